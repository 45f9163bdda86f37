"""The table of the finding codes (`codes.py`): each code's family, the severities it is reported at, where it is
decided and its one-line meaning. The code tables of the README and of docs/codes.md are drawn from it (`ddp-doctor
codes --markdown readme|docs`), and a test holds the files to that drawing."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_doctor.core.codes import SEVERITIES, Code, _Name

__all__ = ["CODES", "FAMILY_TITLES", "TABLE", "CodeInfo", "Family", "info"]


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
    more: str = ""
    """What docs/codes.md adds to `summary`: an example of the title, what the report names."""
    guard: bool = False
    """Built by `analyze/rules.py`, whose severity rule `guard` shares."""

    def __post_init__(self) -> None:
        assert self.severities and self.severities == tuple(s for s in SEVERITIES if s in self.severities), self
        assert (len(self.severities) > 1) == bool(self.when), f"{self.code}: a `when` for each code with several"

    @property
    def severity(self) -> str:
        """The default severity."""
        return self.severities[0]


def _row(
    code: Code,
    family: Family,
    severities: str,
    decided_in: str,
    summary: str,
    *,
    when: str = "",
    more: str = "",
    guard: bool = False,
) -> CodeInfo:
    """A row from its short spelling: `severities` as "error/warning", `decided_in` as "used_set.py crashed_ranks.py"."""
    return CodeInfo(
        code,
        family,
        tuple(severities.split("/")),
        tuple(decided_in.split()),
        summary,
        when=when,
        more=more,
        guard=guard,
    )


# One row a code, in `Code`'s order. Laid out by hand, as a table reads (the formatter would give each argument a line).
# fmt: off
TABLE: tuple[CodeInfo, ...] = (
    _row(Code.UNUSED_PARAMETERS, Family.GRAPH, "error/warning", "used_set.py sharded.py",
         "trainable parameters that never reach the loss",
         when="error with default flags (DDP will fail); warning when the flags cope, and in a model sharded with "
              "FSDP2 (no error: they never train, and their group's all-gathers carry them)"),
    _row(Code.DYNAMIC_GRAPH, Family.GRAPH, "error/info", "used_set.py",
         "the set of parameters that reach the loss changes between steps",
         when="error with default flags or `static_graph=True`; info with `find_unused_parameters=True`"),
    _row(Code.RANK_DEPENDENT_GRAPH, Family.GRAPH, "error/info", "used_set.py crashed_ranks.py",
         "the set of parameters that reach the loss differs between ranks",
         when="error with default flags; info when the flags cope; error when the job died before the exchange"),
    _row(Code.USED_OUTSIDE_FORWARD, Family.GRAPH, "error/info", "used_set.py crashed_ranks.py",
         "parameters used in the loss outside DDP's forward",
         when="error with `find_unused_parameters=True` (without `static_graph`); info when the flags cope"),
    _row(Code.FIND_UNUSED_UNNEEDED, Family.GRAPH, "warning", "used_set.py",
         "find_unused_parameters=True while every parameter is used"),
    _row(Code.STATIC_GRAPH_UNSAFE, Family.GRAPH, "error", "used_set.py crashed_ranks.py",
         "static_graph=True while the graph changes between steps"),
    _row(Code.REENTRANT_CHECKPOINT, Family.GRAPH, "error/warning/info", "used_set.py crashed_ranks.py",
         "reentrant activation checkpointing inside DDP",
         when="error with `find_unused_parameters=True` (without `static_graph`) or when no input of the call "
              "requires grad; warning with default flags; info with `static_graph=True`"),
    _row(Code.WRAPPER_BYPASS, Family.SYNC, "error", "agreement.py",
         "the wrapped module is called directly, so DDP never syncs",
         guard=True),
    _row(Code.GRADS_NOT_SYNCED, Family.SYNC, "error", "agreement.py",
         "gradients differ across ranks when the optimizer steps",
         more=", and already did after DDP's all-reduce (or no backward of the step was synced: *every backward pass "
              "of these optimizer steps ran under no_sync() (entered at train.py:24)*, with the fix for the last "
              "micro-batch)"),
    _row(Code.REPLICA_DIVERGENCE, Family.SYNC, "error/warning", "agreement.py tree_state.py",
         "weights differ across ranks (or, from the module tree, the modules' train/eval modes)",
         when="error; warning when every difference is at float64 rounding level, and for modules whose mode "
              "differs across ranks",
         guard=True),
    _row(Code.BUFFER_DIVERGENCE, Family.SYNC, "warning", "agreement.py",
         "buffers differ across ranks",
         guard=True),
    _row(Code.FROZEN_AFTER_WRAP, Family.GRAPH, "error/warning", "frozen_set.py",
         "requires_grad set to False after DDP was built",
         when="error; warning when harmless (`find_unused_parameters=True`, or `static_graph=True` before the first "
              "step)",
         guard=True),
    _row(Code.UNFROZEN_AFTER_WRAP, Family.GRAPH, "error", "frozen_set.py",
         "requires_grad set to True after DDP was built",
         guard=True),
    _row(Code.IDENTICAL_INPUTS_ACROSS_RANKS, Family.SYNC, "warning", "agreement.py",
         "every rank got the same batch"),
    _row(Code.REDUCTION_ERROR, Family.CRASH, "error", "frozen_set.py crashed_ranks.py",
         "DDP crashed with 'Expected to have finished reduction', explained"),
    _row(Code.NO_TRAINABLE_PARAMETERS, Family.GRAPH, "error", "frozen_set.py",
         "no parameter requires a gradient"),
    _row(Code.RANK_CRASHED, Family.CRASH, "error", "failures.py crashed_ranks.py",
         "a rank died with an error that is not DDP's; the others were stopped",
         more=" (from `check`)"),
    _row(Code.RANK_HUNG, Family.CRASH, "error", "failures.py",
         "a rank stopped making progress and the others waited for it",
         more=" (from `check`)"),
    _row(Code.GRAD_BLOCKED, Family.GRAPH, "error", "used_set.py",
         "a module ran in forward but no gradient reaches its parameters (no_grad, detach, checkpoint)",
         more=": *trunk.weight ran in forward but never got a gradient (reentrant checkpoint at train.py:41 with no "
              "grad-requiring input)*"),
    _row(Code.MODEL_NOT_WRAPPED, Family.SYNC, "error/info", "not_wrapped.py",
         "an optimizer trains parameters on several ranks with no DDP around them",
         when="error; info when a manual sync kept the replicas equal",
         more=": *no DDP: 4 of 4 trained parameters differ across ranks* (from `check`)"),
    _row(Code.COLLECTIVE_MISMATCH, Family.LOCKSTEP, "error/warning", "consistency.py following_ends.py failures.py",
         "ranks issued different collectives, or different numbers of synced backward passes",
         when="error; warning for a DDP forward with autograd on and no backward on some ranks that issued no "
              "collective",
         more=": *rank 1 skipped all_reduce (train.py:41) that rank 0 called* (from `check`'s beacons when the job "
              "aborts or hangs); *the ranks issued different collectives in step 0 (rank 1 differs from rank 0)* "
              "(per-step digests, when the job goes on); *rank 0 ran DDP's forward with autograd on and no backward "
              "at eval.py:24 in step 2; rank 1 did not*; *rank 0 broadcast DDP's buffers from a forward without grad "
              "at eval.py:30 in step 2; rank 1 did not* (DDP's own buffer broadcast, counted per step); a collective "
              "one rank skips at an epoch end (see [Collectives the ranks do not agree "
              "on](#collectives-the-ranks-do-not-agree-on))"),
    _row(Code.UNEVEN_INPUTS, Family.LOCKSTEP, "error/warning/info",
         "epochs.py following_ends.py sharded_failures.py",
         "ranks have different numbers of batches per epoch",
         when="error when a training loader's batch counts differ; warning for a loader no optimizer step trained on "
              "(an evaluation); info when they are equal only through `DistributedSampler`'s padding",
         more=": *ranks have different numbers of batches per epoch (rank 0: 13, rank 1: 12)*, from each loader's "
              "`len()` and from the batches every pass really handed out on each rank (an `IterableDataset` without "
              "`len()` too), naming the loader's line and each rank's count; for an FSDP2 or `replicate` job (no DDP "
              "step record), the training loaders' `len()` per rank when the run ends (or as the cause of a run "
              "that failed after a rank ran out of batches), and a fix without `Join`, which does not cover a sharded "
              "model",
         guard=True),
    _row(Code.SAMPLER_EPOCH_NOT_SET, Family.LOCKSTEP, "warning", "epochs.py following_ends.py",
         "a shuffling DistributedSampler starts a new epoch without set_epoch",
         more=", named by the loader's creation line and the epochs seen: *started a new epoch with the same epoch "
              "(0) (the DataLoader created at train.py:19)*; never for a non-shuffling sampler (evaluation) or a "
              "loader iterated once; for an FSDP2 or `replicate` job, at the epoch the check followed",
         guard=True),
    _row(Code.RANK_EXITED, Family.CRASH, "error", "failures.py",
         "a rank left the job early (any exit status) while the others still trained",
         more=": *rank 1 exited (status 0) at step 3; rank 0 trained on* (from `check`)"),
    _row(Code.BATCHNORM_NOT_SYNCED, Family.HELPERS, "info", "consistency.py",
         "BatchNorm layers train on each rank's batch alone (no SyncBatchNorm)",
         more=": *BatchNorm without SyncBatchNorm: 1 layer normalizing over each rank's own batch (6 samples per "
              "rank)*"),
    _row(Code.GRAD_SCALER_MISMATCH, Family.HELPERS, "warning", "consistency.py",
         "AMP GradScaler's scale differs across ranks at an optimizer step",
         more=": *GradScaler's scale differs across ranks at step 0 (rank 0: 65536, rank 1: 1024)*"),
    _row(Code.OPTIMIZER_DIFFERS, Family.DIVERGENCE, "error", "causes.py",
         "the optimizers' settings (a hyperparameter, the groups, a scheduler's lr) differ across ranks",
         more=": *the optimizer's lr differs across ranks from step 1*, at a step every rank took, naming the value "
              "on each rank and the scheduler call made on some ranks only"),
    _row(Code.OPTIMIZER_STEP_SKIPPED, Family.DIVERGENCE, "error", "causes.py",
         "in one lockstep iteration some ranks called optimizer.step() and others did not",
         more=": *rank 1 did not call optimizer.step() in iteration 2; the other ranks did*"),
    _row(Code.GRADS_REDUCED_TWICE, Family.DIVERGENCE, "error/warning", "causes.py",
         "the script reduces gradients that DDP has already reduced",
         when="error; warning when the second reduction is an AVG (it changes nothing, it only costs)",
         more=": *gradients reduced again after DDP reduced them (all_reduce(float32[16, 8])/2 at train.py:24)*, "
              "with the op and the factor"),
    _row(Code.REPLICAS_DIFFER_AT_WRAP, Family.DIVERGENCE, "error", "causes.py",
         "the replicas differ before the first step (init_sync=False, a per-rank seed)"),
    _row(Code.WEIGHTS_CHANGED_OUTSIDE_OPTIMIZER, Family.DIVERGENCE, "error", "causes.py",
         "parameters changed on some ranks only, outside the optimizer",
         more=" (between DDP's wrap or an optimizer step and the next forward): *rank 0 changed the weights between "
              "DDP's wrap and the first forward*, with `load_state_dict`'s line"),
    _row(Code.GRADS_CHANGED_AFTER_SYNC, Family.DIVERGENCE, "error", "causes.py",
         "gradients agreed after DDP's all-reduce but differ at optimizer.step() (edited on some ranks only, e.g. "
         "clip_grad_norm_ under if rank == 0)",
         more=": *gradients changed on rank 0 after DDP synchronized them (0.weight and others)*, with the "
              "parameters, the steps and the line of the `clip_grad_norm_` / `clip_grad_value_` call (or that "
              "`.grad` was written in place or replaced, when no clipping call was seen)"),
    _row(Code.PARAM_SHAPES_DIFFER, Family.WRAP_AND_EPOCH_ENDS, "error", "shapes.py",
         "parameters have different shapes on different ranks when DDP is built",
         more=": *embed.weight is [9, 16] on rank 0, [11, 16] on rank 1* (from `check`; see [At wrap](#at-wrap))"),
    _row(Code.CHECKPOINT_SAME_PATH, Family.WRAP_AND_EPOCH_ENDS, "warning", "checkpoints.py",
         "several ranks wrote the same file with torch.save (no rank guard)",
         more=": *2 ranks wrote the same file checkpoints/last.pt with torch.save*, with the ranks and the line (see "
              "[Checkpoints](#checkpoints))"),
    _row(Code.CHECKPOINT_MODULE_PREFIX, Family.WRAP_AND_EPOCH_ENDS, "info", "checkpoints.py",
         "the DDP wrapper's state dict (keys 'module.*') was saved",
         more=": *the DDP wrapper's state dict was saved to checkpoints/last.pt*"),
    _row(Code.TIMEOUT_RISK, Family.WRAP_AND_EPOCH_ENDS, "error/warning", "following_ends.py",
         "a rank works alone while the others wait in a collective, long enough to reach the timeout",
         when="error when the projection reaches the timeout, warning at half of it",
         more=", after the observed steps: *rank 0 works alone for about 40 s at the loaders' real lengths while the "
              "others wait; the process group's timeout is 20 s*, with the line span, the capped passes in it, the "
              "measured and projected seconds (see "
              "[check.md](check.md#following-the-epoch-ends---follow-epochs---limit-batches))"),
    _row(Code.INPUT_BOUND, Family.TIMING, "warning", "throughput.py sharded_timing.py",
         "the ranks spend a large share of every step waiting for the next batch",
         more=": *the ranks wait for data 80% of each step (17.4 ms of 21.8 ms)*, naming the DataLoader, its "
              "creation line, `num_workers` and `pin_memory` (see [Where the step time "
              "goes](#where-the-step-time-goes))"),
    _row(Code.STRAGGLER_RANK, Family.TIMING, "warning", "throughput.py sharded_timing.py",
         "one rank is consistently slower and the others wait for it in the gradient all-reduce (or a sharded "
         "model's collectives)",
         more=": *rank 1 is 20.3x slower; the other ranks wait 30.2 ms per step for it*, naming the phase where its "
              "extra time goes"),
    _row(Code.BACKWARD_PASSES_DIFFER, Family.GRAPH, "error/warning/info", "passes.py crashed_ranks.py",
         "two backward passes through one DDP forward reach different parameters (a GAN)",
         when="error; warning in a plain loop when every parameter gets its gradient in exactly one pass (the "
              "default flags then reduce correctly); info under Lightning with `find_unused_parameters=True`",
         more=": *backward passes through one DDP forward reach different parameters (lightning_gan.py:32, "
              "lightning_gan.py:36)*, naming the parameters some pass leaves out and the line of each backward (see "
              "[Several backward passes through one forward](#several-backward-passes-through-one-forward))"),
    _row(Code.OPTIMIZER_PARAMS_REPLACED, Family.FSDP2, "error", "sharded.py tree_state.py",
         "the optimizer holds parameters that are no longer the model's (fully_shard replaced them, or a module was "
         "replaced after the optimizer was built): it does not update the ones the model uses",
         more=": *the optimizer steps 6 parameters that are no longer the model's*, with its creation line and "
              "whether any weight changed (from `check`)"),
    _row(Code.UNSHARDED_PARAMS_NOT_SYNCED, Family.FSDP2, "error/warning/info", "unsharded.py",
         "parameters outside every fully_shard group train on each rank with nothing to sync them",
         when="error when they already differ across ranks; info when they trained and stayed equal (the script "
              "syncs them, as `ignored_params` asks, or every rank saw the same batches); warning when they did not "
              "change",
         more=" (the root not sharded, a module added after sharding, `ignored_params`): *2 parameters outside every "
              "fully_shard group "
              "differ across ranks* (from `check`)"),
    _row(Code.GRADIENT_SYNC_OFF, Family.FSDP2, "error", "sharded.py",
         "gradient sync was off (set_requires_gradient_sync(False)) at every optimizer step",
         more=": *gradient sync was off at all 8 optimizer steps*, with the line of the last call (from `check`)"),
    _row(Code.SHARDED_CHECKPOINT_INCOMPLETE, Family.FSDP2, "error", "sharded.py sharded_failures.py",
         "a torch.save of sharded state on some ranks only: the file holds their shards, not the model",
         more=": *rank 0 alone saved the sharded state dict: ck.pt holds 1 of 2 ranks' shards*, with the line, a "
              "parameter's shard shape against its full shape, and the fix on every rank (from `check`); when the "
              "run then fails (`state_dict()` after an evaluation reshards the root on the saving ranks only, and "
              "the next forward's all-gathers differ), the failure report names the `state_dict()` line"),
    _row(Code.STATE_GATHER_SOME_RANKS, Family.FSDP2, "error", "sharded_failures.py",
         "a full state dict of sharded parameters gathered on some ranks only: a collective the others never enter",
         more=": *rank 0 gathered the full state dict alone: get_model_state_dict at train.py:58*, with where the "
              "others went instead and what the mismatched collectives did (from `check`, when the run failed)"),
    _row(Code.SHARDED_FORWARD_SOME_RANKS, Family.FSDP2, "error", "sharded_failures.py",
         "a forward through the sharded model on some ranks only (an evaluation on rank 0): its all-gathers wait",
         more=": *rank 0 ran a forward through the sharded model that rank 1 did not: train.py:41*, with each "
              "rank's count of forwards at that line and where the others were (from `check`, when the run failed)"),
    _row(Code.LOW_PRECISION_REDUCE, Family.FSDP2, "info", "sharded.py",
         "gradients reduced in bfloat16 (or float16) while the weights train in float32 (reduce_dtype unset or low)",
         more=": *gradients are reduced in bfloat16 while the weights train in float32*, with the difference "
              "measured on one backward against a float32 reduction of the same gradients (from `check`)"),
    _row(Code.UNREGISTERED_PARAMETERS, Family.DIVERGENCE, "error/warning", "tree_state.py",
         "parameters in the model that DDP's reducer does not hold (created or replaced after DDP was built): each "
         "rank trains them alone",
         when="error when they differ across ranks in the observed steps; warning while they still agree",
         more=": *2 trainable parameters are not in DDP's reducer: head.weight, head.bias, attached at "
              "train.py:31 after DDP was built*, with the step at which they part across ranks, and the parameters "
              "the replaced module left in DDP's reducer (which get no gradient: not a reason to freeze anything)"),
    _row(Code.NONFINITE_VALUES, Family.PROGRESS, "error", "moves.py",
         "gradients or weights hold NaN or infinity",
         more=": *the gradients of 4 parameters are NaN or infinite from step 0; the weights already were before the "
              "first step*, with the likely cause (a model materialised from the meta device whose parameters were "
              "never initialised)"),
    _row(Code.TRAINING_STALLED, Family.PROGRESS, "error", "moves.py",
         "the optimizer's steps change no weight: every gradient is exactly zero, or the learning rate is 0",
         more=": *every gradient was exactly zero at all 8 observed steps*, with the likely cause (a loss that does "
              "not depend on the weights, such as a cross-entropy over a single output column)"),
)
# fmt: on

_BY_CODE: dict[Code, CodeInfo] = {row.code: row for row in TABLE}
assert list(_BY_CODE) == list(Code), "TABLE holds every Code once, in Code's order"

CODES: dict[str, str] = {row.code.value: row.summary for row in TABLE}
"""code -> its one-line meaning (`ddp-doctor codes --json`; `from ddp_doctor import CODES`)."""


def info(code: str) -> CodeInfo:
    """The row of `code` (a `Code` or its string). Raises ValueError for a string that is no code."""
    return _BY_CODE[Code(code)]
