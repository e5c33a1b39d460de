"""Two runs of one eval side by side: per criterion, the pass rates and mean scores of each,
their difference (candidate - base) with a paired bootstrap 95% interval, and the items whose
verdict flipped.

Paired: both runs graded the same items, so the difference is taken item by item and the
items are resampled (with replacement, seeded: the same inputs give the same interval), which
keeps what the two runs share (an item hard for both) out of the interval's width. Only items
that both runs graded without an error on the criterion count."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
CHUNK = 250  # resamples drawn at once: bounds memory at CHUNK x items indices


@dataclass(frozen=True)
class Graded:
    """One output item as compare reads it."""

    item: dict[str, Any]
    answer: str | None
    results: dict[str, dict[str, Any]]  # criterion name -> {score, passed, error?}


@dataclass
class CriterionStats:
    name: str
    items: int
    base_pass_rate: float
    candidate_pass_rate: float
    pass_rate_difference: float
    pass_rate_interval: tuple[float, float]
    base_mean_score: float
    candidate_mean_score: float
    mean_score_difference: float
    mean_score_interval: tuple[float, float]


@dataclass
class Flip:
    n: int
    criterion: str
    direction: str  # gained | lost
    item: dict[str, Any]
    base_answer: str | None
    candidate_answer: str | None


@dataclass
class Comparison:
    criteria: list[CriterionStats] = field(default_factory=list)
    flipped: list[Flip] = field(default_factory=list)


def paired_bootstrap(base: list[float], candidate: list[float], *, resamples: int = RESAMPLES,
                     seed: int = 0, level: float = LEVEL) -> tuple[float, float]:
    """The ``level`` percentile interval of mean(candidate - base) over item resamples."""
    if len(base) != len(candidate):
        raise ValueError("paired samples must have the same length")
    n = len(base)
    if n == 0:
        return (0.0, 0.0)
    diffs = np.asarray(candidate, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, CHUNK):
        k = min(CHUNK, resamples - start)
        means[start:start + k] = diffs[rng.integers(0, n, size=(k, n))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return (round(float(lo), 6), round(float(hi), 6))


def compare(base: dict[int, Graded], candidate: dict[int, Graded], criteria: list[str], *,
            seed: int = 0, resamples: int = RESAMPLES, max_flipped: int = 1000) -> Comparison:
    out = Comparison()
    shared = sorted(set(base) & set(candidate))
    for name in criteria:
        b_pass: list[float] = []
        c_pass: list[float] = []
        b_score: list[float] = []
        c_score: list[float] = []
        for n in shared:
            rb, rc = base[n].results.get(name), candidate[n].results.get(name)
            if rb is None or rc is None or rb.get("error") or rc.get("error"):
                continue
            b_pass.append(float(bool(rb["passed"])))
            c_pass.append(float(bool(rc["passed"])))
            b_score.append(float(rb["score"]))
            c_score.append(float(rc["score"]))
            if bool(rb["passed"]) != bool(rc["passed"]) and len(out.flipped) < max_flipped:
                out.flipped.append(Flip(n, name, "gained" if rc["passed"] else "lost",
                                        candidate[n].item, base[n].answer, candidate[n].answer))
        k = len(b_pass)
        out.criteria.append(CriterionStats(
            name=name, items=k,
            base_pass_rate=_mean(b_pass), candidate_pass_rate=_mean(c_pass),
            pass_rate_difference=_diff(c_pass, b_pass),
            pass_rate_interval=paired_bootstrap(b_pass, c_pass, resamples=resamples, seed=seed),
            base_mean_score=_mean(b_score), candidate_mean_score=_mean(c_score),
            mean_score_difference=_diff(c_score, b_score),
            mean_score_interval=paired_bootstrap(b_score, c_score, resamples=resamples,
                                                 seed=seed),
        ))
    return out


def _mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 6) if xs else 0.0


def _diff(cand: list[float], base: list[float]) -> float:
    return round((sum(cand) - sum(base)) / len(base), 6) if base else 0.0
