"""Cross-rank consistency of what each rank did in a step: the same collectives in the same order, the same number
of synced passes through DDP, and no DDP forward in grad mode that only some ranks run without a backward. Pure:
records in, findings out."""

from __future__ import annotations

from ddp_doctor.analyze.rules import count
from ddp_doctor.analyze.view import View
from ddp_doctor.records import RankRecord
from ddp_doctor.report.model import Finding
from ddp_doctor.scalerprobe import decode

__all__ = ["batchnorm_not_synced", "collective_sequence_mismatch", "grad_scaler_mismatch", "synced_pass_mismatch",
           "unpaired_forward_mismatch"]


def _windows(record: RankRecord) -> list[tuple[int, list[int]]]:
    """Per optimizer step: (synced backward passes, the record's step indices in it). Steps are closed by
    optimizer.step() or, when a synced backward was not followed by one, by the next forward."""
    out, count, idx = [], 0, []
    synced, stepped = record.counter("synced_backwards").tolist(), record.counter("optimizer_step").tolist()
    for s, (n, opt) in enumerate(zip(synced, stepped)):
        count, idx = count + n, [*idx, s]
        if opt:
            out.append((count, idx))
            count, idx = 0, []
    return out


def synced_pass_mismatch(v: View) -> list[Finding]:
    """Ranks that ran different numbers of synced backward passes through DDP in one optimizer step: each extra
    backward issues DDP's gradient all-reduces once more, which the other ranks pair with their next ones."""
    if v.world < 2:
        return []
    windows = [_windows(r) for r in v.records]
    n = min(len(w) for w in windows)
    bad = [k for k in range(n) if len({w[k][0] for w in windows}) > 1]
    if not bad:
        return []
    first = bad[0]
    counts = [w[first][0] for w in windows]
    most, least = max(counts), min(counts)
    extra = [r.rank for r, c in zip(v.records, counts) if c == most]
    rest = [r.rank for r, c in zip(v.records, counts) if c != most]
    sites = sorted({site.split(": ", 1)[1] for r, w in zip(v.records, windows) if r.rank in extra
                    for site in r.repeat_sites if int(site.split(":", 1)[0].split()[1]) in w[first][1]})
    where = f" (the extra pass starts at {', '.join(sites)})" if sites else ""
    plural = "s" if len(extra) > 1 else ""
    return [Finding(
        code="collective-mismatch", severity="error",
        title=f"rank{plural} {', '.join(map(str, extra))} ran {most} synced backward passes in optimizer step {first}, "
              f"rank{'s' if len(rest) > 1 else ''} {', '.join(map(str, rest))} {least}",
        detail=f"In optimizer step {first}{where}, the ranks ran different numbers of backward passes through DDP "
               "with gradient sync on. Each synced backward issues DDP's gradient all-reduces, so the extra ones on "
               "one rank are paired with the other ranks' next ones: gradients of different steps get averaged, "
               "and the job hangs or crashes when the counts no longer line up."
               + (f" It happened again in optimizer step(s) {bad[1:]}." if len(bad) > 1 else ""),
        params=[], ranks=extra, steps=bad,
        fix="run the same number of synced forward/backward passes on every rank in each step: decide the retry "
            "from a value all-reduced across ranks, or run the extra pass under ddp.no_sync().")]


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def unpaired_forward_mismatch(v: View) -> list[Finding]:
    """Ranks that ran DDP's forward in grad mode (gradient sync on) without a backward where other ranks did not:
    typically a rank-0-only evaluation through the DDP wrapper with autograd on. DDP prepares a reduction in such a
    forward and, when it broadcasts buffers, issues a collective the other ranks never issue."""
    if v.world < 2 or not v.steps:
        return []
    counts = [r.counter("unpaired_forwards")[: v.steps].tolist() for r in v.records]
    bad = [s for s in range(v.steps) if len({c[s] for c in counts}) > 1]
    if not bad:
        return []
    first = bad[0]
    most = max(c[first] for c in counts)
    extra = [r.rank for r, c in zip(v.records, counts) if c[first] == most]
    rest = [r.rank for r, c in zip(v.records, counts) if c[first] != most]
    sites = sorted({site.split(": ", 1)[1] for r in v.records if r.rank in extra for site in r.unpaired_sites
                    if int(site.split(":", 1)[0].split()[1]) == first})
    where = f" at {', '.join(sites)}" if sites else ""
    broadcasts = bool(v.info.buffer_names) and bool(v.info.ddp_config.get("broadcast_buffers", True))
    consequence = (
        "DDP's forward broadcasts rank 0's buffers (broadcast_buffers=True and the model has buffers), a collective "
        "the other ranks do not issue at that point: their next collectives are paired with it, and the job hangs "
        "or averages the wrong tensors." if broadcasts else
        "This run went on because the model has no buffers for DDP to broadcast in that forward, so it issued no "
        "collective there; with buffers (BatchNorm, say) and broadcast_buffers=True the same line broadcasts them on "
        "these ranks alone, a collective the other ranks never join, and the job hangs (measured on torch 2.13).")
    return [Finding(
        code="collective-mismatch", severity="error" if broadcasts else "warning",
        title=f"{_ranks(extra)} ran DDP's forward with autograd on and no backward{where} in step {first}; "
              f"{_ranks(rest)} did not",
        detail=f"In step {first}, {_ranks(extra)} called the DDP model in grad mode {most} more time(s) than "
               f"{_ranks(rest)}, and no backward followed{where} (an evaluation through the DDP wrapper, say). "
               + consequence + (f" Also in step(s) {bad[1:]}." if len(bad) > 1 else ""),
        params=[], ranks=extra, steps=bad,
        fix="evaluate on one rank under torch.no_grad() through the inner module (ddp_model.module(x)), or run the "
            "evaluation on every rank.")]


