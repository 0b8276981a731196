"""Benchmark: rollout throughput of the sampling engines (HF `generate`, vLLM) side by side, on this machine.

    python -m bench.rollout_engines                               # tiny policy and Qwen2.5-0.5B's shape, hf and vllm
    python -m bench.rollout_engines --models tiny --engines hf --episodes 8 --turns 2 --out /tmp/smoke

For each model and engine, one Sokoban rollout (`pipeline.rollout.episodes.play_episodes`: prompts, environment steps,
parsing) runs `--episodes` episodes for `--turns` turns, and on the same prompts the engine generates the same
number of batches directly ("raw": batched generation alone). Reported: turns/s and generated tokens/s of both,
and the rollout's share of raw generation's tokens/s (target: at least 80 %). The rollout's extra work is the
environments' resets and steps, prompt building and tokenisation. Random weights rarely sample EOS, so
responses mostly run the full `--new-tokens`.

Models, both with random weights and nothing downloaded:
- `tiny`: the tiny Llama at vLLM-compatible head size (hidden 64, 2 heads, 2 layers), vocabulary 1,024.
- `qwen0.5b`: Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV heads, MLP 4,864, vocabulary 151,936),
  in bf16, with a small tokenizer trained here (ids past it decode to nothing).
- `qwen1.5b`: Qwen2.5-1.5B's shape (28 layers, hidden 1,536, 12 heads, 2 KV heads, MLP 8,960), likewise; for a GPU.
`--lora` samples from a LoRA checkpoint on each model instead (r 16 on every linear layer, as the update writes
one): `vllm` merges it into a copy of the base first (its load time includes the merge), `vllm-adapter` serves the
base with vLLM's LoRA support (`rollout.vllm.lora`). Writes rollout_engines.csv (rollout_engines_lora.csv with
`--lora`).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import polars as pl

from pipeline.config.params import Params
from pipeline.data.section import LoraSettings
from pipeline.data.tables import write_text_atomic
from pipeline.envs.base import make_env

SHAPES = {
    "tiny": dict(arch="llama", hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=None, dtype="float32"),
    "qwen0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2, vocab_size=151_936, dtype="bfloat16"),
    "qwen1.5b": dict(arch="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                     num_attention_heads=12, num_key_value_heads=2, vocab_size=151_936, dtype="bfloat16"),
}


def build_model(name: str, folder: Path) -> Path:
    """A random-weight model folder of the named shape, with a tokenizer trained on Sokoban text."""
    import torch  # start-up cost: torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # start-up cost: torch

    from pipeline.model.policy import train_tokenizer  # start-up cost: torch
    from pipeline.rollout.warmstart import tokenizer_corpus  # start-up cost: torch

    if (folder / "config.json").is_file():
        return folder
    shape = dict(SHAPES[name])
    arch, dtype = shape.pop("arch"), shape.pop("dtype")
    p = Params()
    tok = train_tokenizer(tokenizer_corpus(p, 20), 1024)
    shape["vocab_size"] = shape["vocab_size"] or len(tok)
    cls, cfg_cls = (LlamaForCausalLM, LlamaConfig) if arch == "llama" else (Qwen2ForCausalLM, Qwen2Config)
    cfg = cfg_cls(**shape, max_position_embeddings=4096, tie_word_embeddings=True,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = cls(cfg).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def lora_checkpoint(base: Path, folder: Path, r: int = 16) -> Path:
    """A LoRA checkpoint (r, all linear layers, random B so that it changes the policy) on the model folder `base`,
    as the update stage writes one."""
    import torch  # start-up cost: torch

    from pipeline.model.policy import load_policy, save_policy, with_lora  # start-up cost: torch

    if (folder / "adapter_config.json").is_file():
        return folder
    model, tok = load_policy(base, "float32")
    model = with_lora(model, LoraSettings(r=r, alpha=2 * r), seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "lora_B" in name:
                w.copy_(torch.randn(w.shape, generator=g) * 0.02)
    folder.mkdir(parents=True, exist_ok=True)
    save_policy(model, tok, folder, base=base)
    return folder


def measure(folder: Path, engine: str, dtype: str, episodes: int, turns: int, new_tokens: int) -> dict:
    from pipeline.model.engines import open_sampler  # start-up cost: torch
    from pipeline.model.policy import encode_prompt  # start-up cost: torch
    from pipeline.rollout.episodes import EpisodeSpec, play_episodes  # start-up cost: torch

    vllm_lora = "adapter" if engine == "vllm-adapter" else "merged"
    p = Params.model_validate({"policy": {"dtype": dtype, "max_new_tokens": new_tokens},
                               "rollout": {"engine": engine.removesuffix("-adapter"), "batch_size": episodes,
                                           "vllm": {"lora": vllm_lora}},
                               "env": {"name": "sokoban", "max_turns": turns}})
    t0 = time.perf_counter()
    sampler, tok = open_sampler(p, folder, engine_seed=0)
    load = time.perf_counter() - t0
    specs = [EpisodeSpec(1000 + k, k // 4, k) for k in range(episodes)]
    sampler([encode_prompt(tok, "warm up")] * 2, 2, 1.0, seed=0)
    t0 = time.perf_counter()
    steps = play_episodes(sampler, tok, lambda: make_env(p.env), specs, history_turns=p.prompt.history_turns,
                          max_new_tokens=new_tokens, temperature=1.0, batch_size=episodes, seed=0)
    rollout_s = time.perf_counter() - t0
    rollout_tokens = int(steps["response_ids"].list.len().sum())
    # raw: the same prompts, batch for batch, through the engine alone
    batches = [steps.filter(pl.col("step") == t)["prompt_ids"].to_list() for t in range(steps["step"].max() + 1)]
    sampler.reset_cache()    # vLLM: the replayed prompts must not hit the prefix cache the rollout filled
    t0 = time.perf_counter()
    raw_tokens = sum(len(g.response_ids) for b, ids in enumerate(batches) for g in sampler(ids, new_tokens, 1.0, b))
    raw_s = time.perf_counter() - t0
    sampler.close()
    return {"engine": engine, "load_s": load, "turns": steps.height, "rollout_s": rollout_s,
            "rollout_turns_per_s": steps.height / rollout_s, "rollout_tokens_per_s": rollout_tokens / rollout_s,
            "raw_s": raw_s, "raw_tokens_per_s": raw_tokens / raw_s,
            "rollout_share_of_raw": (rollout_tokens / rollout_s) / (raw_tokens / raw_s)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "qwen0.5b"], choices=list(SHAPES))
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm", "vllm-adapter"],
                    help="vllm-adapter: vLLM's LoRA support on a LoRA checkpoint (vllm merges it into a copy)")
    ap.add_argument("--lora", action="store_true", help="sample from a LoRA checkpoint (r 16, all linear layers) "
                    "on each model instead of the model itself; load time then includes vllm's merge")
    ap.add_argument("--episodes", type=int, default=64, help="episodes, all in one batch per turn")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--qwen-episodes", type=int, default=8, help="episodes for the Qwen shapes (slow on a CPU)")
    ap.add_argument("--models-dir", type=Path, default=Path("results/bench/models"))
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    args = ap.parse_args(argv)
    rows = []
    for name in args.models:
        folder = build_model(name, args.models_dir / name)
        if args.lora:
            folder = lora_checkpoint(folder, args.models_dir / f"{name}-lora")
        episodes = args.episodes if name == "tiny" else args.qwen_episodes
        for engine in args.engines:
            print(f"{name} / {engine}: {episodes} episodes x {args.turns} turns, {args.new_tokens} new tokens",
                  flush=True)
            row = {"model": name + ("+lora" if args.lora else ""), "episodes": episodes,
                   **measure(folder, engine, SHAPES[name]["dtype"], episodes, args.turns, args.new_tokens)}
            print("  " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
            rows.append(row)
    df = pl.DataFrame(rows).with_columns(pl.lit(platform.node()).alias("machine"),
                                         pl.lit(os.cpu_count()).alias("cpus"))
    with pl.Config(tbl_cols=20, tbl_width_chars=200, float_precision=3):
        print(df.drop("machine"))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / ("rollout_engines_lora.csv" if args.lora else "rollout_engines.csv")
    write_text_atomic(out, df.write_csv())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
