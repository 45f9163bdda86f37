"""The data that flows from observe, through the exchange, into analyze.

`ModelInfo` is what every rank knows about the model before the first step. `RankRecord` is what one rank saw
during the observed steps: only local facts, never the result of a collective. Both are plain data, so
`analyze` can be tested on hand-built records without a process group.
"""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from ddp_doctor.core.codes import Code
from ddp_doctor.core.counters import StepCounters

__all__ = [
    "CRASH_KINDS",
    "TIMING_COLUMNS",
    "Flavor",
    "ModelInfo",
    "RankRecord",
    "StepCounters",
    "decode_scale",
    "encode_scale",
]

TIMING_COLUMNS = 8
"""Columns of `RankRecord.timing`: forward, backward, optimizer, input wait, communication wait, CPU wait (the time
the rank's main thread was ready to run but waited for a CPU: Linux's run-queue delay; 0 where it cannot be read),
and on the GPU's clock (a DDP model on CUDA, `observation/device_clock.py`) the wait from the previous step's end to
the forward and the step since the previous step's end (NaN where not timed on a GPU)."""
CRASH_KINDS = (
    "none",
    Code.REDUCTION_ERROR.value,
    "static-graph-changed",
    "mark-ready-twice",
    "ddp-other",
    "other",
    "other-model",
    "exit",
)
"""How a rank's observed loop ended early; index = the number stored in a record. DDP's reduction error is the kind
named by the code of the finding that explains it (compared as `Code.REDUCTION_ERROR`)."""


def encode_scale(scale: float) -> int:
    """A GradScaler scale as the bits of a float32: an int that a record's int64 counters carry exactly (0: no
    scaler). `StepCounters.scaler_scale` holds it; the analysis reads it back with `decode_scale`."""
    return struct.unpack("<i", struct.pack("<f", scale))[0]


