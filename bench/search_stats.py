"""What a search agent's run did, per iteration: held-out exact match overall and by question type and hops,
well-formed turns, and, from the training rollouts, searches per episode, answers given and the turns that share
their anchor state with another turn of their task group (the turns GiGPO's step groups can compare).

    python -m bench.search_stats --params configs/search.yaml          # the run of that params file
    python -m bench.search_stats --params P --run RUN_DIR --out DIR

Writes `search_stats.csv` (one row per iteration), `search_em_by_hops.csv` (held-out EM per iteration, question
type and hops) and `search_em.png` (held-out EM with a band of one standard error, EM by question type and hops,
and searches per training episode) into `--out` (default: the run's folder) and prints the tables.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

from pipeline.config.params import load_params
from pipeline.data.figures import pyplot, save_figure
from pipeline.data.tables import write_text_atomic
from pipeline.envs.base import make_env
from pipeline.workflow.runs import run_folder


def question_kinds(env, task_ids) -> pl.DataFrame:
    rows = []
    for t in dict.fromkeys(task_ids):
        q = env.question_of(t)
        rows.append({"task_id": t, "kind": q.kind or "unknown", "hops": q.hops if q.hops is not None else -1})
    return pl.DataFrame(rows, schema={"task_id": pl.Int64, "kind": pl.String, "hops": pl.Int64})


def iteration_stats(run: Path, env) -> tuple[pl.DataFrame, pl.DataFrame]:
    rows, by_hops = [], []
    for d in sorted(run.glob("iter_*"), key=lambda p: int(p.name.split("_")[1])):
        it = int(d.name.split("_")[1])
        row = {"iteration": it}
        if (d / "eval.parquet").is_file():
            ev = pl.read_parquet(d / "eval.parquet")
            ev = ev.join(question_kinds(env, ev["task_id"].to_list()), on="task_id")
            row |= {"heldout_episodes": ev.height, "heldout_em": ev["success"].mean(),
                    "heldout_well_formed": 1 - ev["invalid_turns"].sum() / ev["episode_length"].sum()}
            by_hops.append(ev.group_by("kind", "hops").agg(pl.len().alias("episodes"),
                                                           pl.col("success").mean().alias("em"))
                           .with_columns(pl.lit(it).alias("iteration")))
        if (d / "steps.parquet").is_file():
            st = pl.read_parquet(d / "steps.parquet", columns=["task_group", "episode_id", "anchor", "action",
                                                                "action_valid", "terminated"])
            per_ep = st.group_by("episode_id").agg(
                pl.col("action").str.starts_with("<search>").sum().alias("searches"),
                pl.col("terminated").any().alias("answered"))
            shared = st.group_by("task_group", "anchor").agg(pl.len().alias("n"))
            in_shared = st.join(shared, on=["task_group", "anchor"])["n"].gt(1).mean()
            row |= {"train_turns": st.height, "searches_per_episode": per_ep["searches"].mean(),
                    "answered": per_ep["answered"].mean(), "train_well_formed": st["action_valid"].mean(),
                    "turns_sharing_anchor": in_shared}
        rows.append(row)
    hops = (pl.concat(by_hops).select("iteration", "kind", "hops", "episodes", "em").sort("iteration", "kind", "hops")
            if by_hops else pl.DataFrame())
    return pl.DataFrame(rows), hops


def plot(stats: pl.DataFrame, hops: pl.DataFrame, title: str, path: Path) -> None:
    plt = pyplot()
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(14, 4), dpi=120)
    ev = stats.filter(pl.col("heldout_em").is_not_null()) if "heldout_em" in stats.columns else pl.DataFrame()
    if ev.height:
        x, em, n = ev["iteration"].to_numpy(), ev["heldout_em"].to_numpy(), ev["heldout_episodes"].to_numpy()
        se = (em * (1 - em) / n) ** 0.5
        left.plot(x, em, marker="o", label="held-out EM")
        left.fill_between(x, em - se, em + se, alpha=0.2, label="± one standard error")
        left.plot(x, ev["heldout_well_formed"].to_numpy(), ls="--", color="grey", label="turns well formed")
    left.set_ylim(0, 1.02)
    left.set_title(title)
    for (kind, h), d in hops.group_by("kind", "hops", maintain_order=True) if hops.height else []:
        d = d.sort("iteration")
        label = f"{kind}, {h} hop{'s' if h != 1 else ''} ({int(d['episodes'].max())} episodes)"
        mid.plot(d["iteration"].to_numpy(), d["em"].to_numpy(), marker=".", label=label)
    mid.set_ylim(0, 1.02)
    mid.set_title("held-out EM by question")
    train = stats.filter(pl.col("searches_per_episode").is_not_null()) if "searches_per_episode" in stats.columns \
        else pl.DataFrame()
    if train.height:
        right.plot(train["iteration"].to_numpy(), train["searches_per_episode"].to_numpy(), marker="o",
                   label="searches per episode")
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
    args = ap.parse_args(argv)
    params = load_params(args.params)
    if params.env.name != "search":
        raise SystemExit(f"error: {args.params}: env.name is {params.env.name!r}; bench.search_stats reads search runs")
    run = args.run or run_folder(params, args.params)
    stats, hops = iteration_stats(run, make_env(params.env))
    out = args.out or run
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "search_stats.csv", stats.write_csv(float_precision=4))
    write_text_atomic(out / "search_em_by_hops.csv", hops.write_csv(float_precision=4))
    with pl.Config(tbl_rows=100, tbl_cols=20, tbl_width_chars=200, float_precision=3):
        print(stats)
        print(hops.pivot(on="iteration", index=["kind", "hops"], values="em") if hops.height else hops)
    plot(stats, hops, f"{params.env.name}, {params.credit.method}: held-out exact match", out / "search_em.png")
    print(f"wrote {out / 'search_stats.csv'}, {out / 'search_em_by_hops.csv'} and {out / 'search_em.png'}")


if __name__ == "__main__":
    main()
