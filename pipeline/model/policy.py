"""Policies are Hugging Face causal LMs: the tiny default built here, or any local model folder.

The tiny default is a byte-level BPE tokenizer trained on environment text and a small Llama with random weights,
saved with `save_pretrained` so that it reloads through the same `AutoTokenizer` / `AutoModelForCausalLM` path as
any other model folder (Qwen2.5-1.5B-Instruct, say). Nothing is downloaded: loads are `local_files_only`.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.data.paths import INITIAL_CHECKPOINT, at, strip_dir
from pipeline.data.seeds import mix_seed
from pipeline.model import precision
from pipeline.model.precision import DTYPES, RECORD, autocast, frozen_in_compute_dtype, mark, read_record, resolve

EOS = "<eos>"
PAD = "<pad>"


def train_tokenizer(corpus: list[str], vocab_size: int, isolate: str | None = None, words: Sequence[str] = ()):
    """A byte-level BPE tokenizer trained on `corpus`, wrapped as a `PreTrainedTokenizerFast`; `isolate` is a
    regex of characters kept as single tokens (the environment's, e.g. a grid's cells); `words` are added whole,
    one token each, beyond `vocab_size` (the environment's ids)."""
    from transformers import PreTrainedTokenizerFast  # start-up cost: transformers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=isolate is None)
    tok.pre_tokenizer = (byte_level if isolate is None else pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(isolate), behavior="isolated"), byte_level]))
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if words:
        tok.add_tokens([AddedToken(w, normalized=False) for w in dict.fromkeys(words)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)


def build_tiny_model(tokenizer, cfg, seed: int):
    """A Llama-architecture causal LM with random weights (a Llama config keeps AutoTokenizer's class as saved)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # start-up cost: transformers

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """`runtime.device` (or a torch device) as a torch device: `auto` is cuda when torch sees a GPU, else cpu;
    asking for cuda where there is none is an error rather than a silent fall-back to the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"runtime.device is {name!r}, but this torch ({torch.__version__}) sees no GPU; "
                             "use auto or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"runtime.device is {name!r}, but torch sees {torch.cuda.device_count()} GPU(s)")
    return device


def resolve_params(params, fresh: bool = False):
    """`params` with `policy.dtype` concrete, and why: `auto` as the run's record beside iteration 0's checkpoint says
    (`fresh`: resolved here, as the init stage does, which writes that record), else as this machine resolves it."""
    if params.policy.dtype != "auto":
        return params, f"policy.dtype {params.policy.dtype}"
    folder = Path(strip_dir(at(params, INITIAL_CHECKPOINT)))
    record = None if fresh else read_record(folder)
    if record is not None:
        dtype, why = record["dtype"], f"policy.dtype auto, as the run's initial policy ({record['why']})"
    else:
        dtype, why = resolve("auto", resolve_device(params.runtime.device))
        if not fresh:
            why += f" (no {RECORD} in {folder}: resolved on this machine)"
    return params.model_copy(update={"policy": params.policy.model_copy(update={"dtype": dtype})}), why


def trainer_policy(params):
    """The `policy` section the update trains under: `params.policy` (its dtype resolved, `resolve_params`), with
    `update.dtype` in place of `policy.dtype` where it names one."""
    dtype = params.update.trains_in(params.policy.dtype)
    return params.policy if dtype == params.policy.dtype else params.policy.model_copy(update={"dtype": dtype})


ADAPTER_CONFIG = "adapter_config.json"


def is_adapter(path: str | Path) -> bool:
    """Whether `path` is a LoRA checkpoint (a peft adapter folder) rather than a whole model folder."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> Path:
    """The model folder a LoRA checkpoint adapts: its `base_model_name_or_path`, relative to the adapter folder
    (as `save_policy` writes it) or absolute."""

    path = Path(path)
    base = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path / ADAPTER_CONFIG}: no base_model_name_or_path; cannot tell which model it adapts")
    base = Path(base) if Path(base).is_absolute() else path / base
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{path / ADAPTER_CONFIG}: its base model {base} is not a Hugging Face model folder")
    return base.resolve()


def load_weights(path: str | Path, dtype: str = "float32", train: bool = False, auto_class=None,
                 merge_rounding: str = "nearest"):
    """The model of a local folder, through `auto_class` (default AutoModelForCausalLM; SPA's estimator body takes
    AutoModel), as `load_policy` describes: fp32 master weights for `train`, else cast to `dtype`. A LoRA checkpoint
    loads its base plus the adapter, trainable for `train`, else merged into the base; `merge_rounding` stochastic
    merges in fp32 and rounds the sum to bf16 stochastically (`policy.merge_rounding`)."""
    from transformers import AutoModelForCausalLM  # start-up cost: transformers

    path = Path(path)
    adapter = is_adapter(path)
    folder = adapter_base(path) if adapter else path
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face model folder (config.json missing)")
    stochastic = adapter and not train and merge_rounding == "stochastic" and dtype == "bfloat16"
    model = (auto_class or AutoModelForCausalLM).from_pretrained(
        folder, local_files_only=True, dtype=torch.float32 if train or stochastic else DTYPES[dtype])
    if train:
        mark(model, dtype)
    if stochastic:   # the base as the trainer sees it (its weights cast to bf16), then the update added in fp32
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16).float()
    if adapter:
        from peft import PeftModel  # optional: peft

        model = PeftModel.from_pretrained(model, path, is_trainable=train)
        if not train:
            model = model.merge_and_unload()
    if stochastic:
        generator = torch.Generator().manual_seed(adapter_seed(path))
        for _, p in sorted(model.named_parameters()):
            p.data = precision.stochastic_bf16(p.data, generator)
        model.to(torch.bfloat16)
    return model


def adapter_seed(path: Path) -> int:
    """A seed fixed by the adapter's weights: the same checkpoint merges to the same bf16 weights every time, and
    each iteration's adapter draws its own rounding."""
    import zlib

    return zlib.crc32((Path(path) / "adapter_model.safetensors").read_bytes())


def folder_tokenizer(path):
    """A model folder's tokenizer (saved in adapter folders too), its pad token the EOS where it names none."""
    from transformers import AutoTokenizer  # start-up cost: transformers

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(path: str | Path, dtype: str = "float32", device: str | torch.device | None = None,
                train: bool = False, merge_rounding: str = "nearest"):
    """Load (model, tokenizer) from a local folder, on `device` (a `runtime.device` name or a torch device; None
    keeps the CPU); a clear error when it is not a model folder.

    `train`: fp32 master weights whose forward passes run in `dtype` (`pipeline.model.precision`); otherwise the
    weights themselves are cast to `dtype` (sampling). A LoRA checkpoint loads its base model plus the adapter:
    trainable adapter weights for `train`, else merged into the base for sampling at full speed."""
    model = load_weights(path, dtype, train, merge_rounding=merge_rounding)
    tokenizer = folder_tokenizer(path)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if device is not None:
        model.to(resolve_device(device))
    return model, tokenizer


def with_lora(model, cfg, seed: int, task_type: str | None = "CAUSAL_LM"):
    """`model` wrapped with fresh LoRA adapters (a `LoraSettings`; B = 0, so it computes what `model` did): only
    the adapter weights train. A model that already carries adapters is returned as it is. `task_type` None suits
    a model without an LM head (SPA's estimator body)."""
    from peft import LoraConfig, PeftModel, get_peft_model  # optional: peft

    if isinstance(model, PeftModel):
        return model
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                            target_modules=cfg.target_modules, task_type=task_type))


