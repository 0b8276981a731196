"""Verdicts with their uncertainty (bench/verdicts.py): the sign-flip p-value, the seeds for 80 % power, the
two-level bootstrap interval and the comparison of runs' per-task tables, each on hand-computed numbers."""

import numpy as np
import polars as pl
import pytest

from bench.verdicts import (
    bootstrap_interval,
    compare_methods,
    paired_by_iteration,
    seeds_for_power,
    sign_flip_p,
    verdict,
)


def test_the_sign_flip_p_value_counts_the_sign_patterns_by_hand():
    # 1, 2, 3: of the 8 patterns only +++ and --- reach |mean| 2
    assert sign_flip_p(np.array([1.0, 2.0, 3.0])) == 0.25
    # 3, -1, 2 (sum 4): the sums ±3 ±1 ±2 reaching |4| are 4, 6, -4, -6
    assert sign_flip_p(np.array([3.0, -1.0, 2.0])) == 0.5
    # six seeds all one way: 2 / 64, the first count of seeds that can reach p < 0.05
    assert sign_flip_p(np.ones(6)) == pytest.approx(2 / 64)
    assert sign_flip_p(np.zeros(3)) == 1.0


def test_seeds_for_power_by_hand():
    # differences 1, 5, 0: mean 2, sd sqrt(14 / 2) = 2.6458; (z_.975 + z_.8) = 2.801585;
    # (2.801585 · 2.6458 / 2)² = 13.74 -> 14 seeds
    assert seeds_for_power(np.array([1.0, 5.0, 0.0])) == 14
    # 2, 6, 4: mean 4, sd 2: (2.8016 · 2 / 4)² = 1.96 -> 2, raised to the sign-flip floor of 6
    assert seeds_for_power(np.array([2.0, 6.0, 4.0])) == 6
    assert seeds_for_power(np.array([2.0, 2.0, 2.0])) is None       # no spread to size it by
    assert seeds_for_power(np.array([3.0])) is None


def test_the_bootstrap_resamples_seeds_and_then_tasks_within_a_seed():
    # every task of every seed differs by 2: no draw can move the mean
    assert bootstrap_interval([np.full(5, 2.0)] * 3) == (2.0, 2.0)
    # seeds alone (one figure each) 0, 0, 3: a draw's mean is 0 with probability (2/3)³ = 0.30 and 3 with
    # (1/3)³ = 0.037, both above 2.5 %: the interval is [0, 3]
    assert bootstrap_interval([np.array([0.0]), np.array([0.0]), np.array([3.0])]) == (0.0, 3.0)
    # one seed whose two tasks differ by 0 and 1: resampling the tasks gives 0, 0.5 or 1 (1/4, 1/2, 1/4), so the
    # task level widens the interval to [0, 1]; a bootstrap over seeds alone would give [0.5, 0.5]
    assert bootstrap_interval([np.array([0.0, 1.0])]) == (0.0, 1.0)


def test_the_verdict_says_not_established_with_three_seeds_and_established_with_six():
    v = verdict("gigpo", "grpo", "final", [np.array([0.01, 0.03]), np.array([0.02, 0.02]), np.array([0.03, 0.01])])
    assert v.diff == pytest.approx(2.0) and v.p_value == 0.25 and v.verdict == "not established"
    assert v.sentence.startswith("gigpo − grpo, final held-out success: +2.0 points [")
    assert "3 seeds, p = 0.25: not established" in v.sentence
    six = verdict("gigpo", "grpo", "auc", [np.array([0.02 + 0.01 * k]) for k in range(6)])
    assert six.p_value == pytest.approx(2 / 64) and six.ci_low > 0 and six.verdict == "established"
    assert six.seeds_for_power is not None and "power" not in six.sentence
    down = verdict("a", "b", "final", [np.array([-0.05])] * 6)
    assert (down.ci_low, down.ci_high, down.verdict) == (-5.0, -5.0, "established")
    assert down.sentence.startswith("a − b, final held-out success: −5.0 points [−5.0, −5.0], 6 seeds")


