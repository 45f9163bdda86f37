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
