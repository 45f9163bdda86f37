"""Every detector of the analysis, in the order their findings appear in the report (errors that explain others
first). `analyze()` runs them all on one `View`."""

from __future__ import annotations

from collections.abc import Callable

from ddp_doctor.analyze.agreement import (
    buffer_divergence,
    grads_not_synced,
    identical_inputs,
    replica_divergence,
    wrapper_bypass,
)
from ddp_doctor.analyze.causes import (
    grads_changed_after_sync,
    grads_reduced_twice,
    optimizer_differs,
    optimizer_step_skipped,
    replicas_differ_at_wrap,
    weights_changed_outside_optimizer,
)
from ddp_doctor.analyze.checkpoints import checkpoint_module_prefix, checkpoint_same_path
from ddp_doctor.analyze.consistency import (
    batchnorm_not_synced,
    collective_sequence_mismatch,
    eval_broadcast_mismatch,
    grad_scaler_mismatch,
    synced_pass_mismatch,
    unpaired_forward_mismatch,
)
from ddp_doctor.analyze.epochs import sampler_epoch_not_set, uneven_inputs
from ddp_doctor.analyze.frozen_set import frozen_after_wrap, no_trainable, reduction_error, unfrozen_after_wrap
from ddp_doctor.analyze.passes import backward_passes_differ
from ddp_doctor.analyze.throughput import input_bound, straggler_rank
from ddp_doctor.analyze.used_set import (
    dynamic_graph,
    find_unused_unneeded,
    grad_blocked,
    rank_dependent_graph,
    reentrant_checkpoint,
    static_graph_unsafe,
    unused_parameters,
    used_outside_forward,
)
from ddp_doctor.analyze.view import View
from ddp_doctor.core.findings import Finding

__all__ = ["DETECTORS"]

DETECTORS: tuple[Callable[[View], list[Finding]], ...] = (
    reduction_error,
    backward_passes_differ,
    replicas_differ_at_wrap,
    weights_changed_outside_optimizer,
    optimizer_step_skipped,
    optimizer_differs,
    grads_reduced_twice,
    grads_changed_after_sync,
    static_graph_unsafe,
    wrapper_bypass,
    unfrozen_after_wrap,
    frozen_after_wrap,
    unused_parameters,
    grad_blocked,
    collective_sequence_mismatch,
    synced_pass_mismatch,
    unpaired_forward_mismatch,
    eval_broadcast_mismatch,
    dynamic_graph,
    rank_dependent_graph,
    used_outside_forward,
    reentrant_checkpoint,
    grads_not_synced,
    replica_divergence,
    buffer_divergence,
    identical_inputs,
    no_trainable,
    find_unused_unneeded,
    uneven_inputs,
    sampler_epoch_not_set,
    checkpoint_same_path,
    checkpoint_module_prefix,
    grad_scaler_mismatch,
    batchnorm_not_synced,
    input_bound,
    straggler_rank,
)
