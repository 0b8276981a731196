"""Benchmark: fp32 against bf16 on the same inputs, and where the update's time goes.

    python -m bench.precision --params configs/smollm2-sokoban.yaml --run RUN --iteration 1 --profile --out OUT
    python -m bench.precision --params configs/smollm2-sokoban.yaml --run RUN --jobs update@1 rollout@1 \
        evaluate@0 --repeats 2 --out OUT

`--profile`: one minibatch of the packed update (`update.minibatch_size` turns of iteration `--iteration`'s rollout,
drawn as the update draws them, their advantages and log-probs from the run) and, with `--warmstart-steps K`, K
steps of the warm start, each under `torch.profiler` in every dtype of `--dtypes`, from the checkpoint the update
starts from (LoRA adapters where `policy.lora` is set, as the update trains; AdamW as the update builds it), after
one unprofiled minibatch that warms the caches. Every operator's own time is put in a phase (forward, backward,
the optimiser step) and a kind (`kind`: matrix products, attention, gathers and copies, element-wise, the rest);
what no operator accounts for is Python and framework overhead. Writes `OUT/precision_profile.csv` (phase x kind x
dtype seconds) and `OUT/precision_top_ops.csv` (the 20 costliest operators per dtype and part). `--cpu-kernels
math flash` and `--frozen on off` profile the path attention's CPU kernel and the LoRA base's storage
(`pipeline.model.packing.ATTENTION`, `pipeline.model.policy.load_trainable`) each way, side by side.

`--jobs STAGE@I ...`: each job run as the workflow runs it (`python -m stages.<stage> --params ... --iteration I`)
in a scratch run folder per dtype whose inputs are links to the run's own outputs, the dtypes alternating, each
job `--repeats` times; its wall seconds from the start of the process to its end; `--code DIR ...` runs each job in
every given checkout as well (a worktree of an earlier commit: before against after), `--set KEY=VALUE` overrides
the params. An input the run lacks is made first, untimed, by the job that writes it (`fit@1 --set
credit.method=gae` on a GRPO run: its `reward_init`). Writes `OUT/precision_jobs.csv`.
`--learning BF16 FP32 [BF16 FP32 ...]`: whether bf16 learns as well as fp32, from finished runs (results
folders, or their per-task tables as `bench.verdicts.task_success` writes them; a bf16 and an fp32 run of each
seed): per seed the per-task difference of the held-out success averaged over iterations `--from-iteration`..
the last (the two runs' warm starts differ, so iteration 0 is not shared), then the mean over seeds with a
t-interval over seeds and the shared task panel (`bench.verdicts.standard_error`), and the non-inferiority verdict:
bf16 is not worse by `--margin` points or more where the one-sided 95 % lower bound
(the two-sided 90 % interval's) is above −margin; where it is not, how many seeds would be expected to show it at
the measured mean and spread (`seeds_to_show`, a simulation). Writes `OUT/precision_learning.csv`.
Every row names the CPU and its bf16 flags.
"""

from __future__ import annotations

import argparse
import csv
import math
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import polars as pl
import scipy.stats as sstats
import torch
import yaml

from bench import cpu_name
from bench.verdicts import MAX_SEEDS, POWER, evaluated_iterations, interval, standard_error, task_success
from pipeline.config.files import read_params
from pipeline.config.params import load_params, with_overrides
from pipeline.data.tables import ADVANTAGES, STEPS, read_table, write_text_atomic
from pipeline.model.precision import cpu_bf16_flags

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm", "aten::_mm")
ATTENTION = ("scaled_dot_product", "flash_attention", "_efficient_attention", "attention")
GATHER = ("aten::index", "aten::gather", "aten::cat", "aten::copy_", "aten::index_put", "aten::index_select",
          "aten::embedding", "aten::scatter", "aten::stack", "aten::clone", "aten::contiguous", "aten::_to_copy",
          "aten::to", "aten::masked_select", "aten::nonzero", "aten::unique", "aten::_unique", "aten::narrow_copy",
          "aten::slice_backward", "aten::select_backward", "aten::embedding_dense_backward", "aten::new_zeros",
          "aten::zero_", "aten::fill_", "aten::zeros", "aten::empty")
