"""The per-step log of one rank: the step in progress, and the closed steps that become its `RankRecord`."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from ddp_doctor.core.fingerprint import fingerprints, significant
from ddp_doctor.core.records import RankRecord, StepCounters
from ddp_doctor.observation.collectives import Call, digest
from ddp_doctor.observation.device_clock import DeviceClock
from ddp_doctor.observation.joins import JOIN_SITES, JOIN_THROWS
from ddp_doctor.observation.module_calls import TO_EMPTY_SITES
from ddp_doctor.observation.tree_scan import StateScan

__all__ = [
    "MAX_COLLECTIVE_LOG",
    "MAX_LOADERS",
    "MAX_SAVES",
    "MAX_SITES",
    "MAX_STEP_LOG",
    "StepLog",
    "StepState",
    "runq_seconds",
]

MAX_SITES = 4
"""At most this many call sites of each kind are kept (the first ones)."""
MAX_LOADERS = 4
MAX_SAVES = 8
"""Distinct files written with `torch.save` that a rank records while observed."""
MAX_COLLECTIVE_LOG = 64
"""At most this many of the script's collectives are logged by name (every one is counted in the digests)."""
MAX_STEP_LOG = 64
"""At most this many entries of each per-step log (the optimizer's settings, scheduler calls, changes outside the
optimizer, gradients reduced again)."""


class StepState:
    """What the hooks have seen of the step in progress."""

    def __init__(self, n_params: int) -> None:
        self.used = bytearray(n_params)
        """Nonzero: the parameter got a gradient. Bit k: in the k-th backward pass through its forward (the last
        bit stands for every pass after the seventh), so passes that used different sets show as different values
        without a pass over the parameters per backward."""
        self.pass_bit = 1
        """The bit the gradient hooks set: the backward pass in progress (or next) through the current forward."""
        self.pass_sites: list[str] = []
        """`file:line` of each backward pass of this step, while no step's passes were seen to differ."""
        self.reachable = bytearray(n_params)
        self.ran = bytearray(n_params)
        self.counters = StepCounters(complete=1)
        self.input_fp = torch.zeros(2, dtype=torch.float64)
        self.buffer_fp: torch.Tensor | None = None
        self.grad_fp: torch.Tensor | None = None
        """The gradients' fingerprints as the optimizer step used them (see `StepCounters.grads_measured`)."""
        self.grad_present: list[bool] | None = None
        """Which of those gradients existed when they were fingerprinted (a NaN fingerprint is a missing one too)."""
        self.synced_fp: torch.Tensor | None = None
        """... when the step's last synced backward ended, after DDP's all-reduce."""
        self.synced_grads: list[torch.Tensor | None] = []
        """The `.grad` tensors then, and their in-place version counters: a gradient neither replaced nor written
        since keeps its fingerprint, so the optimizer's pre-hook fingerprints only the others."""
        self.synced_versions: list[int] = []
        self.sync_off: str | None = None
        """Where DDP's gradient sync was turned off, for a forward of this step that ran without it."""
        self.grad_ids: dict[int, int] | None = None
        """`id(p.grad)` -> the parameter's position, once a collective after the synced backward asked."""
        self.started = False
        self.computed = False
        """A synced backward of this step computed every gradient (DDP's all-reduce may still be in flight)."""
        self.t_forward = 0.0
        self.t_backward = 0.0
        self.t_optimizer = 0.0
        self.t_input = 0.0
        """Waiting for the step's input: before each training forward, since the previous step or backward."""
        self.t_comm = 0.0
        """Waiting in DDP's gradient communication: from autograd's end to DDP's finalize, in each backward."""

    @property
    def active(self) -> bool:
        """Something of this step happened (a forward started, or a gradient arrived)."""
        return self.started or any(self.used)