def _logged(record: RankRecord, step: int) -> list[str]:
    """The rank's logged collectives of `step`, as `signature at site`."""
    prefix = f"step {step}: "
    return [entry.removeprefix(prefix) for entry in record.collective_log if entry.startswith(prefix)]


def collective_sequence_mismatch(v: View) -> list[Finding]:
    """Ranks whose own collectives (the script's `torch.distributed` calls) differed in a step that still completed:
    a different op, shape or reduction at the same position, or a different count. Compared through each step's
    count and running digest; the logged calls name the first difference. (A mismatch that aborts or hangs the
    job is named from the ranks' beacons instead, in `failures.py`.)"""
    if v.world < 2 or not v.steps:
        return []
    keys = [list(zip(r.counter("collectives")[: v.steps].tolist(), r.counter("collective_digest")[: v.steps].tolist()))
            for r in v.records]
    bad = [s for s in range(v.steps) if len({k[s] for k in keys}) > 1]
    if not bad:
        return []
    first = bad[0]
    logs = [_logged(r, first) for r in v.records]
    position = next((i for i in range(max(len(log) for log in logs))
                     if len({log[i] if i < len(log) else None for log in logs}) > 1), None)
    odd = [r.rank for r, k in zip(v.records, keys) if k[first] != keys[0][first]]
    if position is None:
        where = "the calls beyond the logged ones differ"
    else:
        shown = []
        for r, log in zip(v.records, logs):
            call = log[position] if position < len(log) else None
            shown.append(f"rank {r.rank} called {call.replace('/', ' over a group of ', 1)}" if call else
                         f"rank {r.rank} called nothing more")
            if len(shown) == 4:
                break
        where = f"at its collective #{position + 1} of the step, " + "; ".join(shown)
    counts = sorted({k[first][0] for k in keys})
    return [Finding(
        code="collective-mismatch", severity="error",
        title=f"the ranks issued different collectives in step {first} ({_ranks(odd)} "
              f"differ{'s' if len(odd) == 1 else ''} from rank {v.records[0].rank})",
        detail=f"In step {first} the script's own collectives were not the same on every rank: {where}. "
               + (f"The ranks issued {' / '.join(map(str, counts))} collectives in that step. " if len(counts) > 1
                  else "")
               + "Collectives pair up by position, so each rank combined a different tensor or reduction than it "
                 "meant to, silently, or waits for a peer that never comes."
               + (f" Also in step(s) {bad[1:]}." if len(bad) > 1 else ""),
        params=[], ranks=sorted({v.records[0].rank, *odd}), steps=bad,
        fix="make every rank of the group call the same collectives, in the same order, with the same dtype, shape "
            "and reduction: compute rank-dependent choices (which metric, which op) from values agreed across ranks "
            "first.")]


