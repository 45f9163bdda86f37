"""The report writes a finding's words from its evidence (`ddp_doctor.report.words`), and every number a
finding's title or detail states is in its typed evidence (JSON `params`, `ranks`, `steps`, `more_ranks`, `sites`,
`measured`), so that a reader of the JSON gets it as a fact, not only inside a sentence. The numbers are checked
on the golden reports of the bundled examples (tests/golden/, real `check` runs); the checker and the words are
tested on hand-built findings."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ddp_doctor.core.findings import Finding, Measure, ParamRef
from ddp_doctor.core.whereabouts import Position
from ddp_doctor.report.words import worded

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
_NUMBER = re.compile(r"(?<![\w.:/-])(\d+(?:,\d{3})*(?:\.\d+)?(?:e-?\d+)?)(?![\w/]|\.\d)")
"""A number in running text (not a part of a name, a path, a `file:line` or a version)."""


def evidence(f: dict[str, Any]) -> set[float]:
    """The numbers a finding's JSON carries as evidence, counts of its lists included."""
    found: set[float] = {len(f["params"]), len(f["ranks"]), len(f["steps"]), f.get("more_ranks", 0)}
    for p in f["params"]:
        found |= {p["numel"], *p["shape"]}
    found |= {*f["ranks"], *f["steps"], *(int(s.rsplit(":", 1)[1]) for s in f.get("sites", []))}
    found |= {m["value"] for m in f.get("measured", []) if m["value"] is not None}
    return {float(x) for x in found}


def unbacked(f: dict[str, Any]) -> list[str]:
    """The numbers of `f`'s title and detail that its evidence does not hold (a printed float within 0.6%)."""
    held = evidence(f)
    said = _NUMBER.findall(f"{f['title']} {f['detail']}")
    return [t for t in said if not any(abs(float(t.replace(",", "")) - x) <= 1e-9 + 0.006 * abs(x) for x in held)]


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.json")), ids=lambda p: p.stem)
def test_every_number_a_finding_states_is_in_its_evidence(path: Path) -> None:
    report = json.loads(path.read_text())
    missing = {f["code"]: unbacked(f) for f in report["findings"] if unbacked(f)}
    assert missing == {}, missing


def test_the_checker_finds_a_number_said_only_in_words() -> None:
    base = {"params": [], "ranks": [0, 1], "steps": [3], "sites": ["train.py:40"], "measured": []}
    ok = {**base, "title": "2 ranks differ at step 3", "detail": "at train.py:40, 1.5 apart"}
    ok["measured"] = [{"name": "gap", "value": 1.4999, "unit": "abs"}]
    assert unbacked(ok) == []
    assert unbacked({**ok, "detail": "rank 0: 13 batches, torch 2.13.0, layers.12.weight"}) == ["13"]


def _worded(code: str, **evidence: Any) -> Finding:
    return worded(Finding(code=code, severity="error", params=[ParamRef("head.weight", 8)], **evidence))


def test_unused_parameters_are_worded_from_the_parallelism_and_the_flags() -> None:
    """The words follow the evidence: the flags DDP was built with decide what the parameters cost, and FSDP2 or
    `replicate` say so in their own names; the count of steps is that of `steps`."""
    labels = {"parallelism": "ddp", "modules_ran": "False", "find_unused_parameters": "False", "static_graph": "False"}
    default = _worded("unused-parameters", ranks=[0, 1], steps=[0, 1, 2], labels=labels)
    assert default.title == "1 trainable parameter never reached the loss"
    assert default.detail.startswith("On every rank and every one of the 3 observed steps, these parameters got no ")
    assert "their modules never ran in a training forward" in default.detail
    assert "Expected to have finished reduction" in default.detail
    coping = _worded("unused-parameters", steps=[0], labels={**labels, "find_unused_parameters": "True"})
    assert "The current flags cope" in coping.detail and "walks the autograd graph" in coping.detail
    replicated = _worded("unused-parameters", steps=[0, 1], labels={"parallelism": "replicate"})
    assert "2 observed optimizer steps with gradient sync on" in replicated.detail
    assert "replicate raises no error" in replicated.detail and "whole copy" in replicated.detail
    assert ": nothing in the loss reaches them" in replicated.detail


