"""The words of the findings about what the ranks exchange and feed (gradients not synced or reduced twice, post-local
SGD, identical inputs, a low-precision reduction or weights), from their evidence (`ddp_doctor.report.words`)."""

from __future__ import annotations

from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, count
from ddp_doctor.core.ranks import listed, other_ranks
from ddp_doctor.report.wording import measure, value_of, words

__all__: list[str] = []


@words(Code.GRADS_NOT_SYNCED)
def _grads_not_synced(f: Finding) -> tuple[str, str]:
    """Label `kind`: the mechanism where one was seen (``sync-off``, `how` it was off, its lines the `sites`;
    ``comm-hook``, the `hook`, its line the site; ``local-sgd``, post-local SGD by design, with the `subgroup_size`
    and the measured `first_local_step` and `start_localSGD_iter`); none where the gradients differ for a cause
    the other findings name or none seen."""
    kind, n = f.labels.get("kind"), len(f.params)
    if kind == "local-sgd":
        return _local_sgd(f)
    off, why = "", ""
    if kind == "comm-hook":
        hook, where = f.labels["hook"], f" (defined at {f.sites[0]})" if f.sites else ""
        why = (
            f" DDP hands each gradient bucket to the comm hook {hook}{where}, registered with register_comm_hook, "
            "instead of all-reducing it itself; the gradients the hook handed back differ across ranks, so it does "
            "not all-reduce (and average) every bucket alike on every rank."
        )
    elif kind == "sync-off":
        by_flag = f.labels.get("how") == "require_backward_grad_sync"
        call, verb = ("require_backward_grad_sync=False", "set") if by_flag else ("no_sync()", "entered")
        where = f" ({verb} at {'; '.join(f.sites)})" if f.sites else ""
        off = f" (DDP's sync was off for every backward: {call})" if f.sites else ""
        how = "with require_backward_grad_sync=False" if by_flag else "under no_sync()"
        why = (
            f" Every backward pass of these optimizer steps ran {how}{where}, the last micro-batch included, so DDP "
            "never reduced the gradients: each rank stepped on its own."
        )
    return (
        f"gradients of {count(n, 'parameter')} differ across ranks at the optimizer step{off}",
        "When the optimizer stepped, these gradients were not the same on every rank, so the replicas take "
        f"different updates. Ranks {listed(f.ranks, f.more_ranks)} disagree in steps {f.steps}.{why}",
    )


def _local_sgd(f: Finding) -> tuple[str, str]:
    first, began = int(value_of(f, "first_local_step")), int(value_of(f, "start_localSGD_iter"))
    subgroup = f.labels.get("subgroup_size")
    alone = subgroup == "1"
    over = "one rank" if alone else f"subgroups of {subgroup} ranks" if subgroup else "subgroups"
    before = (
        f" The gradients agreed across the ranks at step{'s 0-' if first > 1 else ' '}{first - 1}." if first else ""
    )
    return (
        f"post-local SGD: from step {first} the gradients are averaged over {over}, not all ranks",
        "DDP hands each gradient bucket to torch's post_localSGD_hook, which all-reduces it over every rank for "
        f"the first {began} iterations (start_localSGD_iter={began}) and over {over} after: each "
        f"{'rank' if alone else 'subgroup'} steps on its own gradients and the replicas part until a model averager "
        f"averages the parameters. That is the algorithm, not a fault.{before}",
    )


@words(Code.IDENTICAL_INPUTS_ACROSS_RANKS)
def _identical_inputs(f: Finding) -> tuple[str, str]:
    """The steps are those whose inputs every rank saw, the ranks every one."""
    return (
        "every rank got the same batch",
        f"In all {len(f.steps)} observed steps the inputs were identical on all {len(f.ranks)} ranks, so the ranks "
        "do the same work and the job trains no faster than one rank.",
    )


@words(Code.GRADS_REDUCED_TWICE)
def _grads_reduced_twice(f: Finding) -> tuple[str, str]:
    """Labels `call` (the collective and its arguments) and `reduction`; measured `gradient_factor` (what the
    gradients were multiplied by, where known) and `group_size`; the site the call's line."""
    call = f.labels.get("call") or "a collective"
    size = measure(f, "group_size")
    over = f" over {int(size)} ranks" if size is not None else ""
    line = f.sites[0] if f.sites else "an unknown place"
    factor = measure(f, "gradient_factor")
    if factor is None:
        effect = "which replaces or changes what DDP computed"
    elif factor == 1:
        effect = "which changes nothing but exchanges every gradient a second time each step"
    else:
        effect = (
            f"so each gradient is {factor:g} times what DDP computed and every update is {factor:g} times too large, "
            "on every rank alike (nothing diverges: the learning rate is silently scaled)"
        )
    return (
        f"gradients reduced again after DDP reduced them ({call}{over} at {line})",
        f"DDP averaged the gradients across the ranks during the backward pass; then the script ran {call}{over} "
        f"({f.labels.get('reduction', 'a reduction')}) on parameters' .grad at {line}, {effect}. Seen in step(s) "
        f"{f.steps}.",
    )


