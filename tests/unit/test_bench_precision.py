"""`bench.precision`'s attribution of a profile: operators by kind, events by phase, overhead as the rest."""

import numpy as np
import pytest
import torch

from bench.precision import attribute, kind


@pytest.mark.parametrize("name, expected", [
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("aten::bmm", "matmul"), ("aten::linear", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten::index", "gather/copy"), ("aten::index_put_", "gather/copy"), ("aten::copy_", "gather/copy"),
    ("aten::cat", "gather/copy"), ("aten::embedding_dense_backward", "gather/copy"),
    ("aten::mul", "elementwise"), ("aten::add_", "elementwise"), ("aten::_foreach_mul_", "elementwise"),
    ("aten::_log_softmax", "elementwise"), ("aten::addcdiv_", "elementwise"),
    ("aten::view", "other op"), ("aten::transpose", "other op"),
])
def test_kinds_of_operators(name, expected):
    assert kind(name) == expected


def test_a_profile_splits_into_forward_backward_and_optimizer():
    torch.manual_seed(0)
    w = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(w.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = w(x).square().mean()
        loss.backward()
        opt.step()
    table, top = attribute(prof.events(), wall_s=10.0)
    assert table[("forward", "matmul")] > 0 and table[("backward", "matmul")] > 0
    assert sum(s for (ph, _), s in table.items() if ph == "optimizer") > 0
    assert sum(table.values()) == pytest.approx(10.0)              # the overhead is what the operators leave
    assert table[("overhead", "python")] > 9.0
    names = {(n, ph) for n, ph, _, _ in top}
    assert ("aten::addmm", "forward") in names and ("aten::mm", "backward") in names


def test_noninferiority_by_hand():
    """Two seeds, two tasks: differences (+10, 0) and (-10, 0) points. Seed means +5 and -5: their variance 50 over
    2 seeds is 25; the tasks' means over seeds are 0 and 0, no panel term; se 5 on 1 degree of freedom, the lower
    bound 0 - t(0.95, 1) x 5 = -31.57: not shown. Three seeds of +1, +2 and +3 points on one task each: se
    sqrt(1/3), 2 df, lower bound 2 - 2.920 x 0.577 = 0.314: not worse by 5."""
    import numpy as np

    from bench.precision import noninferiority

    r = noninferiority([np.array([10.0, 0.0]), np.array([-10.0, 0.0])], margin=5)
    assert r["mean"] == 0 and r["se"] == pytest.approx(5.0) and r["df"] == 1
    assert r["lower_95_one_sided"] == pytest.approx(-6.313752 * 5, abs=1e-4) and not r["not_worse"]
    r = noninferiority([np.array([1.0]), np.array([2.0]), np.array([3.0])], margin=5)
    assert r["lower_95_one_sided"] == pytest.approx(2 - 2.919986 * (1 / 3) ** 0.5, abs=1e-5) and r["not_worse"]


@pytest.mark.parametrize("mean, sd", [(0.0, 5.0), (-2.0, 4.0)])
def test_seeds_to_show_matches_the_noncentral_t(mean, sd):
    """Without a panel term the bound clears -5 when (mean_hat + 5) / (s / sqrt(n)) > t(0.95, n - 1): the statistic
    is noncentral t with n - 1 degrees of freedom and noncentrality (mean + 5) sqrt(n) / sd, so the exact power
    is its survival function at the critical value. The simulation finds the same fewest n with 80 % power."""
    import scipy.stats as st

    from bench.precision import seeds_to_show

    def power(n):
        return float(st.nct.sf(st.t.ppf(0.95, n - 1), n - 1, (mean + 5.0) * n ** 0.5 / sd))
    exact = next(n for n in range(2, 100) if power(n) >= 0.8)
    assert exact == {0.0: 8, -2.0: 13}[mean]       # powers 0.754 at 7 and 0.815 at 8; 0.785 at 12, 0.817 at 13
    assert seeds_to_show(mean, sd, 5.0) == exact


def test_seeds_to_show_says_none_where_no_number_of_seeds_would():
    """At or below the margin, or where the tasks' own spread keeps the bound under it (-4.5 - 1.645 x 1 < -5);
    task-by-seed noise alone averages away."""
    from bench.precision import noninferiority, seeds_to_show

    assert seeds_to_show(-5.5, 3.0, 5.0) is None
    assert seeds_to_show(-4.5, 2.0, 5.0, panel=1.0) is None
    assert seeds_to_show(-4.5, 2.0, 5.0, panel_per_seed=1.0) is not None
    # one seed has no spread to simulate: no estimate
    assert noninferiority([np.array([1.0, 2.0])], margin=5)["seeds_to_show"] is None


def test_the_panel_splits_into_the_tasks_spread_and_the_task_by_seed_noise(monkeypatch):
    """Seeds (3, 0, 0) and (1, 0, 2): seed means 1 and 1 (spread 0). The tasks' means over seeds 2, 0, 1 vary by 1,
    over 3 tasks 1/3. Each seed less its mean: (2, -1, -1) and (0, -1, 1); per task the variance over seeds 2, 0,
    2, their mean 4/3, over 3 tasks 4/9: the task-by-seed noise, of which 2 seeds leave (4/9) / 2 in the tasks'
    means, so the tasks' own spread is 1/3 - 2/9 = 1/9."""
    from bench import precision

    seen = []
    monkeypatch.setattr(precision, "seeds_to_show", lambda *a: seen.append(a) or 7)
    r = precision.noninferiority([np.array([3.0, 0.0, 0.0]), np.array([1.0, 0.0, 2.0])], margin=5)
    assert r["seeds_to_show"] == 7
    (mean, sd, margin, panel, per_seed), = seen
    assert (mean, sd, margin) == (1.0, 0.0, 5) and panel == pytest.approx(1 / 9) and per_seed == pytest.approx(4 / 9)


def test_the_learning_check_pairs_runs_by_seed_over_later_iterations(tmp_path, monkeypatch, capsys):
    """Each seed's bf16 and fp32 runs, averaged over iterations 1 on and differenced task by task; an odd number
    of folders and different panels are refused."""
    import polars as pl

    from bench import precision

    success = {  # run -> iteration -> rates of tasks 7 and 9
        "bf_0": {0: [0.0, 0.0], 1: [1.0, 0.5], 2: [1.0, 1.0]}, "fp_0": {0: [1.0, 1.0], 1: [0.5, 0.5], 2: [1.0, 0.5]},
        "bf_1": {0: [0.0, 0.0], 1: [0.5, 0.5], 2: [0.5, 0.5]}, "fp_1": {0: [0.0, 0.0], 1: [0.5, 0.0], 2: [0.5, 0.5]},
    }
    monkeypatch.setattr(precision, "evaluated_iterations", lambda r: [0, 1, 2])
    monkeypatch.setattr(precision, "task_success", lambda r, its: pl.DataFrame(
        [{"iteration": i, "task_id": t, "success": success[r.name][i][j]} for i in its for j, t in enumerate((9, 7))]))
    r = precision.learning_check([tmp_path / n for n in ("bf_0", "fp_0", "bf_1", "fp_1")], 1, 5.0, tmp_path)
    # seed 0: bf16 (1.0, 0.75) against fp32 (0.75, 0.5) by task -> +25, +25; seed 1: (0.5, 0.5) - (0.5, 0.25) -> 0, +25
    table = pl.read_csv(tmp_path / "precision_learning.csv")
    assert table["diff_points"].to_list()[:2] == [25.0, 12.5] and r["mean"] == pytest.approx(18.75)
    assert "bf16 − fp32, held-out success over iterations 1 on: +18.8 points over 2 seeds" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="give a bf16 and an fp32 run for each seed"):
        precision.learning_check([tmp_path / "bf_0"], 1, 5.0, tmp_path)


def test_the_learning_check_reads_committed_per_task_tables(tmp_path, capsys):
    import polars as pl

    from bench.precision import learning_check

    for name, rates in (("bf.csv", [0.0, 1.0, 1.0, 0.5]), ("fp.csv", [1.0, 1.0, 0.5, 0.5])):
        pl.DataFrame({"iteration": [0, 0, 1, 1], "task_id": [3, 4, 3, 4], "success": rates}).write_csv(tmp_path / name)
    r = learning_check([tmp_path / "bf.csv", tmp_path / "fp.csv"], 1, 5.0, tmp_path)
    assert r["mean"] == pytest.approx(25.0)          # iteration 1 only: (1.0 - 0.5 + 0.5 - 0.5) / 2 in points
    learning_check([tmp_path / "bf.csv", tmp_path / "fp.csv"], 1, 5.0, tmp_path, names=("fp32 update", "bf16 update"))
    assert "fp32 update − bf16 update, held-out success over iterations 1 on: +25.0 points over 1 seeds" \
        in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no evaluation at iteration 2 or later"):
        learning_check([tmp_path / "bf.csv", tmp_path / "fp.csv"], 2, 5.0, tmp_path)
