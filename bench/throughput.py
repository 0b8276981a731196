"""Benchmark: throughput of grouping and of every advantage estimator on synthetic step tables.

    python -m bench.throughput                       # 10^4, 10^5, 10^6 turns; writes results/bench/throughput.{csv,png}
    python -m bench.throughput --sizes 10000 --repeats 1 --out /tmp/smoke   # the CI smoke version

The tables look like Sokoban rollouts: G = 8 episodes per task, episodes of 3-15 turns that random-walk over a small
per-task state graph (so anchors repeat across episodes and within one), 40-character anchor strings, gym-sokoban-like
rewards and 2 % invalid actions. Each size is timed for the group stage's work (`build_groups`: hashing, step groups,
HGPO keys), for the content checks every read of the step table makes (unique, contiguous turns, finite rewards and
log-probs; `pipeline.data.tables.check_rows`) and for each estimator, and in the same run a plain per-row Python GiGPO
(`pipeline.credit.naive`, loops and dicts the way reference codebases write it) computes the same advantages, which
must agree to 1e-9. Target: 10^6 turns grouped and GiGPO-advantaged in at most 2 s on the 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np
import polars as pl

from bench import log_run
from pipeline.config.params import METHOD_NAMES, CreditConfig
from pipeline.credit.grouping import build_groups
from pipeline.credit.methods import compute_advantages
from pipeline.credit.naive import gigpo_naive
from pipeline.data.figures import pyplot, save_figure
from pipeline.data.tables import STEPS, Table, check_rows, write_text_atomic

TARGET_SECONDS = 2.0
# the content checks a read of the step table makes, on the columns the synthetic table has (the rest of a read is
# Parquet decoding): unique, contiguous turns and finite rewards and log-probs
READ_CHECKS = Table(STEPS.schema, contiguous=True, finite=("reward", "response_logprobs"))


def synthetic_steps(turns: int, group_size: int = 8, states_per_task: int = 24, seed: int = 0) -> pl.DataFrame:
    """About `turns` rows of a step table with realistic anchor repetition (see the module docstring)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 16, size=turns // 3 + 1)
    cs = np.cumsum(lengths)
    k = int(np.searchsorted(cs, turns))
    lengths = lengths[: k + 1]
    lengths[-1] -= cs[k] - turns
    n_eps = len(lengths)
    n = int(lengths.sum())
    episode = np.repeat(np.arange(n_eps), lengths)
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    step = np.arange(n) - np.repeat(starts, lengths)
    task = episode // group_size
    # random walk on a ring of states with jumps: revisits within and across episodes, all from state 0
    moves = rng.choice([-1, 0, 1, 2], size=n, p=[0.3, 0.1, 0.45, 0.15])
    moves[starts] = 0
    walk = np.cumsum(moves)
    walk -= np.repeat(walk[starts], lengths)
    state = np.mod(walk, states_per_task)
    anchors = pl.Series([f"{t:08d}|{s:02d}|" for t, s in zip(task.tolist(), state.tolist())]).str.pad_end(40, "#")
    last = np.r_[starts[1:] - 1, n - 1]
    success = rng.random(n_eps) < 0.3
    reward = np.full(n, -0.1)
    reward[last[success]] += 10.0
    valid = rng.random(n) > 0.02
    return pl.DataFrame({
        "episode_id": episode.astype(np.int64), "step": step.astype(np.int32), "task_group": task.astype(np.int64),
        "anchor": anchors, "reward": reward, "action_valid": valid,
        "score": rng.normal(0, 0.1, size=n),
        "response_logprobs": pl.Series(-rng.exponential(0.5, size=(n, 3)).astype(np.float32)).cast(
            pl.List(pl.Float32)),
    })


