"""Benchmark: credit quality of every method on identical rollouts, scored by the environment's oracle.

    python -m bench.credit_quality                          # the rollouts of results/ (a finished default run)
    python -m bench.credit_quality --run RUN_DIR --params RUN_DIR/params.yaml --out results/bench

One fixed set of step tables (every iteration of one run) goes through every estimator. The learned models (OPRL's
PRM, SPA's estimator, GAE's critic) are replayed over the run's iterations in order, from its initial checkpoint,
exactly as the fit stage would have trained them (`pipeline.credit.reward_model.fit_iteration`); `--set
credit.oprl.lr=2e-4` and the like try other settings on the same rollouts.

Each turn is labelled by the oracle of docs/credit-assignment.md (Oracle credit): good when d(s_{t+1}) < d(s_t), bad
when d(s_{t+1}) > d(s_t) or the action was invalid, d the exact distance to success that the environment provides
(`oracle_distance`: Sokoban's BFS solver), read while replaying each episode. The score is the ROC-AUC of the per-turn
advantage for separating good from bad turns, plus the share of turns each method gives a non-zero step-level signal,
over all iterations and per iteration, and both AUCs again on the valid turns alone (the oracle calls every
invalid turn bad); for a learned model, `auc_score` scores its own output: a turn's score by
the same ROC-AUC, a state's value (GAE's V(s_t)) by how often, of two states at different oracle distances, the
nearer one has the higher value. Writes credit_quality.csv, credit_quality_by_iteration.csv,
credit_quality_fit.csv (the fit statistics per iteration: losses, the PRM's drift), credit_quality.png and
credit_quality_turns.parquet (each method's terms for each turn beside the oracle's label and distance: the rows
behind an AUC, to see which turns a method ranks wrong) and credit_quality_terms_by_turn.csv (`terms_by_turn`: how
large each term is at each position of the episode, and how far the step term repeats the episode term; drawn in
credit_quality_terms_by_turn.png).

Beside the methods, credit_quality_baselines.csv scores two rankings that know nothing of credit, on the same
turns: `turns_left` (the number of turns after a turn in its episode) and `turns_left_then_success` (the same, ties
broken by the episode's success). Where the oracle's labels follow a turn's position (in the search environment
nearly every search is good and the final answer is wrong more often than not), these reach a high AUC alone, and a
method's AUC means something only above them.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl

from bench import log_run
from pipeline.config.params import METHOD_NAMES, load_params
from pipeline.credit.grouping import build_groups
from pipeline.credit.methods import METHODS, compute_advantages, history_depth
from pipeline.credit.oracle import (
    oracle_labels,  # noqa: F401 - bench.* use it
    oracle_replay,
    roc_auc,  # noqa: F401 - bench.* use it
    run_credit,  # noqa: F401 - bench.* use it
    score_advantages,
)
from pipeline.data.figures import pyplot, save_figure
from pipeline.data.paths import iterations_with
from pipeline.data.tables import STEPS, atomic_file, read_table, write_text_atomic
from pipeline.envs.base import spec_of as env_spec
from pipeline.workflow.runs import run_folder

# one row per (method, turn) in credit_quality_turns.parquet: what each method gave each turn, and the oracle's word
TURN_COLUMNS = ["method", "iteration", "episode_id", "step", "action", "action_valid", "reward", "good", "distance",
                "episode_advantage", "step_advantage", "penalty", "advantage"]


def fitted_scores(run: Path, params, iterations: list[int], method: str,
                  select: Callable[[pl.DataFrame], pl.DataFrame] | None = None
                  ) -> tuple[dict[int, pl.DataFrame], list[dict]]:
    """Replay the fit stage of `method` (one with a step-reward model) over the run's iterations, from its initial
    policy, exactly as the fit stage calls it; returns the scores per iteration and the fit statistics (with
    `fit_s`, the seconds of each iteration's fit and scoring). `select` keeps part of each iteration's turns."""
    from pipeline.credit.reward_model import fit_iteration  # start-up cost: torch

    model = METHODS[method].reward_model
    p = params.model_copy(update={"credit": params.credit.model_copy(update={"method": method})})
    ckpt = lambda i: run / f"iter_{i}" / "checkpoint"  # noqa: E731
    state = model.init(ckpt(0), p)
    out, stats = {}, []
    for it in iterations:
        steps = read_table(run / f"iter_{it}" / "steps.parquet", STEPS)
        steps = (select(steps) if select is not None else steps).sort("episode_id", "step")
        say = lambda m, it=it: print(f"  {method} fit, iteration {it}: {m}", flush=True)  # noqa: E731
        t0 = time.perf_counter()
        scores, s = fit_iteration(model, state, steps, ckpt(it - 1), ckpt(0), it, p, log=say)
        s = {**s, "fit_s": time.perf_counter() - t0}
        out[it] = steps.select("episode_id", "step").with_columns(pl.Series("score", scores))
        stats.append({"method": method, "iteration": it, **s})
        say(", ".join(f"{k} {v:.4g}" for k, v in s.items()))
    return out, stats


def position_baselines(labelled: pl.DataFrame) -> list[dict]:
    """ROC-AUC of rankings by position alone over the judged turns of `labelled` (a step table with the oracle's
    `good`): the turns left in the episode after each turn, and the same with ties broken by the episode's success
    (+0.5 on the turns of a successful episode, below one turn's step, so position decides first)."""
    left = pl.col("step").max().over("episode_id") - pl.col("step")
    judged = labelled.with_columns(left.alias("turns_left")).filter(pl.col("good").is_not_null())
    valid = judged.filter(pl.col("action_valid"))
    auc = lambda t, score: roc_auc(t.select(score).to_series().to_numpy(), t["good"].to_numpy())  # noqa: E731
    return [{"baseline": name, "auc": auc(judged, score), "auc_valid": auc(valid, score)}
            for name, score in (("turns_left", pl.col("turns_left").cast(pl.Float64)),
                                ("turns_left_then_success",
                                 pl.col("turns_left") + 0.5 * pl.col("success").cast(pl.Float64)))]


def terms_by_turn(turns: pl.DataFrame) -> pl.DataFrame:
    """Each method's two terms by the turn's position in its episode (`step`, from 0), from the rows of
    credit_quality_turns.parquet: the turns, the share with a non-zero step term, the mean size of each term, their
    correlation (null where either is constant) and, of the turns with a step term, the share whose step term has
    the episode term's sign. Where a step term mostly repeats the outcome at some positions, it weights those turns
    more than the others, which an episode-level method cannot."""
    e, s = pl.col("episode_advantage"), pl.col("step_advantage")
    with_step = s != 0
    return (turns.group_by("method", "step", maintain_order=True)
            .agg(pl.len().alias("turns"), with_step.mean().alias("share_step_term"),
                 e.abs().mean().alias("mean_abs_episode_term"), s.abs().mean().alias("mean_abs_step_term"),
                 pl.when((e.std() > 0) & (s.std() > 0)).then(pl.corr(e, s)).alias("corr_terms"),
                 (e.sign() == s.sign()).filter(with_step).mean().alias("step_term_agrees"))
            .sort("method", "step", maintain_order=True))


def run(run_dir: Path, params_file: Path, out_dir: Path, methods: list[str], log: bool = True,
        sets: list[str] = (), last: int | None = None) -> pl.DataFrame:
    params = load_params(params_file, list(sets))
    spec = env_spec(params.env)
    lacking = {m: spec.lacking(METHODS[m].requires) for m in methods}
    for method in [m for m in methods if lacking[m]]:
        print(f"{method}: left out, it reads {', '.join(lacking[method])}(), which the {spec.name} environment "
              "does not give", flush=True)
    methods = [m for m in methods if not lacking[m]]
    iterations = iterations_with(run_dir, "steps.parquet")
    iterations = [i for i in iterations if last is None or i <= last]
    if not iterations:
        raise FileNotFoundError(f"{run_dir}: no iter_*/steps.parquet; run the pipeline first")
    if iterations != list(range(1, iterations[-1] + 1)):
        raise ValueError(f"{run_dir}: iterations {iterations} are not consecutive from 1")
    tables = {}
    for it in iterations:
        steps = read_table(run_dir / f"iter_{it}" / "steps.parquet", STEPS).sort("episode_id", "step")
        groups = build_groups(steps, history_depth(params.credit, params.prompt.history_turns)).drop("task_group")
        labelled = pl.concat([steps, oracle_replay(steps, params.env)], how="horizontal")
        tables[it] = labelled.join(groups, on=["episode_id", "step"], maintain_order="left")
    labelled = pl.concat(list(tables.values()))
    n_good = int((labelled["good"] == 1).sum())
    n_bad = int((labelled["good"] == 0).sum())
    print(f"{labelled.height} turns of iterations {iterations[0]}..{iterations[-1]}: {n_good} good, {n_bad} bad, "
          f"{labelled.height - n_good - n_bad} neutral", flush=True)
    baselines = position_baselines(labelled)
    print("rankings by position alone: " + "; ".join(f"{b['baseline']} ROC-AUC {b['auc']:.3f} (valid turns alone "
                                                     f"{b['auc_valid']:.3f})" for b in baselines), flush=True)
    rows, by_iteration, fit_stats, turns = [], [], [], []
    for method in methods:
        scores, kind = {}, None
        if METHODS[method].fits:
            kind = METHODS[method].reward_model.score_kind
            scores, s = fitted_scores(run_dir, params, iterations, method)
            fit_stats.extend(s)
        cfg = params.credit.model_copy(update={"method": method})
        parts = []
        for it, table in tables.items():
            t = table.join(scores[it], on=["episode_id", "step"]) if scores else table
            extra = ("good", "distance", "action_valid", "action", "reward", *(("score",) if scores else ()))
            adv = compute_advantages(t, cfg).join(t.select("episode_id", "step", *extra), on=["episode_id", "step"])
            by_iteration.append({"method": method, "iteration": it, **score_advantages(adv, kind)})
            parts.append(adv.with_columns(pl.lit(method).alias("method"), pl.lit(it, pl.Int32).alias("iteration")))
        scored = pl.concat(parts)
        rows.append({"method": method, **score_advantages(scored, kind), "good": n_good, "bad": n_bad})
        turns.append(scored.select(TURN_COLUMNS))
        per_it = ", ".join(f"{r['auc_step_term']:.3f}" for r in by_iteration if r["method"] == method)
        own = "" if kind is None else f"; its {kind} model's own score {rows[-1]['auc_score']:.3f}"
        print(f"{method:>6}: ROC-AUC {rows[-1]['auc']:.3f} (step term alone {rows[-1]['auc_step_term']:.3f}; by "
              f"iteration {per_it}), non-zero step signal on {rows[-1]['share_nonzero_step_signal']:.0%} of turns"
              f"{own}; valid turns alone {rows[-1]['auc_valid']:.3f} (step term "
              f"{rows[-1]['auc_step_term_valid']:.3f})", flush=True)
    df = pl.DataFrame(rows, infer_schema_length=None)
    per_it_df = pl.DataFrame(by_iteration, infer_schema_length=None)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "credit_quality.csv", out_dir / "credit_quality_by_iteration.csv",
             out_dir / "credit_quality.png", out_dir / "credit_quality_baselines.csv"]
    write_text_atomic(files[0], df.write_csv())
    write_text_atomic(files[1], per_it_df.write_csv())
    write_text_atomic(files[3], pl.DataFrame(baselines).write_csv())
    scored_turns = pl.concat(turns)
    files.append(out_dir / "credit_quality_turns.parquet")
    with atomic_file(files[-1]) as tmp:
        scored_turns.write_parquet(tmp)
    by_turn = terms_by_turn(scored_turns)
    files.append(out_dir / "credit_quality_terms_by_turn.csv")
    write_text_atomic(files[-1], by_turn.write_csv())
    files.append(out_dir / "credit_quality_terms_by_turn.png")
    plot_terms_by_turn(by_turn, files[-1], f"{labelled.height} turns, iterations {iterations[0]}-{iterations[-1]}")
    if fit_stats:
        files.append(out_dir / "credit_quality_fit.csv")
        write_text_atomic(files[-1], pl.DataFrame(fit_stats, infer_schema_length=None).write_csv())
    plot(df, per_it_df, files[2], f"{labelled.height} turns, iterations {iterations[0]}-{iterations[-1]}",
         baselines)
    print("wrote " + ", ".join(str(f) for f in files))
    if log:

        metrics = {}
        for r in rows:
            metrics.update({f"{r['method']}_auc": r["auc"], f"{r['method']}_auc_step_term": r["auc_step_term"],
                            f"{r['method']}_auc_valid": r["auc_valid"],
                            f"{r['method']}_auc_step_term_valid": r["auc_step_term_valid"],
                            f"{r['method']}_share_nonzero_step_signal": r["share_nonzero_step_signal"]})
            if r.get("auc_score") is not None:
                metrics[f"{r['method']}_auc_score"] = r["auc_score"]
        metrics.update({f"baseline_{b['baseline']}_auc": b["auc"] for b in baselines})
        log_run("credit_quality", {"run": str(run_dir.resolve()), "params": str(params_file.resolve()),
                                   "iterations": f"{iterations[0]}-{iterations[-1]}", "turns": labelled.height,
                                   "good": n_good, "bad": n_bad, "set": " ".join(sets)},
                {k: v for k, v in metrics.items() if not math.isnan(v)}, files)
    return df


def plot(df: pl.DataFrame, per_it: pl.DataFrame, path: Path, subtitle: str, baselines: list[dict] = ()) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=120)
    x = np.arange(df.height)
    axes[0].bar(x - 0.2, df["auc"].fill_nan(0.5).to_numpy(), width=0.4, color="tab:blue", label="advantage")
    axes[0].bar(x + 0.2, df["auc_step_term"].fill_nan(0.5).to_numpy(), width=0.4, color="tab:green",
                label="step term alone")
    axes[0].set_ylabel("ROC-AUC vs oracle (good vs bad turns)")
    for b, style in zip(baselines, (":", "-.")):
        if not math.isnan(b["auc"]):
            axes[0].axhline(b["auc"], color="tab:red", lw=1.0, ls=style, label=f"{b['baseline']} (no credit)")
    axes[0].legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    for method in per_it["method"].unique(maintain_order=True).to_list():
        d = per_it.filter(pl.col("method") == method)
        if d["share_nonzero_step_signal"].max() > 0:
            axes[1].plot(d["iteration"], d["auc_step_term"].fill_nan(0.5), marker="o", label=method)
    axes[1].set_xlabel("iteration")
    axes[1].set_ylabel("ROC-AUC of the step term")
    axes[1].legend(fontsize=7)
    for ax in axes[:2]:
        ax.axhline(0.5, color="grey", lw=0.8, ls="--")
        ax.set_ylim(0.2, 1.0)
    axes[2].bar(x, df["share_nonzero_step_signal"].to_numpy(), color="tab:orange")
    axes[2].set_ylim(0, 1)
    axes[2].set_ylabel("share of turns with a step-level signal")
    for ax in (axes[0], axes[2]):
        ax.set_xticks(x, df["method"].to_list())
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Credit quality on identical rollouts ({subtitle})", fontsize=9)
    save_figure(fig, path, tight_box=True)


