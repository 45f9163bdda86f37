"""What a check learns of a job that shards with FSDP2 (`fully_shard`) instead of DDP: the facts every rank agreed on,
in the one typed record the analysis reads (`analyze/sharded.py`) and the report's header draws."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddp_doctor.core.agreed import HeldApart
from ddp_doctor.core.findings import ParamRef

__all__ = ["INPUT_STEPS", "PARALLELISMS", "SCALE_TOLERANCE", "ShardedRun", "parallelism_of"]

PARALLELISMS = ("ddp", "fsdp2", "replicate")
"""The JSON's `parallelism`: what keeps the ranks' parameters in sync in the observed model: DDP, FSDP2's
`fully_shard`, or the FSDP2-based `replicate` (a full copy of each parameter on every rank, gradients all-reduced)."""


def parallelism_of(sharding: dict[str, Any] | None) -> str:
    """The `parallelism` of a run from its sharding (`ShardedModel.describe`; None for a DDP run)."""
    if sharding is None:
        return "ddp"
    return "replicate" if sharding.get("api") == "replicate" else "fsdp2"


SCALE_TOLERANCE = 0.01
"""The relative difference of two ranks' gradient-shard scales that counts as a different factor: far above the
rounding of a float32 or bfloat16 reduction, far below a clipping coefficient of its own."""
INPUT_STEPS = 16
"""The observed steps whose training inputs a sharded model's report compares across ranks (a fixed shape for the
exchange)."""


@dataclass(kw_only=True, slots=True)
class ShardedRun:
    """An FSDP2 model trained for `steps` optimizer steps, as every rank saw it (cross-rank facts already reduced)."""

    world: int
    steps: int
    """Optimizer steps observed (the first one included)."""
    optimizer: str
    """The optimizer's class name."""
    optimizer_site: str | None
    sharding: dict[str, Any]
    """The sharded modules, the mesh, `reshard_after_forward`, the mixed-precision dtypes (`ShardedModel.describe`)."""
    model_params: int
    """Trainable parameters of the model."""
    framework: str = "torch"
    """Who stepped the optimizer: `torch` (the script), `accelerate` or `transformers` (HF Trainer)."""
    replaced: int = 0
    """Parameters the optimizer steps that are not the model's and that no observed step gave a gradient (built
    before `fully_shard` replaced them). A tensor beside the model that gets gradients (a prompt tuned on a frozen
    model, a loss temperature) is in use: it is among `unsharded`, not here."""
    model_params_stepped: int = 0
    """Parameters of the model that the optimizer steps."""
    model_changed: bool = True
    """Whether any of the model's parameters changed on any rank between the first observed step and the last."""
    unsharded: list[ParamRef] = field(default_factory=list)
    """Trainable parameters outside every `fully_shard` group (plain tensors, not DTensors)."""
    unsharded_differ: list[bool] = field(default_factory=list)
    """Per `unsharded` parameter: its weights differ across ranks after the observed steps."""
    unsharded_gap: float = 0.0
    """The largest cross-rank difference of an unsharded parameter's weight fingerprint."""
    unsharded_changed: bool = False
    """Whether any `unsharded` parameter changed on any rank between the first observed step and the last."""
    weights_dtype: list[str] = field(default_factory=list)
    """The dtypes of the sharded parameters, which the optimizer steps (`bfloat16`, ...): FSDP2 keeps each in the
    dtype it had when `fully_shard` took it, whatever the mixed-precision policy computes in."""
    buffers_compared: int = 0
    """How many of the sharded model's buffers were compared across ranks at the last observed step (FSDP2 only;
    0 when the ranks held different numbers of buffers)."""
    buffers: list[ParamRef] = field(default_factory=list)
    """The sharded model's buffers, in the order of `buffers_differ` and `buffers_moved`; empty when the ranks held
    different numbers of them (nothing compared). FSDP2 neither broadcasts nor averages buffers."""
    buffers_differ: list[bool] = field(default_factory=list)
    """Per buffer: its fingerprints differ across ranks at the last observed step."""
    buffers_moved: list[bool] = field(default_factory=list)
    """Per buffer: it changed on some rank during the observed steps (running statistics do)."""
    graph_collectives: list[dict[str, Any]] = field(default_factory=list)
    """Rank 0's in-place reductions of tensors autograd tracks that a backward went through
    (`observation.graph_collectives.GraphCollectives.found`)."""
    buffers_unreadable: list[str] = field(default_factory=list)
    """Rank 0's buffers whose values the check cannot read (`fingerprint.readable`: a tensor subclass whose ops it
    cannot run), as `name (type)`: not compared, and not counted in `buffers_compared`."""
    inputs_compared: list[int] = field(default_factory=list)
    """The observed steps whose training forwards every rank saw (the first forward of the root module and those
    after, in grad mode), with their inputs compared across ranks by fingerprint."""
    scale_steps: list[int] = field(default_factory=list)
    """The observed steps at which every rank measured the ratio of its gradient shards at the optimizer step to the
    same at the end of the step's last backward (`observation/grad_scale.py`)."""
    scale_differ_steps: list[int] = field(default_factory=list)
    """Those of `scale_steps` at which the ratio differed across ranks (by more than 1%): the ranks scaled their
    shards by different factors between the end of the backward and the step."""
    scale_spread: float = 1.0
    """At the first of `scale_differ_steps`: the largest rank's scale over the smallest's (of the norms, not the
    squares)."""
    grads_measured_steps: list[int] = field(default_factory=list)
    """The observed steps (the first `INPUT_STEPS`) at which every rank measured its gradient shards' norm at the
    optimizer step."""
    grads_zero_steps: list[int] = field(default_factory=list)
    """Those of `grads_measured_steps` at which every rank's gradient shards were exactly zero."""
    grads_nonfinite_steps: list[int] = field(default_factory=list)
    """The observed steps at which some rank's gradient shards held NaN or infinity."""
    inputs_nonfinite: tuple[int, int] | None = None
    """The first observed step at which some rank's training inputs held NaN or infinity, and the lowest such rank."""
    learning_rates: list[float] = field(default_factory=list)
    """The optimizer's learning rate per param group, at the last observed step (rank 0's)."""
    state_steps: int = 0
    """The observed steps (the first `INPUT_STEPS`) at which every rank recorded its optimizer's settings and its
    modules' train/eval modes, compared across ranks by digest."""
    modules: int = 0
    """Modules in the model's tree (whose modes were compared)."""
    settings_apart: HeldApart | None = None
    """The first of those steps at which the optimizer's settings differed across ranks: the reference rank holds
    the most common settings; `held` maps it and the first other rank to their settings text. None when they
    agreed."""
    metric_schedulers: list[str] = field(default_factory=list)
    """Where rank 0 stepped a scheduler of its optimizer that reads a metric (ReduceLROnPlateau), `file:line`."""
    modes_apart: HeldApart | None = None
    """The same for the modules' modes; `held` maps a rank to its modes entry (`tree_scan.modes_of`)."""
    replica_rows: int = 0
    """The model's replica rows (1 under `replicate`, the shard dimension's size under HSDP); 0 where nothing is
    replicated, or the ranks disagree."""
    replicas_compared: int = 0
    """The parameters whose replicas were compared across the ranks that hold them, after the first observed step
    and after the last."""
    replicas_apart: dict[str, Any] | None = None
    """Where the replicas first differed: `at_first` (already after the first observed step), `first_step` (the
    first observed step after which their sums differed; None where not measured), `row` (the replica
    row), `params` (the parameters that differ there), `reference` (the rank holding the reference copy), `ranks`
    (those that differ from it, the lowest few) and `more`. None where they agreed."""
    script_collectives: int | None = None
    """The script's own collectives in those steps, as many on every rank; None where the counts differ."""
    collectives_apart: HeldApart | None = None
    """The same for the script's own collectives of the step (op, dtype, shape, reduction, group size, in order);
    `held` maps a rank to its first calls of the step, with their lines."""
    drawn_apart: HeldApart | None = None
    """The first of those steps for which the ranks drew different numbers of batches from the training loader:
    `held` maps a rank to (its batches, the loader's line)."""
    inputs_identical: bool = False
    """Every one of `inputs_compared` had the same inputs on every rank."""
    beside_compared: list[int] = field(default_factory=list)
    """The observed steps whose inputs were compared within each group of ranks beside the data-parallel mesh (the
    tensor-parallel groups of FSDP2 over tensor parallelism: `core/beside.py`); empty where there is none."""
    beside_groups: int = 0
    """How many such groups (the data-parallel degree) where their inputs were compared."""
    beside_dims: list[str] = field(default_factory=list)
    """The names of the mesh's dimensions along which a group's ranks differ (`["tp"]`)."""
    beside_apart: dict[str, Any] | None = None
    """The first of those steps at which some group's members fed different inputs: `step`, `steps` (every such
    step), `groups` (the first few such groups' ranks), `count` (how many group slots differ), `slots` (the first
    few), `exact` (False past 64 groups: a slot then stands for every group whose index is the same modulo 64, and
    no group is named), `dims` (the dimensions' names
    beside the data-parallel ones). None where they agreed or were not compared."""
    ignored: list[bool] = field(default_factory=list)
    """Per `unsharded` parameter: the script passed it to `fully_shard` as `ignored_params` (FSDP2 leaves its
    synchronisation to the script)."""
    outside_model: list[bool] = field(default_factory=list)
    """Per `unsharded` parameter: a tensor the optimizer steps that the model never held (a learnable loss
    temperature kept beside it), compared like the others."""
    ignored_site: str | None = None
    """The line of the `fully_shard` call that named the first of them."""
    sync_off_steps: int = 0
    """Observed optimizer steps taken while some sharded module had gradient sync off (on the rank with the most)."""
    sync_off_site: str | None = None
    """Where the script last switched gradient sync off (`sync_off_call`)."""
    sync_off_call: str = "set_requires_gradient_sync"
    """Which call switched it off: `set_requires_gradient_sync` (no reduce-scatter, no all-reduce) or, on an HSDP
    or `replicate` mesh, `set_requires_all_reduce` (no all-reduce across the replicas)."""
    params: list[ParamRef] = field(default_factory=list)
    """The model's parameters, in the order of the per-parameter facts below."""
    params_trainable: list[bool] = field(default_factory=list)
    """Per parameter: it requires a gradient (as this rank holds it; a frozen set that differs across ranks is
    `modes_apart`'s)."""
    params_grads: list[tuple[bool, bool, bool]] | None = None
    """Per parameter, over every rank and every observed step with gradient sync on: it had a gradient, one that
    held a value other than 0, and its weights moved from the first observed step to the last. None where some rank
    saw no such step, or the ranks hold different numbers of parameters."""
    params_held: list[bool] = field(default_factory=list)
    """Per parameter: the followed optimizer holds it."""
    params_zero_lr: list[bool] = field(default_factory=list)
    """Per parameter: the followed optimizer holds it in a param group whose learning rate is 0 at the last
    observed step."""
    followed: bool = False
    """The script was followed past the observed steps to its epoch end: its saves there are in `shard_save*` too;
    everything else is the observed steps'."""
    in_process: bool = False
    """Observed by `observe()` in the script's own process, not by `ddp-doctor check`: no failure of the run is
    named (a rank that hangs in an all-gather it entered alone stays in the `with` block)."""
    shard_save: dict[str, Any] | None = None
    """A `torch.save` of DTensor shards to a file that holds some ranks' shards only, as the first rank that made it
    saw it: `shown` (the file), `site` (the line), `shards` (how many DTensors, one's name, local and global shape).
    None when no rank saved shards, or every rank saved its own to a file of its own."""
    shard_save_ranks: int = 0
    """How many ranks made such a save."""
    shard_save_first: int = 0
    """The lowest rank that made one."""
    shard_save_one_path: bool = False
    """Every rank saved, all to the same path."""
    low_reduce: tuple[str, str] | None = None
    """(the reduction's dtype, the weights' dtype) when every rank saw FSDP2 reduce-scatter one backward's gradients
    in bfloat16 or float16 while the sharded weights are float32 (`ReducePrecisionProbe`); None otherwise, also
    where it could not be seen."""
    reshard_candidate: dict[str, Any] | None = None
    """The sharded module whose `reshard_after_forward=True` costs an all-gather per step for nothing: the last
    non-root module to run forward (`module`, its `fully_shard` `call` index and `site`); None when there is none or
    the all-gathers were not counted."""
    timed_steps: int = 0
    """Steps whose time every rank measured (the fewest on a rank)."""
    gpu_timed: bool = False
    """The steps were timed on the GPU's clock (CUDA events, `observation/step_clock.DeviceClock`), not the host's."""
    input_wait: dict[str, Any] | None = None
    """When every rank waited for its next batch for most of each step (`observation/step_clock.py` on CPU): the
    ranks' median `wait_s` and `step_s` as [lowest, highest], the `steps` timed, and the DataLoader that fed them
    (`dataloaders.describe` with its `site`), and the `clock` that timed them (`host` or `gpu`). None otherwise."""
    comm_timed: bool = False
    """Every rank timed its steps' time in the model's collectives (`observation/step_clock.CommClock`, on CPU
    only: NCCL runs them on streams of its own)."""
    slowest: dict[str, Any] | None = None
    """The rank whose own work per step (its step less its time in the model's collectives and its run-queue
    delay) is the longest, when every rank timed its collectives on CPU: its `rank`, the `steps` timed, its `own_s`
    median and quartiles (`own_q1_s`, `own_q3_s`), its median wait between steps (`wait_s`) and time in collectives
    (`comm_s`), and over the other
    ranks the longest median and third quartile of own work and wait between steps (`others_own_s`,
    `others_own_q3_s`, `others_wait_s`) and the shortest median time in collectives (`others_comm_s`).
    `observation/step_clock.slowest_rank`; None otherwise."""
    samplers_compared: bool = False
    """Some rank's training loader has a DistributedSampler, or a sampler over a dataset whose digest is known."""
    loader_compared: bool = False
    """Some rank's observed steps trained on a DataLoader: the batches each step drew were compared."""
    samplers_apart: dict[str, Any] | None = None
    """When the training loaders' DistributedSamplers differ across ranks, or some rank's is not its own: two
    ranks' loader records, the reference first (`held`), and the other ranks named (`ranks`, `more`)."""
    low_reduce_abs: float = 0.0
    """The largest absolute difference of a reduced gradient element, low dtype against float32, on any rank."""
    low_reduce_rel: float = 0.0
    """The largest, over ranks, of sum |low - float32| / sum |float32| over that backward's reduced gradients."""
