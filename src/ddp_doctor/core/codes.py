"""The finding codes: one table, the JSON contract. A code may be added; none may be renamed.

Every module names a code through `Code` (`Code.UNUSED_PARAMETERS`, never the bare string: `tests/test_codes.py`
scans the package), so a typo is an `AttributeError`, not a finding with an unknown code. A `Code` is its string: it
compares, hashes, formats and serializes to JSON as the stable name, so the reports are byte for byte what they were.

`code_table.py`'s `TABLE` holds each code's family, the severities it is reported at and where it is decided.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["REPORT_ORDER", "SEVERITIES", "Code"]

SEVERITIES = ("error", "warning", "info")
"""Most severe first."""


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
    # The fourth round (issue #32): gradients that DDP synchronized, changed on some ranks before the step.
    GRADS_CHANGED_AFTER_SYNC = "grads-changed-after-sync"
    # Issue #27 (what happens at wrap and at epoch ends):
    PARAM_SHAPES_DIFFER = "param-shapes-differ"
    CHECKPOINT_SAME_PATH = "checkpoint-same-path"
    CHECKPOINT_MODULE_PREFIX = "checkpoint-module-prefix"
    TIMEOUT_RISK = "timeout-risk"
    # Where the step time goes (measurements on this machine):
    INPUT_BOUND = "input-bound"
    STRAGGLER_RANK = "straggler-rank"
    # Issue #32 (never confidently wrong):
    BACKWARD_PASSES_DIFFER = "backward-passes-differ"
    # Data parallelism beyond DDP: FSDP2 (`fully_shard`).
    OPTIMIZER_PARAMS_REPLACED = "optimizer-params-replaced"
    UNSHARDED_PARAMS_NOT_SYNCED = "unsharded-params-not-synced"
    GRADIENT_SYNC_OFF = "gradient-sync-off"
    SHARDED_CHECKPOINT_INCOMPLETE = "sharded-checkpoint-incomplete"
    STATE_GATHER_SOME_RANKS = "state-gather-some-ranks"
    SHARDED_FORWARD_SOME_RANKS = "sharded-forward-some-ranks"
    LOW_PRECISION_REDUCE = "low-precision-reduce"
    # The invariants of data parallelism: what the module tree holds, whatever created it.
    UNREGISTERED_PARAMETERS = "unregistered-parameters"
    NONFINITE_VALUES = "non-finite-values"
    TRAINING_STALLED = "training-stalled"


# fmt: off
REPORT_ORDER: tuple[Code, ...] = (
    # Where each finding decided from the exchanged `Summary` reads in a report, within its severity: errors that
    # explain others first (DDP's error, then why replicas diverge), the symptoms after them, timing last. A detector
    # (`analyze/view.py`'s `detects`) may only be registered for a code listed here.
    Code.NONFINITE_VALUES, Code.OPTIMIZER_PARAMS_REPLACED, Code.UNREGISTERED_PARAMETERS, Code.REDUCTION_ERROR, Code.BACKWARD_PASSES_DIFFER, Code.REPLICAS_DIFFER_AT_WRAP,
    Code.WEIGHTS_CHANGED_OUTSIDE_OPTIMIZER, Code.OPTIMIZER_STEP_SKIPPED, Code.OPTIMIZER_DIFFERS,
    Code.GRADS_REDUCED_TWICE, Code.GRADS_CHANGED_AFTER_SYNC, Code.STATIC_GRAPH_UNSAFE, Code.WRAPPER_BYPASS,
    Code.UNFROZEN_AFTER_WRAP, Code.FROZEN_AFTER_WRAP, Code.UNUSED_PARAMETERS, Code.GRAD_BLOCKED,
    Code.COLLECTIVE_MISMATCH, Code.DYNAMIC_GRAPH, Code.RANK_DEPENDENT_GRAPH, Code.USED_OUTSIDE_FORWARD,
    Code.REENTRANT_CHECKPOINT, Code.GRADS_NOT_SYNCED, Code.REPLICA_DIVERGENCE, Code.BUFFER_DIVERGENCE,
    Code.IDENTICAL_INPUTS_ACROSS_RANKS, Code.NO_TRAINABLE_PARAMETERS, Code.FIND_UNUSED_UNNEEDED, Code.UNEVEN_INPUTS,
    Code.SAMPLER_EPOCH_NOT_SET, Code.CHECKPOINT_SAME_PATH, Code.CHECKPOINT_MODULE_PREFIX, Code.GRAD_SCALER_MISMATCH,
    Code.BATCHNORM_NOT_SYNCED, Code.TRAINING_STALLED, Code.INPUT_BOUND, Code.STRAGGLER_RANK,
)
# fmt: on
