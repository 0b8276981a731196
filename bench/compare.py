"""One comparison report of finished runs: learning, credit quality and cost, side by side, in one HTML page.

    python -m bench.compare params.yaml gigpo.yaml --out results/compare   # two runs of this checkout (run.dir)
    python -m bench.compare W/grpo_s0 W/gigpo_s0 W/grpo_s1 W/gigpo_s1 --out results/compare
    python -m bench.compare RUN... --out DIR --no-mlflow

Each RUN is a run's params file (its `run.dir` says where its outputs are), or a folder holding the
`params.yaml` a run ran with and its outputs. Runs are
grouped by `credit.method` (`--group-by KEY` takes another params key; `policy.dtype` groups a run of `auto` by
the dtype it resolved to) and told apart by `seed`, so several seeds of a group give a mean and a spread. The
page (DIR/report.html, self-contained: the plots are embedded PNGs) shows:

- the verdicts: each group against the baseline group (`--baseline`, GRPO by default, else the first): the paired
  difference in final held-out success and in the mean over the iterations the arms do not share, with a 95 %
  interval (a t-interval over seeds and the shared task panel), the exact sign-flip p-value over seeds (Holm-
  corrected within the primary and the secondary metrics), the equivalence test within ±5 points, and the verdict
  (better, worse, equivalent, or undecided with the seeds a decision is expected to need; `bench.verdicts`,
  docs/statistics.md; compare_verdicts.csv), on the held-out tasks every run played (the page says which);
- the held-out success curves, mean ± std over seeds (one seed: ± one standard error over its held-out tasks), and
  each method minus the baseline on the same seed (one seed: the paired 95 % interval over tasks);
- per iteration, the oracle credit quality of each run's own advantages (ROC-AUC of the advantage and of the step
  term for separating good from bad turns, docs/credit-assignment.md, Oracle credit) and the share of turns with a step
  signal, where the environment has an oracle;
- the held-out tasks each method solves more and less often than at iteration 0 (compare_difficulty.csv: by the
  oracle's solution length);
- the step-group size distribution (share of turns by the size of their anchor group);
- histograms of the episode term and the step term of the advantages;
- the time each stage took (Snakemake's benchmark files).

The tables behind the plots are written beside it (compare_*.csv). The report is logged to MLflow (experiment
`creditrl-bench`) as a parent run with one child run per compared run.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from bench import log_run
from bench.breakdown import collect
from bench.learning import plot, summarise
from bench.verdicts import compare_methods, evaluated_iterations, task_success, verdict_frame
from pipeline.config.params import load_params
from pipeline.credit.oracle import run_credit
from pipeline.data.difficulty import success_by_difficulty
from pipeline.data.figures import figure_base64, pyplot
from pipeline.data.paths import iterations_with
from pipeline.data.tables import ADVANTAGES, EVAL_EPISODES, GROUPS, read_table, write_text_atomic
from pipeline.envs.base import has, make_env
from pipeline.workflow.registry import param_value
from pipeline.workflow.runs import run_folder

SIZE_BINS = (("singleton", 1, 1), ("2-5", 2, 5), ("6-9", 6, 9), ("10+", 10, None))


def _short(value) -> str:
    """A group's name from a params value: strings as they are, a section as `key=value` pairs."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return ", ".join(f"{k}={_short(v)}" for k, v in value.items())
    return json.dumps(value)


class Run:
    """A finished run: its folder, params and results folder. `method` is the value of the params key the runs are
    grouped by (`credit.method` by default), `label` the folder's name."""

    def __init__(self, path: Path, group_by: str = "credit.method"):
        path = Path(path)
        params_file = path if path.is_file() else path / "params.yaml"
        if not params_file.is_file():
            raise FileNotFoundError(f"{path}: no params.yaml; give a run's params file, or a folder holding the "
                                    "params.yaml its stages ran with")
        self.folder = params_file.parent
        self.params = load_params(params_file)
        # a params file: the rule every tool shares (pipeline.workflow.runs); a folder: the run ran in it
        self.results = run_folder(self.params, params_file) if path.is_file() else self.folder / self.params.run.dir
        if not (self.results / "iter_0" / "eval_metrics.json").is_file():
            raise FileNotFoundError(f"{self.results}: no iter_0/eval_metrics.json; run the workflow there first")

        try:
            value = param_value(self.params, group_by)
        except (KeyError, TypeError):
            raise ValueError(f"--group-by {group_by}: not a key of {params_file}") from None
        record = self.results / "iter_0" / "checkpoint" / "precision.json"
        if group_by == "policy.dtype" and value == "auto" and record.is_file():
            value = json.loads(record.read_text())["dtype"]       # what `auto` resolved to on the run's machine
        self.method = _short(value)
        self.seed = self.params.seed
        self.label = self.params.run.dir if path.is_file() else self.folder.name

    def iterations(self) -> list[int]:
        return evaluated_iterations(self.results)


