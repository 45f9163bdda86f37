"""The scenario matrix of the diagnosis core: exact finding codes and names, then the recommendation applied."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from scenarios import CASES, GROUP_CASES, GROUPS, Case, run_applied, run_case
from scenarios_models import run_two_models, run_unwrapped

from ddp_doctor import CODES

_TRAINED = {"grad-blocked", "dynamic-graph", "rank-dependent-graph", "reentrant-checkpoint"}


_GPU = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; run on a GPU machine, see docs/verified.md)"
)


def test_every_case_expects_real_codes() -> None:
    """A misspelt code in a case's expectations would make that case unpassable or vacuous."""
    for case in CASES.values():
        assert case.codes <= set(CODES) and set(case.params) <= case.codes, case.name


@pytest.mark.parametrize("name", list(CASES))
def test_scenario(name: str, tmp_path) -> None:
    check_scenario(name, tmp_path)


@_GPU
@pytest.mark.parametrize("name", list(CASES))
def test_scenario_on_cuda_with_gloo(name: str, tmp_path) -> None:
    """Two ranks sharing one GPU (gloo reduces CUDA tensors; NCCL needs a GPU per rank): the same diagnosis."""
    check_scenario(name, tmp_path, env={"DDP_DOCTOR_TEST_DEVICE": "cuda"})


@_GPU
@pytest.mark.parametrize("name", list(CASES))
def test_scenario_on_nccl_matches_gloo(name: str, tmp_path) -> None:
    """One rank on NCCL and CUDA gives the diagnosis one rank on gloo and the CPU gives, and its recommendation
    applied keeps grads equal to the reference."""
    cpu = run_ranks(run_case, tmp_path, args=(name,), world_size=1, timeout=90)[0]
    gpu = run_ranks(
        run_case,
        tmp_path,
        args=(name,),
        world_size=1,
        timeout=120,
        env={"DDP_DOCTOR_TEST_DEVICE": "cuda", "DDP_DOCTOR_TEST_BACKEND": "nccl"},
    )[0]
    assert gpu["report"]["backend"] == "nccl"

    def diagnosis(report: dict) -> tuple:
        rec = report["recommendation"]
        return (
            [(f["code"], f["severity"], sorted(p["name"] for p in f["params"])) for f in report["findings"]],
            rec["find_unused_parameters"],
            rec["static_graph"],
            rec["freeze_before_wrap"],
        )

    assert diagnosis(gpu["report"]) == diagnosis(cpu["report"]), f"{name}:\n{gpu['text']}\n---\n{cpu['text']}"
    assert gpu["raised"] == cpu["raised"]
    assert gpu["applied"]["max_abs_err"] < 1e-5, gpu["applied"]


def check_scenario(name: str, tmp_path, *, env: dict[str, str] | None = None) -> None:
    """Run the case on two ranks and assert its exact diagnosis, then its recommendation applied."""
    case: Case = CASES[name]
    ranks = run_ranks(run_case, tmp_path, args=(name,), timeout=90, env=env)
    reports = [r["report"] for r in ranks]
    report = reports[0]
    assert all(r == report for r in reports[1:]), "ranks got different reports"

    codes = {f["code"] for f in report["findings"]}
    assert codes == case.codes, (
        f"{name}: expected findings {sorted(case.codes)}, got {sorted(codes)}\n{ranks[0]['text']}"
    )
    for code, names in case.params.items():
        finding = next(f for f in report["findings"] if f["code"] == code)
        got = {p["name"] for p in finding["params"]}
        assert got == names, f"{name}: {code} should name {sorted(names)}, named {sorted(got)}"
        assert all(p["numel"] > 0 for p in finding["params"])
    assert all(r["raised"] == case.raises for r in ranks), f"{name}: raised {[r['raised'] for r in ranks]}"
    # DESIGN 2.3: never advise freezing a parameter the script evidently trains (its module ran, or it got a
    # gradient on some rank or step).
    trained = {p["name"] for f in report["findings"] if f["code"] in _TRAINED for p in f["params"]}
    frozen = set(report["recommendation"]["freeze_before_wrap"])
    assert not frozen & trained, f"{name}: the recommendation freezes trained parameters {sorted(frozen & trained)}"
    for f in report["findings"]:
        named = {c for c in CODES if c in f["fix"] and c != f["code"]}
        assert named <= codes, f"{name}: {f['code']}'s fix points to absent finding(s) {sorted(named - codes)}"
        if {p["name"] for p in f["params"]} & trained:
            assert "set requires_grad=False on them" not in f["fix"] or f["code"] == "grad-blocked", (name, f)

    # Applying the recommendation: every step's grads identical across ranks and equal to the reference average.
    for rank, r in enumerate(ranks):
        applied = r["applied"]
        assert applied["unequal_across_ranks"] == 0, f"{name}: rank {rank} grads differ across ranks"
        assert applied["max_abs_err"] < 1e-5, f"{name}: rank {rank} grads off the reference by {applied}"


