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
findings are `analyze/sharded.py`'s, the report `sharded_report.py`'s. DTensor parameters are compared by no one
here: their shards differ across ranks by design.

`observe()` on a sharded model follows it with this watch too (`sharded_doctor.py`): given the model (and its
optimizer, when the user passes one), it searches no frames.
"""

from __future__ import annotations

import sys
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_doctor.analyze import diagnose_unwrapped
from ddp_doctor.core.compat import is_dtensor
from ddp_doctor.core.findings import ParamRef
from ddp_doctor.core.fingerprint import fingerprints, fingerprints_batched
from ddp_doctor.core.frames import framework_of_stack, user_site, user_site_of
from ddp_doctor.core.sharded_run import INPUT_STEPS, parallelism_of
from ddp_doctor.core.unwrapped_run import UnwrappedRun
from ddp_doctor.doctor.sharded_report import SITE_ATTR, sharded_report
from ddp_doctor.doctor.sharded_tables import nonzero_grads, replica_sum
from ddp_doctor.exchange.drive import drive
from ddp_doctor.exchange.primitives import comm_device
from ddp_doctor.exchange.shard_collectives import reduce_scatter_in_float32
from ddp_doctor.exchange.unwrapped import unwrapped_rounds
from ddp_doctor.observation.collectives import Call, digest
from ddp_doctor.observation.dataloaders import Mark, drawn_since
from ddp_doctor.observation.grad_scale import GradScale
from ddp_doctor.observation.graph_collectives import GraphCollectives
from ddp_doctor.observation.hooks import tensors_in
from ddp_doctor.observation.optimizers import describe
from ddp_doctor.observation.optimizers import listen as listen_schedulers
from ddp_doctor.observation.shard_comms import GatherCount, ReducePrecisionProbe
from ddp_doctor.observation.sharding import (
    ShardedModel,
    find_sharded_model,
    frame_modules,
    heap_modules,
    sharded_model_of,
)
from ddp_doctor.observation.step_clock import StepClock
from ddp_doctor.observation.tree_scan import modes_of
from ddp_doctor.report.model import Report, RunFacts

__all__ = ["PlainOptimizerWatch"]


CALLS_KEPT = 256
"""The collectives of an observed step kept with their lines (the script's, FSDP2's and `replicate`'s, in order),
so that where the ranks' sequences part is named even after the dozens of all-gathers and reduce-scatters FSDP2
issues in a step. Only the reference rank's and one differing rank's are ever sent (`held_apart`)."""


class PlainOptimizerWatch:
    """The first optimizer stepping on a multi-rank group with no DDP model, and its step count."""

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        framework: str | None = None,
    ) -> None:
        self._framework = framework
        self._given = (model, optimizer)
        """`observe()`'s sharded model and its optimizer (either may be None): followed without a search."""
        self.in_process = model is not None
        """Following for `observe()` (given its model), not for `ddp-doctor check`, whose patches mark each
        `fully_shard` call and whose supervisor names a run that fails."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.others: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        """The other optimizers seen stepping, each with whether it steps none of the sharded model's parameters
        (a second optimizer for a tensor kept beside the model)."""
        self.steps = 0
        self.graph = GraphCollectives(lambda: self.steps)
        """The script's in-place reductions of tensors autograd tracks (`ShardedRun.graph_collectives`)."""
        self.names: dict[int, str] = {}
        self.module = ""
        self.sharded: ShardedModel | None = None
        self.weights_at_first: torch.Tensor | None = None
        self.buffers_at_first: torch.Tensor | None = None
        """The sharded model's buffers' fingerprints after its first observed step (which of them change)."""
        self.replicated = False
        """Its parameters are replicated across ranks (`replicate`, HSDP): copies compared at each step."""
        self.replica_sums: list[float] = []
        """Per observed step (the first `INPUT_STEPS`, beside `replica_state`): the sum of the fingerprints of this
        rank's local replicated tensors after its `optimizer.step()`: equal on ranks whose copies are equal, so
        the step at which copies part is named, not only the step they were compared at."""
        self.drawn: list[int] = []
        """Per observed step (beside `replica_state`): the batches the training loader handed out for it."""
        self._drawn_mark: Mark = (None, 0)
        self.sync_off_steps = 0
        self.shard_saves: list[dict[str, Any]] = []
        """`torch.save` calls of this rank that wrote DTensor shards (`observation/saves.py`), the first few."""
        self.grad_seen: torch.Tensor | None = None
        """Per parameter of the sharded model: it had a gradient at some observed step with gradient sync on."""
        self.grad_nonzero: torch.Tensor | None = None
        """Per parameter of the sharded model: this rank's shard of its gradient held a value other than 0 at some
        observed step after the first (while the per-step measures are on)."""
        self.grad_steps = 0
        self.graded_outside: set[int] = set()
        """The tensors the optimizer steps that the sharded model does not hold and that had a gradient at some
        observed step: in use (a prompt tuned beside a frozen model), not the old parameters `fully_shard`
        replaced, which no backward reaches."""
        self.framework = "torch"
        """Who steps the optimizer: `accelerate` or `transformers` when their code is on the first step's stack."""
        self.gathers: GatherCount | None = None
        self.gathers_per_step: list[int] = []
        """All-gathers of each observed step after the first (the first includes FSDP2's lazy init)."""
        self._gathers_before = 0
        self.grad_scale: GradScale | None = None
        """The ratio of each observed step's gradient shards at the optimizer step to the same at the end of its last
        backward (`observation/grad_scale.py`): compared across ranks, it shows shards scaled by different factors."""
        self.probe: ReducePrecisionProbe | None = None
        """Installed after the first step when gradients are reduced in a low dtype: measures one backward's."""
        self.clock: StepClock | None = None
        """The step time of a sharded model on CPU or one GPU (`observation/step_clock.py`); None otherwise."""
        self._solo_declined = False
        """One rank, and the first optimizer to step trains no sharded model: nothing to compare, nothing followed."""
        self.stopped = False
        """`observe()`'s context ended (`detach`): nothing more is counted, no script is followed."""
        self.metric_schedulers: list[str] = []
        """`file:line` of the `step(metric)` calls of a scheduler of this optimizer that reads a metric
        (ReduceLROnPlateau), each once."""
        self._unlisten: Callable[[], None] | None = None
        self.input_fps: list[torch.Tensor | None] = []
        """Per observed step (the first `INPUT_STEPS`): the fingerprint of its training forwards' inputs; None for a
        step whose forward the root's pre-hook did not see (the first: the model is found at its optimizer step)."""
        self._step_input: torch.Tensor | None = None
        self.replica_state: list[tuple[int, str, int, dict[str, Any]]] = []
        """Per observed step (the first `INPUT_STEPS`), what each rank's copy holds beside its weights: (digest,
        text) of the optimizer's settings (`optimizers.describe`) and (digest, entry) of the modules' train/eval
        modes (`tree_scan.modes_of`), when the step's `optimizer.step()` returned."""
        self.step_collectives: list[tuple[int, list[str], int]] = []
        """Per observed step (the first `INPUT_STEPS`, beside `replica_state`): the digest of the script's own
        collectives in it, in order (`collectives.digest`: op, dtype, shape, reduction, group size), and the first
        `CALLS_KEPT` of them (`all_reduce(float32[1], MAX)/2 at train.py:118`), and how many there were."""
        self._calls: tuple[int, list[str], int] = (0, [], 0)
        """The current step's (digest, first calls, count) so far."""
        self.measuring = True
        """Until the observed steps are over (`end_per_step`)."""
        self.frozen = False
        """The observed steps ended and the script is followed to its epoch end: its steps and forwards are no
        longer counted; its saves still are (`report` then covers them too)."""

    def freeze(self) -> None:
        """The observed steps' end, when following starts (see `frozen`)."""
        self.frozen = True
        if self.gathers is not None:
            self.gathers.frozen = True
        self.end_per_step()

    def detach(self) -> None:
        """Stop counting and take this watch's wrappers and hooks off the model (`observe()`'s end); what was
        measured stays for the report."""
        self.stopped = True
        if self._unlisten is not None:
            self._unlisten()
        if self.gathers is not None:
            self.gathers.remove()
        if self.probe is not None:
            self.probe.remove()
        self.end_per_step()

    def end_per_step(self) -> None:
        """The observed steps are over (their report, following, `observe()`'s end): the per-forward and
        per-backward measures stop, so that a job that trains on (`watch`) pays nothing more for them."""
        self.measuring = False
        if self.grad_scale is not None:
            self.grad_scale.remove()
        if self.clock is not None:
            self.clock.stop()

    def note_forward(self, args: Any = ()) -> None:
        """A forward through the sharded model began (the session's pre-hook on its root, with the forward's
        positional `args`): the step clock's mark, and the training inputs' fingerprint of this step."""
        if self.frozen or self.stopped:
            return
        if self.clock is not None:
            self.clock.on_forward()
        # Plain tensors only: a DTensor input is sharded on purpose, and fingerprinting it would communicate.
        if not self.measuring or len(self.input_fps) >= INPUT_STEPS or not torch.is_grad_enabled():
            return
        inputs = [t for t in tensors_in(args) if not t.is_complex() and not is_dtensor(t)]
        if inputs:
            rows = fingerprints(inputs)
            nonfinite = (~rows.isfinite()).any(1).sum(0, keepdim=True).to(rows.dtype)  # tensors holding NaN or inf
            digest = torch.cat([rows.nan_to_num(0.0).sum(0), nonfinite])
            self._step_input = digest if self._step_input is None else self._step_input + digest

    def note_collective(self, call: Call) -> None:
        """The script or FSDP2 entered a collective (a listener of `observation/collectives.py`): folded into the
        current step's digest, and kept by its line among the step's first `CALLS_KEPT`."""
        if self.frozen or self.stopped or not self.measuring:
            return
        if not call.fsdp:
            self.graph.note(call)
        if len(self.step_collectives) >= INPUT_STEPS:
            return
        running, shown, count = self._calls
        if len(shown) < CALLS_KEPT:
            by = " from FSDP2" if call.fsdp else ""
            shown.append(f"{call.signature()}{by} at {user_site_of(call.caller, None) or 'an unknown place'}")
        self._calls = (digest(running, call), shown, count + 1)

    def note_save(self, info: dict[str, Any]) -> None:
        """A `torch.save` to a file (a listener of `observation/saves.py`): kept when it wrote DTensor shards."""
        if info.get("shards") and len(self.shard_saves) < 4:
            self.shard_saves.append(info)

    def _note_scheduler(self, scheduler: Any) -> None:
        """An LR scheduler's `step()`: where one of this optimizer that reads a metric was stepped."""
        if self.stopped or getattr(scheduler, "optimizer", None) is not self.optimizer:
            return
        site = user_site()
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if plateau and site and site not in self.metric_schedulers and len(self.metric_schedulers) < 4:
            self.metric_schedulers.append(site)

    def on_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Count a step; returns True when it was this watch's optimizer. On one rank only a sharded model is
        followed: its optimizer and gradient sync can be wrong on one GPU too, while an unwrapped model is not."""
        if not dist.is_initialized() or self._solo_declined:
            return False
        if self.optimizer is None:
            model, wanted = self._given
            if wanted is not None and optimizer is not wanted:
                return False
            stepped = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
            sharded = sharded_model_of(model) if model is not None else find_sharded_model(sys._getframe(2), stepped)
            if sharded is None and dist.get_world_size() < 2:
                self._solo_declined = True
                return False
            self.optimizer, self.sharded = optimizer, sharded
            self._unlisten = listen_schedulers(self._note_scheduler)
            self.framework = self._framework or framework_of_stack(traceback.extract_stack())
            if self.sharded is None:
                self._name_params(sys._getframe(2))
            else:
                self.module = type(self.sharded.root).__qualname__
                self.names = {id(p): n for n, p in self.sharded.named_parameters()}
                # After the first step: whether any weight changes from here on is what the report measures.
                self.weights_at_first = fingerprints_batched(p for _, p in self.sharded.named_parameters())
                self.buffers_at_first = fingerprints_batched(b for _, b in self.sharded.root.named_buffers())
                self.replicated = dist.get_world_size() > 1 and self.sharded.replica_row() is not None
                if self.sharded.api == "fully_shard":
                    self.gathers = GatherCount(self.sharded)
                self.grad_scale = GradScale(self.sharded, INPUT_STEPS)
                self.grad_scale.install()
                devices = {p.device for _, p in self.sharded.named_parameters()}
                self.clock = StepClock.for_model(devices, self.sharded.param_groups())
        if optimizer is not self.optimizer and self.sharded is not None and optimizer not in self.others:
            held = {id(p) for _, p in self.sharded.named_parameters()}
            self.others[optimizer] = not any(id(p) in held for g in optimizer.param_groups for p in g["params"])
        if optimizer is not self.optimizer or self.stopped:
            return False
        if self.frozen:
            return True
        self.steps += 1
        if len(self.input_fps) < INPUT_STEPS:
            self.input_fps.append(self._step_input)
        self._step_input = None
        drawn, self._drawn_mark = drawn_since(self._drawn_mark)
        if self.sharded is not None and self.measuring and len(self.replica_state) < INPUT_STEPS:
            self.replica_state.append((*describe(optimizer), *modes_of(self.sharded.root)))
            self.drawn.append(drawn)
            self.step_collectives.append(self._calls)
            if self.replicated:
                self.replica_sums.append(replica_sum(self.sharded))
        self._calls = (0, [], 0)
        if self.sharded is not None and not self.sharded.gradient_sync_on():
            self.sync_off_steps += 1
        elif self.sharded is not None:
            self.graded_outside.update(
                id(p) for p in self.stepped_params() if id(p) not in self.names and p.grad is not None
            )
            got = torch.tensor([p.grad is not None for _, p in self.sharded.named_parameters()])
            self.grad_seen = got if self.grad_seen is None else self.grad_seen | got
            self.grad_steps += 1
            if self.measuring and self.steps > 1:  # the weights' moves are measured from the first step's end
                nonzero = nonzero_grads(self.sharded)
                self.grad_nonzero = nonzero if self.grad_nonzero is None else self.grad_nonzero | nonzero
        if self.grad_scale is not None:
            self.grad_scale.on_step()
        if self.sharded is not None:
            self._measure_reduce(self.sharded)
        if self.gathers is not None:
            if self.steps > 1:
                self.gathers_per_step.append(self.gathers.calls - self._gathers_before)
            self._gathers_before = self.gathers.calls
        if self.clock is not None:
            self.clock.on_step()  # after this watch's own work on the step (it is not the wait for data)
        return True

    def _measure_reduce(self, model: ShardedModel) -> None:
        """After the first step, when the model reduces gradients in a low dtype: measure the next backward's
        reductions (`ReducePrecisionProbe`), then take the probe out."""
        if self.probe is None and self.steps == 1 and model.api == "fully_shard" and model.may_reduce_low():
            self.probe = ReducePrecisionProbe(model, reduce_scatter_in_float32)
            self.probe.install()
        elif self.probe is not None and self.probe.calls:
            self.probe.remove()

    def _name_params(self, frame: Any) -> None:
        """Names from the module that owns the most of the optimizer's params: a local or global of the script's
        frames, else any module of the process (a loop in a class holds `self.model`)."""
        wanted = {id(p) for p in self.stepped_params()}
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

    def stepped_params(self) -> list[torch.Tensor]:
        assert self.optimizer is not None
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def report(self) -> Report:
        """Compare the parameters across ranks and build the report. Collective: every rank calls it."""
        if self.sharded is not None:
            self.end_per_step()  # what the report compares is measured; the script may train on (`watch`)
            return sharded_report(self, self.sharded)
        # DTensor parameters (tensor parallelism, or a sharded model the frames did not show) belong to a
        # parallelism that keeps them itself; their local shards differ by design.
        stepped = self.stepped_params()
        params = [p for p in stepped if not is_dtensor(p)]
        device = comm_device(None, stepped[0].device if stepped else None)
        refs = [ParamRef(self.names.get(id(p), f"param[{i}]"), p.numel(), tuple(p.shape)) for i, p in enumerate(params)]
        world = dist.get_world_size()
        compared = drive(
            unwrapped_rounds(len(params), len(stepped) - len(params), lambda: fingerprints_batched(params)),
            group=None,
            device=device,
        )
        assert self.optimizer is not None
        run = UnwrappedRun(
            world=world,
            steps=self.steps,
            optimizer=type(self.optimizer).__qualname__,
            optimizer_site=getattr(self.optimizer, SITE_ATTR, None),
            params=refs,
            differ=compared.differ,
            gap=compared.gap,
            dtensors=compared.dtensors,
        )
        return Report.build(self.facts(), diagnose_unwrapped(run))

    def facts(self, *, sharding: dict[str, Any] | None = None) -> RunFacts:
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