ELEMENTWISE = ("aten::add", "aten::mul", "aten::sub", "aten::div", "aten::silu", "aten::exp", "aten::log",
               "aten::rsqrt", "aten::pow", "aten::mean", "aten::sum", "aten::neg", "aten::sigmoid", "aten::where",
               "aten::clamp", "aten::minimum", "aten::maximum", "aten::softmax", "aten::_softmax", "aten::log_softmax",
               "aten::_log_softmax", "aten::sqrt", "aten::lerp", "aten::addcmul", "aten::addcdiv", "aten::_foreach",
               "aten::norm", "aten::linalg_vector_norm", "aten::cos", "aten::sin", "aten::abs", "aten::max",
               "aten::min", "aten::eq", "aten::ne", "aten::lt", "aten::gt", "aten::le", "aten::ge", "aten::rsub",
               "aten::threshold", "aten::mse", "aten::sign")
KINDS = ("matmul", "attention", "gather/copy", "elementwise", "other op")


def kind(name: str) -> str:
    """The kind of work an operator named `name` (as the profiler names it) does. Backward kernels are named after
    their forward (`MmBackward0` runs `aten::mm`), so the name alone decides; an attention's backward
    (`aten::_scaled_dot_product_flash_attention_for_cpu_backward`) is attention."""
    if any(a in name for a in ATTENTION):
        return "attention"
    base = name.split(".")[0]
    if base.rstrip("_") in MATMUL or base in MATMUL:
        return "matmul"
    if any(base == g or base.rstrip("_") == g or base.startswith(g + "_") for g in GATHER):
        return "gather/copy"
    if any(base == e or base.rstrip("_") == e or base.startswith(e + "_") for e in ELEMENTWISE):
        return "elementwise"
    return "other op"


def phase(event) -> str:
    """forward, backward or optimizer: whichever the profiler event runs under (its ancestors' names)."""
    e = event
    while e is not None:
        name = e.name
        if name.startswith(("Optimizer.step", "Optimizer.zero_grad")):
            return "optimizer"
        if name.startswith("autograd::engine::evaluate_function"):
            return "backward"
        e = e.cpu_parent
    return "forward"


def attribute(events, wall_s: float) -> tuple[dict[tuple[str, str], float], list[tuple[str, str, float, int]]]:
    """Seconds per (phase, kind) from the profiler's events (each operator's own time, without its children's),
    and ('overhead', 'python') for the wall time no operator accounts for; and every operator's (name, phase,
    seconds, calls), costliest first."""
    table: dict[tuple[str, str], float] = defaultdict(float)
    ops: dict[tuple[str, str], list] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or not e.name.startswith("aten::"):
            continue        # labels (record_function, autograd nodes) own no compute of their own here
        s = e.self_cpu_time_total / 1e6
        ph = phase(e)
        table[(ph, kind(e.name))] += s
        row = ops.setdefault((e.name, ph), [0.0, 0])
        row[0] += s
        row[1] += 1
    table[("overhead", "python")] = max(wall_s - sum(table.values()), 0.0)
    top = sorted(((n, ph, s, c) for (n, ph), (s, c) in ops.items()), key=lambda r: -r[2])
    return dict(table), top


def _minibatch(run: Path, it: int, n: int, seed: int):
    """`n` turns of iteration `it` with a response, drawn at random as the update draws a minibatch: their
    prompts, responses, advantages and the engine's log-probs as log pi_old (`Turns`)."""
    from pipeline.model.ppo import Turns

    steps = read_table(run / f"iter_{it}" / "steps.parquet", STEPS)
    adv = read_table(run / f"iter_{it}" / "advantages.parquet", ADVANTAGES)
    table = steps.join(adv, on=["episode_id", "step"]).filter(pl.col("response_ids").list.len() > 0)
    pick = torch.randperm(table.height, generator=torch.Generator().manual_seed(seed))[:2 * n].tolist()
    table = table[pick]
    return [Turns(t["prompt_ids"].to_list(), t["response_ids"].to_list(), t["advantage"].to_list(),
                  [torch.tensor(x, dtype=torch.float32) for x in t["response_logprobs"].to_list()])
            for t in (table[:n], table[n:2 * n])]


