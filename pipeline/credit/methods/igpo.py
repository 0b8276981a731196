"""IGPO: information-gain turn rewards (Wang et al., ICLR 2026; docs/credit-assignment.md, IGPO).

For an episode of turns 0..T−1 on a task with gold answer y* (`gold_answer()` of the environment: search's first
golden answer, SQL's gold query), the policy that sampled the iteration scores y* after each turn's context:
`P_k = exp(mean_j log π(y*_j | prompt of turn k, answer prefix, y*_<j))`, teacher-forced, the geometric mean of the
answer tokens' probabilities (the paper's Eq. and its released code: `exp(old_log_probs[gt span].mean())`). The
prompt of turn k is the context the policy saw before turn k (the question, then turns < k with their results), so
`P_0` is after the question alone. Turn rewards:

    r_t = P_{t+1} − P_t          for t < T−1  (the information gain of turn t: its result in the context)
    r_{T−1} = R(τ)                the outcome (the environment's episode return: search's exact match, SQL's
                                  execution accuracy; the paper's search reward is F1)

Within the task group every turn reward of every episode is z-normalised together (`normalise: joint`, the
released code's default: one mean and population std over the group's rewards; `separate`: the outcomes and the
information gains each on their own), and a turn's advantage is the discounted sum of its episode's normalised
rewards from it on, `A_t = Σ_{k ≥ t} γ^{k−t} r̂_k` (γ = `gamma`, 1 in the released runs). There is no separate
episode term: the outcome enters as the last turn's reward. The fit stage writes the information gains as the
`score` column (0 on an episode's last turn); nothing is learned, and the "model" the fit stage keeps between
iterations is a marker file.

`gain: log_prob` scores `log P` differences instead (the released code's `info_gain_type: log_prob_diff` option).

Loading params imports this module (the schema is assembled from the method registry), so torch, transformers
and `pipeline.model` are imported inside the functions that score (start-up cost).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import polars as pl
from pydantic import Field

from pipeline.credit.base import EpisodeConfig, Method, StepTable, Terms, group_norm, register
from pipeline.credit.reward_model import Log, StepRewardModel
from pipeline.data.section import FitBatching
from pipeline.envs.base import make_env, require

MARKER = "igpo.json"   # the fit stage's "model" of an iteration: IGPO learns nothing


class IgpoConfig(FitBatching):
    """Information-gain turn rewards from the sampling policy's probability of the gold answer."""
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount of the normalised turn rewards into the "
                         "advantage (the released runs: 1.0)")
    normalise: Literal["joint", "separate"] = Field(
        "joint", description="z-normalisation within the task group: joint, all turn rewards together (the paper "
        "and the released default); separate, the outcomes and the information gains each on their own")
    gain: Literal["prob", "log_prob"] = Field("prob", description="prob: P_{t+1} − P_t (the paper); log_prob: "
                                              "log P_{t+1} − log P_t (the released code's option)")


def turn_rewards(t, cfg) -> np.ndarray:
    """r_t: the information gain (`score`) on every turn but an episode's last, the episode's return on its last."""
    last = np.zeros(t.n, dtype=bool)
    last[t.starts + t.lengths - 1] = True
    outcome = np.repeat(t.episode_sum(t.reward), t.lengths)
    return np.where(last, outcome, t.col("score").astype(np.float64)), last


def terms(t: StepTable, cfg: IgpoConfig, episode: EpisodeConfig) -> Terms:
    """IGPO (Wang et al., ICLR 2026): `A_t = Σ_{k≥t} γ^{k−t} ẑ(r_k)`. In: the step table `t` with the fit
    stage's `score` (the information gains), the section and the episode settings (unused: no episode term); out: the
    terms per row, the step score r_t."""
    r, last = turn_rewards(t, cfg)
    if cfg.normalise == "joint":
        r_hat = group_norm(r, t.task, "mean_std_norm", std="population")
    else:   # each kind normalised within the group on its own rows
        r_hat = np.zeros(t.n)
        for rows in (last, ~last):
            idx = np.flatnonzero(rows)
            r_hat[idx] = group_norm(r[idx], t.task[idx], "mean_std_norm", std="population")
    return Terms(t.zeros(), r, t.returns(r_hat, cfg.gamma))


# ----------------------------------------------------------------------------------------------------------------
# The policy's probability of the gold answer after each turn

