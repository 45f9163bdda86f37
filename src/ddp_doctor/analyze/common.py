"""Phrases and helpers the detectors share: flags and freezing in the framework's own words, step lists."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ddp_doctor.analyze.snippets import flags_fix, freeze_point
from ddp_doctor.analyze.view import View
from ddp_doctor.core.findings import Finding, Measure, lines_of
from ddp_doctor.core.records import Flavor

__all__ = [
    "all_ranks",
    "freeze_fix",
    "freeze_fix_in",
    "flag_labels",
    "has_flags",
    "steps_of",
    "with_evidence",
    "with_flags",
    "with_more",
]


def with_flags(v: View, **flags: bool) -> str:
    """'build DDP with ...', in the words of the framework that built the model (TrainingArguments, ...)."""
    return flags_fix(v.info.framework, flags, v.info.flavor)


def flag_labels(find_unused: bool, static_graph: bool) -> dict[str, str]:
    """DDP's two flags of the used set as a finding's labels carry them: what the report's words read
    (`report/words.py`)."""
    return {"find_unused_parameters": str(find_unused), "static_graph": str(static_graph)}


def has_flags(v: View, **flags: bool) -> bool:
    """Whether the script's DDP was built with every one of `flags` already. A fix that only sets them would change
    nothing, so an `info` finding (the current flags cope) leaves that fix out, in the JSON and in the text alike:
    printing "build DDP with static_graph=True" to a script that has it reads as if it were missing."""
    return all(bool(v.info.ddp_config.get(k, False)) == want for k, want in flags.items())


def freeze_fix(v: View) -> str:
    """Freeze before wrapping, or the flags that cope with a changing set, in the framework's words."""
    return freeze_fix_in(v.info.framework, v.info.flavor)


def freeze_fix_in(framework: str, flavor: Flavor | None) -> str:
    """`freeze_fix` for the DDP model `framework` (at `flavor`'s versions, where known) built."""
    flavor = flavor if flavor is not None else Flavor()
    return (
        f"set requires_grad=False on them {freeze_point(framework)}; if they must train on some steps, "
        f"{flags_fix(framework, {'static_graph': True}, flavor)} (same params unused every step) or "
        f"{flags_fix(framework, {'find_unused_parameters': True}, flavor)} (the set changes)"
    )


def steps_of(mask: torch.Tensor) -> list[int]:
    """The indices where a 1-d mask is set."""
    return mask.nonzero().flatten().tolist()


def all_ranks(v: View) -> list[int]:
    """Every rank of the group (a finding every rank shows)."""
    return list(range(v.world))


def with_evidence(
    finding: Finding,
    *,
    sites: Iterable[str] = (),
    measured: Iterable[Measure] = (),
    ruled_out: Iterable[str] = (),
    labels: dict[str, str] | None = None,
) -> Finding:
    """`finding`, with the script lines of the recorded `sites` (`lines_of`), the quantities it was decided on, the
    causes ruled out and the evidence that is a name: for the finding builders shared with `guard` (`rules.py`),
    which take no evidence."""
    finding.sites = lines_of(*sites)
    finding.measured = list(measured)
    finding.ruled_out = list(ruled_out)
    if labels is not None:
        finding.labels = dict(labels)
    return finding


def with_more(finding: Finding, more: int) -> Finding:
    """`finding`, with `more` ranks counted beyond those it lists (the exchange names only examples)."""
    finding.more_ranks = more
    return finding


def first_differing(pair: tuple[list[int], list[int]]) -> list[int]:
    """The positions where a (most, fewest) pair over the ranks differs: where the ranks did not agree."""
    hi, lo = pair
    return [k for k in range(len(hi)) if hi[k] != lo[k]]


def meta_sites(v: View, ranks: list[int], key: str) -> list[str]:
    """The sites the given ranks recorded under `key` in their metadata, sorted, once each."""
    return sorted({s for r in ranks for s in v.meta(r).get(key, [])})
