"""The words of the findings of a run that failed, from their evidence: where each rank was (`Finding.positions`,
in words by `core.whereabouts.said`), the ranks at fault, what the communication library said
(`ddp_doctor.report.words`)."""

from __future__ import annotations

from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.core.whereabouts import capped, said
from ddp_doctor.report.wording import flag, value_of, words

__all__: list[str] = []


@words(Code.RANK_HUNG)
def _rank_hung(f: Finding) -> tuple[str, str]:
    """`ranks`: those furthest behind; `positions`: the first of the ranks still running, in rank order; measured
    `ranks_waiting` (how many still ran); labels `timed_out` (``"True"`` where the check's own timeout ended the
    run), `other_node_ranks` (ranks another node's report covers) and `native` (the communication library's
    line)."""
    waiting = int(value_of(f, "ranks_waiting"))
    shown = capped([f"rank {p.rank} was at {said(p)}" for p in f.positions], more=waiting - len(f.positions))
    elsewhere = [int(r) for r in f.labels["other_node_ranks"].split(",")] if f.labels.get("other_node_ranks") else []
    detail = (
        shown
        + "."
        + (" The ranks ahead were waiting for the ones behind in a collective." if len(f.ranks) < waiting else "")
        + (f" {rank_list(elsewhere)} ran on another node; that node's report covers them." if elsewhere else "")
        + (f" The communication library said: {f.labels['native']}" if f.labels.get("native") else "")
    )
    title = f"{rank_list(f.ranks)} stopped making progress" + (" before the timeout" if flag(f, "timed_out") else "")
    return title, detail
