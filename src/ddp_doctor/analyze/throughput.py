"""Where the step time goes: `input-bound` (the ranks wait for their data), and how the step is measured, which
`straggler-rank` (`analyze/stragglers.py`: one rank is slower and the others wait for it) shares. Measurements on
this machine, so both rules ask for an effect that is large in milliseconds, large in share, and consistent over
the observed steps; a noisy shared machine, or a tiny model whose steps take a millisecond, shows neither.

The rules, on each rank's `RankTiming` (medians and quartiles over its common steps, the first left out):

- **input-bound**: a rank waits for data when its median wait for the next batch is at least `MIN_WAIT_S` and at
  least `INPUT_SHARE` of its median step, in three steps out of four it waited at least `INPUT_SHARE_Q1` of the
  step, and the wait is longer than the step-to-step spread of its steps (their interquartile range). The finding needs more than half of the measured ranks waiting, and a DataLoader iterated while
  observed: without one, the time between steps is the loop's own (a benchmark timing other models in between, an
  evaluation), not evidence of waiting for data.
Both need at least `MIN_STEPS` measured steps on every rank compared: with fewer there are no quartiles to tell a
consistent effect from a few slow steps.

For a DDP on GPUs (`device_ids` set) the phases are host-side times, and with CUDA the host runs ahead of the device:
the time it spends waiting for a batch may be time the GPU was busy (a `loss.item()` after the optimizer step waits
for the GPU there), and the all-reduce the others wait in does not block the host. So there the wait for data and
the step are taken on the GPU's clock (`observation/device_clock.py`: CUDA events at each step's end and the next
forward, so the wait is the time the GPU sat idle), and `input-bound` decides on those. `straggler-rank` does not run
on GPUs: the waits in NCCL's all-reduce, on its own streams, are not timed. Ground truth on one H100, NCCL, one rank
(tests/scripts/gpu_input.py, tests/timing/test_check_gpu_steps.py; the numbers there).

Every rank's statistics reach the analysis already reduced (`exchange/ranktable.py`): counts, the slowest rank,
medians over ranks; the rows of a few ranks whole. Nothing here grows with the world size.
"""

from __future__ import annotations

import dataclasses

from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.agreed import Agreed
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of
from ddp_doctor.core.steptime import INPUT_SHARE, INPUT_SHARE_Q1, MIN_WAIT_S, RankTiming

__all__ = [
    "INPUT_SHARE",
    "INPUT_SHARE_Q1",
    "MIN_WAIT_S",
    "host_times_tell",
    "input_bound",
    "input_bound_finding",
    "gpu_timed",
    "ms",
    "rank_timings",
]


def host_times_tell(v: View) -> bool:
    """The host's clock measures the step: a CPU model (DDP built without `device_ids`, and no rank timed on a GPU:
    a single-device CUDA module can be wrapped without them)."""
    return not v.info.ddp_config.get("device_ids") and not any(t.gpu_clock for t in v.summary.step_times.shown)


def gpu_timed(v: View) -> bool:
    """The ranks' waits for data and steps were taken on the GPU's clock (every rank shown; they run one code)."""
    shown = v.summary.step_times.shown
    return bool(shown) and all(t.gpu_clock for t in shown)


def rank_timings(v: View) -> list[RankTiming]:
    """The measured ranks among the lowest 8, the slowest and the fastest (copies: the caller may renumber them)."""
    return [dataclasses.replace(t) for t in v.summary.step_times.shown]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def loader_words(d: dict) -> tuple[str, str]:
    """A DataLoader's name (its dataset's type, its line) and its settings, from its `dataloaders.describe`."""
    name = f"the DataLoader over {d.get('dataset_type') or 'its dataset'}"
    if d.get("site"):
        name += f" created at {d['site']}"
    settings = ", ".join(
        f"{k}={d[k]}" for k in ("num_workers", "pin_memory", "persistent_workers", "batch_size") if k in d
    )
    return name, settings


@detects(Code.INPUT_BOUND, road="every")
def input_bound(a: Agreed) -> list[Finding]:
    """More than half of the measured ranks wait for data, whatever the parallelism. A sharded model has no DDP
    hooks to split its steps: the watch times them from the host's clock (`observation/step_clock.py`; on CUDA
    from events on the model's stream, the GPU's idle time), and the same thresholds decide
    (`core/steptime.waits_for_data_at`) on every rank, the reduction carrying the lowest and highest of each rank's
    figures.

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks (`tests/scripts/fsdp2_slow_loader.py`, a dataset
    that sleeps 5 ms per sample, 8 samples per batch): with no worker the ranks waited 42 ms of a 70 ms step (the
    script's own clock); with 4 workers 2 ms of 27 ms. Both end with exit code 0 (tests/timing/test_check_fsdp2_steps.py).
    DDP: tests/timing/test_step_time.py."""
    w = a.input_wait
    if w is None or 2 * w.waiting <= w.measured:
        return []
    found = input_bound_finding(
        who="all ranks" if w.waiting == w.measured == a.world else f"{w.waiting} of {w.measured} ranks",
        clock=w.clock,
        steps=w.steps,
        wait=w.wait_s,
        step=w.step_s,
        compute=w.compute_s,
        loader=w.loader,
        sites=w.sites,
        ranks=w.ranks,
        more_ranks=w.more,
        device_type=a.device_type,
    )
    return [found]


