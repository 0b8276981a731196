"""Benchmark: branching rollouts (ARPO) against independent episodes, at equal budget, paired seeds.

    python -m bench.branching --params params.yaml --modes none uniform entropy --methods grpo gigpo --seeds 0 1 \\
        --jobs 2 --cores 1 --work W --out OUT

One base run per seed makes the initial policy and its held-out evaluation (`results/iter_0/`); every arm (a
`rollout.branching.mode`, with `--mode-set` keys of its own) and method continues from it (`run.base`, through
iteration 0), so all runs of a seed share the initial policy and the held-out tasks, and the runs of one arm sample
the same first rollout. `--mode-set entropy:rollout.group_size=K` gives a branching arm as many sampled turns as
the plain one instead of as many episodes (`--label` names such an arm). Output in `--out`:

- branching_curves.csv: held-out success per arm (mode, method), seed and iteration;
- branching_rollouts.csv: per arm, seed and iteration, from the step tables and the rollout's benchmark file and log:
  episodes, sampled and shared turns and tool calls per task, branches and their mean first sampled turn (where the
  branch points fall), the rollout's wall seconds (the stage) and
  its rounds of generation and their seconds (sampling and stepping, without start-up), the share of
  branch points in one step group and of sampled turns with a step signal (`pipeline.rollout.branching`), and the
  oracle credit AUC of the advantages trained on (`pipeline.credit.oracle.run_credit`, where the environment has an
  oracle);
- branching.csv: per arm, the means over seeds and iterations of those, with the final and mean held-out success;
- branching_verdicts.csv: per method, each branching arm against plain and each entropy arm against the uniform
  arm with the same `--mode-set` keys (the same budget): the paired difference in final and mean held-out success
  with its 95 % interval, p-values and verdict (`bench.verdicts`, docs/statistics.md);
- branching_tasks.csv: held-out success per arm, method, seed, iteration and task (the verdicts' input);
- branching.png: the success curves per arm, and the sampled turns and tool calls per task.

`--merge DIR ...` pools the seeds of earlier benches (their `--out` folders, or copies of their CSV files) with
this one's: their curves, rollout rows and per-task success enter every table, verdict and the figure as if their
runs were in `--work`, so a seed run in another session joins the paired comparison. Each arm's runs of a seed
must come from one bench (a seed both here and in a merged folder is refused), so a paired difference never
compares runs of two machines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from functools import cache
from pathlib import Path

import polars as pl

from bench import log_run
from bench.learning import (
    BAND_WORDS,
    _params,
    _snakemake,
    _workflow,
    anchored,
    collect,
    continuing_run,
    curve_bands,
    run_side_by_side,
    write_run_params,
)
from bench.verdicts import compare_methods, task_success, verdict_frame
from pipeline.config.files import read_params
from pipeline.config.params import Params, apply_overrides, check_dependencies, load_params
from pipeline.credit.grouping import build_groups
from pipeline.credit.oracle import run_credit
from pipeline.data.figures import pyplot, save_figure
from pipeline.data.paths import iterations_with
from pipeline.data.tables import GROUPS, STEPS, read_table, write_text_atomic
from pipeline.envs.base import has, make_env, spec_of
from pipeline.rollout.branching import branch_point_groups, rollout_counts

MODES = ("none", "uniform", "entropy")
ROOT = Path(__file__).resolve().parents[1]


def run_all(params_file: Path, arms: dict[str, list[str]], methods: list[str], seeds: list[int], work: Path,
            jobs: int, cores: int, sets: list[str] = ()) -> None:
    """The base run of each seed (initial policy and its evaluation), then every arm's runs (`arms`: label -> its
    own overrides), `jobs` at a time."""
    for own in arms.values():   # every arm's params checked before any work
        check_dependencies(load_params(params_file, [*sets, *own]), params_file)
    uri = f"sqlite:///{ROOT / 'mlflow.db'}"
    plain = anchored(apply_overrides(read_params(params_file)[0], list(sets)))

    def base_run(seed: int) -> None:
        d = work / f"base_s{seed}"
        _workflow(d)
        write_run_params(d, _params(plain, methods[0], seed, uri))
        _snakemake(d, max(cores, cores * jobs // len(seeds)), "results/iter_0/eval.parquet")

    runs = []
    for label, own in arms.items():
        base = anchored(apply_overrides(read_params(params_file)[0], [*sets, *own]))
        runs += [continuing_run(work / label / f"{m}_s{s}", base, m, s, uri, work / f"base_s{s}", through=0)
                 for s in seeds for m in methods]
    run_side_by_side(base_run, seeds, runs, jobs, cores)


def rollout_rows(run: Path, arm: str, method: str, seed: int) -> list[dict]:
    """Per iteration of one run: the rollout's counts per task, its wall time and step-group coverage."""
    p = load_params(run / "params.yaml")
    tool_call = spec_of(p.env).tool_call
    results = run / "results"
    rows = []
    for it in iterations_with(results, "steps.parquet"):
        d = results / f"iter_{it}" / "steps.parquet"
        steps = read_table(d, STEPS)
        tasks = steps["task_group"].n_unique()
        counts = rollout_counts(steps, tool_call)
        groups = (read_table(d.parent / "groups.parquet", GROUPS) if (d.parent / "groups.parquet").is_file()
                  else build_groups(steps))
        bench_file = results / "benchmarks" / f"rollout_{it}.tsv"
        seconds = float(pl.read_csv(bench_file, separator="\t")["s"][0]) if bench_file.is_file() else None
        rounds, sampling = sampling_rounds(results / "logs" / f"rollout_{it}.log")
        row = {"arm": arm, "method": method, "seed": seed, "iteration": it,
               "episodes_per_task": steps["episode_id"].n_unique() / tasks,
               "sampled_turns_per_task": counts["sampled_turns"] / tasks,
               "shared_turns_per_task": counts["shared_turns"] / tasks, "branches_per_task": counts["branches"] / tasks,
               "branch_turn_mean": steps.filter(pl.col("step") == 0)["branch_turn"].mean(),
               "train_success": float(steps.group_by("episode_id").agg(pl.col("success").first())["success"].mean()),
               "rollout_seconds": seconds, "rounds": rounds, "sampling_seconds": sampling}
        if tool_call is not None:
            row |= {"sampled_tool_calls_per_task": counts["sampled_tool_calls"] / tasks,
                    "shared_tool_calls_per_task": counts["shared_tool_calls"] / tasks}
        row |= branch_point_groups(steps, groups)
        rows.append(row)
    frame = pl.DataFrame(rows)
    if has_oracle(p.env.model_dump_json()):
        credit = run_credit(results, p).select("iteration", pl.col("auc").alias("oracle_auc"),
                                               pl.col("auc_step_term").alias("oracle_auc_step_term"))
        frame = frame.join(credit, on="iteration", how="left")
    return frame.to_dicts()


