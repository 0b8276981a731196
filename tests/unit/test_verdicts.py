"""Verdicts with their uncertainty (bench/verdicts.py): the sign-flip p-values, Holm's correction, the interval of
a crossed seeds x tasks design (by hand, and its coverage in a simulation), equivalence, the seeds a decision needs
(the sign-flip test simulated), and the comparison of runs' per-task tables, each on hand-computed numbers."""

import numpy as np
import polars as pl
import pytest
from scipy import stats

from bench.verdicts import (
    auc_weights,
    bootstrap_interval,
    compare_methods,
    equivalence_p,
    holm,
    interval,
    paired_by_iteration,
    seeds_to_decide,
    sign_flip_p,
    simulated_power,
    standard_error,
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
    # one-sided: of 3, -1, 2's sums 6, 2, 4, 0, 0, -4, -2, -6 (+-3 +-1 +-2), those >= 4 are 6 and 4
    assert sign_flip_p(np.array([3.0, -1.0, 2.0]), "greater") == 2 / 8
    assert sign_flip_p(np.array([3.0, -1.0, 2.0]), "less") == 7 / 8
    # above 20 seeds random patterns, and never p = 0: (1 + count) / (1 + B)
    p = sign_flip_p(np.ones(30))
    assert p == pytest.approx(1 / 200_001, rel=0.5) and p > 0


def test_holm_by_hand():
    # sorted 0.01, 0.03, 0.04: 3 x 0.01 = 0.03, 2 x 0.03 = 0.06, max(0.06, 1 x 0.04) = 0.06
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5]) == [0.5] and holm([0.6, 0.9]) == pytest.approx([1.0, 1.0])


def test_the_standard_error_adds_the_seeds_and_the_shared_panel_by_hand():
    # seeds' means 1, 3, 2: s^2 = 1, / 3 seeds; the tasks' means over seeds 1 and 3: v = 2, / 2 tasks
    se, df, covers = standard_error([np.array([0.0, 2.0]), np.array([2.0, 4.0]), np.array([1.0, 3.0])])
    assert se == pytest.approx(np.sqrt(1 / 3 + 1)) and df == 2 and "seeds and the task panel" in covers
    v = verdict("a", "b", "final", [np.array([0.0, 0.02]), np.array([0.02, 0.04]), np.array([0.01, 0.03])])
    half = stats.t.ppf(0.975, 2) * np.sqrt(1 / 3 + 1)          # 4.3027 x 1.1547 = 4.968 points
    assert (v.ci_low, v.ci_high) == pytest.approx((2.0 - half, 2.0 + half))
    # one seed: the panel alone (variance 1/3 over 4 tasks, 3 degrees of freedom), and it says what it covers
    one = verdict("a", "b", "final", [np.array([0.0, 0.01, 0.0, 0.01])])
    half = stats.t.ppf(0.975, 3) * np.sqrt(1 / 3 / 4)
    assert (one.ci_low, one.ci_high) == pytest.approx((0.5 - half, 0.5 + half))
    assert "over held-out tasks only; excludes run-to-run variation" in one.sentence
    # one per-seed figure: no interval at all (it used to be [+10.0, +10.0])
    single = verdict("a", "b", "final", [np.array([0.1])])
    assert np.isnan(single.ci_low) and "(no interval from one figure)" in single.sentence
    assert single.verdict == "undecided"


def test_the_interval_covers_the_mean_of_a_crossed_design_in_simulation():
    """Seeds x tasks crossed, as every seed plays one panel: d[s, t] = mu + seed effect + task effect + noise, the
    target mu. Over 2,000 simulated experiments of 3 seeds and 32 tasks the 95 % interval covers mu at least 93 %
    of the time; the seeds' range (what a percentile bootstrap over 3 seeds gives) covers it far less often."""
    rng = np.random.default_rng(1)
    n, tasks, hits, ranges = 3, 32, 0, 0
    for _ in range(2000):
        d = 2.0 + rng.normal(0, 6, (n, 1)) + rng.normal(0, 20, (1, tasks)) + rng.normal(0, 30, (n, tasks))
        lo, hi = interval(float(d.mean()), *standard_error(list(d))[:2], 0.95)
        hits += lo <= 2.0 <= hi
        means = d.mean(axis=1)
        ranges += means.min() <= 2.0 <= means.max()
    assert hits / 2000 >= 0.93
    assert ranges / 2000 < 0.85