def profile_update(params, run: Path, it: int, dtype: str, frozen_low: bool = True) -> tuple[float, object]:
    """(wall seconds, profiler) of one minibatch of the update in `dtype`, after one that warms up; `frozen_low`:
    a LoRA base stored in the compute dtype (`load_trainable`)."""
    from pipeline.model import adamw
    from pipeline.model.policy import load_trainable
    from pipeline.model.ppo import ppo_update

    p = with_overrides(params, [f"policy.dtype={dtype}"])
    u = p.update
    start = run / f"iter_{it - 1}" / "checkpoint"
    model, tok = load_trainable(start, p.policy, p.runtime.device, seed=0, frozen_low_precision=frozen_low)
    opt = adamw.build([q for q in model.parameters() if q.requires_grad], u.lr, u.weight_decay)
    warm, timed = _minibatch(run, it, u.minibatch_size, p.seed)
    cfg = u.model_copy(update={"epochs": 1})
    args = {"cfg": cfg, "pad_id": tok.pad_token_id, "seed": 0, "temperature": p.rollout.temperature}
    ppo_update(model, opt, warm, **args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        ppo_update(model, opt, timed, **args)
        wall = time.perf_counter() - t0
    return wall, prof


def profile_warmstart(params, steps: int, dtype: str) -> tuple[float, object]:
    """(wall seconds, profiler) of `steps` warm-start steps in `dtype` from `policy.path`, after one unprofiled."""
    from pipeline.data.seeds import stage_seed
    from pipeline.model.gguf_import import load_pretrained
    from pipeline.rollout.warmstart import demonstrations, supervised_warmstart

    p = with_overrides(params, [f"policy.dtype={dtype}"])
    w = p.warmstart
    model, tok = load_pretrained(p.policy.path, dtype, p.runtime.device)
    demos = demonstrations(p, min(w.episodes, 20), w.random_action_share, stage_seed("init", p.seed), tasks=w.tasks)
    kw = {"batch_size": w.batch_size, "lr": w.lr_for(p.policy), "seed": 0, "packing": w.packing,
          "micro_batch_size": w.micro_batch_size, "micro_batch_tokens": w.micro_batch_tokens}
    supervised_warmstart(model, tok, demos, 1, **kw)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        supervised_warmstart(model, tok, demos, steps, **kw)
        wall = time.perf_counter() - t0
    return wall, prof


def machine() -> dict[str, str]:
    return {"cpu": cpu_name(), "bf16_flags": " ".join(cpu_bf16_flags()) or "none",
            "threads": str(torch.get_num_threads())}


def run_profiles(params, run: Path, it: int, dtypes: list[str], warmstart_steps: int, out: Path,
                 kernels: list[str], frozen: list[str]) -> None:
    """Profile each part in every dtype x CPU attention kernel x frozen-base storage, alternating."""
    from pipeline.model import packing

    rows, tops = [], []
    variants = [(d, k, f) for d in dtypes for k in kernels for f in frozen]
    parts = [("update minibatch", lambda d, f: profile_update(params, run, it, d, f == "on"))]
    if warmstart_steps:
        parts.append((f"warm start, {warmstart_steps} steps",
                      lambda d, f: profile_warmstart(params, warmstart_steps, d)))
    for part, fn in parts:
        for dtype, kernel, frz in variants:
            packing.ATTENTION["cpu_kernel"] = kernel
            wall, prof = fn(dtype, frz)
            table, top = attribute(prof.events(), wall)
            label = {"part": part, "dtype": dtype, "cpu_kernel": kernel, "frozen_low_precision": frz}
            print(f"{part}, {dtype}, {kernel} attention, frozen base in the compute dtype {frz}: {wall:.2f} s",
                  flush=True)
            for (ph, k), sec in sorted(table.items(), key=lambda kv: -kv[1]):
                rows.append({**label, "phase": ph, "kind": k, "seconds": round(sec, 4),
                             "share": round(sec / wall, 4), "wall_s": round(wall, 3), **machine()})
                print(f"  {ph:9s} {k:12s} {sec:7.2f} s  {100 * sec / wall:5.1f} %")
            for name, ph, sec, calls in top[:20]:
                tops.append({**label, "op": name, "phase": ph, "seconds": round(sec, 4), "calls": calls})
    packing.ATTENTION["cpu_kernel"] = "math"
    _write(out / "precision_profile.csv", rows)
    _write(out / "precision_top_ops.csv", tops)


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)
    print(f"wrote {path}")