@cache
def has_oracle(env_json: str) -> bool:
    """Whether the environment of these `env` params has an oracle: one environment made per report, not per run."""
    return has(make_env(Params(env=json.loads(env_json)).env), "oracle_distance")


_LINE = re.compile(r"^\[rollout\[\d+\]\s+([\d.]+)s\] (sampling with|turn (\d+):)")


def sampling_rounds(log: Path) -> tuple[int | None, float | None]:
    """From a rollout's log: its rounds of generation (the last `turn N:` line) and the seconds from the engine's
    start to the end of the last round (sampling and environment steps, without the stage's start-up)."""
    if not log.is_file():
        return None, None
    start = end = rounds = None
    for line in log.read_text().splitlines():
        m = _LINE.match(line)
        if m and m[3] is None:
            start = float(m[1])
        elif m:
            end, rounds = float(m[1]), int(m[3])
    return rounds, (end - start if start is not None and end is not None else None)


def collect_all(work: Path, arms: list[str], methods: list[str], seeds: list[int]) -> tuple[pl.DataFrame, ...]:
    curves, rollouts = [], []
    for arm in arms:
        c = collect(work / arm, methods, seeds).with_columns(pl.lit(arm).alias("arm"))
        curves.append(c)
        for m in methods:
            for s in seeds:
                rollouts += rollout_rows(work / arm / f"{m}_s{s}", arm, m, s)
    curves = pl.concat(curves).select("arm", "method", "seed", "iteration", "success_rate")
    return curves, pl.DataFrame(rollouts)