def test_equivalence_needs_five_seeds_and_both_one_sided_tests_by_hand():
    d = np.array([1.0, -1.0, 0.5, -0.5, 0.0])
    # shifted by +5 every difference is positive: only the all-plus pattern reaches the observed mean, 1 / 32
    assert equivalence_p(d, 5.0) == pytest.approx(1 / 32)
    v = verdict("a", "b", "auc", [np.array([x / 100]) for x in d])
    assert v.verdict == "equivalent" and v.p_equivalence == pytest.approx(1 / 32)
    assert "equivalent within ±5 points (90 % interval" in v.sentence
    four = verdict("a", "b", "auc", [np.array([x / 100]) for x in d[:4]])
    assert four.verdict == "undecided" and np.isnan(four.p_equivalence)
    # a margin the 90 % interval does not fit inside: not equivalent, though both one-sided p-values are 1/32
    wide = np.array([4.9, -4.9, 4.9, -4.9, 4.8])      # mean 0.96, 90 % interval [-4.1, +6.1]
    assert equivalence_p(wide, 5.0) == pytest.approx(1 / 32)
    assert verdict("a", "b", "auc", [np.array([x / 100]) for x in wide]).verdict == "undecided"


def test_seeds_to_decide_simulate_the_sign_flip_test_itself():
    # a mean of 4 points and a spread of 3.4: the normal formula ((2.80 x 3.4 / 4)^2 = 5.7) promised 6 seeds, where
    # the sign-flip test needs all 6 positive (about 0.88^6 = 0.47)
    assert simulated_power(4.0, 3.4, 6, "difference") < 0.6
    need = seeds_to_decide(np.array([0.6, 4.0, 7.4]))              # mean 4, sd 3.4
    assert need > 6
    assert simulated_power(4.0, 3.4, need, "difference") >= 0.8 > simulated_power(4.0, 3.4, need - 1, "difference")
    # a large effect: the test's own floor of 6 seeds; near zero, an equivalence is the cheaper decision
    assert seeds_to_decide(np.array([20.0, 25.0, 30.0])) == 6
    near = seeds_to_decide(np.array([-1.0, 0.0, 1.0]))
    assert near is not None and near >= 5 and simulated_power(0.0, 1.0, near, "equivalence") >= 0.8
    assert seeds_to_decide(np.array([2.0, 2.0])) is None and seeds_to_decide(np.array([3.0])) is None
    v = verdict("a", "b", "final", [np.array([x / 100]) for x in (0.6, 4.0, 7.4)])
    assert v.verdict == "undecided" and f"about {need - 3} more seeds expected to decide" in v.sentence


def test_a_run_pairs_bootstrap_resamples_its_tasks():
    assert bootstrap_interval(np.full(5, 2.0)) == (2.0, 2.0)
    # two tasks differing by 0 and 1: resampling gives 0, 0.5 or 1 (1/4, 1/2, 1/4)
    assert bootstrap_interval(np.array([0.0, 1.0])) == (0.0, 1.0)


def test_the_mean_over_iterations_leaves_out_the_shared_ones_and_weights_uneven_evaluations():
    assert auc_weights([0, 1, 2, 3], 1) == pytest.approx([1 / 3] * 3)
    assert auc_weights([0, 2, 3, 6], 1) == pytest.approx([2 / 6, 1 / 6, 3 / 6])   # iterations since the previous
    assert auc_weights([2, 4, 6], 0) == pytest.approx([1 / 3] * 3)              # nothing shared, evenly spaced
    assert auc_weights([5], 0) == pytest.approx([1.0])


def table(rows: dict[int, list[float]]) -> pl.DataFrame:
    """Per-task success per iteration: {iteration: [task 0's, task 1's, ...]}."""
    return pl.DataFrame([{"iteration": it, "task_id": t, "success": s} for it, xs in rows.items()
                         for t, s in enumerate(xs)])


