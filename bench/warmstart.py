"""Benchmark: the warm start's time and memory a step, one batch at once against micro-batches and prefix trees.

    python -m bench.warmstart --params configs/smollm2-sql.yaml --steps 3
    python -m bench.warmstart --params P --variant plain --variant tree1024 micro_batch_tokens=1024 packing=tree

Each variant (a label and `warmstart` keys over the params' own) runs `--steps` steps of the warm start
(`pipeline.rollout.warmstart.supervised_warmstart`) from the same initial weights on the params' demonstrations, in
a fresh process of its own, one after the other, so that its peak resident memory is its own. Same seed, same
batches: the variants' losses agree up to float summation order (printed, to check that). The model is the params'
`policy.path` (a GGUF file or a model folder). Writes `OUT/warmstart_steps.csv`: seconds a step, peak resident
GiB, the losses, and the tokens a step's forward passes compute (the padded micro-batches' rows x their longest
turn, or the nodes of the prefix trees), averaged over the timed steps or, with `--count-steps N`, over the first N
steps of the same batches (no model runs for those: the tokenizer and `pipeline.model.packing` count them).

    python -m bench.warmstart --params configs/smollm2-sql.yaml --steps 0 --count-steps 60 \
        --variant tree2048 packing=tree micro_batch_tokens=2048 \
        --variant tree16384 packing=tree micro_batch_tokens=16384
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import polars as pl

from pipeline.config.params import ParamsError, load_params, with_overrides
from pipeline.data.tables import atomic_file

PLAIN = ["packing=none", "micro_batch_size=null", "micro_batch_tokens=null", "gradient_checkpointing=false"]
DEFAULT_VARIANTS = [    # each sets every batching key, whatever the params file's warmstart section says
    ("one_batch", PLAIN),
    ("padded_micro_2", [*PLAIN[:1], "micro_batch_size=2", *PLAIN[2:]]),
    ("tree_1024", ["packing=tree", "micro_batch_size=null", "micro_batch_tokens=1024", PLAIN[3]]),
    ("tree_1024_checkpointing", ["packing=tree", "micro_batch_size=null", "micro_batch_tokens=1024",
                                 "gradient_checkpointing=true"]),
]


def step_tokens(tokenizer, demos, w, seed: int, steps: int) -> tuple[float, float]:
    """(tokens the forward passes compute, tokens of the turns themselves) a step, over the warm start's first
    `steps` batches, cut into passes as `supervised_warmstart` cuts them."""
    from pipeline.model.packing import packed_tokens, padded_tokens, passes
    from pipeline.rollout.warmstart import step_batches

    computed = plain = 0
    for ps, rs, idx in step_batches(tokenizer, demos, steps, w.batch_size, seed, w.clean_steps):
        plain += sum(len(ps[i]) + len(rs[i]) for i in idx)
        for part in passes(ps, rs, idx, w.micro_batch_size or w.batch_size, w.packing, w.micro_batch_tokens):
            seqs = [ps[i] + rs[i] for i in part]
            computed += packed_tokens(seqs) if w.packing == "tree" else padded_tokens(seqs)
    return computed / max(steps, 1), plain / max(steps, 1)


def measure(params_path: Path, sets: list[str], steps: int, count_steps: int = 0) -> dict:
    """One variant in this process: load the model, build the demonstrations, time `steps` steps, count the tokens
    of `count_steps` steps (or of the timed ones)."""
    import torch

    from pipeline.data.seeds import stage_seed
    from pipeline.model.gguf_import import load_pretrained, load_tokenizer
    from pipeline.model.policy import resolve_params
    from pipeline.rollout.warmstart import demonstrations, supervised_warmstart

    p = load_params(params_path)
    p = with_overrides(p, [f"warmstart.{s}" for s in sets])
    p, _ = resolve_params(p, fresh=True)        # policy.dtype auto: as init would on this machine
    w = p.warmstart
    if p.policy.path is None:
        raise SystemExit(f"{params_path}: policy.path is null; this benchmark loads a model from a path")
    torch.set_num_threads(p.runtime.torch_threads or torch.get_num_threads())
    if steps:
        model, tok = load_pretrained(p.policy.path, p.policy.dtype, p.runtime.device)
    else:                                                    # counting only: the tokenizer is all it needs
        model, tok = None, load_tokenizer(p.policy.path)
    seed = stage_seed("init", p.seed)
    demos = demonstrations(p, w.episodes, w.random_action_share, seed, tasks=w.tasks)
    computed, plain = step_tokens(tok, demos, w, seed, count_steps or steps)
    start = time.perf_counter()
    losses = supervised_warmstart(model, tok, demos, steps, w.batch_size, w.lr_for(p.policy), seed,
                                  clean_steps=w.clean_steps, packing=w.packing, micro_batch_size=w.micro_batch_size,
                                  micro_batch_tokens=w.micro_batch_tokens,
                                  gradient_checkpointing=w.gradient_checkpointing)
    seconds = (time.perf_counter() - start) / steps if steps else None
    return {"s_per_step": seconds, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "losses": losses, "batch_size": w.batch_size, "demonstration_turns": len(demos),
            "tokens_per_step": computed, "turn_tokens_per_step": plain}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=3, help="steps to time (0: none, count only)")
    ap.add_argument("--count-steps", type=int, default=0,
                    help="count the tokens of this many steps (default: the timed ones)")
    ap.add_argument("--variant", nargs="+", action="append", metavar=("LABEL", "KEY=VALUE"),
                    help="a label and warmstart keys (repeatable; default: one batch, padded micro-batches of 2, "
                         "trees of 1,024 tokens with and without gradient checkpointing)")
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--one", nargs="*", help=argparse.SUPPRESS)      # the child process: these sets
    a = ap.parse_args(argv)
    if a.one is not None:
        print("RESULT " + json.dumps(measure(a.params, a.one, a.steps, a.count_steps)))
        return
    if a.steps == 0 and a.count_steps == 0:
        raise SystemExit("--steps 0 times nothing: give --count-steps N to count tokens only")
    variants = [(v[0], v[1:]) for v in a.variant] if a.variant else DEFAULT_VARIANTS
    try:                                                 # broken params or variants fail here, before any run
        base = load_params(a.params)
        for label, sets in variants:
            with_overrides(base, [f"warmstart.{s}" for s in sets], f"--variant {label}")
    except ParamsError as e:
        raise SystemExit(str(e)) from None
    rows = []
    for label, sets in variants:
        print(f"{label}: {steps_text(a.steps)} ...", flush=True)
        out = subprocess.run([sys.executable, "-m", "bench.warmstart", "--params", str(a.params), "--steps",
                              str(a.steps), "--count-steps", str(a.count_steps), "--one", *sets],
                             capture_output=True, text=True)
        lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            raise SystemExit(f"variant {label} failed:\n{out.stderr[-3000:]}")
        r = json.loads(lines[-1][len("RESULT "):])
        rows.append({"variant": label, "keys": " ".join(sets),
                     "s_per_step": None if r["s_per_step"] is None else round(r["s_per_step"], 2),
                     "peak_rss_gib": round(r["peak_rss_gib"], 2), "batch_size": r["batch_size"],
                     "tokens_per_step": round(r["tokens_per_step"]),
                     "turn_tokens_per_step": round(r["turn_tokens_per_step"]),
                     "counted_steps": a.count_steps or a.steps, "losses": " ".join(f"{x:.6f}" for x in r["losses"])})
        print(f"  {rows[-1]['s_per_step']} s a step, {rows[-1]['peak_rss_gib']} GiB peak, "
              f"{rows[-1]['tokens_per_step']} tokens a step computed "
              f"({rows[-1]['turn_tokens_per_step']} in its turns), "
              f"losses {rows[-1]['losses']}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    target = a.out / "warmstart_steps.csv"
    with atomic_file(target) as tmp:
        pl.DataFrame(rows).write_csv(tmp)
    print(f"wrote {target}")


def steps_text(n: int) -> str:
    return f"{n} step" + ("s" if n != 1 else "")


if __name__ == "__main__":
    main()
