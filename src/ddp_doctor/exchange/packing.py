"""The exchange's packing: 64-bit digests, the order key of floats, and the two kinds of round (a SUM of bit
fields and integers, a MAX of pairs and owner slots), each with its decoding. No collectives here: a round builds
the tensor to reduce and reads the reduced result back."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ddp_doctor.core.records import RankRecord

__all__ = [
    "MIN",
    "MaxRound",
    "Op",
    "Reply",
    "SumRound",
    "bool_digest",
    "differs",
    "element_hashes",
    "first_set",
    "from_words",
    "hash_steps",
    "int_digest",
    "of_record",
    "order_key",
    "text_digest",
    "to_words",
    "unkey",
]

MIN = -(2**63)
_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB
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


# ------------------------------------------------------------------------------------------------ digests


def mix(x: torch.Tensor) -> torch.Tensor:
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
    return mix(flat ^ mix(pos * _M3 + 1)).reshape(fp.shape)


memo: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, Any]] | None = None
"""Set by `summarize` only: in the in-process model, ranks that share a record tensor hash it once."""


def of_record(record: RankRecord, name: str, n: int, compute: Callable[[torch.Tensor], Any]) -> Any:
    """`compute(getattr(record, name)[:n])`, remembered for the last few tensors while the model runs."""
    t = getattr(record, name)
    if memo is None:
        return compute(t[:n])
    key = (id(t), t._version, name, n, compute)
    hit = memo.get(key)
    if hit is None or hit[0] is not t:
        hit = (t, compute(t[:n]))
        memo[key] = hit
        while len(memo) > 16:
            memo.popitem(last=False)
    return hit[1]


def int_digest(t: torch.Tensor) -> int:
    """A 64-bit digest of an int64 tensor's values and their positions."""
    flat = t.reshape(-1).to(torch.int64)
    pos = torch.arange(flat.numel(), dtype=torch.int64)
    return int(mix(flat ^ mix(pos * _M3 + flat.numel())).sum())


def hash_steps(fp: torch.Tensor) -> torch.Tensor:
    return element_hashes(fp).sum(-1)


def order_key(x: torch.Tensor) -> torch.Tensor:
    """float64 -> int64 whose signed order is the float order (NaN mapped above +inf)."""
    bits = x.to(torch.float64).contiguous().view(torch.int64)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFFFFFFFFFF)
    return torch.where(x.isnan(), torch.full((), 2**63 - 1, dtype=torch.int64), key)


def unkey(k: int) -> float:
    bits = k if k >= 0 else k ^ 0x7FFFFFFFFFFFFFFF
    return float(torch.tensor([bits], dtype=torch.int64).view(torch.float64)[0])


# ------------------------------------------------------------------------------------------------ buffers


def bool_digest(t: torch.Tensor) -> int:
    """A 64-bit digest of a bool tensor (its bits packed 63 to a word, then hashed with their positions)."""
    flat = t.reshape(-1).to(torch.int64)
    words = -(-flat.numel() // 63)
    x = torch.zeros(words * 63, dtype=torch.int64)
    x[: flat.numel()] = flat
    packed = (x.view(words, 63) << torch.arange(63, dtype=torch.int64)).sum(1)
    pos = torch.arange(words, dtype=torch.int64)
    return int(mix(packed ^ mix(pos * _M3 + flat.numel())).sum())


class SumRound:
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
        return torch.tensor(
            [self.known[n] if n in self.known else bool_digest(t) for n, kind, t in self.sections if kind == "bits"],
            dtype=torch.int64,
        )

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
        parts = [
            t.reshape(-1) if kind == "ints" else self._pack(t, self._width(kind))
            for name, kind, t in self.sections
            if not self.uniform.get(name)
        ]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def read(self, reply: Reply) -> dict[str, torch.Tensor]:
        key = ("sum", self.width, tuple((n, k, tuple(t.shape), self.uniform.get(n)) for n, k, t in self.sections))
        if key not in reply.cache:
            reply.cache[key] = self._decode(reply.tensor)
        self.sections = []  # nothing held after the round
        return reply.cache[key]

    def _decode(self, result: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, kind, t in self.sections:
            if self.uniform.get(name):
                out[name] = t.to(torch.int64) * self.world
                continue
            numel = t.numel()
            if kind == "ints":
                out[name] = result[offset : offset + numel].reshape(t.shape)
                offset += numel
                continue
            width = self._width(kind)
            per_word = 63 // width
            n = -(-numel // per_word)
            chunk = result[offset : offset + n]
            offset += n
            shifts = torch.arange(per_word, dtype=torch.int64) * width
            counts = ((chunk.unsqueeze(1) >> shifts) & ((1 << width) - 1)).reshape(-1)
            out[name] = counts[:numel].reshape(t.shape)
        return out


class MaxRound:
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
            hi = torch.where(mask, hi, MIN)
            lo = torch.where(mask, lo, MIN)
        self.parts.append(torch.cat([hi, lo]))
        self.layout.append((name, "pair", tuple(t.shape), 2 * flat.numel()))

    def slot(self, name: str, t: torch.Tensor, owner: bool | torch.Tensor) -> None:
        """The value of the rank(s) where `owner` is True (the largest, when several own an entry)."""
        flat = t.reshape(-1).to(torch.int64)
        own = torch.as_tensor(owner).reshape(-1).expand(flat.shape)
        self.parts.append(torch.where(own, flat, MIN))
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
            chunk = result[offset : offset + n]
            offset += n
            if kind == "pair":
                half = n // 2
                out[name] = (chunk[:half].reshape(shape), (~chunk[half:]).reshape(shape))
            else:
                out[name] = chunk.reshape(shape)
        return out


def differs(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return pair[0] != pair[1]


def first_set(flags: list[bool]) -> int | None:
    """The index of the first True (None: none)."""
    return next((i for i, f in enumerate(flags) if f), None)


def text_digest(value: Any) -> int:
    """A 64-bit digest of a JSON-able value (or of bytes)."""
    data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()
    words = to_words(data, -(-len(data) // 8) + 1)
    pos = torch.arange(words.numel(), dtype=torch.int64)
    return int(mix(words ^ mix(pos * _M3 + len(data))).sum())


def to_words(data: bytes, n_words: int) -> torch.Tensor:
    padded = bytearray(data + b"\0" * (n_words * 8 - len(data)))
    return torch.frombuffer(padded, dtype=torch.int64).clone() if n_words else torch.zeros(0, dtype=torch.int64)


def from_words(words: torch.Tensor, n: int) -> bytes:
    return words.contiguous().numpy().tobytes()[:n]
