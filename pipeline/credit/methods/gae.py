"""GAE: PPO's learned critic at the turn level (docs/credit-assignment.md, GAE).

`A_t = whiten(GAE_t) · step_advantage_w` (+ the shared `A^E` with `episode_term: true`), where
`GAE_t = Σ_l (γλ)^l δ_{t+l}` within the episode, `δ_t = r_t + γ V(s_{t+1}) [t+1 < T] − V(s_t)` (no bootstrap after
an episode's last turn, terminated or truncated), and `V(s_t)` the critic's value of the state the turn was taken
in, written by the fit stage (`score`) with the critic as it was before this iteration's fit.

The critic is the initial policy's body (all weights, or LoRA adapters) with a zero-initialised scalar head on
the last prompt token: the state before the response. Each iteration it scores the turns, then fits the λ-returns
`GAE_t + V_old(s_t)` of those values with `½ (V − target)²` (optionally clipped around `V_old`, verl's
`cliprange_value`) for `epochs` shuffled passes. Its diagnostics: the loss on this iteration's targets before and
after the fit, and the explained variance of its values against the turns' discounted returns. The critic and its
training are `pipeline.model.critic`; this module has the advantage, the method's settings and its fit stage's
steps.

Loading params imports this module (the schema is assembled from the method registry), so torch, transformers
and `pipeline.model` are imported inside the functions that train or score (start-up cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import Field

from pipeline.credit.base import (
    EpisodeConfig,
    Method,
    StepTable,
    Terms,
    discounted_returns,
    episode_advantage,
    group_norm,
    register,
)
from pipeline.credit.reward_model import Log, StepRewardModel, check_lora
from pipeline.data.section import FitBatching, LoraSettings
from pipeline.data.seeds import stage_seed
from pipeline.model.critic import Critic, explained_variance, train_critic
from pipeline.model.scalar_head import pad_id


class GaeConfig(FitBatching):
    """A learned turn-level critic; by default no episode term (PPO). The critic's optimiser defaults are verl's."""
    gamma: float = Field(0.95, ge=0.0, le=1.0, description="discount γ between turns")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE's λ between turns (1: the return minus the value; "
                       "0: the one-step TD error)")
    step_advantage_w: float = Field(1.0, ge=0.0, description="weight of the whitened GAE")
    episode_term: bool = Field(False, description="add the shared episode term A^E (credit.episode), to compare "
                               "the critic's step credit with GiGPO's on the same footing; false: pure PPO")
    lr: float = Field(1e-5, gt=0.0, description="critic AdamW learning rate (verl's critic default)")
    weight_decay: float = Field(0.01, ge=0.0, description="critic AdamW weight decay (verl's critic default)")
    epochs: int = Field(1, ge=0, description="passes over the iteration's turns per fit (verl's ppo_epochs)")
    minibatch_size: int = Field(64, ge=1, description="turns per critic optimiser step")
    value_clip: float | None = Field(0.5, gt=0.0, description="clip the new value to V_old ± this in the loss "
                                     "(verl's cliprange_value); null: no clipping")
    grad_clip: float = Field(1.0, gt=0.0)
    lora: LoraSettings | None = Field(None, description="train LoRA adapters on the frozen body (and the head) "
                                      "instead of every weight of the critic (null)")


def gae(episode_id: np.ndarray, step: np.ndarray, reward: np.ndarray, values: np.ndarray, gamma: float,
        lam: float) -> np.ndarray:
    """`GAE_t` per row (docs/credit-assignment.md, GAE), in the rows' own order, whatever it is; an episode's turns
    are its rows in the order of `step`."""
    episode_id, step = np.asarray(episode_id), np.asarray(step)
    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    if n == 0:
        return np.zeros(0)
    order = np.lexsort((step, episode_id))                         # by episode, then turn
    ep, v = episode_id[order], values[order]
    same = np.r_[ep[1:] == ep[:-1], False]                         # sorted row k+1 is the same episode's next turn
    v_next = np.where(same, np.r_[v[1:], 0.0], 0.0)
    delta = np.empty(n)
    delta[order] = np.asarray(reward, dtype=np.float64)[order] + gamma * v_next - v
    return discounted_returns(episode_id, step, delta, gamma * lam)


def terms(t: StepTable, cfg: GaeConfig, episode: EpisodeConfig) -> Terms:
    """GAE over turns (Schulman et al., 2016; verl's critic, turn-level as ArCHer's): `ω · whiten(GAE_t)`, plus
    `A^E` with `episode_term`. In: the step table `t` with the fit stage's `score` (V(s_t)), the section and the
    episode settings; out: the terms per row, the step score GAE_t."""
    A = gae(t.episode_id, t.step, t.reward, t.col("score"), cfg.gamma, cfg.lam)
    whitened = group_norm(A, np.zeros(t.n, dtype=np.int64), "mean_std_norm")   # over every turn of the iteration
    ep = episode_advantage(t, episode) if cfg.episode_term else t.zeros()
    return Terms(ep, A, cfg.step_advantage_w * whitened)


def lambda_return(t, cfg, gamma: float) -> np.ndarray:
    """The critic's λ-return `GAE_t + V(s_t)` at the method's own γ and λ: GAE's step value for preferences (the
    step-level preference objective's `gamma` is for returns, which this is not)."""
    values = t.col("score").astype(np.float64)
    return gae(t.episode_id, t.step, t.reward, values, cfg.gamma, cfg.lam) + values


