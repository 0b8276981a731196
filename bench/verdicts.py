"""Verdicts with their uncertainty: is one method's held-out success above another's, below it, or equivalent?

    python -m bench.verdicts --name GiGPO --baseline-name GRPO --a 0.695 0.469 0.664 --b 0.516 0.492 0.513
    python -m bench.verdicts --a ... --b ... --scale 100        # per-seed values given in points already
    python -m bench.verdicts --runs RUN                        # each iteration's gain over iteration 0, paired
    python -m bench.verdicts --runs RUN_A RUN_B --name A --baseline-name B   # two runs, paired by task

Two methods run on the same seeds (paired: the same initial policy, through `run.base`) and evaluated on the same
held-out tasks (tasks and seeds crossed: every seed plays the one panel) are compared on a metric of held-out
success, in points (100 x the success rate): `final`, the last iteration both runs of a seed evaluated, and `auc`,
the mean over the iterations the two arms do not share (those whose evaluations are identical, as a shared
`run.base` makes iteration 0, are left out: they are the same numbers twice), each evaluation standing for the
iterations since the previous one (uneven `evaluate.every`). Per comparison (docs/statistics.md):

- **Interval** (95 %): with n >= 2 seeds, a t-interval (n - 1 degrees of freedom) of the mean paired difference
  whose standard error adds the spread over seeds (s^2 / n, each seed's mean over the tasks) and the panel's
  (v / T: the variance over the T tasks of each task's difference averaged over seeds), the panel being one draw
  of tasks shared by every seed; with one seed and a task panel, the panel's term alone, said to cover "held-out
  tasks only; excludes run-to-run variation"; with one per-seed figure, none.
- **p**: the exact paired sign-flip permutation p-value over seeds (two-sided: the share of the 2^n sign patterns
  of the per-seed differences whose mean is at least as far from 0; above 20 seeds 200,000 random patterns, with
  the (1 + count) / (1 + B) correction). With n seeds it cannot go below 2 / 2^n (6 seeds for p < 0.05).
- **Primary metric and Holm**: one metric is primary (`auc` by default); the primary comparisons of several arms
  against one baseline are one family, the secondary ones another, each Holm-corrected (`p_adjusted`).
- **Equivalence** within +-`delta` points (5 by default): two one-sided sign-flip tests at 0.05 (the differences
  shifted by +-delta) and the 90 % interval inside +-delta. A one-sided sign-flip p cannot go below 1 / 2^n, so
  equivalence needs at least 5 seeds.
- **Verdict**: *better* or *worse* (adjusted p < 0.05 and the 95 % interval excludes 0), *equivalent within
  +-delta*, or *undecided*, with the seeds a simulation of the sign-flip test itself (not a normal formula) expects
  80 % power to need at the observed mean and spread (an estimate, the cheaper of deciding a difference or an
  equivalence).

`bench.learning`, `bench.compare` and `bench.branching` call `compare_methods` on their runs' evaluation tables;
the command line above re-states a recorded comparison from its per-seed figures.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
from scipy import stats as sstats

from pipeline.data.paths import iterations_with
from pipeline.data.tables import EVAL_EPISODES, read_table

BOOTSTRAP = 10_000
ALPHA = 0.05
POWER = 0.8
DELTA = 5.0             # the equivalence margin, points
MIN_SEEDS = 6           # 2 / 2^6 = 0.031: the fewest seeds whose two-sided sign-flip test can reach p < 0.05
MIN_SEEDS_EQUIVALENCE = 5   # 1 / 2^5 = 0.031: the fewest whose one-sided tests can
EXACT_UP_TO = 20        # seeds whose 2^n sign patterns are enumerated; above, random patterns
RANDOM_PATTERNS = 200_000
MAX_SEEDS = 200         # the power search gives up beyond


@dataclass
class Verdict:
    method: str
    baseline: str
    metric: str           # "final" (the last iteration both runs evaluated) or "auc" (mean over unshared ones)
    seeds: int
    tasks: int | None     # held-out tasks per seed (None: per-seed figures only, no task level)
    diff: float           # mean paired difference, points
    ci_low: float         # 95 % interval (nan: none, one per-seed figure)
    ci_high: float
    p_value: float        # two-sided sign-flip
    verdict: str          # better, worse, equivalent, undecided
    sentence: str
    primary: bool = True
    p_adjusted: float = float("nan")    # Holm within the comparison's family (primary or secondary)
    delta: float = DELTA
    p_equivalence: float = float("nan")     # the larger of the two one-sided p-values (nan: fewer than 5 seeds)
    ci90_low: float = float("nan")
    ci90_high: float = float("nan")
    seeds_for_power: int | None = None      # seeds expected to decide (simulated); None: nothing to size it by
    interval: str = ""    # what the interval covers
    iterations: str = ""  # the iterations the metric read
    notes: list[str] = field(default_factory=list)


@functools.lru_cache(maxsize=20)
def _cached_patterns(n: int) -> np.ndarray:
    return np.array(list(itertools.product((1.0, -1.0), repeat=n)))


def sign_patterns(n: int) -> np.ndarray:
    """All 2^n sign patterns of n values, [2^n, n] (kept for n <= 16: at most 8 MiB each)."""
    if n <= 16:
        return _cached_patterns(n)
    return np.array(list(itertools.product((1.0, -1.0), repeat=n)))


def sign_flip_p(d: np.ndarray, alternative: str = "two-sided") -> float:
    """Exact paired sign-flip permutation p-value of the mean of `d`: two-sided (|mean| at least as far from 0),
    `greater` (mean at least as large) or `less`; above `EXACT_UP_TO` values, `RANDOM_PATTERNS` random patterns
    with the (1 + count) / (1 + B) correction, so that p is never 0."""
    d = np.asarray(d, dtype=np.float64)
    n = len(d)
    if n == 0:
        return 1.0
    observed = d.mean()
    signs = sign_patterns(n) if n <= EXACT_UP_TO else np.random.default_rng(0).choice((1.0, -1.0),
                                                                                      size=(RANDOM_PATTERNS, n))
    means = signs @ d / n
    eps = 1e-12 * max(1.0, float(np.abs(d).max()))
    if alternative == "two-sided":
        hits = np.abs(means) >= abs(observed) - eps
    elif alternative == "greater":
        hits = means >= observed - eps
    elif alternative == "less":
        hits = means <= observed + eps
    else:
        raise ValueError(f"alternative {alternative!r}; expected two-sided, greater or less")
    if n <= EXACT_UP_TO:
        return float(hits.mean())
    return float((1 + hits.sum()) / (1 + len(hits)))


def equivalence_p(d: np.ndarray, delta: float) -> float:
    """Two one-sided sign-flip tests of |mean| < `delta`: H0 mean <= -delta (on d + delta, `greater`) and H0 mean
    >= delta (on d - delta, `less`); the larger p-value (equivalence at level alpha when it is below alpha)."""
    d = np.asarray(d, dtype=np.float64)
    return max(sign_flip_p(d + delta, "greater"), sign_flip_p(d - delta, "less"))


def holm(p: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given."""
    order = sorted(range(len(p)), key=lambda i: p[i])
    out, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        out[i] = running
    return out


