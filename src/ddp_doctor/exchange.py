"""The check's exchange: what every rank contributes, reduced across the DDP group into one `Summary`.

Every rank runs the same `protocol`, a generator that yields collectives (``("sum" | "max", int64 tensor)``) and
receives their results. Two drivers run it: `gather.exchange` over a real process group (one rank per process),
and `summarize` here, which runs every rank's generator in lockstep in one process and computes each collective's
result as the reduction would (the pure `analyze(info, records)` entry point and the scale benchmark use it). Both
drivers therefore run the same packing and the same local computations.

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
The shapes of every collective depend only on (W, S, P, B) and on earlier collectives' results, which every rank
holds identically: never on local data (DESIGN §3).
"""

from __future__ import annotations

import gc
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ddp_doctor.records import CRASH_KINDS, ModelInfo, RankRecord

__all__ = ["EXAMPLES", "PREDICATES", "SLOTS", "Examples", "Reply", "Summary", "Volume", "protocol", "summarize"]

EXAMPLES = 8
"""How many example ranks a finding names when more ranks show it (the rest are counted)."""
SLOTS = 64
"""Example slots per predicate: the smallest flagged rank of each class ``rank % SLOTS``. Exact for W <= SLOTS."""

_MIN = -(2**63)
_M1 = -7046029254386353131      # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687      # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685      # 0x94D049BB133111EB
_NAN_BITS = 0x7FF8000000000000

Op = tuple[str, torch.Tensor]
"""A collective request: ``("sum" | "max", int64 tensor)``; the answer is a `Reply`."""