def test_a_rank_dependent_graph_names_the_ranks_it_holds_and_counts_the_rest() -> None:
    many = _worded("rank-dependent-graph", ranks=[3, 6], more_ranks=59, steps=[0])
    assert "Ranks [3, 6] and 59 other ranks left these parameters" in many.detail
    crash = _worded("rank-dependent-graph", ranks=[0, 1], steps=[2], labels={"kind": "crash", "failed_rank": "1"})
    assert crash.title == "1 parameter(s) got a gradient on rank 0 but not on rank 1 in step 2"
    assert crash.detail.startswith("Rank 1 failed at the start of step 3")


def test_the_other_used_set_codes_are_worded_from_their_evidence() -> None:
    blocked = _worded("grad-blocked", steps=[0, 1], sites=["train.py:23"], labels={"kind": "checkpoint"})
    assert "(train.py:23)" in blocked.detail and "while DDP waits" in blocked.detail
    handled = _worded("dynamic-graph", steps=[1], labels={"find_unused_parameters": "True", "static_graph": "False"})
    assert handled.detail.endswith("which is what this run uses.")
    crashed = _worded("static-graph-unsafe", ranks=[1], labels={"kind": "crashed"})
    assert "DDP failed on rank(s) [1]" in crashed.detail
    unneeded = _worded(
        "find-unused-unneeded", ranks=[0, 1], steps=[0, 1, 2, 3], measured=[Measure("parameters_used", 5, "count")]
    )
    assert unneeded.detail.startswith("All 5 trainable parameters got a gradient on every one of the 2 ranks in all 4")


def test_a_finding_with_its_own_words_keeps_them() -> None:
    """A code not worded by the report, or a finding read back from a report's JSON, keeps its text."""
    read = Finding(code="dynamic-graph", severity="info", title="as written", detail="d")
    assert worded(read) is read
    other = Finding(code="replica-divergence", severity="error", title="t", detail="d")
    assert worded(other) is other


def test_gradients_not_synced_are_worded_from_the_mechanism_seen() -> None:
    """The mechanism (`kind`) and its lines decide the words; the ranks and steps are the finding's."""
    ranks = {"ranks": [0, 1], "steps": [0, 1]}
    plain = _worded("grads-not-synced", **ranks)
    assert plain.title == "gradients of 1 parameter differ across ranks at the optimizer step"
    assert plain.detail.endswith("Ranks [0, 1] disagree in steps [0, 1].")
    off = _worded("grads-not-synced", **ranks, sites=["train.py:30"], labels={"kind": "sync-off", "how": "no_sync"})
    assert off.title.endswith("(DDP's sync was off for every backward: no_sync())")
    assert "ran under no_sync() (entered at train.py:30)" in off.detail
    flag = {"kind": "sync-off", "how": "require_backward_grad_sync"}
    assert (
        "with require_backward_grad_sync=False (set at t.py:9)"
        in _worded("grads-not-synced", **ranks, sites=["t.py:9"], labels=flag).detail
    )
    hook = _worded("grads-not-synced", **ranks, sites=["t.py:4"], labels={"kind": "comm-hook", "hook": "my_hook"})
    assert "comm hook my_hook (defined at t.py:4)" in hook.detail
    local = _worded(
        "grads-not-synced",
        **ranks,
        measured=[Measure("first_local_step", 3, "count"), Measure("start_localSGD_iter", 3, "count")],
        labels={"kind": "local-sgd", "subgroup_size": "1"},
    )
    assert local.title == "post-local SGD: from step 3 the gradients are averaged over one rank, not all ranks"
    assert "(start_localSGD_iter=3)" in local.detail and local.detail.endswith("at steps 0-2.")


def test_a_reduction_error_is_worded_from_its_kind_and_step() -> None:
    plain = _worded("reduction-error", ranks=[0, 1], steps=[1])
    assert plain.detail.startswith("At the start of step 1, DDP found that the previous step's gradient reduction")
    assert "because these trainable parameters got no gradient" in plain.detail
    replaced = _worded("reduction-error", steps=[2], labels={"kind": "replaced"})
    assert "never finished: these parameters, which DDP registered" in replaced.detail
    second = _worded("reduction-error", steps=[0], sites=["m.py:7", "m.py:9"], labels={"kind": "second-pass"})
    assert second.detail.startswith("Two backward passes through one forward (m.py:7, m.py:9): DDP failed at the")


