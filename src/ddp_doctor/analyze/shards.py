"""The ranks' shares of the data (`shards-overlap`): every rank's training loader splits one dataset with a
DistributedSampler, and the samplers must agree on everything but the rank (seed, shuffle, drop_last,
num_replicas, the dataset's length) and each must be its own rank's; a loader with no DistributedSampler over a
dataset that is the same on every rank (`observation/datasets.py`) hands every rank all of it. Decided from the loaders the exchange held apart
(DDP's predicate "sampler-apart", the sharded exchange's `samplers_apart`); the overlap is computed from the samplers' settings with torch's own DistributedSampler."""

from __future__ import annotations

from typing import Any

import torch.utils.data as tud

from ddp_doctor.analyze.common import with_more
from ddp_doctor.analyze.view import detects
from ddp_doctor.core.agreed import Agreed
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of

__all__ = ["samplers_apart", "shards_overlap"]

_SHARED = ("seed", "shuffle", "drop_last", "num_replicas", "dataset", "sampled_digest")
"""What every rank's sampler must hold alike (`dataset`: the dataset's length)."""
MAX_COMPUTED = 2_000_000
"""The largest dataset whose shares are computed index by index."""


def _indices(d: dict[str, Any]) -> set[int]:
    """The indices this sampler hands out in its epoch (torch's own DistributedSampler, on a range)."""
    sampler = tud.DistributedSampler(
        range(d["dataset"]),
        num_replicas=d["num_replicas"],
        rank=d["rank"],
        shuffle=d["shuffle"],
        seed=d["seed"],
        drop_last=d["drop_last"],
    )
    sampler.set_epoch(d["epoch"])
    return set(sampler)


def _overlap(held: dict[int, dict[str, Any]]) -> tuple[int, int, int] | None:
    """(indices rank 0 and the first other rank both read, indices none of these ranks read, the dataset's
    length), when every one is torch's DistributedSampler over one dataset length that is small enough."""
    lengths = {d.get("dataset") for d in held.values()}
    if len(lengths) != 1 or not all(d.get("exact") for d in held.values()):
        return None
    n = lengths.pop()
    if not isinstance(n, int) or not 0 < n <= MAX_COMPUTED:
        return None
    shares = {r: _indices(d) for r, d in held.items()}
    first, *others = shares
    both = len(shares[first] & shares[others[0]]) if others else 0
    read = set().union(*shares.values())
    return both, n - len(read), n


@detects(Code.SHARDS_OVERLAP, road="every")
def shards_overlap(a: Agreed) -> list[Finding]:
    """The training loaders the exchange held apart, for every parallelism."""
    if (apart := a.samplers_apart) is None:
        return []
    found = samplers_apart(apart.held, world=a.world, ranks=apart.ranks)
    return [with_more(found, apart.more)] if found is not None else []


