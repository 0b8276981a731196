"""Rollout engines (`rollout.engine`): what samples the policy's responses in the rollout and evaluate stages.

- `hf`: Hugging Face `generate` on the loaded model (`pipeline.model.policy.generate`).
- `vllm`: vLLM's offline `LLM` on the checkpoint folder (a LoRA checkpoint is merged into a copy of its base
  first, or with `rollout.vllm.lora: adapter` passed to vLLM's LoRA support with every request). One request per
  live episode per turn; vLLM returns the sampled tokens' log-probs of the processed (temperature-scaled)
  distribution, the one the trainer recomputes. Seeds: vLLM's engine-wide seed always; each request the episode's
  seed for that turn only on a GPU, since on the CPU a per-request generator kills the engine (so vLLM's samples
  on a CPU depend on what else is in the batch, and a sharded vLLM rollout differs from an unsharded one).
  On a CPU the engine's threads are not pinned (`VLLM_CPU_OMP_THREADS_BIND=nobind` unless the user set it): vLLM's
  automatic binding keeps one core for its front end and pins the worker to the rest, while torch keeps the
  stage's thread count, so on 2 cores two threads spin on one core (sampling many times slower, docs/models.md).

Both return `pipeline.model.policy.Generation`s, so the step table is the same whichever engine sampled it; asked
for an `EntropySpec`, both add ARPO's entropy of the response's first tokens, vLLM from its top-k log-probs and
`generate` from the same top-k of its logits.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import get_args

import torch

from pipeline.data.seeds import mix_seed
from pipeline.model.policy import (
    EntropySpec,
    Generation,
    adapter_base,
    arpo_entropy,
    generate,
    is_adapter,
    load_policy,
    resolve_device,
)

# head sizes vLLM's CPU attention kernels accept (vLLM 0.32: csrc/cpu/attention)
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 192, 256)


class HFSampler:
    name = "hf"
    label = "hf"          # what the stage's log says it samples with

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        model.eval()

    def __call__(self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float,
                 seed: int | list[int], entropy: EntropySpec | None = None) -> list[Generation]:
        return generate(self.model, self.tokenizer, prompt_ids, max_new_tokens, temperature, seed, entropy)

    def reset_cache(self) -> None:
        pass

    def close(self) -> None:
        pass


def _head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def merged_copy(folder: Path, dtype: str, merge_rounding: str = "nearest") -> Path:
    """A LoRA checkpoint's base with its adapter merged in, as one plain model folder in a new temporary directory
    (`rollout.vllm.lora: merged`, rounded to `dtype` by `policy.merge_rounding`); the caller removes it."""
    out = Path(tempfile.mkdtemp(prefix="creditrl-vllm-"))
    model, tok = load_policy(folder, dtype, merge_rounding=merge_rounding)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


class VLLMSampler:
    name = "vllm"

    def __init__(self, checkpoint: Path, tokenizer, params, engine_seed: int):

        try:
            from vllm import LLM  # optional: vLLM
        except ImportError as e:
            raise ImportError("rollout.engine is vllm, but vLLM is not installed: run scripts/install-vllm "
                              f"(docs/models.md, Rollout engines) ({e})") from None
        self.tokenizer = tokenizer
        self._tmp = None
        folder = Path(checkpoint)
        device = resolve_device(params.runtime.device)
        config = adapter_base(folder) / "config.json" if is_adapter(folder) else folder / "config.json"
        head_dim = _head_dim(json.loads(config.read_text()))
        if device.type == "cpu" and head_dim not in VLLM_CPU_HEAD_DIMS:
            raise ValueError(f"{checkpoint}: head_dim {head_dim} is not one vLLM's CPU attention supports "
                             f"{VLLM_CPU_HEAD_DIMS}; for the tiny policy set policy.tiny.hidden_size / "
                             "num_attention_heads to one of them, or use rollout.engine: hf")
        cfg = params.rollout.vllm
        self.lora_request, lora_args = None, {}
        if is_adapter(folder) and cfg.lora == "adapter":   # the base, and the adapter with every request

            from vllm.config.lora import MaxLoRARanks  # optional: vLLM
            from vllm.lora.request import LoRARequest  # optional: vLLM

            rank = int(json.loads((folder / "adapter_config.json").read_text())["r"])
            slots = [k for k in get_args(MaxLoRARanks) if k >= rank]   # vLLM sizes its LoRA slots in steps
            if not slots:
                raise ValueError(f"{folder}: LoRA rank {rank} is above vLLM's largest, {max(get_args(MaxLoRARanks))};"
                                 " set rollout.vllm.lora: merged")
            self.lora_request = LoRARequest("policy", 1, str(folder.resolve()))
            lora_args = dict(enable_lora=True, max_lora_rank=min(slots), max_loras=1)
            folder = adapter_base(folder)
        elif is_adapter(folder):   # a merged copy: base + adapter as one plain model folder
            folder = self._tmp = merged_copy(folder, params.policy.dtype, params.policy.merge_rounding)
        if device.type == "cpu":   # the stage's thread budget (OMP_NUM_THREADS), placed by the OS
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            # vLLM declares its worker dead after one model step of 300 s; on a CPU shared with other stages a step
            # took longer (measured: 2 cores, two runs beside the test suite) and the rollout failed
            os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
            # the engine core and its worker in this process: vLLM's default starts two more, each importing torch
            # and vLLM and each waited for at exit (docs/models.md, One process on a CPU); 1 restores them
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.per_request_seed = device.type == "cuda"
        share = cfg.gpu_memory_utilization or (0.85 if device.type == "cuda" else 0.2)
        set_threads = torch.set_num_threads
        try:
            self.llm = LLM(model=str(folder), tokenizer=str(folder), dtype=params.policy.dtype, seed=engine_seed,
                           enforce_eager=device.type == "cpu", gpu_memory_utilization=share,
                           max_model_len=cfg.max_model_len, logprobs_mode="processed_logprobs",
                           generation_config="vllm", enable_prefix_caching=cfg.prefix_caching, **lora_args)
        finally:
            torch.set_num_threads = set_threads   # vLLM's CPU worker stubs it out in the process it runs in
        # what the engine does, whatever was asked (vLLM turns it off on some platforms and models)
        self.prefix_caching = bool(self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
        self.label = f"vllm, prefix caching {'on' if self.prefix_caching else 'off'}"

    def __call__(self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float,
                 seed: int | list[int], entropy: EntropySpec | None = None) -> list[Generation]:
        from vllm import SamplingParams  # optional: vLLM

        if isinstance(seed, int):   # one seed for the call: one per prompt derived from it, as `generate` does
            seed = [mix_seed(seed, i) for i in range(len(prompt_ids))]
        eos = self.tokenizer.eos_token_id
        params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens,
                                 logprobs=entropy.top_k if entropy else 0,
                                 stop_token_ids=[eos], detokenize=False, top_k=0, top_p=1.0, min_p=0.0,
                                 repetition_penalty=1.0, seed=s if self.per_request_seed else None)
                  for s in seed]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False,
                                 lora_request=self.lora_request)
        results = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            logps = [float(step[tok].logprob) for step, tok in zip(c.logprobs, ids, strict=True)]
            h = None
            if entropy is not None:   # vLLM adds the sampled token where it is not in the top-k: the k largest
                h = arpo_entropy([sorted((float(x.logprob) for x in step.values()), reverse=True)[:entropy.top_k]
                                  for step in c.logprobs[:entropy.tokens]], entropy.vocab)
            results.append(Generation(ids, logps, self.tokenizer.decode(ids, skip_special_tokens=True), h))
        return results

    def reset_cache(self) -> None:
        """Forget cached prompt prefixes (a benchmark replaying the same prompts must not hit them)."""
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def open_sampler(params, checkpoint: str | Path, engine_seed: int):
    """(sampler, tokenizer) for the checkpoint folder, by `rollout.engine`."""
    if params.rollout.engine == "vllm":
        from transformers import AutoTokenizer  # start-up cost: transformers

        tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
        return VLLMSampler(Path(checkpoint), tokenizer, params, engine_seed), tokenizer
    model, tokenizer = load_policy(checkpoint, params.policy.dtype, params.runtime.device,
                                   merge_rounding=params.policy.merge_rounding)
    return HFSampler(model, tokenizer), tokenizer
