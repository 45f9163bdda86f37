"""The golden comparison itself: on another torch it still compares the diagnosis, then skips with the reason."""

from __future__ import annotations

import copy
import json

import pytest
from golden import GOLDEN, assert_matches_golden


def _golden(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


def test_the_same_report_matches():
    assert_matches_golden("unused_head", _golden("unused_head"))


def test_another_torch_compares_the_diagnosis_then_skips_with_the_reason():
    report = _golden("unused_head")
    report["torch_version"] = "9.9.9"
    report["findings"][0]["detail"] = "torch 9.9.9 words its error differently"
    with pytest.raises(pytest.skip.Exception, match="made on torch 2.13.0"):
        assert_matches_golden("unused_head", report)


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r["findings"].pop(),
        lambda r: r["findings"][0].update(severity="warning"),
        lambda r: r["findings"][1]["params"].pop(),
        lambda r: r["recommendation"].update(static_graph=not r["recommendation"]["static_graph"]),
    ],
)
def test_another_torch_still_fails_on_a_different_diagnosis(change):
    report = copy.deepcopy(_golden("unused_head"))
    report["torch_version"] = "9.9.9"
    change(report)
    with pytest.raises(AssertionError, match="differs from its golden copy"):
        assert_matches_golden("unused_head", report)


def _replace_in_detail(report: dict, old: str, new: str) -> None:
    finding = next(f for f in report["findings"] if old in f["detail"])
    finding["detail"] = finding["detail"].replace(old, new)


def test_another_cpus_float32_digits_still_match():
    """The numbers an AMD EPYC machine gave for the same run: float32 sums differ in their 7th digit."""
    report = copy.deepcopy(_golden("observe_unused_head"))
    assert report["divergence"]["grads"][0] == 0.3694651379723837
    report["divergence"]["grads"][0] = 0.3694651732005241
    _replace_in_detail(report, "is 0.09", "is 0.08")  # a two-digit rounding that fell the other way
    assert_matches_golden("observe_unused_head", report)


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r["divergence"]["grads"].__setitem__(0, r["divergence"]["grads"][0] * 1.001),
        lambda r: _replace_in_detail(r, "is 0.09", "is 0.11"),
        lambda r: _replace_in_detail(r, "is 0.09", "is 0.09 and more"),
        lambda r: r["findings"][0]["params"][0].update(numel=r["findings"][0]["params"][0]["numel"] + 1),
    ],
    ids=["float-beyond-1e-4", "printed-decimal-off-by-two-units", "text", "integer"],
)
def test_a_real_change_still_fails_the_comparison(change):
    report = copy.deepcopy(_golden("observe_unused_head"))
    change(report)
    with pytest.raises(pytest.fail.Exception, match="the report of observe_unused_head changed"):
        assert_matches_golden("observe_unused_head", report)