def summarise(curves: pl.DataFrame, rollouts: pl.DataFrame) -> pl.DataFrame:
    last = curves["iteration"].max()
    success = curves.group_by("arm", "method", "seed", maintain_order=True).agg(
        pl.col("success_rate").filter(pl.col("iteration") == last).first().alias("final"),
        pl.col("success_rate").mean().alias("auc")).group_by("arm", "method", maintain_order=True).agg(
        pl.len().alias("seeds"), pl.col("final").mean().alias("final_mean"), pl.col("final").std().alias("final_std"),
        pl.col("auc").mean().alias("auc_mean"))
    numeric = [c for c in rollouts.columns if c not in ("arm", "method", "seed", "iteration")]
    means = rollouts.group_by("arm", "method", maintain_order=True).agg(pl.col(numeric).mean())
    return success.join(means, on=["arm", "method"], how="left")


def control_pairs(arms: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(uniform arm, entropy arm) for every entropy arm and the uniform arm with the same overrides but the mode
    (`arms`: label -> its overrides, as `main` makes them): the entropy rule against its control at one budget."""
    mode = "rollout.branching.mode="

    def rest(label):
        return sorted(x for x in arms[label] if not x.startswith(mode))

    def of(label):
        return next((x[len(mode):] for x in arms[label] if x.startswith(mode)), "none")

    return [(u, e) for e in arms if of(e) == "entropy" for u in arms if of(u) == "uniform" and rest(u) == rest(e)]


def verdicts(runs: dict, arms: list[str], methods: list[str],
             controls: list[tuple[str, str]] = ()) -> tuple[pl.DataFrame, list[str]]:
    """Per method, every arm against the plain one (the first arm) and each entropy arm against its uniform
    control (`controls`, from `control_pairs`); `runs`: the runs' `task_success` tables keyed by ((method, arm),
    seed)."""
    found, panels = [], []
    for m in methods:
        tables = {(a, s): t for ((mm, a), s), t in runs.items() if mm == m}
        pairs = [(arms[0], [a for a in arms[1:]]), *((u, [e]) for u, e in controls)]
        for base, others in pairs:
            v, panel = compare_methods({k: t for k, t in tables.items() if k[0] in (base, *others)}, base)
            for x in v:
                x.method, x.sentence = f"{m}/{x.method}", f"{m}: {x.sentence}"
            found += v
            panels.append(f"{m}: {panel}")
    return verdict_frame(found), panels


def plot(curves: pl.DataFrame, rollouts: pl.DataFrame, path: Path, tasks: dict | None = None) -> None:
    """Held-out success per arm and method with `bench.learning.curve_bands`' band (± one standard deviation over
    seeds; on one seed ± one standard error over its held-out tasks, from `tasks`, the runs' `task_success` tables
    keyed by ((method, arm), seed)), and the turns and tool calls a task samples and copies."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), dpi=120)
    ax = axes[0]
    arms = curves["arm"].unique(maintain_order=True).to_list()
    colors = {a: f"C{k}" for k, a in enumerate(arms)}
    styles = {m: s for m, s in zip(curves["method"].unique(maintain_order=True).to_list(), ("-", "--", ":", "-."))}
    lines = curves.with_columns(pl.concat_list("method", "arm").list.join(", ").alias("line"))
    keyed = {(f"{m}, {a}", s): t for ((m, a), s), t in (tasks or {}).items()}
    agg = curve_bands(lines, key="line", tasks=keyed)
    for method in styles:
        for arm in arms:
            d = agg.filter(pl.col("line") == f"{method}, {arm}").sort("iteration")
            if d.height == 0:
                continue
            x, m, sd = d["iteration"].to_numpy(), d["m"].to_numpy(), d["s"].to_numpy()
            ax.plot(x, m, styles[method], color=colors[arm], marker="o", ms=3,
                    label=f"{method}, {arm} (n={int(d['n'].max())}; {BAND_WORDS[d['band'][0]]})")
            ax.fill_between(x, m - sd, m + sd, color=colors[arm], alpha=0.12)
    ax.set_xlabel("iteration")
    ax.set_xticks(sorted(curves["iteration"].unique().to_list()))   # whole iterations, however few
    ax.set_ylabel("held-out success rate")
    ax.set_title("Held-out success per arm, with its band")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1]
    per = rollouts.group_by("arm", "method", maintain_order=True).agg(pl.col("sampled_turns_per_task").mean(),
                                                                     pl.col("shared_turns_per_task").mean())
    labels = [f"{m}\n{a}" for a, m in zip(per["arm"], per["method"])]
    x = list(range(per.height))
    ax.bar(x, per["sampled_turns_per_task"], color=[colors[a] for a in per["arm"]], label="sampled turns")
    ax.bar(x, per["shared_turns_per_task"], bottom=per["sampled_turns_per_task"], color="lightgray",
           hatch="//", edgecolor="gray", label="shared (copied) turns")
    if "sampled_tool_calls_per_task" in rollouts.columns:
        calls = rollouts.group_by("arm", "method", maintain_order=True).agg(pl.col("sampled_tool_calls_per_task")
                                                                           .mean())
        ax.plot(x, calls["sampled_tool_calls_per_task"], "ko", label="sampled tool calls")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("per task and iteration (mean)")
    ax.set_title("Turns per task: sampled and copied from a parent")
    ax.set_ylim(0, 1.3 * float((per["sampled_turns_per_task"] + per["shared_turns_per_task"]).max()))
    ax.legend(fontsize=8, loc="upper right", ncol=3)   # above the bars: no marker hidden
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


