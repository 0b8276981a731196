"""Benchmark: how precise a held-out evaluation is for its cost, tasks x episodes, from evaluations already made.

    python -m bench.eval_design --runs RUN/results ... --csv TABLE.csv ... --episodes-per-task 4 \
        --designs 32x4 64x2 128x1 --out OUT

A held-out success rate averages n tasks x k sampled episodes. Task i succeeds with probability p_i; the tasks of a
panel are a draw from the environment's tasks (between-task variance sigma_b^2) and an episode is a Bernoulli draw
of its task's p_i (within-task variance sigma_w^2 = E[p_i (1 - p_i)]). The mean's standard error is then

    SE(n, k) = sqrt((sigma_b^2 + sigma_w^2 / k) / n),

and since sigma_b^2 + sigma_w^2 = mu (1 - mu) for Bernoulli outcomes, SE(n, 1) is the binomial sqrt(mu (1 - mu) / n):
at equal episodes n k, more tasks are never worse, and strictly better wherever tasks differ (sigma_b^2 > 0).
Both components are estimated by moments from a table of k0 episodes a task (`components`):
sigma_w^2 = mean(p^_i (1 - p^_i)) k0 / (k0 - 1) (unbiased: E[p^ (1 - p^) | p] = p (1 - p) (1 - 1/k0)) and
sigma_b^2 = max(0, var(p^_i) - sigma_w^2 / k0). A comparison of two evaluations of one panel (iteration t against
iteration 0 of a run, or two arms at one iteration: what `bench.verdicts` pairs by task) has the same form with the
per-task differences d_i: var(d^_i) = sigma_bd^2 + (sigma_wA^2 + sigma_wB^2) / k0.

Inputs: run results folders (`--runs`: every `iter_<i>/eval.parquet`, k0 read from the table) and per-task tables
(`--csv`: columns iteration, task_id, success, as `bench.verdicts.task_success` writes them, k0 given by
`--episodes-per-task`). Every evaluated iteration is scored alone and against the run's iteration 0; `--pair A B`
(labels: a run folder's name, or its parent's where it is `results`; a table's parent folder/stem) scores two runs
iteration by iteration. Writes `OUT/eval_design.csv` (one row per evaluation or pair: the components and the
standard error of each design, and its ratio to the first design) and prints the medians.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import polars as pl

from bench.verdicts import task_success
from pipeline.data.tables import EVAL_EPISODES, read_table, write_text_atomic


def components(p_hat: np.ndarray, k0: int) -> tuple[float, float]:
    """(sigma_b^2, sigma_w^2) by moments from per-task success rates `p_hat` over `k0` episodes a task."""
    if k0 < 2:
        raise ValueError(f"the within-task variance needs at least 2 episodes a task, got {k0}")
    if len(p_hat) < 2:
        raise ValueError(f"the between-task variance needs at least 2 tasks, got {len(p_hat)}")
    sw = float(np.mean(p_hat * (1 - p_hat))) * k0 / (k0 - 1)
    sb = max(0.0, float(np.var(p_hat, ddof=1)) - sw / k0)
    return sb, sw


def paired_components(a: np.ndarray, b: np.ndarray, k0: int) -> tuple[float, float]:
    """(sigma_bd^2, sigma_wA^2 + sigma_wB^2) of the per-task differences a - b of two evaluations of one panel."""
    swa, swb = (float(np.mean(x * (1 - x))) * k0 / (k0 - 1) for x in (a, b))
    sbd = max(0.0, float(np.var(a - b, ddof=1)) - (swa + swb) / k0)
    return sbd, swa + swb


def standard_error(sb: float, sw: float, n: int, k: int) -> float:
    """The standard error of a mean over n tasks x k episodes with these variance components."""
    return math.sqrt((sb + sw / k) / n)


def parse_design(text: str) -> tuple[int, int]:
    try:
        n, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--designs: {text!r} is not TASKSxEPISODES (e.g. 128x1)") from None
    if n < 1 or k < 1:
        raise SystemExit(f"--designs: {text!r} needs at least 1 task and 1 episode")
    return n, k


def _label(path: Path) -> str:
    """A run folder's name (its parent's where it is `results`); a table's parent folder and stem."""
    if path.is_dir():
        return path.parent.name if path.name == "results" else path.name
    return f"{path.parent.name}/{path.stem}"


def load(runs: list[Path], csvs: list[Path], k_csv: int | None) -> dict[str, tuple[pl.DataFrame, int]]:
    """Each input's per-task table (iteration, task_id, success) and its episodes a task."""
    out: dict[str, tuple[pl.DataFrame, int]] = {}
    for r in runs:
        if not r.is_dir():
            raise SystemExit(f"--runs: {r} is not a run's results folder")
        ts = task_success(r)
        first = min(ts["iteration"].to_list())
        counts = (read_table(r / f"iter_{first}" / "eval.parquet", EVAL_EPISODES)
                  .group_by("task_id").len()["len"].unique().to_list())
        if len(counts) != 1:
            raise SystemExit(f"{r}/iter_{first}/eval.parquet: tasks have different numbers of episodes {counts}")
        out[_label(r)] = (ts, int(counts[0]))
    for c in csvs:
        if k_csv is None:
            raise SystemExit(f"--csv {c}: give its episodes a task with --episodes-per-task")
        ts = pl.read_csv(c)
        missing = {"iteration", "task_id", "success"} - set(ts.columns)
        if missing:
            raise SystemExit(f"--csv {c}: columns {sorted(missing)} missing; expected iteration, task_id, success")
        out[_label(c)] = (ts, k_csv)
    for label, (_, k0) in out.items():
        if k0 < 2:
            raise SystemExit(f"{label}: {k0} episode a task (a CSV's from --episodes-per-task); the components need "
                             "at least 2 episodes a task to tell the tasks' spread from the episodes' (an evaluation "
                             "of 32 x 4 or 64 x 2, say)")
    return out


def _rates(ts: pl.DataFrame, it: int) -> tuple[list[int], np.ndarray]:
    rows = ts.filter(pl.col("iteration") == it).sort("task_id")
    return rows["task_id"].to_list(), rows["success"].to_numpy().astype(np.float64)


def rows_for(label: str, ts: pl.DataFrame, k0: int, designs: list[tuple[int, int]],
             other: tuple[str, pl.DataFrame] | None = None) -> list[dict]:
    """One row per evaluated iteration: alone and against iteration 0 (or, with `other`, against that run's
    evaluation of the same iteration)."""
    rows = []
    its = sorted(set(ts["iteration"].to_list()))
    for it in its:
        tasks, a = _rates(ts, it)
        comparisons = []
        if other is None:
            comparisons.append(("alone", label, components(a, k0), float(a.mean())))
            if it != its[0]:
                t0, b = _rates(ts, its[0])
                if t0 == tasks:
                    comparisons.append((f"iteration {it} - {its[0]}", label, paired_components(a, b, k0),
                                        float((a - b).mean())))
        else:
            name, ots = other
            t1, b = _rates(ots, it)
            if t1 != tasks or not len(b):
                continue
            comparisons.append((f"{label} - {name}", f"{label} | {name}", paired_components(a, b, k0),
                                float((a - b).mean())))
        for what, runs, (sb, sw), mean in comparisons:
            ses = [standard_error(sb, sw, n, k) for n, k in designs]
            row = {"runs": runs, "iteration": it, "what": what, "tasks": len(tasks), "episodes_per_task": k0,
                   "mean": round(mean, 4), "sigma_b2": round(sb, 5), "sigma_w2": round(sw, 5)}
            for (n, k), se in zip(designs, ses):
                row[f"se_{n}x{k}"] = round(se, 5)
            for (n, k), se in zip(designs[1:], ses[1:]):
                row[f"ratio_{n}x{k}"] = round(se / ses[0], 4) if ses[0] > 0 else None
            rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.eval_design", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, nargs="*", default=[])
    ap.add_argument("--csv", type=Path, nargs="*", default=[])
    ap.add_argument("--episodes-per-task", type=int, default=None, help="k0 of the --csv tables")
    ap.add_argument("--designs", nargs="+", default=["32x4", "64x2", "128x1"])
    ap.add_argument("--pair", nargs=2, action="append", default=[], metavar=("A", "B"))
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    a = ap.parse_args(argv)
    designs = [parse_design(d) for d in a.designs]
    tables = load(a.runs, a.csv, a.episodes_per_task)
    if not tables:
        raise SystemExit("nothing to score: give --runs or --csv")
    rows = []
    for label, (ts, k0) in tables.items():
        rows += rows_for(label, ts, k0, designs)
    for x, y in a.pair:
        for name in (x, y):
            if name not in tables:
                raise SystemExit(f"--pair: no input labelled {name!r}; the inputs are {sorted(tables)}")
        if tables[x][1] != tables[y][1]:
            raise SystemExit(f"--pair {x} {y}: {tables[x][1]} against {tables[y][1]} episodes a task")
        rows += rows_for(x, tables[x][0], tables[x][1], designs, other=(y, tables[y][0]))
    df = pl.DataFrame(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(a.out / "eval_design.csv", df.write_csv())
    ratios = [c for c in df.columns if c.startswith("ratio_")]
    first = f"{designs[0][0]}x{designs[0][1]}"
    for kind, sub in (("one evaluation", df.filter(pl.col("what") == "alone")),
                      ("a paired difference", df.filter(pl.col("what") != "alone"))):
        if sub.height:
            med = ", ".join(f"{c[6:]} {sub[c].drop_nulls().median():.3f} (range {sub[c].drop_nulls().min():.3f}-"
                            f"{sub[c].drop_nulls().max():.3f})" for c in ratios)
            print(f"{kind} ({sub.height} rows): standard error against {first}, median: {med}")
    print(f"wrote {a.out / 'eval_design.csv'}")


if __name__ == "__main__":
    main()