def _scratch(params_file: Path, run: Path, dtype: str, job: str, where: Path, sets: list[str] = ()
             ) -> tuple[Path, list[str], list[list[str]]]:
    """A params file (`sets`: KEY=VALUE overrides) whose run folder (`where`) links every output of `run` except
    the job's own; the job's command line; and the command lines, untimed, of the jobs that make the inputs the
    run lacks (`prerequisites`: a fit's step-reward model of iteration 0 where the run used no learned model)."""
    from pipeline.config.params import apply_overrides
    from pipeline.workflow.registry import STAGE_BY_NAME
    from pipeline.workflow.runs import _link, job_paths

    stage_name, _, it = job.partition("@")
    if stage_name not in STAGE_BY_NAME:
        raise SystemExit(f"--jobs {job}: no stage {stage_name!r}; expected one of {', '.join(STAGE_BY_NAME)}")
    raw = read_params(params_file)[0]
    raw.setdefault("policy", {})["dtype"] = dtype
    raw.setdefault("run", {})["dir"] = str(where)
    raw["run"].pop("base", None)
    raw.setdefault("tracking", {})["enabled"] = False
    raw = apply_overrides(raw, list(sets), "--set")
    if where.exists():
        shutil.rmtree(where)
    where.mkdir(parents=True)
    f = where.parent / f"{where.name}.yaml"
    f.write_text(yaml.safe_dump(raw))
    p = load_params(f)
    stage, it = STAGE_BY_NAME[stage_name], int(it) if it else None
    outs = job_paths(stage, p, it, stage.outs_for(p))
    for child in sorted(run.iterdir()):
        if child.name.startswith("iter_"):
            _link(child, where / child.name)
    for o in outs:
        o = Path(o)
        if o.is_dir() and not o.is_symlink():
            shutil.rmtree(o)
        elif o.exists() or o.is_symlink():
            o.unlink()
    # iteration 0's record would carry the source run's dtype: the scratch run computes in its own
    (where / "iter_0" / "checkpoint" / "precision.json").unlink(missing_ok=True)
    return f, _command(stage, f, it), prerequisites(p, f, stage, it)


def _command(stage, params_file: Path, it: int | None) -> list[str]:
    return [sys.executable, "-m", f"stages.{stage.base}", "--params", str(params_file)] + (
        [] if it is None else ["--iteration", str(it)])


def prerequisites(p, params_file: Path, stage, it: int | None) -> list[list[str]]:
    """The command lines of the jobs that write the inputs of `stage` at `it` missing from the run folder of `p`,
    in pipeline order (one level: their own inputs must be there)."""
    from pipeline.workflow.runs import job_paths, ordered_jobs

    missing = {x for x in job_paths(stage, p, it, stage.deps_templates(p)) if not Path(x).exists()}
    return [_command(other, params_file, i) for other, i in ordered_jobs(p, p.loop.iterations)
            if missing & set(job_paths(other, p, i, other.outs_for(p)))]


def run_jobs(params_file: Path, run: Path, jobs: list[str], dtypes: list[str], repeats: int, scratch: Path,
             out: Path, sets: list[str], codes: list[Path]) -> None:
    """Each job in every dtype and checkout of the code (`codes`: folders whose `stages` run the job, this one
    by default), alternating, `repeats` times."""
    rows = []
    variants = [(d, c) for c in codes for d in dtypes]
    for job in jobs:
        for r in range(repeats):
            for dtype, code in (variants if r % 2 == 0 else variants[::-1]):    # alternating: drift hits all
                tag = f"{job.replace('@', '_')}_{dtype}" + (f"_{code.name}" if len(codes) > 1 else "")
                _, cmd, before = _scratch(params_file, run, dtype, job, scratch / tag, sets)
                for pre in before:                     # untimed: what the run lacks for this job
                    done = subprocess.run(pre, capture_output=True, text=True, check=False, cwd=code)
                    if done.returncode != 0:
                        raise SystemExit(f"{' '.join(pre)} (in {code}), made before {job}, failed:\n"
                                         f"{done.stderr[-3000:]}")
                t0 = time.perf_counter()
                r_ = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=code)
                wall = time.perf_counter() - t0
                if r_.returncode != 0:
                    raise SystemExit(f"{' '.join(cmd)} (in {code}) failed:\n{r_.stderr[-3000:]}")
                print(f"{job} {dtype} {code} repeat {r}: {wall:.1f} s", flush=True)
                rows.append({"job": job, "dtype": dtype, "code": str(code), "repeat": r, "wall_s": round(wall, 2),
                             **machine()})
    _write(out / "precision_jobs.csv", rows)