MERGED = ("branching_curves.csv", "branching_rollouts.csv", "branching_tasks.csv")


def tasks_frame(runs: dict) -> pl.DataFrame:
    """The runs' `task_success` tables (keyed by ((method, arm), seed)) as one table."""
    return pl.concat([t.select(pl.lit(a).alias("arm"), pl.lit(m).alias("method"), pl.lit(s, pl.Int64).alias("seed"),
                               pl.col("iteration").cast(pl.Int64), pl.col("task_id").cast(pl.Int64), "success")
                      for ((m, a), s), t in runs.items()])


def merged(folders: list[Path], arms: list[str], methods: list[str], seeds: list[int]):
    """The curves, rollout rows and `task_success` tables of earlier benches' output folders, for this bench's
    arms and methods, refused with the file named where a table is missing or a seed is run twice."""
    curves, rollouts, runs = [], [], {}
    own = {(a, m, s) for a in arms for m in methods for s in seeds}
    for folder in folders:
        for name in MERGED:
            if not (folder / name).is_file():
                raise SystemExit(f"error: --merge {folder}: {name} is missing (a bench.branching output folder has "
                                 f"{', '.join(MERGED)})")
        c = pl.read_csv(folder / "branching_curves.csv").filter(pl.col("arm").is_in(arms),
                                                                 pl.col("method").is_in(methods))
        if c.height == 0:
            raise SystemExit(f"error: --merge {folder}: its branching_curves.csv has no run of the arms {arms} and "
                             f"methods {methods}")
        twice = sorted(own & set(c.select("arm", "method", "seed").unique().iter_rows()))
        if twice:
            raise SystemExit(f"error: --merge {folder}: arm, method and seed {twice[0]} are in this bench too; a "
                             "seed's runs must come from one bench")
        own |= set(c.select("arm", "method", "seed").unique().iter_rows())
        curves.append(c)
        rollouts.append(pl.read_csv(folder / "branching_rollouts.csv").filter(pl.col("arm").is_in(arms),
                                                                             pl.col("method").is_in(methods)))
        t = pl.read_csv(folder / "branching_tasks.csv").filter(pl.col("arm").is_in(arms),
                                                               pl.col("method").is_in(methods))
        for (a, m, sd), part in t.group_by("arm", "method", "seed"):
            runs[((m, a), sd)] = part.select("iteration", "task_id", "success")
    return curves, rollouts, runs