def _applied_unfixed(rank: int, world: int) -> dict:
    case = CASES["loss-through-module"]
    rec = {
        "find_unused_parameters": False,
        "static_graph": False,
        "gradient_as_bucket_view": False,
        "freeze_before_wrap": [],
    }
    return run_applied(Case(**{**case.__dict__, "fixed": {}}), rank, rec)


def test_reference_check_catches_unsynced_grads(tmp_path) -> None:
    """The matrix's grad check can fail: the bypass loop, left unfixed, is caught."""
    ranks = run_ranks(_applied_unfixed, tmp_path)
    assert ranks[0]["unequal_across_ranks"] > 0
    assert ranks[0]["max_abs_err"] > 1e-4


@pytest.mark.parametrize("name", list(GROUP_CASES))
def test_scenario_over_subgroups(name: str, tmp_path) -> None:
    """DDP over two data-parallel groups of 4 ranks: each group's report is its own (same on its ranks, global rank
    numbers, the group's ranks listed), and its recommendation applied keeps grads equal within the group."""
    _, expected = GROUP_CASES[name]
    ranks = run_ranks(run_case, tmp_path, args=(name,), world_size=4, timeout=150)
    for g, members in enumerate(GROUPS):
        reports = [ranks[r]["report"] for r in members]
        assert all(r == reports[0] for r in reports[1:]), f"{name}: group {members} got different reports"
        report = reports[0]
        assert report["ddp_config"].get("process_group_ranks") == members, report["ddp_config"]
        codes = {f["code"] for f in report["findings"]}
        assert codes == expected[g], (
            f"{name}: group {members} expected {expected[g]}, got {codes}\n{ranks[members[0]]['text']}"
        )
        for f in report["findings"]:
            assert set(f["ranks"]) <= set(members), f"{name}: a finding of group {members} names ranks {f['ranks']}"
            if f["code"] == "unused-parameters":
                assert {p["name"] for p in f["params"]} == {"head_b.weight", "head_b.bias"}
                assert report["recommendation"]["freeze_before_wrap"] == ["head_b.weight", "head_b.bias"]
        for r in members:
            applied = ranks[r]["applied"]
            assert applied["unequal_across_ranks"] == 0 and applied["max_abs_err"] < 1e-5, (name, r, applied)


@pytest.mark.parametrize(("sync", "severity"), [(None, "error"), ("sync_gradients", "info")])
def test_scenario_model_not_wrapped(sync: str | None, severity: str, tmp_path) -> None:
    """No DDP at all: each rank trains its own copy (error), unless a correct manual sync keeps them equal (info,
    pointing to DDP). The fix, DDP around the model, keeps grads equal to the reference average."""
    ranks = run_ranks(run_unwrapped, tmp_path, args=(sync,), timeout=90)
    report = ranks[0]["report"]
    assert all(r["report"] == report for r in ranks[1:])
    assert [(f["code"], f["severity"]) for f in report["findings"]] == [("model-not-wrapped", severity)], ranks[0][
        "text"
    ]
    names = {p["name"] for p in report["findings"][0]["params"]}
    assert names == {
        "trunk.weight",
        "trunk.bias",
        "block.0.weight",
        "block.0.bias",
        "head_a.weight",
        "head_a.bias",
        "head_b.weight",
        "head_b.bias",
    }, names
    for r in ranks:
        assert r["applied"]["unequal_across_ranks"] == 0 and r["applied"]["max_abs_err"] < 1e-5, r["applied"]


def test_scenario_two_models_each_report_is_its_own(tmp_path) -> None:
    """Several DDP models (a GAN): the critic's reduction error belongs to the critic; the generator's report, whose
    loop the same error ended, has no finding about it."""
    for r in run_ranks(run_two_models, tmp_path, timeout=90):
        assert r["raised"] == "reduction-error"
        critic = {f["code"]: {p["name"] for p in f["params"]} for f in r["critic"]["findings"]}
        assert set(critic) == {"reduction-error", "unused-parameters", "grads-not-synced", "replica-divergence"}, r[
            "text"
        ]
        assert critic["reduction-error"] == critic["unused-parameters"] == {"head_b.weight", "head_b.bias"}
        assert r["generator"]["findings"] == [], r["generator"]["findings"]
        assert r["generator"]["crashes"][0]["kind"] == "other-model"  # what ended its loop, not its own failure
