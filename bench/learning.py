"""Benchmark: which credit method learns faster, on the same budget and the same rollouts.

    python -m bench.learning                                   # 6 methods x 3 seeds on params.yaml (hours on CPU)
    python -m bench.learning --methods grpo gigpo --seeds 0 1 2 --params params.yaml --jobs 2
    python -m bench.learning --params gpu.yaml --jobs 18 --cores 1            # 18 runs side by side on a GPU machine
    python -m bench.learning --methods grpo --arm dpo grpo update.objective=step_dpo --seeds 0 1   # objectives too

For each seed, one base run makes the initial policy and iteration 1's rollouts and groups
(`snakemake results/iter_1/groups.parquet`); every method then continues from it, linking its outputs
(`run.base`, README: Compare methods) rather than copying them, so the methods
differ only in credit assignment: same initial policy, same first rollouts, same iterations, episodes and update
steps. `--arm LABEL METHOD KEY=VALUE ...` adds a run of METHOD with params of its own (another update objective,
another margin), labelled LABEL in every table beside the methods; it shares the base run as they do, so its keys
must not change the initial policy or the first rollout (those jobs would not be shared: Snakemake reruns them in
the arm's folder). Each run is a normal pipeline run in `<work>/<method>_s<seed>/` (its own results/, logs and benchmark
files), logged to the repository's MLflow store like any run. Output in `--out`:

- learning_curves.csv: success rate per method, seed and iteration (held-out evaluation);
- learning.csv: per method, mean and standard deviation over seeds of the final success, the best success, the
  area under the curve (mean success over iterations 0..T) and the gain (final minus iteration 0), beside the
  mean oracle ROC-AUC of the step term and of the advantage the runs trained on (Sokoban's oracle), and for a
  method with a learned model the oracle score of its own output (`oracle_auc_own_score`; GAE: its values);
- learning_credit.csv: that oracle credit quality per method, seed and iteration, with the share of turns with a
  step signal and in non-singleton anchor groups (and `auc_score`, the learned model's own);
- learning_vs_grpo.csv: per method, the per-seed difference from GRPO's final success (mean, std);
- learning_verdicts.csv: per method against the baseline (`--baseline`, GRPO by default), the paired difference in
  final held-out success and in the mean over the iterations the arms do not share, in points, with a 95 %
  interval over seeds and the shared task panel, the sign-flip p-value (Holm-corrected per family), the
  equivalence test and the verdict (`bench.verdicts`, docs/statistics.md); the sentences are printed too;
- learning_pairs.csv: for runs that learn from step-level preferences (`update.objective: step_dpo`), per run and
  iteration the pairs, the share of the iteration's turns in a pair, the states with a pair and the mean gap and
  margin (`pipeline.credit.preferences.pair_stats`);
- learning.png: mean success curve per method with a band of ± one standard deviation over seeds (a method run on
  one seed: ± one standard error over its held-out tasks), and each method minus GRPO on the same seed (one seed:
  the paired 95 % bootstrap interval over the held-out tasks).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import psutil
import yaml

from bench import label_seed, log_run
from bench.verdicts import compare_methods, paired_by_iteration, task_success, verdict_frame
from pipeline.config.files import read_params
from pipeline.config.params import METHOD_NAMES, apply_overrides, check_dependencies, flat_keys, load_params
from pipeline.credit.oracle import run_credit
from pipeline.credit.preferences import pair_stats
from pipeline.data.figures import pyplot, save_figure
from pipeline.data.paths import iterations_with
from pipeline.data.tables import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]


def _workflow(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "Snakefile", d / "Snakefile")
    shutil.copytree(ROOT / "profiles", d / "profiles", dirs_exist_ok=True)


_ABSENT = object()
PATH_KEYS = (("policy", "path"), ("env", "data_path"))


def anchored(raw: dict, where: Path | None = None) -> dict:
    """The params mapping `raw` with its relative file paths (`policy.path`, `env.data_path`) made absolute against
    `where` (the folder the command runs in, as the workflow reads them) where a file or folder is there: a benchmark
    run works in a folder of its own, where `models/...` names nothing."""
    where = where or Path.cwd()
    out = yaml.safe_load(yaml.safe_dump(raw)) or {}
    for section, key in PATH_KEYS:
        value = (out.get(section) or {}).get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute() and (where / value).exists():
            out[section][key] = str((where / value).resolve())
    return out


def write_run_params(d: Path, params: dict) -> None:
    """`d/params.yaml` for a benchmark run: written where the folder has no results yet, left as it is (its time too)
    where the same params are there, refused where a run with other params already wrote results: Snakemake would
    rerun it, and the removal of its outputs would break the runs that link them (`run.base`)."""
    f = d / "params.yaml"
    if f.is_file():
        before = yaml.safe_load(f.read_text())
        if before == params:
            return
        if (d / "results").exists():
            old, new = flat_keys(before or {}), flat_keys(params)
            keys = sorted(k for k in old.keys() | new.keys() if old.get(k, _ABSENT) != new.get(k, _ABSENT))
            shown = ", ".join(f"{k}: {_shown(old, k)} -> {_shown(new, k)}" for k in keys[:5])
            raise SystemExit(f"error: {f}: a run made with other params is there ({shown}"
                             f"{f' and {len(keys) - 5} more' if len(keys) > 5 else ''}); rerunning it would remove "
                             "outputs that other runs link (run.base). Pass the --params and --set it was made with, "
                             "or another --work")
    write_text_atomic(f, yaml.safe_dump(params))


def _shown(flat: dict, key: str) -> str:
    return repr(flat[key]) if key in flat else "absent"


def _params(base: dict, method: str, seed: int, tracking_uri: str) -> dict:
    """A benchmark run's params: `base` with the seed and method, into `results/` of its own folder (whatever
    folder the config names: the benchmark's targets are there)."""
    p = yaml.safe_load(yaml.safe_dump(base))
    p["seed"] = seed
    p["run"] = {"dir": "results"}
    p.setdefault("credit", {})["method"] = method
    tracking = p.setdefault("tracking", {})
    if not tracking.get("tracking_uri"):
        tracking["tracking_uri"] = tracking_uri          # one store for every run, the repository's
    return p


