"""Stage `init`: the policy of iteration 0.

The model: with `policy.path` null, a byte-level BPE tokenizer trained on environment text and the tiny Llama with
random weights; with a local Hugging Face model folder, its weights and tokenizer; with a GGUF file, its weights
dequantized (`pipeline.model.gguf_import`). Nothing is downloaded. Then the warm start (`warmstart`: supervised
fine-tuning on expert demonstrations through the model's chat template, full or LoRA merged back), and iteration
0's checkpoint is saved as a plain model folder. Checkpoints hold fp32 master weights whatever `policy.dtype` is
(`pipeline.model.precision`); beside iteration 0's, the dtype the run computes in (`policy.dtype: auto` resolved
on this machine) and why.
"""

from __future__ import annotations

from pipeline.data import paths
from pipeline.data.seeds import stage_seed
from pipeline.data.tables import atomic_dir
from pipeline.envs.base import spec_of
from pipeline.model.gguf_import import is_gguf, load_pretrained
from pipeline.model.policy import build_tiny_model, resolve_device, train_tokenizer, with_lora
from pipeline.model.precision import mark, write_record
from pipeline.rollout.warmstart import demonstrations, supervised_warmstart, tokenizer_corpus
from pipeline.workflow.cli import parse_args, stage_job
from pipeline.workflow.tracking import Tracker


def main(argv=None) -> None:
    ctx = parse_args("init", per_iteration=False, argv=argv)
    p = ctx.params
    with stage_job(ctx), Tracker(p, "init", None) as tracker:
        if p.policy.path is None:
            model, tokenizer = build_tiny(ctx)
        else:
            if not is_gguf(p.policy.path):
                ctx.log(f"loading local model folder {p.policy.path}")
            model, tokenizer = load_pretrained(p.policy.path, p.policy.dtype, p.runtime.device, progress=ctx.log)
        if p.policy.path is not None:
            ctx.log(f"{type(model).__name__}: {sum(x.numel() for x in model.parameters()):,} parameters, "
                    f"vocabulary {len(tokenizer)}, chat template: {'yes' if tokenizer.chat_template else 'no'}")
        model, metrics = warm_start(ctx, model, tokenizer, tracker)
        out = ctx.path(paths.INITIAL_CHECKPOINT)
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            write_record(tmp, ctx.requested_dtype or p.policy.dtype, p.policy.dtype, ctx.dtype_why or "")
        tracker.log_metrics(metrics)
        ctx.log(f"wrote {out}")


def build_tiny(ctx):
    """A tokenizer trained on the environment's text and the tiny Llama with random weights."""
    p = ctx.params
    seed = stage_seed("init", p.seed)
    ctx.log("training the tokenizer on environment text")
    spec = spec_of(p.env)
    words = spec.words(p.env) if spec.words is not None else []
    tokenizer = train_tokenizer(tokenizer_corpus(p, seed), p.policy.tiny.vocab_size, spec.isolate, words)
    model = mark(build_tiny_model(tokenizer, p.policy.tiny, seed), p.policy.dtype)
    model.to(resolve_device(p.runtime.device))
    ctx.log(f"tiny Llama: {sum(x.numel() for x in model.parameters()):,} parameters, vocabulary {len(tokenizer)}, "
            f"on {model.device}")
    return model, tokenizer


def warm_start(ctx, model, tokenizer, tracker):
    """Supervised training on expert demonstrations (`pipeline.rollout.warmstart`): the model (LoRA adapters merged
    back where `warmstart.lora` trained them) and its metrics."""
    p = ctx.params
    w = p.warmstart
    metrics = {"parameters": float(sum(x.numel() for x in model.parameters()))}
    steps = w.steps_for(p.policy)
    if steps == 0:
        return model, metrics
    seed = stage_seed("init", p.seed)
    pairs = demonstrations(p, w.episodes, w.random_action_share, seed, tasks=w.tasks)
    ctx.log(f"{len(pairs)} demonstration turns from {w.episodes} expert-guided episodes")
    if w.lora is not None:
        model = with_lora(model, w.lora, seed=seed)
    losses = supervised_warmstart(model, tokenizer, pairs, steps, w.batch_size, w.lr_for(p.policy), seed,
                                  clean_steps=w.clean_steps, progress=ctx.log, packing=w.packing,
                                  micro_batch_size=w.micro_batch_size, micro_batch_tokens=w.micro_batch_tokens,
                                  gradient_checkpointing=w.gradient_checkpointing)
    if w.lora is not None:
        model = model.merge_and_unload()
    metrics["demonstration_turns"] = float(len(pairs))
    metrics["warmstart_first_loss"] = losses[0]
    metrics["warmstart_final_loss"] = sum(losses[-20:]) / len(losses[-20:])
    for i in range(0, len(losses), max(1, len(losses) // 50)):
        tracker.log_metrics({"warmstart_loss": losses[i]}, step=i)
    return model, metrics


if __name__ == "__main__":
    main()
