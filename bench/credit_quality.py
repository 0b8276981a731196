"""Benchmark: credit quality of every method on identical rollouts, scored by the Sokoban oracle (issue 5, point 2).

    python -m bench.credit_quality                          # the rollouts of results/ (a finished default run)
    python -m bench.credit_quality --run RUN_DIR --params RUN_DIR/params.yaml --out results/bench

One fixed set of step tables (every iteration of one run) goes through every estimator. OPRL's PRM and SPA's
estimator are replayed over the run's iterations in order, from its initial checkpoint, exactly as the fit stage
would have trained them (`pipeline.fitting`). Each turn is labelled by the oracle of credit-assignment.md (Oracle
credit): good when d(s_{t+1}) < d(s_t), bad when d(s_{t+1}) > d(s_t) or the action was invalid, d the exact BFS
distance to solved. The score is the ROC-AUC of the per-turn advantage for separating good from bad turns, plus the
share of turns each method gives a non-zero step-level signal. Writes credit_quality.csv and .png.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.config import METHODS, load_params
from pipeline.credit import compute_advantages
from pipeline.envs.sokoban import ACTIONS, Solver, parse_grid
from pipeline.grouping import build_groups, hgpo_depth
from pipeline.prompting import parse_action
from pipeline.tables import STEPS, read_table, write_text_atomic


def oracle_labels(steps: pl.DataFrame) -> pl.Series:
    """1 good, 0 bad, null neither (d unchanged, or both states dead), per row of `steps`."""
    solvers: dict = {}
    labels = []
    for anchor, response, valid in zip(steps["anchor"].to_list(), steps["response"].to_list(),
                                       steps["action_valid"].to_list(), strict=True):
        if not valid:
            labels.append(0)
            continue
        room, state = parse_grid(anchor)
        key = (room.walls, room.targets)
        if key not in solvers:
            solvers[key] = Solver(room, state)
        solver = solvers[key]
        action = parse_action(response, ACTIONS)
        nxt, _ = room.move(state, action)
        d0, d1 = solver.distance(state), solver.distance(nxt)
        labels.append(1 if d1 < d0 else 0 if d1 > d0 else None)
    return pl.Series("good", labels, dtype=pl.Int8)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney ROC-AUC with average ranks for ties (0.5 when a turn's score says nothing)."""
    pos, neg = int(labels.sum()), int(len(labels) - labels.sum())
    if pos == 0 or neg == 0:
        return math.nan
    ranks = pl.Series(scores).rank("average").to_numpy()
    return float((ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def fitted_scores(run: Path, params, iterations: list[int], method: str) -> dict[int, pl.DataFrame]:
    """Replay the fit stage of `method` (oprl or spa) over the run's iterations, from its initial policy."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.fitting import oprl_iteration, spa_iteration
    from pipeline.policy import load_policy
    from pipeline.reward_models import ProgressEstimator
    from pipeline.tables import REPLAY, empty_table

    ckpt = lambda i: run / f"iter_{i}" / "checkpoint"  # noqa: E731
    tokenizer = AutoTokenizer.from_pretrained(ckpt(0), local_files_only=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = {}
    if method == "oprl":
        cfg = params.credit.oprl
        prm, _ = load_policy(ckpt(0), params.policy.dtype, params.runtime.device)
        opt = torch.optim.AdamW(prm.parameters(), lr=cfg.lr, weight_decay=0.0)
        for it in iterations:
            steps = read_table(run / f"iter_{it}" / "steps.parquet", STEPS).sort("episode_id", "step")
            old, _ = load_policy(ckpt(it - 1), params.policy.dtype, params.runtime.device)
            scores, _ = oprl_iteration(prm, old, opt, steps, cfg, pad)
            out[it] = steps.select("episode_id", "step").with_columns(pl.Series("score", scores))
    else:
        cfg = params.credit.spa
        est = ProgressEstimator.from_policy(ckpt(0), params.policy.dtype, params.runtime.device)
        opt = torch.optim.AdamW(est.parameters(), lr=cfg.lr, weight_decay=0.0)
        replay = empty_table(REPLAY)
        for it in iterations:
            steps = read_table(run / f"iter_{it}" / "steps.parquet", STEPS).sort("episode_id", "step")
            scores, replay, _ = spa_iteration(est, opt, replay, steps, it, cfg, pad, seed=params.seed * 7919 + 17 * it)
            out[it] = steps.select("episode_id", "step").with_columns(pl.Series("score", scores))
    return out


def run(run_dir: Path, params_file: Path, out_dir: Path, methods: list[str], log: bool = True) -> pl.DataFrame:
    params = load_params(params_file)
    iterations = sorted(int(p.parent.name.split("_")[1]) for p in run_dir.glob("iter_*/steps.parquet"))
    if not iterations:
        raise FileNotFoundError(f"{run_dir}: no iter_*/steps.parquet; run the pipeline first")
    if iterations != list(range(1, iterations[-1] + 1)):
        raise ValueError(f"{run_dir}: iterations {iterations} are not consecutive from 1")
    tables = {}
    for it in iterations:
        steps = read_table(run_dir / f"iter_{it}" / "steps.parquet", STEPS).sort("episode_id", "step")
        groups = build_groups(steps, hgpo_depth(params)).drop("task_group")
        tables[it] = steps.join(groups, on=["episode_id", "step"]).with_columns(oracle_labels(steps))
    labelled = pl.concat(list(tables.values()))
    n_good = int((labelled["good"] == 1).sum())
    n_bad = int((labelled["good"] == 0).sum())
    print(f"{labelled.height} turns of iterations {iterations[0]}..{iterations[-1]}: {n_good} good, {n_bad} bad, "
          f"{labelled.height - n_good - n_bad} neutral", flush=True)
    rows = []
    for method in methods:
        scores = fitted_scores(run_dir, params, iterations, method) if method in ("oprl", "spa") else {}
        cfg = params.credit.model_copy(update={"method": method})
        parts = []
        for it, table in tables.items():
            t = table.join(scores[it], on=["episode_id", "step"]) if scores else table
            adv = compute_advantages(t, cfg)
            parts.append(adv.join(t.select("episode_id", "step", "good"), on=["episode_id", "step"]))
        adv = pl.concat(parts)
        judged = adv.filter(pl.col("good").is_not_null())
        auc = roc_auc(judged["advantage"].to_numpy(), judged["good"].to_numpy())
        auc_step = roc_auc(judged["step_advantage"].to_numpy(), judged["good"].to_numpy())
        rows.append({"method": method, "auc": auc, "auc_step_term": auc_step,
                     "share_nonzero_step_signal": float((adv["step_advantage"] != 0).mean()),
                     "turns": adv.height, "good": n_good, "bad": n_bad})
        print(f"{method:>6}: ROC-AUC {auc:.3f} (step term alone {auc_step:.3f}), non-zero step signal on "
              f"{rows[-1]['share_nonzero_step_signal']:.0%} of turns", flush=True)
    df = pl.DataFrame(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "credit_quality.csv", df.write_csv())
    plot(df, out_dir / "credit_quality.png", f"{labelled.height} turns, iterations {iterations[0]}-{iterations[-1]}")
    print(f"wrote {out_dir / 'credit_quality.csv'} and {out_dir / 'credit_quality.png'}")
    if log:
        from bench import log_run

        metrics = {}
        for r in rows:
            metrics.update({f"{r['method']}_auc": r["auc"], f"{r['method']}_auc_step_term": r["auc_step_term"],
                            f"{r['method']}_share_nonzero_step_signal": r["share_nonzero_step_signal"]})
        log_run("credit_quality", {"run": str(run_dir.resolve()), "params": str(params_file.resolve()),
                                   "iterations": f"{iterations[0]}-{iterations[-1]}", "turns": labelled.height,
                                   "good": n_good, "bad": n_bad},
                {k: v for k, v in metrics.items() if not math.isnan(v)},
                [out_dir / "credit_quality.csv", out_dir / "credit_quality.png"])
    return df


def plot(df: pl.DataFrame, path: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=120)
    x = np.arange(df.height)
    axes[0].bar(x, df["auc"].fill_nan(0.5).to_numpy(), color="tab:blue")
    axes[0].axhline(0.5, color="grey", lw=0.8, ls="--")
    axes[0].set_ylim(0.3, 1.0)
    axes[0].set_ylabel("ROC-AUC vs oracle (good vs bad turns)")
    axes[1].bar(x, df["share_nonzero_step_signal"].to_numpy(), color="tab:orange")
    axes[1].set_ylim(0, 1)
    axes[1].set_ylabel("share of turns with a step-level signal")
    for ax in axes:
        ax.set_xticks(x, df["method"].to_list())
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Credit quality on identical rollouts ({subtitle})", fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, path)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=Path("results"), help="a run's results folder")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="the params file of that run")
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--no-mlflow", action="store_true", help="do not log the run to MLflow")
    args = ap.parse_args(argv)
    run(args.run, args.params, args.out, args.methods, log=not args.no_mlflow)


if __name__ == "__main__":
    main()
