"""The interface of a learned per-turn model (docs/credit-assignment.md, OPRL; SPA; GAE), and one fit iteration of it.

The state after iteration i lives in `iter_i/reward_model/` (a model folder) plus the model's `extra_tables` beside
it (SPA's replay); its optimiser (the state's `optimizer`) in `iter_i/optimizer/reward_model.pt`
(`pipeline.model.adamw`). `reward_init` writes iteration 0's from the initial policy; each iteration the fit stage
loads the state of i-1, prepares this iteration's turns, fits and scores them (in the order the method says), and
saves the state of i. The credit-quality benchmark runs the same calls in memory.

Loading params imports this module (the schema is assembled from the method registry), so torch, transformers
and `pipeline.model` are imported inside the functions that train or score (start-up cost).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pipeline.data.tables import Table, atomic_dir, read_table, write_table

OPTIMIZER = "reward_model"   # results/iter_i/optimizer/reward_model.pt
Log = Callable[[str], None] | None


class StepRewardModel(ABC):
    extra_tables: dict[str, Table] = {}  # file name in the iteration folder -> its declared table
    # what the per-turn score rates, for the oracle (pipeline.credit.oracle.score_advantages): "turn", the action
    # (OPRL's r_φ, SPA's c_t: good turns should score higher), or "state", the state it was taken in (GAE's V(s_t):
    # states fewer moves from success should score higher)
    score_kind: str = "turn"

    @abstractmethod
    def init(self, policy_dir: Path, params) -> Any:
        """The model before any RL, built from the initial policy's folder."""

    @abstractmethod
    def load(self, model_dir: Path, tables: dict[str, pl.DataFrame], params) -> Any:
        """The state saved by `save` (the model folder and the extra tables)."""

    @abstractmethod
    def save(self, state, model_dir: Path) -> dict[str, pl.DataFrame]:
        """Write the model folder (an empty temporary folder); return the extra tables to write beside it."""

    @abstractmethod
    def prepare(self, state, steps: pl.DataFrame, rollout_policy: Path, initial_policy: Path, iteration: int,
                params) -> Any:
        """What `fit` and `score` read for this iteration's turns (`steps` sorted by episode and step)."""

    @abstractmethod
    def fit(self, state, batch, iteration: int, params, log: Log = None) -> dict[str, float]:
        """Train on this iteration; returns statistics to log."""

    @abstractmethod
    def score(self, state, batch, params) -> np.ndarray:
        """The per-turn score the advantage function reads (`score` column), in `steps`' row order."""

    def score_first(self, params) -> bool:
        """Whether the turns are scored with the model as it was before this iteration's fit."""
        return False

    def diagnostics(self, state, batch, scores: np.ndarray, params) -> dict[str, float]:
        return {}


def fit_iteration(model: StepRewardModel, state, steps: pl.DataFrame, rollout_policy: Path, initial_policy: Path,
                  iteration: int, params, log: Log = None) -> tuple[np.ndarray, dict[str, float]]:
    """One iteration of `model`: prepare, then fit and score in the method's order; returns (scores, stats), the
    scores in the order of `steps` sorted by episode and step.

    An episode whose environment raised (`env_error` set, `pipeline.rollout.episodes`) says nothing about the
    policy: as the advantages stage leaves it out of every group statistic, the model neither fits on it nor
    scores it, and its turns get score 0 (their advantage is 0 whatever the score)."""
    steps = steps.sort("episode_id", "step")
    broken = (steps.select(pl.col("episode_id").filter(pl.col("env_error").is_not_null()).unique())["episode_id"]
              if "env_error" in steps.columns else pl.Series([]))
    if broken.len():
        keep = ~steps["episode_id"].is_in(broken.implode())
        scores, stats = fit_iteration(model, state, steps.filter(keep), rollout_policy, initial_policy, iteration,
                                      params, log)
        full = np.zeros(steps.height)
        full[keep.to_numpy()] = scores
        return full, {**stats, "env_error_episodes_left_out": float(broken.len())}
    batch = model.prepare(state, steps, rollout_policy, initial_policy, iteration, params)
    if model.score_first(params):
        scores = model.score(state, batch, params)
        stats = model.fit(state, batch, iteration, params, log)
    else:
        stats = model.fit(state, batch, iteration, params, log)
        scores = model.score(state, batch, params)
    scores = np.asarray(scores, dtype=np.float64)
    if not np.isfinite(scores).all():
        raise ValueError(f"iteration {iteration}: the step-reward model gave non-finite scores")
    stats = dict(stats)
    stats["score_abs_mean"] = float(np.abs(scores).mean()) if len(scores) else 0.0
    stats.update(model.diagnostics(state, batch, scores, params))
    return scores, stats


def episode_index(episode_ids: pl.Series) -> tuple[np.ndarray, list]:
    """(the index of each turn's episode, the episodes in order of first appearance): the map from turns to
    episodes that a learned model's episode-level loss sums over."""
    episodes = episode_ids.unique(maintain_order=True).to_list()
    index = {e: i for i, e in enumerate(episodes)}
    return np.array([index[e] for e in episode_ids.to_list()], dtype=np.int64), episodes


def check_lora(model_dir: Path, lora, key: str) -> bool:
    """Whether the saved model at `model_dir` is a LoRA adapter; an error when that disagrees with the params'
    `key` (the model was made under other settings: rerun from reward_init)."""
    from pipeline.model.policy import is_adapter  # start-up cost: torch

    adapter = is_adapter(model_dir)
    if adapter != (lora is not None):
        saved = "a LoRA adapter" if adapter else "a whole model"
        raise ValueError(f"{model_dir}: the saved step-reward model is {saved} but {key} is "
                         f"{'null' if lora is None else 'set'}; rerun from the reward_init stage (snakemake does so "
                         "when the params change)")
    return adapter


def save_state(model: StepRewardModel, state, model_dir: Path, iter_dir: Path) -> None:
    """Write `state` as `model_dir` (atomically, whole), its optimiser's state and its extra tables into
    `iter_dir`. The caller prunes older optimiser states (`adamw.prune`) once all its outputs are written."""
    from pipeline.model import adamw  # start-up cost: torch
    if state.optimizer is not None:    # a scorer that learns nothing (IGPO) has none
        adamw.save(state.optimizer, iter_dir, OPTIMIZER)
    with atomic_dir(model_dir) as tmp:
        tables = model.save(state, tmp)
    for name, df in tables.items():
        write_table(df, iter_dir / name, model.extra_tables[name])


def load_state(model: StepRewardModel, model_dir: Path, iter_dir: Path, params):
    """The state `save_state` wrote; a clear error when the folder or a table is missing."""
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: step-reward model missing; run the reward_init or fit stage")
    from pipeline.model import adamw  # start-up cost: torch

    tables = {name: read_table(iter_dir / name, schema) for name, schema in model.extra_tables.items()}
    state = model.load(model_dir, tables, params)
    if state.optimizer is not None:
        adamw.restore(state.optimizer, iter_dir, OPTIMIZER, required=True)
    return state
