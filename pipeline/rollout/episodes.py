"""Play episodes with a policy: batched generation across every live episode, one row per turn.

All episodes of a call advance together turn by turn. The episodes are cut into fixed blocks of `batch_size` (in the
order given); each turn, the live episodes of a block are generated as one batch. Every response is sampled with its
own seed, from (seed, episode, turn), and a block's batch holds the same episodes whichever other blocks run beside
it, so a shard (`pipeline.rollout.shards`: whole blocks) writes exactly the rows the unsharded call writes for those
episodes, bit for bit on CPU.

An exception in one episode's `env.step` ends that episode there: its last row is truncated, not executed
(`action_valid` false, reward 0) and carries the error text in `env_error`; the other episodes go on.
`check_env_errors` counts them and fails the stage above `faults.max_env_error_share`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import polars as pl

from pipeline.envs.actions import format_of
from pipeline.envs.base import Env, Observation, StepResult, make_env
from pipeline.model.engines import HFSampler, VLLMSampler
from pipeline.model.policy import encode_prompt, mix_seed
from pipeline.rollout.prompts import build_prompt


@dataclass(frozen=True)
class EpisodeSpec:
    task_id: int       # environment seed
    task_group: int
    episode_id: int


def play_episodes(model, tokenizer, make_env: Callable[[], Env], specs: list[EpisodeSpec], *, history_turns: int,
                  max_new_tokens: int, temperature: float, batch_size: int, seed: int,
                  progress: Callable[[str], None] | None = None) -> pl.DataFrame:
    """Run every episode of `specs` to its end; returns the step rows (schema `tables.STEPS` less `iteration`).
    `model` is a Hugging Face model or a sampler of `pipeline.model.engines`."""
    sample = model if isinstance(model, (HFSampler, VLLMSampler)) else HFSampler(model, tokenizer)
    envs = [make_env() for _ in specs]
    fmt = format_of(envs[0]) if envs else None
    obs: list[Observation] = [env.reset(spec.task_id) for env, spec in zip(envs, specs)]
    history: list[list[tuple[str, str | None]]] = [[] for _ in specs]
    rows: list[dict] = []
    blocks = [range(b, min(b + batch_size, len(specs))) for b in range(0, len(specs), batch_size)]
    live = list(range(len(specs)))
    turn = 0
    started = time.perf_counter()
    while live:
        prompts = [build_prompt(envs[i].task_description(), history[i], obs[i].text, obs[i].admissible,
                                history_turns, fmt) for i in live]
        prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
        seeds = [mix_seed(seed, specs[i].episode_id, turn) for i in live]
        gens = []
        for block in blocks:   # live is in spec order, so each block's live episodes are a run of it
            rows_of = [k for k, i in enumerate(live) if i in block]
            if rows_of:
                sl = slice(rows_of[0], rows_of[-1] + 1)
                gens.extend(sample(prompt_ids[sl], max_new_tokens, temperature, seed=seeds[sl]))
        still = []
        for k, i in enumerate(live):
            g = gens[k]
            spec = specs[i]
            try:
                res, error = envs[i].step(g.text), None
            except Exception as e:  # noqa: BLE001 - one broken episode must not stop the rollout
                res, error = _failed_step(obs[i]), f"{type(e).__name__}: {e}"[:500]
            rows.append({
                "task_id": spec.task_id, "task_group": spec.task_group, "episode_id": spec.episode_id,
                "step": turn, "observation": obs[i].text, "anchor": obs[i].anchor, "prompt": prompts[k],
                "prompt_ids": prompt_ids[k], "response_ids": g.response_ids, "response_logprobs": g.logprobs,
                "response": g.text, "action": res.action, "action_valid": res.action_valid,
                "reward": res.reward, "terminated": res.terminated, "truncated": res.truncated,
                "success": res.success, "env_error": error,
            })
            history[i].append((obs[i].text, res.action))
            obs[i] = Observation(res.observation, res.anchor, res.admissible)
            if not (res.terminated or res.truncated):
                still.append(i)
        turn += 1
        if progress is not None:
            done = len(specs) - len(still)
            rate = len(rows) / max(time.perf_counter() - started, 1e-9)
            progress(f"turn {turn}: {done}/{len(specs)} episodes done, {len(rows)} turns, {rate:.1f} turns/s")
        live = still
    return finish_episodes(pl.DataFrame(rows, schema_overrides={"action": pl.String, "env_error": pl.String}))


def _failed_step(obs: Observation) -> StepResult:
    """The row of a turn whose `env.step` raised: not executed, no reward, the episode truncated here."""
    return StepResult(observation=obs.text, anchor=obs.anchor, reward=0.0, terminated=False, truncated=True,
                      action_valid=False, success=False, action=None, admissible=obs.admissible)


class EnvFailureError(ValueError):
    pass


def check_env_errors(steps: pl.DataFrame, max_share: float, where: str) -> dict[str, float]:
    """Count episodes whose environment raised (`env_error` set); fail above `max_share` of all episodes.

    Returns the metrics to report; raises `EnvFailureError` naming the share, the limit and the first error.
    """
    episodes = steps["episode_id"].n_unique()
    failed = steps.filter(pl.col("env_error").is_not_null())
    n = failed["episode_id"].n_unique()
    share = n / episodes if episodes else 0.0
    if share > max_share:
        first = failed.row(0, named=True)
        raise EnvFailureError(
            f"{where}: the environment raised in {n} of {episodes} episodes ({share:.1%}), above "
            f"faults.max_env_error_share = {max_share}; first in episode {first['episode_id']} (task "
            f"{first['task_id']}, turn {first['step']}): {first['env_error']}")
    return {"env_error_episodes": float(n), "env_error_share": share}


def play_with_params(params, model, tokenizer, specs: list[EpisodeSpec], *, temperature: float, seed: int,
                     progress: Callable[[str], None] | None = None) -> pl.DataFrame:
    """`play_episodes` with the environment, prompt and generation settings of a `Params`."""
    return play_episodes(model, tokenizer, lambda: make_env(params.env), specs,
                         history_turns=params.prompt.history_turns, max_new_tokens=params.policy.max_new_tokens,
                         temperature=temperature, batch_size=params.rollout.batch_size, seed=seed,
                         progress=progress)


def finish_episodes(steps: pl.DataFrame) -> pl.DataFrame:
    """Add the episode-level columns: return, length and success broadcast to every turn."""
    return steps.with_columns(
        pl.col("reward").sum().over("episode_id").alias("episode_return"),
        pl.len().over("episode_id").cast(pl.Int32).alias("episode_length"),
        pl.col("success").any().over("episode_id").alias("success"),
    ).sort("episode_id", "step")


def episode_summary(steps: pl.DataFrame) -> dict[str, float]:
    """Success rate, mean return, mean length and invalid-action rate of a step table."""
    eps = steps.group_by("episode_id").agg(
        pl.col("success").first(), pl.col("episode_return").first(), pl.col("episode_length").first()
    )
    return {
        "episodes": float(eps.height),
        "success_rate": float(eps["success"].mean()),
        "mean_return": float(eps["episode_return"].mean()),
        "mean_length": float(eps["episode_length"].mean()),
        "invalid_action_rate": float(1.0 - steps["action_valid"].mean()),
        "turns": float(steps.height),
    }