def curves(runs: list[Run]) -> pl.DataFrame:
    rows = [{"method": r.method, "seed": r.seed, "run": r.label, "iteration": it,
             "success_rate": json.loads((r.results / f"iter_{it}" / "eval_metrics.json").read_text())["success_rate"]}
            for r in runs for it in r.iterations()]
    return pl.DataFrame(rows)


def credit(runs: list[Run]) -> pl.DataFrame | None:
    """Oracle credit quality per run and iteration (`pipeline.credit.oracle.run_credit`); None when the environment
    has no oracle."""

    if not all(has(make_env(r.params.env), "oracle_distance") for r in runs):
        return None
    return pl.concat([run_credit(r.results, r.params).with_columns(
        pl.lit(r.method).alias("method"), pl.lit(r.seed).alias("seed"), pl.lit(r.label).alias("run"))
        for r in runs], how="diagonal_relaxed")


def terms(runs: list[Run]) -> pl.DataFrame:
    """Every turn's episode term, step term and step-group size, over all iterations of each run."""
    frames = []
    for r in runs:
        for it in iterations_with(r.results, "advantages.parquet"):
            d = r.results / f"iter_{it}"
            adv = read_table(d / "advantages.parquet", ADVANTAGES)
            groups = read_table(d / "groups.parquet", GROUPS).select("episode_id", "step", "step_group_size")
            frames.append(adv.join(groups, on=["episode_id", "step"]).select(
                "episode_advantage", "step_advantage", "step_group_size").with_columns(
                pl.lit(r.method).alias("method"), pl.lit(r.label).alias("run"),
                pl.lit(it).alias("iteration")))
    return pl.concat(frames)


def difficulty(runs: list[Run]) -> pl.DataFrame:
    """Held-out success by the oracle's solution length per run and iteration, with the tasks solved more or less
    often than at iteration 0 (`pipeline.data.difficulty`)."""
    return pl.concat([success_by_difficulty(pl.concat(
        [read_table(r.results / f"iter_{it}" / "eval.parquet", EVAL_EPISODES) for it in r.iterations()])).with_columns(
        pl.lit(r.method).alias("method"), pl.lit(r.seed).alias("seed"), pl.lit(r.label).alias("run"))
        for r in runs])


