"""Benchmark: where an iteration's time goes, from a finished run's own records.

    python -m bench.breakdown                     # the run in results/ (e.g. after `snakemake --cores all`)
    python -m bench.breakdown --run /path/to/results --out results/bench

Reads Snakemake's benchmark files (`results/benchmarks/<stage>[_<iteration>].tsv`: wall seconds and peak RSS of
each stage process, sampled) and each stage's `time/*` metrics (its peak RSS from the kernel too; the larger is kept) (`results/metrics/<stage>[_<iteration>].jsonl`, written by
the tracker): start-up (interpreter and module imports, torch and transformers included where the stage needs
them), tracking (MLflow), and the stage's own work. For a run made without those metrics, start-up is measured
here instead: the best of three `python -c "import stages.<stage>"`. Writes breakdown.csv (one row per stage and
iteration), breakdown_summary.csv (per stage) and breakdown.png (stacked bars), and prints the share of start-up
in the whole run and the share of grouping plus advantages in an iteration (the GiGPO paper: 0.54 s of 362.8 s).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import polars as pl

from bench import log_run
from pipeline.data.figures import pyplot, save_figure
from pipeline.data.tables import write_text_atomic

NAME = re.compile(r"^(?P<stage>[a-z_]+?)(?:_(?P<it>\d+))?\.tsv$")
ITERATION_STAGES = ("rollout", "group", "fit", "advantages", "update", "evaluate")


def stage_timing(metrics_file: Path) -> dict[str, float] | None:
    """The last `time/*` record of a stage's metrics file, or None."""
    if not metrics_file.exists():
        return None
    found = None
    for line in metrics_file.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        m = rec.get("metrics", {})
        if "time/startup_s" in m:
            found = m
    return found


