"""Batches per pass counted on every rank, and the files written, below the launcher: the exchange over 4 real gloo
ranks (each rank's count, the short rank named, a capped pass as a lower bound, the files and who wrote them), the
findings and notes read from it, and the report's new keys in JSON and text."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from dist import run_ranks

from ddp_doctor.analyze.epochs import counted_uneven
from ddp_doctor.analyze.following_ends import following_findings, unchecked
from ddp_doctor.core.findings import Recommendation, Timing, Unchecked
from ddp_doctor.core.following import FollowRecord, FollowSummary, LoaderSeen
from ddp_doctor.exchange.following_rounds import exchange_follow
from ddp_doctor.report.model import Report


def seen(key: str, counted: list[int], floors: list[int], *, training: bool) -> LoaderSeen:
    return LoaderSeen(
        key=key,
        site=key.split("#")[0],
        batches=None,
        passes=len(counted),
        most=max(floors),
        capped=sum(c < 0 for c in counted),
        training=training,
        sampler="_InfiniteConstantSampler",
        ordinal=int(key.split("#")[1].split("|")[0]),
        counted=counted,
        floors=floors,
    )


def _exchange(rank: int, world: int) -> dict:
    # One helper line builds the training loader (#1, 3 batches per epoch, 2 on rank 2) and a test loader (#2,
    # equal, its second pass capped by the check at 2). Rank 0 saves a snapshot; rank 2 also writes a log.
    train = seen("make.py:5#1|_InfiniteConstantSampler|None", [2 if rank == 2 else 3, -1], [3, 2], training=True)
    test = seen("make.py:5#2|_InfiniteConstantSampler|None", [4, -1], [4, 2], training=False)
    files = [{"path": "/w/snap.pt", "shown": "snap.pt", "site": "train.py:80", "how": "torch.save", "existed": False}]
    if rank == 2:
        files.append(
            {"path": "/w/log.txt", "shown": "log.txt", "site": "train.py:90", "how": "open()", "existed": True}
        )
    mine = FollowRecord(
        requested=1, limit=2, followed=True, epoch_ends=1, loaders=[train, test], files=files if rank in (0, 2) else []
    )
    s = exchange_follow(mine, timeout=30.0, device=torch.device("cpu"))
    return {"loaders": s.loaders, "files": s.files, "unlisted": s.files_unlisted}


def test_the_exchange_counts_each_ranks_batches_and_lists_the_files_written(tmp_path: Path) -> None:
    results = run_ranks(_exchange, tmp_path, world_size=4, timeout=120)
    assert all(r == results[0] for r in results)  # identical on every rank
    train, test = results[0]["loaders"]
    assert (train["ordinal"], test["ordinal"]) == (1, 2) and train["site"] == test["site"] == "make.py:5"
    c = train["counted"]
    assert c["uneven"] and c["pass"] == 1 and c["by_rank"] == [3, 3, 2, 3] and c["fewest_ranks"] == [2], c
    assert not test["counted"]["uneven"] and test["counted"]["by_rank"] == [4] * 4, test
    assert test["no_len"] and test["counted"]["all_first_counted"], test
    files = {f["path"]: f for f in results[0]["files"]}
    assert files["/w/snap.pt"]["ranks"] == [0, 2] and files["/w/log.txt"]["ranks"] == [2], files
    assert files["/w/log.txt"]["how"] == "open()" and files["/w/log.txt"]["existed"], files
    assert results[0]["unlisted"] == 0

    [error] = counted_uneven(results[0]["loaders"])
    # Rank 2 alone got the fewest, 2 batches; the others 3 (rank 0: 3, rank 1: 3, rank 2: 2, rank 3: 3).
    assert error.severity == "error" and (error.ranks, error.more_ranks) == ([2], 0), error
    assert {m.name: (m.value, m.unit) for m in error.measured} == {
        "batches_most": (3, "count"),
        "batches_fewest": (2, "count"),
        "pass": (1, "value"),
        **{f"batches (rank {r})": (n, "count") for r, n in enumerate([3, 3, 2, 3])},
    }, error.measured
    assert error.sites == ["make.py:5"], error.sites  # the loader's line, which the title names
    s = FollowSummary(
        followed=True, declined=False, epoch_ends=1, ended_by="", seconds=0.1, loaders=results[0]["loaders"], counts={}
    )
    notes = unchecked(s, epochs=1, limit=2, steps=8)
    assert [(u.what, u.facts) for u in notes] == [
        ("loader-later-passes", {"loader": "#2 built at make.py:5", "cap": 2})
    ]


def test_a_pass_that_handed_out_more_than_another_ranks_whole_pass_is_uneven_though_capped() -> None:
    # Rank 1's first pass was capped at 6, past rank 0's whole pass of 5: different, whatever rank 1's real end.
    loader = {
        "site": "t.py:3",
        "ordinal": 1,
        "sampler": None,
        "training": True,
        "no_len": True,
        "batches": {"min": None, "max": None, "by_rank": [None, None]},
        "passes": 1,
        "most": 6,
        "capped": 1,
        "counted": {"pass": 1, "uneven": True, "min": 5, "max": 6, "by_rank": [5, None], "at_least_by_rank": [5, 6]},
    }
    [f] = counted_uneven([loader])
    # Rank 0's whole pass, and rank 1's count as a lower bound (its pass capped), each by name.
    assert [(m.name, m.value, m.unit) for m in f.measured] == [
        ("batches_most", 6, "count"),
        ("batches_fewest", 5, "count"),
        ("pass", 1, "value"),
        ("batches (rank 0)", 5, "count"),
        ("batches at least (rank 1)", 6, "count"),
    ], f.measured
    assert f.sites == ["t.py:3"], f.sites
    # Not followed (the script ended in the observed steps): the counted passes are still compared.
    s = FollowSummary(followed=False, declined=False, epoch_ends=0, ended_by="", seconds=0, loaders=[loader], counts={})
    assert [x.code for x in following_findings(s)] == ["uneven-inputs"]
    assert unchecked(s, epochs=0, limit=2, steps=8)[0].to_dict() == {
        "what": "epoch-end",
        "steps": 8,
        "follow_epochs": 0,
    }


def test_the_files_written_and_what_went_unchecked_are_in_json_and_text() -> None:
    report = Report(
        tool_version="0.1.0",
        torch_version=torch.__version__,
        backend="gloo",
        world_size=2,
        steps_observed=8,
        ddp_config={"find_unused_parameters": False, "static_graph": False},
        findings=[],
        recommendation=Recommendation(
            find_unused_parameters=False,
            static_graph=False,
            gradient_as_bucket_view=False,
            freeze_before_wrap=[],
            reason="every parameter got a gradient",
            verified=True,
        ),
        timing=Timing(),
    )
    plain = json.loads(report.to_json())
    assert "files_written" not in plain and "unchecked" not in plain  # absent when empty
    report = dataclasses.replace(
        report,
        files_written=[
            {"path": "/w/gpt_snapshot.pt", "shown": "gpt_snapshot.pt", "site": "t.py:9", "how": "torch.save"}
            | {"existed": False, "ranks": [0]}
        ],
        unchecked=[
            Unchecked("epoch-end", "--follow-epochs 0: the script was stopped.", {"steps": 8, "follow_epochs": 0})
        ],
    )
    data = json.loads(report.to_json())
    assert data["schema"] == "ddp-doctor/report@2", data["schema"]
    assert list(data)[-3:] == ["files_written", "unchecked", "not_checked"], list(data)
    assert data["not_checked"] == [{"what": "epoch-end", "steps": 8, "follow_epochs": 0}]
    again = Report.from_dict(data)
    assert again.files_written == report.files_written and again.unchecked == report.unchecked
    text = " ".join(str(report).split())
    assert "The script wrote 1 file(s) while under the check" in text, text
    assert "the script will find them on its next run" in text, text
    assert "gpt_snapshot.pt (torch.save at t.py:9, rank(s) 0; created)" in text, text
    assert "Not checked: --follow-epochs 0" in text, text
    page = report.to_html()
    assert "the script will find them on its next run" in page and "Not checked: --follow-epochs 0" in page