class Reply:
    """A collective's result. The in-process driver hands the same `Reply` to every rank, so what the ranks decode
    from it is decoded once and shared (read-only): the model of W ranks then needs memory for one decoded result,
    not W."""

    __slots__ = ("cache", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.cache: dict[Any, Any] = {}

# Predicates: each rank says yes or no after the first rounds; the exchange counts the yeses and names examples.
PREDICATES = ("lacking", "bypass", "grad-differs", "weight-differs", "no-trainable",
              *(f"crash:{k}" for k in CRASH_KINDS[1:]), "crashed", "hidden-outside", "hidden-reentrant",
              "extra-passes", "fewer-passes", "fewest-batches", "bypass-sites", "blocked-sites")


# ------------------------------------------------------------------------------------------------ digests


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit finalizer (splitmix64, with arithmetic shifts): int64 in, well-mixed int64 out (wraps)."""
    x = x ^ (x >> 31)
    x = x * _M1
    x = x ^ (x >> 29)
    x = x * _M2
    return x ^ (x >> 32)


def _bits(fp: torch.Tensor) -> torch.Tensor:
    """float64 -> int64 bit patterns with ``==`` semantics plus NaN == NaN: -0.0 is 0.0 and every NaN is one NaN."""
    x = fp.to(torch.float64).contiguous()
    bits = torch.where(x == 0, torch.zeros((), dtype=torch.float64), x).view(torch.int64)
    return torch.where(x.isnan(), torch.full((), _NAN_BITS, dtype=torch.int64), bits)


def element_hashes(fp: torch.Tensor) -> torch.Tensor:
    """int64 hash of each value of `fp` ([S, N, 2] or [S, 2]) keyed by its position: sums over any subset of
    positions are digests of that subset."""
    flat = _bits(fp).reshape(-1)
    pos = torch.arange(flat.numel(), dtype=torch.int64)
    return _mix(flat ^ _mix(pos * _M3 + 1)).reshape(fp.shape)


_memo: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, Any]] | None = None
"""Set by `summarize` only: in the in-process model, ranks that share a record tensor hash it once."""


def _of_record(record: RankRecord, name: str, n: int, compute: Callable[[torch.Tensor], Any]) -> Any:
    """`compute(getattr(record, name)[:n])`, remembered for the last few tensors while the model runs."""
    t = getattr(record, name)
    if _memo is None:
        return compute(t[:n])
    key = (id(t), t._version, name, n, compute)
    hit = _memo.get(key)
    if hit is None or hit[0] is not t:
        hit = (t, compute(t[:n]))
        _memo[key] = hit
        while len(_memo) > 16:
            _memo.popitem(last=False)
    return hit[1]


def _hash_steps(fp: torch.Tensor) -> torch.Tensor:
    return element_hashes(fp).sum(-1)


def _key(x: torch.Tensor) -> torch.Tensor:
    """float64 -> int64 whose signed order is the float order (NaN mapped above +inf)."""
    bits = x.to(torch.float64).contiguous().view(torch.int64)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFFFFFFFFFF)
    return torch.where(x.isnan(), torch.full((), 2**63 - 1, dtype=torch.int64), key)


def _unkey(k: int) -> float:
    bits = k if k >= 0 else k ^ 0x7FFFFFFFFFFFFFFF
    return float(torch.tensor([bits], dtype=torch.int64).view(torch.float64)[0])


# ------------------------------------------------------------------------------------------------ buffers


def _bool_digest(t: torch.Tensor) -> int:
    """A 64-bit digest of a bool tensor (its bits packed 63 to a word, then hashed with their positions)."""
    flat = t.reshape(-1).to(torch.int64)
    words = -(-flat.numel() // 63)
    x = torch.zeros(words * 63, dtype=torch.int64)
    x[: flat.numel()] = flat
    packed = (x.view(words, 63) << torch.arange(63, dtype=torch.int64)).sum(1)
    pos = torch.arange(words, dtype=torch.int64)
    return int(_mix(packed ^ _mix(pos * _M3 + flat.numel())).sum())


class _Sum:
    """Sections of one all_reduce(SUM) of int64: bit fields (counts of ranks) and plain integers.

    A bits section is packed ``63 // width`` fields to a word, ``width = W.bit_length()`` bits each, so the sum of
    the ranks' words holds each field's count without carries. With `settle`, a section that a preceding MAX
    showed identical on every rank (`digests`) is not sent at all: its counts are W times the local bits.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.width = max(1, world.bit_length())
        self.sections: list[tuple[str, str, torch.Tensor]] = []
        self.uniform: dict[str, bool] = {}
        self.known: dict[str, int] = {}

    def bits(self, name: str, t: torch.Tensor, digest: int | None = None) -> None:
        self.sections.append((name, "bits", t.bool()))
        if digest is not None:
            self.known[name] = digest

    def ints(self, name: str, t: torch.Tensor) -> None:
        self.sections.append((name, "ints", t.to(torch.int64)))

    def counts(self, name: str, t: torch.Tensor, limit: int) -> None:
        """Non-negative integers whose sum over the ranks stays at most `limit`, packed in fields that hold it."""
        self.sections.append((name, f"counts:{max(1, limit.bit_length())}", t.to(torch.int64)))

    def digests(self) -> torch.Tensor:
        """One digest per bits section, for a MAX pair that tells which sections are identical on every rank."""
        return torch.tensor([self.known[n] if n in self.known else _bool_digest(t)
                             for n, kind, t in self.sections if kind == "bits"], dtype=torch.int64)

    def settle(self, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        names = [name for name, kind, _ in self.sections if kind == "bits"]
        self.uniform = {n: bool(h == lo) for n, h, lo in zip(names, pair[0].tolist(), pair[1].tolist())}

    def _width(self, kind: str) -> int:
        return int(kind.split(":")[1]) if kind.startswith("counts:") else self.width

    def _pack(self, t: torch.Tensor, width: int) -> torch.Tensor:
        flat = t.reshape(-1).to(torch.int64)
        f = 63 // width
        words = -(-flat.numel() // f)
        x = torch.zeros(words * f, dtype=torch.int64)
        x[: flat.numel()] = flat
        shifts = torch.arange(f, dtype=torch.int64) * width
        return (x.view(words, f) << shifts).sum(1)

    def tensor(self) -> torch.Tensor:
        """The buffer to reduce: the sections that differ somewhere, packed."""
        parts = [t.reshape(-1) if kind == "ints" else self._pack(t, self._width(kind))
                 for name, kind, t in self.sections if not self.uniform.get(name)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def read(self, reply: Reply) -> dict[str, torch.Tensor]:
        key = ("sum", self.width, tuple((n, k, tuple(t.shape), self.uniform.get(n)) for n, k, t in self.sections))
        if key not in reply.cache:
            reply.cache[key] = self._decode(reply.tensor)
        self.sections = []        # nothing held after the round
        return reply.cache[key]

    def _decode(self, result: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, kind, t in self.sections:
            if self.uniform.get(name):
                out[name] = t.to(torch.int64) * self.world
                continue
            numel = t.numel()
            if kind == "ints":
                out[name] = result[offset: offset + numel].reshape(t.shape)
                offset += numel
                continue
            width = self._width(kind)
            per_word = 63 // width
            n = -(-numel // per_word)
            chunk = result[offset: offset + n]
            offset += n
            shifts = torch.arange(per_word, dtype=torch.int64) * width
            counts = ((chunk.unsqueeze(1) >> shifts) & ((1 << width) - 1)).reshape(-1)
            out[name] = counts[:numel].reshape(t.shape)
        return out


class _Max:
    """Sections of one all_reduce(MAX) of int64: (max, min) pairs as ``[x, ~x]``, and owner slots."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.layout: list[tuple[str, str, tuple[int, ...], int]] = []

    def pair(self, name: str, t: torch.Tensor, present: bool | torch.Tensor = True) -> None:
        """MAX and MIN of int64 `t` over the ranks; entries where `present` is False take no part."""
        flat = t.reshape(-1).to(torch.int64)
        keep = torch.as_tensor(present).reshape(-1).expand(flat.shape) if not isinstance(present, bool) else None
        hi, lo = flat, ~flat
        if keep is not None or present is False:
            mask = keep if keep is not None else torch.zeros(flat.shape, dtype=torch.bool)
            hi = torch.where(mask, hi, _MIN)
            lo = torch.where(mask, lo, _MIN)
        self.parts.append(torch.cat([hi, lo]))
        self.layout.append((name, "pair", tuple(t.shape), 2 * flat.numel()))

    def slot(self, name: str, t: torch.Tensor, owner: bool | torch.Tensor) -> None:
        """The value of the rank(s) where `owner` is True (the largest, when several own an entry)."""
        flat = t.reshape(-1).to(torch.int64)
        own = torch.as_tensor(owner).reshape(-1).expand(flat.shape)
        self.parts.append(torch.where(own, flat, _MIN))
        self.layout.append((name, "slot", tuple(t.shape), flat.numel()))

    def tensor(self) -> torch.Tensor:
        """The buffer to reduce (the parts are released: a waiting rank holds nothing of it)."""
        out = torch.cat(self.parts) if self.parts else torch.zeros(0, dtype=torch.int64)
        self.parts = []
        return out

    def read(self, reply: Reply) -> dict[str, Any]:
        key = ("max", tuple(self.layout))
        if key not in reply.cache:
            reply.cache[key] = self._decode(reply.tensor)
        return dict(reply.cache[key])

    def _decode(self, result: torch.Tensor) -> dict[str, Any]:
        out: dict[str, Any] = {}
        offset = 0
        for name, kind, shape, n in self.layout:
            chunk = result[offset: offset + n]
            offset += n
            if kind == "pair":
                half = n // 2
                out[name] = (chunk[:half].reshape(shape), (~chunk[half:]).reshape(shape))
            else:
                out[name] = chunk.reshape(shape)
        return out


def _differs(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return pair[0] != pair[1]


# ------------------------------------------------------------------------------------------------ the result


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
    """bool[P]: gradients differ across ranks in some common step where every rank trains the param."""
    grad_steps: torch.Tensor
    """bool[S]: steps with such a difference."""
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
    examples: dict[str, Examples]
    """Per predicate (`PREDICATES`)."""
    metas: dict[int, dict[str, Any]]
    """Group rank -> its strings: crash, call sites, loaders (group rank 0 and the example ranks that need them)."""
    timing: list[float | None]
    """Medians over every rank's common steps: forward, backward, optimizer, and their sum (None: no step)."""
    volume: Volume | None = None


@dataclass
class Volume:
    """Bytes one rank hands to and gets back from the exchange's collectives (logical payload; a ring all_reduce
    moves about twice that on the wire)."""

    sent: int = 0
    received: int = 0
    collectives: int = 0
    rounds: list[str] = field(default_factory=list)

    def add(self, op: str, t: torch.Tensor, world: int) -> None:
        n = t.numel() * t.element_size()
        self.sent += n
        self.received += n
        self.collectives += 1
        self.rounds.append(f"{op}:{n}")


# ------------------------------------------------------------------------------------------------ local facts


def _leading_complete(record: RankRecord) -> int:
    complete = record.counter("complete").bool().tolist()
    return next((i for i, c in enumerate(complete) if not c), len(complete))


def windows(record: RankRecord) -> list[tuple[int, list[int]]]:
    """Per optimizer step: (synced backward passes, the record's step indices in it). Steps are closed by
    optimizer.step() or, when a synced backward was not followed by one, by the next forward."""
    out, count, idx = [], 0, []
    synced, stepped = record.counter("synced_backwards").tolist(), record.counter("optimizer_step").tolist()
    for s, (n, opt) in enumerate(zip(synced, stepped)):
        count, idx = count + n, [*idx, s]
        if opt:
            out.append((count, idx))
            count, idx = 0, []
    return out


def _training_loader(record: RankRecord) -> dict[str, Any] | None:
    """The first loader the rank iterated while observed that has a length (the training loop's, in practice)."""
    return next((d for d in record.loaders if d.get("batches") is not None), None)


def names_in_message(info: ModelInfo, text: str) -> list[int]:
    """Indices of parameters DDP named in an error message ("... with name head_b.bias has been marked ...")."""
    index = {n: i for i, n in enumerate(info.param_names)}
    return [index[m] for m in re.findall(r"with name (\S+)", text) if m in index]


def _text_digest(value: Any) -> int:
    """A 64-bit digest of a JSON-able value (or of bytes)."""
    data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()
    words = _words(data, -(-len(data) // 8) + 1)
    pos = torch.arange(words.numel(), dtype=torch.int64)
    return int(_mix(words ^ _mix(pos * _M3 + len(data))).sum())


def _words(data: bytes, n_words: int) -> torch.Tensor:
    padded = bytearray(data + b"\0" * (n_words * 8 - len(data)))
    return torch.frombuffer(padded, dtype=torch.int64).clone() if n_words else torch.zeros(0, dtype=torch.int64)


def _from_words(words: torch.Tensor, n: int) -> bytes:
    return words.contiguous().numpy().tobytes()[:n]


_last_info: list[Any] = [None, b"", 0]


def _info_json(info: ModelInfo) -> tuple[bytes, int]:
    """The ModelInfo as JSON and its digest. The in-process model hands one ModelInfo to every rank: the last one
    is remembered (the ranks of a real group each compute theirs once)."""
    if _last_info[0] is not info:
        data = json.dumps(info.to_dict(), sort_keys=True).encode()
        _last_info[:] = [info, data, _text_digest(data)]
    return _last_info[1], _last_info[2]


def _examples(counts: torch.Tensor, slots: torch.Tensor) -> dict[str, Examples]:
    out = {}
    for k, name in enumerate(PREDICATES):
        found = sorted(-int(v) for v in slots[k].tolist() if v != _MIN)
        out[name] = Examples(count=int(counts[k]), ranks=found[:EXAMPLES])
    return out


# ------------------------------------------------------------------------------------------------ the protocol


def protocol(record: RankRecord, info: ModelInfo, *, rank: int,
             world: int) -> Generator[Op, Reply, Summary]:
    """One rank's side of the exchange (group ranks). Yields collectives, returns the `Summary`."""
    n_params = record.used.shape[1]
    lead = _leading_complete(record)
    info_json, info_digest = _info_json(info)

    # Round A: the common and padded step counts, and whether every rank holds the same ModelInfo.
    a = _Max()
    a.pair("steps", torch.tensor([record.steps, lead]))
    a.pair("info", torch.tensor([info_digest]))
    a.slot("info_len", torch.tensor([len(info_json)]), rank == 0)
    ra = a.read((yield ("max", a.tensor())))
    pad_steps, s = int(ra["steps"][0][0]), int(ra["steps"][1][1])
    if bool(_differs(ra["info"]).any()):
        # Group rank 0's ModelInfo speaks for the group (names and shapes already agree: they are in the layout
        # hash, checked before); it travels once, from rank 0 only.
        n = int(ra["info_len"][0])
        words = _words(info_json if rank == 0 else b"", -(-n // 8))
        got = yield ("sum", words if rank == 0 else torch.zeros_like(words))
        info = ModelInfo.from_dict(json.loads(_from_words(got.tensor, n).decode()))
    tracked = torch.tensor(info.trainable_at_wrap, dtype=torch.bool)
    ignored = torch.tensor(info.ignored, dtype=torch.bool)

    used = record.used[:s]
    trainable = record.trainable[:s]
    partial = torch.zeros(n_params, dtype=torch.bool)
    if lead < record.steps:
        partial = record.used[lead] | record.reachable[lead]

    def grad_hashes() -> torch.Tensor:
        """int64[S, P]: each gradient fingerprint's hash (recomputed where needed rather than held while waiting)."""
        return _of_record(record, "grad_fp", s, _hash_steps)

    # Round B: every local fact that needs only the common step count.
    b = _Sum(world)
    b.bits("used", used, _of_record(record, "used", s, _bool_digest))
    b.bits("trainable", trainable, _of_record(record, "trainable", s, _bool_digest))
    b.bits("ran", record.ran[:s].any(0) if s else torch.zeros(n_params, dtype=torch.bool))
    b.bits("partial", partial)
    b.bits("varies", used.any(0) != used.all(0) if s >= 2 else torch.zeros(n_params, dtype=torch.bool))
    b.bits("after_crash", partial & ~used.all(0) if s >= 1 else torch.zeros(n_params, dtype=torch.bool))
    forwards, bypasses = record.counter("ddp_forwards"), record.counter("bypass_forwards")
    hits = ((bypasses > 0) & (forwards == 0)).nonzero().flatten().tolist()
    bypass_used = torch.zeros(n_params, dtype=torch.bool)
    for step in hits:
        bypass_used |= record.used[step]
    hit_steps = torch.zeros(pad_steps, dtype=torch.bool)
    hit_steps[hits] = True
    b.bits("bypass_used", bypass_used)
    b.bits("bypass_steps", hit_steps)
    empty = torch.zeros(pad_steps, dtype=torch.bool)
    if s:
        empty[:s] = ~trainable.any(-1)
    b.bits("empty", empty)
    missing = torch.zeros(n_params, dtype=torch.bool)
    if CRASH_KINDS[record.crash_kind] == "reduction-error" and lead:
        missing = ~record.used[lead - 1]
    b.bits("missing", missing)
    b.bits("rank0_trainable", trainable[-1] if rank == 0 and s else torch.zeros(n_params, dtype=torch.bool))
    crash_steps = torch.zeros(len(CRASH_KINDS), pad_steps + 2, dtype=torch.bool)
    if record.crash_kind:
        crash_steps[record.crash_kind, min(max(record.crash_step + 1, 0), pad_steps + 1)] = True
    b.bits("crash_steps", crash_steps)
    b.bits("buffer_nan", record.buffer_fp[:s].isnan().all(-1))
    b.bits("input", (record.input_fp[:s] != 0).any(-1))
    loader = _training_loader(record)
    b.ints("loader", torch.tensor([int(loader is not None)]))

    m = _Max()
    m.pair("sections", b.digests())
    mask = trainable & ~ignored
    grad_h = grad_hashes()
    m.pair("grad_p", (grad_h * mask).sum(0))
    m.pair("grad_s", (grad_h * mask).sum(1))
    infer = (not info.wrap_state_exact and info.wrap_trainable_count is not None and world >= 2 and s > 0)
    if infer:
        m.pair("unsynced", grad_h.sum(0))
    weight_h = _of_record(record, "weight_fp", s + 1, _hash_steps)
    m.pair("weight_p", weight_h.sum(0))
    m.pair("weight_s", (weight_h * ~ignored).sum(1))
    del grad_h, weight_h, mask
    m.pair("buffer", _of_record(record, "buffer_fp", s, _hash_steps))
    m.pair("input", _of_record(record, "input_fp", s, _hash_steps))
    wins = windows(record)
    counts = torch.full((pad_steps,), 0, dtype=torch.int64)
    counts[: len(wins)] = torch.tensor([c for c, _ in wins], dtype=torch.int64)
    present = torch.arange(pad_steps) < len(wins)
    m.pair("windows", counts, present)
    m.pair("n_windows", torch.tensor([len(wins)]))
    batches = int(loader["batches"]) if loader is not None else 0
    m.pair("batches", torch.tensor([batches]), loader is not None)
    m.slot("padded", torch.tensor([int(loader.get("padded") or 0) if loader is not None else 0]),
           loader is not None)
    first = torch.full((min(world, 8),), -1, dtype=torch.int64)
    if rank < len(first):
        first[rank] = batches if loader is not None else -1
    m.slot("first_batches", first, torch.arange(len(first)) == rank)
    sites = [_text_digest(sorted(set(record.bypass_sites))), _text_digest(sorted(set(record.blocked_checkpoints)))]
    m.slot("sites0", torch.tensor(sites), rank == 0)
    rm = m.read((yield ("max", m.tensor())))
    del m
    b.settle(rm["sections"])
    rb = b.read((yield ("sum", b.tensor())))
    del b

    # Round B2, only when some parameter's requires_grad differs across ranks in some step: the gradient digests
    # again, masked by the parameters every rank trains (the mask round B could not know yet).
    train_all = rb["trainable"] == world
    uniform = bool(((rb["trainable"] == 0) | train_all).all())
    if not uniform:
        b2 = _Max()
        mask = train_all & ~ignored
        grad_h = grad_hashes()
        b2.pair("grad_p", (grad_h * mask).sum(0))
        b2.pair("grad_s", (grad_h * mask).sum(1))
        del grad_h, mask
        r2 = b2.read((yield ("max", b2.tensor())))
        rm["grad_p"], rm["grad_s"] = r2["grad_p"], r2["grad_s"]

    # What the group knows now.
    unsynced = _differs(rm["unsynced"]) if infer else torch.zeros(n_params, dtype=torch.bool)
    if infer:
        extra = int(tracked.sum()) - int(info.wrap_trainable_count or 0)
        if extra > 0 and int((unsynced & tracked).sum()) == extra:
            tracked = tracked & ~unsynced
    grad_params = _differs(rm["grad_p"]) & ~ignored if world >= 2 else torch.zeros(n_params, dtype=torch.bool)
    weight_params = _differs(rm["weight_p"]) & ~ignored if world >= 2 else torch.zeros(n_params, dtype=torch.bool)
    used_count = rb["used"]
    used_any, used_all = used_count > 0, used_count == world
    live = tracked & ~((rb["trainable"] < world).any(0) if s else torch.zeros_like(tracked))
    rank_dep = live & (used_any != used_all).any(0) if s else torch.zeros_like(live)
    del used_any, used_all, train_all
    n_wins = int(rm["n_windows"][1][0])
    w_hi, w_lo = rm["windows"]
    bad = [k for k in range(n_wins) if int(w_hi[k]) != int(w_lo[k])]
    b_hi, b_lo = (int(v[0]) for v in rm["batches"])
    all_loaders = int(rb["loader"][0]) == world

    # Round C, only when gradients or weights differ: digests of each rank's differing slice against rank 0's
    # (to name the ranks), and rank 0's weights there (for the largest difference).
    g_ref = w_ref = 0
    g_mine = w_mine = 0
    w_nan = False
    gap_local = 0.0
    w_nan0 = False
    if bool(grad_params.any() or weight_params.any()):
        c = _Max()
        g_mine = int(grad_hashes()[:, grad_params].sum()) if s else 0
        w_slice = record.weight_fp[: s + 1][:, weight_params]
        w_mine = int(element_hashes(w_slice).sum()) if w_slice.numel() else 0
        w_nan = bool(w_slice.isnan().any())
        c.slot("ref", torch.tensor([g_mine, w_mine, int(w_nan)]), rank == 0)
        rc = c.read((yield ("max", c.tensor())))
        g_ref, w_ref, w_nan0 = int(rc["ref"][0]), int(rc["ref"][1]), bool(rc["ref"][2])
        x = w_slice[..., 0]
        x0_words = _words(x.contiguous().numpy().tobytes() if rank == 0 else b"", x.numel())
        got = yield ("sum", x0_words if rank == 0 else torch.zeros_like(x0_words))
        x0 = got.tensor.view(torch.float64).reshape(x.shape)
        if x.numel():
            gap_local = float((x - x0).abs().nan_to_num(0).max())

    # Round D: the predicates, plus what needs the inferred `tracked` (hidden parameters).
    checkpoints = record.counter("reentrant_checkpoints")
    hidden = torch.zeros(2, n_params, dtype=torch.bool)
    hidden_steps = torch.zeros(2, pad_steps, dtype=torch.bool)
    hidden_rank = [False, False]
    hidden_crash = [0, 0]
    mark_twice = CRASH_KINDS.index("mark-ready-twice")
    for step in range(record.steps):
        if not forwards[step]:
            continue
        target = 1 if checkpoints[step] else 0
        found = record.used[step] & ~record.reachable[step] & tracked
        named = False
        if record.crash_kind == mark_twice and step == record.crash_step:
            idx = names_in_message(info, record.crash_message)
            found[idx] = True
            named = bool(idx)
            hidden_crash[target] = 1
        if bool(found.any()) or named or checkpoints[step]:
            hidden[target] |= found
            hidden_steps[target, step] = True
            hidden_rank[target] = True
    first_window = bad[0] if bad else None
    my_passes = wins[first_window][0] if first_window is not None else None
    window_sites: list[str] = []
    if first_window is not None and my_passes == int(w_hi[first_window]):
        window_sites = [site.split(": ", 1)[1] for site in record.repeat_sites
                        if int(site.split(":", 1)[0].split()[1]) in wins[first_window][1]]
    lacking = bool(s and rank_dep.any() and (~used[:, rank_dep]).any())
    flags = {
        "lacking": lacking,
        "bypass": bool(hits),
        "grad-differs": bool(rank >= 1 and grad_params.any() and g_mine != g_ref),
        "weight-differs": bool(rank >= 1 and weight_params.any() and (w_mine != w_ref or w_nan or w_nan0)),
        "no-trainable": bool(empty.any()),
        **{f"crash:{k}": record.crash_kind == i for i, k in enumerate(CRASH_KINDS) if i},
        "crashed": bool(record.crash_kind),
        "hidden-outside": hidden_rank[0],
        "hidden-reentrant": hidden_rank[1],
        "extra-passes": first_window is not None and my_passes == int(w_hi[first_window]),
        "fewer-passes": first_window is not None and my_passes != int(w_hi[first_window]),
        "fewest-batches": bool(all_loaders and b_hi != b_lo and loader is not None and batches == b_lo),
        "bypass-sites": sites[0] != int(rm["sites0"][0]),
        "blocked-sites": sites[1] != int(rm["sites0"][1]),
    }
    assert tuple(flags) == PREDICATES
    meta = json.dumps({
        "crash_kind": record.crash_kind, "crash_step": record.crash_step, "crash_message": record.crash_message,
        "bypass_sites": sorted(set(record.bypass_sites)), "blocked_checkpoints": sorted(set(record.blocked_checkpoints)),
        "loaders": record.loaders, "window_sites": window_sites}).encode()
    d = _Sum(world)
    d.ints("counts", torch.tensor([int(v) for v in flags.values()]))
    d.bits("hidden", hidden)
    d.bits("hidden_steps", hidden_steps)
    d.ints("hidden_crash", torch.tensor(hidden_crash))
    dm = _Max()
    me = torch.full((len(PREDICATES), SLOTS), _MIN, dtype=torch.int64)
    for k, v in enumerate(flags.values()):
        if v:
            me[k, rank % SLOTS] = -rank
    dm.slot("slots", me, True)
    dm.pair("meta_len", torch.tensor([len(meta)]))
    dm.pair("gap", _key(torch.tensor([gap_local])))
    rd = d.read((yield ("sum", d.tensor())))
    rdm = dm.read((yield ("max", dm.tensor())))
    examples = _examples(rd["counts"], rdm["slots"])

    # Round E: the strings, from group rank 0 and a bounded set of example ranks.
    wanted = {0}
    for name in ("crashed", "bypass-sites", "blocked-sites", "extra-passes"):
        wanted.update(examples[name].ranks)
    wanted.update(examples["fewest-batches"].ranks[:1])
    chosen = sorted(wanted)          # at most 2 + 4 * EXAMPLES ranks, whatever W
    n_meta = int(rdm["meta_len"][0][0])
    words = -(-n_meta // 8)
    e = torch.zeros(len(chosen), words, dtype=torch.int64)
    if rank in chosen:
        e[chosen.index(rank)] = _words(meta, words)
    got = yield ("sum", e.reshape(-1))
    metas = {}
    for i, r in enumerate(chosen):
        raw = _from_words(got.tensor.reshape(len(chosen), words)[i], n_meta).rstrip(b"\0")
        metas[r] = json.loads(raw.decode())

    # Rounds T: exact medians of the step timings over every rank's common steps (radix select on the keys).
    timing: list[float | None] = [None] * 4
    if s:
        rows = record.timing[:s]
        values = torch.cat([rows, rows.sum(1, keepdim=True)], 1)         # [s, 4]
        keys = _key(values)
        total = world * s
        # The middle element (odd count), or the two middle ones, of each quantity's world * s values.
        targets = [(total - 1) // 2, total // 2] if total % 2 == 0 else [total // 2]
        n_sel = len(targets)
        remaining = [[t] * 4 for t in targets]                            # [selection][quantity]
        prefix: list[list[int | None]] = [[None] * 4 for _ in targets]
        # 16 rounds of 4-bit digits: more (tiny) collectives than 8 rounds of bytes, 8 times fewer counts.
        for level in range(16):
            shift = 60 - 4 * level
            digit = ((keys >> 60) + 8) if level == 0 else ((keys >> shift) & 0xF)
            hist = torch.zeros(n_sel, 4, 16, dtype=torch.int64)
            for j in range(n_sel):
                for q in range(4):
                    sel = torch.ones(s, dtype=torch.bool) if level == 0 else (keys[:, q] >> (shift + 4)) == prefix[j][q]
                    hist[j, q] = torch.bincount(digit[sel, q], minlength=16)
            t = _Sum(world)
            t.counts("hist", hist, total)
            got = t.read((yield ("sum", t.tensor())))["hist"]
            for j in range(n_sel):
                for q in range(4):
                    cum = got[j, q].cumsum(0)
                    bin_ = int((cum <= remaining[j][q]).sum())
                    remaining[j][q] -= int(cum[bin_ - 1]) if bin_ else 0
                    base = prefix[j][q]
                    prefix[j][q] = bin_ - 8 if level == 0 else base * 16 + bin_
        for q in range(4):
            lo, hi = _unkey(prefix[0][q]), _unkey(prefix[-1][q])
            timing[q] = lo if total % 2 else (lo + hi) / 2

    b_nan = rb["buffer_nan"]
    return Summary(
        info=info, world=world, steps=s, pad_steps=pad_steps,
        used=used_count, trainable=rb["trainable"],
        ran=rb["ran"] > 0, partial=rb["partial"] > 0, varies=rb["varies"] > 0, after_crash=rb["after_crash"] > 0,
        bypass_used=rb["bypass_used"] > 0, bypass_steps=rb["bypass_steps"] > 0,
        no_trainable_steps=(rb["empty"] > 0)[:s], reduction_missing=(rb["missing"] > 0) & tracked,
        rank0_trainable=rb["rank0_trainable"] > 0, tracked=tracked, crash_steps=rb["crash_steps"] > 0,
        hidden=rd["hidden"] > 0, hidden_steps=rd["hidden_steps"] > 0,
        hidden_crashed=[int(v) for v in rd["hidden_crash"]],
        grad_params=grad_params, grad_steps=(_differs(rm["grad_s"]) if world >= 2 else
                                             torch.zeros(s, dtype=torch.bool)),
        unsynced=unsynced, weight_params=weight_params,
        weight_steps=_differs(rm["weight_s"]) if world >= 2 else torch.zeros(s + 1, dtype=torch.bool),
        weight_gap=_unkey(int(rdm["gap"][0][0])) if weight_params.any() else 0.0,
        buffer_seen=b_nan == 0, buffer_differs=_differs(rm["buffer"]),
        input_present=rb["input"] == world, input_differs=_differs(rm["input"]),
        windows=n_wins, window_passes=(w_hi[:n_wins].tolist(), w_lo[:n_wins].tolist()),
        loader_ranks=int(rb["loader"][0]), batches=(b_hi, b_lo), padded=int(rm["padded"][0]),
        first_batches=[int(v) for v in rm["first_batches"]],
        examples=examples, metas=metas, timing=timing)


# ------------------------------------------------------------------------------------------------ local driver


def summarize(info: ModelInfo, records: Sequence[RankRecord], *,
              infos: Sequence[ModelInfo] | None = None) -> Summary:
    """Run every rank's `protocol` in lockstep in this process, each collective's result computed as the
    reduction computes it. Pure: no process group. `records[w]` is group rank w's record.

    Ranks are advanced one at a time and their buffers folded into a running SUM or MAX, so the model of W ranks
    holds one buffer, not W (the benchmark runs 1,024 ranks this way). Every collective is checked to have the same
    op and shape on every rank: the invariant that keeps the real exchange from hanging.

    Args:
        info: the model (every rank's, unless `infos` gives one per rank).
        records: one per rank, in group-rank order.
        infos: per-rank `ModelInfo`, when they differ.

    Returns:
        Group rank 0's `Summary` (every rank's is the same), with `volume` counting one rank's bytes.
    """
    # Thousands of suspended generators and their tensors make the cyclic collector rescan them all the time;
    # nothing here builds reference cycles.
    global _memo
    collecting = gc.isenabled()
    gc.disable()
    _memo = OrderedDict()
    try:
        return _run(info, records, infos)
    finally:
        _memo = None
        if collecting:
            gc.enable()


def _run(info: ModelInfo, records: Sequence[RankRecord], infos: Sequence[ModelInfo] | None) -> Summary:
    world = len(records)
    gens = [protocol(r, infos[w] if infos else info, rank=w, world=world) for w, r in enumerate(records)]
    volume = Volume()
    reply: Reply | None = None
    while True:
        acc: torch.Tensor | None = None
        op0: str | None = None
        result: Summary | None = None
        ended = 0
        for w, g in enumerate(gens):
            try:
                op, t = next(g) if reply is None else g.send(reply)
            except StopIteration as stop:
                ended += 1
                if w == 0:
                    result = stop.value
                continue
            if acc is None:
                op0, acc = op, t.clone()
            else:
                assert op == op0 and t.shape == acc.shape, (
                    f"rank {w} issued {op} {tuple(t.shape)} where rank 0 issued {op0} {tuple(acc.shape)}")
                if op == "sum":
                    acc += t
                else:
                    torch.maximum(acc, t, out=acc)
        if ended:
            assert ended == world, "ranks ended the exchange at different collectives"
            assert result is not None
            result.volume = volume
            return result
        assert op0 is not None and acc is not None
        volume.add(op0, acc, world)
        reply = Reply(acc)
