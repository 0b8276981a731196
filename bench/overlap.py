"""Benchmark: one step off-policy against the on-policy chain, the same job, whole runs, paired seeds.

    python -m bench.overlap --params params.yaml --seeds 0 1 2 --work W     # 6 whole runs, one after another

For each seed, the job of `--params` runs twice from scratch with `snakemake --cores <cores>`, alone on the
machine: with `loop.off_policy_lag: 0` (rollout i waits for update i-1) and with 1 (rollout i samples from the
checkpoint of i-2 and runs beside update i-1). Snakemake's own log gives each job's start and end; from them the
benchmark reports how long rollouts ran beside a trainer job (fit or update) and how many jobs ran at once. Output
in `--out`:

- overlap.csv: per seed and lag, the run's wall time, the seconds a rollout and a trainer job ran at once, the mean
  number of jobs running, the threads each stage's rule declared, and the final held-out success;
- overlap_curves.csv: held-out success per seed, lag and iteration;
- overlap.png: success curves (mean ± std over seeds) and each seed's wall time, lag 0 beside lag 1.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import polars as pl
import yaml

from bench import log_run
from bench.learning import _workflow, mean_curves
from pipeline.config.files import read_params
from pipeline.config.params import apply_overrides, load_params
from pipeline.data.figures import pyplot, save_figure
from pipeline.data.tables import write_text_atomic
from pipeline.workflow.registry import STAGE_BY_NAME, resources_for

ROOT = Path(__file__).resolve().parents[1]
LAGS = (0, 1)
_STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_RULE = re.compile(r"^(?:local)?rule (\w+):$")
_FIELD = re.compile(r"^    (jobid|wildcards): (.+)$")
_DONE = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")


def job_intervals(log: str) -> dict[str, tuple[float, float | None]]:
    """Each job of a Snakemake log ("rollout@2", "init") with its start and end, in seconds from the log's first time
    stamp (None: never finished). Snakemake stamps every job start and every end to the second."""
    out: dict[str, tuple[float, float | None]] = {}
    names: dict[str, str] = {}
    t0 = now = None
    rule = jobid = None
    for line in log.splitlines():
        if m := _STAMP.match(line):
            now = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y").timestamp()
            t0 = now if t0 is None else t0
        elif m := _RULE.match(line):
            rule, jobid = m.group(1), None
        elif rule and (m := _FIELD.match(line)):
            if m.group(1) == "jobid":
                jobid = m.group(2)
                names[jobid] = rule
                out[rule] = (now - t0, None)
            elif jobid is not None:
                it = re.search(r"\bit=(\d+)", m.group(2))
                if it:
                    del out[names[jobid]]
                    names[jobid] = f"{rule}@{it.group(1)}"
                    out[names[jobid]] = (now - t0, None)
        elif m := _DONE.match(line):
            rule = None
            name = names.get(m.group(1))
            if name is not None and name != "all":
                out[name] = (out[name][0], now - t0)
        elif not line.startswith("    "):
            rule = None
    out.pop("all", None)
    return out


def overlap_seconds(jobs: dict[str, tuple[float, float | None]], a: set[str], b: set[str]) -> float:
    """Seconds during which a job of stage set `a` and one of `b` ran at the same time."""
    def spans(kinds):
        return sorted((s, e) for n, (s, e) in jobs.items() if e is not None and n.split("@")[0] in kinds)

    def union(xs):
        out = []
        for s, e in xs:
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        return out

    total = 0.0
    for s1, e1 in union(spans(a)):
        for s2, e2 in union(spans(b)):
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


def mean_running(jobs: dict[str, tuple[float, float | None]]) -> float:
    """The mean number of jobs running over the run's wall time."""
    done = [(s, e) for s, e in jobs.values() if e is not None]
    span = max(e for _, e in done) - min(s for s, _ in done)
    return sum(e - s for s, e in done) / span if span > 0 else 0.0


