"""Build the default policy: tokenizer on environment text, random Llama, supervised warm start.

Demonstrations come from the exact solver: each turn is labelled with an optimal action, except a share
`random_action_share` labelled with a uniformly random action (so the warm-started policy is a mixture of
optimal and random play, and RL has room to improve). The labelled action is also the one executed, so the
prompt history matches what happened.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from pipeline.config import WARMSTART_SEED_BASE, Params
from pipeline.envs.base import make_env
from pipeline.policy import encode_prompt, encode_response, pad_batch
from pipeline.prompting import build_prompt, format_action


def demonstrations(params: Params, episodes: int, random_share: float, seed: int) -> list[tuple[str, str]]:
    """(prompt text, response text) pairs from solver-guided play on warm-start seeds."""
    rng = random.Random(seed)
    env = make_env(params.env)
    pairs = []
    for j in range(episodes):
        obs, _ = env.reset(WARMSTART_SEED_BASE + seed * 100_000 + j)
        solver = env.solver()
        history: list[tuple[str, str | None]] = []
        for _ in range(params.env.max_turns):
            best = solver.optimal_actions(env.state)
            if best and rng.random() >= random_share:
                action = rng.choice(best)
            else:
                action = rng.choice(env.actions)
            prompt = build_prompt(env.task_description(), history, obs, env.actions, params.prompt.history_turns)
            response = format_action(action)
            pairs.append((prompt, response))
            res = env.step(response)
            history.append((obs, res.action))
            obs = res.observation
            if res.terminated or res.truncated:
                break
    return pairs


def tokenizer_corpus(params: Params, seed: int) -> list[str]:
    pairs = demonstrations(params, params.policy.tiny.tokenizer_corpus_episodes, 0.5, seed + 7919)
    return [p for p, _ in pairs] + [r for _, r in pairs]


def supervised_warmstart(model, tokenizer, pairs: list[tuple[str, str]], steps: int, batch_size: int, lr: float,
                         seed: int, progress: Callable[[str], None] | None = None) -> list[float]:
    """Cross-entropy on the response tokens (EOS included); returns the loss of every step."""
    if steps == 0 or not pairs:
        return []
    gen = torch.Generator().manual_seed(seed)
    encoded = [(encode_prompt(tokenizer, p), encode_response(tokenizer, r)) for p, r in pairs]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    model.train()
    losses = []
    started = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(len(encoded), (batch_size,), generator=gen).tolist()
        ids, attn, resp = pad_batch([encoded[i][0] for i in idx], [encoded[i][1] for i in idx],
                                    tokenizer.pad_token_id)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none").view_as(resp)
        loss = (nll * resp).sum() / resp.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress is not None and ((step + 1) % 50 == 0 or step + 1 == steps):
            rate = (step + 1) / (time.perf_counter() - started)
            progress(f"warm start step {step + 1}/{steps}: loss {sum(losses[-50:]) / len(losses[-50:]):.4f}, "
                     f"{rate:.1f} steps/s")
    model.eval()
    return losses