def noninferiority(per_task: list[np.ndarray], margin: float = 5.0) -> dict:
    """bf16 − fp32 from each seed's per-task differences (points): the mean, its standard error over seeds and the
    task panel, the one-sided 95 % lower bound and whether it clears −`margin`; and, from 2 seeds on, how many
    seeds would be expected to clear it (`seeds_to_show`) at the measured mean and spread."""
    per_task = [np.asarray(x, dtype=np.float64) for x in per_task]
    means = np.array([x.mean() for x in per_task])
    mean = float(means.mean())
    se, df, covers = standard_error(per_task)
    low, high = interval(mean, se, df, 0.90)
    shown = bool(math.isfinite(low) and low > -margin)
    need = None
    if len(means) >= 2 and len({len(x) for x in per_task}) == 1:
        d = np.stack(per_task)                               # seeds x tasks, one shared panel
        n, t = d.shape
        by_task = float(d.mean(axis=0).var(ddof=1)) / t if t > 1 else 0.0
        crossed = float((d - d.mean(axis=1, keepdims=True)).var(axis=0, ddof=1).mean()) / t if t > 1 else 0.0
        need = seeds_to_show(mean, float(means.std(ddof=1)), margin, max(by_task - crossed / n, 0.0), crossed)
    return {"seeds": len(per_task), "mean": mean, "se": se, "df": df, "lower_95_one_sided": low,
            "upper_95_one_sided": high, "margin": margin, "covers": covers, "not_worse": shown,
            "seeds_to_show": need}


def seeds_to_show(mean: float, sd: float, margin: float, panel: float = 0.0, panel_per_seed: float = 0.0,
                  power: float = POWER, sims: int = 4000, seed: int = 0) -> int | None:
    """The fewest seeds n at which the one-sided 95 % lower bound is expected to clear −`margin` with probability
    `power`, the per-seed differences normal with this `mean` and `sd`: a simulation of `sims` experiments a size.
    The bound is `bench.verdicts.standard_error`'s: t with n − 1 degrees of freedom over the seeds' means, plus the
    task panel's variance, here `panel + panel_per_seed / n` (the tasks' own spread of the difference, which more
    seeds do not average away, and the task-by-seed noise, which they do; `noninferiority` estimates both from the
    seeds measured). None where no number of seeds is expected to (with many the bound tends to
    mean − 1.645 sqrt(panel)) or more than `MAX_SEEDS` would. An estimate, as `bench.verdicts.seeds_to_decide` is."""
    if mean - float(sstats.norm.ppf(0.95)) * math.sqrt(panel) <= -margin:
        return None
    rng = np.random.default_rng(seed)
    for n in range(2, MAX_SEEDS + 1):
        d = rng.normal(mean, sd, size=(sims, n))
        se = np.sqrt(d.var(axis=1, ddof=1) / n + panel + panel_per_seed / n)
        low = d.mean(axis=1) - float(sstats.t.ppf(0.95, n - 1)) * se
        if float((low > -margin).mean()) >= power:
            return n
    return None