def answer_logprobs(model, prompts: list[list[int]], answer: list[tuple[list[int], list[int]]], pad_id: int,
                    batching: FitBatching) -> np.ndarray:
    """`mean_j log π(y*_j | prompt, prefix, y*_<j)` for each prompt, with `answer[i] = (prefix ids, answer ids)`:
    the prefix and the answer teacher-forced after the prompt, the mean over the answer's tokens. Tree packing
    (`batching.packing: tree`) computes each distinct prefix once: a group's prompts share the question, and every
    turn of a task scores the same answer."""
    from pipeline.model.ppo import sequence_logprobs  # start-up cost: torch

    responses = [pre + ans for pre, ans in answer]
    logps = sequence_logprobs(model, prompts, responses, pad_id, batching.batch_size, 1.0, None, batching.packing,
                              batching.micro_batch_tokens)
    return np.array([float(lp[len(pre):len(pre) + len(ans)].double().mean()) for lp, (pre, ans) in
                     zip(logps, answer, strict=True)])


def information_gains(steps: pl.DataFrame, mean_logp: np.ndarray, gain: str) -> np.ndarray:
    """Per turn, in `steps`' order (sorted by episode and step): `P_{t+1} − P_t` from the answer's mean log-prob
    before each turn (`mean_logp`), 0 on an episode's last turn (its reward is the outcome)."""
    value = mean_logp if gain == "log_prob" else np.exp(mean_logp)
    episode = steps["episode_id"].to_numpy()
    same_next = np.r_[episode[1:] == episode[:-1], False]
    nxt = np.r_[value[1:], 0.0]
    return np.where(same_next, nxt - value, 0.0)


@dataclass
class IgpoState:
    optimizer: None = None     # nothing is learned


@dataclass
class IgpoBatch:
    gains: np.ndarray
    p: np.ndarray              # P before each turn (for the diagnostics)


def gold_answers(params, task_ids: list[int]) -> dict[int, tuple[str, str, str]]:
    """The environment's gold answer response of each task (`gold_answer()`), one environment for all."""
    env = make_env(params.env)
    require(env, "gold_answer", "credit.method igpo")
    out = {}
    for task in dict.fromkeys(task_ids):
        env.reset(task)
        out[task] = env.gold_answer()
    return out


class InformationGain(StepRewardModel):
    score_kind = "turn"

    def init(self, policy_dir: Path, params) -> IgpoState:
        return IgpoState()

    def load(self, model_dir: Path, tables, params) -> IgpoState:
        return IgpoState()

    def save(self, state: IgpoState, model_dir: Path) -> dict[str, pl.DataFrame]:
        (Path(model_dir) / MARKER).write_text(json.dumps(
            {"method": "igpo", "learned": False, "why": "IGPO scores turns with the policy that sampled them"}) + "\n")
        return {}

    def prepare(self, state, steps: pl.DataFrame, rollout_policy, initial_policy, iteration, params) -> IgpoBatch:
        from pipeline.model.policy import load_policy  # start-up cost: torch

        cfg = params.credit.igpo
        model, tok = load_policy(rollout_policy, params.policy.dtype, params.runtime.device, train=True)
        gold = gold_answers(params, steps["task_id"].to_list())
        # the prefix and the answer tokenised apart, so that the answer's tokens are exactly its own
        ids = {task: (tok(pre, add_special_tokens=False)["input_ids"], tok(ans, add_special_tokens=False)["input_ids"])
               for task, (pre, ans, _) in gold.items()}
        for task, (_, ans_ids) in ids.items():
            if not ans_ids:
                raise ValueError(f"credit.method igpo: task {task}'s gold answer {gold[task][1]!r} has no tokens")
        answer = [ids[task] for task in steps["task_id"].to_list()]
        mean_logp = answer_logprobs(model, steps["prompt_ids"].to_list(), answer, tok.pad_token_id, cfg)
        del model
        return IgpoBatch(information_gains(steps, mean_logp, cfg.gain), np.exp(mean_logp))

    def fit(self, state, b: IgpoBatch, iteration, params, log: Log = None) -> dict[str, float]:
        return {}

    def score(self, state, b: IgpoBatch, params) -> np.ndarray:
        return b.gains

    def diagnostics(self, state, b: IgpoBatch, scores, params) -> dict[str, float]:
        if not len(scores):
            return {}
        return {"answer_prob_mean": float(b.p.mean()), "gain_positive_share": float((scores > 0).mean()),
                "gain_abs_mean": float(np.abs(scores).mean())}


def _value(t, cfg, gamma: float) -> np.ndarray:
    """The step value step-level preferences rank turns by: the discounted return of the raw turn rewards."""
    r, _ = turn_rewards(t, cfg)
    return t.returns(r, gamma)


METHOD = register(Method("igpo", "Σ_{k≥t} γ^{k−t} ẑ(r_k): information gain of the answer's probability per turn, "
                         "the outcome on the last, z-normalised in the task group", IgpoConfig, terms,
                         columns=("score",), reward_model=InformationGain(), order=8, step_value=_value,
                         requires=("gold_answer",), own_episode_term=True))
