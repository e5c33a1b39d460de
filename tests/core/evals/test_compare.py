"""Compare statistics: the paired bootstrap interval and the flipped items."""

from __future__ import annotations

import pytest

from core.evals.compare import Graded, compare, paired_bootstrap


def test_the_bootstrap_is_seeded() -> None:
    base = [0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    cand = [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert paired_bootstrap(base, cand, seed=7) == paired_bootstrap(base, cand, seed=7)
    assert paired_bootstrap(base, cand, seed=7) != paired_bootstrap(base, cand, seed=8)


def test_the_interval_holds_the_mean_difference() -> None:
    base = [0.0] * 30 + [1.0] * 10
    cand = [1.0] * 25 + [0.0] * 5 + [1.0] * 10
    lo, hi = paired_bootstrap(base, cand, seed=0)
    assert lo <= 25 / 40 <= hi
    assert lo > 0  # every change is an improvement: the interval stays above 0


def test_identical_runs_give_a_zero_width_interval() -> None:
    xs = [0.2, 0.9, 0.5, 0.5]
    assert paired_bootstrap(xs, xs) == (0.0, 0.0)


def test_pairing_narrows_the_interval_against_shared_difficulty() -> None:
    # Items vary a lot, but the candidate is always 0.1 better: the paired interval is
    # the single point 0.1.
    base = [0.0, 0.8, 0.1, 0.7, 0.3, 0.5]
    cand = [b + 0.1 for b in base]
    lo, hi = paired_bootstrap(base, cand)
    assert lo == pytest.approx(0.1) and hi == pytest.approx(0.1)


def test_unpaired_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], [1.0, 0.0])


def _g(passed: bool, answer: str, error: str | None = None) -> Graded:
    r = {"score": 1.0 if passed else 0.0, "passed": passed}
    if error:
        r["error"] = error
    return Graded({"q": answer}, answer, {"exact": r})


def test_compare_counts_rates_and_flips_over_items_both_graded() -> None:
    base = {0: _g(False, "a"), 1: _g(True, "b"), 2: _g(False, "c"), 3: _g(True, "d", "boom")}
    cand = {0: _g(True, "A"), 1: _g(False, "B"), 2: _g(True, "C"), 3: _g(True, "D"),
            4: _g(True, "E")}
    out = compare(base, cand, ["exact"], seed=1)
    (c,) = out.criteria
    assert c.items == 3  # item 3 errored in base, item 4 is not in base
    assert (c.base_pass_rate, c.candidate_pass_rate) == (pytest.approx(1 / 3),
                                                          pytest.approx(2 / 3))
    assert c.pass_rate_difference == pytest.approx(1 / 3)
    flips = {(f.n, f.direction, f.base_answer, f.candidate_answer) for f in out.flipped}
    assert flips == {(0, "gained", "a", "A"), (1, "lost", "b", "B"), (2, "gained", "c", "C")}
