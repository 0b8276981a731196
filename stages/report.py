"""Stage `report`: the success-rate curve over iterations, as CSV and PNG, logged to the parent MLflow run, and
held-out success by the oracle's solution length with the tasks each iteration gained and lost against iteration 0
(where a method's gain or loss comes from: the short tasks or the long ones).

It is the last stage of an invocation, so it also marks the parent run finished.
"""

from __future__ import annotations

import json

import polars as pl

from pipeline.credit.oracle import run_credit
from pipeline.data import paths
from pipeline.data.difficulty import plot_difficulty, success_by_difficulty
from pipeline.data.figures import pyplot, save_figure
from pipeline.data.tables import EVAL_EPISODES, read_table, write_text_atomic
from pipeline.envs.base import has, make_env
from pipeline.model import adamw
from pipeline.workflow.cli import parse_args, stage_job
from pipeline.workflow.registry import made_at
from pipeline.workflow.tracking import Tracker


def load_curve(p) -> pl.DataFrame:
    rows = []
    for it in made_at(paths.EVAL_METRICS, p):
        path = paths.fill(paths.at(p, paths.EVAL_METRICS), it)
        try:
            rows.append(json.loads(open(path).read()))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: evaluation metrics of iteration {it} missing; run evaluate first")
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    return pl.DataFrame(rows).select("iteration", "success_rate", "mean_return", "mean_length",
                                     "invalid_action_rate", "episodes")


def plot_curve(curve: pl.DataFrame, path, title: str) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot(curve["iteration"], curve["success_rate"], marker="o", color="#1f77b4", label="success rate")
    ax.set_xlabel("iteration")
    ax.xaxis.get_major_locator().set_params(integer=True)   # whole iterations, not ticks at 0.5
    ax.set_ylabel("held-out success rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(curve["iteration"], curve["invalid_action_rate"], ls="--", color="#d62728", label="invalid actions")
    ax2.set_ylabel("invalid-action rate", color="#d62728")
    ax2.set_ylim(0, 1)
    ax.set_title(title)
    save_figure(fig, path)


def load_episodes(p) -> pl.DataFrame:
    """Every evaluated iteration's held-out episode table, in one (a missing or malformed one: `read_table`'s error)."""
    return pl.concat([read_table(paths.fill(paths.at(p, paths.EVAL), it), EVAL_EPISODES)
                      for it in made_at(paths.EVAL, p)])


def run_metrics(p, curve: pl.DataFrame, results) -> dict[str, float | None]:
    """The run in a few numbers (`results/report/metrics.json`, DVC's metrics): held-out success at the last
    iteration, its best, its mean over iterations and its gain over iteration 0; with `report.credit_oracle` and an
    environment oracle, the mean over iterations 1..N of the oracle ROC-AUC of the advantages the run trained on, of
    their step term, the share of turns with a step signal, and for a method with a learned per-turn model the
    oracle score of that model's output (`pipeline.credit.oracle`)."""
    s = curve["success_rate"]
    out = {"iterations": int(curve["iteration"].max()), "success_final": float(s[-1]), "success_best": float(s.max()),
           "success_mean": float(s.mean()), "success_gain": float(s[-1] - s[0])}
    if p.report.credit_oracle and has(make_env(p.env), "oracle_distance"):
        cr = run_credit(results, p).filter(pl.col("iteration") <= p.loop.iterations)
        for key, col in (("credit_auc", "auc"), ("credit_auc_step_term", "auc_step_term"),
                         ("credit_step_signal", "share_nonzero_step_signal"), ("credit_auc_score", "auc_score")):
            if col not in cr.columns:
                continue   # auc_score: only a method with a learned per-turn model has one
            value = cr[col].fill_nan(None).mean()
            out[key] = None if value is None else float(value)   # None: no turn both good and bad to rank
    return out


def main(argv=None) -> None:
    ctx = parse_args("report", per_iteration=False, argv=argv)
    p = ctx.params
    with stage_job(ctx):
        tracker = Tracker(p, "report", None)
        curve = load_curve(p)
        csv_path, png_path = (ctx.path(x) for x in paths.REPORT)
        write_text_atomic(csv_path, curve.write_csv())
        first, last = curve["success_rate"][0], curve["success_rate"][-1]
        plot_curve(curve, png_path, f"{p.env.name}, {p.credit.method}: {first:.2f} -> {last:.2f}")
        by_len = success_by_difficulty(load_episodes(p))
        dcsv, dpng = (ctx.path(x) for x in paths.REPORT_DIFFICULTY)
        write_text_atomic(dcsv, by_len.write_csv())
        plot_difficulty(by_len, dpng, f"{p.env.name}, {p.credit.method}: held-out success by solution length")
        metrics = run_metrics(p, curve, ctx.path(paths.ITER_DIR, 0).parent)
        write_text_atomic(ctx.path(paths.REPORT_METRICS), json.dumps(metrics, indent=2) + "\n")
        tracker.log_metrics({"report/success_first": first, "report/success_last": last}
                            | {f"report/{k}": v for k, v in metrics.items() if v is not None})
        tracker.log_artifact(csv_path, parent=True)
        tracker.log_artifact(png_path, parent=True)
        tracker.log_artifact(dpng, parent=True)
        tracker.finish("FINISHED", end_parent=True)
        for f in adamw.prune_finished(ctx.path(paths.ITER_DIR, 0).parent, p.runtime.keep_optimizer):
            ctx.log(f"runtime.keep_optimizer last: deleted {f}")
        ctx.log(f"wrote {csv_path}, {png_path} and {ctx.path(paths.REPORT_METRICS)}: success {first:.3f} at "
                f"iteration 0, {last:.3f} at the last" + "".join(f", {k} {v:.3f}" for k, v in metrics.items()
                                                      if "credit" in k and v is not None))
        print(curve)


if __name__ == "__main__":
    main()