def test_a_second_reduction_is_worded_from_its_call_and_factor() -> None:
    call = {"call": "all_reduce(float32[4, 3], SUM)", "reduction": "SUM"}
    doubled = _worded(
        "grads-reduced-twice",
        ranks=[0, 1],
        steps=[0, 1],
        sites=["t.py:40"],
        labels=call,
        measured=[Measure("gradient_factor", 2, "ratio"), Measure("group_size", 2, "count")],
    )
    assert (
        doubled.title
        == "gradients reduced again after DDP reduced them (all_reduce(float32[4, 3], SUM) over 2 ranks at t.py:40)"
    )
    assert "each gradient is 2 times what DDP computed" in doubled.detail and doubled.detail.endswith("step(s) [0, 1].")
    averaged = _worded("grads-reduced-twice", steps=[0], labels=call, measured=[Measure("gradient_factor", 1, "ratio")])
    assert "changes nothing but exchanges every gradient a second time" in averaged.detail
    assert "at an unknown place" in averaged.title
    unknown = _worded("grads-reduced-twice", steps=[0], sites=["t.py:3"])
    assert "ran a collective (a reduction) on parameters' .grad at t.py:3, which replaces" in unknown.detail


def test_low_precision_is_worded_from_the_dtypes_and_the_measured_difference() -> None:
    reduce = _worded(
        "low-precision-reduce",
        ranks=[0, 1, 2, 3],
        labels={"reduce_dtype": "bfloat16", "weights_dtype": "float32", "policy_param_dtype": "bfloat16"},
        measured=[
            Measure("mean_relative_difference", 0.00123, "fraction"),
            Measure("largest_difference", 4.5e-5, "abs"),
        ],
    )
    assert reduce.title == "gradients are reduced in bfloat16 while the weights train in float32"
    assert (
        "param_dtype=bfloat16, reduce_dtype=unset" in reduce.detail
        and "differ by 0.0012 of their size" in reduce.detail
    )
    assert "by 4.5e-05 at most" in reduce.detail and "rounding on 4 ranks" in reduce.detail
    weights = _worded("low-precision-weights", labels={"weights_dtype": "bfloat16", "param_dtype": "bfloat16"})
    assert weights.title.startswith("the optimizer steps bfloat16 weights") and "about 1/256" in weights.detail
    same = _worded("identical-inputs-across-ranks", ranks=[0, 1, 2], steps=[0, 1])
    assert same.detail.startswith("In all 2 observed steps the inputs were identical on all 3 ranks")


def test_use_outside_forward_and_reentrant_checkpoints_are_worded_from_the_flags() -> None:
    finder = {"find_unused_parameters": "True", "static_graph": "False"}
    outside = _worded("used-outside-forward", labels=finder)
    assert outside.title == "1 parameter used outside DDP's forward" and "arrives anyway" in outside.detail
    assert "The current flags cope" in _worded("used-outside-forward", labels={}).detail
    blocked = _worded("reentrant-checkpoint", sites=["c.py:23"], labels={"kind": "no-grad-inputs"})
    assert blocked.title == "reentrant checkpoint without grad-requiring inputs at c.py:23"
    static = {"find_unused_parameters": "False", "static_graph": "True"}
    assert _worded("reentrant-checkpoint", labels=static).detail.endswith("static_graph=True handles it.")
    assert "Default flags happened to reduce correctly" in _worded("reentrant-checkpoint").detail


def test_a_gradscaler_mismatch_shows_each_named_ranks_scale_and_counts_the_rest() -> None:
    scales = [Measure("scale (rank 0)", 1024.0, "ratio"), Measure("scale (rank 6)", 512.0, "ratio")]
    two = _worded("grad-scaler-mismatch", ranks=[0, 6, 7], steps=[1, 3], measured=scales, more_ranks=2)
    assert two.title == (
        "GradScaler's scale differs across ranks at step 1 (rank 0: 1024, rank 6: 512, rank 7: no scaler.step() "
        "and 2 other ranks)"
    )
    assert two.detail.endswith("Also at step(s) [3].")


