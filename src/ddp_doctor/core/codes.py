"""The finding codes: one table, the JSON contract. A code may be added; none may be renamed.

Every module names a code through `Code` (`Code.UNUSED_PARAMETERS`, never the bare string: `tests/design/test_codes.py`
scans the package), so a typo is an `AttributeError`, not a finding with an unknown code. A `Code` is its string: it
compares, hashes, formats and serializes to JSON as the stable name, so the reports are byte for byte what they were.

`TABLE` holds each code's family, the severities it is reported at and where it is decided; `code_notes.py`, what
docs/codes.md adds to a code's line. The code tables of the README and of docs/codes.md are drawn from them
(`ddp-doctor codes --markdown readme|docs`), and a test holds the files to that drawing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = [
    "CODES",
    "FAMILY_TITLES",
    "PARALLELISMS",
    "REPORT_ORDER",
    "SEVERITIES",
    "TABLE",
    "Code",
    "CodeInfo",
    "Family",
    "info",
    "not_checked_for",
]

SEVERITIES = ("error", "warning", "info")
"""Most severe first."""
PARALLELISMS = {"ddp": "DDP", "fsdp2": "FSDP2", "replicate": "replicate"}
"""The kinds of data parallelism the check knows, with the name a report gives them: DDP, and FSDP2's `fully_shard`
and `replicate`."""


class _Name(str, Enum):
    """A string enum that is its value wherever a string goes (`enum.StrEnum` from Python 3.11; 3.10 is supported)."""

    __str__ = str.__str__
    __format__ = str.__format__


class Code(_Name):
    """The stable finding codes, in the order they were added (`ddp-doctor codes` lists them in this order)."""

    UNUSED_PARAMETERS = "unused-parameters"
    DYNAMIC_GRAPH = "dynamic-graph"
    RANK_DEPENDENT_GRAPH = "rank-dependent-graph"
    USED_OUTSIDE_FORWARD = "used-outside-forward"
    FIND_UNUSED_UNNEEDED = "find-unused-unneeded"
    STATIC_GRAPH_UNSAFE = "static-graph-unsafe"
    REENTRANT_CHECKPOINT = "reentrant-checkpoint"
    WRAPPER_BYPASS = "wrapper-bypass"
    GRADS_NOT_SYNCED = "grads-not-synced"
    REPLICA_DIVERGENCE = "replica-divergence"
    BUFFER_DIVERGENCE = "buffer-divergence"
    FROZEN_AFTER_WRAP = "frozen-after-wrap"
    UNFROZEN_AFTER_WRAP = "unfrozen-after-wrap"
    IDENTICAL_INPUTS_ACROSS_RANKS = "identical-inputs-across-ranks"
    REDUCTION_ERROR = "reduction-error"
    NO_TRAINABLE_PARAMETERS = "no-trainable-parameters"
    # Added with `ddp-doctor check`, which runs whole scripts:
    RANK_CRASHED = "rank-crashed"
    RANK_HUNG = "rank-hung"
    # The second round:
    GRAD_BLOCKED = "grad-blocked"
    MODEL_NOT_WRAPPED = "model-not-wrapped"
    COLLECTIVE_MISMATCH = "collective-mismatch"
    UNEVEN_INPUTS = "uneven-inputs"
    SAMPLER_EPOCH_NOT_SET = "sampler-epoch-not-set"
    RANK_EXITED = "rank-exited"
    # Cheap cross-rank checks of the training loop's helpers:
    BATCHNORM_NOT_SYNCED = "batchnorm-not-synced"
    GRAD_SCALER_MISMATCH = "grad-scaler-mismatch"
    # The third round: why replicas diverge when the gradients agree.
    OPTIMIZER_DIFFERS = "optimizer-differs"
    OPTIMIZER_STEP_SKIPPED = "optimizer-step-skipped"
    GRADS_REDUCED_TWICE = "grads-reduced-twice"
    REPLICAS_DIFFER_AT_WRAP = "replicas-differ-at-wrap"
    WEIGHTS_CHANGED_OUTSIDE_OPTIMIZER = "weights-changed-outside-optimizer"
    # Gradients that DDP synchronized, changed on some ranks before the step.
    GRADS_CHANGED_AFTER_SYNC = "grads-changed-after-sync"
    # What happens at wrap and at epoch ends:
    PARAM_SHAPES_DIFFER = "param-shapes-differ"
    CHECKPOINT_SAME_PATH = "checkpoint-same-path"
    CHECKPOINT_MODULE_PREFIX = "checkpoint-module-prefix"
    TIMEOUT_RISK = "timeout-risk"
    # Where the step time goes (measurements on this machine):
    INPUT_BOUND = "input-bound"
    STRAGGLER_RANK = "straggler-rank"
    # Backward passes that differ across ranks:
    BACKWARD_PASSES_DIFFER = "backward-passes-differ"
    # Data parallelism beyond DDP: FSDP2 (`fully_shard`).
    OPTIMIZER_PARAMS_REPLACED = "optimizer-params-replaced"
    UNSHARDED_PARAMS_NOT_SYNCED = "unsharded-params-not-synced"
    GRADIENT_SYNC_OFF = "gradient-sync-off"
    SHARDED_CHECKPOINT_INCOMPLETE = "sharded-checkpoint-incomplete"
    STATE_GATHER_SOME_RANKS = "state-gather-some-ranks"
    SHARDED_FORWARD_SOME_RANKS = "sharded-forward-some-ranks"
    LOW_PRECISION_REDUCE = "low-precision-reduce"
    LOW_PRECISION_WEIGHTS = "low-precision-weights"
    # The invariants of data parallelism: what the module tree holds, whatever created it.
    UNREGISTERED_PARAMETERS = "unregistered-parameters"
    NONFINITE_VALUES = "non-finite-values"
    TRAINING_STALLED = "training-stalled"
    SHARDS_OVERLAP = "shards-overlap"
    TP_INPUTS_DIFFER = "tp-inputs-differ"
    COLLECTIVE_IN_GRAPH = "collective-in-graph"


# fmt: off
REPORT_ORDER: tuple[Code, ...] = (
    # Where each finding a detector decides (from DDP's exchanged `Summary` or a sharded model's `ShardedRun`) reads
    # in a report, within its severity: errors that explain others first (DDP's error, then why replicas diverge),
    # the symptoms after them, timing last. A detector (`analyze/view.py`'s `detects`) may only be registered for a
    # code listed here.
    Code.RANK_CRASHED, Code.NONFINITE_VALUES, Code.PARAM_SHAPES_DIFFER, Code.OPTIMIZER_PARAMS_REPLACED, Code.GRADIENT_SYNC_OFF, Code.UNSHARDED_PARAMS_NOT_SYNCED, Code.UNREGISTERED_PARAMETERS, Code.REDUCTION_ERROR, Code.BACKWARD_PASSES_DIFFER, Code.REPLICAS_DIFFER_AT_WRAP,
    Code.WEIGHTS_CHANGED_OUTSIDE_OPTIMIZER, Code.OPTIMIZER_STEP_SKIPPED, Code.OPTIMIZER_DIFFERS,
    Code.GRADS_REDUCED_TWICE, Code.GRADS_CHANGED_AFTER_SYNC, Code.STATIC_GRAPH_UNSAFE, Code.WRAPPER_BYPASS,
    Code.UNFROZEN_AFTER_WRAP, Code.FROZEN_AFTER_WRAP, Code.UNUSED_PARAMETERS, Code.GRAD_BLOCKED,
    Code.COLLECTIVE_MISMATCH, Code.DYNAMIC_GRAPH, Code.RANK_DEPENDENT_GRAPH, Code.USED_OUTSIDE_FORWARD,
    Code.REENTRANT_CHECKPOINT, Code.GRADS_NOT_SYNCED, Code.REPLICA_DIVERGENCE, Code.BUFFER_DIVERGENCE,
    Code.IDENTICAL_INPUTS_ACROSS_RANKS, Code.TP_INPUTS_DIFFER, Code.NO_TRAINABLE_PARAMETERS, Code.FIND_UNUSED_UNNEEDED, Code.UNEVEN_INPUTS,
    Code.SAMPLER_EPOCH_NOT_SET, Code.SHARDS_OVERLAP, Code.SHARDED_CHECKPOINT_INCOMPLETE, Code.CHECKPOINT_SAME_PATH, Code.CHECKPOINT_MODULE_PREFIX, Code.GRAD_SCALER_MISMATCH,
    Code.BATCHNORM_NOT_SYNCED, Code.LOW_PRECISION_WEIGHTS, Code.LOW_PRECISION_REDUCE, Code.TRAINING_STALLED, Code.COLLECTIVE_IN_GRAPH, Code.INPUT_BOUND, Code.STRAGGLER_RANK,
)
# fmt: on


class Family(_Name):
    """What a finding is about; the tables are grouped by family, in this order."""

    GRAPH = "graph"
    CRASH = "crash"
    SYNC = "sync"
    DIVERGENCE = "divergence"
    LOCKSTEP = "lockstep"
    HELPERS = "helpers"
    WRAP_AND_EPOCH_ENDS = "wrap-and-epoch-ends"
    TIMING = "timing"
    FSDP2 = "fsdp2"
    PROGRESS = "progress"


FAMILY_TITLES: dict[Family, str] = {
    Family.GRAPH: "which parameters train and reach the loss, against DDP's flags",
    Family.CRASH: "a run that ended early: DDP's error explained, a rank that crashed, hung or left",
    Family.SYNC: "replicas that stop agreeing (the symptom), and a model with no DDP",
    Family.DIVERGENCE: "why replicas diverge when the gradients agree (the cause)",
    Family.LOCKSTEP: "ranks out of step: collectives, batches per epoch, sampler epochs (hangs and data)",
    Family.HELPERS: "training helpers that differ across ranks",
    Family.WRAP_AND_EPOCH_ENDS: "what happens at wrap and at epoch ends",
    Family.TIMING: "where the step time goes (measured on this machine)",
    Family.FSDP2: "FSDP2 (`fully_shard`)",
    Family.PROGRESS: "whether training moves at all: finite values, gradients that are not all zero, steps that "
    "change the weights",
}


@dataclass(frozen=True, slots=True)
class CodeInfo:
    """One row of the table."""

    code: Code
    family: Family
    severities: tuple[str, ...]
    """The severities it is reported at, most severe first; the first is its default: what it is reported at unless
    `when` says otherwise."""
    decided_in: tuple[str, ...]
    """The modules of `ddp_doctor/analyze/` that build it."""
    summary: str
    """One line: `ddp-doctor codes`, the README."""
    when: str = ""
    """What decides the severity, when there is more than one (docs/codes.md)."""
    guard: bool = False
    """Built by `analyze/rules.py`, whose severity rule `guard` shares."""
    checked_for: tuple[str, ...] = ("ddp",)
    """The parallelisms (`PARALLELISMS`) whose check decides it: a DDP model's, and a model's that FSDP2 shards
    (`fully_shard`) or replicates (`replicate`)."""
    not_checked_for: tuple[str, ...] = ()
    """The parallelisms it applies to whose check does not decide it yet: their reports say so
    (`not_checked_for`), rather than stay silent about it."""

    def __post_init__(self) -> None:
        assert self.severities and self.severities == tuple(s for s in SEVERITIES if s in self.severities), self
        assert (len(self.severities) > 1) == bool(self.when), f"{self.code}: a `when` for each code with several"
        assert not set(self.checked_for) & set(self.not_checked_for), f"{self.code}: checked and not"

    @property
    def severity(self) -> str:
        """The default severity."""
        return self.severities[0]


# fmt: off
def _row(code: Code, family: Family, severities: str, decided_in: str, summary: str, *, when: str = "",
         guard: bool = False, on: str = "ddp", gap: str = "") -> CodeInfo:
    """A row from its short spelling: `severities` as "error/warning", `decided_in` as "used_set.py crashed_ranks.py",
    `on` (the parallelisms whose check decides it) and `gap` (those it applies to whose check does not) as
    "ddp fsdp2", with "all" for every parallelism and "sharded" for FSDP2's two (`fully_shard`, `replicate`)."""
    return CodeInfo(code, family, tuple(severities.split("/")), tuple(decided_in.split()), summary, when=when,
                    guard=guard, checked_for=_parallelisms(on), not_checked_for=_parallelisms(gap))
