"""The terminal and HTML reports as a user reads them: at 80 columns nothing is cut (finding titles, paths), the
ranks counted beyond the named examples are said in both renderers, and a run without DDP shows no DDP flags."""

from __future__ import annotations

import dataclasses
import re

from ddp_doctor.core.findings import Finding, ParamRef, Recommendation, Timing, Unchecked
from ddp_doctor.core.ranks import listed, named_ranks, other_ranks, rank_list, rank_ranges
from ddp_doctor.report import Report
from ddp_doctor.report.html import check_section
from ddp_doctor.report.text import to_text

LONG_TITLE = "1 layer normalizes over each rank's own batch of 8 samples with no SyncBatchNorm in the model"
LONG_PATH = "very/long/project/folder/with/many/nested/levels/of/packages/and/a/long/training_script_name.py"
FLAGS = {"find_unused_parameters": False, "static_graph": False, "gradient_as_bucket_view": False}


def _report(findings: list[Finding], *, ddp_config: dict | None = None, ddp_site: str | None = None) -> Report:
    return Report(
        tool_version="0.test",
        torch_version="2.x",
        backend="gloo",
        world_size=1024,
        steps_observed=3,
        ddp_config=FLAGS if ddp_config is None else ddp_config,
        findings=findings,
        recommendation=Recommendation(
            find_unused_parameters=False,
            static_graph=True,
            gradient_as_bucket_view=True,
            freeze_before_wrap=[],
            verified=False,
            reason="each rank used the same parameters on every step",
        ),
        timing=Timing(),
        ddp_site=ddp_site,
    )


def _finding(**kw) -> Finding:
    base = dict(
        code="batchnorm-not-synced",
        severity="warning",
        title=LONG_TITLE,
        detail=f"Called from {LONG_PATH}:51, in training mode.",
        params=[ParamRef("net.bn.weight", 8, (8,))],
        ranks=[0, 1],
        steps=[0],
        fix="convert with torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping",
    )
    return Finding(**{**base, **kw})


def _words(text: str) -> str:
    """The text without the boxes' borders, its lines joined: what a user reads across the wrapped lines."""
    lines = [re.sub(r"^[│╭╰]\s?|\s?[│╮╯]$", "", line).strip() for line in text.splitlines()]
    return " ".join(line for line in lines if line)


def test_a_long_finding_title_wraps_whole_at_80_columns() -> None:
    text = to_text(_report([_finding()]), width=80)
    assert max(map(len, text.splitlines())) <= 80
    assert "WARNING batchnorm-not-synced" in text
    assert LONG_TITLE in _words(text), text


def test_long_paths_wrap_instead_of_being_cut() -> None:
    site = f"{LONG_PATH}:40"
    text = to_text(_report([_finding()], ddp_site=site), width=80)
    assert "…" not in text, text
    # Folded or wrapped, every character of both paths is there, in order.
    flat = re.sub(r"\s", "", _words(text))
    assert f"DDPbuiltat{site}" in flat and f"Calledfrom{LONG_PATH}:51" in flat, text


def test_ranks_counted_beyond_the_examples_are_said_in_text_and_html() -> None:
    f = _finding(ranks=[0, 1, 2, 3, 4, 5, 6, 7], more_ranks=1015)
    report = _report([f])
    assert "seen: ranks 0-7 and 1015 others; steps [0]" in to_text(report, width=80)
    assert "ranks 0-7 and 1015 others; steps [0]" in check_section(report)


def test_a_run_without_ddp_shows_no_ddp_flags() -> None:
    report = _report(
        [_finding(code="model-not-wrapped", severity="error", title="no DDP: 4 of 4 trained parameters differ")],
        ddp_config={},
    )
    reason = "No DDP model was built, so there are no DDP flags to recommend."
    report = dataclasses.replace(report, recommendation=dataclasses.replace(report.recommendation, reason=reason))
    text = to_text(report, width=80)
    assert "No DDP model was built" in text
    assert "Recommendation (" not in text and "static_graph=" not in text and "find_unused_parameters=" not in text
    page = check_section(report)
    assert "No DDP model was built" in page and "static_graph=" not in page
    # With DDP, the flags are recommended as before.
    text = to_text(_report([]), width=80)
    assert "Recommendation (not yet verified)" in text and "static_graph=True" in text


def test_rank_lists_in_words() -> None:
    assert rank_ranges([*range(512), *range(513, 1024)]) == "0-511, 513-1023"
    assert rank_ranges([3, 17, 250], more=41) == "3, 17, 250 and 41 others"
    assert rank_ranges([1], more=1) == "1 and 1 other"
    # Cut at its limit with ranks also counted: the hidden ones join the count, so the phrase keeps one total.
    assert rank_ranges(range(0, 20, 2), limit=3, more=5) == "0, 2, 4 and 12 others"
    assert rank_ranges(range(0, 8, 2), limit=3) == "0, 2, 4 and 1 more range"
    assert rank_list([5]) == "rank 5" and rank_list([5], more=2) == "ranks 5 and 2 others"
    assert rank_list([1, 2, 3]) == "ranks 1-3"
    assert listed([0, 1]) == "[0, 1]" and listed([0, 1], 41) == "[0, 1] and 41 other ranks"
    assert named_ranks([3, 17]) == "rank(s) [3, 17]" and named_ranks([3], prefix="ranks") == "ranks [3]"
    assert named_ranks([1, 3], 2) == "ranks 1, 3 and 2 others"
    assert (
        other_ranks(0) == "" and other_ranks(1) == " and 1 other rank" and other_ranks(3, noun=False) == " and 3 others"
    )


