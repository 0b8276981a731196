"""Benchmark: the whole loop on a model of a real size, with full fine-tuning and with LoRA, side by side.

    python -m bench.real_size                                   # Qwen2.5-0.5B's shape in bf16, 1 iteration
    python -m bench.real_size --model qwen1.5b --iterations 2   # on a GPU machine
    python -m bench.real_size --model tiny --tasks 1 --group-size 2 --max-turns 2 --out /tmp/smoke   # seconds

A random-weight model folder of the named shape (`bench.rollout_engines.build_model`: Qwen2's architecture and
sizes, nothing downloaded) is the policy (`policy.path`) of two runs of the real workflow (`snakemake`), one with
full fine-tuning and one with `policy.lora`, in `--dtype` (fp32 master weights, forward passes in bf16). Each
run's Snakemake benchmark files give every stage's wall time and peak RSS (`bench.breakdown.collect`); on a GPU the
stages also log their peak GPU memory (`time/gpu_peak_mb` in the metrics files). Checkpoint and optimiser sizes are
read off the disk. Writes real_size.csv (one row per variant, stage and iteration) and real_size.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import yaml

from bench.breakdown import collect
from bench.rollout_engines import SHAPES, build_model
from pipeline.data.figures import pyplot, save_figure
from pipeline.data.tables import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"full": None, "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}}


def params_for(model: Path, variant: str, args) -> dict:
    """A small loop on `model`: the sizes are the workload's, the model is the one under test."""
    return {
        "seed": 0,
        "loop": {"iterations": args.iterations},
        "env": {"name": "sokoban", "max_turns": args.max_turns},
        "policy": {"path": str(model.resolve()), "dtype": args.dtype, "max_new_tokens": args.new_tokens,
                   "lora": VARIANTS[variant]},
        "rollout": {"tasks_per_iteration": args.tasks, "group_size": args.group_size},
        "update": {"epochs": 1, "minibatch_size": args.minibatch, "micro_batch_size": args.micro_batch,
                   "gradient_checkpointing": args.gradient_checkpointing},
        "evaluate": {"tasks": args.tasks, "episodes_per_task": 1},
        "tracking": {"enabled": False},
        "runtime": {"device": args.device, "fork_server": args.fork_server},
    }


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20 if path.exists() else 0.0


def gpu_peaks(results: Path) -> dict[str, float]:
    """`time/gpu_peak_mb` of each stage's metrics file (present where the stage ran on a GPU)."""
    out = {}
    for f in (results / "metrics").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            peak = json.loads(line).get("metrics", {}).get("time/gpu_peak_mb")
            if peak is not None:
                out[f.stem] = float(peak)
    return out


def run_variant(model: Path, variant: str, args) -> pl.DataFrame:
    d = args.work / variant
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    shutil.copy(ROOT / "Snakefile", d / "Snakefile")
    shutil.copytree(ROOT / "profiles", d / "profiles")
    (d / "params.yaml").write_text(yaml.safe_dump(params_for(model, variant, args), sort_keys=False))
    print(f"{variant}: snakemake in {d}", flush=True)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "snakemake", "--cores", str(args.cores), "--quiet"], cwd=d,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"snakemake failed in {d} (see {d / 'results/logs'}):\n{r.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    results = d / "results"
    gpu = gpu_peaks(results)
    df = collect(results).with_columns(
        pl.lit(variant).alias("variant"),
        pl.struct("stage", "iteration").map_elements(
            lambda s: gpu.get(s["stage"] if s["iteration"] is None else f"{s['stage']}_{s['iteration']}"),
            return_dtype=pl.Float64).alias("gpu_peak_mb"))
    last = args.iterations
    sizes = {"checkpoint_mb": folder_mb(results / f"iter_{last}/checkpoint"),
             "initial_checkpoint_mb": folder_mb(results / "iter_0/checkpoint"),
             "optimizer_mb": folder_mb(results / f"iter_{last}/optimizer"), "run_wall_s": wall}
    print(f"  {variant}: {wall:.0f} s; " + ", ".join(f"{k} {v:.1f}" for k, v in sizes.items()), flush=True)
    return df.with_columns(*(pl.lit(v).alias(k) for k, v in sizes.items()))


def plot(df: pl.DataFrame, path: Path, title: str) -> None:
    plt = pyplot()

    per = (df.group_by("variant", "stage", maintain_order=True)
           .agg(pl.col("wall_s").mean(), pl.col("max_rss_mb").max()))
    stages = per["stage"].unique(maintain_order=True).to_list()
    variants = per["variant"].unique(maintain_order=True).to_list()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    width = 0.8 / len(variants)
    for k, v in enumerate(variants):
        rows = {r["stage"]: r for r in per.filter(pl.col("variant") == v).iter_rows(named=True)}
        xs = [i + (k - (len(variants) - 1) / 2) * width for i in range(len(stages))]
        for ax, col, scale in ((axes[0], "wall_s", 1.0), (axes[1], "max_rss_mb", 1 / 1024)):
            ax.bar(xs, [(rows[s][col] or 0.0) * scale if s in rows else 0.0 for s in stages], width, label=v)
    for ax, label in ((axes[0], "mean wall seconds per run of the stage"), (axes[1], "peak RSS (GiB)")):
        ax.set_xticks(range(len(stages)), stages, rotation=30)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    fig.suptitle(title)
    save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen0.5b", choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tasks", type=int, default=2, help="task groups per iteration, and held-out tasks")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--minibatch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=None, help="update.micro_batch_size")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="update.gradient_checkpointing")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--fork-server", action="store_true",
                    help="fork the stages from one process that imported torch once (runtime.fork_server): a "
                         "shorter run, but each job's peak RSS is then its client's, not the stage's")
    ap.add_argument("--models-dir", type=Path, default=Path("results/bench/models"))
    ap.add_argument("--work", type=Path, default=Path("results/bench/real_size_runs"))
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    args = ap.parse_args(argv)
    model = build_model(args.model, args.models_dir / args.model)
    df = pl.concat([run_variant(model, v, args) for v in args.variants], how="diagonal_relaxed")
    df = df.with_columns(pl.lit(args.model).alias("model"), pl.lit(args.dtype).alias("dtype"),
                         pl.lit(platform.node()).alias("machine"))
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "real_size.csv", df.write_csv())
    plot(df, args.out / "real_size.png", f"{args.model} shape, {args.dtype}, {args.iterations} iteration(s)")
    with pl.Config(tbl_rows=60, tbl_cols=12, tbl_width_chars=160, float_precision=1):
        print(df.select("variant", "stage", "iteration", "wall_s", "max_rss_mb", "gpu_peak_mb"))
    print(f"wrote {args.out / 'real_size.csv'} and {args.out / 'real_size.png'}")


if __name__ == "__main__":
    main()