def run_all(params_file: Path, seeds: list[int], work: Path, cores: int, sets: list[str]) -> None:
    base = apply_overrides(read_params(params_file)[0], list(sets))
    uri = f"sqlite:///{ROOT / 'mlflow.db'}"
    for seed in seeds:
        for lag in LAGS:
            d = work / f"lag{lag}_s{seed}"
            _workflow(d)
            p = yaml.safe_load(yaml.safe_dump(base))
            p["seed"] = seed
            p.setdefault("loop", {})["off_policy_lag"] = lag
            p.setdefault("tracking", {}).setdefault("tracking_uri", uri)
            (d / "params.yaml").write_text(yaml.safe_dump(p))
            load_params(d / "params.yaml")     # validate before any work
            if (d / "results" / "report" / "success_curve.csv").exists():
                print(f"  {d.name}: done before, kept", flush=True)
                continue
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "snakemake", "--cores", str(cores)], cwd=d,
                               capture_output=True, text=True)
            wall = time.perf_counter() - t0
            (d / "snakemake.log").write_text(r.stdout + r.stderr)
            if r.returncode != 0:
                raise RuntimeError(f"snakemake failed in {d} (see {d / 'snakemake.log'}):\n{r.stderr[-3000:]}")
            (d / "wall_s.txt").write_text(f"{wall:.1f}\n")
            print(f"  {d.name}: {wall:.0f} s", flush=True)


def collect(work: Path, seeds: list[int]) -> tuple[pl.DataFrame, pl.DataFrame]:
    rows, curves = [], []
    for seed in seeds:
        for lag in LAGS:
            d = work / f"lag{lag}_s{seed}"
            jobs = job_intervals((d / "snakemake.log").read_text())
            p = load_params(d / "params.yaml")
            curve = pl.read_csv(d / "results" / "report" / "success_curve.csv").select("iteration", "success_rate")
            curves.append(curve.with_columns(pl.lit(seed).alias("seed"), pl.lit(lag).alias("lag")))
            rows.append({
                "seed": seed, "lag": lag, "wall_s": float((d / "wall_s.txt").read_text()),
                "rollout_beside_trainer_s": overlap_seconds(jobs, {"rollout"}, {"update", "fit"}),
                "mean_jobs_running": mean_running(jobs),
                **{f"threads_{s}": resources_for(STAGE_BY_NAME[s], p)["threads"]
                   for s in ("rollout", "update", "evaluate")},
                "final_success": curve["success_rate"][-1]})
    return pl.DataFrame(rows), pl.concat(curves).select("seed", "lag", "iteration", "success_rate")


def plot(table: pl.DataFrame, curves: pl.DataFrame, path: Path) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4), dpi=120)
    mean_curves(a, curves, "lag", lambda lag, n: f"lag {lag} (n={n})")
    a.set_title("Held-out success: mean ± std over seeds")
    seeds = table["seed"].unique().sort().to_list()
    width = 0.38
    for k, lag in enumerate(LAGS):
        t = table.filter(pl.col("lag") == lag).sort("seed")
        b.bar([i + (k - 0.5) * width for i in range(len(seeds))], (t["wall_s"] / 60).to_list(), width,
              label=f"lag {lag}")
    b.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
    b.set_ylabel("wall time of the whole run (min)")
    b.set_title("Wall time, each run alone on the machine")
    b.grid(alpha=0.3, axis="y")
    b.legend(fontsize=8)
    save_figure(fig, path)


def report(work: Path, seeds: list[int], out: Path, log: bool = True) -> pl.DataFrame:
    table, curves = collect(work, seeds)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "overlap.csv", table.write_csv())
    write_text_atomic(out / "overlap_curves.csv", curves.write_csv())
    plot(table, curves, out / "overlap.png")
    with pl.Config(tbl_rows=20, tbl_cols=12, tbl_width_chars=160, float_precision=3):
        print(table)
    if log:
        metrics = {f"lag{lag}_{k}": float(table.filter(pl.col("lag") == lag)[k].mean())
                   for lag in LAGS for k in ("wall_s", "final_success", "rollout_beside_trainer_s")}
        log_run("overlap", {"seeds": seeds, "work": str(work.resolve())}, metrics,
                [out / f for f in ("overlap.csv", "overlap_curves.csv", "overlap.png")])
    return table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a params key in every run (repeatable)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", type=Path, default=Path("results/bench/overlap"), help="where the runs live")
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores for each run (--cores all)")
    ap.add_argument("--report-only", action="store_true", help="only collect finished runs")
    ap.add_argument("--no-mlflow", action="store_true")
    args = ap.parse_args(argv)
    if not args.report_only:
        run_all(args.params, args.seeds, args.work, args.cores, args.set)
    report(args.work, args.seeds, args.out, log=not args.no_mlflow)


if __name__ == "__main__":
    main()
