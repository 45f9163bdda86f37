"""The usage map and divergence curve from hand-built records (no process group), their JSON round trip, and the
HTML page's static contract (self-contained, every finding, every framework's code)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from ddp_doctor.core.figures import MAX_PATTERNS, MAX_ROWS
from ddp_doctor.core.records import ModelInfo, RankRecord, StepCounters
from ddp_doctor.doctor.pipeline import analyze
from ddp_doctor.report.model import Report, RunFacts

NAMES = ["trunk.weight", "trunk.bias", "head.weight", "aux.weight"]


def info(names: list[str] = NAMES, **overrides) -> ModelInfo:
    n = len(names)
    base = {
        "param_names": names,
        "param_shapes": [(2, 2)] * n,
        "trainable_at_wrap": [True] * n,
        "ignored": [False] * n,
        "buffer_names": [],
        "buffer_shapes": [],
        "ddp_config": {"find_unused_parameters": True, "static_graph": False},
    }
    return ModelInfo(**{**base, **overrides})


def record(rank: int, used: list[list[int]], *, ran=None, trainable=None, grad=None, weights=None) -> RankRecord:
    """`used[s][p]` = 1 when parameter p got a gradient in step s; `ran` defaults to `used`."""
    steps, n = len(used), len(used[0])
    used_t = torch.tensor(used, dtype=torch.bool)
    counters = StepCounters(ddp_forwards=1, micro_steps=1, synced_backwards=1, optimizer_step=1)
    g = torch.ones(steps, n, 2, dtype=torch.float64)
    return RankRecord(
        rank=rank,
        used=used_t,
        reachable=used_t.clone(),
        ran=torch.tensor(ran, dtype=torch.bool) if ran is not None else used_t.clone(),
        trainable=(
            torch.tensor(trainable, dtype=torch.bool)
            if trainable is not None
            else torch.ones(steps, n, dtype=torch.bool)
        ),
        grad_fp=grad if grad is not None else g.masked_fill(~used_t[..., None], float("nan")),
        weight_fp=weights if weights is not None else torch.zeros(steps + 1, n, 2, dtype=torch.float64),
        buffer_fp=torch.zeros(steps, 0, 2, dtype=torch.float64),
        input_fp=torch.full((steps, 2), float(rank + 1), dtype=torch.float64),
        timing=torch.full((steps, 5), 0.01, dtype=torch.float64),
        counters=torch.tensor([counters.as_list()] * steps),
    )


def build(model: ModelInfo, records: list[RankRecord]) -> Report:
    return Report.build(RunFacts.of_model(model, world_size=len(records), backend="gloo"), analyze(model, records))


def cells(report: Report, rank: int) -> dict[str, str]:
    usage = report.usage_map
    assert usage is not None
    pattern = next(p for p in usage.patterns if rank in p.ranks)
    return {row.name: c for row, c in zip(usage.rows, pattern.cells)}


def test_a_dynamic_graph_shows_the_steps_a_parameter_missed_and_the_rows_carry_the_finding() -> None:
    even = [[1, 1, 1, s % 2 == 0] for s in range(4)]
    report = build(info(), [record(0, even), record(1, even)])
    assert "dynamic-graph" in report.codes
    usage = report.usage_map
    assert usage is not None and usage.steps == 4 and not usage.aggregated
    assert len(usage.patterns) == 1 and usage.patterns[0].ranks == [0, 1]  # both ranks saw the same
    assert cells(report, 0) == {
        "trunk.weight": "UUUU",
        "trunk.bias": "UUUU",
        "head.weight": "UUUU",
        "aux.weight": "UNUN",
    }
    rows = {r.name: r for r in usage.rows}
    assert rows["aux.weight"].codes == ["dynamic-graph"] and rows["trunk.weight"].codes == []
    assert rows["aux.weight"].module == "aux" and rows["trunk.bias"].module == "trunk"


def test_a_rank_dependent_graph_gives_one_pattern_per_distinct_rank_behaviour() -> None:
    with_aux, without = [[1, 1, 1, 1]] * 3, [[1, 1, 1, 0]] * 3
    report = build(info(), [record(0, with_aux), record(1, without), record(2, without), record(3, without)])
    assert "rank-dependent-graph" in report.codes
    usage = report.usage_map
    assert [p.ranks for p in usage.patterns] == [[0], [1, 2, 3]]  # rank 0's first, then by frequency
    assert cells(report, 0)["aux.weight"] == "UUU" and cells(report, 2)["aux.weight"] == "NNN"


def test_blocked_frozen_flipped_and_ignored_cells_follow_the_analysis() -> None:
    # head.weight: its module ran but no gradient reached it (blocked); aux.weight frozen at wrap; trunk.bias
    # frozen after wrap from step 1 (flipped); trunk.weight ignored by DDP.
    used = [[1, 1, 0, 0], [1, 0, 0, 0]]
    ran = [[1, 1, 1, 0], [1, 0, 1, 0]]
    trainable = [[1, 1, 1, 0], [1, 0, 1, 0]]
    model = info(trainable_at_wrap=[True, True, True, False], ignored=[True, False, False, False])
    report = build(model, [record(r, used, ran=ran, trainable=trainable) for r in (0, 1)])
    assert {"grad-blocked", "frozen-after-wrap"} <= report.codes
    assert cells(report, 0) == {"trunk.weight": "II", "trunk.bias": "UX", "head.weight": "BB", "aux.weight": "FF"}


def test_above_max_rows_the_rows_are_modules_showing_their_most_notable_state() -> None:
    names = [f"layers.{i}.{k}" for i in range(MAX_ROWS // 2 + 1) for k in ("weight", "bias")]
    used = [[1] * len(names)]
    used[0][names.index("layers.3.bias")] = 0
    report = build(info(names), [record(0, used), record(1, used)])
    usage = report.usage_map
    assert usage.aggregated and len(usage.rows) == MAX_ROWS // 2 + 1
    row = next(r for r in usage.rows if r.name == "layers.3")
    assert row.params == 2 and row.numel == 8 and row.module == "layers"
    assert cells(report, 0)["layers.3"] == "N" and cells(report, 0)["layers.4"] == "U"


def test_rank_patterns_are_capped_and_the_rest_are_named() -> None:
    world = MAX_PATTERNS + 3
    names = [f"p{i}" for i in range(world)]
    records = [record(r, [[int(i != r) for i in range(world)]]) for r in range(world)]  # every rank differs
    report = build(info(names), records)
    usage = report.usage_map
    assert len(usage.patterns) == MAX_PATTERNS and usage.patterns[0].ranks == [0]
    shown = {r for p in usage.patterns for r in p.ranks}
    assert sorted(shown | set(usage.ranks_omitted)) == list(range(world)) and len(usage.ranks_omitted) == 3


def test_subgroup_patterns_name_global_ranks() -> None:
    same = [[1, 1, 1, 1]]
    report = build(info(group_ranks=[4, 6]), [record(0, same), record(1, same)])
    assert report.usage_map.patterns[0].ranks == [4, 6]


def test_the_divergence_curve_starts_where_the_fingerprints_first_differ() -> None:
    used = [[1, 1, 1, 1]] * 3
    w0 = torch.zeros(4, 4, 2, dtype=torch.float64)
    w1 = w0.clone()
    w1[2:, 2, 0] = torch.tensor([0.5, 2.0])  # head.weight's sum differs after step 1, more after step 2
    g = torch.ones(3, 4, 2, dtype=torch.float64)
    g1 = g.clone()
    g1[1, 2, 1] = 1.25  # its gradient differed in step 1
    g1[2, 3] = float("nan")  # rank 1 had no gradient for aux.weight in step 2
    report = build(info(), [record(0, used, grad=g, weights=w0), record(1, used, grad=g1, weights=w1)])
    d = report.divergence
    assert d.weights == [0.0, 0.0, 0.5, 2.0] and d.weights_start == 1
    assert d.grads == [0.0, 0.25, 0.0] and d.grads_missing == [0, 0, 1] and d.grads_start == 1
    assert {"grads-not-synced", "replica-divergence"} <= report.codes


def test_identical_ranks_give_a_flat_curve_with_no_start() -> None:
    used = [[1, 1, 1, 1]] * 2
    d = build(info(), [record(0, used), record(1, used)]).divergence
    assert d.weights == [0.0] * 3 and d.grads == [0.0] * 2 and d.weights_start is None and d.grads_start is None


def test_json_round_trip_keeps_the_old_keys_and_carries_the_new_ones() -> None:
    used = [[1, 1, 1, s % 2 == 0] for s in range(3)]
    report = build(info(), [record(0, used), record(1, used)])
    data = json.loads(report.to_json())
    assert list(data)[-3:] == ["usage_map", "divergence", "compared"]  # new keys last, only added
    old = dataclasses.replace(Report.from_dict(data), usage_map=None, divergence=None, compared=None)
    new = ("usage_map", "divergence", "compared")
    assert {k: v for k, v in data.items() if k not in new} == json.loads(old.to_json())
    again = Report.from_dict(data)
    assert json.loads(again.to_json()) == data
    assert data["usage_map"]["states"]["B"] == "blocked" and "fingerprint(rank r)" in data["divergence"]["measure"]


def test_no_complete_step_means_no_figures_and_the_page_says_why() -> None:
    report = build(info(), [RankRecord.empty(0, 4, 0), RankRecord.empty(1, 4, 0)])
    assert report.usage_map is None and report.divergence is None
    assert "no step completed on every rank" in report.to_html()


@pytest.fixture(scope="module")
def page() -> tuple[Report, str]:
    used = [[1, 1, 1, s % 2 == 0] for s in range(4)]
    report = build(
        info(ddp_config={"find_unused_parameters": False, "static_graph": True}), [record(0, used), record(1, used)]
    )
    return report, report.to_html()


def test_the_page_has_every_finding_both_figures_and_code_for_four_frameworks(page) -> None:
    report, html = page
    assert report.findings
    for f in report.findings:
        assert f"data-code='{f.code}'" in html and f.title.replace("'", "&#x27;") in html
    assert html.count("class='usage-map'") == 1 and html.count("class='divergence'") == 1
    assert html.count("class='step-time'") == 1  # each rank's step in phases (issue #26)
    assert html.count("<svg") == 3
    for framework in ("torch", "transformers", "accelerate", "lightning"):
        assert f"data-framework='{framework}'" in html
    assert "static_graph=False" in html  # the recommendation's code, escaped but whole


def test_the_page_is_self_contained(page) -> None:
    _, html = page
    # No element loads anything: SVG namespace URIs are names, not requests.
    assert not re.search(r"""\b(?:src|href)\s*=\s*["']?(?:https?:)?//""", html)
    assert "@import" not in html and not re.search(r"url\(\s*['\"]?(?:https?:)?//", html)
    assert "<link" not in html and "<iframe" not in html


def test_check_page_of_several_models_gives_each_its_own_section_and_ids(page) -> None:
    from ddp_doctor.cli.check import check_page
    from ddp_doctor.launch.outcome import CheckResult, Model

    report, _ = page
    html = check_page(
        CheckResult(models=[Model(report=report, module="Generator"), Model(report=report, module="Discriminator")])
    )
    assert "DDP model 1 of 2: Generator" in html and "DDP model 2 of 2: Discriminator" in html
    ids = re.findall(r"id='(m\d-[a-z-]+)'", html)
    assert {"m0-usage-map", "m1-usage-map", "m0-divergence", "m1-divergence"} <= set(ids)
    assert len(ids) == len(set(ids))
    assert html.count("name='m0-rec'") == html.count("name='m1-rec'") == 4  # one tab group per model


def test_check_page_without_a_report_says_why() -> None:
    from ddp_doctor.cli.check import check_page
    from ddp_doctor.launch.outcome import CheckResult

    html = check_page(CheckResult(error="the script failed on rank 1 before it built a DDP model: <ValueError>"))
    assert "could not run the script" in html and "&lt;ValueError&gt;" in html and "<section" not in html
