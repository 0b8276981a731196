"""What a tool-using agent's run did, per iteration: held-out success overall and by the environment's task labels
(the search environment's question type and hops, the SQL environment's hardness and database), well-formed
turns, and, from the training rollouts, tool calls per episode (searches, queries), answers given and the turns
that share their anchor state with another turn of their task group (the turns GiGPO's step groups can compare).

    python -m bench.task_stats --params configs/smollm2-search.yaml     # the run of that params file
    python -m bench.task_stats --params P --run RUN_DIR --out DIR
    python -m bench.task_stats --params configs/smollm2-sql.yaml --by hardness     # pooled over the databases

For an environment with task labels (`task_labels`) and tools (`EnvSpec.tool_call`). Writes `task_stats.csv`
(one row per iteration), `task_success_by_label.csv` (held-out success per iteration and label, or per the labels
named by `--by`, pooled over the others) and
`task_stats.png` (held-out success with a band of one standard error, success by label, and tool calls per
training episode) into `--out` (default: the run's folder) and prints the tables.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

from pipeline.config.params import load_params
from pipeline.data.figures import pyplot, save_figure
from pipeline.data.paths import iterations_with
from pipeline.data.tables import write_text_atomic
from pipeline.envs.base import make_env, require, spec_of
from pipeline.workflow.runs import run_folder


def task_labels(env, task_ids) -> pl.DataFrame:
    """One row per task: its id and the environment's labels of it."""
    rows = [{"task_id": t, **env.task_labels(t)} for t in dict.fromkeys(task_ids)]
    return pl.DataFrame(rows).with_columns(pl.col("task_id").cast(pl.Int64))