def table(rows: dict[int, list[float]]) -> pl.DataFrame:
    """Per-task success per iteration: {iteration: [task 0's, task 1's, ...]}."""
    return pl.DataFrame([{"iteration": it, "task_id": t, "success": s} for it, xs in rows.items()
                         for t, s in enumerate(xs)])


def test_runs_are_compared_on_the_same_tasks_final_and_area_under_the_curve():
    # two tasks, iterations 0 and 1; GRPO's seeds give the same table, GiGPO's differ by seed
    grpo = table({0: [0.5, 0.0], 1: [0.5, 0.5]})
    tables = {("grpo", s): grpo for s in (0, 1, 2)}
    tables[("gigpo", 0)] = table({0: [0.5, 0.0], 1: [1.0, 0.5]})     # final +0.5, 0 -> +0.25; AUC +0.125
    tables[("gigpo", 1)] = table({0: [0.5, 0.0], 1: [0.5, 1.0]})     # final 0, +0.5 -> +0.25; AUC +0.125
    tables[("gigpo", 2)] = table({0: [0.5, 0.0], 1: [0.5, 0.0]})     # final 0, -0.5 -> -0.25; AUC -0.125
    found, panel = compare_methods(tables, "grpo")
    assert panel == "Paired on the same 2 held-out tasks for every method and seed, at iterations 0-1."
    final, auc = found
    assert (final.metric, final.seeds, final.tasks) == ("final", 3, 2)
    assert final.diff == pytest.approx(25 / 3) and auc.diff == pytest.approx(12.5 / 3)
    # per-seed differences 25, 25, -25 points: every sign pattern's sum is ±25 or ±75, none nearer 0 than 25
    assert final.p_value == sign_flip_p(np.array([25.0, 25.0, -25.0])) == 1.0
    assert final.ci_low < 0 < final.ci_high and final.verdict == "not established"
    # a run that played a third task: the pairing keeps the tasks every run played, and says so
    tables[("gigpo", 2)] = table({0: [0.5, 0.0, 1.0], 1: [0.5, 0.0, 1.0]})
    found2, panel2 = compare_methods(tables, "grpo")
    assert panel2.startswith("Paired on the 2 held-out tasks every run played (the runs' panels differ)")
    assert found2[0].diff == pytest.approx(final.diff)


def test_two_runs_and_one_runs_gain_are_paired_by_task_at_every_iteration():
    a = table({0: [0.5, 0.0, 1.0], 1: [1.0, 0.5, 1.0], 2: [0.75, 0.25, 1.25]})
    # the gain over iteration 0: task differences 50, 50, 0 (mean 33.3) at 1; 25, 25, 25 at 2, which no resample
    # can move
    gain = paired_by_iteration(a)
    assert gain["iteration"].to_list() == [1, 2] and gain["tasks"].to_list() == [3, 3]
    assert gain["diff"].to_list() == pytest.approx([100 / 3, 25.0])
    assert gain["a"].to_list() == pytest.approx([2.5 / 3, 2.25 / 3]) and gain["b"].to_list() == pytest.approx([0.5] * 2)
    assert (gain["ci_low"][1], gain["ci_high"][1]) == (25.0, 25.0)
    lo, hi = gain["ci_low"][0], gain["ci_high"][0]
    assert 0.0 <= lo < 100 / 3 < hi <= 50.0
    # the rows' order does not change a draw: the tasks are resampled in the order of their id
    assert paired_by_iteration(a.reverse()).equals(gain)
    # against another run: only the tasks both played, at the iterations both evaluated
    b = table({0: [0.5, 0.5], 1: [0.0, 0.5], 3: [1.0, 1.0]})
    pair = paired_by_iteration(a, b)
    assert pair["iteration"].to_list() == [0, 1] and pair["tasks"].to_list() == [2, 2]
    assert pair["diff"].to_list() == pytest.approx([-25.0, 50.0])
    assert paired_by_iteration(table({1: [1.0]})).height == 0          # no iteration 0: no gain to pair