def plot_gained_lost(d: pl.DataFrame, colors) -> str:
    """Per iteration after the first, each method's held-out tasks solved more often (up) and less often (down)
    than at iteration 0, mean over seeds."""
    plt = pyplot()

    per = (d.filter(pl.col("iteration") > d["iteration"].min())
           .group_by("method", "run", "iteration").agg(pl.col("tasks_up").sum(), pl.col("tasks_down").sum())
           .group_by("method", "iteration").agg(pl.col("tasks_up").mean(), pl.col("tasks_down").mean()))
    its = sorted(set(per["iteration"].to_list()))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + 0.7 * len(its)), 3.6), dpi=110)
    width = 0.8 / len(colors)
    for i, (m, c) in enumerate(colors.items()):
        rows = {r["iteration"]: r for r in per.filter(pl.col("method") == m).iter_rows(named=True)}
        xs = [k + (i - (len(colors) - 1) / 2) * width for k in range(len(its))]
        ax.bar(xs, [rows[t]["tasks_up"] if t in rows else 0.0 for t in its], width, color=c, label=m)
        ax.bar(xs, [-rows[t]["tasks_down"] if t in rows else 0.0 for t in its], width, color=c, alpha=0.45)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(range(len(its)), [str(t) for t in its])
    ax.set_xlabel("iteration")
    ax.set_ylabel("held-out tasks")
    ax.set_title("Tasks solved more (solid) and less often (pale) than at iteration 0", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return figure_base64(fig)


def times(runs: list[Run]) -> pl.DataFrame:

    return pl.concat([collect(r.results).with_columns(pl.lit(r.method).alias("method"), pl.lit(r.label).alias("run"))
                      for r in runs])


def _colors(methods: list[str]) -> dict[str, str]:
    plt = pyplot()

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {m: cycle[i % len(cycle)] for i, m in enumerate(methods)}


def plot_credit(cr: pl.DataFrame, colors) -> str:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), dpi=110)
    agg = cr.group_by("method", "iteration").agg(
        *[e for k in ("auc", "auc_step_term", "share_nonzero_step_signal")
          for e in (pl.col(k).mean().alias(k), pl.col(k).std().fill_null(0.0).alias(k + "_sd"))]).sort("iteration")
    for ax, k, title in ((axes[0], "auc", "advantage"), (axes[1], "auc_step_term", "step term"),
                         (axes[2], "share_nonzero_step_signal", "turns with a step signal")):
        for m, c in colors.items():
            d = agg.filter(pl.col("method") == m)
            y = d[k].to_numpy().astype(float)
            if np.isnan(y).all():
                continue
            x, s = d["iteration"].to_numpy(), d[k + "_sd"].to_numpy()
            ax.plot(x, y, marker="o", color=c, label=m)
            ax.fill_between(x, y - s, y + s, color=c, alpha=0.12)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if k != "share_nonzero_step_signal":
            ax.axhline(0.5, color="black", lw=0.8, ls=":")
            ax.set_ylabel("oracle ROC-AUC (0.5: chance)")
        else:
            ax.set_ylabel("share of turns")
        ax.set_title(f"Oracle credit: {title}")
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    return figure_base64(fig)


def _grouped_bars(values: dict[str, list[float]], colors, labels: list[str], ylabel: str, title: str,
                  size: tuple[float, float], rotation: int = 0) -> str:
    """One bar per group side by side at each of `labels` (`values`: group -> a value per label), as a PNG."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=size, dpi=110)
    width = 0.8 / len(colors)
    for i, (m, c) in enumerate(colors.items()):
        xs = [k + (i - (len(colors) - 1) / 2) * width for k in range(len(labels))]
        ax.bar(xs, values[m], width, color=c, label=m)
    ax.set_xticks(range(len(labels)), labels, rotation=rotation)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return figure_base64(fig)


def plot_group_sizes(t: pl.DataFrame, colors) -> str:
    shares = {}
    for m in colors:
        sizes = t.filter(pl.col("method") == m)["step_group_size"].to_numpy()
        shares[m] = [float(((sizes >= lo) & ((sizes <= hi) if hi else True)).mean()) if len(sizes) else 0.0
                     for _, lo, hi in SIZE_BINS]
    return _grouped_bars(shares, colors, [f"{name} turns" for name, _, _ in SIZE_BINS], "share of turns",
                         "Step-group sizes: turns by the size of their anchor group", (7, 3.6))


def plot_terms(t: pl.DataFrame, colors) -> str:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), dpi=110)
    for ax, col, title in ((axes[0], "episode_advantage", "Episode term A^E"),
                           (axes[1], "step_advantage", "Step term (turns with one)")):
        values = {m: t.filter(pl.col("method") == m)[col].to_numpy() for m in colors}
        if col == "step_advantage":
            values = {m: v[v != 0] for m, v in values.items()}
        nonempty = [v for v in values.values() if len(v)]
        if not nonempty:
            ax.text(0.5, 0.5, "no method here has a step term", ha="center", va="center", transform=ax.transAxes)
        else:
            lo, hi = np.percentile(np.concatenate(nonempty), [0.5, 99.5])
            bins = np.linspace(lo, hi if hi > lo else lo + 1, 41)
            for m, v in values.items():
                if len(v):
                    ax.hist(np.clip(v, bins[0], bins[-1]), bins=bins, histtype="step", lw=1.5, density=True,
                            color=colors[m], label=f"{m} ({len(v):,} turns)")
            ax.legend(fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("value")
        ax.set_ylabel("density")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return figure_base64(fig)


def plot_times(tm: pl.DataFrame, colors) -> str:
    per = tm.group_by("method", "run", "stage").agg(pl.col("wall_s").sum()).group_by("method", "stage").agg(
        pl.col("wall_s").mean())
    stages = [s for s in ("init", "reward_init", "rollout", "group", "fit", "advantages", "update", "evaluate",
                          "report") if s in per["stage"].to_list()]
    walls = {}
    for m in colors:
        d = {r["stage"]: r["wall_s"] for r in per.filter(pl.col("method") == m).iter_rows(named=True)}
        walls[m] = [d.get(x, 0.0) for x in stages]
    return _grouped_bars(walls, colors, stages, "wall seconds per run (all iterations)", "Where each run's time went",
                         (8, 3.8), rotation=20)


def plot_curves(cv: pl.DataFrame, tables: dict, baseline: str) -> str:
    """The held-out success figure (`bench.learning.plot`), as an embedded PNG."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "curves.png"
        plot(cv.select("method", "seed", "iteration", "success_rate"), path, tables, baseline)
        return base64.b64encode(path.read_bytes()).decode()


