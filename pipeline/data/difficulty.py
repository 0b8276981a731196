"""Held-out success by difficulty: the evaluations' episodes split by the oracle's solution length
(`optimal_moves` of `eval.parquet`), with the tasks each iteration solves more or less often than the first. The
report stage writes it per run (`results/report/success_by_difficulty.*`), `bench.compare` per method."""

from __future__ import annotations

import polars as pl

from pipeline.data.figures import pyplot, save_figure

MAX_BUCKETS = 10   # solution lengths beyond this many distinct values are binned into ranges


def difficulty_buckets(lengths: list[int | None]) -> dict[int | None, str]:
    """A label for each optimal solution length: the length itself where there are at most MAX_BUCKETS distinct
    ones, else ranges of near-equal width ("4-6"); None (no oracle) is "all"."""
    known = sorted({x for x in lengths if x is not None})
    out: dict[int | None, str] = {None: "all"}
    if len(known) <= MAX_BUCKETS:
        return out | {x: str(x) for x in known}
    lo, hi = known[0], known[-1]
    width = -(-(hi - lo + 1) // MAX_BUCKETS)
    for x in known:
        a = lo + (x - lo) // width * width
        b = min(a + width - 1, hi)
        out[x] = str(a) if a == b else f"{a}-{b}"
    return out


def success_by_difficulty(episodes: pl.DataFrame) -> pl.DataFrame:
    """Held-out success per iteration and difficulty bucket (`difficulty_buckets` of the oracle's optimal number of
    moves from the start), from the evaluations' episode tables. A task's success is the share of its episodes
    solved; `tasks_up` / `tasks_down` count the bucket's tasks solved more / less often than at the first iteration
    (with one greedy episode a task: the tasks gained and lost)."""
    labels = difficulty_buckets(episodes["optimal_moves"].to_list())
    tasks = (episodes.group_by("iteration", "task_id")
             .agg(pl.col("optimal_moves").first(), pl.col("success").cast(pl.Float64).mean().alias("share"),
                  pl.len().alias("episodes"), pl.col("success").sum().alias("successes")))
    first = tasks.filter(pl.col("iteration") == tasks["iteration"].min()).select("task_id", share0="share")
    tasks = tasks.join(first, on="task_id", how="left").with_columns(
        pl.col("optimal_moves").replace_strict(labels, return_dtype=pl.String).alias("difficulty"))
    eps = 1e-9
    table = (tasks.group_by("iteration", "difficulty")
             .agg(pl.col("optimal_moves").min().alias("min_moves"), pl.len().alias("tasks"),
                  pl.col("episodes").sum(), pl.col("successes").sum(),
                  (pl.col("share") > pl.col("share0") + eps).sum().alias("tasks_up"),
                  (pl.col("share") < pl.col("share0") - eps).sum().alias("tasks_down"))
             .with_columns((pl.col("successes") / pl.col("episodes")).alias("success_rate")))
    return (table.sort("iteration", "min_moves", nulls_last=True)
            .select("iteration", "difficulty", "tasks", "episodes", "successes", "success_rate", "tasks_up",
                    "tasks_down"))


def plot_difficulty(table: pl.DataFrame, path, title: str) -> None:
    """A heatmap of success (difficulty x iteration, each cell "successes/episodes") over bars of the tasks solved
    more and less often than at the first iteration."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    its = sorted(set(table["iteration"].to_list()))
    rows = list(dict.fromkeys(table.filter(pl.col("iteration") == its[0])["difficulty"].to_list()))
    grid = np.full((len(rows), len(its)), np.nan)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(max(5.0, 1.6 + 0.62 * len(its)), 2.0 + 0.3 * len(rows) + 1.8),
                                 dpi=120, gridspec_kw={"height_ratios": [max(len(rows), 2), 5]})
    for r in table.iter_rows(named=True):
        i, j = rows.index(r["difficulty"]), its.index(r["iteration"])
        grid[i, j] = r["success_rate"]
        ax.text(j, i, f"{r['successes']}/{r['episodes']}", ha="center", va="center", fontsize=7,
                color="white" if r["success_rate"] < 0.5 else "black")
    ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, origin="lower")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xticks(range(len(its)), [str(i) for i in its])
    ax.set_ylabel("oracle's solution length" if rows != ["all"] else "tasks")
    ax.set_title(f"{title}\n(each cell: successes / episodes; brighter is higher)", fontsize=9)
    per_it = table.group_by("iteration").agg(pl.col("tasks_up").sum(), pl.col("tasks_down").sum()).sort("iteration")
    x = [its.index(i) for i in per_it["iteration"].to_list()]
    bx.bar(x, per_it["tasks_up"].to_list(), color="#2ca02c", label=f"tasks solved more often than at {its[0]}")
    bx.bar(x, [-v for v in per_it["tasks_down"].to_list()], color="#d62728", label="less often")
    bx.axhline(0, color="black", lw=0.6)
    bx.set_xlim(-0.5, len(its) - 0.5)
    bx.set_xticks(range(len(its)), [str(i) for i in its])
    bx.set_xlabel("iteration")
    bx.set_ylabel("tasks")
    bx.yaxis.set_major_locator(MaxNLocator(integer=True))
    bx.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    bx.grid(alpha=0.3, axis="y")
    save_figure(fig, path)