# fmt: on


def _parallelisms(spelled: str) -> tuple[str, ...]:
    words = {"all": PARALLELISMS, "sharded": ("fsdp2", "replicate")}
    named = {p for word in spelled.split() for p in words.get(word, (word,))}
    assert named <= set(PARALLELISMS), spelled
    return tuple(p for p in PARALLELISMS if p in named)


def not_checked_for(parallelism: str) -> list[Code]:
    """The codes that apply to a model of `parallelism` (`PARALLELISMS`) whose check does not decide them yet, in
    `Code`'s order: a report of that parallelism names them."""
    return [row.code for row in TABLE if parallelism in row.not_checked_for]


# One row a code, in `Code`'s order. Laid out by hand, as a table reads (the formatter would give each argument a line).
# fmt: off
TABLE: tuple[CodeInfo, ...] = (
    _row(Code.UNUSED_PARAMETERS, Family.GRAPH, "error/warning", "used_set.py",
         "trainable parameters that never reach the loss",
         when="error with default flags (DDP will fail); warning when the flags cope, and in a model sharded with "
              "FSDP2 (no error: they never train, and their group's all-gathers carry them)", on="all"),
    _row(Code.DYNAMIC_GRAPH, Family.GRAPH, "error/info", "used_set.py",
         "the set of parameters that reach the loss changes between steps",
         when="error with default flags or `static_graph=True`; info with `find_unused_parameters=True`"),
    _row(Code.RANK_DEPENDENT_GRAPH, Family.GRAPH, "error/info", "used_set.py crashed_ranks.py",
         "the set of parameters that reach the loss differs between ranks",
         when="error with default flags; info when the flags cope; error when the job died before the exchange"),
    _row(Code.USED_OUTSIDE_FORWARD, Family.GRAPH, "error/info", "hidden_use.py crashed_ranks.py",
         "parameters used in the loss outside DDP's forward",
         when="error with `find_unused_parameters=True` (without `static_graph`); info when the flags cope"),
    _row(Code.FIND_UNUSED_UNNEEDED, Family.GRAPH, "warning", "used_set.py",
         "find_unused_parameters=True while every parameter is used"),
    _row(Code.STATIC_GRAPH_UNSAFE, Family.GRAPH, "error", "used_set.py crashed_ranks.py",
         "static_graph=True while the graph changes between steps"),
    _row(Code.REENTRANT_CHECKPOINT, Family.GRAPH, "error/warning/info", "hidden_use.py crashed_ranks.py",
         "reentrant activation checkpointing inside DDP",
         when="error with `find_unused_parameters=True` (without `static_graph`) or when no input of the call "
              "requires grad; warning with default flags; info with `static_graph=True`"),
    _row(Code.WRAPPER_BYPASS, Family.SYNC, "error", "agreement.py",
         "the wrapped module is called directly, so DDP never syncs",
         guard=True),
    _row(Code.GRADS_NOT_SYNCED, Family.SYNC, "error/info", "agreement.py",
         "gradients differ across ranks when the optimizer steps",
         when="error; info under post-local SGD from the step its comm hook stops averaging over every rank"),
    _row(Code.REPLICA_DIVERGENCE, Family.SYNC, "error/warning/info", "replica_state.py",
         "weights differ across ranks (the DDP model's, or a module's run beside it; or, from the module tree, the "
         "modules' train/eval modes)",
         when="error; warning when every difference is at float64 rounding level, for modules whose mode "
              "differs across ranks, and under post-local SGD with no model averaging seen; info between its "
              "model averagings",
         guard=True, on="all"),
    _row(Code.BUFFER_DIVERGENCE, Family.SYNC, "error/warning", "buffer_state.py",
         "buffers differ across ranks",
         when="error for a buffer that differs and never changed in training (FSDP2 never broadcasts buffers, "
              "DDP not with broadcast_buffers=False, nor when the model had no buffers when it was built); "
              "warning for buffers that change in training (running statistics)",
         guard=True, on="all"),
    _row(Code.FROZEN_AFTER_WRAP, Family.GRAPH, "error/warning", "frozen_set.py",
         "requires_grad set to False after DDP was built",
         when="error; warning when harmless (`find_unused_parameters=True`, or `static_graph=True` before the first "
              "step)",
         guard=True, gap="replicate"),
    _row(Code.UNFROZEN_AFTER_WRAP, Family.GRAPH, "error", "frozen_set.py",
         "requires_grad set to True after DDP was built",
         guard=True),
    _row(Code.IDENTICAL_INPUTS_ACROSS_RANKS, Family.SYNC, "warning", "agreement.py",
         "every rank got the same batch", on="all"),
    _row(Code.REDUCTION_ERROR, Family.CRASH, "error", "frozen_set.py crashed_ranks.py",
         "DDP crashed with 'Expected to have finished reduction', explained"),
    _row(Code.NO_TRAINABLE_PARAMETERS, Family.GRAPH, "error", "frozen_set.py",
         "no parameter requires a gradient", gap="sharded"),
    _row(Code.RANK_CRASHED, Family.CRASH, "error", "crashed_ranks.py",
         "a rank, or every rank at once, died with an error that is not DDP's (or of a signal); the others were "
         "stopped", on="all"),
    _row(Code.RANK_HUNG, Family.CRASH, "error", "failures.py",
         "a rank stopped making progress and the others waited for it", on="all"),
    _row(Code.GRAD_BLOCKED, Family.GRAPH, "error", "used_set.py",
         "a module ran in forward but no gradient reaches its parameters (no_grad, detach, checkpoint)"),
    _row(Code.MODEL_NOT_WRAPPED, Family.SYNC, "error/info", "not_wrapped.py",
         "an optimizer trains parameters on several ranks with no DDP around them",
         when="error; info when a manual sync kept the replicas equal"),
    _row(Code.COLLECTIVE_MISMATCH, Family.LOCKSTEP, "error/warning", "collective_order.py",
         "ranks issued different collectives, or different numbers of synced backward passes",
         when="error; warning for a DDP forward with autograd on and no backward on some ranks that issued no "
              "collective", on="all"),
    _row(Code.UNEVEN_INPUTS, Family.LOCKSTEP, "error/warning/info",
         "epochs.py",
         "ranks have different numbers of batches per epoch",
         when="error when a training loader's batch counts differ; warning for a loader no optimizer step trained on "
              "(an evaluation); info when they are equal only through `DistributedSampler`'s padding",
         guard=True, on="all"),
    _row(Code.SAMPLER_EPOCH_NOT_SET, Family.LOCKSTEP, "warning", "epochs.py",
         "a shuffling DistributedSampler starts a new epoch without set_epoch",
         guard=True, on="all"),
    _row(Code.RANK_EXITED, Family.CRASH, "error", "failures.py",
         "a rank left the job early (any exit status) while the others still trained", on="all"),
    _row(Code.BATCHNORM_NOT_SYNCED, Family.HELPERS, "info", "consistency.py",
         "BatchNorm layers train on each rank's batch alone (no SyncBatchNorm)", gap="sharded"),
    _row(Code.GRAD_SCALER_MISMATCH, Family.HELPERS, "warning", "consistency.py",
         "AMP GradScaler's scale differs across ranks at an optimizer step", gap="sharded"),
    _row(Code.OPTIMIZER_DIFFERS, Family.DIVERGENCE, "error", "optimizer_settings.py",
         "the optimizers' settings (a hyperparameter, the groups, a scheduler's lr) differ across ranks", on="all"),
    _row(Code.OPTIMIZER_STEP_SKIPPED, Family.DIVERGENCE, "error", "causes.py",
         "in one lockstep iteration some ranks called optimizer.step() and others did not", on="all"),
    _row(Code.GRADS_REDUCED_TWICE, Family.DIVERGENCE, "error/warning", "causes.py",
         "the script reduces gradients that DDP has already reduced",
         when="error; warning when the second reduction is an AVG (it changes nothing, it only costs)", gap="sharded"),
    _row(Code.REPLICAS_DIFFER_AT_WRAP, Family.DIVERGENCE, "error", "weight_writes.py",
         "the replicas differ before the first step (init_sync=False, a per-rank seed)"),
    _row(Code.WEIGHTS_CHANGED_OUTSIDE_OPTIMIZER, Family.DIVERGENCE, "error", "weight_writes.py",
         "parameters changed outside the optimizer on some ranks only, or with different values on every rank",
         gap="sharded"),
    _row(Code.GRADS_CHANGED_AFTER_SYNC, Family.DIVERGENCE, "error", "causes.py",
         "gradients agreed after DDP's all-reduce but differ at optimizer.step() (edited on some ranks only, e.g. "
         "clip_grad_norm_ under if rank == 0); under FSDP2, shards scaled by a factor of each rank's own", on="all"),
    _row(Code.PARAM_SHAPES_DIFFER, Family.WRAP_AND_EPOCH_ENDS, "error", "shapes.py",
         "parameters have different shapes on different ranks when DDP is built, or are trainable on some ranks "
         "only", on="all"),
    _row(Code.CHECKPOINT_SAME_PATH, Family.WRAP_AND_EPOCH_ENDS, "warning", "checkpoints.py",
         "several ranks wrote one path with torch.save (no rank guard, or a local-rank one)", gap="sharded"),
    _row(Code.CHECKPOINT_MODULE_PREFIX, Family.WRAP_AND_EPOCH_ENDS, "info", "checkpoints.py",
         "the DDP wrapper's state dict (keys 'module.*') was saved"),
    _row(Code.TIMEOUT_RISK, Family.WRAP_AND_EPOCH_ENDS, "error/warning", "timeouts.py",
         "a rank works alone while the others wait in a collective, long enough to reach the timeout",
         when="error when the projection reaches the timeout, warning at half of it", on="all"),
    _row(Code.INPUT_BOUND, Family.TIMING, "warning", "throughput.py",
         "the ranks spend a large share of every step waiting for the next batch", on="all"),
    _row(Code.STRAGGLER_RANK, Family.TIMING, "warning", "stragglers.py",
         "one rank is consistently slower and the others wait for it in the gradient all-reduce (or a sharded "
         "model's collectives)", on="all"),
    _row(Code.BACKWARD_PASSES_DIFFER, Family.GRAPH, "error/warning/info", "passes.py crashed_ranks.py",
         "two backward passes through one DDP forward reach different parameters (a GAN)",
         when="error; warning in a plain loop when every parameter gets its gradient in exactly one pass (the "
              "default flags then reduce correctly); info under Lightning with `find_unused_parameters=True`"),
    _row(Code.OPTIMIZER_PARAMS_REPLACED, Family.FSDP2, "error", "tree_state.py",
         "the optimizer holds parameters that are no longer the model's (fully_shard replaced them, or a module was "
         "replaced after the optimizer was built): it does not update the ones the model uses", on="all"),
    _row(Code.UNSHARDED_PARAMS_NOT_SYNCED, Family.FSDP2, "error/warning/info", "unsharded.py",
         "parameters outside every fully_shard group train on each rank with nothing to sync them",
         when="error when they already differ across ranks; info when they trained and stayed equal (the script "
              "syncs them, as `ignored_params` asks, or every rank saw the same batches); warning when they did not "
              "change", on="sharded"),
    _row(Code.GRADIENT_SYNC_OFF, Family.FSDP2, "error", "sharded.py",
         "gradient sync was off (set_requires_gradient_sync(False)) at every optimizer step", on="sharded"),
    _row(Code.SHARDED_CHECKPOINT_INCOMPLETE, Family.FSDP2, "error", "sharded_saves.py",
         "a torch.save of sharded state on some ranks only: the file holds their shards, not the model", on="sharded"),
    _row(Code.STATE_GATHER_SOME_RANKS, Family.FSDP2, "error", "sharded_failures.py",
         "a full state dict of sharded parameters gathered on some ranks only: a collective the others never enter",
         on="sharded"),
    _row(Code.SHARDED_FORWARD_SOME_RANKS, Family.FSDP2, "error", "sharded_failures.py",
         "a forward through the sharded model on some ranks only (an evaluation on rank 0, an extra training "
         "pass): its all-gathers wait", on="sharded"),
    _row(Code.LOW_PRECISION_REDUCE, Family.FSDP2, "info", "sharded.py",
         "gradients reduced in bfloat16 (or float16) while the weights train in float32 (reduce_dtype unset or low)",
         on="sharded"),
    _row(Code.LOW_PRECISION_WEIGHTS, Family.FSDP2, "warning", "sharded.py",
         "a mixed-precision policy computes in bfloat16 (or float16) on weights that are already in it: the optimizer "
         "steps low-precision weights and loses the updates below their resolution", on="sharded", gap="ddp"),
    _row(Code.UNREGISTERED_PARAMETERS, Family.DIVERGENCE, "error/warning/info", "tree_state.py",
         "parameters in the model that DDP's reducer does not hold (created or replaced after DDP was built), or "
         "tensors the optimizer trains beside the model (a loss temperature): each rank trains them alone",
         when="error when they differ across ranks in the observed steps; warning while they still agree; for a "
         "weight tied after DDP was built, error with find_unused_parameters=False, info with True"),
    _row(Code.NONFINITE_VALUES, Family.PROGRESS, "error", "moves.py",
         "gradients or weights hold NaN or infinity", on="all"),
    _row(Code.TRAINING_STALLED, Family.PROGRESS, "error/warning", "moves.py",
         "the optimizer's steps change no weight: every gradient is exactly zero, or the learning rate is 0; or some "
         "parameters get gradients and never change",
         when="error when no weight trains; warning when some parameters never change while the rest train", on="all"),
    _row(Code.SHARDS_OVERLAP, Family.LOCKSTEP, "warning", "shards.py",
         "the ranks' shares of the data overlap: their DistributedSamplers disagree (a seed, num_replicas, rank), "
         "or a loader with no DistributedSampler reads one dataset whole on every rank", on="all"),
    _row(Code.TP_INPUTS_DIFFER, Family.LOCKSTEP, "error", "agreement.py",
         "the ranks of a tensor-parallel group fed different batches to the forward they compute together (FSDP2 "
         "over tensor parallelism)", on="sharded", gap="ddp"),
    _row(Code.COLLECTIVE_IN_GRAPH, Family.PROGRESS, "warning/info", "in_graph.py",
         "a backward went through the script's in-place dist.all_reduce of a tensor autograd tracks (the loss, "
         "averaged across ranks before backward): autograd passes through it as the identity",
         when="warning when the script divided the summed value by the world size (every gradient that many "
              "times smaller); info for another factor", on="all"),
)
# fmt: on

_BY_CODE: dict[Code, CodeInfo] = {row.code: row for row in TABLE}
assert list(_BY_CODE) == list(Code), "TABLE holds every Code once, in Code's order"

CODES: dict[str, str] = {row.code.value: row.summary for row in TABLE}
"""code -> its one-line meaning (`ddp-doctor codes --json`; `from ddp_doctor import CODES`)."""


def info(code: str) -> CodeInfo:
    """The row of `code` (a `Code` or its string). Raises ValueError for a string that is no code."""
    return _BY_CODE[Code(code)]