def test_the_reshard_advice_is_worded_from_what_its_second_run_showed() -> None:
    """The analysis types the advice and its verification (`reshard`); the report words them, in text and HTML:
    advice first, then the analysis' reason; advice its second run did not prove is withdrawn, not printed."""
    advice = {"module": "layers.2", "site": "train.py:68", "call": 1, "all_gathers_per_step": 7}
    rec = Recommendation.unknown("Checked on every rank.")
    said_advice = "For speed: `reshard_after_forward=False` on layers.2 (the fully_shard call at train.py:68)."
    runs = {
        "Not yet verified": {},
        "Verified: a second run of the script with it applied made 6 all-gathers per step instead of 7, with the "
        "same findings.": {
            "verification": {"all_gathers_per_step": 6, "same_findings": True, "error": None},
            "verified_all_gathers_per_step": 6,
        },
        "with it counted 7 all-gathers per step (the first counted 7).": {
            "verification": {"all_gathers_per_step": 7, "same_findings": True, "error": None},
            "withdrawn": True,
        },
        "with it found other problems than the first.": {
            "verification": {"all_gathers_per_step": 6, "same_findings": False, "error": None},
            "withdrawn": True,
        },
        "with it failed: rank 1 crashed.": {
            "verification": {"all_gathers_per_step": None, "same_findings": False, "error": "rank 1 crashed"},
            "withdrawn": True,
        },
    }
    for said, outcome in runs.items():
        report = _report([], ddp_config={})
        report = dataclasses.replace(report, recommendation=dataclasses.replace(rec, reshard={**advice, **outcome}))
        words, page = _words(to_text(report, width=200)), check_section(report)
        assert said in words and words.index(said) < words.index("Checked on every rank."), (said, words)
        assert (said_advice in words) is not outcome.get("withdrawn", False), words
        assert ("Tried and withdrawn" in words) is outcome.get("withdrawn", False), words
        assert "layers.2" in page and ("Tried and withdrawn" in page) is outcome.get("withdrawn", False)


def test_a_second_run_of_the_flags_is_worded_from_its_typed_outcome() -> None:
    kwargs = '{"static_graph": true}'
    shown = {"ddp_kwargs": kwargs, "steps_needed": 3, "steps_observed": 8, "errors": [], "crashed": False}
    said = {
        "verified": f"Verified: a second run with these flags (--ddp-kwargs '{kwargs}') observed 8 step(s) on every "
        "rank with no error.",
        "not-run": f"A second run with these flags (--ddp-kwargs '{kwargs}') did not run: no rank started.",
        "refuted": f"Refuted: a second run with these flags (--ddp-kwargs '{kwargs}') failed: reduction-error (",
        "unconfirmed": "Not verified: a second run with these flags (--ddp-kwargs '{\"static_graph\": true}') ran "
        "without DDP's errors, but errors that flags cannot fix remain: grads-changed-after-sync (",
    }
    for outcome, words in said.items():
        errors = {"refuted": ["reduction-error"], "unconfirmed": ["grads-changed-after-sync"]}.get(outcome, [])
        verification = {**shown, "outcome": outcome, "errors": errors, "error": "no rank started"}
        rec = dataclasses.replace(_report([]).recommendation, verification=verification)
        text = _words(to_text(dataclasses.replace(_report([]), recommendation=rec), width=400))
        assert "each rank used the same parameters on every step" in text and words in text, (outcome, text)
    few = {**shown, "outcome": "unconfirmed", "steps_observed": 2, "error": None}
    rec = dataclasses.replace(_report([]).recommendation, verification=few)
    assert "it observed 2 step(s), fewer than the 3 needed" in _words(
        to_text(dataclasses.replace(_report([]), recommendation=rec), width=400)
    )


def test_a_sharded_report_says_what_it_compared_with_counts_and_what_it_did_not() -> None:
    compared = {
        "parallelism": "fsdp2", "api": "fully_shard", "ranks": 4, "steps": 8, "parameters": 14, "outside_groups": 2,
        "buffers": 6, "saves": "the observed steps", "timed_steps": 7, "clock": "host", "straggler": True,
        "all_gathers_per_step": 10,
    }  # fmt: skip
    report = dataclasses.replace(
        _report([], ddp_config={}),
        compared=compared,
        unchecked=[Unchecked("sharded-saves", "FSDP2: a save of sharded state after the steps")],
    )
    words = _words(to_text(report, width=200))
    assert "No problems found in what was compared (below)." in words
    for said in (
        "Compared across 4 ranks over 8 optimizer steps (FSDP2)",
        "the model's 14 trainable parameters",
        "outside every fully_shard group (2, their weights compared)",
        "6 buffers at the last step",
        "the wait for data and a straggler rank (the host's clock, 7 steps)",
        "FSDP2's all-gathers per step (10)",
        "Not checked: FSDP2: a save of sharded state after the steps",
    ):
        assert said in words, (said, words)


def test_a_clean_report_that_lists_nothing_compared_never_says_no_problems_found_alone() -> None:
    """A report read from JSON written before reports listed what they compared: the clean line says so."""
    report = dataclasses.replace(_report([]), compared=None, unchecked=[])
    words = _words(to_text(report, width=200))
    assert "No problems found; this report does not list what was compared." in words, words
    assert "No problems found." not in words


def test_a_failed_run_without_findings_says_nothing_was_compared_in_text_html_and_json() -> None:
    report = dataclasses.replace(_report([], ddp_config={}), failed=True)
    words = _words(to_text(report, width=200))
    assert "No problems found" not in words
    assert "The run failed before the ranks could compare what they saw: nothing was compared across ranks." in words
    assert "No problems found" not in check_section(report)
    data = report.to_dict()
    assert data["failed"] is True and Report.from_dict(data).failed