_CLOCKS = {
    "host": "this machine's clock",
    "gpu": "the GPU's clock (CUDA events on the model's stream: the GPU idle from a step's end until the forward's "
    "work reached it)",
}


def _span(lo: float, hi: float) -> str:
    """`42.0 ms`, or `40.0-42.0 ms` for the lowest and highest over the ranks."""
    return ms(lo) if round(lo * 1e3, 1) == round(hi * 1e3, 1) else f"{lo * 1e3:.1f}-{hi * 1e3:.1f} ms"


def input_bound_finding(
    *,
    who: str,
    clock: str,
    steps: int,
    wait: tuple[float, float],
    step: tuple[float, float],
    loader: dict,
    sites: list[str],
    ranks: list[int],
    more_ranks: int = 0,
    compute: float | None = None,
    device_type: str = "",
) -> Finding:
    """`input-bound`, for every parallelism: `who` wait for data (`"all ranks"`, `"3 of 4 ranks"`), measured on
    `clock` (`host` or `gpu`) over `steps` steps; `wait` and `step` are the waiting ranks' median wait and step,
    as (lowest, highest) over them; `compute` the median forward and backward where DDP's hooks timed it; `loader`
    the training DataLoader (`dataloaders.describe`), `sites` every loader's line; `device_type` where the model
    runs (pinned memory helps a copy to a GPU only)."""
    (wait_lo, wait_hi), (step_lo, step_hi) = wait, step
    share = wait_lo / step_hi if step_hi > 0 else 1.0
    ranged = (wait_lo, step_lo) != (wait_hi, step_hi)
    name, settings = loader_words(loader)
    against = f", against {ms(compute)} of forward and backward compute" if compute is not None else ""
    return Finding(
        code=Code.INPUT_BOUND,
        severity="warning",
        title=f"{who} wait for data {'at least ' if ranged else ''}{share:.0%} of each step ({_span(wait_lo, wait_hi)} "
        f"of {_span(step_lo, step_hi)})",
        detail=f"Measured on {_CLOCKS[clock]} over {steps} steps (the first observed step left out): {who} wait "
        f"{_span(wait_lo, wait_hi)} per step (median{', the lowest and highest over the ranks' if ranged else ''}) "
        f"between the end of one optimizer step and the next forward, of a median step of {_span(step_lo, step_hi)}"
        f"{against}. The input comes from {name}" + (f" ({settings})" if settings else "") + ". That time is spent "
        "in the loader's __next__ and whatever else the loop does between steps; more GPUs will not make the run "
        "faster until it shrinks.",
        ranks=ranks,
        more_ranks=more_ranks,
        steps=[],
        fix=input_fix(loader.get("num_workers"), gpu=device_type != "cpu"),
        sites=lines_of(*sites),
        measured=[
            Measure("data_wait", wait_lo, "s"),
            Measure("step", step_hi, "s"),
            Measure("data_wait_share", share, "fraction"),
            Measure("steps_timed", steps, "count"),
            *(Measure(k, loader[k], "count") for k in ("num_workers", "batch_size") if loader.get(k) is not None),
        ],
        labels=_loader_labels(clock, loader),
    )


def _loader_labels(clock: str, loader: dict) -> dict[str, str]:
    """`input-bound`'s named evidence: the clock, the loader's dataset type and its memory settings."""
    named = {"clock": clock}
    if loader.get("dataset_type"):
        named["dataset"] = str(loader["dataset_type"])
    for key in ("pin_memory", "persistent_workers"):
        if key in loader:
            named[key] = str(loader[key])
    return named


def input_fix(workers: int | None, *, gpu: bool = True) -> str:
    """The fix of `input-bound` for a loader with `workers` worker processes (None: not known), for a model on a GPU
    (pinned memory speeds the copy there) or not."""
    first = (
        "give it worker processes (num_workers=4 or more, so that decoding runs beside the step)"
        if workers == 0
        else "give it more worker processes (num_workers) or a larger prefetch_factor"
    )
    return (
        f"{first}; persistent_workers=True keeps them between epochs; "
        + ("pin_memory=True speeds the copy to the GPU; " if gpu else "")
        + "move decoding and augmentation out of the training loop (into the Dataset run by the workers, or done "
        "once beforehand)."
    )
