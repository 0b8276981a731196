"""How an optimiser's pass over n items is cut into minibatches: the policy update (turns), GAE's critic (turns)
and SPA's progress estimator (whole episodes) all cut the same way."""

from __future__ import annotations

import math


def minibatch_count(n: int, size: int) -> int:
    """How many minibatches `minibatches` cuts n items into: ceil(n / size)."""
    return math.ceil(n / size)


def minibatches(order: list[int], size: int) -> list[list[int]]:
    """`order` cut into ceil(n / size) consecutive minibatches of near-equal size (at most `size`, sizes differing by
    at most one). Why: 577 turns in minibatches of 64 make 10 of 57-58 turns, not 9 of 64 and a last one of 1 turn
    whose optimiser step would follow that one turn's gradient at the full learning rate."""
    if not order:
        return []
    k = minibatch_count(len(order), size)
    q, r = divmod(len(order), k)
    cuts = [0]
    for j in range(k):
        cuts.append(cuts[-1] + q + (j < r))
    return [order[a:b] for a, b in zip(cuts, cuts[1:])]