def test_a_finding_without_words_or_its_measures_is_refused() -> None:
    """A detector that left out the words of a code the report does not word, or a quantity its words state, fails
    loudly rather than printing an empty title or a made-up number."""
    with pytest.raises(AssertionError, match="built without words"):
        worded(Finding(code="replica-divergence", severity="error"))
    with pytest.raises(AssertionError, match="parameters_used"):
        worded(Finding(code="find-unused-unneeded", severity="warning", ranks=[0, 1], steps=[0]))


def test_a_hang_is_worded_from_the_ranks_positions() -> None:
    """Each position the finding carries is said once, the ranks beyond them counted; the ranks on another node
    and the communication library's line come from the labels."""
    at = [
        Position(rank=r, step=3, phase="backward", how="in-collective", site="t.py:5", collective="all_reduce")
        for r in range(8)
    ]
    hung = Finding(
        code="rank-hung",
        severity="error",
        ranks=[9],
        positions=at,
        measured=[Measure("ranks_waiting", 10, "count")],
        labels={"timed_out": "True", "other_node_ranks": "12,13", "native": "gloo: timed out"},
    )
    f = worded(hung)
    assert f.title == "rank 9 stopped making progress before the timeout"
    assert f.detail.count("inside all_reduce called at t.py:5") == 8
    assert "; and 2 other ranks." in f.detail
    assert "waiting for the ones behind" in f.detail
    assert " ranks 12, 13 ran on another node; that node's report covers them." in f.detail
    assert f.detail.endswith("The communication library said: gloo: timed out")


def _at(rank: int, **kw: Any) -> Position:
    return Position(rank=rank, step=kw.pop("step", 3), phase=kw.pop("phase", "backward"), **kw)


def test_a_crash_is_worded_from_the_raising_ranks_and_the_others_positions() -> None:
    """The raising rank's own position gives the line and phase; the others are said as lost their peer or still
    where they were, by their positions, and counted beyond them."""
    raised = Finding(
        code="rank-crashed",
        severity="error",
        ranks=[1],
        steps=[4],
        labels={"kind": "raised", "exception": "ValueError", "message": "bad batch"},
        measured=[Measure("other_ranks", 12, "count")],
        positions=[
            _at(1, step=4, phase="forward", how="raised", site="t.py:33"),
            _at(0, how="raised", site="t.py:50", lost_peer=True),
            _at(2, how="in-collective", site="t.py:50", collective="all_reduce(float32[4])"),
        ],
    )
    f = worded(raised)
    assert f.title == "rank 1 crashed at step 4: ValueError: bad batch"
    assert f.detail.startswith("Raised at t.py:33 (forward); its traceback was printed above.")
    assert "rank 0 lost its peer at step 3, backward, at t.py:50" in f.detail
    assert "rank 2 was at step 3, backward, inside all_reduce(float32[4]) called at t.py:50" in f.detail
    assert f.detail.endswith("; and 10 other ranks.")


def test_a_rank_a_signal_ended_is_worded_from_its_fault_and_signal() -> None:
    killed = Finding(
        code="rank-crashed",
        severity="error",
        ranks=[1],
        steps=[0],
        sites=["t.py:15"],
        labels={"kind": "signal", "signal": "SIGSEGV", "fault_frame": "DistributedDataParallel.__init__"},
        measured=[Measure("position_age", 0.25, "s"), Measure("other_ranks", 0, "count")],
        positions=[_at(1, step=0, phase="setup", how="died", site="t.py:15")],
    )
    f = worded(killed)
    assert f.title == "rank 1 died of SIGSEGV in DistributedDataParallel.__init__ at t.py:15"
    assert f.detail.startswith("It was at step 0, setup, at t.py:15 (where it died) (its last published position, 0.2")
    assert "Cause: a segmentation fault inside native code" in f.detail and "The others" not in f.detail
    torn = worded(
        Finding(
            code="rank-crashed",
            severity="error",
            ranks=[0],
            steps=[9],
            labels={"kind": "teardown", "signal": "SIGABRT", "native": "terminate called"},
            positions=[_at(0, step=9, phase="torn down", how="innermost")],
        )
    )
    assert torn.title == "rank 0 died of SIGABRT at step 9"
    assert "after the script had destroyed its process group" in torn.detail
    assert torn.detail.endswith("The communication library said: terminate called")


