"""The check's exchange: what every rank contributes, reduced across the group into one `Summary` (DDP) or one
`ShardedReduced` (FSDP2, `replicate`).

Every rank runs the same protocol, a generator that yields collectives (``("sum" | "max", tensor)``) and receives
their results: `protocol` for a DDP model, whose rounds each have their own module (the table in `protocol.py`), and
`sharded_protocol.sharded_protocol` for a sharded one (its table is in that module); the epoch end's rounds
(`following_rounds.py`), a run without a wrapper's (`unwrapped.py`), and the control rounds, one flag each, that
launch drives where the ranks must all go the same way (`control.py`). Two drivers run either:
`drive.drive` over a real process group (one rank per process; `runner.exchange` for DDP's), and `simulate.lockstep`,
which runs every rank's generator in one process and computes each collective's result as the reduction would
(`summarize`, `ddp_doctor.doctor.pipeline.analyze(info, records)`, the scale benchmark and the tests up to 1,024
ranks use it). Both drivers therefore run the same packing and the same local computations. The small rounds that
name ranks (`oddranks.py`) and the min/max (`primitives.minmax_rounds`) are written once, as rounds, and driven
over a group for guard, refreeze and the header checks. The `Summary` is core's
(`ddp_doctor.core.summary`): the analysis reads it without importing the exchange.

Why the volume does not grow with the world size W: the exchange is made of reductions, never gathers.
- Boolean masks travel as bit fields of ``W.bit_length()`` bits, summed: each field is the count of ranks that
  set the bit (so OR is ``count > 0`` and AND is ``count == W``).
- Fingerprints travel as 64-bit digests (per parameter over the steps, per step over the parameters); their MIN and
  MAX over the ranks (one all_reduce(MAX) of ``[x, ~x]``) tell where they differ.
- Ranks are named only where a round shows a difference, by predicates each rank evaluates on the reduced results:
  a count and up to `SLOTS` example ranks per predicate (the smallest flagged rank in each class ``rank % SLOTS``).
- Strings (crash messages, call sites, DataLoader facts) travel from at most a bounded set of example ranks.
- Timing medians are exact order statistics, found with a fixed 16-round radix select (4-bit digits) on summed
  histograms.
- The usage map's distinct per-rank patterns are sent once each, by one owner (`patterns.py`); one bit per rank
  says which pattern it has. The divergence curve needs group rank 0's fingerprints of the differing parameters
  only.
- The one exception, on purpose: each rank's step split into phases (`ranktable.py`), `ROW_SIZE` float64 per rank
  (136 bytes), in one SUM where each rank fills its own row; the steps never add to it.
The shapes of every collective depend only on (W, S, P, B) and on earlier collectives' results, which every rank
holds identically: never on local data (docs/architecture.md, "Rules that hold everywhere").
"""

from ddp_doctor.core.summary import EXAMPLES, PREDICATES, Curve, Examples, Summary, Volume
from ddp_doctor.exchange.packing import Reply
from ddp_doctor.exchange.predicates import SLOTS
from ddp_doctor.exchange.protocol import protocol
from ddp_doctor.exchange.simulate import summarize

__all__ = [
    "EXAMPLES",
    "PREDICATES",
    "SLOTS",
    "Curve",
    "Examples",
    "Reply",
    "Summary",
    "Volume",
    "protocol",
    "summarize",
]
