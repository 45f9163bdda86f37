"""In a `check` run whose script builds no DDP model: watch the optimizer that trains on several ranks anyway.

A well-known pattern: the script wraps the model in DDP only on its GPU branch, so on CPU every rank trains its own
copy. The first optimizer that steps while a process group of several ranks exists is followed for K steps (or to
the end of the script); then every rank compares its parameters' fingerprints with one fixed-shape all_reduce and
the report says `model-not-wrapped`.

A model sharded with FSDP2 (`fully_shard`, or the FSDP2-based `replicate`) is no unwrapped model: FSDP2 keeps its
sharded parameters in sync. When the loop's frames hold one, the watch follows it instead (`observation/sharding.py`),
on one rank too: which parameters the optimizer steps, which stay outside every sharded group, whether gradient sync
is on at each step, whether any weight changes, the dtype of one backward's reduce-scatters (and what a low one
costs), the all-gathers per step and the last module to run forward (the `reshard_after_forward` advice); the
findings are `analyze/sharded.py`'s. DTensor parameters are compared by no one here: their shards differ across
ranks by design.
"""

from __future__ import annotations

import sys
import traceback
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_doctor.analyze import diagnose_sharded, diagnose_unwrapped
from ddp_doctor.core.compat import is_dtensor
from ddp_doctor.core.findings import ParamRef
from ddp_doctor.core.fingerprint import fingerprints_batched
from ddp_doctor.core.frames import framework_of_stack, user_site
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of
from ddp_doctor.core.unwrapped_run import UnwrappedRun
from ddp_doctor.exchange.primitives import comm_device, minmax
from ddp_doctor.exchange.timing import slowest_rank
from ddp_doctor.observation.sharding import (
    GatherCount,
    ReducePrecisionProbe,
    ShardedModel,
    find_sharded_model,
    frame_modules,
    heap_modules,
    reshards_fully,
)
from ddp_doctor.observation.step_clock import StepClock, input_wait
from ddp_doctor.report.model import Report, RunFacts

__all__ = ["PlainOptimizerWatch", "record_creation_site"]

SITE_ATTR = "_ddp_doctor_site"
_SLOTS = (
    "unsharded",
    "sync_off",
    "changed",
    "saved",
    "saver",
    "path",
    "grad_steps",
    "params",
    "low_reduces",
    "low_abs",
    "low_rel",
    "gathers",
    "unsharded_changed",
    "waiting",
    "timed_steps",
    "wait_s",
    "step_s",
    "comm_timed",
    "own_s",
    "gpu_timed",
)
"""What every rank puts in the sharded report's one min/max reduction, in this order."""
_NOBODY = 2**24
"""The `saver` slot of a rank that saved no shards (above any rank, exact in float32)."""
SHARD_CALL_ATTR = "_ddp_doctor_shard_call"
"""Set on each module the patched `fully_shard` sharded: (which call it was, 0 the first; the call's line)."""
SYNC_OFF_ATTR = "_ddp_doctor_sync_off_site"
"""Set on an FSDP2 module by the patched `set_requires_gradient_sync(False)`: where the script called it."""
IGNORED_ATTR = "_ddp_doctor_ignored_site"
"""Set on each parameter the script passed to the patched `fully_shard` as `ignored_params`: that call's line."""


def _low_reduce(probe: ReducePrecisionProbe | None) -> tuple[str, str] | None:
    """(the dtype FSDP2 reduced in, the weights' dtype) from the probe, as the report names them."""
    if probe is None or probe.low_dtype is None:
        return None
    return str(probe.low_dtype).removeprefix("torch."), "float32"


def record_creation_site(optimizer: torch.optim.Optimizer) -> None:
    """Remember where the script created `optimizer` (called from a wrapper of `Optimizer.__init__`)."""
    if getattr(optimizer, SITE_ATTR, None) is None:
        setattr(optimizer, SITE_ATTR, user_site())


