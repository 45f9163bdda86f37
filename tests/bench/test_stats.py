"""The bench verdict's statistics on synthetic timings: a clear winner is found, a noisy tie is called a tie and
falls back to the least-work configuration, the fallback order, and early stopping."""

from __future__ import annotations

from ddp_doctor.bench.candidates import Config
from ddp_doctor.bench.stats import MARGIN, compare, decide, work_rank

FREEZE = Config(freeze_before_wrap=("head.weight",))
DEFAULTS = Config()
STATIC = Config(static_graph=True)
FIND_UNUSED = Config(find_unused_parameters=True)


def test_the_fallback_order_is_least_work_first() -> None:
    assert [work_rank(c) for c in (FREEZE, DEFAULTS, STATIC, FIND_UNUSED)] == [0, 1, 2, 3]
    assert work_rank(Config(find_unused_parameters=True, static_graph=True)) == 3


def test_a_clear_winner_is_found() -> None:
    # find_unused is 20% faster in every one of 6 rounds (an odd script where the graph walk pays off).
    defaults = [10.0, 11.0, 9.5, 10.5, 12.0, 10.2]
    verdict = decide(
        {"defaults": defaults, "find_unused": [t * 0.8 for t in defaults]},
        {"defaults": DEFAULTS, "find_unused": FIND_UNUSED},
    )
    assert verdict.choice == "find_unused" and verdict.measured and verdict.reference == "defaults"
    c = verdict.comparisons["find_unused"]
    assert c.high < 1 - MARGIN and abs(c.ratio - 0.8) < 1e-9
    assert "clearly faster" in verdict.reason and "95% interval 0.80 to 0.80 over 6 rounds" in verdict.reason


def test_a_noisy_tie_falls_back_to_least_work_and_says_so() -> None:
    # The case: the script's find_unused_parameters=True looked 1.43x faster in one round, slower in others.
    defaults = [14.3, 9.0, 11.5, 10.0]
    user = [10.0, 10.5, 10.2, 11.0]
    verdict = decide({"user": user, "defaults": defaults}, {"user": FIND_UNUSED, "defaults": DEFAULTS})
    assert verdict.choice == "defaults" and not verdict.measured
    assert "indistinguishable here; choosing defaults, which skips the graph walk" in verdict.reason, verdict.reason
    assert verdict.reason.startswith("user vs defaults: median ratio ")


def test_freeze_before_wrap_wins_a_tie_over_plain_flags() -> None:
    verdict = decide(
        {"recommended": [10.0, 10.1, 9.9], "static_graph": [9.9, 10.2, 10.0]},
        {"recommended": FREEZE, "static_graph": STATIC},
    )
    assert verdict.choice == "recommended" and "freezes the never-used parameters" in verdict.reason


def test_too_few_rounds_never_declare_a_winner() -> None:
    verdict = decide(
        {"defaults": [10.0, 10.0], "find_unused": [5.0, 5.0]}, {"defaults": DEFAULTS, "find_unused": FIND_UNUSED}
    )
    assert verdict.choice == "defaults" and not verdict.settled
    assert "too few rounds for an interval" in verdict.reason


def test_settled_when_every_interval_is_on_one_side() -> None:
    slower = compare([12.0, 12.5, 12.2, 12.4], [10.0, 10.1, 10.0, 9.9])
    assert slower.settled and not slower.faster and slower.low > 1
    straddling = compare([9.0, 11.0, 10.0, 12.0], [10.0, 10.0, 10.0, 10.0])
    assert not straddling.settled and not straddling.faster


def test_the_verdict_is_deterministic() -> None:
    rounds = {"defaults": [10.0, 11.0, 9.0, 10.5], "static_graph": [9.8, 10.4, 9.5, 10.1]}
    configs = {"defaults": DEFAULTS, "static_graph": STATIC}
    assert decide(rounds, configs) == decide(rounds, configs)
