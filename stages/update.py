"""Stage `update`: PPO-clip on the response tokens of iteration i's turns, from the checkpoint of i-1 to that of i.

`log π_old` is recomputed from the rollout checkpoint at the sampling temperature (credit-assignment.md, Policy
update); its mismatch with the rollout engine's log-probs is reported. The policy trains with fp32 master weights
whose forward passes run in `policy.dtype` (`pipeline.precision`), and the checkpoint keeps the fp32 weights.
AdamW resumes from the state of i-1 (`pipeline.optstate`: beside the checkpoint; `runtime.keep_optimizer`). A
non-finite loss or advantage stops the stage before anything is written.
"""

from __future__ import annotations

import math

import polars as pl
import torch

from pipeline import optstate
from pipeline.policy import load_policy, save_policy, with_lora
from pipeline.ppo import ppo_update, sequence_logprobs
from pipeline.registry import ADVANTAGES, CHECKPOINT, ITER_DIR, PREV_CHECKPOINT, STEPS
from pipeline.stagekit import parse_args, stage_errors
from pipeline.tables import ADVANTAGES as ADV_SCHEMA
from pipeline.tables import STEPS as STEPS_SCHEMA
from pipeline.tables import atomic_dir, check_same_turns, read_table
from pipeline.tracking import Tracker

OPTIMIZER = "policy"   # results/iter_i/optimizer/policy.pt


def main(argv=None) -> None:
    ctx = parse_args("update", per_iteration=True, argv=argv)
    p, it = ctx.params, ctx.iteration
    with stage_errors(ctx), Tracker(p, "update", it) as tracker:
        steps = read_table(ctx.path(STEPS), STEPS_SCHEMA).select(
            "episode_id", "step", "task_group", "prompt_ids", "response_ids", "response_logprobs")
        adv = read_table(ctx.path(ADVANTAGES), ADV_SCHEMA)     # finite advantages: checked on read
        check_same_turns(steps, ctx.path(STEPS), adv, ctx.path(ADVANTAGES), "advantages")
        table = steps.join(adv, on=["episode_id", "step"], how="inner").sort("episode_id", "step")
        table = table.filter(pl.col("response_ids").list.len() > 0)
        prev = ctx.path(PREV_CHECKPOINT)
        model, tokenizer = load_policy(prev, p.policy.dtype, p.runtime.device, train=True)
        if p.policy.lora is not None:   # iteration 1 wraps the initial policy; later ones load their adapter
            model = with_lora(model, p.policy.lora, seed=p.seed * 7919 + it)
        if p.update.gradient_checkpointing:   # non-reentrant: works with frozen inputs (LoRA) as with full training
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        temperature = p.rollout.temperature
        prompts = table["prompt_ids"].to_list()
        responses = table["response_ids"].to_list()
        advantages = table["advantage"].to_list()
        ctx.log(f"recomputing log pi_old for {len(prompts)} turns")
        old = sequence_logprobs(model, prompts, responses, tokenizer.pad_token_id, p.update.minibatch_size,
                                temperature)
        engine = torch.cat([torch.tensor(x, dtype=torch.float32) for x in table["response_logprobs"].to_list()])
        recomputed = torch.cat(old)
        gap = (engine - recomputed).abs()   # the rollout engine's log-probs against the trainer's (as verl logs)
        mismatch = {"logprob_mismatch_abs_mean": float(gap.mean()), "logprob_mismatch_abs_max": float(gap.max()),
                    "logprob_mismatch_share_over_0.1": float((gap > 0.1).float().mean())}
        ref = None
        if p.update.kl_coef > 0:
            ref_model, _ = load_policy(ctx.path(CHECKPOINT, 0), p.policy.dtype, p.runtime.device, train=True)
            ref = sequence_logprobs(ref_model, prompts, responses, tokenizer.pad_token_id, p.update.minibatch_size,
                                    temperature)
            del ref_model
        trainable = [q for q in model.parameters() if q.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=p.update.lr, weight_decay=p.update.weight_decay)
        optstate.restore(optimizer, ctx.path(ITER_DIR, it - 1), OPTIMIZER, required=it > 1)
        stats = ppo_update(model, optimizer, prompts, responses, advantages, old, p.update,
                           tokenizer.pad_token_id, seed=p.seed * 7919 + it, ref_logps=ref, progress=ctx.log,
                           temperature=temperature)
        stats.update(mismatch)
        if not all(math.isfinite(v) for v in stats.values()):
            raise ValueError(f"iteration {it}: non-finite update statistics {stats}")
        out = ctx.path(CHECKPOINT)
        optstate.save(optimizer, ctx.path(ITER_DIR), OPTIMIZER)
        with atomic_dir(out) as tmp:
            save_policy(model, tokenizer, tmp, base=ctx.path(CHECKPOINT, 0))
        optstate.prune(ctx.path(ITER_DIR), OPTIMIZER, p.runtime.keep_optimizer)
        tracker.log_metrics({f"update/{k}": v for k, v in stats.items()}, step=it, parent=True)
        ctx.log(f"wrote {out}: " + ", ".join(f"{k} {v:.4f}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
