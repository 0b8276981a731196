"""A claim's campaign: paired seeds in batches under a group-sequential design fixed in advance, so that it stops
as soon as the claim is decided and its error rate still holds (docs/statistics.md, Campaigns).

The design (`Design`) fixes before any run: the claim's two arms, the primary metric, the maximum number of seeds,
the looks (the seeds after which the data are read; the first at 8 or more, since the sign-flip test cannot reach
the early boundaries with fewer), the seed order, alpha and the equivalence margin delta.

At look k with n_k seeds, the per-seed paired differences d_1..d_{n_k} (in seed order) are tested against an
alpha-spending boundary: Lan-DeMets' O'Brien-Fleming-type function `spent(t) = 2 - 2 Phi(z_{1 - alpha/2} /
sqrt(t))`, t = n_k / max seeds, calibrated exactly on the sign patterns of the observed differences
(`boundaries`): c_k is the smallest |mean| at which the patterns that cross c_1..c_{k-1} at an earlier look, or
c_k at this one, are at most `spent(t_k)` of all 2^{n_k} (random patterns past `EXACT_UP_TO` seeds). The claim is
*better* or *worse* when the observed |mean| reaches c_k; *equivalent within +-delta* (a non-binding stop: it
never moves the efficacy boundary) when both one-sided sign-flip tests of the shifted differences pass at this
look's increment of alpha and the 90 % t-interval is inside +-delta; else the campaign goes on to the next look,
and at the last one it is *undecided*, with the seeds a simulation expects a decision to need. A seed whose run
crashed counts: its arm scores 0 at every iteration it did not evaluate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from bench.verdicts import DELTA, equivalence_p, interval, seeds_to_decide, sign_patterns

EXACT_UP_TO = 16          # seeds whose 2^n sign patterns are enumerated at a look
RANDOM_PATTERNS = 100_000
FIRST_LOOK = 8


@dataclass(frozen=True)
class Design:
    claim: str
    method: str                    # the arm the claim is about
    baseline: str
    metric: str                    # the primary metric: final or auc (bench.verdicts)
    looks: tuple[int, ...]         # seeds at each look, increasing; the last is the maximum
    alpha: float = 0.05
    delta: float = DELTA
    seed_order: tuple[int, ...] = field(default=())   # default 0, 1, ..., max - 1

    def __post_init__(self):
        if self.metric not in ("final", "auc"):
            raise ValueError(f"design {self.claim}: metric {self.metric!r}; expected final or auc")
        if not self.looks or list(self.looks) != sorted(set(self.looks)):
            raise ValueError(f"design {self.claim}: looks {self.looks} must be increasing seed counts")
        if self.looks[0] < FIRST_LOOK:
            raise ValueError(f"design {self.claim}: the first look at {self.looks[0]} seeds; the sign-flip test "
                             f"cannot reach an O'Brien-Fleming boundary before {FIRST_LOOK}")
        if self.seed_order and len(self.seed_order) != self.max_seeds:
            raise ValueError(f"design {self.claim}: seed_order has {len(self.seed_order)} seeds, the design "
                             f"{self.max_seeds}")

    @property
    def max_seeds(self) -> int:
        return self.looks[-1]

    @property
    def seeds(self) -> tuple[int, ...]:
        return self.seed_order or tuple(range(self.max_seeds))


def spent(t: float, alpha: float = 0.05) -> float:
    """Lan-DeMets' O'Brien-Fleming-type alpha spent by information fraction t (two-sided)."""
    if t <= 0:
        return 0.0
    z = NormalDist().inv_cdf(1 - alpha / 2)
    return min(alpha, 2 - 2 * NormalDist().cdf(z / math.sqrt(t)))


def _patterns(n: int, seed: int = 0) -> np.ndarray:
    if n <= EXACT_UP_TO:
        return sign_patterns(n)
    return np.random.default_rng(seed).choice((1.0, -1.0), size=(RANDOM_PATTERNS, n))


def boundaries(d: np.ndarray, looks: tuple[int, ...], max_seeds: int, alpha: float = 0.05) -> list[float]:
    """The critical |mean| of the differences at each look that `d` reaches (in order; inf: no |mean| can cross
    within the alpha spent so far), each calibrated on the sign patterns of the differences seen at that look with
    the earlier looks' boundaries fixed."""
    d = np.asarray(d, dtype=np.float64)
    out: list[float] = []
    for k, n in enumerate(looks):
        if n > len(d):
            break
        signs = _patterns(n)
        stats = [np.abs(signs[:, :m] @ d[:m]) / m for m in looks[: k + 1]]
        tol = 1e-12 * max(1.0, float(np.abs(d[:n]).max()))
        crossed = np.zeros(len(signs), dtype=bool)
        for j, c in enumerate(out):
            crossed |= stats[j] >= c - tol
        budget = spent(n / max_seeds, alpha) * len(signs)
        free = np.sort(stats[k][~crossed])[::-1]          # the patterns not yet crossed, largest |mean| first
        room = int(math.floor(budget - crossed.sum() + 1e-9))
        if room <= 0 or not len(free):
            out.append(math.inf)
            continue
        # the smallest c with #(free >= c) <= room: ties at the cut move c up past them
        c = free[min(room, len(free)) - 1]
        while (free >= c - tol).sum() > room:
            above = free[free > c + tol]
            if not len(above):
                c = math.inf
                break
            c = above.min()
        out.append(float(c))
    return out


@dataclass
class Look:
    seeds: int
    mean: float
    boundary: float
    alpha_spent: float
    p_equivalence: float
    ci90: tuple[float, float]
    decision: str           # better, worse, equivalent, continue, undecided
    seeds_to_decide: int | None = None


def decide(design: Design, d: np.ndarray, estimate: bool = True) -> list[Look]:
    """Every look the per-seed differences `d` (points, in the design's seed order) reach, the last one's decision
    being the campaign's: it stops at the first look that decides. `estimate`: an undecided campaign's seeds to
    decide (a simulation of its own)."""
    d = np.asarray(d, dtype=np.float64)
    bounds = boundaries(d, design.looks, design.max_seeds, design.alpha)
    looks, before = [], 0.0
    for n, c in zip(design.looks, bounds):
        x = d[:n]
        mean = float(x.mean())
        a = spent(n / design.max_seeds, design.alpha)
        se = float(x.std(ddof=1)) / math.sqrt(n)
        ci90 = interval(mean, se, n - 1, 0.90)
        p_eq = equivalence_p(x, design.delta)
        tol = 1e-12 * max(1.0, float(np.abs(x).max()))
        if abs(mean) >= c - tol:
            decision = "better" if mean > 0 else "worse"
        elif p_eq < a - before and -design.delta < ci90[0] and ci90[1] < design.delta:
            decision = "equivalent"
        elif n == design.max_seeds:
            decision = "undecided"
        else:
            decision = "continue"
        need = seeds_to_decide(x, design.delta) if decision == "undecided" and estimate else None
        looks.append(Look(n, mean, c, a, p_eq, ci90, decision, need))
        before = a
        if decision != "continue":
            break
    return looks
