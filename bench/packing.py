"""Benchmark: tree packing (`update.packing: tree`) against padded micro-batches, on a run's own turns.

    python -m bench.packing --run results/smollm2-search --params configs/smollm2-search.yaml --iterations 1 2
    python -m bench.packing ... --turns 16 --repeats 2 --micro-batch-tokens 512 1024 2048

Per iteration: the turns' prompt + response tokens, the tokens their prefix tree holds (the whole iteration as one
tree, and the update's micro-batches: `micro_batch_size` turns of a shuffled minibatch, as the update draws them,
against prefix trees of at most `micro_batch_tokens`), and the padded tokens a padded micro-batch computes. Then the
update's work on one minibatch of `--turns` turns of the first iteration (drawn at random, as the update's are),
side by side in this process, alternating: the PPO loss's forward and backward over the checkpoint (LoRA adapters
where `policy.lora` is set, as the update trains), padded (`packing: none`, `micro_batch_size` turns a pass) against
packed (`tree`, `micro_batch_tokens`; with `--attention paths mask`, each budget under both of the trees'
attentions, `pipeline.model.packing`), and the no-grad log-prob pass (log pi_old, the reference) likewise; the
seconds of each and the ratio. Writes `OUT/packing_tokens.csv` and `OUT/packing_time.csv`.

`--fits METHOD...` times the learned methods' fits as well (those whose settings have a `packing` key: OPRL's PRM,
SPA's progress estimator, GAE's critic): one fit of the first iteration's turns of the first `--fit-groups` task
groups (whole groups, as the fit sees them), from the run's initial policy, exactly as the fit stage calls it
(`pipeline.credit.reward_model.fit_iteration`), with `credit.<method>.packing` none and then tree, alternating;
writes `OUT/packing_fits.csv`.

    python -m bench.packing ... --fits oprl spa gae --fit-groups 4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import polars as pl
import torch

from bench import cpu_name
from pipeline.config.params import load_params
from pipeline.data.batches import minibatches
from pipeline.data.tables import STEPS, atomic_file, read_table
from pipeline.model.packing import micro_batches, packed_tokens, padded_tokens
from pipeline.model.policy import resolve_params
from pipeline.workflow.runs import run_folder


def token_rows(turns: pl.DataFrame, it: int, minibatch: int, micro: int, budgets: list[int], seed: int
               ) -> list[dict]:
    """One row per token budget: the counts that do not depend on it (the whole iteration, its padded
    micro-batches) computed once, then the prefix trees of at most that many tokens."""
    seqs = [list(p) + list(r) for p, r in zip(turns["prompt_ids"].to_list(), turns["response_ids"].to_list())]
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed)).tolist()
    batches = minibatches(order, minibatch)
    padded = plain = packed_micro = 0
    for mb in batches:
        for m in range(0, len(mb), micro):
            part = [seqs[i] for i in mb[m: m + micro]]
            padded += padded_tokens(part)
            plain += sum(map(len, part))
            packed_micro += packed_tokens(part)
    tokens, whole = sum(map(len, seqs)), packed_tokens(seqs)
    rows = []
    for budget in budgets:
        trees = [p for mb in batches for p in micro_batches(seqs, mb, budget)]
        in_trees = sum(packed_tokens([seqs[i] for i in p]) for p in trees)
        rows.append({"iteration": it, "turns": len(seqs), "tokens": tokens, "padded_tokens": padded,
                     "tree_whole_iteration": whole, f"tree_micro_batches_of_{micro}": packed_micro,
                     "budget": budget, "tree_budget": in_trees, "tree_micro_batches": len(trees),
                     "reduction_whole": tokens / whole, "reduction_update": plain / in_trees})
    return rows


def device_name(device: torch.device) -> str:
    """The device the timings ran on, in words: the GPU's name, or the CPU's model."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def timing(params, checkpoint: Path, turns: pl.DataFrame, n: int, repeats: int, budgets: list[int],
           attentions: tuple[str, ...] = ("paths",)) -> list[dict]:
    from pipeline.model import packing
    from pipeline.model.policy import load_policy, with_lora
    from pipeline.model.ppo import Turns, ppo_update, sequence_logprobs

    pick = torch.randperm(turns.height, generator=torch.Generator().manual_seed(params.seed))[:n].tolist()
    turns = turns[pick]                            # a minibatch as the update draws one: shuffled turns
    prompts = turns["prompt_ids"].to_list()
    responses = turns["response_ids"].to_list()
    old = [torch.tensor(x, dtype=torch.float32) for x in turns["response_logprobs"].to_list()]
    base, tok = load_policy(checkpoint, params.policy.dtype, params.runtime.device, train=True)
    device = device_name(next(base.parameters()).device)
    model = with_lora(base, params.policy.lora, seed=0) if params.policy.lora else base
    trainable = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.0)       # the same weights every repeat
    u = params.update
    variants = [("none", None, None, u.model_copy(update={"packing": "none", "minibatch_size": n}))]
    variants += [("tree", b, a, u.model_copy(update={"packing": "tree", "micro_batch_tokens": b, "minibatch_size": n}))
                 for b in budgets for a in attentions]
    rows = []
    for r in range(repeats):
        for name, budget, attention, cfg in variants:
            packing.ATTENTION["mode"] = attention or "paths"
            t0 = time.perf_counter()
            ppo_update(model, opt, Turns(prompts, responses, [1.0, -1.0] * (n // 2) + [1.0] * (n % 2), old),
                       cfg.model_copy(update={"epochs": 1}), tok.pad_token_id, seed=0)
            t1 = time.perf_counter()
            sequence_logprobs(model, prompts, responses, tok.pad_token_id, u.micro_batch_size or n,
                              packing=name, max_tokens=budget)
            t2 = time.perf_counter()
            rows.append({"repeat": r, "packing": name, "budget": budget, "attention": attention, "turns": n,
                         "update_s": t1 - t0, "logprobs_s": t2 - t1, "device": device, "dtype": params.policy.dtype})
            label = name if budget is None else f"{name} (budget {budget}, {attention} attention)"
            print(f"  repeat {r} {label}: update {t1 - t0:.1f} s, log-probs {t2 - t1:.1f} s", flush=True)
    return rows


def fit_timing(params, run: Path, iteration: int, methods: list[str], groups: int, repeats: int
               ) -> list[dict]:
    """Seconds of one fit (and scoring) of each learned method on the turns of the iteration's first `groups` task
    groups, padded against packed, in this process, alternating; the fit is the credit benchmark's replay of the
    fit stage (`bench.credit_quality.fitted_scores`)."""
    from bench.credit_quality import fitted_scores
    from pipeline.credit.methods import METHODS
    from pipeline.model.policy import resolve_device

    def first_groups(steps: pl.DataFrame) -> pl.DataFrame:
        keep = steps["task_group"].unique(maintain_order=True).head(groups)
        return steps.filter(pl.col("task_group").is_in(keep.implode()))

    device = device_name(resolve_device(params.runtime.device))
    rows = []
    for method in methods:
        if method not in METHODS or not METHODS[method].fits:
            raise SystemExit(f"--fits: {method!r} is not a learned method; expected some of "
                             f"{[m for m, v in METHODS.items() if v.fits]}")
        settings = getattr(params.credit, method)
        if "packing" not in type(settings).model_fields:
            raise SystemExit(f"--fits: credit.{method} has no packing key")
        for r in range(repeats):
            for packing in ("none", "tree"):
                credit = params.credit.model_copy(update={method: settings.model_copy(update={"packing": packing})})
                torch.manual_seed(0)
                scores, stats = fitted_scores(run, params.model_copy(update={"credit": credit}), [iteration],
                                              method, select=first_groups)
                score = scores[iteration]["score"]
                rows.append({"method": method, "repeat": r, "packing": packing, "turns": len(score),
                             "fit_s": stats[0]["fit_s"], "score_abs_mean": float(score.abs().mean()),
                             "device": device, "dtype": params.policy.dtype})
                print(f"  {method} fit on {len(score)} turns, repeat {r} {packing}: {stats[0]['fit_s']:.1f} s",
                      flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=None, help="the run's results folder (default: its params' run.dir)")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--iterations", type=int, nargs="+", default=[1])
    ap.add_argument("--turns", type=int, default=16, help="turns of the timed minibatch")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[2048],
                    help="the packed micro-batches' token budget; several: each is counted and timed")
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--attention", nargs="+", default=["paths"], choices=["paths", "segments", "mask"],
                    help="the packed passes' attention (pipeline.model.packing.ATTENTION): each is timed")
    ap.add_argument("--fits", nargs="*", default=[], metavar="METHOD", help="learned methods whose fit to time")
    ap.add_argument("--fit-groups", type=int, default=4, help="task groups of the first iteration the fits see")
    args = ap.parse_args(argv)
    params, _ = resolve_params(load_params(args.params, args.set))     # policy.dtype auto: as the run computed
    run = args.run or run_folder(params, args.params)
    u = params.update
    micro = u.micro_batch_size or u.minibatch_size
    rows = []
    for it in args.iterations:
        turns = read_table(run / f"iter_{it}" / "steps.parquet", STEPS)
        for row in token_rows(turns, it, u.minibatch_size, micro, args.micro_batch_tokens, params.seed):
            rows.append(row)
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with atomic_file(args.out / "packing_tokens.csv") as tmp:
        pl.DataFrame(rows).write_csv(tmp)
    first = read_table(run / f"iter_{args.iterations[0]}" / "steps.parquet", STEPS)
    times = pl.DataFrame(timing(params, run / "iter_0" / "checkpoint", first, args.turns, args.repeats,
                                args.micro_batch_tokens, tuple(args.attention)))
    with atomic_file(args.out / "packing_time.csv") as tmp:
        times.write_csv(tmp)
    med = times.group_by("packing", "budget", "attention", maintain_order=True).agg(pl.col("update_s").median(),
                                                                                   pl.col("logprobs_s").median())
    none = med.filter(pl.col("packing") == "none").row(0, named=True)
    for tree in med.filter(pl.col("packing") == "tree").iter_rows(named=True):
        print(f"median of {args.repeats}, budget {tree['budget']}, {tree['attention']} attention: update "
              f"{none['update_s']:.1f} s padded, "
              f"{tree['update_s']:.1f} s packed ({none['update_s'] / tree['update_s']:.2f}x); log-probs "
              f"{none['logprobs_s']:.1f} s, {tree['logprobs_s']:.1f} s "
              f"({none['logprobs_s'] / tree['logprobs_s']:.2f}x)")
    if args.fits:
        fits = pl.DataFrame(fit_timing(params, run, args.iterations[0], args.fits, args.fit_groups, args.repeats))
        with atomic_file(args.out / "packing_fits.csv") as tmp:
            fits.write_csv(tmp)
        for (method,), g in fits.group_by("method", maintain_order=True):
            fit_s = {k: g.filter(pl.col("packing") == k)["fit_s"].median() for k in ("none", "tree")}
            print(f"median of {args.repeats}: {method} fit {fit_s['none']:.1f} s padded, {fit_s['tree']:.1f} s "
                  f"packed ({fit_s['none'] / fit_s['tree']:.2f}x)")


if __name__ == "__main__":
    main()