def _table(df: pl.DataFrame) -> str:
    def cell(v):
        if v is None or (isinstance(v, float) and v != v):
            return ""
        return f"{v:.3f}" if isinstance(v, float) else html.escape(str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    rows = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in df.iter_rows())
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em;display:block;overflow-x:auto}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;display:block;margin:0.5em 0}
figure{margin:1.5em 0}figcaption{color:#555;font-size:0.9em}.note{color:#555}"""

# Counts the plots that rendered once the page has loaded (read by the test in headless Chromium).
RENDER_CHECK = """<script>window.addEventListener('load', () => { const imgs = [...document.images];
document.body.dataset.plots = imgs.length;
document.body.dataset.plotsRendered = imgs.filter(i => i.complete && i.naturalWidth > 0).length; });</script>"""


SUMMARY_HEADERS = {"method": "group", "seeds": "seeds", "final_mean": "final success", "final_std": "± (final)",
                   "auc_mean": "mean over iterations", "auc_std": "± (mean)", "gain_mean": "gain over iteration 0",
                   "gain_std": "± (gain)", "oracle_auc_advantage": "advantage's oracle AUC",
                   "oracle_auc_step_term": "step term's oracle AUC",
                   "share_nonzero_step_signal": "turns with a step signal",
                   "final_minus_grpo_mean": "final minus GRPO (same seed)", "final_minus_grpo_std": "± (vs GRPO)"}


def _readable(df: pl.DataFrame) -> pl.DataFrame:
    keep = [c for c in SUMMARY_HEADERS if c in df.columns]
    return df.select(keep).rename({c: SUMMARY_HEADERS[c] for c in keep})


VERDICT_HEADERS = {"method": "group", "baseline": "against", "metric": "metric", "primary": "primary",
                   "seeds": "seeds", "tasks": "tasks a seed", "diff": "difference (points)", "ci_low": "95 % CI low",
                   "ci_high": "95 % CI high", "p_value": "p (sign flip)", "p_adjusted": "p (Holm)",
                   "p_equivalence": "p (equivalence)", "seeds_for_power": "seeds to decide (estimate)",
                   "verdict": "verdict"}


def task_tables(runs: list[Run]) -> dict[tuple[str, int], pl.DataFrame]:
    """Every run's held-out success per task and iteration (`bench.verdicts.task_success`), keyed by (group, seed)."""
    return {(r.method, r.seed): task_success(r.results, r.iterations()) for r in runs}


def verdicts(tables: dict[tuple[str, int], pl.DataFrame], baseline: str) -> tuple[pl.DataFrame, str]:
    """Each group against `baseline` on the runs' held-out tasks (`bench.verdicts.compare_methods`)."""
    found, panel = compare_methods(tables, baseline)
    return verdict_frame(found), panel


def verdict_section(table: pl.DataFrame, panel: str) -> list[str]:
    if not table.height:
        return []
    items = "".join(f"<li>{html.escape(s)}</li>" for s in table["sentence"].to_list())
    readable = table.select(list(VERDICT_HEADERS)).rename(VERDICT_HEADERS)
    return [f"<h2>Verdicts against {html.escape(table['baseline'][0])}</h2>",
            f"<p class='note'>{html.escape(panel)} Each difference is the mean over seeds of the paired difference "
            "on the same seed, in points of held-out success; its 95 % interval is a t-interval whose standard "
            "error adds the spread over seeds and over the shared panel of tasks (one seed: the tasks only); p is "
            "the exact sign-flip permutation p-value over seeds (with n seeds it cannot go below 2 / 2<sup>n</sup>), "
            "Holm-corrected within the primary and within the secondary metric; better or worse when that p &lt; "
            "0.05 and the interval excludes 0, equivalent when two one-sided tests put the difference within ±5 "
            "points (5 seeds or more), else undecided (docs/statistics.md).</p>", f"<ul class='verdicts'>{items}</ul>", _table(readable)]


def page(runs: list[Run], summary: pl.DataFrame, vs: pl.DataFrame, figures: list[tuple[str, str, str]],
         verdict_parts: list[str] = ()) -> str:
    listing = pl.DataFrame([{"run": r.label, "group": r.method, "seed": r.seed, "iterations": max(r.iterations()),
                             "env": r.params.env.name, "outputs": str(r.results.resolve())} for r in runs])
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>creditrl: comparison of {len(runs)} runs"
             f"</title><style>{STYLE}</style></head><body>",
             f"<h1>Comparison of {len(runs)} runs</h1>", "<h2>Runs</h2>", _table(listing),
             "<h2>Summary per group</h2>",
             "<p class='note'>Mean and standard deviation over seeds: held-out success at the last iteration, the "
             "mean over iterations (area under the curve) and the gain over iteration 0; with an oracle, the mean "
             "ROC-AUC of each method's advantage and step term on its own runs.</p>", _table(_readable(summary))]
    if vs.height:
        parts += ["<p class='note'>Final success minus GRPO's on the same seed:</p>", _table(_readable(vs))]
    parts += list(verdict_parts)
    for title, caption, b64 in figures:
        parts.append(f"<figure><h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
                     f"src='data:image/png;base64,{b64}'><figcaption>{html.escape(caption)}</figcaption></figure>")
    parts.append(RENDER_CHECK + "</body></html>")
    return "\n".join(parts)