class PlainOptimizerWatch:
    """The first optimizer stepping on a multi-rank group with no DDP model, and its step count."""

    def __init__(self) -> None:
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps = 0
        self.names: dict[int, str] = {}
        self.module = ""
        self.sharded: ShardedModel | None = None
        self._weights_at_first: torch.Tensor | None = None
        self.sync_off_steps = 0
        self.shard_saves: list[dict[str, Any]] = []
        """`torch.save` calls of this rank that wrote DTensor shards (`observation/saves.py`), the first few."""
        self._grad_seen: torch.Tensor | None = None
        """Per parameter of the sharded model: it had a gradient at some observed step with gradient sync on."""
        self._grad_steps = 0
        self.framework = "torch"
        """Who steps the optimizer: `accelerate` or `transformers` when their code is on the first step's stack."""
        self._gathers: GatherCount | None = None
        self._gathers_per_step: list[int] = []
        """All-gathers of each observed step after the first (the first includes FSDP2's lazy init)."""
        self._gathers_before = 0
        self._probe: ReducePrecisionProbe | None = None
        """Installed after the first step when gradients are reduced in a low dtype: measures one backward's."""
        self.clock: StepClock | None = None
        """The step time of a sharded model on CPU or one GPU (`observation/step_clock.py`); None otherwise."""
        self._solo_declined = False
        """One rank, and the first optimizer to step trains no sharded model: nothing to compare, nothing followed."""
        self.frozen = False
        """The observed steps ended and the script is followed to its epoch end: its steps and forwards are no
        longer counted; its saves still are (`report` then covers them too)."""

    def freeze(self) -> None:
        """The observed steps' end, when following starts (see `frozen`)."""
        self.frozen = True
        if self._gathers is not None:
            self._gathers.frozen = True

    def note_forward(self) -> None:
        """A forward through the sharded model began (the session's pre-hook on its root)."""
        if self.clock is not None and not self.frozen:
            self.clock.on_forward()

    def note_save(self, info: dict[str, Any]) -> None:
        """A `torch.save` to a file (a listener of `observation/saves.py`): kept when it wrote DTensor shards."""
        if info.get("shards") and len(self.shard_saves) < 4:
            self.shard_saves.append(info)

    def on_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Count a step; returns True when it was this watch's optimizer. On one rank only a sharded model is
        followed: its optimizer and gradient sync can be wrong on one GPU too, while an unwrapped model is not."""
        if not dist.is_initialized() or self._solo_declined:
            return False
        if self.optimizer is None:
            stepped = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
            sharded = find_sharded_model(sys._getframe(2), stepped)
            if sharded is None and dist.get_world_size() < 2:
                self._solo_declined = True
                return False
            self.optimizer, self.sharded = optimizer, sharded
            self.framework = framework_of_stack(traceback.extract_stack())
            if self.sharded is None:
                self._name_params(sys._getframe(2))
            else:
                self.module = type(self.sharded.root).__qualname__
                self.names = {id(p): n for n, p in self.sharded.named_parameters()}
                # After the first step: whether any weight changes from here on is what the report measures.
                self._weights_at_first = fingerprints_batched(p for _, p in self.sharded.named_parameters())
                if self.sharded.api == "fully_shard":
                    self._gathers = GatherCount(self.sharded)
                devices = {p.device for _, p in self.sharded.named_parameters()}
                self.clock = StepClock.for_model(devices, self.sharded.param_groups())
        if optimizer is not self.optimizer:
            return False
        if self.frozen:
            return True
        self.steps += 1
        if self.sharded is not None and not self.sharded.gradient_sync_on():
            self.sync_off_steps += 1
        elif self.sharded is not None:
            got = torch.tensor([p.grad is not None for _, p in self.sharded.named_parameters()])
            self._grad_seen = got if self._grad_seen is None else self._grad_seen | got
            self._grad_steps += 1
        if self.sharded is not None:
            self._measure_reduce(self.sharded)
        if self._gathers is not None:
            if self.steps > 1:
                self._gathers_per_step.append(self._gathers.calls - self._gathers_before)
            self._gathers_before = self._gathers.calls
        if self.clock is not None:
            self.clock.on_step()  # after this watch's own work on the step (it is not the wait for data)
        return True

    def _measure_reduce(self, model: ShardedModel) -> None:
        """After the first step, when the model reduces gradients in a low dtype: measure the next backward's
        reductions (`ReducePrecisionProbe`), then take the probe out."""
        if self._probe is None and self.steps == 1 and model.api == "fully_shard" and model.may_reduce_low():
            self._probe = ReducePrecisionProbe(model)
            self._probe.install()
        elif self._probe is not None and self._probe.calls:
            self._probe.remove()

    def _name_params(self, frame: Any) -> None:
        """Names from the module that owns the most of the optimizer's params: a local or global of the script's
        frames, else any module of the process (a loop in a class holds `self.model`)."""
        wanted = {id(p) for p in self._params()}
        for modules in (lambda: frame_modules(frame), heap_modules):  # the heap only where no frame has one
            best: tuple[int, nn.Module | None] = (0, None)
            for module in modules():
                n = sum(id(p) in wanted for p in module.parameters())
                if n > best[0]:
                    best = (n, module)
            if best[1] is not None:
                self.names = {id(p): n for n, p in best[1].named_parameters()}
                self.module = type(best[1]).__qualname__
                return

    def _params(self) -> list[torch.Tensor]:
        assert self.optimizer is not None
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def report(self) -> Report:
        """Compare the parameters across ranks and build the report. Collective: every rank calls it."""
        if self.sharded is not None:
            return self._sharded_report(self.sharded)
        # DTensor parameters (tensor parallelism, or a sharded model the frames did not show) belong to a
        # parallelism that keeps them itself; their local shards differ by design.
        stepped = self._params()
        params = [p for p in stepped if not is_dtensor(p)]
        device = comm_device(None, stepped[0].device if stepped else None)
        top, low = minmax(torch.tensor([float(len(params)), float(len(stepped) - len(params))]), None, device)
        refs = [ParamRef(self.names.get(id(p), f"param[{i}]"), p.numel(), tuple(p.shape)) for i, p in enumerate(params)]
        world = dist.get_world_size()
        if top[0].item() != low[0].item():
            differ, gap = torch.ones(len(params), dtype=torch.bool), torch.full((len(params),), float("inf"))
        else:
            fp = fingerprints_batched(params).nan_to_num(0.0)
            high, lowest = minmax(fp, None, device)
            differ = (high != lowest).any(-1)
            gap = (high - lowest).abs().amax(-1)
        assert self.optimizer is not None
        run = UnwrappedRun(
            world=world,
            steps=self.steps,
            optimizer=type(self.optimizer).__qualname__,
            optimizer_site=getattr(self.optimizer, SITE_ATTR, None),
            params=refs,
            differ=differ.tolist(),
            gap=float(gap.max()) if len(params) else 0.0,
            dtensors=int(top[1].item()),
        )
        return Report.build(self._facts(), diagnose_unwrapped(run))

    def _facts(self, *, sharding: dict[str, Any] | None = None) -> RunFacts:
        """The run's facts: no DDP flags; the sharding of an FSDP2 model."""
        return RunFacts(
            torch_version=torch.__version__,
            backend=str(dist.get_backend()),
            world_size=dist.get_world_size(),
            ddp_config={},
            framework=self.framework,
            parallelism=parallelism_of(sharding),
            sharding=sharding,
        )

    def _sharded_report(self, model: ShardedModel) -> Report:
        """The FSDP2 findings: what the optimizer steps, the parameters outside every group, gradient sync, unused
        parameters, checkpoints of shards, and whether anything changed. Collective, every call decided by values
        every rank holds alike: one fixed-shape min/max of `_SLOTS`; one over which parameters had a gradient (when
        every rank saw a step with sync on); one over the unsharded parameters' fingerprints (when every rank has the
        same number of them); two more when some rank saved shards (`_shard_save`)."""
        assert self.optimizer is not None
        named = model.named_parameters()
        in_model = {id(p) for _, p in named}
        stepped = self._params()
        unsharded = model.unsharded() if dist.get_world_size() > 1 else []  # one rank: nothing to keep in sync
        now = fingerprints_batched(p for _, p in named)
        before = self._weights_at_first if self._weights_at_first is not None else now
        moved = (now.nan_to_num(0.0) != before.nan_to_num(0.0)).any(-1)
        changed = bool(moved.any())
        outside = {id(p) for _, p in unsharded}
        unsharded_changed = bool(moved[[i for i, (_, p) in enumerate(named) if id(p) in outside]].any())
        device = comm_device(None, named[0][1].device if named else None)
        saved = self.shard_saves[0] if self.shard_saves else None
        probe = self._probe
        if probe is not None:
            probe.remove()
        local = {
            "unsharded": len(unsharded),
            "sync_off": self.sync_off_steps,
            "changed": changed,
            "saved": saved is not None,
            "saver": dist.get_rank() if saved else _NOBODY,
            "path": zlib.crc32(saved["path"].encode()) & 0xFFFFFF if saved else -1,  # exact in float32
            "grad_steps": self._grad_steps,
            "params": len(named),
            "low_reduces": probe.low_calls if probe else 0,
            "low_abs": probe.worst_abs if probe else 0.0,
            "low_rel": probe.mean_relative if probe else 0.0,
            "gathers": self._steady_gathers(),
            "unsharded_changed": unsharded_changed,
            **StepClock.slots(self.clock),
        }
        reduced = minmax(torch.tensor([float(local[k]) for k in _SLOTS]), None, device)
        top, low = ({k: v.item() for k, v in zip(_SLOTS, r)} for r in reduced)
        unused: list[ParamRef] = []
        if low["grad_steps"] > 0 and top["params"] == low["params"] and self._grad_seen is not None:
            # Every rank saw a step with gradient sync on, and the same parameters: none had a gradient anywhere.
            seen, _ = minmax(self._grad_seen.float(), None, device)
            unused = [
                ParamRef(n, p.numel(), tuple(p.shape))
                for (n, p), s in zip(named, seen.tolist())
                if p.requires_grad and not s
            ]
        differ = [False] * len(unsharded)
        gap = 0.0
        if unsharded and top["unsharded"] == low["unsharded"]:
            high, lowest = minmax(fingerprints_batched(p for _, p in unsharded).nan_to_num(0.0), None, device)
            differ = (high != lowest).any(-1).tolist()
            gap = float((high - lowest).abs().amax()) if differ else 0.0
        elif unsharded:
            differ = [True] * len(unsharded)
            gap = float("inf")
        shard_save = self._shard_save(saved, top, low, device)
        sync_site = next((getattr(m, SYNC_OFF_ATTR) for _, m in model.sharded if getattr(m, SYNC_OFF_ATTR, None)), None)
        sharding = model.describe()
        if top["gathers"] == low["gathers"] >= 0:
            sharding["all_gathers_per_step"] = int(top["gathers"])
        run = ShardedRun(
            world=dist.get_world_size(),
            steps=self.steps,
            optimizer=type(self.optimizer).__qualname__,
            optimizer_site=getattr(self.optimizer, SITE_ATTR, None),
            framework=self.framework,
            sharding=sharding,
            model_params=sum(p.requires_grad for _, p in named),
            replaced=sum(id(p) not in in_model for p in stepped),
            model_params_stepped=sum(id(p) in in_model for p in stepped),
            model_changed=bool(top["changed"]),
            unsharded=[ParamRef(n, p.numel(), tuple(p.shape)) for n, p in unsharded],
            unsharded_differ=differ,
            unsharded_gap=gap,
            unsharded_changed=bool(top["unsharded_changed"]),
            ignored_site=next((getattr(p, IGNORED_ATTR) for _, p in unsharded if hasattr(p, IGNORED_ATTR)), None),
            ignored=[hasattr(p, IGNORED_ATTR) for _, p in unsharded],
            unused=unused,
            sync_off_steps=int(top["sync_off"]),
            sync_off_site=sync_site,
            low_reduce=_low_reduce(probe) if low["low_reduces"] > 0 else None,
            reshard_candidate=self._reshard_candidate(model) if "all_gathers_per_step" in sharding else None,
            input_wait=input_wait(top, low),
            comm_timed=low["comm_timed"] >= 1,
            slowest=slowest_rank(self.clock and self.clock.stats(), top, low, device),
            timed_steps=int(low["timed_steps"]),
            gpu_timed=low["gpu_timed"] >= 1,
            low_reduce_abs=top["low_abs"],
            low_reduce_rel=top["low_rel"],
            followed=self.frozen,
            **shard_save,
        )
        return Report.build(self._facts(sharding=run.sharding), diagnose_sharded(run))

    def _steady_gathers(self) -> int:
        """The all-gathers of an observed step after the first, when every such step made as many; -1 when not
        counted or when they varied (an evaluation forward in between, say)."""
        counts = set(self._gathers_per_step)
        return counts.pop() if self._gathers is not None and self._gathers.counted and len(counts) == 1 else -1

    def _reshard_candidate(self, model: ShardedModel) -> dict[str, Any] | None:
        """The non-root sharded module that ran its forward last, when it reshards after forward and the patched
        `fully_shard` built it: its backward starts right after that forward, so FSDP2 all-gathers the parameters
        it just freed again at once. Its name, which `fully_shard` call built it, and that call's line."""
        name = self._gathers.last_forward if self._gathers is not None else None
        module = dict(model.sharded).get(name) if name else None
        call = getattr(module, SHARD_CALL_ATTR, None)
        if module is None or call is None or not reshards_fully(module):
            return None
        return {"module": name, "call": call[0], "site": call[1]}

    @staticmethod
    def _shard_save(
        saved: dict[str, Any] | None, top: dict[str, float], low: dict[str, float], device: torch.device
    ) -> dict[str, Any]:
        """Whether sharded state went to a file that holds some ranks' shards only: saved by some ranks, or by every
        rank to one path. Then two more collectives every rank makes alike: how many ranks saved, and what the
        first of them wrote (its line, its file, a parameter's shard shape). `ShardedRun`'s `shard_save*` fields."""
        if top["saved"] == 0:
            return {}
        every, one_path = low["saved"] == 1, top["path"] == low["path"]
        if every and not one_path:
            return {}  # each rank its own file of its own shards: a per-rank sharded checkpoint
        first = int(low["saver"])
        count = torch.tensor([1.0 if saved else 0.0], device=device)
        dist.all_reduce(count)
        shown = [None if saved is None else {k: saved[k] for k in ("shown", "site", "shards")}]
        dist.broadcast_object_list(shown, src=first)
        return {
            "shard_save": shown[0],
            "shard_save_ranks": int(count.item()),
            "shard_save_first": first,
            "shard_save_one_path": every and one_path,
        }
