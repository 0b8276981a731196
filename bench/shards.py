"""Benchmark: sharded rollouts through Snakemake, side by side, and what a batch's shape alone changes.

    python -m bench.shards                          # default params: 1, 2 and 4 shards; results/bench/shards.csv
    python -m bench.shards --shards 1 2 --tasks 4 --out /tmp/smoke    # a smoke version

1. Throughput. The initial policy of the params (built once, `snakemake` target iteration 0's checkpoint) plays
   iteration 1's rollout as `snakemake --cores C` runs it with `rollout.shards` N (batches of `--batch-size`
   episodes; each shard job 1 thread, as the registry gives rollouts). Each N is one run in its own `run.dir`,
   linking the same initial policy (`run.base`), timed from Snakemake's start to the merged step table; reported:
   turns/s, and whether the step table is byte-identical to N = 1's.
2. Batch shape. The same episodes are played by `pipeline.rollout.episodes.play_episodes` in one batch of all of
   them and in batches of `--batch-size`: every response is sampled with its own seed, so only the floats of the
   forward pass differ (BLAS kernels and padding widths depend on the batch). Reported: the largest log-prob
   difference on the first turn (identical prompts), the share of first-turn tokens that differ, and the share of
   episodes whose play differs anywhere. Shards never see this difference (a shard is whole batches), but it is
   what changing `rollout.batch_size` does. The same comparison on prompts of unequal length (a random-weight
   model of the tiny default's shape; text environments' prompts vary in length, Sokoban's do not) counts how
   often the float differences flip a sampled token.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import yaml

from pipeline.config.files import read_params
from pipeline.config.params import Params
from pipeline.data.tables import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def _params(base: dict, name: str, shards: int, batch: int, tasks: int | None, run_base: bool) -> dict:
    p = yaml.safe_load(yaml.safe_dump(base))
    p["rollout"] = {**p.get("rollout", {}), "shards": shards, "batch_size": batch}
    if tasks:
        p["rollout"]["tasks_per_iteration"] = tasks
    p["tracking"] = {"enabled": False}
    p["run"] = {"dir": f"runs/{name}"}
    if run_base:
        p["run"]["base"] = {"params": "init.yaml", "through": 0}
    return p


def _snakemake(work: Path, params: str, target: str, cores: int) -> float:
    t = time.perf_counter()
    r = subprocess.run([SNAKEMAKE, target, "--cores", str(cores), "--quiet", "--config", f"params={params}"],
                       cwd=work, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"snakemake {target} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t


def throughput(work: Path, base: dict, shards: list[int], batch: int, tasks: int | None, cores: int) -> list[dict]:
    shutil.copy(ROOT / "Snakefile", work / "Snakefile")
    shutil.copytree(ROOT / "profiles", work / "profiles", dirs_exist_ok=True)
    (work / "init.yaml").write_text(yaml.safe_dump(_params(base, "init", 1, batch, tasks, False)))
    print("building the initial policy ...", flush=True)
    _snakemake(work, "init.yaml", "runs/init/iter_0/checkpoint", cores)
    rows, reference = [], None
    for n in shards:
        name = f"shards{n}"
        (work / f"{name}.yaml").write_text(yaml.safe_dump(_params(base, name, n, batch, tasks, True)))
        seconds = _snakemake(work, f"{name}.yaml", f"runs/{name}/iter_1/steps.parquet", cores)
        table = work / f"runs/{name}/iter_1/steps.parquet"
        turns = pl.read_parquet(table).height
        data = table.read_bytes()
        reference = reference or data
        rows.append({"shards": n, "batch_size": batch, "cores": cores, "turns": turns, "seconds": seconds,
                     "turns_per_s": turns / seconds, "identical_to_first": data == reference})
        print(f"{n} shard(s): {turns} turns in {seconds:.1f} s, {turns / seconds:.1f} turns/s, "
              f"table identical to {shards[0]} shard(s): {data == reference}", flush=True)
    return rows


def batch_shape(work: Path, base: dict, batch: int, tasks: int | None) -> dict:
    """Play the same episodes in one batch and in batches of `batch`; compare."""
    from pipeline.model.engines import open_sampler  # start-up cost: torch
    from pipeline.rollout.episodes import play_with_params  # start-up cost: torch
    from stages.rollout import training_specs  # start-up cost: torch

    p = Params.model_validate(_params(base, "init", 1, batch, tasks, False))
    sampler, tok = open_sampler(p, work / "runs/init/iter_0/checkpoint", engine_seed=0)
    specs = training_specs(p, 1)
    tables = {}
    for size in (len(specs), batch):
        p2 = p.model_copy(update={"rollout": p.rollout.model_copy(update={"batch_size": size})})
        tables[size] = play_with_params(p2, sampler, tok, specs, temperature=p.rollout.temperature, seed=1)
    a, b = tables[len(specs)], tables[batch]
    first_a, first_b = a.filter(pl.col("step") == 0), b.filter(pl.col("step") == 0)
    lp_gap, tok_diff, tok_all = 0.0, 0, 0
    for ra, rb, la, lb in zip(first_a["response_ids"].to_list(), first_b["response_ids"].to_list(),
                              first_a["response_logprobs"].to_list(), first_b["response_logprobs"].to_list()):
        same = 0
        while same < min(len(ra), len(rb)) and ra[same] == rb[same]:
            same += 1
        lp_gap = max([lp_gap] + [abs(x - y) for x, y in zip(la[:same], lb[:same])])
        tok_diff += int(same < max(len(ra), len(rb)))
        tok_all += 1
    eps = a.group_by("episode_id").agg(pl.col("response_ids")).join(
        b.group_by("episode_id").agg(pl.col("response_ids")), on="episode_id", how="full")
    differ = sum(x != y for x, y in zip(eps["response_ids"].to_list(), eps["response_ids_right"].to_list()))
    out = {"episodes": len(specs), "batch_sizes": f"{len(specs)} vs {batch}",
           "first_turn_logprob_max_abs_diff": lp_gap, "first_turn_responses_differing": tok_diff / tok_all,
           "episodes_differing": differ / len(specs)}
    print(f"one batch of {len(specs)} vs batches of {batch}: first-turn log-probs differ by up to {lp_gap:.2e}; "
          f"{tok_diff}/{tok_all} first-turn responses and {differ}/{len(specs)} episodes differ", flush=True)
    return out


def synthetic_shape(batch: int, prompts: int = 256, new_tokens: int = 12, seed: int = 0) -> dict:
    """Prompts of unequal length (150-259 tokens, as text environments' observations vary) on a random-weight
    model of the tiny default's shape, sampled in one batch and in batches of `batch` with the same per-row seeds:
    the floats differ (padding widths and batch sizes), and this counts the sampled tokens that differ."""

    import torch  # start-up cost: torch
    from transformers import LlamaConfig, LlamaForCausalLM  # start-up cost: torch

    from pipeline.model.policy import generate  # start-up cost: torch

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=768, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                         pad_token_id=0, eos_token_id=1, bos_token_id=2)).eval()

    class Tok:
        pad_token_id, eos_token_id = 0, 1

        def decode(self, ids, skip_special_tokens=True):
            return ""

    rng = random.Random(seed)
    ids = [[rng.randrange(3, 768) for _ in range(rng.randrange(150, 260))] for _ in range(prompts)]
    seeds = list(range(prompts))
    whole = generate(model, Tok(), ids, new_tokens, 1.0, seeds)
    parts = [g for b in range(0, prompts, batch)
             for g in generate(model, Tok(), ids[b: b + batch], new_tokens, 1.0, seeds[b: b + batch])]
    gap, tokens, differ, responses = 0.0, 0, 0, 0
    for a, b in zip(whole, parts):
        same = 0
        while same < min(len(a.response_ids), len(b.response_ids)) and a.response_ids[same] == b.response_ids[same]:
            same += 1
        gap = max([gap] + [abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same])])
        tokens += len(a.response_ids)
        differ += len(a.response_ids) - same
        responses += same < len(a.response_ids)
    out = {"prompts": prompts, "batch_sizes": f"{prompts} vs {batch}", "logprob_max_abs_diff": gap,
           "responses_differing": responses / prompts, "tokens_after_first_difference": differ / tokens}
    print(f"unequal prompts, one batch of {prompts} vs batches of {batch}: log-probs differ by up to {gap:.2e}; "
          f"{responses}/{prompts} responses differ ({differ}/{tokens} tokens from the first difference on)",
          flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch-size", type=int, default=64, help="rollout.batch_size of every run (shards are whole "
                    "batches of it)")
    ap.add_argument("--tasks", type=int, default=None, help="rollout.tasks_per_iteration (default: the params')")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--work", type=Path, default=Path("results/bench/shards_work"))
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    a = ap.parse_args(argv)
    base = read_params(a.params)[0]
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    rows = throughput(a.work.resolve(), base, a.shards, a.batch_size, a.tasks, a.cores)
    shape = batch_shape(a.work.resolve(), base, a.batch_size, a.tasks)
    synthetic = synthetic_shape(a.batch_size)
    a.out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()} {os.cpu_count()} cores"
    table = pl.DataFrame(rows).with_columns(pl.lit(machine).alias("machine"))
    write_text_atomic(a.out / "shards.csv", table.write_csv())
    write_text_atomic(a.out / "shards_batch_shape.csv", pl.DataFrame([shape]).write_csv())
    write_text_atomic(a.out / "shards_batch_shape_synthetic.csv", pl.DataFrame([synthetic]).write_csv())
    print(f"wrote {a.out / 'shards.csv'} and {a.out / 'shards_batch_shape.csv'}")


if __name__ == "__main__":
    main()