def decode_scale(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", int(bits)))[0]


@dataclass(kw_only=True)
class Flavor:
    """The installed framework versions a fix must be phrased for, read where the model was built.

    Recorded with the model so that analysis and rendering depend on the records only, never on what happens to
    be imported in the process that renders.
    """

    lightning_package: str = "lightning.pytorch"
    """`lightning.pytorch`, or `pytorch_lightning` when only that package was imported."""
    transformers_version: str = ""
    """The imported transformers' version ("" when it was not imported)."""
    training_arguments_fields: list[str] | None = None
    """The `ddp_*` fields of the imported `TrainingArguments` (4.x has no `ddp_static_graph`); None when
    transformers was not imported, and then every field is assumed to exist."""


@dataclass(kw_only=True)
class ModelInfo:
    """The model as DDP wrapped it. Identical on every rank of a healthy job."""

    param_names: list[str]
    """Names from `ddp.module.named_parameters()`, in that order (shared parameters appear once)."""
    param_shapes: list[tuple[int, ...]]
    trainable_at_wrap: list[bool]
    """`requires_grad` when DDP was built, for parameters DDP does not ignore: the set DDP's reducer reduces."""
    ignored: list[bool]
    """Parameters listed in `_ddp_params_and_buffers_to_ignore`: DDP never touches them."""
    buffer_names: list[str]
    buffer_shapes: list[tuple[int, ...]]
    ddp_config: dict[str, Any]
    """The flags the script built DDP with (`find_unused_parameters`, `static_graph`, ...)."""
    device_type: str = ""
    """The device type DDP runs the model on (`ddp.device_type`: `cpu`, `cuda`, ...; empty when not known)."""
    buffers_synced: bool | None = None
    """DDP broadcasts rank 0's buffers before each forward: built with `broadcast_buffers=True` and holding buffers
    then (read from DDP by `ddp_broadcasts_buffers`; a record built without a DDP instance derives it from the flag
    and `buffer_names`). The one place the analysis and the observation learn it."""
    wrap_state_exact: bool = True
    """False when the trainable set at wrap time had to be inferred from the state at `observe()` entry."""
    wrap_trainable_count: int | None = None
    """How many parameter tensors DDP's reducer was built with, from DDP's own logging data."""
    ddp_site: str | None = None
    """`file:line` of the user code that built DDP, when it was seen."""
    framework: str = "torch"
    """Who built the DDP model: torch, transformers, accelerate or lightning."""
    group_ranks: list[int] | None = None
    """The global ranks of the DDP model's process group, in group order, when it is a subgroup (None: the world).
    Analysis works in group ranks; findings are mapped to these at the end."""
    batchnorm: list[str] = field(default_factory=list)
    """Names of the model's BatchNorm layers that are not SyncBatchNorm: each rank normalizes over its own batch."""
    flavor: Flavor = field(default_factory=Flavor)
    """The framework versions installed where the model was built (how fixes and snippets are phrased)."""

    def __post_init__(self) -> None:
        if self.buffers_synced is None:
            self.buffers_synced = bool(self.buffer_names) and bool(self.ddp_config.get("broadcast_buffers", True))
        n = len(self.param_names)
        if not (len(self.param_shapes) == len(self.trainable_at_wrap) == len(self.ignored) == n):
            raise ValueError(
                f"ModelInfo lists disagree: {n} names, {len(self.param_shapes)} shapes, "
                f"{len(self.trainable_at_wrap)} trainable flags, {len(self.ignored)} ignore flags"
            )

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.param_shapes]

    def to_dict(self) -> dict[str, Any]:
        return {
            "param_names": self.param_names,
            "param_shapes": [list(s) for s in self.param_shapes],
            "trainable_at_wrap": self.trainable_at_wrap,
            "ignored": self.ignored,
            "buffer_names": self.buffer_names,
            "buffer_shapes": [list(s) for s in self.buffer_shapes],
            "ddp_config": self.ddp_config,
            "wrap_state_exact": self.wrap_state_exact,
            "wrap_trainable_count": self.wrap_trainable_count,
            "ddp_site": self.ddp_site,
            "framework": self.framework,
            "group_ranks": self.group_ranks,
            "batchnorm": self.batchnorm,
            "flavor": asdict(self.flavor),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelInfo:
        return cls(
            **{
                **d,
                "param_shapes": [tuple(s) for s in d["param_shapes"]],
                "buffer_shapes": [tuple(s) for s in d["buffer_shapes"]],
                "flavor": Flavor(**d.get("flavor", {})),
            }
        )


@dataclass(kw_only=True)
class RankRecord:
    """Everything one rank saw. S = observed steps, P = parameters, B = buffers.

    Fingerprints are float64 pairs (see `fingerprint.py`); NaN marks "no gradient" (`grad is None`).
    """

    rank: int
    used: torch.Tensor
    """bool[S, P]: the parameter's grad was accumulated by autograd during the step (it reached the loss)."""
    reachable: torch.Tensor
    """bool[S, P]: the parameter is reachable from the autograd graph of DDP's forward outputs."""
    trainable: torch.Tensor
    """bool[S, P]: `requires_grad` at the end of the step."""
    ran: torch.Tensor
    """bool[S, P]: the module that owns the parameter ran in the step's forward (in a training forward, even under
    `no_grad` or a checkpoint inside it): evidence that the script means to use it."""
    grad_fp: torch.Tensor
    """float64[S, P, 2]: gradient fingerprint as the optimizer saw it (NaN: no grad), taken where
    `StepCounters.grads_measured` says."""
    weight_fp: torch.Tensor
    """float64[S + 1, P, 2]: weight fingerprint before step 0, then after each step."""
    buffer_fp: torch.Tensor
    """float64[S, B, 2]: buffer fingerprint at the first forward of the step, after DDP's buffer broadcast."""
    input_fp: torch.Tensor
    """float64[S, 2]: fingerprint of every tensor the wrapped module received during the step."""
    timing: torch.Tensor
    """float64[S, 6]: seconds of forward, backward (DDP's wait included), optimizer, the wait for the step's input
    (from the end of the previous step, or of the previous micro-step's backward, to the forward; NaN where no
    previous step was seen), DDP's communication wait (from autograd's end to DDP's finalize, within backward) and
    the main thread's wait for a CPU over the step (run-queue delay: a machine busy with other work)."""
    counters: torch.Tensor
    """int64[S, len(StepCounters.FIELDS)]."""
    crash_kind: int = 0
    """Index into `CRASH_KINDS`."""
    crash_step: int = -1
    crash_message: str = ""
    crash_site: str = ""
    """`file:line  code` of the user's innermost frame on the crash's traceback ("" when none is the user's)."""
    bypass_sites: list[str] = field(default_factory=list)
    """`file:line` of user code that called the wrapped module directly."""
    blocked_checkpoints: list[str] = field(default_factory=list)
    """`file:line` of reentrant checkpoint calls none of whose inputs required grad (no gradient reaches them)."""
    loaders: list[dict[str, Any]] = field(default_factory=list)
    """The DataLoaders iterated while observed (at most 4): batches per epoch, sampler kind, padding, epochs."""
    repeat_sites: list[str] = field(default_factory=list)
    """`step N: file:line` of each synced DDP forward after the first in a step."""
    step_sites: list[str] = field(default_factory=list)
    """`file:line` of the synced DDP forwards that began a step's synced passes, each once."""
    unpaired_sites: list[str] = field(default_factory=list)
    """`step N: file:line` of synced DDP forwards in grad mode that no backward followed (see `unpaired_forwards`)."""
    broadcast_sites: list[str] = field(default_factory=list)
    """`step N: file:line` of DDP forwards without grad that broadcast the buffers (see `eval_broadcasts`)."""
    collective_log: list[str] = field(default_factory=list)
    """The first script collectives of the observed steps (at most `MAX_COLLECTIVE_LOG`), as
    `step N: all_reduce(float32[1], SUM)/2 at file:line`: what names a mismatch that the per-step digests reveal."""
    optimizer_log: list[str] = field(default_factory=list)
    """Per step with an optimizer step: `step N: group 0 lr=0.05, momentum=0.9; group 1 ...`, what names the field
    that `optimizer_digest` shows to differ (at most `MAX_STEP_LOG` steps)."""
    scheduler_sites: list[str] = field(default_factory=list)
    """`step N: file:line` of the LR scheduler's `step()` calls."""
    metric_schedulers: list[str] = field(default_factory=list)
    """`file:line` of the `step(metric)` calls of a scheduler that reads a metric (ReduceLROnPlateau)."""
    changed_sites: list[str] = field(default_factory=list)
    """`step N: <how> at file:line` of changes to the parameters outside the optimizer (`changed_outside`)."""
    changed_params: list[int] = field(default_factory=list)
    """Positions of the parameters changed outside the optimizer, the first step it happened."""
    rereduce_sites: list[str] = field(default_factory=list)
    """`step N: all_reduce(SUM)/2 at file:line` of collectives on gradients DDP had already reduced."""
    pass_sites: list[str] = field(default_factory=list)
    """`step N: file:line` of each backward pass of the first forward whose passes used different parameters."""
    split_params: list[int] = field(default_factory=list)
    """Positions of the parameters that got a gradient in some but not every backward pass through one forward,
    in the first step where the passes differed (see `StepCounters.split_passes`)."""
    saves: list[dict[str, Any]] = field(default_factory=list)
    """The files written with `torch.save` while observed (at most `MAX_SAVES`): `path`, `site`, `step`,
    `module_prefix` (the DDP wrapper's state dict), `host` and `local_rank` (the writer's machine and its rank
    there)."""
    synced_grad_fp: torch.Tensor | None = None
    """float64[S, P, 2]: the gradient fingerprints when the step's last synced backward ended (DDP's all-reduce
    done), where they differ from `grad_fp` in some step: something changed `.grad` between the backward and
    `optimizer.step()`. None: the same as `grad_fp` in every step (nothing changed them, or no synced backward)."""
    grad_edit_sites: list[str] = field(default_factory=list)
    """`step N: clip_grad_norm_(max_norm=0.5) at file:line` of the gradient clipping calls while observed."""
    nosync_sites: list[str] = field(default_factory=list)
    """`no_sync() at file:line` or `require_backward_grad_sync=False at file:line`: where DDP's gradient sync was
    turned off for steps none of whose backward passes DDP reduced (at most `MAX_SITES`)."""
    state_log: list[dict[str, Any]] = field(default_factory=list)
    """Whenever what the module tree held changed (`StepCounters.state_digest`): `step`, `training`, `other_mode`
    (modules in the other mode than the model's), `other_mode_count`, `unregistered` (`observation.tree_scan`)."""
    unregistered: list[dict[str, Any]] = field(default_factory=list)
    """The trainable parameters DDP's reducer does not hold at the last step: `name`, `shape`, `site`, `stepped`,
    `used`, `data`, `readable`, `fp` (`observation.tree_scan.StateScan.unregistered`)."""
    orphaned: list[int] = field(default_factory=list)
    """Positions of parameters DDP registered that the module tree no longer holds at the last step (a module
    replaced after DDP was built left them behind: they get no gradient, and nothing the script does uses them)."""
    retied: list[dict[str, Any]] = field(default_factory=list)
    """Names that held one of `orphaned` and now hold another parameter DDP registered (a weight tied after DDP was
    built): `name`, `now`, `site` (`observation.tree_scan.StateScan.retied`)."""
    recast: list[dict[str, Any]] = field(default_factory=list)
    """Parameters DDP registered whose dtype or device changed after it was built: `name`, `was`, `now`, `site`
    (`observation.tree_scan.StateScan.recast`); `recast_count` of them in all."""
    recast_count: int = 0
    join_sites: list[str] = field(default_factory=list)
    """Where the script entered a `Join` over a DDP model (`observation.joins.JOIN_SITES`): ranks that run out of
    batches there shadow the others' collectives."""
    join_throws: list[str] = field(default_factory=list)
    """Those of `join_sites` whose Join throws when a rank runs out (throw_on_early_termination=True)."""
    late_buffers: list[dict[str, Any]] = field(default_factory=list)
    """When DDP does not broadcast them, the buffers registered under a new name after DDP was built: `name`, `shape`,
    `fp`, `changing`, `site` (`observation.tree_scan.StateScan.late_buffers`)."""
    late_count: int = 0
    """How many buffers were registered after the wrap (`late_buffers` names at most 8)."""
    unreadable: list[dict[str, Any]] = field(default_factory=list)
    """Tensors in the module tree beyond DDP's whose values the check cannot read: `name`, `kind` (`parameter`,
    `buffer`), `type`, `data` (`observation.tree_scan.StateScan.unreadable`)."""
    optimizer_stale: int = 0
    """Tensors the observed optimizer steps that the model no longer holds, at the last step."""
    comm_hook: dict[str, Any] | None = None
    """The comm hook registered on the DDP model when the report was made: `name`, `site` where the script defines
    it (`observation.wrapstate.comm_hook_of`); None: DDP's own all-reduce."""
    outside: list[dict[str, Any]] = field(default_factory=list)
    """Trainable tensors the observed optimizer steps that the model never held: `name`, `shape`, `grad`, `fp`
    (`observation.tree_scan.StateScan.outside`)."""
    outside_count: int = 0
    """How many such tensors there are (`outside` lists at most 8)."""
    modules: int = 0
    """Modules in the tree at the last step, whose train/eval modes `StepCounters.state_digest` covers."""
    to_empty_sites: list[str] = field(default_factory=list)
    """Where the script materialised a model from the meta device (`nn.Module.to_empty()`), when seen."""
    learning_rates: list[float] = field(default_factory=list)
    """The observed optimizer's learning rate per param group at the last step."""
    nonfinite_params: list[int] = field(default_factory=list)
    """Positions of the parameters whose gradient held a NaN or an infinity, in the first step where one did."""
    never_updated: list[int] = field(default_factory=list)
    """Positions of the parameters whose gradient held a finite value other than 0 at some observed step and whose
    weights changed at none (the first 64)."""
    never_updated_held: int = 0
    """How many of `never_updated` the observed optimizer holds."""
    never_updated_zero_lr: int = 0
    """How many of `never_updated` it holds in a param group whose learning rate is 0."""
    graph_collectives: list[dict[str, Any]] = field(default_factory=list)
    """The script's in-place reductions of a tensor autograd tracks that a backward went through, per line
    (`observation.graph_collectives.GraphCollectives.found`)."""
    beside_modules: list[dict[str, Any]] = field(default_factory=list)
    """The modules the script called outside DDP's forward (a distillation teacher), at the last step: `name`,
    `site`, `tensors`, `numel`, `fp` (`observation.beside_modules.BesideModules.entries`)."""
    model_averaging: dict[str, Any] | None = None
    """When a model averager (post-local SGD) averaged the parameters: after which steps, over how many ranks, from
    which line (`observation.model_averaging.Averagings.found`)."""

    TENSOR_FIELDS: ClassVar[tuple[str, ...]] = (
        "used",
        "reachable",
        "trainable",
        "ran",
        "grad_fp",
        "weight_fp",
        "buffer_fp",
        "input_fp",
        "timing",
        "counters",
    )
    """The per-step tensor fields, in packing order."""

    @property
    def steps(self) -> int:
        return int(self.used.shape[0])

    def counter(self, name: str) -> torch.Tensor:
        """The int64[S] column of one `StepCounters` field."""
        return self.counters[:, StepCounters.FIELDS.index(name)]

    @staticmethod
    def empty(rank: int, n_params: int, n_buffers: int) -> RankRecord:
        return RankRecord(
            rank=rank,
            used=torch.zeros(0, n_params, dtype=torch.bool),
            reachable=torch.zeros(0, n_params, dtype=torch.bool),
            trainable=torch.zeros(0, n_params, dtype=torch.bool),
            ran=torch.zeros(0, n_params, dtype=torch.bool),
            grad_fp=torch.zeros(0, n_params, 2, dtype=torch.float64),
            weight_fp=torch.zeros(1, n_params, 2, dtype=torch.float64),
            buffer_fp=torch.zeros(0, n_buffers, 2, dtype=torch.float64),
            input_fp=torch.zeros(0, 2, dtype=torch.float64),
            timing=torch.zeros(0, TIMING_COLUMNS, dtype=torch.float64),
            counters=torch.zeros(0, len(StepCounters.FIELDS), dtype=torch.int64),
        )

    # Packing: one float64 vector of a length that depends only on (S, P, B), so that every rank's vector
    # has the same shape once S is agreed on. Steps a rank did not reach are padded and masked by `steps`.

    @staticmethod
    def _shapes(steps: int, n_params: int, n_buffers: int) -> dict[str, tuple[int, ...]]:
        c = len(StepCounters.FIELDS)
        shapes = {
            "used": (steps, n_params),
            "reachable": (steps, n_params),
            "trainable": (steps, n_params),
            "ran": (steps, n_params),
            "grad_fp": (steps, n_params, 2),
            "weight_fp": (steps + 1, n_params, 2),
            "buffer_fp": (steps, n_buffers, 2),
            "input_fp": (steps, 2),
            "timing": (steps, TIMING_COLUMNS),
            "counters": (steps, c),
        }
        assert tuple(shapes) == RankRecord.TENSOR_FIELDS
        return shapes

    @staticmethod
    def packed_size(steps: int, n_params: int, n_buffers: int) -> int:
        """float64 numbers in a record of `steps` steps: what the all_gather exchange that the reductions of
        `ddp_doctor.exchange` replaced sent from every rank to every rank (the scale benchmark's "before")."""
        return sum(math.prod(s) for s in RankRecord._shapes(steps, n_params, n_buffers).values())