def standard_error(per_task: list[np.ndarray]) -> tuple[float, int | None, str]:
    """(standard error of the mean paired difference, degrees of freedom, what it covers) from each seed's per-task
    differences on one shared panel: s^2 / n over the seeds' means plus v / T over the tasks' means across seeds
    (the panel is one draw of tasks that every seed shares; the task-by-seed noise enters both terms, which errs
    wide). One seed: the panel's term alone, T - 1 degrees of freedom. One figure in all: nan."""
    n = len(per_task)
    tasks = {len(x) for x in per_task}
    means = np.array([x.mean() for x in per_task])
    panel = 0.0
    if len(tasks) == 1 and tasks != {1}:
        t = tasks.pop()
        by_task = np.stack(per_task).mean(axis=0)
        panel = float(by_task.var(ddof=1)) / t
        if n == 1:
            return math.sqrt(panel), t - 1, "over held-out tasks only; excludes run-to-run variation"
    elif n == 1:
        return float("nan"), None, "none: one figure"
    seeds = float(means.var(ddof=1)) / n
    covers = "t over seeds" + (" and the task panel" if panel else "")
    return math.sqrt(seeds + panel), n - 1, covers


def interval(mean: float, se: float, df: int | None, level: float) -> tuple[float, float]:
    if df is None or not math.isfinite(se):
        return float("nan"), float("nan")
    if se == 0:
        return mean, mean
    h = float(sstats.t.ppf(1 - (1 - level) / 2, df)) * se
    return mean - h, mean + h