def report(work: Path, arms: list[str], methods: list[str], seeds: list[int], out: Path, log: bool = True,
           controls: list[tuple[str, str]] = (), merge: list[Path] = ()):
    curves, rollouts = collect_all(work, arms, methods, seeds) if seeds else (None, None)
    runs = {((m, a), s): task_success(work / a / f"{m}_s{s}" / "results") for m in methods for a in arms for s in seeds}
    more_curves, more_rollouts, more_runs = merged(list(merge), arms, methods, seeds)
    curves = pl.concat([c for c in (curves, *more_curves) if c is not None], how="vertical_relaxed")
    rollouts = pl.concat([r for r in (rollouts, *more_rollouts) if r is not None], how="diagonal_relaxed")
    runs |= more_runs
    table = summarise(curves, rollouts)
    verdict_table, panels = verdicts(runs, arms, methods, controls)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "branching_curves.csv", curves.write_csv())
    write_text_atomic(out / "branching_rollouts.csv", rollouts.write_csv())
    write_text_atomic(out / "branching_tasks.csv", tasks_frame(runs).sort("arm", "method", "seed", "iteration",
                                                                          "task_id").write_csv())
    write_text_atomic(out / "branching.csv", table.write_csv())
    if verdict_table.height:
        write_text_atomic(out / "branching_verdicts.csv", verdict_table.write_csv())
    plot(curves, rollouts, out / "branching.png", runs)
    with pl.Config(tbl_rows=30, tbl_cols=20, tbl_width_chars=220, float_precision=3):
        print(table)
    print("\n".join(panels))
    if verdict_table.height:
        print("\n".join(verdict_table["sentence"].to_list()))
    if log:
        log_run("branching", {"arms": arms, "methods": methods, "seeds": seeds, "work": str(work.resolve())},
                {f"{r['method']}_{r['arm']}_final_mean": r["final_mean"] for r in table.iter_rows(named=True)},
                [out / f for f in ("branching.csv", *MERGED, "branching_verdicts.csv", "branching.png")
                 if (out / f).exists()])
    return table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key in every run")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="the arms; the first is the "
                    "baseline of the verdicts")
    ap.add_argument("--label", nargs="+", default=None, help="a name per mode for its work folder (default: the "
                    "mode), e.g. to keep an equal-turns arm beside an equal-episodes one")
    ap.add_argument("--mode-set", action="append", default=[], metavar="MODE:KEY=VALUE",
                    help="override a key in one mode's runs only, e.g. entropy:rollout.group_size=12")
    ap.add_argument("--methods", nargs="+", default=["grpo", "gigpo"])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1], help="the seeds run in --work (none: a "
                    "report of --merge folders alone)")
    ap.add_argument("--work", type=Path, default=Path("results/bench/branching"))
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--no-mlflow", action="store_true")
    ap.add_argument("--merge", nargs="+", type=Path, default=[], metavar="DIR",
                    help="earlier benches' output folders whose seeds join this report")
    args = ap.parse_args(argv)
    if not args.seeds and not (args.report_only and args.merge):
        raise SystemExit("error: --seeds is empty; only a --report-only report of --merge folders needs no seeds")
    labels = args.label or list(args.modes)
    if len(labels) != len(args.modes):
        raise SystemExit(f"error: {len(labels)} labels for {len(args.modes)} modes")
    arms = {label: [f"rollout.branching.mode={mode}",
                    *(s.split(":", 1)[1] for s in args.mode_set if s.split(":", 1)[0] in (mode, label))]
            for mode, label in zip(args.modes, labels)}
    if not args.report_only:
        run_all(args.params, arms, args.methods, args.seeds, args.work, args.jobs, args.cores, args.set)
    report(args.work, labels, args.methods, args.seeds, args.out, log=not args.no_mlflow,
           controls=control_pairs(arms), merge=args.merge)


if __name__ == "__main__":
    main()