def load_trainable(path: str | Path, policy, device, seed: int, gradient_checkpointing: bool = False,
                   frozen_low_precision: bool = True):
    """(model, tokenizer) of the checkpoint `path` set up to train under the `policy` params section: its weights
    in fp32 with forward passes in `policy.dtype`, wrapped with fresh LoRA adapters seeded by `seed` where
    `policy.lora` is set (iteration 1 wraps the initial policy; later checkpoints are adapters already). Under
    LoRA in bf16 or fp16 the frozen base's linear weights are stored in that dtype (`frozen_low_precision`;
    `pipeline.model.precision.frozen_in_compute_dtype`): the adapters keep fp32 master weights."""
    model, tokenizer = load_policy(path, policy.dtype, device, train=True)
    if policy.lora is not None:
        model = with_lora(model, policy.lora, seed=seed)
        if frozen_low_precision:
            frozen_in_compute_dtype(model)
    if gradient_checkpointing:
        checkpoint_activations(model)
    return model, tokenizer


def checkpoint_activations(model, on: bool = True) -> None:
    """Gradient checkpointing on (non-reentrant: it works with frozen inputs, LoRA, as with full training) or off."""
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def save_weights(model, folder: Path, base: Path | None = None) -> None:
    """`model.save_pretrained(folder)`. A LoRA model writes only its adapter, with `base_model_name_or_path`
    pointing at `base` relative to `folder` (a temporary folder beside the final one, as `atomic_dir` makes it,
    so the relative path holds there too and a run folder can move)."""

    from peft import PeftModel  # optional: peft

    model.save_pretrained(folder)
    if isinstance(model, PeftModel):
        if base is None:
            raise ValueError("save_weights: a LoRA model needs the base model folder it adapts")
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
        cfg["base_model_name_or_path"] = os.path.relpath(Path(base).resolve(), Path(folder).resolve())
        (folder / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_policy(model, tokenizer, folder: Path, base: Path | None = None) -> None:
    """Write the policy (weights or adapter, see `save_weights`) and its tokenizer into `folder`."""
    save_weights(model, folder, base)
    tokenizer.save_pretrained(folder)


def render_prompt(tokenizer, text: str) -> str:
    """Wrap the prompt text in the model's chat template when it has one (instruct models); else keep it."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return text


def encode_prompt(tokenizer, text: str) -> list[int]:
    """The prompt's ids: a chat template writes its own special tokens (BOS included); without one, the tokenizer
    adds those it is set to add (a base model's BOS; none for the tiny default's)."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    return tokenizer(render_prompt(tokenizer, text), add_special_tokens=not templated)["input_ids"]


def encode_response(tokenizer, text: str) -> list[int]:
    """Target ids of a response, ended by EOS, as the policy should generate them."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


@dataclass
class Generation:
    response_ids: list[int]
    logprobs: list[float]
    text: str
    entropy: float | None = None   # ARPO's entropy of the first tokens (`arpo_entropy`), when asked for


@dataclass(frozen=True)
class EntropySpec:
    """What `arpo_entropy` reads of a response: its first `tokens` positions, each position's `top_k` most likely
    candidates, normalised by log `vocab` (ARPO's rollout, docs/credit-assignment.md, Branching rollouts)."""
    tokens: int
    top_k: int
    vocab: int


def arpo_entropy(candidates: list[list[float]], vocab: int) -> float:
    """ARPO's uncertainty of a response: -sum p log p over the candidates' log-probs `candidates` (one list per
    position: its top-k, not renormalised), averaged over the positions (ARPO sums over its 20; ours are often
    shorter, and a sum would follow the response's length), divided by log `vocab`; 0 for no position."""
    total = 0.0
    for position in candidates:
        for lp in position:
            total -= math.exp(lp) * lp
    return total / (len(candidates) * math.log(vocab)) if candidates else 0.0


# Generation settings that a model folder's generation_config.json may set (Qwen2.5-Instruct sets
# repetition_penalty 1.05, top_k 20, top_p 0.8) and that would make the sampler's distribution differ from
# softmax(logits / temperature), the one the trainer recomputes. Every sampling call overrides them.
NEUTRAL_SAMPLING = dict(top_k=None, top_p=None, min_p=None, typical_p=None, epsilon_cutoff=None, eta_cutoff=None,
                        repetition_penalty=None, no_repeat_ngram_size=None, encoder_repetition_penalty=None,
                        min_length=None, min_new_tokens=None, bad_words_ids=None, suppress_tokens=None,
                        begin_suppress_tokens=None, sequence_bias=None, forced_bos_token_id=None,
                        forced_eos_token_id=None, renormalize_logits=False)


class _SampledLogprobs:
    """A logits processor that keeps only the sampled tokens' log-probs, never the [batch, tokens, vocab] logits.

    Called once per generated token with the logits of the next position, it holds that position's log-softmax
    ([batch, vocab]) until the next call, whose `input_ids` end with the token sampled from it; `finish` gathers
    the last one. Memory is one step's log-softmax, whatever the number of new tokens."""

    def __init__(self, temperature: float, entropy: EntropySpec | None = None):
        self.temperature = temperature
        self.entropy = entropy
        self.pending: torch.Tensor | None = None
        self.columns: list[torch.Tensor] = []
        self.candidates: list[torch.Tensor] = []   # per position (the first entropy.tokens): [batch] -sum p log p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self._gather(input_ids[:, -1])
        logits = scores.float()
        if self.temperature > 0 and self.temperature != 1.0:
            logits = logits / self.temperature
        self.pending = torch.log_softmax(logits, dim=-1)
        return scores

    def _gather(self, tokens: torch.Tensor) -> None:
        chosen = self.pending.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if self.entropy is not None and len(self.columns) < self.entropy.tokens:
            top = self.pending.topk(self.entropy.top_k, dim=1).values   # the top-k candidates
            self.candidates.append((-(top.exp() * top).sum(1)).double().cpu())
        self.columns.append(chosen.cpu())
        self.pending = None

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[batch, new tokens] log-probs of the sampled tokens."""
        if self.pending is not None:
            self._gather(new_tokens[:, -1].to(self.pending.device))
        if len(self.columns) != new_tokens.shape[1]:
            raise RuntimeError(f"generate: {len(self.columns)} log-prob columns for {new_tokens.shape[1]} new tokens")
        return torch.stack(self.columns, dim=1) if self.columns else torch.zeros(new_tokens.shape)

    def entropies(self, lengths: list[int]) -> list[float | None]:
        """Each row's `arpo_entropy` over its first min(tokens, length) positions, their mean (None without an
        EntropySpec)."""
        if self.entropy is None:
            return [None] * len(lengths)
        terms = torch.stack(self.candidates, dim=1) if self.candidates else torch.zeros((len(lengths), 0))
        scale = math.log(self.entropy.vocab)
        read = [min(n, terms.shape[1]) for n in lengths]
        return [float(terms[i, :k].sum()) / (k * scale) if k else 0.0 for i, k in enumerate(read)]


class _SeededSampling:
    """A logits processor that samples each row from softmax(logits / temperature) with the row's own generator.

    The argmax of logits / temperature - log(q), q ~ Exp(1) drawn per row (float64, so q is never 0), is a sample
    of that softmax (the exponential-race form of the Gumbel-max trick, as vLLM samples); it returns scores that
    are 0 at that token and -inf elsewhere, and `generate` decodes greedily. A row's draws depend only on its seed
    and its position, not on the other rows of the batch, so an episode samples the same tokens whichever batch or
    shard it is generated in."""

    def __init__(self, temperature: float, seeds: list[int], device: torch.device):
        self.temperature = temperature
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # one row at a time: a [vocab] float64 buffer, never a [batch, vocab] one (memory, not maths)
        out = torch.full_like(scores, float("-inf"))
        for i, g in enumerate(self.generators):
            q = torch.empty(scores.shape[1], dtype=torch.float64, device=scores.device).exponential_(generator=g)
            out[i, (scores[i].double() / self.temperature - q.log()).argmax()] = 0.0
        return out


@torch.no_grad()
def generate(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float,
             seed: int | list[int], entropy: EntropySpec | None = None) -> list[Generation]:
    """Sample one response per prompt (left-padded batch); greedy when temperature is 0.

    `seed` is one seed per prompt (an int: seeds derived from it and the row), and row i's tokens depend only on
    its seed and its prompt's logits. The log-probs are those of the sampling distribution (logits / temperature),
    one per response token; the response ends at the first EOS (kept) or at `max_new_tokens`. Only the sampled
    tokens' log-probs are kept (`_SampledLogprobs`), so memory does not grow with vocabulary x new tokens. With
    `entropy`, each Generation carries `arpo_entropy` of its first tokens, from the same distribution.
    """
    from transformers import LogitsProcessorList  # start-up cost: transformers

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    seeds = [mix_seed(seed, i) for i in range(len(prompt_ids))] if isinstance(seed, int) else list(seed)
    if len(seeds) != len(prompt_ids):
        raise ValueError(f"generate: {len(seeds)} seeds for {len(prompt_ids)} prompts")
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention[i, width - len(p):] = 1
    sample = temperature > 0
    recorder = _SampledLogprobs(temperature if sample else 0.0, entropy)
    processors = [recorder, _SeededSampling(temperature, seeds, device)] if sample else [recorder]
    sequences = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,      # the sampling is _SeededSampling's; the argmax of its output is the sample
        temperature=None,
        pad_token_id=pad,
        eos_token_id=eos,
        logits_processor=LogitsProcessorList(processors),
        **NEUTRAL_SAMPLING,
    )
    new = sequences[:, width:].cpu()
    logp = recorder.finish(new)
    rows = [r.tolist() for r in new]
    lengths = [ids.index(eos) + 1 if eos in ids else len(ids) for ids in rows]
    results = []
    for i, (ids, n, h) in enumerate(zip(rows, lengths, recorder.entropies(lengths), strict=True)):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        results.append(Generation(ids[:n], logp[i, :n].tolist(), text, h))
    return results


def pad_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int):
    """Right-padded prompt+response batch: input ids, attention mask, and a response-token mask aligned with
    the *targets* (position t predicts token t+1)."""
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(lengths), width), dtype=torch.long)
    resp = torch.zeros((len(lengths), width - 1), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        seq = list(p) + list(r)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
        resp[i, len(p) - 1: len(seq) - 1] = True
    return ids, attn, resp


def token_logprobs(model, ids: torch.Tensor, targets: torch.Tensor | None = None, with_entropy: bool = False,
                   temperature: float = 1.0):
    """Per-position log-prob of the next token (shape [B, L-1]) and, optionally, the policy's entropy there, under
    the distribution softmax(logits / `temperature`): the one the sampler drew from (docs/credit-assignment.md, Policy
    update), as verl's actor computes it.

    `ids` is a right-padded batch from `pad_batch`. Pads come after every real token, so causal attention alone
    never lets a real position see one: no padding mask is passed, positions run 0, 1, ... as with one, and
    SDPA takes its causal fast path. `targets` (the response mask of `pad_batch`), when given, limits the LM head
    to the columns where some row has a target (through `logits_to_keep` where the model accepts it); the other
    columns come back as 0.
    """
    device = next(model.parameters()).device
    ids = ids.to(device)
    width = ids.shape[1] - 1
    cols = None
    with autocast(model):
        if targets is not None and _accepts_logits_to_keep(_lm_class(model)):
            cols = targets.any(0).nonzero().squeeze(1).to(device)
            logits = model(input_ids=ids, logits_to_keep=cols).logits.float()
        else:
            logits = model(input_ids=ids).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    nxt = ids[:, 1:] if cols is None else ids[:, 1:][:, cols]
    logp = logp_all.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    if cols is not None:
        logp = logp.new_zeros((ids.shape[0], width)).index_copy(1, cols, logp)
        if entropy is not None:
            entropy = entropy.new_zeros((ids.shape[0], width)).index_copy(1, cols, entropy)
    return logp, entropy


def _lm_class(model) -> type:
    """The causal LM's class, under a peft wrapper (whose forward passes extra keywords through)."""
    get_base = getattr(model, "get_base_model", None)
    return type(get_base() if callable(get_base) else model)


@functools.cache
def _accepts_logits_to_keep(model_class: type) -> bool:
    """Whether the model class's forward takes `logits_to_keep` (asked once per class, not every batch)."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters
