"""Verdicts with their uncertainty: is one method's held-out success really above another's?

    python -m bench.verdicts --name GiGPO --baseline-name GRPO --a 0.695 0.469 0.664 --b 0.516 0.492 0.513
    python -m bench.verdicts --a ... --b ... --scale 100        # per-seed values given in points already
    python -m bench.verdicts --runs RUN                        # each iteration's gain over iteration 0, paired
    python -m bench.verdicts --runs RUN_A RUN_B --name A --baseline-name B   # two runs, paired by task

For two methods run on the same seeds (paired: same initial policy, same held-out tasks), each comparison reports
the paired difference in held-out success (in points, 100 x the success rate) of the final iteration and of the
area under the curve (the mean over iterations 0..T), with

- a 95 % confidence interval from a two-level paired bootstrap: seeds resampled with replacement, and within each
  drawn seed the held-out tasks resampled with replacement, the same tasks for both methods (percentile interval,
  10,000 draws, a fixed generator seed); with per-seed figures only, the seeds alone are resampled;
- an exact paired sign-flip permutation p-value over the seeds (two-sided: the share of the 2^n sign patterns of
  the per-seed differences whose mean is at least as far from 0 as the one observed; with n seeds it cannot be
  below 2 / 2^n, so 3 seeds never give p < 0.05);
- the number of seeds that 80 % power (two-sided, α = 0.05) would need at the observed mean difference and its
  spread over seeds, `ceil(((z_0.975 + z_0.8) · sd / |mean|)²)` (a normal approximation), and never fewer than the
  sign-flip test's own floor of 6 seeds;
- a verdict in words: "established" when p < 0.05 and the interval excludes 0, else "not established".

`bench.learning` and `bench.compare` call `compare_methods` on their runs' evaluation tables; the command line
above re-states a recorded comparison from its per-seed figures.
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np
import polars as pl

from pipeline.data.paths import iterations_with
from pipeline.data.tables import EVAL_EPISODES, read_table

BOOTSTRAP = 10_000
ALPHA = 0.05
POWER = 0.8
MIN_SEEDS = 6           # 2 / 2^6 = 0.031: the fewest seeds whose sign-flip test can reach p < 0.05


@dataclass
class Verdict:
    method: str
    baseline: str
    metric: str           # "final" (held-out success at the last iteration) or "auc" (mean over iterations)
    seeds: int
    tasks: int | None     # held-out tasks per seed (None: per-seed figures only, no task level)
    diff: float           # mean paired difference, points
    ci_low: float
    ci_high: float
    p_value: float
    seeds_for_power: int | None   # None: no difference or no spread to size it by
    verdict: str
    sentence: str


def sign_flip_p(d: np.ndarray) -> float:
    """Exact two-sided paired sign-flip permutation p-value of the mean of `d` (random flips past 20 seeds)."""
    d = np.asarray(d, dtype=np.float64)
    n = len(d)
    observed = abs(d.mean())
    if n <= 20:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))
    else:
        signs = np.random.default_rng(0).choice((1.0, -1.0), size=(200_000, n))
    means = np.abs(signs @ d) / n
    return float(np.mean(means >= observed - 1e-12))


def seeds_for_power(d: np.ndarray, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Seeds a paired test would need for `power` at the observed mean and spread of the per-seed differences `d`
    (normal approximation), at least `MIN_SEEDS`; None when the mean or the spread is 0 or unknown."""
    d = np.asarray(d, dtype=np.float64)
    if len(d) < 2:
        return None
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if mean == 0 or sd == 0:
        return None
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return max(MIN_SEEDS, math.ceil((z * sd / abs(mean)) ** 2))