_RELATIVE_STEP = {"bfloat16": "0.0039 (2^-8)", "float16": "0.00049 (2^-11)"}
"""A low dtype's relative step (the resolution of a value near 1)."""


@words(Code.LOW_PRECISION_REDUCE)
def _low_precision_reduce(f: Finding) -> tuple[str, str]:
    """Labels: `reduce_dtype` (what the reduce-scatter ran in), `weights_dtype`, the policy's `policy_param_dtype`
    and `policy_reduce_dtype`; measured: the reduced gradients' `mean_relative_difference` and
    `largest_difference` against float32; the ranks are every one."""
    low, weights = f.labels["reduce_dtype"], f.labels["weights_dtype"]
    policy = ", ".join(f"{k}={f.labels.get(f'policy_{k}', 'unset')}" for k in ("param_dtype", "reduce_dtype"))
    rel, largest = value_of(f, "mean_relative_difference"), value_of(f, "largest_difference")
    return (
        f"gradients are reduced in {low} while the weights train in {weights}",
        f"FSDP2 reduce-scattered this run's gradients in {low} (seen at its reduce-scatter, on every rank), while "
        f"the sharded weights the optimizer steps are {weights}: each gradient is summed over the ranks in {low} "
        f"before the optimizer sees it. The mixed-precision policy: {policy} (with reduce_dtype unset, torch 2.13 "
        "reduces in param_dtype, 2.15 in the weights' dtype). Measured on the second observed step, every rank's "
        "reduce-scatter against a float32 one of the same inputs: the reduced gradients differ by "
        f"{rel:.2g} of their size on average (the sum of the differences over the sum of the magnitudes), by "
        f"{largest:.3g} at most in one element; {low}'s relative step is {_RELATIVE_STEP.get(low, '')}. That is the "
        f"summation's own rounding on {len(f.ranks)} ranks, and it grows with the number of ranks. It may be what you "
        f"meant (it halves the reduce-scatter's bytes); recipes that compute in {low} usually reduce in float32 "
        "(torchtitan's default).",
    )


@words(Code.LOW_PRECISION_WEIGHTS)
def _low_precision_weights(f: Finding) -> tuple[str, str]:
    """Labels: `weights_dtype` (the sharded weights the optimizer steps) and the policy's `param_dtype`."""
    dtype, policy = f.labels["weights_dtype"], f.labels["param_dtype"]
    return (
        f"the optimizer steps {dtype} weights, the dtype the mixed-precision policy computes in",
        f"The mixed-precision policy (param_dtype={policy}) computes in {dtype}, and the sharded weights the "
        f"optimizer steps are {dtype} as well: fully_shard keeps each parameter in the dtype it had when it took it, "
        "and the policy only casts copies for forward and backward. An update smaller than a weight's resolution in "
        f"{dtype} (about 1/{256 if dtype == 'bfloat16' else 2048} of its size) is lost; with a small learning rate or "
        "late in training, most weights stop moving.",
    )


_SHOWN_SCALES = 8
"""The ranks whose scale the title shows: rank 0 and the first seven others."""


@words(Code.GRAD_SCALER_MISMATCH)
def _grad_scaler_mismatch(f: Finding) -> tuple[str, str]:
    """The ranks are rank 0 and examples of the others, the steps those at which the scales differ; measured: each
    shown rank's scale at the first (`scale (rank R)`; none for a rank that called no scaler.step())."""
    scales = {m.name: m.value for m in f.measured}
    shown = f.ranks[:_SHOWN_SCALES]
    said = ", ".join(
        f"rank {r}: {scales[f'scale (rank {r})']:g}" if f"scale (rank {r})" in scales else f"rank {r}: no scaler.step()"
        for r in shown
    )
    more = len(f.ranks) - len(shown) + f.more_ranks
    also = f" Also at step(s) {f.steps[1:]}." if len(f.steps) > 1 else ""
    return (
        f"GradScaler's scale differs across ranks at step {f.steps[0]} ({said}{other_ranks(more)})",
        "With gradients synchronized by DDP, every rank sees the same infs and NaNs, so every rank's scaler skips the "
        "same steps and keeps the same scale. Here they differ: DDP averages gradients scaled by different factors "
        "and each rank divides the average by its own scale, so the ranks apply different updates (and skip "
        "different steps), and the replicas drift apart. Usual causes: a scaler built with a rank-dependent "
        "init_scale, scaler.update() or scaler.step() called on some ranks only, or gradients that DDP did not "
        f"synchronize (see the other findings).{also}",
    )
