"""An aligned, cross-rank view of the records that every detector reads."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ddp_doctor.records import CRASH_KINDS, ModelInfo, RankRecord
from ddp_doctor.report.model import ParamRef

__all__ = ["View"]


def _leading_complete(record: RankRecord) -> int:
    complete = record.counter("complete").bool().tolist()
    return next((i for i, c in enumerate(complete) if not c), len(complete))


def _same_across_ranks(fp: torch.Tensor) -> torch.Tensor:
    """fp: [W, ..., 2] fingerprints. True where every rank equals rank 0 (NaN equals NaN)."""
    ref = fp[:1]
    equal = (fp == ref) | (fp.isnan() & ref.isnan())
    return equal.all(-1).all(0)


@dataclass
class View:
    """Records aligned on the steps every rank completed. W ranks, S common steps, P params, B buffers."""

    info: ModelInfo
    records: list[RankRecord]

    def __post_init__(self) -> None:
        info, records = self.info, self.records
        self.world = len(records)
        self.steps = min((_leading_complete(r) for r in records), default=0)
        s = self.steps
        self.used = torch.stack([r.used[:s] for r in records])            # [W, S, P]
        self.trainable = torch.stack([r.trainable[:s] for r in records])  # [W, S, P]
        self.ran = torch.stack([r.ran[:s] for r in records])              # [W, S, P]
        self.grad_fp = torch.stack([r.grad_fp[:s] for r in records])      # [W, S, P, 2]
        self.weight_fp = torch.stack([r.weight_fp[: s + 1] for r in records])  # [W, S+1, P, 2]
        self.buffer_fp = torch.stack([r.buffer_fp[:s] for r in records])  # [W, S, B, 2]
        self.input_fp = torch.stack([r.input_fp[:s] for r in records])    # [W, S, 2]
        self.tracked = torch.tensor(info.trainable_at_wrap, dtype=torch.bool)
        self.ignored = torch.tensor(info.ignored, dtype=torch.bool)
        # The step a crash interrupted: what got a gradient, or was reachable from DDP's outputs, before the crash
        # is evidence of use. What was not is unknown, not unused.
        self.partial_used = torch.zeros(self.world, len(info.param_names), dtype=torch.bool)
        for w, r in enumerate(records):
            n = _leading_complete(r)
            if n < r.steps:
                self.partial_used[w] = r.used[n] | r.reachable[n]
        self._infer_unfrozen()
        cfg = info.ddp_config
        self.find_unused = bool(cfg.get("find_unused_parameters"))
        self.static_graph = bool(cfg.get("static_graph"))
        self.default_flags = not self.find_unused and not self.static_graph
        # Parameters DDP reduces and that stayed trainable throughout: the ones whose usage decides the flags.
        frozen_any = (~self.trainable).any(0).any(0) if s else torch.zeros_like(self.tracked)
        self.live = self.tracked & ~frozen_any

    def _infer_unfrozen(self) -> None:
        """Find parameters unfrozen between wrap and observe(), when only DDP's tensor count says so.

        DDP reduces every parameter it was built with, so among the parameters trainable at observe() entry,
        exactly the unfrozen ones can have gradients that differ across ranks. Accept that only when the count
        of such parameters matches the count DDP's logging data is missing.
        """
        wrap_count = self.info.wrap_trainable_count
        if self.info.wrap_state_exact or wrap_count is None or self.world < 2 or not self.steps:
            return
        missing = int(self.tracked.sum()) - wrap_count
        if missing <= 0:
            return
        unsynced = (~_same_across_ranks(self.grad_fp)).any(0) & self.tracked
        if int(unsynced.sum()) == missing:
            self.tracked = self.tracked & ~unsynced

    def usage(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Over live params, [P] masks: (never used, used-set changes across steps, differs across ranks, always used).

        A crashed step's partial usage counts as evidence of use.
        """
        u = self.used
        partial = self.partial_used
        never = self.live & ~u.any(0).any(0) & ~partial.any(0)
        always = self.live & u.all(0).all(0) & ~(self.steps == 0)
        across_steps = (u.any(1) != u.all(1)).any(0) if self.steps >= 2 else torch.zeros_like(self.live)
        after_crash = (partial & ~u.all(1)).any(0) if self.steps >= 1 else torch.zeros_like(self.live)
        dynamic = self.live & (across_steps | after_crash)
        rank_dep = self.live & (u.any(0) != u.all(0)).any(0)
        return never, dynamic, rank_dep, always

    def unused_by_cause(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Never-used live params split by cause, [P] masks: (dead: the module never ran in a training forward on
        any rank or step, so freezing it changes nothing the script does; blocked: the module ran, but no gradient
        reached the parameter: `no_grad`, `.detach()` or a reentrant checkpoint without grad-requiring inputs).
        Only the dead ones may ever be advised to freeze."""
        never = self.usage()[0]
        ran = self.ran.any(0).any(0) if self.steps else torch.zeros_like(never)
        return never & ~ran, never & ran

    @property
    def blocked_checkpoints(self) -> list[str]:
        return sorted({site for r in self.records for site in r.blocked_checkpoints})

    @property
    def ever_used(self) -> torch.Tensor:
        return self.used.any(0).any(0) | self.partial_used.any(0)

    # ------------------------------------------------------------------------------------------- helpers

    def params(self, mask: torch.Tensor | list[int]) -> list[ParamRef]:
        idx = mask.nonzero().flatten().tolist() if isinstance(mask, torch.Tensor) else mask
        names, shapes, numels = self.info.param_names, self.info.param_shapes, self.info.numels
        return [ParamRef(names[i], numels[i], tuple(shapes[i])) for i in idx]

    def buffers(self, mask: torch.Tensor) -> list[ParamRef]:
        names, shapes = self.info.buffer_names, self.info.buffer_shapes
        out = []
        for i in mask.nonzero().flatten().tolist():
            numel = 1
            for d in shapes[i]:
                numel *= d
            out.append(ParamRef(names[i], numel, tuple(shapes[i])))
        return out

    def names_in_message(self, text: str) -> list[int]:
        """Indices of parameters DDP named in an error message ("... with name head_b.bias has been marked ...")."""
        index = {n: i for i, n in enumerate(self.info.param_names)}
        return [index[m] for m in re.findall(r"with name (\S+)", text) if m in index]

    def same_across_ranks(self, fp: torch.Tensor) -> torch.Tensor:
        return _same_across_ranks(fp)

    def crashed(self, kind: str) -> list[RankRecord]:
        code = CRASH_KINDS.index(kind)
        return [r for r in self.records if r.crash_kind == code]

    def last_complete_used(self, record: RankRecord) -> torch.Tensor | None:
        n = _leading_complete(record)
        return record.used[n - 1] if n else None