def learning_check(runs: list[Path], first: int, margin: float, out: Path,
                   names: tuple[str, str] = ("bf16", "fp32")) -> dict:
    """The non-inferiority check of `--learning` over (bf16, fp32) pairs of results folders; `names` label the two
    arms in what it prints (two variants of a bf16 run, say)."""
    if len(runs) % 2:
        raise SystemExit(f"--learning: {len(runs)} folders; give a bf16 and an fp32 run for each seed")
    rows, per_task = [], []
    for bf, fp in zip(runs[::2], runs[1::2]):
        tables = []
        for r in (bf, fp):
            if r.is_file():     # a per-task table (bench.verdicts.task_success's columns), e.g. committed
                table = pl.read_csv(r).filter(pl.col("iteration") >= first)
            else:
                its = [i for i in evaluated_iterations(r) if i >= first]
                table = task_success(r, its) if its else pl.DataFrame()
            if not table.height:
                raise SystemExit(f"--learning: {r} has no evaluation at iteration {first} or later")
            tables.append(table.group_by("task_id").agg(pl.col("success").mean()).sort("task_id"))
        a, b = tables
        if a["task_id"].to_list() != b["task_id"].to_list():
            raise SystemExit(f"--learning: {bf} and {fp} evaluated different held-out tasks")
        d = 100.0 * (a["success"].to_numpy() - b["success"].to_numpy())
        per_task.append(d)
        rows.append({"bf16": str(bf), "fp32": str(fp), "bf16_mean": float(a["success"].mean()),
                     "fp32_mean": float(b["success"].mean()), "diff_points": float(d.mean()), "tasks": len(d)})
    result = noninferiority(per_task, margin)
    out.mkdir(parents=True, exist_ok=True)
    cpu = machine()
    write_text_atomic(out / "precision_learning.csv", pl.DataFrame(
        [{**r, **cpu} for r in rows] + [{"bf16": "mean over seeds", "diff_points": result["mean"],
                                           "lower_95_one_sided": result["lower_95_one_sided"],
                                           "seeds_to_show": result["seeds_to_show"], **cpu}],
        infer_schema_length=None).write_csv())
    a_name, b_name = names
    verdict = (f"{a_name} is not worse than {b_name} by {margin:g} points or more" if result["not_worse"] else
               f"not shown: {a_name} may be worse than {b_name} by {margin:g} points or more")
    seeds = ", ".join(f"{r['diff_points']:+.1f}" for r in rows)
    if not result["not_worse"] and result["seeds"] >= 2:
        n = result["seeds_to_show"]
        verdict += (f"; at this mean and spread about {n} seeds would be expected to show it (80 % power, an "
                    "estimate)" if n else "; at this mean no number of seeds is expected to show it")
    print(f"{a_name} − {b_name}, held-out success over iterations {first} on: {result['mean']:+.1f} points over "
          f"{result['seeds']} seeds (per seed {seeds}); one-sided 95 % lower bound "
          f"{result['lower_95_one_sided']:+.1f} ({result['covers']}): {verdict}")
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=Path)
    ap.add_argument("--run", type=Path, help="a run's results folder with the iteration's outputs")
    ap.add_argument("--iteration", type=int, default=1)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--warmstart-steps", type=int, default=0)
    ap.add_argument("--jobs", nargs="*", default=[], metavar="STAGE@I")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--scratch", type=Path, default=Path("results/bench/precision_scratch"))
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--cpu-kernels", nargs="+", default=["math"], choices=["math", "flash"],
                    help="the path attention's SDPA kernel on a CPU (pipeline.model.packing.ATTENTION): each profiled")
    ap.add_argument("--frozen", nargs="+", default=["on"], choices=["on", "off"],
                    help="a LoRA base stored in the compute dtype (on) or fp32 (off): each profiled")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="--jobs: params overrides")
    ap.add_argument("--code", type=Path, nargs="+", default=[Path.cwd()],
                    help="--jobs: checkouts whose stages run each job (e.g. a git worktree of an earlier commit)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the profiles (default: torch's)")
    ap.add_argument("--learning", type=Path, nargs="+", default=[], metavar="RESULTS",
                    help="bf16 and fp32 results folders of each seed, alternating: the non-inferiority check")
    ap.add_argument("--from-iteration", type=int, default=1)
    ap.add_argument("--margin", type=float, default=5.0, help="--learning: points")
    ap.add_argument("--names", nargs=2, default=["bf16", "fp32"], metavar=("FIRST", "SECOND"),
                    help="--learning: what the first and the second run of each pair are, for the verdict's words")
    a = ap.parse_args(argv)
    if a.learning:
        learning_check(a.learning, a.from_iteration, a.margin, a.out, tuple(a.names))
        if not (a.profile or a.jobs):
            return
    if a.params is None or a.run is None:
        ap.error("--params and --run are needed for --profile and --jobs")
    if a.threads:
        torch.set_num_threads(a.threads)
    params = load_params(a.params)
    if a.profile:
        run_profiles(params, a.run, a.iteration, a.dtypes, a.warmstart_steps, a.out, a.cpu_kernels, a.frozen)
    if a.jobs:
        run_jobs(a.params.resolve(), a.run.resolve(), a.jobs, a.dtypes, a.repeats, a.scratch.resolve(), a.out,
                 a.set, [c.resolve() for c in a.code])
    print(machine())


if __name__ == "__main__":
    main()