def test_exits_and_silent_deaths_are_worded_from_their_labels() -> None:
    exited = worded(
        Finding(
            code="rank-crashed",
            severity="error",
            ranks=[0, 1],
            steps=[2],
            labels={"kind": "exited", "site": "t.py:20", "phase": "forward", "every_rank": "True"},
            measured=[Measure("exit_status", 3, "value")],
        )
    )
    assert exited.title == "ranks 0, 1 exited with status 3 at step 2"
    assert exited.detail == (
        "The script's own exit with a failure status, at t.py:20 (forward) on every rank: torchrun reports the job "
        "as failed."
    )
    silent = worded(
        Finding(
            code="rank-crashed",
            severity="error",
            ranks=list(range(10)),
            steps=[1],
            labels={"kind": "silent"},
            measured=[Measure("other_ranks", 0, "count")],
            positions=[_at(r, step=1, phase="forward", how="after", site="t.py:7") for r in range(8)],
        )
    )
    assert silent.title == "ranks 0-9 died without a Python error"
    assert silent.detail.count(": step 1, forward, after t.py:7") == 8
    assert silent.detail.endswith("; and 2 other ranks.")
    left = worded(
        Finding(
            code="rank-exited",
            severity="error",
            ranks=[1],
            steps=[3],
            labels={"site": "t.py:40", "phase": "forward", "trained_on": "0,2,3"},
            measured=[Measure("exit_status", 0, "value"), Measure("other_ranks", 1, "count")],
            positions=[_at(1, how="after", site="t.py:40"), _at(0, how="sampled", site="t.py:9")],
        )
    )
    assert left.title == "rank 1 exited (status 0) at step 3; ranks 0, 2, 3 trained on"
    assert left.detail.startswith("It left from t.py:40 (forward).")
    assert left.detail.endswith("The others: rank 0 was at step 3, backward, at t.py:9.")


def test_an_error_that_ended_every_ranks_loop_is_worded_with_what_was_compared() -> None:
    loop = worded(
        Finding(
            code="rank-crashed",
            severity="error",
            ranks=[0, 1],
            steps=[5],
            labels={"kind": "raised", "exchanged": "True", "site": "t.py:12", "message": "boom", "every_rank": "True"},
        )
    )
    assert loop.title == "ranks 0, 1 raised at step 5: boom"
    assert "ended the loop at t.py:12 on every rank; the comparisons below cover the 5 step(s) before it." in (
        loop.detail
    )


def test_a_timeout_risk_is_worded_from_the_span_or_from_the_ranks_that_timed_out() -> None:
    """Followed: the span's sync points, its capped passes and the three measured times; as it happened: the
    waiting rank's position and error, and where the ranks that worked alone were."""
    span = worded(
        Finding(
            code="timeout-risk",
            severity="error",
            ranks=[0],
            labels={"start": "t.py:10", "end": "t.py:30", "passes": "t.py:20: 2 of 400 batches, 0.31 s"},
            measured=[
                Measure("alone", 0.62, "s"),
                Measure("alone_projected", 124.0, "s"),
                Measure("group_timeout", 60.0, "s"),
            ],
        )
    )
    assert span.title == (
        "rank 0 works alone for about 2.1 min at the loaders' real lengths while the others wait; the process "
        "group's timeout is 60 s"
    )
    assert span.detail.startswith("Between t.py:10 and t.py:30, rank 0 worked alone for 0.62 s as measured")
    assert "Capped DataLoader passes in that span: t.py:20: 2 of 400 batches, 0.31 s." in span.detail
    assert "That reaches the process group's timeout of 60 s" in span.detail
    unknown = worded(
        Finding(
            code="timeout-risk",
            severity="warning",
            ranks=[1],
            labels={"start": "t.py:10", "end": "t.py:30"},
            measured=[Measure("alone", 40.0, "s"), Measure("group_timeout", 60.0, "s")],
        )
    )
    assert unknown.title.startswith("rank 1 works alone for 40 s while the others wait")
    assert "the projection to the real lengths is unknown" in unknown.detail
    assert "more than half of the process group's timeout of 60 s" in unknown.detail
    happened = worded(
        Finding(
            code="timeout-risk",
            severity="error",
            ranks=[0],
            steps=[2],
            labels={"waited": "1,2,3", "exception": "DistBackendError", "message": "Timed out waiting 5000ms"},
            measured=[Measure("group_timeout", 5.0, "s")],
            positions=[
                _at(1, step=2, phase="after backward", how="raised", site="t.py:50", lost_peer=True),
                _at(0, step=2, phase="forward", how="sampled", site="t.py:70"),
            ],
        )
    )
    assert happened.title == "ranks 1-3 timed out after 5 s in a collective, waiting for rank 0, which worked alone"
    assert happened.detail.startswith(
        "Rank 1 waited in a collective at t.py:50 (step 2, after backward) until the process group's timeout ran "
        "out after 5 s (DistBackendError: Timed out waiting 5000ms). Rank 0 was not in any collective: step 2, "
        "forward, at t.py:70."
    )


