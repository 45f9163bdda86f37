"""The facts of one observed model that every parallelism's check establishes in the same shape: what the ranks'
inputs showed, and what they held apart at a step (the optimizer's settings, the modules' modes, the script's
collectives). DDP's exchanged `Summary` and a sharded model's `ShardedRun` each give an `Agreed`
(`analyze/view_facts.py`, `analyze/run_facts.py`), and a detector registered for every road reads it (`detects(..., road="every")`,
`analyze/view.py`): such a concept is decided once, with the parallelism an input to the rule and its words."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ddp_doctor.core.findings import Measure, ParamRef

if TYPE_CHECKING:  # core/records.py imports torch; the report's reader (core/sharded_run.py) must not
    from ddp_doctor.core.records import Flavor

__all__ = [
    "Agreed",
    "BuffersApart",
    "DrawnApart",
    "HeldApart",
    "InputWait",
    "LocalAveraging",
    "Moves",
    "NeverReached",
    "NonFinite",
    "SamplersApart",
    "Slowest",
    "StaleOptimizer",
    "SteppedApart",
    "WeightsApart",
]


@dataclass(frozen=True, slots=True)
class HeldApart:
    """What the ranks held apart at observed step `step`: the value of the `reference` rank and of some of the
    ranks whose value is another (`held`, the reference first), `ranks` those ranks (the lowest few named; `more`
    others counted). The value is what the ranks recorded: an optimizer's settings as text, a modes entry, the list
    of a step's collective calls."""

    step: int
    reference: int
    held: dict[int, Any]
    ranks: list[int]
    more: int = 0

    @property
    def named(self) -> list[int]:
        """The ranks a finding names: the reference and the ranks that differ from it."""
        return sorted({self.reference, *self.ranks})


@dataclass(frozen=True, slots=True)
class SteppedApart:
    """An LR scheduler stepped on some ranks only, in observed step `step`: `ranks` stepped it (the lowest few;
    `more` others), at their recorded `sites` (`StepLR.step() at train.py:31`)."""

    step: int
    ranks: list[int]
    more: int
    sites: list[str]


@dataclass(frozen=True, slots=True)
class DrawnApart:
    """The ranks drew different numbers of batches from the training loader (created at `site`) for observed step
    `step`: `ranks` (the lowest few; `more` others) drew `drew` where other ranks drew `others`."""

    step: int
    ranks: list[int]
    more: int
    drew: int
    others: int
    site: str | None


@dataclass(frozen=True, slots=True)
class NeverReached:
    """Trainable parameters that got no gradient on any rank in any of the `steps` observed steps (a sharded
    model's: those with gradient sync on), and whether their modules ran in a training forward: False for DDP's
    (a module that ran and gave no gradient is `grad-blocked`'s), None where it was not recorded (FSDP2,
    `replicate`)."""

    params: list[ParamRef]
    steps: int
    modules_ran: bool | None


