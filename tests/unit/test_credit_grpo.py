"""GRPO advantages on a hand-computed table (docs/credit-assignment.md, "GRPO (episode level only)"; Episode level,
shared; Invalid actions)."""

import math

import polars as pl
import pytest

from pipeline.config.params import CreditConfig
from pipeline.credit.base import EPS
from pipeline.credit.methods import compute_advantages


def table():
    # task group 1: episode 10 (2 turns, R = 1, second turn invalid), episode 11 (3 turns, R = 3)
    # task group 2: three episodes with R = 0 (all the same); task group 3: a single episode (singleton)
    rows = [
        (1, 10, 0, 0.5, True), (1, 10, 1, 0.5, False),
        (1, 11, 0, 1.0, True), (1, 11, 1, 1.0, True), (1, 11, 2, 1.0, True),
        (2, 20, 0, 0.0, True), (2, 21, 0, 0.0, True), (2, 22, 0, 0.0, True),
        (3, 30, 0, 5.0, True),
    ]
    return pl.DataFrame(rows, schema=["task_group", "episode_id", "step", "reward", "action_valid"], orient="row")


def adv(mode="mean_std_norm", stats="per_episode", penalty=0.1):
    cfg = CreditConfig.model_validate({"method": "grpo", "invalid_penalty": penalty,
                                       "episode": {"mode": mode, "episode_stats": stats}})
    out = compute_advantages(table(), cfg)
    return {(r["episode_id"], r["step"]): r["advantage"] for r in out.iter_rows(named=True)}


def test_grpo_mean_std_norm_per_episode():
    a = adv()
    s = math.sqrt(2)  # unbiased std of {1, 3}
    assert a[(10, 0)] == pytest.approx(-1 / (s + EPS))
    assert a[(10, 1)] == pytest.approx(-1 / (s + EPS) - 0.1)  # invalid turn: penalty after normalising
    assert a[(11, 0)] == a[(11, 2)] == pytest.approx(1 / (s + EPS))
    assert [a[(e, 0)] for e in (20, 21, 22)] == [0.0, 0.0, 0.0]
    assert a[(30, 0)] == 0.0


def test_grpo_mean_norm():
    a = adv(mode="mean_norm")
    assert a[(10, 0)] == pytest.approx(-1.0) and a[(11, 1)] == pytest.approx(1.0)
    assert a[(10, 1)] == pytest.approx(-1.1)


def test_grpo_per_turn_statistics_weight_long_episodes():
    a = adv(stats="per_turn", penalty=0.0)
    # rows of group 1 carry R = 1, 1, 3, 3, 3: mean 2.2, unbiased std sqrt(1.2)
    s = math.sqrt(1.2)
    assert a[(10, 0)] == pytest.approx(-1.2 / (s + EPS))
    assert a[(11, 0)] == pytest.approx(0.8 / (s + EPS))


def test_grpo_is_invariant_to_row_order():
    cfg = CreditConfig()
    base = compute_advantages(table(), cfg)
    shuffled = compute_advantages(table().sample(fraction=1.0, shuffle=True, seed=4), cfg)
    assert base.equals(shuffled)