def measured_startup(stage: str, repeats: int = 3) -> float:
    """Best of `repeats` fresh interpreters importing the stage's module (no work done)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import stages.{stage}"], check=True, capture_output=True)
        best = min(best, time.perf_counter() - t0)
    return best


def collect(run_dir: Path) -> pl.DataFrame:
    bench_dir = run_dir / "benchmarks"
    files = sorted(bench_dir.glob("*.tsv"))
    if not files:
        raise FileNotFoundError(f"{bench_dir}: no Snakemake benchmark files; run `snakemake --cores all` first")
    rows, fallback = [], {}
    for f in files:
        m = NAME.match(f.name)
        if not m:
            continue
        stage, it = m["stage"], (int(m["it"]) if m["it"] is not None else None)
        b = pl.read_csv(f, separator="\t")
        for col in ("s", "max_rss"):
            if col not in b.columns:
                raise ValueError(f"{f}: column {col!r} missing; expected a Snakemake benchmark file")
        wall = float(b["s"][-1])
        rss = b["max_rss"][-1]
        timing = stage_timing(run_dir / "metrics" / f"{f.stem}.jsonl")
        if timing is not None:
            startup, tracking, source = timing["time/startup_s"], timing["time/tracking_s"], "metrics"
        else:
            if stage not in fallback:
                fallback[stage] = measured_startup(stage)
            startup, tracking, source = fallback[stage], None, "measured import"
        startup = min(startup, wall)
        tracking = min(tracking, wall - startup) if tracking is not None else 0.0
        # Snakemake samples the job's process tree, which misses a job shorter than its interval and, under the
        # fork server, sees only the launcher; the stage's own peak (`time/peak_rss_mb`, from the kernel) covers both.
        sampled = float(rss) if rss not in (None, "-", "NA") else None
        own = timing.get("time/peak_rss_mb") if timing is not None else None
        peaks = [v for v in (sampled, own) if v is not None]
        rows.append({"stage": stage, "iteration": it, "wall_s": wall,
                     "max_rss_mb": max(peaks) if peaks else None,
                     "startup_s": startup, "tracking_s": tracking, "work_s": wall - startup - tracking,
                     "startup_source": source})
    return pl.DataFrame(rows, schema_overrides={"iteration": pl.Int64, "max_rss_mb": pl.Float64})


def summarise(df: pl.DataFrame) -> tuple[pl.DataFrame, dict[str, float]]:
    per_stage = (df.group_by("stage", maintain_order=True)
                 .agg(pl.len().alias("runs"), pl.col("wall_s").sum().alias("total_wall_s"),
                      pl.col("wall_s").mean().alias("mean_wall_s"), pl.col("max_rss_mb").max().alias("peak_rss_mb"),
                      pl.col("startup_s").mean().alias("mean_startup_s"),
                      pl.col("work_s").mean().alias("mean_work_s"))
                 .sort("total_wall_s", descending=True))
    total = float(df["wall_s"].sum())
    iters = df.filter(pl.col("iteration").is_not_null() & (pl.col("iteration") >= 1)
                      & pl.col("stage").is_in(ITERATION_STAGES))
    it_wall = float(iters["wall_s"].sum())
    ga = iters.filter(pl.col("stage").is_in(["group", "advantages"]))
    n_it = iters["iteration"].n_unique()
    facts = {
        "total_wall_s": total,
        "startup_share": float(df["startup_s"].sum()) / total if total else 0.0,
        "tracking_share": float(df["tracking_s"].sum()) / total if total else 0.0,
        "iterations": float(n_it),
        "mean_iteration_s": it_wall / n_it if n_it else 0.0,
        "group_adv_wall_share": float(ga["wall_s"].sum()) / it_wall if it_wall else 0.0,
        "group_adv_work_share": float(ga["work_s"].sum()) / it_wall if it_wall else 0.0,
        "group_adv_work_s_per_iteration": float(ga["work_s"].sum()) / n_it if n_it else 0.0,
    }
    return per_stage, facts


def plot(df: pl.DataFrame, per_stage: pl.DataFrame, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    iters = df.filter(pl.col("iteration").is_not_null() & (pl.col("iteration") >= 1)
                      & pl.col("stage").is_in(ITERATION_STAGES))
    its = sorted(iters["iteration"].unique().to_list())
    bottom = [0.0] * len(its)
    for stage in ITERATION_STAGES:
        d = {r["iteration"]: r["wall_s"] for r in iters.filter(pl.col("stage") == stage).iter_rows(named=True)}
        if not d:
            continue
        h = [d.get(i, 0.0) for i in its]
        axes[0].bar([str(i) for i in its], h, bottom=bottom, label=stage)
        bottom = [b + x for b, x in zip(bottom, h, strict=True)]
    axes[0].set_xlabel("iteration")
    axes[0].set_ylabel("wall seconds")
    axes[0].set_title("Wall time of each iteration, by stage")
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    stages = per_stage["stage"].to_list()
    means = {s: df.filter(pl.col("stage") == s).select(pl.col("startup_s", "tracking_s", "work_s").mean()).row(0)
             for s in stages}
    bottom = [0.0] * len(stages)
    for k, (label, color) in enumerate([("start-up and imports", "tab:grey"), ("MLflow", "tab:purple"),
                                        ("work", "tab:green")]):
        h = [means[s][k] or 0.0 for s in stages]
        axes[1].bar(stages, h, bottom=bottom, label=label, color=color)
        bottom = [b + x for b, x in zip(bottom, h, strict=True)]
    axes[1].set_ylabel("mean wall seconds per run of the stage")
    axes[1].set_title("Inside a stage process")
    axes[1].tick_params(axis="x", rotation=30)
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


def run(run_dir: Path, out_dir: Path, log: bool = True) -> tuple[pl.DataFrame, dict[str, float]]:
    df = collect(run_dir)
    per_stage, facts = summarise(df)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "breakdown.csv", df.write_csv())
    write_text_atomic(out_dir / "breakdown_summary.csv", per_stage.write_csv())
    plot(df, per_stage, out_dir / "breakdown.png")
    with pl.Config(tbl_rows=40, tbl_cols=12, tbl_width_chars=140, float_precision=2):
        print(per_stage)
    print(f"whole run {facts['total_wall_s']:.0f} s; start-up and imports {facts['startup_share']:.0%}, "
          f"MLflow {facts['tracking_share']:.0%}; mean iteration {facts['mean_iteration_s']:.1f} s, of which "
          f"group + advantages {facts['group_adv_wall_share']:.1%} as stage processes and "
          f"{facts['group_adv_work_share']:.2%} as computation ({facts['group_adv_work_s_per_iteration']:.2f} s "
          f"per iteration)")
    print(f"wrote {out_dir / 'breakdown.csv'}, {out_dir / 'breakdown_summary.csv'} and {out_dir / 'breakdown.png'}")
    if log:

        log_run("breakdown", {"run": str(run_dir.resolve())}, facts,
                [out_dir / "breakdown.csv", out_dir / "breakdown_summary.csv", out_dir / "breakdown.png"])
    return df, facts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=Path("results"), help="a run's results folder")
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--no-mlflow", action="store_true", help="do not log the run to MLflow")
    args = ap.parse_args(argv)
    run(args.run, args.out, log=not args.no_mlflow)


if __name__ == "__main__":
    main()