def bootstrap_interval(per_task: list[np.ndarray], draws: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of the mean over seeds of the mean over tasks, resampling seeds and then, within
    each drawn seed, its tasks (`per_task[s]`: seed s's per-task paired differences; one value per seed resamples
    the seeds alone)."""
    rng = np.random.default_rng(seed)
    n = len(per_task)
    sizes = {len(x) for x in per_task}
    s_idx = rng.integers(0, n, size=(draws, n))
    if sizes == {1}:
        stats = np.array([x[0] for x in per_task])[s_idx].mean(axis=1)
    elif len(sizes) == 1:                                    # one panel of tasks: vectorised
        D = np.stack(per_task)                               # seeds x tasks
        t = D.shape[1]
        t_idx = rng.integers(0, t, size=(draws, n, t))
        stats = D[s_idx[:, :, None], t_idx].mean(axis=2).mean(axis=1)
    else:                                                    # panels of different sizes: seed by seed
        stats = np.array([np.mean([per_task[s][rng.integers(0, len(per_task[s]), len(per_task[s]))].mean()
                                   for s in row]) for row in s_idx])
    lo, hi = np.percentile(stats, [100 * ALPHA / 2, 100 * (1 - ALPHA / 2)])
    return float(lo), float(hi)


def _points(x: float) -> str:
    return f"{x:+.1f}".replace("-", "−")


def verdict(method: str, baseline: str, metric: str, per_task: list[np.ndarray], scale: float = 100.0) -> Verdict:
    """The comparison of `method` against `baseline` on one metric from each seed's per-task paired differences
    (success-rate units; `scale` turns them into points)."""
    per_task = [np.asarray(x, dtype=np.float64) * scale for x in per_task]
    d = np.array([x.mean() for x in per_task])
    lo, hi = bootstrap_interval(per_task)
    p = sign_flip_p(d)
    n_power = seeds_for_power(d)
    established = p < ALPHA and (lo > 0 or hi < 0)
    word = "established" if established else "not established"
    what = "final held-out success" if metric == "final" else "mean held-out success over iterations"
    power = (f"; about {n_power} seeds would give 80 % power at this difference and spread" if n_power and
             not established else "")
    sentence = (f"{method} − {baseline}, {what}: {_points(d.mean())} points [{_points(lo)}, {_points(hi)}], "
                f"{len(d)} seed{'s' * (len(d) != 1)}, p = {p:.2g}: {word}{power}")
    tasks = sorted({len(x) for x in per_task})
    return Verdict(method, baseline, metric, len(d), tasks[0] if len(tasks) == 1 and tasks[0] > 1 else None,
                   float(d.mean()), lo, hi, p, n_power, word, sentence)


def evaluated_iterations(results: Path) -> list[int]:
    """The iterations of a run's folder that have a held-out evaluation (`iter_<i>/eval.parquet`), in order."""
    return iterations_with(results, "eval.parquet")


def task_success(results: Path, iterations: list[int] | None = None) -> pl.DataFrame:
    """Held-out success per task and iteration of a run (`iter_<i>/eval.parquet`; every evaluated iteration by
    default): columns iteration, task_id, success (the task's success rate over its episodes)."""
    if iterations is None:
        iterations = evaluated_iterations(results)
    frames = [read_table(results / f"iter_{it}" / "eval.parquet", EVAL_EPISODES)
              .group_by("task_id").agg(pl.col("success").cast(pl.Float64).mean())
              .with_columns(pl.lit(it).alias("iteration")) for it in iterations]
    return pl.concat(frames).select("iteration", "task_id", "success")


def compare_methods(tables: dict[tuple[str, int], pl.DataFrame], baseline: str) -> tuple[list[Verdict], str]:
    """Every method against `baseline` on the seeds both ran, from each run's `task_success` table (keyed by
    (method, seed)); returns the verdicts and a sentence on the held-out panel they were paired on.

    The runs are paired on the iterations and the held-out tasks they all evaluated: a task enters when every run
    played it at every one of those iterations."""
    if not tables:
        return [], ""
    iterations = sorted(set.intersection(*(set(t["iteration"].to_list()) for t in tables.values())))
    task_sets = [set(t.filter(pl.col("iteration") == it)["task_id"].to_list()) for t in tables.values()
                 for it in iterations]
    common = sorted(set.intersection(*task_sets))
    same = all(s == task_sets[0] for s in task_sets)
    panel = (f"Paired on the same {len(common)} held-out tasks for every method and seed, at iterations "
             f"{iterations[0]}-{iterations[-1]}." if same else
             f"Paired on the {len(common)} held-out tasks every run played (the runs' panels differ), at iterations "
             f"{iterations[0]}-{iterations[-1]}.")
    matrices = {}
    for key, t in tables.items():
        wide = (t.filter(pl.col("iteration").is_in(iterations), pl.col("task_id").is_in(common))
                .pivot(on="task_id", index="iteration", values="success").sort("iteration"))
        matrices[key] = wide.select([str(c) for c in common]).to_numpy()     # iterations x tasks
    out = []
    methods = list(dict.fromkeys(m for m, _ in tables))
    for m in methods:
        if m == baseline:
            continue
        seeds = sorted(s for mm, s in tables if mm == m and (baseline, s) in tables)
        if not seeds:
            continue
        final = [matrices[(m, s)][-1] - matrices[(baseline, s)][-1] for s in seeds]
        auc = [matrices[(m, s)].mean(axis=0) - matrices[(baseline, s)].mean(axis=0) for s in seeds]
        out += [verdict(m, baseline, "final", final), verdict(m, baseline, "auc", auc)]
    return out, panel


def paired_by_iteration(a: pl.DataFrame, b: pl.DataFrame | None = None) -> pl.DataFrame:
    """Run `a` against run `b` at every iteration both evaluated (two `task_success` tables; `b` None: `a` against
    its own iteration 0, the gain of training), paired by held-out task: columns iteration, tasks, a, b (their mean
    success on the tasks both played), diff (points) and ci_low, ci_high (the 95 % bootstrap interval over the
    tasks, `bootstrap_interval`, tasks in order of their id so a rerun draws the same resamples)."""
    ours = set(a["iteration"].to_list())
    if b is None:                       # each iteration against iteration 0 of the same run
        b, iterations, against = a, sorted(ours - {0}) if 0 in ours else [], lambda it: 0
    else:
        iterations, against = sorted(ours & set(b["iteration"].to_list())), lambda it: it
    rows = []
    for it in iterations:
        j = (a.filter(pl.col("iteration") == it).select("task_id", "success")
             .join(b.filter(pl.col("iteration") == against(it)).select("task_id", "success"), on="task_id",
                   suffix="_b").sort("task_id"))
        d = ((j["success"] - j["success_b"]).to_numpy() * 100.0)
        lo, hi = bootstrap_interval([d]) if len(d) else (float("nan"), float("nan"))
        rows.append({"iteration": it, "tasks": j.height, "a": j["success"].mean(), "b": j["success_b"].mean(),
                     "diff": float(d.mean()) if len(d) else float("nan"), "ci_low": lo, "ci_high": hi})
    return pl.DataFrame(rows, schema={"iteration": pl.Int64, "tasks": pl.Int64, "a": pl.Float64, "b": pl.Float64,
                                      "diff": pl.Float64, "ci_low": pl.Float64, "ci_high": pl.Float64})


def verdict_frame(verdicts: list[Verdict]) -> pl.DataFrame:
    return pl.DataFrame([asdict(v) for v in verdicts], schema_overrides={"tasks": pl.Int64, "seeds_for_power":
                                                                         pl.Int64})


def _runs(args) -> None:
    """--runs A [B]: the paired table per iteration, then (with B) the final and mean-over-iterations verdicts."""
    for r in args.runs:
        if not evaluated_iterations(Path(r)):
            raise SystemExit(f"error: {r}: no iter_<i>/eval.parquet; give a run's results folder that has "
                             "held-out evaluations")
    a, b = [task_success(Path(r)) for r in args.runs] + [None] * (2 - len(args.runs))
    table = paired_by_iteration(a, b)
    if not table.height:
        raise SystemExit(f"error: {args.runs[0]}: no evaluated iteration to pair" +
                         (f" with {args.runs[1]}" if b is not None else " with its iteration 0"))
    other = args.baseline_name if b is not None else "iteration 0"
    print(f"{args.name} − {other}, held-out success paired by task (points, 95 % bootstrap interval over tasks):")
    for r in table.iter_rows(named=True):
        print(f"  iteration {r['iteration']}: {r['a']:.3f} against {r['b']:.3f}, {_points(r['diff'])} "
              f"[{_points(r['ci_low'])}, {_points(r['ci_high'])}] on {r['tasks']} tasks")
    if b is not None:
        verdicts, panel = compare_methods({(args.name, 0): a, (args.baseline_name, 0): b}, args.baseline_name)
        print(panel)
        for v in verdicts:
            print(v.sentence)
    if args.out:
        table.write_csv(args.out)
        print(f"wrote {args.out}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=float, nargs="+", help="the method's per-seed figures")
    ap.add_argument("--b", type=float, nargs="+", help="the baseline's, on the same seeds, in order")
    ap.add_argument("--runs", nargs="+", metavar="RUN", help="one run's results folder (its gain over iteration 0) "
                    "or two (the first against the second), paired by held-out task at every iteration")
    ap.add_argument("--out", help="with --runs: write the per-iteration table to this CSV file")
    ap.add_argument("--name", default="method")
    ap.add_argument("--baseline-name", default="baseline")
    ap.add_argument("--metric", default="final", choices=("final", "auc"))
    ap.add_argument("--scale", type=float, default=100.0, help="points per unit of the figures (100: rates)")
    args = ap.parse_args(argv)
    if args.runs:
        if len(args.runs) > 2:
            raise SystemExit(f"error: --runs takes one or two results folders, not {len(args.runs)}")
        return _runs(args)
    if not args.a or not args.b:
        raise SystemExit("error: give --a and --b (per-seed figures), or --runs (results folders)")
    if len(args.a) != len(args.b):
        raise SystemExit(f"error: --a has {len(args.a)} seeds and --b {len(args.b)}; give one figure per seed to each")
    v = verdict(args.name, args.baseline_name, args.metric,
                [np.array([a - b]) for a, b in zip(args.a, args.b)], args.scale)
    print(v.sentence)


if __name__ == "__main__":
    main()
