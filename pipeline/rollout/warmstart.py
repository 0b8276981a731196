"""Build the default policy: tokenizer on environment text, random Llama, supervised warm start.

Demonstrations come from the exact solver: each turn is labelled with an optimal action, except a share
`random_action_share` labelled with a uniformly random action (so the warm-started policy is a mixture of
optimal and random play, and RL has room to improve). The labelled action is also the one executed, so the
prompt history matches what happened.

Training has two phases. The first `clean_steps` steps see the same prompts labelled with an optimal action
only: they teach the state-to-action mapping. The rest use the executed (mixed) labels, which pull the sampling
distribution toward the mixture, so the initial policy knows the mapping but plays it noisily, and RL has room to
sharpen it. `random_action_share` also decides which states the demonstrations visit: more random moves, more
off-path states with an optimal label, the states a noisy policy actually meets.

Why these settings, with the measurements behind them: docs/results/default-run.md, "Warm-start settings".
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import torch

from pipeline.data.seeds import task_seed
from pipeline.envs.actions import format_of
from pipeline.envs.base import has, make_env, require
from pipeline.model.packing import passes, response_logprobs
from pipeline.model.policy import checkpoint_activations, encode_prompt, encode_response
from pipeline.model.precision import Stepper
from pipeline.progress import Ticker
from pipeline.rollout.demonstrations import environment
from pipeline.rollout.prompts import build_prompt


def demonstration_tasks(seed: int, episodes: int, stream: str = "warmstart", tasks: int | None = None) -> list[int]:
    """The task seeds the warm start (or the tokenizer's corpus, `stream="tokenizer"`) plays: one per episode, or
    `tasks` distinct ones in turn."""
    return [task_seed(stream, seed, 0, j if tasks is None else j % tasks) for j in range(episodes)]


def warmstart_params(params):
    """`params` as the warm start and the tiny tokenizer's corpus see them: `prompt.demonstrations` replaced by
    `warmstart.demonstrations` where that is set."""
    k = params.warmstart.demonstrations
    if k is None or k == params.prompt.demonstrations:
        return params
    return params.model_copy(update={"prompt": params.prompt.model_copy(update={"demonstrations": k})})


def demonstrations(params, episodes: int, random_share: float, seed: int, stream: str = "warmstart",
                   tasks: int | None = None) -> list[tuple[str, str, str | None]]:
    """(prompt, executed response, an optimal response or None) from expert-guided play on the tasks of `stream`
    (warm-start or tokenizer tasks, never training or held-out ones: `pipeline.data.seeds`).

    Each turn executes an expert action (`expert_actions`, an optional capability of the environment) or, with
    probability `random_share`, a random admissible command, so the demonstrations also visit off-path states;
    the optimal label is an expert action of the state (None where the task can no longer be solved). Without an
    expert, `random_share` must be 1: every command is random and there is no optimal label.
    """
    rng = random.Random(task_seed(stream, seed, 0, 0))
    params = warmstart_params(params)
    env = environment(params)
    expert = has(env, "expert_actions")
    fmt = format_of(env)
    if random_share < 1.0:
        require(env, "expert_actions", "the warm start (warmstart.random_action_share < 1)")
    pairs = []
    for task in demonstration_tasks(seed, episodes, stream, tasks):
        obs = env.reset(task)
        text, admissible = obs.text, obs.admissible
        history: list[tuple[str, str | None]] = []
        for _ in range(params.env.max_turns):
            best = env.expert_actions() if expert else []
            if best and rng.random() >= random_share:
                action = rng.choice(best)
            else:
                action = rng.choice(admissible)
            prompt = build_prompt(env.task_description(), history, text, admissible, params.prompt.history_turns,
                                  fmt)
            response = fmt.render(action)
            pairs.append((prompt, response, fmt.render(rng.choice(best)) if best else None))
            res = env.step(response)
            history.append((text, res.action))
            text, admissible = res.observation, res.admissible
            if res.terminated or res.truncated:
                break
    return pairs


def tokenizer_corpus(params, seed: int) -> list[str]:
    """The environment's own text, which the tiny model's tokenizer is trained on: prompts and responses of
    half-expert, half-random play (all random without an expert) on the tokenizer's tasks."""
    share = 0.5 if has(make_env(params.env), "expert_actions") else 1.0
    pairs = demonstrations(params, params.policy.tiny.tokenizer_corpus_episodes, share, seed, stream="tokenizer")
    return [p for p, _, _ in pairs] + [r for _, r, _ in pairs]


def step_batches(tokenizer, demos: list[tuple[str, str, str | None]], steps: int, batch_size: int, seed: int,
                 clean_steps: int = 0) -> Iterator[tuple[tuple, tuple, list[int]]]:
    """The warm start's batches, one a step: (prompt ids, response ids, the `batch_size` turns drawn), drawn with
    replacement from the optimal labels for the first `clean_steps` steps, then from the executed ones."""
    gen = torch.Generator().manual_seed(seed)
    prompts = {p: encode_prompt(tokenizer, p) for p, _, _ in demos}
    responses = {r: encode_response(tokenizer, r) for _, r, o in demos for r in (r, o) if r is not None}
    mixed = ([prompts[p] for p, _, _ in demos], [responses[r] for _, r, _ in demos])
    labelled = [(prompts[p], responses[o]) for p, _, o in demos if o is not None]
    clean = (tuple(zip(*labelled, strict=True)) if labelled else mixed)
    for step in range(steps):
        ps, rs = clean if step < clean_steps else mixed
        yield ps, rs, torch.randint(len(ps), (batch_size,), generator=gen).tolist()


def supervised_warmstart(model, tokenizer, demos: list[tuple[str, str, str | None]], steps: int, batch_size: int,
                         lr: float, seed: int, clean_steps: int = 0,
                         progress: Callable[[str], None] | None = None, packing: str = "none",
                         micro_batch_size: int | None = None, micro_batch_tokens: int | None = None,
                         gradient_checkpointing: bool = False) -> list[float]:
    """Cross-entropy on the response tokens (EOS included; the prompt goes through the model's chat template, as
    in rollouts): the first `clean_steps` steps on the optimal labels, the rest on the executed (mixed) ones. Only
    the parameters that require gradients train (LoRA adapters, when the model carries them). Progress lines every
    50 steps or 30 s. `packing` tree: each batch as one prefix tree (`pipeline.model.packing`). A step's batch goes
    through the model in micro-batches of `micro_batch_size` turns (or, packed as trees, of at most
    `micro_batch_tokens` tokens), with the gradients accumulated: the loss stays the token mean over the whole
    batch (less memory, the same step); `gradient_checkpointing` for the steps only. Returns the loss of every
    step."""
    if steps == 0 or not demos:
        return []
    opt = torch.optim.AdamW([x for x in model.parameters() if x.requires_grad], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    stepper = Stepper(model, opt, grad_clip=1.0)
    model.train()
    if gradient_checkpointing:
        checkpoint_activations(model)
    losses = []
    ticker = Ticker(steps, every=50)
    for step, (ps, rs, idx) in enumerate(step_batches(tokenizer, demos, steps, batch_size, seed, clean_steps)):
        tokens = sum(len(rs[i]) for i in idx)
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for part in passes(ps, rs, idx, micro_batch_size or batch_size, packing, micro_batch_tokens):
            logp, _, resp = response_logprobs(model, [ps[i] for i in part], [rs[i] for i in part],
                                              tokenizer.pad_token_id, packing)
            resp = resp.to(logp.device)
            part_loss = -(logp * resp).sum() / tokens
            stepper.backward(part_loss)
            loss += part_loss.item()
        stepper.step(f"warm start step {step}")
        sched.step()
        losses.append(loss)
        if progress is not None and ticker.due(step + 1):
            rate = ticker.rate(step + 1)
            recent = losses[-min(50, len(losses)):]
            progress(f"warm start step {step + 1}/{steps}: loss {sum(recent) / len(recent):.4f}, "
                     f"{ticker.pace(step + 1)}, {(steps - step - 1) / rate:.0f} s left")
    if gradient_checkpointing:
        checkpoint_activations(model, False)
    model.eval()
    return losses
