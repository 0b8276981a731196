"""bench.eval_design: the variance components of a held-out evaluation by hand, their unbiasedness and the design's
standard error by simulation, and its inputs' errors."""

import math

import numpy as np
import polars as pl
import pytest

from bench import eval_design as ed


def test_components_by_hand():
    # 4 tasks x 2 episodes: rates 1, 1/2, 0, 1/2
    sb, sw = ed.components(np.array([1.0, 0.5, 0.0, 0.5]), 2)
    # within: mean(p(1-p)) = (0 + 1/4 + 0 + 1/4) / 4 = 1/8, times k0/(k0-1) = 2 -> 1/4
    assert sw == pytest.approx(0.25)
    # between: var(ddof=1) = (1/4 + 0 + 1/4 + 0) / 3 = 1/6, minus 1/4 / 2 -> 1/24
    assert sb == pytest.approx(1 / 24)
    assert ed.standard_error(sb, sw, 4, 2) == pytest.approx(math.sqrt((1 / 24 + 1 / 8) / 4))
    # clipped at zero where the rates vary less than the episodes' noise alone
    assert ed.components(np.array([0.5, 0.5, 0.5]), 2)[0] == 0.0


def test_paired_components_by_hand():
    a, b = np.array([1.0, 0.5, 0.5, 0.0]), np.array([0.5, 0.5, 0.0, 0.0])
    sbd, sw = ed.paired_components(a, b, 2)
    # within: a's mean(0, 1/4, 1/4, 0) = 1/8 and b's mean(1/4, 1/4, 0, 0) = 1/8, each * 2: 1/4 + 1/4
    assert sw == pytest.approx(0.5)
    # d = 1/2, 0, 1/2, 0: var(ddof=1) = 4 * 1/16 / 3 = 1/12, minus 1/2 / 2 -> negative, clipped
    assert sbd == 0.0
    a, b = np.array([1.0, 1.0, 0.0, 0.0]), np.array([0.0, 0.0, 1.0, 1.0])
    sbd, sw = ed.paired_components(a, b, 2)
    assert sw == 0.0 and sbd == pytest.approx(4 / 3)     # d = 1, 1, -1, -1: var 4/3


def test_components_unbiased_and_design_error_by_simulation():
    """Tasks of a Beta(0.6, 0.4) population: the moment estimates average the true components, and the error they
    predict for 128 x 1 is the spread of 128 x 1 means drawn afresh; 128 x 1 beats 32 x 4."""
    rng = np.random.default_rng(0)
    al, be = 0.6, 0.4
    mu = al / (al + be)
    sb_true = al * be / ((al + be) ** 2 * (al + be + 1))
    sw_true = mu * (1 - mu) - sb_true
    est = []
    for _ in range(4000):
        p = rng.beta(al, be, 32)
        est.append(ed.components(rng.binomial(4, p) / 4, 4))
    est = np.array(est)
    assert est[:, 1].mean() == pytest.approx(sw_true, rel=0.02)
    assert est[:, 0].mean() == pytest.approx(sb_true, rel=0.03)   # clipping at 0 is rare here
    for n, k in ((128, 1), (32, 4)):
        means = [rng.binomial(k, rng.beta(al, be, n)).mean() / k for _ in range(4000)]
        assert np.std(means) == pytest.approx(ed.standard_error(sb_true, sw_true, n, k), rel=0.05)
    assert ed.standard_error(sb_true, sw_true, 128, 1) < 0.7 * ed.standard_error(sb_true, sw_true, 32, 4)
    assert ed.standard_error(sb_true, sw_true, 128, 1) == pytest.approx(math.sqrt(mu * (1 - mu) / 128))


def test_rows_and_cli(tmp_path, capsys):
    rows = [{"iteration": it, "task_id": t, "success": s} for it, rates in ((0, [1.0, 0.5, 0.0, 0.5]),
                                                                          (1, [1.0, 1.0, 0.5, 0.5]))
            for t, s in zip((11, 12, 13, 14), rates)]
    run = tmp_path / "arm" / "task_success.csv"
    run.parent.mkdir()
    pl.DataFrame(rows).write_csv(run)
    ed.main(["--csv", str(run), "--episodes-per-task", "2", "--designs", "4x2", "8x1", "--out", str(tmp_path)])
    out = pl.read_csv(tmp_path / "eval_design.csv")
    assert out["what"].to_list() == ["alone", "alone", "iteration 1 - 0"]
    first = out.row(0, named=True)
    assert first["runs"] == "arm/task_success" and first["mean"] == 0.5
    assert first["se_4x2"] == pytest.approx(round(math.sqrt((1 / 24 + 1 / 8) / 4), 5))
    assert first["ratio_8x1"] == pytest.approx(math.sqrt((1 / 24 + 1 / 4) / 8) / math.sqrt((1 / 24 + 1 / 8) / 4),
                                               abs=1e-4)
    gain = out.row(2, named=True)
    assert gain["mean"] == 0.25            # d = 0, 1/2, 1/2, 0
    assert "standard error against 4x2" in capsys.readouterr().out


def test_bad_inputs(tmp_path):
    with pytest.raises(SystemExit, match="128by1"):
        ed.main(["--csv", "x.csv", "--designs", "128by1"])
    bad = tmp_path / "t.csv"
    pl.DataFrame({"iteration": [0], "task": [1], "success": [1.0]}).write_csv(bad)
    with pytest.raises(SystemExit, match=r"t.csv: columns \['task_id'\] missing"):
        ed.main(["--csv", str(bad), "--episodes-per-task", "4", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--episodes-per-task"):
        ed.main(["--csv", str(bad), "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="at least 2 episodes"):
        ed.components(np.array([0.0, 1.0]), 1)


def test_one_episode_a_task_is_refused_by_name(tmp_path):
    t = tmp_path / "run1" / "task_success.csv"
    t.parent.mkdir()
    pl.DataFrame({"iteration": [0, 0], "task_id": [1, 2], "success": [1.0, 0.0]}).write_csv(t)
    with pytest.raises(SystemExit, match="the components need at least 2 episodes a task"):
        ed.main(["--csv", str(t), "--episodes-per-task", "1", "--out", str(tmp_path)])