@dataclass(frozen=True, slots=True, kw_only=True)
class InputWait:
    """The ranks' waits for data between steps, on `clock` (`host` or `gpu`) over `steps` timed steps: `waiting`
    of the `measured` ranks waited by `core/steptime`'s thresholds; `wait_s` and `step_s` are their median wait
    and step as (lowest, highest) over them, `compute_s` their median forward and backward where DDP's hooks
    timed it; `loader` the training DataLoader (`dataloaders.describe`), `sites` every loader's line; `ranks` the
    waiting ranks named (the lowest few; `more` others)."""

    waiting: int
    measured: int
    clock: str
    steps: int
    wait_s: tuple[float, float]
    step_s: tuple[float, float]
    loader: dict[str, Any]
    sites: list[str]
    ranks: list[int]
    more: int = 0
    compute_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class NonFinite:
    """NaN or infinity in the observed steps: the first step whose gradients held it (`grads_step`; a GradScaler's
    skipped step is not counted) and in how many parameters (`grads_count`; None: not counted, a sharded model's
    shards are measured as one norm), the first step after which weights did (`weights_step`, `weights_count`),
    the parameters that held it before the first step (`before`), `steps` the steps it was seen at, `params` the
    parameters named, `materialised` the lines that built the model with `to_empty()`. `inputs_step`: the first
    step, at or before the gradients', at which some ranks' training inputs held it: `inputs_ranks` (the lowest
    few; `inputs_more` others) of `inputs_count` ranks (None: not counted)."""

    grads_step: int | None = None
    grads_count: int | None = None
    weights_step: int | None = None
    weights_count: int = 0
    before: int = 0
    steps: list[int] = field(default_factory=list)
    params: list[ParamRef] = field(default_factory=list)
    materialised: list[str] = field(default_factory=list)
    inputs_step: int | None = None
    inputs_ranks: list[int] = field(default_factory=list)
    inputs_more: int = 0
    inputs_count: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Moves:
    """What the optimizer's steps did to the weights over `steps`, the observed optimizer steps whose gradients
    were measured and finite: at every one every gradient was exactly zero (`all_zero`), some weight changed
    (`moved`); `rates` the optimizer's learning rates. `never`: trainable parameters whose gradients held a value
    other than 0 and whose weights changed on no rank over `never_steps`; `never_held` of them the followed
    optimizer (`optimizer`, named with its line where known) holds, `never_zero_lr` in a param group whose
    learning rate is 0."""

    steps: list[int]
    all_zero: bool
    moved: bool
    rates: list[float] = field(default_factory=list)
    never: list[ParamRef] = field(default_factory=list)
    never_held: int = 0
    never_zero_lr: int = 0
    never_steps: list[int] = field(default_factory=list)
    optimizer: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Slowest:
    """The rank whose own work per step (its step less its time in the model's collectives and its waits for a
    CPU) is the longest, on the host's clock over `steps` timed steps: group rank `rank` (`name` as users number
    it), its median `own_s` and quartiles `own_q`, its own time in collectives `own_comm_s`; over the other ranks
    `others_s` (their median own work; with `bounds`, the longest of their medians), `others_q3_s` (the highest of
    their third quartiles) and `lost_s` (their median time in collectives; with `bounds`, the shortest). `phase`:
    where its extra time goes (`data_wait`, `forward`, `backward`, `optimizer`; `step` where only the step as a
    whole was timed), `phase_extra_s` how much longer than the others it is there (None: not measured)."""

    rank: int
    name: int
    steps: int
    own_s: float
    own_q: tuple[float, float]
    own_comm_s: float
    others_s: float
    others_q3_s: float
    lost_s: float
    phase: str
    phase_extra_s: float | None = None
    bounds: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class StaleOptimizer:
    """The optimizer steps `stale` tensors the model no longer holds, over `steps` observed steps. `wholesale`:
    the wrapper's call replaced every parameter of the modules it took after the optimizer was built, so it steps
    none of the model's `model_params` (FSDP2's `fully_shard`, `replicate`); else a module replaced after the
    optimizer was built, `params` its old parameters and `replacements` the names of the new ones no optimizer
    steps. `optimizer`: the followed optimizer, with its line where known; `moved`: some of the model's weights
    changed between the first observed step and the last."""

    stale: int
    steps: int
    wholesale: bool = False
    params: list[ParamRef] = field(default_factory=list)
    replacements: list[str] = field(default_factory=list)
    optimizer: str = ""
    model_params: int = 0
    moved: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class BuffersApart:
    """Buffers that held different values across ranks at a forward: `buffers`, at `steps`, the `ranks` named.
    `changing`: they changed during the steps (running statistics such as BatchNorm's, each rank from its own
    batches); else they were made different and never changed. `late`: a DDP model's buffers registered after DDP
    was built, at `registered_at`; `none_at_wrap`: the model had no buffers then, so DDP syncs none
    (`will_sync_module_buffers`)."""

    buffers: list[ParamRef]
    steps: list[int]
    changing: bool
    ranks: list[int]
    late: bool = False
    registered_at: list[str] = field(default_factory=list)
    none_at_wrap: bool = False


@dataclass(frozen=True, slots=True)
class SamplersApart:
    """The ranks' training loaders do not split the data: `held` maps the ranks compared (the reference first) to
    their loader's record (`dataloaders.describe`, with the sampler's settings and the dataset's digest); `ranks`
    are the ranks the exchange named apart (the lowest few; `more` others)."""

    held: dict[int, dict[str, Any]]
    ranks: list[int]
    more: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsApart:
    """The replicas' weights apart: `params` whose copies differ between the `reference` rank and `ranks` (the
    lowest few; `more` others). `at_start`: already at the first comparison (DDP's: when the observation began,
    before the first step; a sharded model's: when the first observed optimizer step ended, they are not compared
    before it); `steps`: the observed steps after which they differed, where each step was compared (DDP's),
    else the first (a sharded model's; `first_step` None: not measured, found after the last of `observed`).
    `gap`: the largest difference of a parameter's sum between the reference and another rank (None: not
    measured); `row`: the HSDP replica row of the shard that differs (None: every rank holds whole parameters)."""

    params: list[ParamRef]
    reference: int
    ranks: list[int]
    more: int = 0
    at_start: bool
    steps: list[int]
    first_step: int | None = None
    observed: int = 0
    gap: float | None = None
    row: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalAveraging:
    """Post-local SGD as rank 0 saw it (the hook and the averager are the same on every rank): from observed step
    `first_step` the hook (`start_localSGD_iter`, `from_iteration`) averages each gradient over `subgroup` ranks
    (1: none; None: not known), not the group, and a model averager (at `averager_site`) averaged the parameters
    over `averaged_over` ranks after the observed steps `averaged_after`; `world` ranks, `steps` observed."""

    first_step: int
    from_iteration: int
    subgroup: int | None
    averaged_after: list[int]
    averaged_over: int | None
    averager_site: str | None
    world: int
    steps: int

    @property
    def measured(self) -> list[Measure]:
        """The step local SGD began at, and the averagings seen."""
        return [
            Measure("first_local_step", self.first_step, "count"),
            Measure("averagings", len(self.averaged_after), "count"),
        ]

    def explains(self, steps: list[int]) -> bool:
        """Every step in `steps` is one where the ranks step on their own gradients by design."""
        return bool(steps) and min(steps) >= self.first_step