def test_a_shared_checkpoint_path_is_worded_from_the_writers_machines_and_guard() -> None:
    base = {"file": "/ckpt/last.pt", "site": "t.py:40  torch.save(state, path)"}
    two_nodes = worded(
        Finding(
            code="checkpoint-same-path",
            severity="warning",
            ranks=[0, 8],
            more_ranks=2,
            steps=[3],
            labels={**base, "guard": "local-rank", "hosts": "a,b"},
            measured=[
                Measure("machines", 2, "count"),
                Measure("writers_shown", 2, "count"),
                Measure("more_files", 1, "count"),
            ],
        )
    )
    assert two_nodes.title == "4 ranks wrote the same path /ckpt/last.pt with torch.save"
    assert two_nodes.detail.startswith(
        "Ranks 0, 8 and 2 others each called torch.save on /ckpt/last.pt at t.py:40  torch.save(state, path) (first "
        "after step 3) (1 more file(s) likewise). Each of the first 2 is local rank 0 of its node"
    )
    assert "They run on at least 2 machines (a, b), so the path is one file only where" in two_nodes.detail
    one = worded(
        Finding(
            code="checkpoint-same-path",
            severity="warning",
            ranks=[0, 1],
            labels={**base, "followed": "True", "every_rank": "True", "hosts": "a"},
            measured=[
                Measure("machines", 1, "count"),
                Measure("writers_shown", 2, "count"),
                Measure("more_files", 0, "count"),
            ],
        )
    )
    assert one.title == "2 ranks wrote the same file /ckpt/last.pt with torch.save"
    assert "(after the observed steps, at an epoch end the check followed). Every rank wrote it:" in one.detail
    assert "On one machine, the writes race" in one.detail
    prefix = worded(Finding(code="checkpoint-module-prefix", severity="info", ranks=[0], labels=base))
    assert prefix.title == "the DDP wrapper's state dict was saved to /ckpt/last.pt (keys start with 'module.')"
    assert prefix.detail.startswith("torch.save at t.py:40  torch.save(state, path) saved a state dict whose keys")


def test_a_gather_on_some_ranks_is_worded_from_the_call_and_where_the_others_went() -> None:
    gather = worded(
        Finding(
            code="state-gather-some-ranks",
            severity="error",
            ranks=list(range(12)),
            steps=[4],
            labels={
                "call": "get_model_state_dict",
                "site": "src/t.py:80  sd = get_model_state_dict(m)",
                "ranks_alone": "0",
            },
            positions=[
                _at(0, step=4, phase="after step", how="raised", site="src/t.py:80"),
                *(_at(r, step=5, phase="forward", how="sampled", site="src/t.py:60") for r in range(1, 9)),
            ],
        )
    )
    assert gather.title == "rank 0 gathered the full state dict alone: get_model_state_dict at t.py:80"
    assert "and ranks 1-11 never did: rank 1 went on to step 5, forward, at src/t.py:60;" in gather.detail
    assert gather.detail.count("went on to") == 8 and "; and 3 other ranks. Their next collectives" in gather.detail
    assert "The communication library said" not in gather.detail