def plot_terms_by_turn(by_turn: pl.DataFrame, path: Path, subtitle: str) -> None:
    """Per method with a step term: the mean size of its episode term and of its step term at each turn position,
    and the share of turns with a step term."""
    plt = pyplot()
    methods = by_turn.filter(pl.col("share_step_term") > 0)["method"].unique(maintain_order=True).to_list()
    fig, axes = plt.subplots(1, max(len(methods), 1), figsize=(4.2 * max(len(methods), 1), 3.6), dpi=120,
                             squeeze=False)
    for ax, method in zip(axes[0], methods):
        d = by_turn.filter(pl.col("method") == method)
        x = d["step"].to_numpy() + 1
        ax.bar(x, d["mean_abs_episode_term"].to_numpy(), color="tab:blue", label="episode term, mean |A^E|")
        ax.bar(x, d["mean_abs_step_term"].to_numpy(), bottom=d["mean_abs_episode_term"].to_numpy(),
               color="tab:green", label="step term, mean |A^S|")
        for xi, share, corr in zip(x, d["share_step_term"], d["corr_terms"]):
            ax.annotate(f"{share:.0%}\nr {corr:.2f}" if corr is not None else f"{share:.0%}", (xi, 0.02),
                        ha="center", fontsize=7, color="white")
        ax.set_xticks(x)
        ax.set_xlabel("turn of the episode")
        ax.set_title(method, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("mean size of the term")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"Each term's size by turn; in the bars the share of turns with a step term and its correlation "
                 f"with the episode term ({subtitle})", fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=None, help="a run's results folder (default: the params file's "
                    "run.dir, found as every tool finds it: docs/workflow.md, Where a run's outputs are)")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="the params file of that run")
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--methods", nargs="+", default=list(METHOD_NAMES), choices=METHOD_NAMES)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a params key for this benchmark, e.g. credit.oprl.lr=2e-4 (repeatable)")
    ap.add_argument("--last-iteration", type=int, default=None, help="use iterations 1..N of the run only")
    ap.add_argument("--no-mlflow", action="store_true", help="do not log the run to MLflow")
    args = ap.parse_args(argv)
    if args.run is None:
        args.run = run_folder(load_params(args.params), args.params)
    run(args.run, args.params, args.out, args.methods, log=not args.no_mlflow, sets=args.set,
        last=args.last_iteration)


if __name__ == "__main__":
    main()
