"""Stage `init`: the policy of iteration 0.

With `policy.path` null: train a byte-level BPE tokenizer on environment text, build the tiny Llama with random
weights, warm-start it on solver demonstrations, and save it. With `policy.path` set: copy that local Hugging Face
model folder's weights and tokenizer as iteration 0's checkpoint (nothing is downloaded). Checkpoints hold fp32
master weights whatever `policy.dtype` is (`pipeline.model.precision`).
"""

from __future__ import annotations

from pipeline.data import paths
from pipeline.data.seeds import stage_seed
from pipeline.data.tables import atomic_dir
from pipeline.envs.base import spec_of
from pipeline.model.policy import build_tiny_model, load_policy, resolve_device, train_tokenizer
from pipeline.model.precision import mark
from pipeline.rollout.warmstart import demonstrations, supervised_warmstart, tokenizer_corpus
from pipeline.workflow.cli import parse_args, stage_job
from pipeline.workflow.tracking import Tracker


def main(argv=None) -> None:
    ctx = parse_args("init", per_iteration=False, argv=argv)
    p = ctx.params
    with stage_job(ctx), Tracker(p, "init", None) as tracker:
        if p.policy.path:
            ctx.log(f"loading local model folder {p.policy.path}")
            model, tokenizer = load_policy(p.policy.path, p.policy.dtype, p.runtime.device, train=True)
            metrics = {}
        else:
            model, tokenizer = build_tiny(ctx)
            metrics = warm_start(ctx, model, tokenizer, tracker)
        out = ctx.path(paths.INITIAL_CHECKPOINT)
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        tracker.log_metrics(metrics)
        ctx.log(f"wrote {out}")


def build_tiny(ctx):
    """A tokenizer trained on the environment's text and the tiny Llama with random weights."""
    p = ctx.params
    seed = stage_seed("init", p.seed)
    ctx.log("training the tokenizer on environment text")
    tokenizer = train_tokenizer(tokenizer_corpus(p, seed), p.policy.tiny.vocab_size, spec_of(p.env).isolate)
    model = mark(build_tiny_model(tokenizer, p.policy.tiny, seed), p.policy.dtype)
    model.to(resolve_device(p.runtime.device))
    ctx.log(f"tiny Llama: {sum(x.numel() for x in model.parameters()):,} parameters, vocabulary {len(tokenizer)}, "
            f"on {model.device}")
    return model, tokenizer


def warm_start(ctx, model, tokenizer, tracker) -> dict[str, float]:
    """Supervised training on solver demonstrations (`pipeline.rollout.warmstart`); its metrics."""
    p = ctx.params
    seed = stage_seed("init", p.seed)
    pairs = demonstrations(p, p.warmstart.episodes, p.warmstart.random_action_share, seed, tasks=p.warmstart.tasks)
    ctx.log(f"{len(pairs)} demonstration turns from {p.warmstart.episodes} solver-guided episodes")
    losses = supervised_warmstart(model, tokenizer, pairs, p.warmstart.steps, p.warmstart.batch_size,
                                  p.warmstart.lr, seed, clean_steps=p.warmstart.clean_steps, progress=ctx.log)
    metrics = {"parameters": float(sum(x.numel() for x in model.parameters())),
               "demonstration_turns": float(len(pairs))}
    if losses:
        metrics["warmstart_final_loss"] = sum(losses[-20:]) / len(losses[-20:])
        for i in range(0, len(losses), max(1, len(losses) // 50)):
            tracker.log_metrics({"warmstart_loss": losses[i]}, step=i)
    return metrics


if __name__ == "__main__":
    main()