def simulated_power(mean: float, sd: float, n: int, test: str, delta: float = DELTA, sims: int = 400,
                    seed: int = 0) -> float:
    """The share of `sims` simulated experiments of `n` seeds, per-seed differences normal with this `mean` and
    `sd`, in which the sign-flip `test` ("difference": two-sided p < alpha; "equivalence": both one-sided p <
    alpha) decides; patterns enumerated up to 12 seeds, else 2,000 random ones a simulation."""
    rng = np.random.default_rng(seed)
    d = rng.normal(mean, sd, size=(sims, n))
    if n <= 12:
        signs = sign_patterns(n)
        correction = 0
    else:
        signs = rng.choice((1.0, -1.0), size=(2_000, n))
        correction = 1

    def p_of(x: np.ndarray, alternative: str) -> np.ndarray:
        means = x @ signs.T / n                      # sims x patterns
        obs = x.mean(axis=1, keepdims=True)
        if alternative == "two-sided":
            hits = (np.abs(means) >= np.abs(obs) - 1e-12).sum(axis=1)
        elif alternative == "greater":
            hits = (means >= obs - 1e-12).sum(axis=1)
        else:
            hits = (means <= obs + 1e-12).sum(axis=1)
        return (hits + correction) / (len(signs) + correction)

    if test == "difference":
        return float((p_of(d, "two-sided") < ALPHA).mean())
    both = np.maximum(p_of(d + delta, "greater"), p_of(d - delta, "less"))
    return float((both < ALPHA).mean())


def seeds_to_decide(d: np.ndarray, delta: float = DELTA, power: float = POWER) -> int | None:
    """The fewest seeds at which a simulation of the sign-flip tests expects `power` to decide (a difference, or
    an equivalence within +-`delta`, whichever is reached first), at the observed mean and spread of the per-seed
    differences `d`; None without a spread (fewer than 2 seeds, or none) or beyond `MAX_SEEDS`. An estimate."""
    d = np.asarray(d, dtype=np.float64)
    if len(d) < 2 or float(d.std(ddof=1)) == 0:
        return None
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    best = None
    for test, floor in (("difference", MIN_SEEDS), ("equivalence", MIN_SEEDS_EQUIVALENCE)):
        lo, hi = floor, floor
        while simulated_power(mean, sd, hi, test, delta) < power:      # doubling, then bisection
            lo = hi + 1
            hi *= 2
            if hi > MAX_SEEDS:
                hi = None
                break
        if hi is None:
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if simulated_power(mean, sd, mid, test, delta) >= power:
                hi = mid
            else:
                lo = mid + 1
        best = hi if best is None else min(best, hi)
    return best