@dataclass
class Built:
    report: Path
    summary: pl.DataFrame
    runs: list[Run]
    curves: pl.DataFrame
    verdicts: pl.DataFrame     # empty with one group

    def __iter__(self):        # report, summary, runs = build(...)
        return iter((self.report, self.summary, self.runs))


def build(folders: list[Path], out: Path, group_by: str = "credit.method", baseline: str = "grpo") -> Built:
    """The comparison page and its tables in `out`; returns them."""

    runs = [Run(f, group_by) for f in folders]
    for r in runs:          # folders of the same name (W/s0/grpo, W/s1/grpo): their parent tells them apart
        if sum(x.label == r.label for x in runs) > 1:
            r.label = f"{r.folder.parent.name}/{r.folder.name}"
    pairs = [(r.method, r.seed) for r in runs]
    if len(set(pairs)) != len(pairs):
        dup = sorted({f"{m} (seed {s})" for m, s in pairs if pairs.count((m, s)) > 1})
        raise ValueError(f"several runs of {', '.join(dup)} by {group_by}; a group holds one run per seed (group by "
                         "the key that differs between them with --group-by)")
    cv = curves(runs)
    cr = credit(runs)
    t = terms(runs)
    tm = times(runs)
    dif = difficulty(runs)
    summary, vs = summarise(cv, cr)
    groups = list(dict.fromkeys(r.method for r in runs))
    tables = task_tables(runs)
    baseline = baseline if baseline in groups else groups[0]
    verdict_table, panel = verdicts(tables, baseline)
    colors = _colors(groups)
    figures = [("Held-out success", "Left: mean per method over seeds, with a band of ± one standard deviation over "
                "seeds, or, where a method ran one seed, ± one standard error over its held-out tasks. Right: each "
                f"method's success minus {baseline}'s on the same seed, ± one standard deviation over seeds, or on "
                "one seed the 95 % paired bootstrap interval over the held-out tasks.",
                plot_curves(cv, tables, baseline))]
    if dif["iteration"].n_unique() > 1:
        figures.append(("Tasks gained and lost", "Per iteration, the held-out tasks each method solves more often "
                        "and less often than at iteration 0 (a change in the mean can hide both); by the oracle's "
                        "solution length in compare_difficulty.csv.", plot_gained_lost(dif, colors)))
    if cr is not None:
        figures.append(("Credit quality against the oracle", "Per iteration, mean ± std over seeds: how well each "
                        "run's advantages (left) and step terms (middle) separate the turns that brought the goal "
                        "closer from those that did not, and the share of turns with a non-zero step term.",
                        plot_credit(cr, colors)))
    figures += [("Step groups", "Share of each method's turns whose anchor state is shared by that many turns of "
                 "its task group (GiGPO's step groups; singletons get no step credit).", plot_group_sizes(t, colors)),
                ("Advantage terms", "Distribution of the episode term and of the non-zero step terms over all "
                 "turns of all iterations.", plot_terms(t, colors)),
                ("Time", "Wall time of each stage, summed over the run's iterations, mean over seeds. A run counts "
                 "only the jobs it ran itself: those it linked from a base run (run.base) count for the base.",
                 plot_times(tm, colors))]
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "compare_curves.csv", cv.write_csv())
    write_text_atomic(out / "compare_summary.csv", summary.write_csv())
    if cr is not None:
        write_text_atomic(out / "compare_credit.csv", cr.write_csv())
    write_text_atomic(out / "compare_times.csv", tm.write_csv())
    write_text_atomic(out / "compare_difficulty.csv", dif.write_csv())
    if verdict_table.height:
        write_text_atomic(out / "compare_verdicts.csv", verdict_table.write_csv())
    else:                                 # one group: nothing to compare (and no earlier page's verdicts left)
        (out / "compare_verdicts.csv").unlink(missing_ok=True)
    report = out / "report.html"
    write_text_atomic(report, page(runs, summary, vs, figures, verdict_section(verdict_table, panel)))
    return Built(report, summary, runs, cv, verdict_table)


