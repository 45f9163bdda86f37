"""What the exchange tells every rank, the analysis's one input: the `Summary`, its bounded rank `Examples`, the
divergence `Curve`, and the `Volume` one rank moved. Built by `ddp_doctor.exchange` (its rounds), read by
`ddp_doctor.analyze`; plain data here, so neither stage needs the other's modules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ddp_doctor.core.codes import Code
from ddp_doctor.core.records import CRASH_KINDS, ModelInfo
from ddp_doctor.core.steptime import StepTimes

__all__ = ["EXAMPLES", "PREDICATES", "Curve", "Examples", "Summary", "Volume"]

EXAMPLES = 8
"""How many example ranks a finding names when more ranks show it (the rest are counted)."""

PREDICATES = (
    "lacking",
    "bypass",
    "grad-differs",
    "weight-differs",
    "no-trainable",
    *(f"crash:{k}" for k in CRASH_KINDS[1:]),
    "crashed",
    "hidden-outside",
    "hidden-reentrant",
    "extra-passes",
    "fewer-passes",
    "fewest-batches",
    "sampler-apart",
    "bypass-sites",
    "blocked-sites",
    "unpaired-extra",
    "unpaired-fewer",
    "broadcast-extra",
    "broadcast-fewer",
    "collective-differs",
    "scale-differs",
    Code.OPTIMIZER_DIFFERS,  # the one predicate named by the code of the finding it decides
    "skipped-step",
    "changed-outside",
    "rereduced",
    "scheduler-extra",
    "same-path-save",
    "crash-after-pass",
    "grads-edited",
    "state-differs",
    "unregistered",
    "drew-more",
    "inputs-nonfinite",
)
"""What each rank evaluates on its own record against the group's results (the exchange's round D); the analysis
reads the ranks for each by name in `Summary.examples`."""


@dataclass(frozen=True, slots=True)
class Examples:
    """The ranks (within the group) that satisfied one predicate: a count and up to `EXAMPLES` of them."""

    count: int
    ranks: list[int]

    @property
    def more(self) -> int:
        return self.count - len(self.ranks)


@dataclass(kw_only=True)
class Summary:
    """What the exchange tells every rank, identically. W ranks, S common steps, P params, B buffers.

    Counts are "how many ranks"; masks over ranks are derived from them (any: > 0, all: == W).
    """

    info: ModelInfo
    world: int
    steps: int
    """Steps every rank completed (the leading complete steps, minimum over the ranks)."""
    pad_steps: int
    """The most steps any rank recorded."""
    used: torch.Tensor
    """int64[S, P]: ranks on which the parameter got a gradient in the step."""
    trainable: torch.Tensor
    """int64[S, P]: ranks on which it required grad at the end of the step."""
    ran: torch.Tensor
    """bool[P]: its module ran on some rank in some common step."""
    partial: torch.Tensor
    """bool[P]: used or reachable on some rank in the step a crash interrupted."""
    varies: torch.Tensor
    """bool[P]: on some rank, used in some common steps and not in others."""
    after_crash: torch.Tensor
    """bool[P]: on some rank, used in the interrupted step but not in every common step."""
    bypass_used: torch.Tensor
    """bool[P]: used in a step that ran the wrapped module without DDP's forward."""
    bypass_steps: torch.Tensor
    """bool[pad_steps]: steps with such a bypass on some rank."""
    no_trainable_steps: torch.Tensor
    """bool[S]: steps in which some rank had no parameter requiring grad."""
    reduction_missing: torch.Tensor
    """bool[P]: tracked params without a gradient in the last complete step of a rank that hit the reduction error."""
    rank0_trainable: torch.Tensor
    """bool[P]: group rank 0's requires_grad at the end of the last common step."""
    tracked: torch.Tensor
    """bool[P]: the parameters DDP's reducer reduces (trainable at wrap, minus any inferred unfrozen)."""
    crash_steps: torch.Tensor
    """bool[len(CRASH_KINDS), pad_steps + 2]: index ``crash_step + 1`` for each crash kind seen."""
    hidden: torch.Tensor
    """bool[2, P]: got a gradient outside the graph of DDP's outputs (0: used outside forward, 1: under a reentrant
    checkpoint), including parameters DDP named in a 'mark a variable ready only once' error."""
    hidden_steps: torch.Tensor
    """bool[2, pad_steps]."""
    hidden_crashed: list[int]
    """[2]: ranks whose 'mark a variable ready only once' crash is attributed to each kind."""
    grad_params: torch.Tensor
    """bool[P]: gradients differ across ranks at the optimizer step, in some common step where every rank trains
    the param (`RankRecord.grad_fp`)."""
    grad_steps: torch.Tensor
    """bool[S]: steps with such a difference."""
    edited_params: torch.Tensor
    """bool[P]: those of `grad_params` whose gradients agreed across ranks when the synced backward ended (after
    DDP's all-reduce) in every common step: something changed them on some ranks after DDP reduced them."""
    edited_steps: torch.Tensor
    """bool[S]: steps in which some rank changed one of `edited_params` between its synced backward and the step."""
    grads_measured: dict[str, int]
    """Group rank 0's common steps by where the gradients the optimizer used were fingerprinted: `step` (when
    optimizer.step() began), `closure` (when it returned: a closure ran the backward inside it), `backward` (after
    the synced backward: no optimizer step)."""
    unsynced: torch.Tensor
    """bool[P]: gradients differ across ranks in some common step (no mask; for inferring the wrap state)."""
    weight_params: torch.Tensor
    """bool[P]: weights differ across ranks before or after some common step."""
    weight_steps: torch.Tensor
    """bool[S + 1]: over the non-ignored parameters."""
    weight_gap: float
    """Largest |weight fingerprint - group rank 0's| over the differing parameters (0 when none differ)."""
    buffer_seen: torch.Tensor
    """bool[S, B]: every rank recorded the buffer's fingerprint."""
    buffer_differs: torch.Tensor
    """bool[S, B]."""
    input_present: torch.Tensor
    """bool[S]: every rank saw a nonzero input fingerprint."""
    input_differs: torch.Tensor
    """bool[S]."""
    windows: int
    """Optimizer steps every rank closed (see `windows`)."""
    window_passes: tuple[list[int], list[int]]
    """(max, min) over the ranks of synced backward passes in each of the first `windows` optimizer steps."""
    loader_ranks: int
    """Ranks that iterated a DataLoader with a length."""
    batches: tuple[int, int]
    """(max, min) batches per epoch over those ranks."""
    padded: int
    """The most padded samples any rank's sampler added."""
    first_batches: list[int]
    """Batches per epoch of group ranks 0.. min(W, 8) - 1 (-1: unknown)."""
    steps_taken: tuple[list[int], list[int]]
    """(max, min) over the ranks of `optimizer.step()` calls in each common step (0 or 1)."""
    synced: tuple[list[int], list[int]]
    """(max, min) of synced backward passes in each common step: the steps are aligned by these, what the ranks do
    in lockstep, never by each rank's own count of optimizer steps."""
    optimizer_differs: int | None
    """The first common step that every rank took with `optimizer.step()` and whose optimizer settings differ."""
    scheduler_steps: tuple[list[int], list[int]]
    """(max, min) of LR scheduler `step()` calls on the observed optimizer in each common step."""
    changed: tuple[list[int], list[int]]
    """(max, min) over the ranks of 1 when parameters changed outside the optimizer before the step's forward."""
    rereduced: tuple[list[int], list[int]]
    """(max, min) of the script's collectives on already reduced gradients in each common step."""
    split_passes: list[int] = field(default_factory=list)
    """Per common step, 1 where some rank's backward passes through one DDP forward used different parameters."""
    inner_passes: list[int] = field(default_factory=list)
    """Per common step, 1 where some rank ran its backward passes inside DDP's forward (Lightning's manual
    optimization: Lightning prepares DDP's reduction from each pass's loss)."""
    examples: dict[str, Examples]
    """Per predicate (`PREDICATES`)."""
    metas: dict[int, dict[str, Any]]
    """Group rank -> its strings: crash, call sites, loaders (group rank 0 and the example ranks that need them)."""
    timing: list[float | None]
    """Medians over every rank's common steps: forward, backward, optimizer, and their sum (None: no step)."""
    step_times: StepTimes
    """The ranks' step phases: a few ranks whole, and what the step-time rules need over every rank."""
    unpaired: tuple[list[int], list[int]]
    """(max, min) over the ranks of DDP forwards in grad mode without a backward, per common step."""
    broadcasts: tuple[torch.Tensor, torch.Tensor]
    """(max, min) over the ranks of int64[S, 2]: DDP's buffer broadcasts per common step, all of them and those of
    forwards without grad (`StepCounters.ddp_broadcasts`, `eval_broadcasts`)."""
    collectives: tuple[torch.Tensor, torch.Tensor]
    """(max, min) over the ranks of int64[S, 2]: the script's own collectives per step, count and running digest."""
    collectives0: torch.Tensor
    """int64[S, 2]: group rank 0's."""
    scales: tuple[list[int], list[int]]
    """(max, min) of GradScaler's scale at each step's scaler.step() (float32 bits; 0: no scaler.step())."""
    scales0: list[int]
    """Group rank 0's."""
    batchnorm_training: torch.Tensor
    """bool[S]: some rank had BatchNorm layers in training mode in the step's first forward."""
    batch_sizes: tuple[int, int] | None
    """(largest, smallest) nonzero first-input batch size over every rank and common step (None: none seen)."""
    patterns: list[tuple[torch.Tensor, list[int]]]
    """The distinct usage-map grids (int64[R, S] of `STATES` indices) and the group ranks that have each, group
    rank 0's first; at most `MAX_PATTERNS`."""
    patterns_omitted: list[int]
    """Group ranks whose grid was not among those found."""
    curve: Curve
    """The divergence curve's data."""
    volume: Volume | None = None
    state_step: int | None = None
    """The first common step at which the module trees held different modes or parameters DDP does not hold
    (`StepCounters.state_digest`; None: the same on every rank at every step)."""
    unregistered: list[int] = field(default_factory=list)
    """Per common step, the most trainable parameters DDP's reducer does not hold that any rank's tree had."""
    moves: tuple[torch.Tensor, torch.Tensor] | None = None
    """(max, min) over the ranks of int64[S, 6]: per common step, the parameters that got a gradient, whose gradient
    was exactly zero, or not finite; whose weights changed in the step, or are not finite after it; the training
    inputs that held NaN or infinity (None: not recorded)."""
    nonfinite_before: int = 0
    """The most parameters any rank held with a NaN or an infinity before the first common step."""
    drawn: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    """(max, min) over the ranks of the batches the training loader handed out for each common step."""
    drawn_step: int | None = None
    """The first common step every rank took whose ranks drew different numbers of batches for it."""
    sampler_compared: bool = False
    """Some rank's training loader has a DistributedSampler, or a sampler over a dataset whose digest is known: the
    ranks' shares of the data were compared (`shards-overlap`)."""
    wrap_trainable: torch.Tensor | None = None
    """int64[P, 3] when the ranks handed DDP different trainable sets (None: the same on every rank): per
    parameter, how many ranks had it trainable at the wrap, the lowest rank that had it trainable and the lowest
    that had it frozen (-1: none)."""


@dataclass(kw_only=True, slots=True)
class Curve:
    """Per step, the largest |fingerprint(rank r) - fingerprint(rank 0)| over parameters, ranks and both numbers."""

    weights: list[float]
    """S + 1 values: before the first common step, then after each."""
    grads: list[float]
    """S values, over the parameters every rank trains in the step."""
    weights_missing: list[bool]
    """S + 1: some parameter's weight fingerprint is NaN on some ranks only."""
    grads_missing: list[int]
    """S: how many such parameters' gradient fingerprints are NaN on some ranks only (a gradient absent there)."""


@dataclass
class Volume:
    """Bytes one rank hands to and gets back from the exchange's collectives (logical payload; a ring all_reduce
    moves about twice that on the wire)."""

    sent: int = 0
    received: int = 0
    collectives: int = 0
    rounds: list[str] = field(default_factory=list)

    def add(self, op: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        self.sent += n
        self.received += n
        self.collectives += 1
        self.rounds.append(f"{op}:{n}")