def samplers_apart(held: dict[int, dict[str, Any]], *, world: int, ranks: list[int]) -> Finding | None:
    """`shards-overlap` for every parallelism: `held` maps ranks (the reference first) to their training loader's
    record (`dataloaders.describe`, with the sampler's settings), `ranks` are the other ranks the exchange named.
    None when no record holds a DistributedSampler's settings, or the ranks' datasets differ."""
    whole = {r: d for r, d in held.items() if d.get("dataset_digest")}
    if whole:
        return _whole(whole, world=world, ranks=ranks) if len(whole) == len(held) else None
    held = {r: d for r, d in held.items() if d.get("sampler") == "DistributedSampler" and "seed" in d}
    if not held:
        return None
    ref = next(iter(held.values()))
    apart = [k for k in _SHARED if len({str(d.get(k)) for d in held.values()}) > 1]
    wrong = [r for r, d in held.items() if d.get("rank") != r or d.get("num_replicas") != world]
    said = [
        f"{'dataset length' if k == 'dataset' else k}: " + ", ".join(f"{d.get(k)} on rank {r}" for r, d in held.items())
        for k in apart
        if k != "sampled_digest"
    ]
    subsets = "sampled_digest" in apart  # the same settings over different datasets: no overlap to compute
    if subsets:
        said.append(_sampled_words(held))
    said += [
        f"rank {r}'s sampler has rank={held[r].get('rank')}, num_replicas={held[r].get('num_replicas')} (it is rank "
        f"{r} of {world})"
        for r in wrong
    ]
    if not said:
        return None
    overlap = None if subsets else _overlap(held)
    measured: list[Measure] = []
    consequence = "so the ranks' shares of the data are not the disjoint parts of one split"
    after = "Training still runs, on a different mix of the data than one split gives."
    if overlap is not None:
        both, unread, n = overlap
        pair = sorted(held)[:2]
        consequence = (
            f"so their shares overlap: in epoch {ref.get('epoch', 0)} rank {pair[0]} and rank {pair[-1]} both read "
            f"{both} of the {n} samples' indices"
        )
        measured = [Measure("indices_read_twice", both, "count"), Measure("epoch", ref.get("epoch", 0), "count")]
        if len(held) == world:  # every rank's share is known: what none of them reads, too
            consequence += f", and {unread} are read by no rank"
            measured.append(Measure("indices_unread", unread, "count"))
        after = (
            "Training still runs, these ranks on the same samples."
            if both == n
            else "Training still runs: some samples count twice per epoch and others never."
        )
    site = ref.get("site")
    return Finding(
        code=Code.SHARDS_OVERLAP,
        sites=lines_of(site or ""),
        severity="warning",
        title=f"the ranks' DistributedSamplers {'disagree' if apart else 'do not split the data over the group'} "
        f"({'; '.join(said[:2])})",
        detail=f"Each rank's DistributedSampler{f' (the DataLoader at {site})' if site else ''} shuffles "
        "the indices of the dataset from its seed and takes every num_replicas-th from its rank on; that "
        f"splits the data only when every rank's sampler holds the same settings but its rank. Here "
        f"{'; '.join(said)}: {consequence}. {after}",
        params=[],
        ranks=sorted({*held, *ranks}),
        steps=[],
        fix="split the dataset alike on every rank: random_split(dataset, lengths, "
        "generator=torch.Generator().manual_seed(seed)) with one seed for all ranks (random_split draws from the "
        "global generator otherwise, which a per-rank torch.manual_seed makes each rank's own), then "
        "DistributedSampler over that split."
        if subsets and len(apart) == 1
        else "build the sampler alike on every rank: DistributedSampler(dataset, shuffle=True, seed=args.seed) "
        "with one seed for all ranks, and num_replicas and rank left to the process group (a per-rank seed "
        "belongs in torch.manual_seed, for dropout and augmentation, not in the sampler).",
        measured=measured,
    )


def _sampled_words(held: dict[int, dict[str, Any]]) -> str:
    """What differs between the datasets the ranks' samplers sample (their digests, `observation/datasets.py`)."""
    ranks = " and ".join(f"rank {r}" for r in held)
    digests = [str(d.get("sampled_digest")) for d in held.values()]
    if all(x.startswith("subset ") for x in digests) and len({x.split(" of ", 1)[-1] for x in digests}) == 1:
        return f"the dataset each samples: another subset of one dataset on {ranks} (a random_split per rank)"
    return f"the dataset each samples: other contents on {ranks}"


def _whole(held: dict[int, dict[str, Any]], *, world: int, ranks: list[int]) -> Finding | None:
    """Every compared rank's training loader orders its whole dataset (a RandomSampler or SequentialSampler, no
    DistributedSampler), and the datasets' digests agree: one dataset, read whole by every rank. Ranks whose
    datasets differ (each loaded its own part) are not named."""
    if len({d["dataset_digest"] for d in held.values()}) != 1 or len(held) < 2:
        return None
    ref = next(iter(held.values()))
    site = ref.get("site")
    kinds = sorted({str(d.get("sampler")) for d in held.values()})
    n = ref.get("dataset")
    size = f"{n} samples, " if isinstance(n, int) else ""
    return Finding(
        code=Code.SHARDS_OVERLAP,
        sites=lines_of(site or ""),
        severity="warning",
        title=f"every rank reads the whole dataset: its DataLoader has no DistributedSampler ({', '.join(kinds)})",
        detail=f"The training loader{f' (the DataLoader at {site})' if site else ''} orders the whole dataset "
        f"({size}{ref.get('batches')} batches per epoch) on every rank with {' and '.join(kinds)}, and the dataset "
        f"is the same on rank {' and rank '.join(map(str, held))} (what it holds has the same digest): nothing splits "
        "it, so an epoch reads every sample once per rank, in each rank's own order, and the ranks' batches overlap. "
        "Training still runs, on many more samples per epoch than one split gives.",
        params=[],
        ranks=sorted({*held, *ranks}),
        steps=[],
        fix="shard it: DataLoader(dataset, batch_size=..., sampler=DistributedSampler(dataset, shuffle=True)) "
        "without shuffle=True on the DataLoader, and call sampler.set_epoch(epoch) at the start of every epoch "
        "(Accelerate's prepare() and Lightning's Trainer add the sampler themselves).",
        measured=[Measure("ranks_reading_whole_dataset", world, "count")] if len(held) == world else [],
    )