@dataclass
class GaeState:
    critic: Critic
    tokenizer: object
    optimizer: object


@dataclass
class GaeBatch:
    prompts: list
    episode_id: np.ndarray
    step: np.ndarray
    reward: np.ndarray
    seed: int
    values: np.ndarray | None = None   # V_old(s_t): the critic's values before this iteration's fit


class TurnCritic(StepRewardModel):
    score_kind = "state"   # the score is V(s_t), a state's value: the oracle compares it with the distance left

    def init(self, policy_dir: Path, params) -> GaeState:
        from transformers import AutoTokenizer  # start-up cost: transformers

        from pipeline.model import adamw  # start-up cost: torch

        cfg = params.credit.gae
        critic = Critic.from_policy(policy_dir, params.policy.dtype, params.runtime.device, cfg.lora,
                                    seed=stage_seed("reward_init", params.seed))
        tok = AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
        return GaeState(critic, tok, adamw.build(critic.parameters(), cfg.lr, cfg.weight_decay))

    def load(self, model_dir: Path, tables, params) -> GaeState:
        from transformers import AutoTokenizer  # start-up cost: transformers

        from pipeline.model import adamw  # start-up cost: torch

        cfg = params.credit.gae
        check_lora(model_dir, cfg.lora, "credit.gae.lora")
        critic = Critic.load(model_dir, params.policy.dtype, params.runtime.device)
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        return GaeState(critic, tok, adamw.build(critic.parameters(), cfg.lr, cfg.weight_decay))

    def save(self, state: GaeState, model_dir: Path) -> dict:
        state.critic.save(model_dir)
        state.tokenizer.save_pretrained(model_dir)
        return {}

    def prepare(self, state: GaeState, steps, rollout_policy, initial_policy, iteration, params) -> GaeBatch:
        return GaeBatch(steps["prompt_ids"].to_list(), steps["episode_id"].to_numpy(), steps["step"].to_numpy(),
                        steps["reward"].to_numpy().astype(np.float64), seed=stage_seed("fit", params.seed, iteration))

    def score_first(self, params) -> bool:
        return True   # PPO's order: the advantages come from the values before the critic's fit

    def _values(self, state: GaeState, b: GaeBatch, params) -> np.ndarray:
        cfg = params.credit.gae
        v = state.critic.state_values(b.prompts, pad_id(state.tokenizer), cfg)
        return v.double().cpu().numpy()

    def score(self, state: GaeState, b: GaeBatch, params) -> np.ndarray:
        if b.values is None:
            b.values = self._values(state, b, params)
        return b.values

    def _targets(self, b: GaeBatch, cfg) -> np.ndarray:
        return gae(b.episode_id, b.step, b.reward, b.values, cfg.gamma, cfg.lam) + b.values

    def fit(self, state: GaeState, b: GaeBatch, iteration, params, log: Log = None) -> dict[str, float]:
        cfg = params.credit.gae
        self.score(state, b, params)             # V_old: the values before the fit (computed once per batch)
        target = self._targets(b, cfg)
        if log is not None:
            log(f"fitting the critic on {len(b.prompts)} turns ({cfg.epochs} epochs, minibatches of "
                f"{cfg.minibatch_size})")
        stats = train_critic(state.critic, state.optimizer, b.prompts, b.values, target, cfg,
                             pad_id(state.tokenizer), seed=b.seed, progress=log)
        after = self._values(state, b, params)
        returns = discounted_returns(b.episode_id, b.step, b.reward, cfg.gamma)
        stats.update({
            "critic_loss_before": float(0.5 * np.mean((b.values - target) ** 2)) if len(target) else 0.0,
            "critic_loss_after": float(0.5 * np.mean((after - target) ** 2)) if len(target) else 0.0,
            "explained_variance_before": explained_variance(b.values, returns),
            "explained_variance_after": explained_variance(after, returns),
            "value_mean": float(b.values.mean()) if len(b.values) else 0.0,
        })
        return stats


METHOD = register(Method("gae", "whiten(GAE_t) of a learned turn-level critic V(s_t) (+ A^E with episode_term)",
                         GaeConfig, terms, columns=("score",), step_weight="step_advantage_w",
                         reward_model=TurnCritic(), order=7,
                         step_value=lambda_return))