def runq_seconds(schedstat: str) -> float:
    """Seconds a thread has waited for a CPU so far, from its `schedstat` file (`/proc/self/task/<tid>/schedstat`,
    the second field: Linux's run-queue delay); 0.0 where there is none to read."""
    try:
        with open(schedstat) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class StepLog:
    """The closed steps of one rank, one row per `RankRecord` tensor field and step.

    Args:
        params: the model's parameters, in `named_parameters()` order.
        buffers: the model's buffers, in `named_buffers()` order.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], buffers: Sequence[torch.Tensor]) -> None:
        # The thread that runs the training loop: the run-queue delay is read for it, whichever thread closes a step
        # (CUDA's backward runs the hooks on the device's autograd thread).
        self._schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._runq = self._runq_now()
        self._params = list(params)
        self._buffers = list(buffers)
        self._rows: dict[str, list[torch.Tensor]] = {k: [] for k in RankRecord.TENSOR_FIELDS}
        self._rows["weight_fp"].append(fingerprints(self._params))  # before step 0
        self.bypass_sites: list[str] = []
        """`file:line` of user code that called the wrapped module directly."""
        self.blocked_checkpoints: list[str] = []
        """`file:line` of reentrant checkpoint calls with no grad-requiring input."""
        self.repeat_sites: list[str] = []
        """`step N: file:line` of each synced DDP forward after the first in a step."""
        self.step_sites: list[str] = []
        """`file:line` of the synced DDP forwards that began a step's synced passes, each once."""
        self.unpaired_sites: list[str] = []
        """`step N: file:line` of synced DDP forwards in grad mode that no backward followed."""
        self.broadcast_sites: list[str] = []
        """`step N: file:line` of DDP forwards without grad that broadcast the buffers."""
        self.collective_log: list[str] = []
        """The first script collectives, `step N: all_reduce(float32[1])/2 at file:line`."""
        self.loaders: list[dict[str, Any]] = []
        """The DataLoaders iterated while observed (at most `MAX_LOADERS`)."""
        self.after_steps = False
        """The observed steps are over and `check` follows the script through its epoch ends."""
        self.saves: list[dict[str, Any]] = []
        """The files written with `torch.save` while observed (at most `MAX_SAVES` distinct paths)."""
        self.optimizer_log: list[str] = []
        """`step N: group 0 (4 tensors) lr=0.1, ...` at each optimizer step."""
        self.scheduler_sites: list[str] = []
        """`step N: file:line` of each LR scheduler step()."""
        self.metric_schedulers: list[str] = []
        """`file:line` of each step(metric) of a scheduler that reads a metric (ReduceLROnPlateau), each once."""
        self.changed_sites: list[str] = []
        """`step N: <how>` of each change to the parameters outside the optimizer."""
        self.changed_params: list[int] = []
        """Positions of the parameters changed outside the optimizer, the first time it happened."""
        self.rereduce_sites: list[str] = []
        """`step N: all_reduce(float32[16, 8], SUM)/2 at file:line` of collectives on already reduced gradients."""
        self.pass_sites: list[str] = []
        """`step N: file:line` of the backward passes of the first step whose passes used different parameters."""
        self.device: DeviceClock | None = None
        self.nonfinite_params: list[int] = []
        """Positions of the parameters whose gradient was not finite, in the first step where one was not."""
        self._grad_nonzero: torch.Tensor | None = None
        self._weights_moved: torch.Tensor | None = None
        """Per parameter, over the observed steps: it had a finite gradient other than 0; its weights changed."""
        self.state: StateScan | None = None
        """Walks the module tree as each step closes (`tree_scan.py`); None: not scanned."""
        """The GPU's clock for a model on CUDA (the host's times do not tell there), set by the caller."""
        self.split_params: list[int] = []
        """Positions of the parameters some of those passes did not reach."""
        self.grad_edit_sites: list[str] = []
        """`step N: clip_grad_norm_(max_norm=0.5) at file:line` of each gradient clipping call."""
        self.nosync_sites: list[str] = []
        """`no_sync() at file:line` (or the flag's assignment) for steps none of whose backward passes were synced."""
        self._synced_rows: list[torch.Tensor] = []
        self._edited = False
        """Some step's gradients changed between its synced backward and the optimizer step."""

    @property
    def steps(self) -> int:
        """Closed steps so far."""
        return len(self._rows["used"])

    def close(self, step: StepState, *, complete: bool) -> None:
        """Append `step` (whose counters say whether it ran to the end) and the weights after it."""
        n = len(self._params)
        step.counters.complete = int(complete)
        rows = self._rows
        used = torch.frombuffer(bytearray(step.used), dtype=torch.uint8) if n else torch.zeros(0, dtype=torch.uint8)
        got = used[used > 0]
        # Two used parameters whose pass bits differ: some backward pass used one and not the other.
        if got.numel() and int(got.min()) != int(got.max()):
            step.counters.split_passes = 1
            if not self.split_params:
                passes = 0
                for bit in range(8):  # every pass of the step (the bits some parameter has)
                    if bool(((got >> bit) & 1).any()):
                        passes |= 1 << bit
                self.split_params = ((used > 0) & (used != passes)).nonzero().flatten().tolist()[:64]
                self.pass_sites = [f"step {self.steps}: {site}" for site in step.pass_sites[:MAX_SITES]]
        elif not complete and step.pass_bit > 1:
            # Crashed after a backward pass through the forward it crashed in: a later pass failed (DDP had
            # prepared one reduction for the forward, or the first pass left it unfinished).
            step.counters.split_passes = 2
            if not self.pass_sites:
                self.pass_sites = [f"step {self.steps}: {site}" for site in step.pass_sites[:MAX_SITES]]
        rows["used"].append(used > 0)
        rows["reachable"].append(torch.tensor(list(step.reachable), dtype=torch.bool))
        rows["ran"].append(torch.tensor(list(step.ran), dtype=torch.bool))
        rows["trainable"].append(torch.tensor([p.requires_grad for p in self._params], dtype=torch.bool))
        grad_fp = step.grad_fp if step.grad_fp is not None else step.synced_fp
        if grad_fp is None:
            grad_fp = torch.full((n, 2), float("nan"), dtype=torch.float64)
        rows["grad_fp"].append(grad_fp)
        synced = step.synced_fp if step.synced_fp is not None else grad_fp
        self._synced_rows.append(synced)
        if synced is not grad_fp and not self._edited:
            self._edited = not bool(((synced == grad_fp) | (synced.isnan() & grad_fp.isnan())).all())
        counters = step.counters
        if counters.optimizer_step and counters.micro_steps and not counters.synced_backwards:
            self.note_site(self.nosync_sites, step.sync_off)
        weights = fingerprints(self._params)
        self._moves(counters, used > 0, grad_fp, step.grad_present, rows["weight_fp"][-1], weights)
        rows["weight_fp"].append(weights)
        rows["buffer_fp"].append(
            step.buffer_fp
            if step.buffer_fp is not None
            else torch.full((len(self._buffers), 2), float("nan"), dtype=torch.float64)
        )
        rows["input_fp"].append(step.input_fp)
        runq, self._runq = self._runq, self._runq_now()
        rows["timing"].append(
            torch.tensor(
                [step.t_forward, step.t_backward, step.t_optimizer, step.t_input, step.t_comm, self._runq - runq]
                + [float("nan")] * 2,
                dtype=torch.float64,
            )
        )
        if self.state is not None:
            self.state.close_step(step.counters, self.steps - 1)
        rows["counters"].append(torch.tensor(step.counters.as_list(), dtype=torch.int64))

    def _moves(
        self,
        counters: StepCounters,
        used: torch.Tensor,
        grads: torch.Tensor,
        present: list[bool] | None,
        before: torch.Tensor,
        after: torch.Tensor,
    ) -> None:
        """Whether training moves (from the fingerprints already taken): gradients present, exactly zero or not
        finite; weights that changed in the step, or hold a NaN or an infinity after it. A fingerprint is NaN for a
        missing gradient too: only the gradients that existed when they were fingerprinted count (a second
        optimizer's, cleared before this one stepped, did not), among the parameters that got one in the step."""
        if present is None:
            present = [p.grad is not None for p in self._params]
        used = used & torch.tensor(present, dtype=torch.bool)
        finite = grads.isfinite().all(-1)
        counters.grads_present = int(used.sum())
        counters.grads_zero = int((used & (grads == 0).all(-1)).sum())
        counters.grads_nonfinite = int((used & ~finite).sum())
        if counters.grads_nonfinite and not self.nonfinite_params:
            self.nonfinite_params = (used & ~finite).nonzero().flatten().tolist()[:64]
        same = (before == after) | (before.isnan() & after.isnan())
        counters.weights_moved = int((~same.all(-1)).sum())
        # A gradient of round-off only (a bias before a BatchNorm) is no gradient an optimizer step could apply.
        nonzero, moved = used & finite & significant(grads.abs().amax(-1)), ~same.all(-1)
        self._grad_nonzero = nonzero if self._grad_nonzero is None else self._grad_nonzero | nonzero
        self._weights_moved = moved if self._weights_moved is None else self._weights_moved | moved
        counters.weights_nonfinite = int((~after.isfinite().all(-1)).sum())

    def _runq_now(self) -> float:
        return runq_seconds(self._schedstat)

    def missing(self, names: list[str], limit: int) -> list[str]:
        """Names of the parameters trainable at the end of the last closed step that got no gradient in it."""
        if not self._rows["used"]:
            return []
        used, trainable = self._rows["used"][-1], self._rows["trainable"][-1]
        return [n for n, u, t in zip(names, used.tolist(), trainable.tolist()) if t and not u][:limit]

    def note_site(self, sites: list[str], site: str | None) -> None:
        """Add `site` to one of the site lists, once, and at most `MAX_SITES` of them."""
        if site and site not in sites and len(sites) < MAX_SITES:
            sites.append(site)

    def note_step(self, log: list[str], text: str) -> None:
        """Add `step N: text` to one of the per-step logs (at most `MAX_STEP_LOG` entries)."""
        if len(log) < MAX_STEP_LOG:
            log.append(f"step {self.steps}: {text}")

    def note_loader(self, info: dict[str, Any]) -> None:
        """A DataLoader started iterating: a new loader, or a new epoch of a known one."""
        # The first loader iterated while observed is the training loader in the usual loop; later starts of the
        # same loader are new epochs.
        # A loader created anew each epoch at the same line, with the same length and sampler, is the same loader.
        known = next(
            (
                d
                for d in self.loaders
                if d["id"] == info["id"]
                or (
                    info.get("site") is not None
                    and (d.get("site"), d.get("batches"), d.get("sampler"))
                    == (info.get("site"), info.get("batches"), info.get("sampler"))
                )
            ),
            None,
        )
        one_pass = {"epoch": info.get("epoch"), "counted": info.get("pass")}
        if known is not None:
            known["passes"].append(one_pass)
        elif len(self.loaders) < MAX_LOADERS:
            fields = {k: v for k, v in info.items() if k != "pass"}
            self.loaders.append({**fields, "passes": [one_pass], "first_step": self.steps})

    @staticmethod
    def _epochs(loader: dict[str, Any]) -> dict[str, Any]:
        """A loader as the record keeps it: its passes that were epochs (`epochs_started`, `epochs_seen`). A pass that
        yielded one batch of several and was dropped is a peek at the data, not an epoch."""
        out = {k: v for k, v in loader.items() if k not in ("id", "passes")}
        epochs = [
            p["epoch"]
            for p in loader["passes"]
            if p["counted"] is None or p["counted"].was_epoch(loader.get("batches"))
        ]
        out["epochs_started"], out["epochs_seen"] = max(1, len(epochs)), epochs or [loader["passes"][0]["epoch"]]
        out["peeks"] = len(loader["passes"]) - len(epochs)
        # Whether an optimizer step took a batch from it (None: not known, outside `check`): an evaluation loader's
        # order does not matter, so its sampler's epoch does not either.
        counted = [p["counted"] for p in loader["passes"] if p["counted"] is not None]
        out["trained"] = any(c.steps for c in counted) if counted else None
        return out

    def note_save(self, info: dict[str, Any]) -> None:
        """`torch.save` wrote a file: the first write of each path, with its line and the last step closed before
        it (`step`, -1 before the first; a checkpoint is written between steps)."""
        if not any(d["path"] == info["path"] for d in self.saves) and len(self.saves) < MAX_SAVES:
            self.saves.append({**info, "step": self.steps - 1, **({"followed": True} if self.after_steps else {})})

    def note_collective(self, step: StepState, call: Call, site: str | None) -> None:
        """The script entered `call` during `step`: count it, fold it into the step's digest, log it by name."""
        step.counters.collectives += 1
        step.counters.collective_digest = digest(step.counters.collective_digest, call)
        if len(self.collective_log) < MAX_COLLECTIVE_LOG:
            self.collective_log.append(f"step {self.steps}: {call.signature()} at {site or 'an unknown place'}")

    def record(self, rank: int) -> RankRecord:
        """The closed steps and the sites seen, as a `RankRecord` (without the crash, which the caller stamps)."""
        if not self._rows["used"]:
            record = RankRecord.empty(rank, len(self._params), len(self._buffers))
            record.weight_fp = self._rows["weight_fp"][0].unsqueeze(0)
        else:
            record = RankRecord(rank=rank, **{k: torch.stack(v) for k, v in self._rows.items()})
        record.bypass_sites = list(self.bypass_sites)
        record.blocked_checkpoints = list(self.blocked_checkpoints)
        record.repeat_sites = list(self.repeat_sites)
        record.step_sites = list(self.step_sites)
        record.unpaired_sites = list(self.unpaired_sites)
        record.broadcast_sites = list(self.broadcast_sites)
        record.collective_log = list(self.collective_log)
        record.optimizer_log = list(self.optimizer_log)
        record.scheduler_sites = list(self.scheduler_sites)
        record.metric_schedulers = list(self.metric_schedulers)
        record.changed_sites = list(self.changed_sites)
        record.changed_params = list(self.changed_params)
        record.rereduce_sites = list(self.rereduce_sites)
        record.pass_sites = list(self.pass_sites)
        record.split_params = list(self.split_params)
        record.grad_edit_sites = list(self.grad_edit_sites)
        record.nosync_sites = list(self.nosync_sites)
        record.nonfinite_params = list(self.nonfinite_params)
        if self._grad_nonzero is not None and self._weights_moved is not None:
            never = (self._grad_nonzero & ~self._weights_moved).nonzero().flatten().tolist()[:64]
            record.never_updated = never
            if self.state is not None and never:
                held = self.state.optimizer_holds([self._params[i] for i in never])
                record.never_updated_held = sum(h for h, _ in held)
                record.never_updated_zero_lr = sum(z for _, z in held)
        if self.state is not None:
            record.state_log = list(self.state.log)
            record.unregistered = list(self.state.unregistered)
            record.orphaned = list(self.state.orphaned)
            record.retied = list(self.state.retied)
            record.recast = list(self.state.recast)
            record.recast_count = self.state.recast_count
            record.late_buffers = list(self.state.late_buffers)
            record.late_count = self.state.late_count
            record.unreadable = list(self.state.unreadable)
            record.optimizer_stale = self.state.stale
            record.outside = list(self.state.outside)
            record.outside_count = self.state.outside_count
            record.modules = self.state.modules
            record.learning_rates = list(self.state.learning_rates)
        record.to_empty_sites = list(TO_EMPTY_SITES)
        record.join_sites = list(JOIN_SITES)
        record.join_throws = list(JOIN_THROWS)
        if self._edited:
            record.synced_grad_fp = torch.stack(self._synced_rows)
        if self.device is not None and record.timing.shape[0]:
            for step, wait, took in self.device.measured():
                if step is not None and step < record.timing.shape[0]:
                    record.timing[step, 6:] = torch.tensor([wait, took], dtype=torch.float64)
        record.loaders = [self._epochs(d) for d in self.loaders]
        record.saves = list(self.saves)
        return record
