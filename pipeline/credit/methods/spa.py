"""SPA: stepwise progress attribution, critic-free (docs/credit-assignment.md, SPA).

`A_t = A^E(τ) + ω · norm(G^SPA_t; all turns of g)`, where `G^SPA` is the γ-discounted return of the step reward
`r^SPA_t = progress_w · c_t + grounding_w · g_t` (g_t = 1 for a valid, executed action) and c_t is the progress
estimator's contribution, written by the fit stage (`score`).

The estimator is the policy's base model plus a scalar head on the final hidden state at each turn's last token
(**Decision**: on the hidden state, not on the vocabulary logits), zero-initialised so that a new estimator gives
every turn c_t = 0. Each iteration the replay (SPA's `replay.parquet`: the turns of the last `replay_iterations`
iterations) is extended with this iteration's turns, the estimator trains on it so that each episode's
contributions sum to its outcome, `(Σ_t c_t − R_final(τ))²`, and then scores this iteration's turns. The estimator
and its training are `pipeline.model.progress_estimator`; this module has the advantage, the replay, the method's
settings and its fit stage's steps.

Loading params imports this module (the schema is assembled from the method registry), so torch, transformers
and `pipeline.model` are imported inside the functions that train or score (start-up cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
from pydantic import Field

from pipeline.credit.base import (
    EpisodeConfig,
    Method,
    StepTable,
    Terms,
    episode_advantage,
    group_norm,
    learned_return,
    register,
)
from pipeline.credit.reward_model import Log, StepRewardModel, check_lora, episode_index
from pipeline.data.section import FitBatching, LoraSettings, Mode
from pipeline.data.seeds import stage_seed
from pipeline.data.tables import Table, empty_table
from pipeline.model.progress_estimator import ProgressEstimator, spa_loss, train_progress
from pipeline.model.scalar_head import pad_id

REPLAY_FILE = "replay.parquet"
REPLAY = Table(pa.schema([           # the estimator's training window: the turns of recent iterations
    ("iteration", pa.int32()),
    ("episode_id", pa.int64()),
    ("step", pa.int32()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("outcome", pa.float64()),        # R_final: success (the task score where the environment has one)
]), contiguous=True, finite=("outcome",), empty_ok=True)


class SpaConfig(FitBatching):
    """A progress estimator whose turn contributions sum to the outcome; the episode level is the shared
    `credit.episode`."""
    progress_w: float = Field(1.0, ge=0.0)
    grounding_w: float = Field(0.5, ge=0.0)
    gamma: float = Field(0.95, ge=0.0, le=1.0, description="discount of the SPA step return")
    step_advantage_w: float = Field(1.0, ge=0.0, description="weight ω of the step-level advantage")
    replay_iterations: int = Field(3, ge=1, description="recent iterations the estimator trains on")
    lr: float = Field(1e-3, gt=0.0, description="estimator AdamW learning rate")
    epochs: int = Field(2, ge=0, description="passes over the replay per iteration")
    episodes_per_batch: int = Field(16, ge=1, description="episodes per optimiser step")
    grad_clip: float = Field(1.0, gt=0.0)
    mode: Mode = Field("mean_std_norm", description="normalisation of the step level")
    lora: LoraSettings | None = Field(None, description="train LoRA adapters on the frozen body (and the head) "
                                      "instead of every weight of the estimator (null)")


def terms(t: StepTable, cfg: SpaConfig, episode: EpisodeConfig) -> Terms:
    """SPA (stepwise progress attribution): `A^E + ω · norm(G^SPA_t; all turns of g)`. In: the step table `t`
    with the fit stage's `score` (c_t), the section and the episode settings; out: the terms per row, the step score
    G^SPA."""
    r_spa = cfg.progress_w * t.col("score").astype(np.float64) + cfg.grounding_w * t.valid.astype(np.float64)
    G = t.returns(r_spa, cfg.gamma)
    return Terms(episode_advantage(t, episode), G, cfg.step_advantage_w * group_norm(G, t.task, cfg.mode))


@dataclass
class SpaState:
    estimator: ProgressEstimator
    tokenizer: object
    optimizer: object
    replay: pl.DataFrame         # the turns of the last `replay_iterations` iterations


@dataclass
class SpaBatch:
    prompts: list                # this iteration's turns
    responses: list
    turn_episode: np.ndarray
    outcome: np.ndarray          # per episode of this iteration
    replay: pl.DataFrame         # the training window, this iteration included
    seed: int


class ProgressModel(StepRewardModel):
    extra_tables = {REPLAY_FILE: REPLAY}

    def init(self, policy_dir: Path, params) -> SpaState:
        from transformers import AutoTokenizer  # start-up cost: transformers

        from pipeline.model import adamw  # start-up cost: torch

        cfg = params.credit.spa
        est = ProgressEstimator.from_policy(policy_dir, params.policy.dtype, params.runtime.device, cfg.lora,
                                            seed=stage_seed("reward_init", params.seed))
        tok = AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
        return SpaState(est, tok, adamw.build(est.parameters(), cfg.lr), empty_table(REPLAY))

    def load(self, model_dir: Path, tables, params) -> SpaState:
        from transformers import AutoTokenizer  # start-up cost: transformers

        from pipeline.model import adamw  # start-up cost: torch

        check_lora(model_dir, params.credit.spa.lora, "credit.spa.lora")
        est = ProgressEstimator.load(model_dir, params.policy.dtype, params.runtime.device)
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        opt = adamw.build(est.parameters(), params.credit.spa.lr)
        return SpaState(est, tok, opt, tables[REPLAY_FILE])

    def save(self, state: SpaState, model_dir: Path) -> dict[str, pl.DataFrame]:
        state.estimator.save(model_dir)
        state.tokenizer.save_pretrained(model_dir)
        return {REPLAY_FILE: state.replay}

    def prepare(self, state: SpaState, steps, rollout_policy, initial_policy, iteration, params) -> SpaBatch:
        cfg = params.credit.spa
        current = steps.select("iteration", "episode_id", "step", "prompt_ids", "response_ids",
                               pl.col("success").cast(pl.Float64).alias("outcome"))
        keep = pl.col("iteration") > iteration - cfg.replay_iterations
        replay = pl.concat([state.replay.filter(keep), current.filter(keep)]).sort("episode_id", "step")
        te, _ = episode_index(steps["episode_id"])
        outcome = steps.group_by("episode_id", maintain_order=True).agg(
            pl.col("success").first())["success"].cast(pl.Float64).to_numpy()
        return SpaBatch(steps["prompt_ids"].to_list(), steps["response_ids"].to_list(), te, outcome, replay,
                        seed=stage_seed("fit", params.seed, iteration))

    def fit(self, state: SpaState, b: SpaBatch, iteration, params, log: Log = None) -> dict[str, float]:
        state.replay = b.replay
        te, eps = episode_index(b.replay["episode_id"])
        outcome = b.replay.group_by("episode_id", maintain_order=True).agg(
            pl.col("outcome").first())["outcome"].to_numpy()
        if log is not None:
            log(f"training the progress estimator on {len(eps)} episodes ({b.replay.height} turns) of iterations "
                f"{b.replay['iteration'].min()}..{b.replay['iteration'].max()}")
        return train_progress(state.estimator, state.optimizer, b.replay["prompt_ids"].to_list(),
                              b.replay["response_ids"].to_list(), te, outcome, params.credit.spa,
                              pad_id(state.tokenizer), seed=b.seed, progress=log)

    def score(self, state: SpaState, b: SpaBatch, params) -> np.ndarray:
        cfg = params.credit.spa
        c = state.estimator.contributions(b.prompts, b.responses, pad_id(state.tokenizer), cfg)
        return c.double().cpu().numpy()

    def diagnostics(self, state: SpaState, b: SpaBatch, scores, params) -> dict[str, float]:
        import torch  # start-up cost: torch

        if not len(scores):
            return {}
        loss = spa_loss(torch.tensor(scores), torch.tensor(b.turn_episode), torch.tensor(b.outcome))
        return {"estimator_loss_current": float(loss)}


METHOD = register(Method("spa", "A^E + ω · norm(G^SPA_t; all turns of g), r^SPA = progress_w c_t + "
                         "grounding_w [valid]", SpaConfig, terms, columns=("score",),
                         step_weight="step_advantage_w", reward_model=ProgressModel(), order=5,
                         step_value=learned_return))