def log_mlflow(runs: list[Run], report: Path, summary: pl.DataFrame, cv: pl.DataFrame) -> str | None:
    """A parent run holding the page, with one child run per compared run (its folder, method, seed, curve)."""


    def child(r: Run):
        def add(client, exp_id, parent):
            from mlflow.entities import Metric, Param  # start-up cost: MLflow

            folder = str(r.results.resolve())
            rid = client.create_run(exp_id, run_name=r.label, tags={
                "mlflow.parentRunId": parent, "creditrl.run_dir": folder, "creditrl.method": r.params.credit.method,
                "creditrl.seed": str(r.seed)}).info.run_id
            ts = int(time.time() * 1000)
            d = cv.filter(pl.col("method") == r.method, pl.col("seed") == r.seed)
            client.log_batch(rid, params=[Param("run_dir", folder), Param("group", r.method),
                                          Param("seed", str(r.seed))],
                             metrics=[Metric("eval/success_rate", float(x["success_rate"]), ts, int(x["iteration"]))
                                      for x in d.iter_rows(named=True)])
            client.set_terminated(rid)
        return add

    return log_run("compare", {"runs": ", ".join(r.label for r in runs)},
                   {f"{r['method']}/final_mean": r["final_mean"] for r in summary.iter_rows(named=True)},
                   [report], children=[child(r) for r in runs])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="runs: params files, or folders holding params.yaml")
    ap.add_argument("--out", type=Path, default=Path("results/compare"))
    ap.add_argument("--group-by", default="credit.method", help="the params key whose value groups the runs (seeds "
                    "of one group give its spread), e.g. policy.lora to compare LoRA with full fine-tuning")
    ap.add_argument("--no-mlflow", action="store_true", help="do not log the report to MLflow")
    ap.add_argument("--baseline", default="grpo", help="the group every other one is compared with in the verdicts "
                    "(a value of --group-by's key; default grpo, else the first group)")
    args = ap.parse_args(argv)
    try:
        built = build(args.runs, args.out, args.group_by, args.baseline)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    with pl.Config(tbl_cols=20, tbl_width_chars=200, float_precision=3):
        print(built.summary)
    if built.verdicts.height:
        print("\n".join(built.verdicts["sentence"].to_list()))
    if not args.no_mlflow:
        log_mlflow(built.runs, built.report, built.summary, built.curves)
    print(f"wrote {built.report}")


if __name__ == "__main__":
    main()