def bootstrap_interval(differences: np.ndarray, draws: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of the mean of one run pair's per-task differences, the tasks resampled (the
    per-iteration tables of `paired_by_iteration`: one seed, so over held-out tasks only)."""
    d = np.asarray(differences, dtype=np.float64)
    rng = np.random.default_rng(seed)
    stats = d[rng.integers(0, len(d), size=(draws, len(d)))].mean(axis=1)
    lo, hi = np.percentile(stats, [100 * ALPHA / 2, 100 * (1 - ALPHA / 2)])
    return float(lo), float(hi)


def _points(x: float) -> str:
    return f"{x:+.1f}".replace("-", "−")


WHAT = {"final": "final held-out success", "auc": "mean held-out success over the iterations"}


def verdict(method: str, baseline: str, metric: str, per_task: list[np.ndarray], scale: float = 100.0,
            delta: float = DELTA, p_adjusted: float | None = None, primary: bool = True,
            iterations: str = "") -> Verdict:
    """The comparison of `method` against `baseline` on one metric from each seed's per-task paired differences
    (success-rate units; `scale` turns them into points); `p_adjusted`: the p-value after the family's correction
    (`compare_methods`; default the comparison's own)."""
    per_task = [np.asarray(x, dtype=np.float64) * scale for x in per_task]
    d = np.array([x.mean() for x in per_task])
    n, mean = len(d), float(d.mean())
    se, df, covers = standard_error(per_task)
    lo, hi = interval(mean, se, df, 0.95)
    lo90, hi90 = interval(mean, se, df, 0.90)
    p = sign_flip_p(d)
    p_adj = p if p_adjusted is None else p_adjusted
    p_eq = equivalence_p(d, delta) if n >= MIN_SEEDS_EQUIVALENCE else float("nan")
    if p_adj < ALPHA and lo > 0:
        word = "better"
    elif p_adj < ALPHA and hi < 0:
        word = "worse"
    elif n >= MIN_SEEDS_EQUIVALENCE and p_eq < ALPHA and -delta < lo90 and hi90 < delta:
        word = "equivalent"
    else:
        word = "undecided"
    need = seeds_to_decide(d, delta) if word == "undecided" else None
    ci = f"[{_points(lo)}, {_points(hi)}]" if math.isfinite(lo) else "(no interval from one figure)"
    adj = f", Holm {p_adj:.2g}" if p_adjusted is not None and p_adj != p else ""
    head = (f"{method} − {baseline}, {WHAT[metric]}{' (primary)' if primary else ''}: {_points(mean)} points {ci}, "
            f"{n} seed{'s' * (n != 1)}, p = {p:.2g}{adj}")
    if word in ("better", "worse"):
        tail = f": {word}"
    elif word == "equivalent":
        tail = f": equivalent within ±{delta:g} points (90 % interval [{_points(lo90)}, {_points(hi90)}])"
    else:
        k = max(need - n, 1) if need else 0
        more = f"; about {k} more seed{'s' * (k != 1)} expected to decide (simulated, an estimate)" if need else ""
        tail = f": undecided{more}"
    if n == 1 and math.isfinite(lo):
        tail += f" (interval {covers})"
    tasks = sorted({len(x) for x in per_task})
    return Verdict(method, baseline, metric, n, tasks[0] if len(tasks) == 1 and tasks[0] > 1 else None, mean, lo, hi,
                   p, word, head + tail, primary, p_adj, delta, p_eq, lo90, hi90, need, covers, iterations)


def evaluated_iterations(results: Path) -> list[int]:
    """The iterations of a run's folder that have a held-out evaluation (`iter_<i>/eval.parquet`), in order."""
    return iterations_with(results, "eval.parquet")


def task_success(results: Path, iterations: list[int] | None = None) -> pl.DataFrame:
    """Held-out success per task and iteration of a run (`iter_<i>/eval.parquet`; every evaluated iteration by
    default): columns iteration, task_id, success (the task's success rate over its episodes), sorted by iteration
    and task, so that a table written from it is the same file each time."""
    if iterations is None:
        iterations = evaluated_iterations(results)
    frames = [read_table(results / f"iter_{it}" / "eval.parquet", EVAL_EPISODES)
              .group_by("task_id").agg(pl.col("success").cast(pl.Float64).mean())
              .with_columns(pl.lit(it).alias("iteration")) for it in iterations]
    return pl.concat(frames).select("iteration", "task_id", "success").sort("iteration", "task_id")


def shared_iterations(a: np.ndarray, b: np.ndarray, iterations: list[int]) -> int:
    """How many of the first `iterations` two runs share: the longest prefix at which their per-task evaluations
    (`a`, `b`: iterations x tasks) are identical, as a shared `run.base` makes them."""
    k = 0
    while k < len(iterations) and np.array_equal(a[k], b[k]):
        k += 1
    return k


def auc_weights(iterations: list[int], shared: int) -> np.ndarray:
    """The weight of each evaluated iteration after the `shared` ones in the mean over iterations: the iterations
    since the previous evaluation (the last shared one, else the gap to the next evaluation; 1 for a lone one),
    normalised: equal weights where evaluations are evenly spaced, more to an evaluation that stands for more
    iterations where they are not."""
    its = iterations[shared:]
    if not its:
        return np.zeros(0)
    prev = iterations[shared - 1] if shared else (its[0] - (its[1] - its[0]) if len(its) > 1 else its[0] - 1)
    w = np.diff(np.array([prev, *its], dtype=np.float64))
    return w / w.sum()


def seed_pair(ma: np.ndarray, mb: np.ndarray, its: list[int]) -> tuple[np.ndarray, np.ndarray, str]:
    """One seed's per-task differences of two runs (`ma`, `mb`: iterations `its` x tasks): at the last iteration
    (final) and over the iterations they do not share (auc, `auc_weights`), and which iterations those are."""
    k = min(shared_iterations(ma, mb, its), len(its) - 1)   # identical throughout: the last one (difference 0)
    w = auc_weights(its, k)
    span = f"{its[k]}-{its[-1]}" if its[k] != its[-1] else f"{its[-1]}"
    return ma[-1] - mb[-1], w @ ma[k:] - w @ mb[k:], span


def compare_methods(tables: dict[tuple[str, int], pl.DataFrame], baseline: str, primary: str = "auc",
                    delta: float = DELTA, reverse: bool = False) -> tuple[list[Verdict], str]:
    """Every method against `baseline` on the seeds both ran, from each run's `task_success` table (keyed by
    (method, seed)); returns the verdicts (a final and a mean-over-iterations one per method, `primary` the
    primary metric, each family Holm-corrected) and a sentence on the panel they were paired on, with a warning
    for every seed whose final iteration is not one of its runs' last, or that shares no evaluated iteration.
    `reverse`: each verdict reads `baseline` − method (one method compared with several others).

    A task enters the panel when every run played it at every iteration it evaluated; each seed's pair is read at
    the iterations both of its runs evaluated."""
    if not tables:
        return [], ""
    if primary not in WHAT:
        raise ValueError(f"primary metric {primary!r}; expected one of {', '.join(WHAT)}")
    task_sets = [set(t.filter(pl.col("iteration") == it)["task_id"].to_list()) for t in tables.values()
                 for it in t["iteration"].unique().to_list()]
    common = sorted(set.intersection(*task_sets))
    same = all(s == task_sets[0] for s in task_sets)
    panel = (f"Paired on the same {len(common)} held-out tasks for every method and seed." if same else
             f"Paired on the {len(common)} held-out tasks every run played (the runs' panels differ).")
    warnings: list[str] = []
    if not common:
        return [], panel + " No task is common to every run: nothing to compare."

    def matrix(t: pl.DataFrame, its: list[int]) -> np.ndarray:
        wide = (t.filter(pl.col("iteration").is_in(its), pl.col("task_id").is_in(common))
                .pivot(on="task_id", index="iteration", values="success").sort("iteration"))
        return wide.select([str(c) for c in common]).to_numpy()     # iterations x tasks

    found: list[tuple[str, str, list[np.ndarray], str]] = []
    for m in dict.fromkeys(m for m, _ in tables):
        if m == baseline:
            continue
        final, auc, finals, spans = [], [], set(), set()
        for s in sorted(s for mm, s in tables if mm == m and (baseline, s) in tables):
            a, b = tables[(m, s)], tables[(baseline, s)]
            its = sorted(set(a["iteration"].to_list()) & set(b["iteration"].to_list()))
            if not its:
                warnings.append(f"{m} and {baseline} share no evaluated iteration on seed {s}: left out.")
                continue
            last = {max(a["iteration"].to_list()), max(b["iteration"].to_list())}
            if last != {its[-1]}:
                warnings.append(f"seed {s}: {m} against {baseline} is final at iteration {its[-1]}, the last both "
                                f"evaluated; the runs end at {' and '.join(map(str, sorted(last)))}.")
            if reverse:
                a, b = b, a
            f, u, span = seed_pair(matrix(a, its), matrix(b, its), its)
            final.append(f)
            auc.append(u)
            finals.add(its[-1])
            spans.add(span)
        if final:
            found.append((m, "final", final, "iteration " + ", ".join(map(str, sorted(finals)))))
            found.append((m, "auc", auc, "iterations " + ", ".join(sorted(spans))))
    out = []
    for fam in (True, False):                       # the primary family, then the secondary one
        rows = [f for f in found if (f[1] == primary) == fam]
        d = [np.array([x.mean() for x in per]) * 100.0 for _, _, per, _ in rows]
        adjusted = holm([sign_flip_p(x) for x in d]) if len(rows) > 1 else [None] * len(rows)
        out += [verdict(*((baseline, m) if reverse else (m, baseline)), metric, per, p_adjusted=adj, primary=fam,
                        delta=delta, iterations=its) for (m, metric, per, its), adj in zip(rows, adjusted)]
    order = {(m, metric): i for i, (m, metric, _, _) in enumerate(found)}
    out.sort(key=lambda v: order[(v.baseline if reverse else v.method, v.metric)])
    return out, " ".join([panel, *warnings])


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
        lo, hi = bootstrap_interval(d) if len(d) else (float("nan"), float("nan"))
        rows.append({"iteration": it, "tasks": j.height, "a": j["success"].mean(), "b": j["success_b"].mean(),
                     "diff": float(d.mean()) if len(d) else float("nan"), "ci_low": lo, "ci_high": hi})
    return pl.DataFrame(rows, schema={"iteration": pl.Int64, "tasks": pl.Int64, "a": pl.Float64, "b": pl.Float64,
                                      "diff": pl.Float64, "ci_low": pl.Float64, "ci_high": pl.Float64})


def verdict_frame(verdicts: list[Verdict]) -> pl.DataFrame:
    rows = [{**asdict(v), "notes": "; ".join(v.notes)} for v in verdicts]
    return pl.DataFrame(rows, schema_overrides={"tasks": pl.Int64, "seeds_for_power": pl.Int64})


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