def grad_scaler_mismatch(v: View) -> list[Finding]:
    """AMP GradScaler's scale differs across ranks at an optimizer step: the ranks skip different steps (a scaler
    skips the step whose gradients hold an inf or NaN, then lowers its scale), so the replicas drift apart."""
    if v.world < 2 or not v.steps:
        return []
    scales = [r.counter("scaler_scale")[: v.steps].tolist() for r in v.records]
    bad = [s for s in range(v.steps) if any(c[s] for c in scales) and len({c[s] for c in scales}) > 1]
    if not bad:
        return []
    first = bad[0]
    shown = ", ".join(f"rank {r.rank}: {decode(c[first]):g}" if c[first] else f"rank {r.rank}: no scaler.step()"
                      for r, c in list(zip(v.records, scales))[:8])
    ref = scales[0][first]
    odd = [r.rank for r, c in zip(v.records, scales) if c[first] != ref]
    return [Finding(
        code="grad-scaler-mismatch", severity="warning",
        title=f"GradScaler's scale differs across ranks at step {first} ({shown})",
        detail="With gradients synchronized by DDP, every rank sees the same infs and NaNs, so every rank's scaler "
               "skips the same steps and keeps the same scale. Here they differ: DDP averages gradients scaled by "
               "different factors and each rank divides the average by its own scale, so the ranks apply different "
               "updates (and skip different steps), and the replicas drift apart. Usual causes: a scaler built with "
               "a rank-dependent "
               "init_scale, scaler.update() or scaler.step() called on some ranks only, or gradients that DDP did "
               "not synchronize (see the other findings)."
               + (f" Also at step(s) {bad[1:]}." if len(bad) > 1 else ""),
        params=[], ranks=sorted({v.records[0].rank, *odd}), steps=bad,
        fix="build the GradScaler with the same arguments on every rank and call scaler.scale(loss).backward(), "
            "scaler.step(optimizer) and scaler.update() on every rank in every step.")]


def batchnorm_not_synced(v: View) -> list[Finding]:
    """BatchNorm layers in training mode under DDP without SyncBatchNorm: each rank normalizes over its own batch.
    Information, not an error: it matters when the per-rank batch is small."""
    if v.world < 2 or not v.steps or not v.info.batchnorm:
        return []
    training = [r.counter("batchnorm_training")[: v.steps].tolist() for r in v.records]
    steps = [s for s in range(v.steps) if any(t[s] for t in training)]
    if not steps:
        return []
    sizes = sorted({int(b) for r in v.records for b in r.counter("batch_size")[: v.steps].tolist() if b})
    per_rank = (f"{sizes[0]} samples per rank" if len(sizes) == 1 else
                f"{sizes[0]} to {sizes[-1]} samples per rank" if sizes else "an unknown number of samples per rank")
    names = v.info.batchnorm
    listed = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return [Finding(
        code="batchnorm-not-synced", severity="info",
        title=f"BatchNorm without SyncBatchNorm: {count(len(names), 'layer')} normalizing over each rank's own "
              f"batch ({per_rank})",
        detail=f"{listed} trained in training mode without SyncBatchNorm, so each rank computes the batch mean and "
               f"variance over its own {per_rank} and keeps its own running statistics (DDP then copies rank 0's "
               "running statistics to the others at each forward when broadcast_buffers=True). That is fine when the "
               "per-rank batch is large (tens of samples or more per layer input); with a few samples per rank the "
               "statistics are noisy and training can be worse than on one device with the global batch. "
               "SyncBatchNorm computes them over the global batch at the cost of one all-reduce per layer per forward.",
        params=[], ranks=[r.rank for r in v.records], steps=steps,
        fix="if the per-rank batch is small, convert before wrapping: "
            "model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model); otherwise nothing to do.")]