def iteration_stats(run: Path, env, tool_call, by: list[str] | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Per iteration of `run` (a run's results folder), and held-out success per iteration and label (the labels
    `by`, pooled over the others; None: all of them); `tool_call` says which executed actions call a tool
    (`EnvSpec.tool_call`)."""
    rows, by_label = [], []
    for it in iterations_with(run):
        d = run / f"iter_{it}"
        row = {"iteration": it}
        if (d / "eval.parquet").is_file():
            ev = pl.read_parquet(d / "eval.parquet")
            labels = task_labels(env, ev["task_id"].to_list())
            keys = [c for c in labels.columns if c != "task_id"]
            if by:
                unknown = [k for k in by if k not in keys]
                if unknown:
                    raise ValueError(f"--by {' '.join(unknown)}: not a task label of this environment (its labels: "
                                     f"{', '.join(keys)})")
                keys = list(by)
            ev = ev.join(labels, on="task_id")
            row |= {"heldout_episodes": ev.height, "heldout_success": ev["success"].mean(),
                    "heldout_well_formed": 1 - ev["invalid_turns"].sum() / ev["episode_length"].sum()}
            by_label.append(ev.group_by(keys).agg(pl.len().alias("episodes"),
                                                  pl.col("success").mean().alias("success"))
                            .with_columns(pl.lit(it).alias("iteration")))
        if (d / "steps.parquet").is_file():
            st = pl.read_parquet(d / "steps.parquet", columns=["task_group", "episode_id", "anchor", "action",
                                                                "action_valid", "terminated"])
            calls = pl.Series([bool(a is not None and tool_call(a)) for a in st["action"]])
            per_ep = st.with_columns(calls.alias("call")).group_by("episode_id").agg(
                pl.col("call").sum().alias("tool_calls"), pl.col("terminated").any().alias("answered"))
            shared = st.group_by("task_group", "anchor").agg(pl.len().alias("n"))
            in_shared = st.join(shared, on=["task_group", "anchor"])["n"].gt(1).mean()
            row |= {"train_turns": st.height, "tool_calls_per_episode": per_ep["tool_calls"].mean(),
                    "answered": per_ep["answered"].mean(), "train_well_formed": st["action_valid"].mean(),
                    "turns_sharing_anchor": in_shared}
        rows.append(row)
    if not by_label:
        return pl.DataFrame(rows), pl.DataFrame()
    labels = pl.concat(by_label, how="diagonal")
    keys = [c for c in labels.columns if c not in ("iteration", "episodes", "success")]
    return pl.DataFrame(rows), labels.select("iteration", *keys, "episodes", "success").sort("iteration", *keys)


def plot(stats: pl.DataFrame, labels: pl.DataFrame, title: str, path: Path) -> None:
    plt = pyplot()
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(14, 4), dpi=120)
    ev = stats.filter(pl.col("heldout_success").is_not_null()) if "heldout_success" in stats.columns \
        else pl.DataFrame()
    if ev.height:
        x, sr, n = ev["iteration"].to_numpy(), ev["heldout_success"].to_numpy(), ev["heldout_episodes"].to_numpy()
        se = (sr * (1 - sr) / n) ** 0.5
        left.plot(x, sr, marker="o", label="held-out success")
        left.fill_between(x, sr - se, sr + se, alpha=0.2, label="± one standard error")
        left.plot(x, ev["heldout_well_formed"].to_numpy(), ls="--", color="grey", label="turns well formed")
    left.set_ylim(0, 1.02)
    left.set_title(title)
    keys = [c for c in labels.columns if c not in ("iteration", "episodes", "success")]
    for values, d in labels.group_by(keys, maintain_order=True) if labels.height else []:
        d = d.sort("iteration")
        label = ", ".join(f"{k} {v}" for k, v in zip(keys, values)) + f" ({int(d['episodes'].max())} episodes)"
        mid.plot(d["iteration"].to_numpy(), d["success"].to_numpy(), marker=".", label=label)
    mid.set_ylim(0, 1.02)
    mid.set_title("held-out success by task label")
    train = stats.filter(pl.col("tool_calls_per_episode").is_not_null()) \
        if "tool_calls_per_episode" in stats.columns else pl.DataFrame()
    if train.height:
        right.plot(train["iteration"].to_numpy(), train["tool_calls_per_episode"].to_numpy(), marker="o",
                   label="tool calls per episode")
        right.plot(train["iteration"].to_numpy(), train["answered"].to_numpy(), marker="s", label="share answered")
    right.set_ylim(bottom=0)
    right.set_title("training rollouts")
    for ax in (left, mid, right):
        ax.set_xlabel("iteration")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", required=True, type=Path)
    ap.add_argument("--run", type=Path, help="the run's folder (default: the params' run.dir, docs/workflow.md)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--by", nargs="+", metavar="LABEL", help="held-out success per these task labels only, pooled "
                    "over the others (the SQL environment's: hardness, database)")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    env = make_env(params.env)
    try:
        require(env, "task_labels", "bench.task_stats")
        if spec_of(params.env).tool_call is None:
            raise ValueError(f"bench.task_stats counts tool calls, and environment {params.env.name!r} has none")
    except ValueError as e:
        raise SystemExit(f"error: {args.params}: {e}") from None
    run = args.run or run_folder(params, args.params)
    try:
        stats, labels = iteration_stats(run, env, spec_of(params.env).tool_call, args.by)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    out = args.out or run
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "task_stats.csv", stats.write_csv(float_precision=4))
    write_text_atomic(out / "task_success_by_label.csv", labels.write_csv(float_precision=4))
    keys = [c for c in labels.columns if c not in ("iteration", "episodes", "success")]
    with pl.Config(tbl_rows=100, tbl_cols=20, tbl_width_chars=200, float_precision=3):
        print(stats)
        print(labels.pivot(on="iteration", index=keys, values="success") if labels.height else labels)
    plot(stats, labels, f"{params.env.name}, {params.credit.method}: held-out success", out / "task_stats.png")
    print(f"wrote {out / 'task_stats.csv'}, {out / 'task_success_by_label.csv'} and {out / 'task_stats.png'}")


if __name__ == "__main__":
    main()