LOCKED = "Directory cannot be locked"


def _snakemake(d: Path, cores: int, *targets: str) -> None:
    """Snakemake in the run folder `d`. A lock left by a bench killed earlier (no Snakemake process works in `d`)
    is removed and the run started again, so that a resumed bench or campaign goes on where it stopped instead of
    recording a run that never started as crashed."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "snakemake", *targets, "--cores", str(cores), "--quiet"]
    r = subprocess.run(cmd, cwd=d, capture_output=True, text=True, check=False)
    if r.returncode != 0 and LOCKED in r.stderr and not snakemake_works_in(d):
        print(f"  {d.name}: a stale Snakemake lock (a run killed earlier): unlocked, started again", flush=True)
        subprocess.run([sys.executable, "-m", "snakemake", "--unlock", "--cores", "1"], cwd=d, capture_output=True,
                       text=True, check=False)
        r = subprocess.run(cmd, cwd=d, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"snakemake failed in {d} (see {d / 'results/logs'}):\n{r.stderr[-3000:]}")
    print(f"  {d.name}: {' '.join(targets) or 'all'} in {time.perf_counter() - t0:.0f} s", flush=True)


def snakemake_works_in(d: Path) -> bool:
    """Whether a Snakemake process runs with `d` as its working folder (then its lock is not stale)."""
    d = d.resolve()
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if any("snakemake" in a for a in proc.info["cmdline"] or ()) and proc.info["cwd"] \
                    and Path(proc.info["cwd"]).resolve() == d:
                return True
        except (psutil.Error, OSError):
            continue
    return False


def continuing_run(d: Path, base: dict, method: str, seed: int, tracking_uri: str, base_dir: Path,
                   through: int, sets: list[str] = ()) -> Path:
    """Folder `d` set up for a run of `method` (with the params overrides `sets`) that links its jobs of iterations
    0..`through` from the base run in `base_dir` (`run.base`)."""
    _workflow(d)
    p = _params(anchored(apply_overrides(base, list(sets))), method, seed, tracking_uri)   # a copy, its overrides
    p["run"]["base"] = {"params": str((base_dir / "params.yaml").resolve()), "through": through}
    write_run_params(d, p)
    return d


def run_side_by_side(base_run, seeds: list[int], runs: list[Path], jobs: int, cores: int,
                     on_done: Callable[[Path, BaseException | None, float], None] | None = None) -> None:
    """`base_run(seed)` for every seed and Snakemake in every folder of `runs` (named `..._s<seed>`, continuing
    their seed's base), `jobs` at a time. A free worker takes the first run whose seed's base has finished, else
    the next seed's base: a seed's runs finish (and a campaign records them) before the later seeds' bases are
    made. One error naming every run that failed (a run whose base failed among them, not started).
    `on_done(folder, error or None, wall seconds)` as each run ends (a campaign records it at once)."""
    waiting = {s: [d for d in runs if label_seed(d.name)[1] == s] for s in seeds}
    bases, ready = list(seeds), []
    building = 0                                           # bases in progress
    failed: dict[Path, BaseException] = {}
    cond = threading.Condition()

    def take():
        nonlocal building
        with cond:
            while True:
                if ready:
                    return "run", ready.pop(0)
                if bases:
                    building += 1
                    return "base", bases.pop(0)
                if not building:
                    return None
                cond.wait()

    def one(d: Path) -> None:
        t0 = time.perf_counter()
        try:
            _snakemake(d, cores)
        except BaseException as e:  # noqa: BLE001 - recorded and reported with the others once all have ended
            failed[d] = e
            if on_done is not None:
                on_done(d, e, time.perf_counter() - t0)
            return
        if on_done is not None:
            on_done(d, None, time.perf_counter() - t0)

    def worker() -> None:
        nonlocal building
        while (task := take()) is not None:
            kind, x = task
            if kind == "run":
                one(x)
                continue
            try:
                base_run(x)
            except BaseException as e:  # noqa: BLE001 - the other workers wait on this base: never leave it open
                failed.update({d: e for d in waiting[x]})
                waiting[x] = []
            with cond:
                building -= 1
                ready.extend(waiting[x])                   # the earliest seed's runs come first
                ready.sort(key=lambda d: seeds.index(label_seed(d.name)[1]))
                cond.notify_all()

    threads = [threading.Thread(target=worker) for _ in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(runs)} runs failed: " + "; ".join(
            f"{d.parent.name}/{d.name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            for d, e in failed.items()))


def parse_arms(methods: list[str], arms: list[list[str]]) -> dict[str, tuple[str, list[str]]]:
    """Label -> (credit method, params overrides): each method as itself, then each `--arm LABEL METHOD KEY=VALUE
    ...`. A clear error for a label used twice, an unknown method or an override without `=`."""
    found = {m: (m, []) for m in methods}
    for arm in arms:
        if len(arm) < 2:
            raise SystemExit(f"--arm {' '.join(arm)}: expected LABEL METHOD [KEY=VALUE ...]")
        label, method, sets = arm[0], arm[1], arm[2:]
        if label in found:
            raise SystemExit(f"--arm {label}: the label is used twice (methods are labelled by their own names)")
        if method not in METHOD_NAMES:
            raise SystemExit(f"--arm {label}: unknown credit method {method!r}; expected one of {list(METHOD_NAMES)}")
        if bad := [x for x in sets if "=" not in x]:
            raise SystemExit(f"--arm {label}: {bad[0]!r} is not KEY=VALUE")
        found[label] = (method, sets)
    return found


def run_all(params_file: Path, methods: list[str], seeds: list[int], work: Path, jobs: int, cores: int,
            sets: list[str] = (), arms: dict[str, tuple[str, list[str]]] | None = None, through: int = 1,
            on_done: Callable[[Path, BaseException | None, float], None] | None = None) -> None:
    """Each seed's base run, then every arm's run continuing it (`run.base`): the initial policy and, `through` 1,
    the first rollout too; `through` 0 shares the initial policy and its evaluation only (arms whose rollouts
    differ from the first iteration on, e.g. branching). `on_done`: called as each arm's run ends
    (`run_side_by_side`)."""
    if through not in (0, 1):
        raise ValueError(f"through {through}: the arms share iteration 0 (0) or iterations 0 and 1 (1)")
    arms = arms or parse_arms(methods, [])
    base = anchored(apply_overrides(read_params(params_file)[0], list(sets)))
    for method, own in arms.values():    # every arm's params checked before any work
        check_dependencies(load_params(params_file, [*sets, f"credit.method={method}", *own]), params_file)
    uri = f"sqlite:///{ROOT / 'mlflow.db'}"

    def base_run(seed: int) -> None:
        seed_dir = work / f"base_s{seed}"
        _workflow(seed_dir)
        write_run_params(seed_dir, _params(base, "grpo", seed, uri))
        targets = ["results/iter_1/groups.parquet"] if through == 1 else []
        _snakemake(seed_dir, max(cores, cores * jobs // len(seeds)), *targets, "results/iter_0/eval.parquet")
        for label, (method, own) in arms.items():  # each links the base's initial policy (and first rollout)
            continuing_run(work / f"{label}_s{seed}", base, method, seed, uri, seed_dir, through=through, sets=own)

    run_side_by_side(base_run, seeds, [work / f"{a}_s{s}" for s in seeds for a in arms], jobs, cores, on_done)


def collect(work: Path, methods: list[str], seeds: list[int]) -> pl.DataFrame:
    frames = []
    for m in methods:
        for s in seeds:
            f = work / f"{m}_s{s}" / "results" / "report" / "success_curve.csv"
            if not f.exists():
                raise FileNotFoundError(f"{f}: missing; the run of {m}, seed {s} did not finish")
            frames.append(pl.read_csv(f).select("iteration", "success_rate")
                          .with_columns(pl.lit(m).alias("method"), pl.lit(s).alias("seed")))
    return pl.concat(frames).select("method", "seed", "iteration", "success_rate")


def collect_credit(work: Path, methods: list[str], seeds: list[int]) -> pl.DataFrame:
    """The oracle credit quality of every run's own advantages, per iteration (`pipeline.credit.oracle.run_credit`)."""

    frames = [run_credit(work / f"{m}_s{s}" / "results", load_params(work / f"{m}_s{s}" / "params.yaml"))
              .with_columns(pl.lit(m).alias("method"), pl.lit(s).alias("seed")) for m in methods for s in seeds]
    # diagonal: a method with a learned model adds the oracle score of its own output (`auc_score`)
    return pl.concat(frames, how="diagonal_relaxed").select("method", "seed", pl.all().exclude("method", "seed"))


def collect_pairs(work: Path, methods: list[str], seeds: list[int]) -> pl.DataFrame:
    """Each step-DPO run's pairs per iteration (`pair_stats` of `iter_<i>/pairs.parquet` against its step table);
    empty where no run has pairs."""
    rows = []
    for m in methods:
        for s in seeds:
            results = work / f"{m}_s{s}" / "results"
            for it in iterations_with(results, "pairs.parquet"):
                f = results / f"iter_{it}" / "pairs.parquet"
                turns = pl.scan_parquet(f.parent / "steps.parquet").select(pl.len()).collect().item()
                rows.append({"method": m, "seed": s, "iteration": it,
                             **pair_stats(pl.read_parquet(f), turns)})
    return pl.DataFrame(rows).sort("method", "seed", "iteration", maintain_order=True) if rows else pl.DataFrame()


def summarise(curves: pl.DataFrame, credit: pl.DataFrame | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Per method: final, best and area under the curve (mean over iterations), the gain (final minus iteration 0),
    mean and std over seeds, and with `credit` the mean oracle ROC-AUC of the step term and of the advantage over
    the runs' iterations; and the per-seed difference of each method's final success from GRPO's."""
    last = curves["iteration"].max()
    per_run = curves.group_by("method", "seed", maintain_order=True).agg(
        pl.col("success_rate").filter(pl.col("iteration") == last).first().alias("final"),
        pl.col("success_rate").max().alias("best"),
        pl.col("success_rate").mean().alias("auc"),
        (pl.col("success_rate").filter(pl.col("iteration") == last).first()
         - pl.col("success_rate").filter(pl.col("iteration") == 0).first()).alias("gain"),
    )
    table = per_run.group_by("method", maintain_order=True).agg(
        pl.len().alias("seeds"),
        *[e for k in ("final", "best", "auc", "gain")
          for e in (pl.col(k).mean().alias(f"{k}_mean"), pl.col(k).std().alias(f"{k}_std"))])
    if credit is not None and credit.height:
        oracle = credit.group_by("method", maintain_order=True).agg(
            pl.col("auc_step_term").mean().alias("oracle_auc_step_term"),
            pl.col("auc").mean().alias("oracle_auc_advantage"),
            pl.col("share_nonzero_step_signal").mean().alias("share_nonzero_step_signal"),
            *([pl.col("auc_score").mean().alias("oracle_auc_own_score")] if "auc_score" in credit.columns else []))
        table = table.join(oracle, on="method", how="left", maintain_order="left")
    vs = pl.DataFrame()
    if "grpo" in per_run["method"].to_list():
        g = per_run.filter(pl.col("method") == "grpo").select("seed", pl.col("final").alias("grpo_final"))
        vs = (per_run.join(g, on="seed").with_columns((pl.col("final") - pl.col("grpo_final")).alias("diff"))
              .group_by("method", maintain_order=True)
              .agg(pl.col("diff").mean().alias("final_minus_grpo_mean"),
                   pl.col("diff").std().alias("final_minus_grpo_std")))
    return table, vs


def curve_bands(curves: pl.DataFrame, key: str = "method", tasks: dict | None = None) -> pl.DataFrame:
    """Held-out success per iteration of each `key` value (a method, a lag), its mean over seeds and the band
    around it: ± one standard deviation over seeds where there are several (`band` "seeds"); with one seed, ± one
    standard error over that run's held-out tasks (`band` "tasks": the standard deviation of the tasks' success
    rates over the root of their number), from `tasks`, the runs' `bench.verdicts.task_success` tables keyed by
    (value, seed); without them a single seed has no band ("none"). Columns key, iteration, n (seeds), m, s, band."""
    agg = curves.group_by(key, "iteration", maintain_order=True).agg(
        pl.col("success_rate").mean().alias("m"), pl.col("success_rate").std().alias("s"), pl.len().alias("n"),
        pl.col("seed").first().alias("seed")).sort(key, "iteration", maintain_order=True)
    rows = []
    for r in agg.iter_rows(named=True):
        s, band = r["s"], "seeds"
        if r["n"] == 1:
            t = (tasks or {}).get((r[key], r["seed"]))
            x = t.filter(pl.col("iteration") == r["iteration"])["success"].to_numpy() if t is not None else []
            s, band = (float(np.std(x, ddof=1) / np.sqrt(len(x))), "tasks") if len(x) > 1 else (0.0, "none")
        rows.append({key: r[key], "iteration": r["iteration"], "n": r["n"], "m": r["m"], "s": s, "band": band})
    return pl.DataFrame(rows, schema={key: curves.schema[key], "iteration": pl.Int64, "n": pl.Int64,
                                      "m": pl.Float64, "s": pl.Float64, "band": pl.String})


def diff_bands(curves: pl.DataFrame, baseline: str, tasks: dict | None = None) -> pl.DataFrame:
    """Each method minus `baseline` on the same seed, per iteration, in points: the mean over seeds and a band of
    ± one standard deviation over seeds where there are several (`band` "seeds"); on one seed, the 95 % paired
    bootstrap interval over the held-out tasks both played (`bench.verdicts.paired_by_iteration`, `band` "tasks"),
    from `tasks` as in `curve_bands`. Columns method, iteration, n, m, low, high, band."""
    base = curves.filter(pl.col("method") == baseline).select("seed", "iteration", pl.col("success_rate").alias("b"))
    per_seed = (curves.filter(pl.col("method") != baseline).join(base, on=["seed", "iteration"])
                .with_columns(((pl.col("success_rate") - pl.col("b")) * 100).alias("d")))
    rows = []
    for method in per_seed["method"].unique(maintain_order=True).to_list():
        mine = per_seed.filter(pl.col("method") == method)
        seeds = mine["seed"].unique().to_list()
        pair = [(tasks or {}).get((m, seeds[0])) for m in (method, baseline)]
        if len(seeds) == 1 and all(t is not None for t in pair):
            for r in paired_by_iteration(*pair).iter_rows(named=True):
                rows.append({"method": method, "iteration": r["iteration"], "n": 1, "m": r["diff"],
                             "low": r["ci_low"], "high": r["ci_high"], "band": "tasks"})
            continue
        agg = mine.group_by("iteration").agg(pl.col("d").mean().alias("m"), pl.col("d").std().alias("s"),
                                             pl.len().alias("n"))
        for r in agg.iter_rows(named=True):
            s = r["s"] if r["n"] > 1 else 0.0
            rows.append({"method": method, "iteration": r["iteration"], "n": r["n"], "m": r["m"], "low": r["m"] - s,
                         "high": r["m"] + s, "band": "seeds" if r["n"] > 1 else "none"})
    schema = {"method": pl.String, "iteration": pl.Int64, "n": pl.Int64, "m": pl.Float64, "low": pl.Float64,
              "high": pl.Float64, "band": pl.String}
    return pl.DataFrame(rows, schema=schema).sort("method", "iteration", maintain_order=True)


BAND_WORDS = {"seeds": "± std over seeds", "tasks": "one seed: ± s.e. over held-out tasks", "none": "no band"}
DIFF_BAND_WORDS = {"seeds": "± std over seeds", "tasks": "one seed: 95 % interval over tasks", "none": "no band"}


def mean_curves(ax, curves: pl.DataFrame, key: str, label, tasks: dict | None = None) -> dict:
    """Draw `curve_bands` on `ax`, each value labelled `label(value, seeds)` and the kind of its band; returns each
    value's colour."""
    agg = curve_bands(curves, key, tasks)
    colors = {}
    for value in curves[key].unique(maintain_order=True).to_list():
        d = agg.filter(pl.col(key) == value)
        x, m, s = d["iteration"].to_numpy(), d["m"].to_numpy(), d["s"].to_numpy()
        words = ", ".join(BAND_WORDS[b] for b in d["band"].unique(maintain_order=True).to_list())
        line = ax.plot(x, m, marker="o", label=f"{label(value, int(d['n'].max()))}: {words}")[0]
        colors[value] = line.get_color()
        ax.fill_between(x, m - s, m + s, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("iteration")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("held-out success rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return colors


def plot(curves: pl.DataFrame, path: Path, tasks: dict | None = None, baseline: str = "grpo") -> None:
    """Learning curves with their uncertainty (`curve_bands`) and, with `baseline` among the methods, each method
    minus the baseline on the same seed (`diff_bands`); `tasks`: the runs' task_success tables keyed by (method,
    seed)."""
    plt = pyplot()

    paired = baseline in curves["method"].to_list() and curves["method"].n_unique() > 1
    fig, axes = plt.subplots(1, 2 if paired else 1, figsize=(12 if paired else 7, 4), dpi=120, squeeze=False)
    draw_curves(axes[0], curves, tasks, baseline if paired else None)
    save_figure(fig, path)


def draw_curves(axes, curves: pl.DataFrame, tasks: dict | None, baseline: str | None) -> dict:
    """On `axes[0]` the mean learning curve of each method over its seeds with their spread (`curve_bands`); with
    a `baseline`, on `axes[1]` each other method minus it on the same seed (`diff_bands`). Returns the colours."""
    ax = axes[0]
    colors = mean_curves(ax, curves, "method", lambda method, n: f"{method} (n={n})", tasks)
    ax.set_title("Learning curves: mean over seeds, with their spread")
    if baseline is not None:
        # the seeds differ far more than the methods do; the difference to the baseline on the same seed removes that
        ax = axes[1]
        diff = diff_bands(curves, baseline, tasks)
        for method in [m for m in colors if m != baseline]:
            d = diff.filter(pl.col("method") == method)
            x, m = d["iteration"].to_numpy(), d["m"].to_numpy()
            ax.plot(x, m, marker="o", color=colors[method], label=f"{method}: {DIFF_BAND_WORDS[d['band'][0]]}")
            ax.fill_between(x, d["low"].to_numpy(), d["high"].to_numpy(), color=colors[method], alpha=0.12)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlabel("iteration")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel(f"success minus {baseline}'s, same seed (points)")
        ax.set_title(f"Paired with {baseline} on the same seed")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return colors


def task_tables(work: Path, methods: list[str], seeds: list[int]) -> dict[tuple[str, int], pl.DataFrame]:
    """Every run's held-out success per task and iteration (`bench.verdicts.task_success`), keyed by (method, seed)."""
    return {(m, s): task_success(work / f"{m}_s{s}" / "results") for m in methods for s in seeds}


def verdicts(tables: dict[tuple[str, int], pl.DataFrame], baseline: str) -> tuple[pl.DataFrame, str]:
    """Each method against `baseline` on the held-out tasks of every run (`bench.verdicts.compare_methods`)."""
    found, panel = compare_methods(tables, baseline)
    return verdict_frame(found), panel


def report(work: Path, methods: list[str], seeds: list[int], out: Path, log: bool = True,
           oracle: bool = True, baseline: str = "grpo") -> pl.DataFrame:
    curves = collect(work, methods, seeds)
    credit = collect_credit(work, methods, seeds) if oracle else None
    table, vs = summarise(curves, credit)
    baseline = baseline if baseline in methods else methods[0]
    tables = task_tables(work, methods, seeds)
    verdict_table, panel = verdicts(tables, baseline)
    out.mkdir(parents=True, exist_ok=True)
    if verdict_table.height:
        write_text_atomic(out / "learning_verdicts.csv", verdict_table.write_csv())
    write_text_atomic(out / "learning_curves.csv", curves.write_csv())
    write_text_atomic(out / "learning.csv", table.write_csv())
    if credit is not None:
        write_text_atomic(out / "learning_credit.csv", credit.write_csv())
    if vs.height:
        write_text_atomic(out / "learning_vs_grpo.csv", vs.write_csv())
    pairs = collect_pairs(work, methods, seeds)
    if pairs.height:
        write_text_atomic(out / "learning_pairs.csv", pairs.write_csv())
    plot(curves, out / "learning.png", tables)
    with pl.Config(tbl_rows=20, tbl_cols=12, tbl_width_chars=160, float_precision=3):
        print(table)
        if vs.height:
            print(vs)
        if pairs.height:
            print(pairs.group_by("method", maintain_order=True).agg(
                pl.col("pairs", "share_turns_in_pair", "gap_mean", "margin_mean").mean()))
    if verdict_table.height:
        print(panel)
        print("\n".join(verdict_table["sentence"].to_list()))
    if log:

        metrics = {f"{r['method']}_{k}": r[k] for r in table.iter_rows(named=True)
                   for k in ("final_mean", "best_mean", "auc_mean", "gain_mean", "oracle_auc_step_term")
                   if r.get(k) is not None and r[k] == r[k]}
        log_run("learning", {"methods": methods, "seeds": seeds, "work": str(work.resolve())}, metrics,
                [out / f for f in ("learning.csv", "learning_curves.csv", "learning.png", "learning_credit.csv",
                                   "learning_verdicts.csv", "learning_pairs.csv") if (out / f).exists()])
    return table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="the shared configuration and budget")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a params key in every run, e.g. env.max_turns=30 (repeatable)")
    ap.add_argument("--methods", nargs="+", default=list(METHOD_NAMES), choices=METHOD_NAMES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", type=Path, default=Path("results/bench/learning"), help="where the runs live")
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--jobs", type=int, default=1, help="runs at the same time")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores for each run")
    ap.add_argument("--report-only", action="store_true", help="only collect finished runs")
    ap.add_argument("--no-oracle", action="store_true", help="skip scoring the runs' advantages against the oracle")
    ap.add_argument("--no-mlflow", action="store_true")
    ap.add_argument("--arm", nargs="+", action="append", default=[], metavar="LABEL METHOD KEY=VALUE",
                    help="a run of METHOD with params of its own, labelled LABEL, e.g. --arm dpo grpo "
                         "update.objective=step_dpo (repeatable)")
    ap.add_argument("--baseline", default="grpo", help="the method every other one is compared with (verdicts)")
    args = ap.parse_args(argv)
    arms = parse_arms(args.methods, args.arm)
    if not args.report_only:
        run_all(args.params, args.methods, args.seeds, args.work, args.jobs, args.cores, args.set, arms)
    report(args.work, list(arms), args.seeds, args.out, log=not args.no_mlflow, oracle=not args.no_oracle,
           baseline=args.baseline)


if __name__ == "__main__":
    main()