@dataclass(frozen=True, slots=True, kw_only=True)
class Agreed:
    """One model's shared facts, as every rank agreed on them."""

    parallelism: str
    """`ddp`, `fsdp2` or `replicate` (`core/sharded_run.PARALLELISMS`)."""
    world: int
    """The ranks compared: DDP's process group, the sharded model's world."""
    framework: str = "torch"
    """Who built the model's wrapper or stepped its optimizer (`torch`, `transformers`, `accelerate`, `lightning`):
    the words a fix is given in."""
    flavor: Flavor | None = None
    """The framework's versions, where a fix's words depend on them (None: not known)."""
    ddp_flags: dict[str, Any] = field(default_factory=dict)
    """The flags DDP was built with (`find_unused_parameters`, `static_graph`, ...); empty for a sharded model."""
    never_reached: NeverReached | None = None
    """Trainable parameters no gradient reached anywhere in the observed steps."""
    device_type: str = ""
    """Where the model runs (`cpu`, `cuda`)."""
    input_wait: InputWait | None = None
    """The ranks' waits for data, where the steps were timed on a clock that tells them and a DataLoader was
    iterated."""
    inputs_compared: list[int] = field(default_factory=list)
    """The observed steps whose training inputs every rank fingerprinted."""
    inputs_identical: bool = False
    """At every one of `inputs_compared`, the inputs were the same on every rank."""
    one_data_group: bool = False
    """Every rank reads the same batches by design: the ranks form one data-parallel group beside tensor
    parallelism (the group computes one forward together)."""
    settings_apart: HeldApart | None = None
    """The first step at which the optimizers' settings (`optimizers.describe`'s text) differed across ranks."""
    scheduler_apart: SteppedApart | None = None
    """Where an LR scheduler of that optimizer was stepped on some ranks only, at or before that step. DDP's
    exchange counts scheduler steps per rank; a sharded model's does not (None there)."""
    schedulers_counted: bool = False
    """Whether the exchange counted each rank's LR scheduler steps (DDP's does), so that `scheduler_apart` is None
    because none was stepped apart, not because it was not looked for."""
    metric_schedulers: list[str] = field(default_factory=list)
    """The lines where a scheduler that reads a metric (ReduceLROnPlateau) was stepped."""
    modes_apart: HeldApart | None = None
    """The first step at which the modules' train/eval modes differed across ranks (modes entries: `training`,
    `other_mode`, `other_mode_count`); None when only other parts of the ranks' state differed."""
    collectives_apart: HeldApart | None = None
    """The first completed step whose collectives (the script's; FSDP2's and `replicate`'s too) were not the same
    sequence on every rank; `held`: each shown rank's calls of the step, in order."""
    collectives_counts: list[int] = field(default_factory=list)
    """The fewest and most collectives a rank issued in that step, where the exchange counted them (DDP's)."""
    collectives_also: list[int] = field(default_factory=list)
    """Later steps whose collectives differed too, where the exchange compared every step (DDP's)."""
    drawn_apart: DrawnApart | None = None
    """The first observed step for which the ranks drew different numbers of batches from the training loader."""
    graph_collectives: list[dict[str, Any]] = field(default_factory=list)
    """Rank 0's in-place reductions of a tensor autograd tracks that a backward went through, with the factor a hook
    measured (`observation.graph_collectives.GraphCollectives.found`); every rank runs the script's line."""
    nonfinite: NonFinite | None = None
    """NaN or infinity in the gradients, the weights or the training inputs of the observed steps."""
    moves: Moves | None = None
    """What the optimizer's steps did to the weights, where at least one step's gradients were measured and finite
    (a sharded model's: where its optimizer steps the model's parameters and no gradient held NaN or infinity)."""
    slowest: Slowest | None = None
    """The rank with the longest own work per step, where every rank's step and time in collectives were timed on
    the host's clock (on CPU: NCCL's collectives run on streams of their own, untimed)."""
    stale_optimizer: StaleOptimizer | None = None
    """Tensors the optimizer steps that are no longer the model's."""
    buffers_apart: list[BuffersApart] = field(default_factory=list)
    """Buffers that differed across ranks: those made different, those that changed apart in training, and a DDP
    model's registered after it was built, each their own."""
    samplers_apart: SamplersApart | None = None
    """Training loaders whose DistributedSamplers disagree, or that read one dataset whole on every rank."""
    weights_apart: WeightsApart | None = None
    """The replicas' weights apart at the first step they were compared apart."""
    local_averaging: LocalAveraging | None = None
    """Post-local SGD that began within or before the observed steps (DDP's `post_localSGD_hook`): gradients and
    replicas that differ by design."""
    grads_measured: dict[str, int] = field(default_factory=dict)
    """Where DDP's exchange compared the gradients across ranks besides after its all-reduce (`step`: when
    optimizer.step() began; `closure`: when a closure-based step returned), with the steps counted."""