def test_runs_are_compared_on_the_same_tasks_final_and_area_under_the_curve():
    # two tasks, iterations 0 and 1; GRPO's seeds give the same table, GiGPO's differ by seed; iteration 0 is the
    # shared initial policy, so the mean over iterations reads iteration 1 alone
    grpo = table({0: [0.5, 0.0], 1: [0.5, 0.5]})
    tables = {("grpo", s): grpo for s in (0, 1, 2)}
    tables[("gigpo", 0)] = table({0: [0.5, 0.0], 1: [1.0, 0.5]})     # final +0.5, 0 -> +0.25
    tables[("gigpo", 1)] = table({0: [0.5, 0.0], 1: [0.5, 1.0]})     # final 0, +0.5 -> +0.25
    tables[("gigpo", 2)] = table({0: [0.5, 0.0], 1: [0.5, 0.0]})     # final 0, -0.5 -> -0.25
    found, panel = compare_methods(tables, "grpo")
    assert panel == "Paired on the same 2 held-out tasks for every method and seed."
    final, auc = found
    assert (final.metric, final.seeds, final.tasks, final.primary) == ("final", 3, 2, False)
    assert final.diff == pytest.approx(25 / 3) and auc.diff == pytest.approx(25 / 3) and auc.primary
    assert auc.iterations == "iterations 1" and final.iterations == "iteration 1"
    # per-seed differences 25, 25, -25 points: every sign pattern's sum is ±25 or ±75, none nearer 0 than 25
    assert final.p_value == sign_flip_p(np.array([25.0, 25.0, -25.0])) == 1.0
    assert final.ci_low < 0 < final.ci_high and final.verdict == "undecided"
    # a run that played a third task: the pairing keeps the tasks every run played, and says so
    tables[("gigpo", 2)] = table({0: [0.5, 0.0, 1.0], 1: [0.5, 0.0, 1.0]})
    found2, panel2 = compare_methods(tables, "grpo")
    assert panel2.startswith("Paired on the 2 held-out tasks every run played (the runs' panels differ)")
    assert found2[0].diff == pytest.approx(final.diff)


def test_each_seed_is_final_where_both_its_runs_are_and_says_so():
    """A short run truncates its own seed's pair only, with a warning; a pair without a common iteration is left
    out by name instead of crashing; several arms are Holm-corrected within the primary family and within the
    secondary one."""
    base = table({0: [0.0, 0.0], 1: [0.5, 0.5], 2: [0.5, 0.5]})
    tables = {("grpo", s): base for s in (0, 1)}
    tables[("gigpo", 0)] = table({0: [0.0, 0.0], 1: [1.0, 0.5], 2: [1.0, 1.0]})   # final at 2: +0.5
    tables[("gigpo", 1)] = table({0: [0.0, 0.0], 1: [1.0, 1.0]})                  # stopped at 1: final +0.5
    tables[("rloo", 0)] = table({3: [1.0, 1.0]})                                   # nothing in common with seed 0
    tables[("rloo", 1)] = table({0: [0.0, 0.0], 1: [0.5, 0.5], 2: [0.0, 0.5]})
    found, panel = compare_methods(tables, "grpo", primary="final")
    v = {(x.method, x.metric): x for x in found}
    assert v[("gigpo", "final")].diff == pytest.approx(50.0) and v[("gigpo", "final")].iterations == "iteration 1, 2"
    assert "seed 1: gigpo against grpo is final at iteration 1, the last both evaluated; the runs end at 1 and 2." \
        in panel
    assert "rloo and grpo share no evaluated iteration on seed 0: left out." in panel
    assert v[("rloo", "final")].seeds == 1 and v[("rloo", "final")].diff == pytest.approx(-25.0)
    # gigpo's mean over iterations 1-2 on seed 0: (0.75 + 1.0) / 2 - 0.5 = +0.375; seed 1: iteration 1, +0.5
    assert v[("gigpo", "auc")].diff == pytest.approx(100 * (0.375 + 0.5) / 2)
    primaries = [v[("gigpo", "final")], v[("rloo", "final")]]
    assert [x.primary for x in primaries] == [True, True] and not v[("gigpo", "auc")].primary
    assert [x.p_adjusted for x in primaries] == pytest.approx(holm([x.p_value for x in primaries]))


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


def test_a_runs_task_success_is_each_tasks_rate_sorted_by_iteration_and_task(tmp_path):
    """Two evaluations of three tasks, episodes written in shuffled order: each task's rate over its episodes (task
    7: 1 of 2, task 3: 2 of 2, task 5: 0 of 1 at iteration 0), one row per iteration and task in sorted order, so a
    recorded table is the same file whichever order the rows were grouped in."""
    from bench.verdicts import task_success
    from pipeline.data import tables

    for it, rows in ((0, [(7, True), (3, True), (5, False), (7, False), (3, True)]),
                     (2, [(5, True), (3, False), (7, True)])):
        (tmp_path / f"iter_{it}").mkdir()
        tables.write_table(pl.DataFrame({
            "iteration": [it] * len(rows), "task_id": [t for t, _ in rows], "episode_return": [1.0] * len(rows),
            "episode_length": [3] * len(rows), "success": [ok for _, ok in rows], "invalid_turns": [0] * len(rows),
            "optimal_moves": [None] * len(rows)}), tmp_path / f"iter_{it}" / "eval.parquet", tables.EVAL_EPISODES)
    got = task_success(tmp_path, [0, 2])
    assert got.rows() == [(0, 3, 1.0), (0, 5, 0.0), (0, 7, 0.5), (2, 3, 0.0), (2, 5, 1.0), (2, 7, 1.0)]