def timed(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(sizes: list[int], repeats: int, reference_max: int, out_dir: Path, log: bool = True) -> pl.DataFrame:
    rows = []
    for n in sizes:
        steps = synthetic_steps(n)
        n = steps.height
        t_group, groups = timed(lambda: build_groups(steps, 3), repeats)
        table = steps.join(groups.drop("task_group"), on=["episode_id", "step"])
        sizes_dist = groups.group_by("step_group").len()["len"]
        share_nonsingleton = float((groups["step_group_size"] > 1).mean())
        rows.append({"turns": n, "what": "group", "seconds": t_group, "turns_per_s": n / t_group})
        t_check, _ = timed(lambda: check_rows(steps, READ_CHECKS, Path("steps.parquet")), repeats)
        rows.append({"turns": n, "what": "read_checks", "seconds": t_check, "turns_per_s": n / t_check})
        results = {}
        for method in METHOD_NAMES:
            cfg = CreditConfig(method=method)
            t, results[method] = timed(lambda c=cfg: compute_advantages(table, c), repeats)
            rows.append({"turns": n, "what": method, "seconds": t, "turns_per_s": n / t})
        gigpo_s = next(r["seconds"] for r in rows if r["turns"] == n and r["what"] == "gigpo")
        rows.append({"turns": n, "what": "group+gigpo", "seconds": t_group + gigpo_s,
                     "turns_per_s": n / (t_group + gigpo_s)})
        if n <= reference_max:
            credit = CreditConfig(method="gigpo")
            cfg, ep = credit.gigpo, credit.episode
            records = steps.select("episode_id", "step", "task_group", "anchor", "reward", "action_valid").to_dicts()
            t_ref, ref = timed(lambda: gigpo_naive(records, ep.mode, cfg.mode, ep.episode_stats, cfg.gamma,
                                                       cfg.step_advantage_w, credit.invalid_penalty), 1)
            got = results["gigpo"]
            diff = max(abs(a - ref[(e, s)]) for e, s, a in zip(got["episode_id"].to_list(), got["step"].to_list(),
                                                                  got["advantage"].to_list(), strict=True))
            if diff > 1e-9:
                raise AssertionError(f"vectorised GiGPO differs from the per-row reference by {diff} at {n} turns")
            rows.append({"turns": n, "what": "gigpo_per_row_python", "seconds": t_ref, "turns_per_s": n / t_ref})
            print(f"{n:>9,} turns: per-row Python GiGPO {t_ref:.2f} s, vectorised {gigpo_s:.3f} s "
                  f"({t_ref / gigpo_s:.0f}x), max |difference| {diff:.1e}", flush=True)
        print(f"{n:>9,} turns: group {t_group:.3f} s, read checks {t_check:.3f} s ({t_check / t_group:.0%} of "
              f"group), group+gigpo {t_group + gigpo_s:.3f} s; "
              f"{len(sizes_dist):,} step groups, {share_nonsingleton:.0%} of turns in non-singleton groups",
              flush=True)
    df = pl.DataFrame(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv = out_dir / "throughput.csv"
    write_text_atomic(csv, df.write_csv())
    plot(df, out_dir / "throughput.png")
    print(f"wrote {csv} and {out_dir / 'throughput.png'}")
    if log:

        log_run("throughput", {"sizes": sizes, "repeats": repeats, "reference_max": reference_max,
                               "cpus": os.cpu_count()},
                {f"{r['what']}_{r['turns']}_seconds": r["seconds"] for r in df.iter_rows(named=True)},
                [csv, out_dir / "throughput.png"])
    big = df.filter((pl.col("what") == "group+gigpo") & (pl.col("turns") >= 1_000_000))
    if big.height:
        s = float(big["seconds"][0])
        verdict = "meets" if s <= TARGET_SECONDS else "misses"
        print(f"10^6 turns grouped + GiGPO: {s:.2f} s, {verdict} the {TARGET_SECONDS:.0f} s target "
              f"({os.cpu_count()} cores, {platform.processor() or platform.machine()})")
    return df


def plot(df: pl.DataFrame, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for what in df["what"].unique(maintain_order=True).to_list():
        d = df.filter(pl.col("what") == what).sort("turns")
        ax.plot(d["turns"], d["turns_per_s"], marker="o", label=what,
                linestyle="--" if what == "gigpo_per_row_python" else "-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("turns in the step table")
    ax.set_ylabel("turns per second")
    ax.set_title("Grouping and advantage throughput")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")
    save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs per timing")
    ap.add_argument("--reference-max", type=int, default=1_000_000,
                    help="largest table the per-row Python reference also runs on")
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--no-mlflow", action="store_true", help="do not log the run to MLflow")
    args = ap.parse_args(argv)
    run(args.sizes, args.repeats, args.reference_max, args.out, log=not args.no_mlflow)


if __name__ == "__main__":
    main()
