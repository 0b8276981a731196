"""What every credit method shares: the `Method` object the registry holds, the step table as numpy arrays, group
statistics, the episode-level term all methods share, and the invalid-action penalty (docs/credit-assignment.md).

A method is one module in `pipeline/credit/methods/` that calls `register(Method(...))`. The `Method` holds its params
section (a pydantic class, assembled into `credit.<name>` of the schema), the columns its advantage function reads
besides the step keys, that pure function, and for methods with a learned step reward (OPRL, SPA, GAE) its
`StepRewardModel`. The schema's method list, the stage registry's fit stages, the fit stage's dispatch and the
benchmarks all read this registry; nothing else names a method.

Every advantage is composed the same way (docs/credit-assignment.md, Episode level, shared; Invalid actions):

    advantage = episode_advantage + step_advantage − penalty

where `episode_advantage` is the method's episode term (the shared `A^E` for every method that has one),
`step_advantage` its weighted step term, and `penalty` = `credit.invalid_penalty` on invalid turns, applied once
after every normalisation and entering no group statistic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import polars as pl
from pydantic import Field

from pipeline.credit.grouping import dense_rank
from pipeline.data.section import EpisodeStats, Mode, Section

if TYPE_CHECKING:
    from pipeline.credit.reward_model import StepRewardModel

EPS = 1e-6  # docs/credit-assignment.md, Terms: ε in every normalisation
KEYS = ("episode_id", "step", "task_group", "reward", "action_valid")  # what every method reads
OUTPUT = ("episode_id", "step", "episode_advantage", "step_score", "step_advantage", "penalty", "advantage")


class EpisodeConfig(Section):
    """docs/credit-assignment.md, Episode level, shared by every method: one configuration of `A^E` for all methods
    that have an episode term, so that methods differ only in their step-level credit."""
    mode: Mode = Field("mean_std_norm", description="normalisation of the episode return within its task group")
    episode_stats: EpisodeStats = Field(
        "per_turn", description="per_turn: one value per turn row in the group statistics (the released GiGPO "
        "code; long failed episodes cannot outweigh short successes under token-mean PPO); per_episode: one per "
        "episode (GRPO paper, Eq. 3)")


class Terms(NamedTuple):
    """A method's output before the penalty: one value per row of the `StepTable`, in its row order."""
    episode_advantage: np.ndarray
    step_score: np.ndarray | None      # the value the step level normalises (G_t, r_φ, G^SPA); None: no step term
    step_advantage: np.ndarray         # the weighted step term (zeros for episode-level methods)


@dataclass(frozen=True)
class Method:
    name: str
    summary: str                                   # one line: what the advantage of a turn is
    config: type[Section]                          # the section `credit.<name>`: step-level keys only
    terms: Callable[[StepTable, Section, EpisodeConfig], Terms]  # pure: no I/O, no model
    columns: tuple[str, ...] = ()                  # read besides KEYS (e.g. step_group, history_groups, score)
    step_weight: str | None = None                 # the key of `config` weighting the step term (0: A^E alone)
    reward_model: StepRewardModel | None = None    # a learned per-turn score, fitted by the fit stage
    order: int = 100                               # position in listings
    # how many anchors deep the method reads `history_groups`: a number, or the key of its section that holds it
    # (HGPO's `depth`; null there: prompt.history_turns + 1). Declared, not computed, so that the group stage's keys
    # follow from params alone. None: the method reads no history groups
    history_depth: int | str | None = None
    # the per-turn value step-level preferences rank turns by (docs/credit-assignment.md, Step-level preference
    # updates): step_value(table, config, gamma), one value per row; None: the discounted return of the
    # environment's rewards at `gamma` (update.step_dpo.gamma)
    step_value: Callable[[StepTable, Section, float], np.ndarray] | None = None
    # the optional environment capabilities the method reads (`pipeline.envs.base.CAPABILITIES`, e.g. IGPO's
    # `gold_answer`): an environment without one is refused when the params load, naming `credit.method`
    requires: tuple[str, ...] = ()
    # the method's episode term is its own, not the shared `credit.episode` one (RLOO: its baseline; IGPO: none, the
    # outcome is its last turn's reward)
    own_episode_term: bool = False

    @property
    def fits(self) -> bool:
        return self.reward_model is not None


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in _REGISTRY and _REGISTRY[method.name] is not method:
        raise ValueError(f"credit method {method.name!r} is registered twice")
    _REGISTRY[method.name] = method
    return method


def registered() -> dict[str, Method]:
    return dict(sorted(_REGISTRY.items(), key=lambda kv: (kv[1].order, kv[0])))


# ----------------------------------------------------------------------------------------------------------------
# Group statistics (docs/credit-assignment.md, Terms)

def dense_keys(keys: np.ndarray) -> np.ndarray:
    """Small non-negative integer ids for `keys`: the keys themselves when already in [0, 2n), else dense ranks."""
    keys = np.asarray(keys)
    n = len(keys)
    if n and keys.dtype.kind in "iu" and keys.min() >= 0 and keys.max() < 2 * n:
        return keys.astype(np.int64, copy=False)
    return dense_rank(keys)


def group_norm(x: np.ndarray, keys: np.ndarray, mode: str, std: str = "unbiased") -> np.ndarray:
    """`norm(x; G)` of docs/credit-assignment.md, Terms, for every row at once; a group of size 1 gives 0.

    `keys` names each row's group. `mean_norm`: x − mean_G(x); `mean_std_norm`: (x − mean_G(x)) / (std_G(x) + ε),
    std unbiased (ddof 1) or population (ddof 0). Two passes of `np.bincount`: O(rows), no sorting.
    """
    x = np.asarray(x, dtype=np.float64)
    if len(x) == 0:
        return np.zeros(0)
    k = dense_keys(keys)
    count = np.bincount(k)
    mean = np.bincount(k, x) / np.maximum(count, 1)
    out = x - mean[k]
    if mode == "mean_std_norm":
        ddof = 1 if std == "unbiased" else 0
        var = np.bincount(k, out * out) / np.maximum(count - ddof, 1)
        out = out / (np.sqrt(var)[k] + EPS)
    elif mode != "mean_norm":
        raise ValueError(f"unknown normalisation mode {mode!r}; expected mean_norm or mean_std_norm")
    return np.where(count[k] > 1, out, 0.0)


def discounted_returns(episode_id: np.ndarray, step: np.ndarray, reward: np.ndarray, gamma: float) -> np.ndarray:
    """`G_t = r_t + γ G_{t+1}` within each episode (docs/credit-assignment.md, GiGPO, step level), any row order.

    Vectorised over episodes: one numpy pass per distance from the episode's end, so the work is O(turns) and
    the number of passes is the longest episode's length.
    """
    n = len(reward)
    if n == 0:
        return np.zeros(0)
    episode_id, step = np.asarray(episode_id), np.asarray(step)
    presorted = n < 2 or bool(np.all((episode_id[1:] > episode_id[:-1])
                                     | ((episode_id[1:] == episode_id[:-1]) & (step[1:] > step[:-1]))))
    order = np.arange(n) if presorted else np.lexsort((step, episode_id))
    ep, r = episode_id[order], np.asarray(reward, dtype=np.float64)[order]
    last = np.r_[ep[1:] != ep[:-1], True]                     # row ends its episode
    end_idx = np.flatnonzero(last)
    ends = np.repeat(end_idx, np.diff(np.r_[-1, end_idx]))   # index of each row's episode end
    dist = ends - np.arange(n)                                # turns to the episode's end
    by_dist = np.argsort(dist, kind="stable")
    bounds = np.searchsorted(dist[by_dist], np.arange(dist.max() + 2))
    G = np.empty(n)
    idx = by_dist[bounds[0]:bounds[1]]
    G[idx] = r[idx]
    for d in range(1, dist.max() + 1):
        idx = by_dist[bounds[d]:bounds[d + 1]]
        G[idx] = r[idx] + gamma * G[idx + 1]
    out = np.empty(n)
    out[order] = G
    return out


class StepTable:
    """The step table's columns as numpy arrays, rows sorted by (episode_id, step), with episode boundaries."""

    def __init__(self, steps: pl.DataFrame):
        df = steps.sort("episode_id", "step")
        self.df = df
        self.episode_id = df["episode_id"].to_numpy()
        self.step = df["step"].to_numpy()
        self.task = df["task_group"].to_numpy()
        self.reward = df["reward"].to_numpy().astype(np.float64)
        self.valid = df["action_valid"].to_numpy().astype(bool)
        n = df.height
        first = np.r_[True, self.episode_id[1:] != self.episode_id[:-1]] if n else np.zeros(0, bool)
        self.starts = np.flatnonzero(first)
        self.lengths = np.diff(np.r_[self.starts, n])

    @property
    def n(self) -> int:
        return self.df.height

    def col(self, name: str) -> np.ndarray:
        return self.df[name].to_numpy()

    def episode_sum(self, values: np.ndarray) -> np.ndarray:
        """Σ over each episode's rows, one value per episode."""
        return np.add.reduceat(values, self.starts) if len(self.starts) else np.zeros(0)

    def returns(self, reward: np.ndarray, gamma: float) -> np.ndarray:
        return discounted_returns(self.episode_id, self.step, reward, gamma)

    def zeros(self) -> np.ndarray:
        return np.zeros(self.n)


def env_return(t: StepTable, cfg: Section, gamma: float) -> np.ndarray:
    """The discounted return of the environment's rewards from each turn: the step value of the methods whose
    credit comes from the rewards alone (GRPO, RLOO, GiGPO, HGPO)."""
    return t.returns(t.reward, gamma)


def learned_return(t: StepTable, cfg: Section, gamma: float) -> np.ndarray:
    """The discounted return of a learned per-turn score (`score`, the fit stage's): the step value of OPRL and SPA."""
    return t.returns(t.col("score").astype(np.float64), gamma)


def step_values(method: Method, t: StepTable, cfg: Section, gamma: float) -> np.ndarray:
    return (method.step_value or env_return)(t, cfg, gamma)


def episode_advantage(t: StepTable, episode: EpisodeConfig) -> np.ndarray:
    """The shared `A^E = norm(R(τ); task group)` (docs/credit-assignment.md, GRPO; Episode level, shared) per row.

    Statistics over one value per episode (`per_episode`) or one per turn row (`per_turn`).
    """
    R = t.episode_sum(t.reward)
    if episode.episode_stats == "per_episode":
        return np.repeat(group_norm(R, t.task[t.starts], episode.mode), t.lengths)
    if episode.episode_stats == "per_turn":
        return group_norm(np.repeat(R, t.lengths), t.task, episode.mode)
    raise ValueError(f"unknown episode_stats {episode.episode_stats!r}; expected per_episode or per_turn")


def penalty(valid: np.ndarray, invalid_penalty: float) -> np.ndarray:
    """`invalid_penalty` on rows whose action was invalid, else 0 (docs/credit-assignment.md, Invalid actions)."""
    return np.where(valid, 0.0, invalid_penalty)


def output_frame(t: StepTable, terms: Terms, pen: np.ndarray) -> pl.DataFrame:
    """The advantages table (`tables.ADVANTAGES`): `advantage = episode_advantage + step_advantage − penalty`."""
    n = t.n
    score = (pl.Series("step_score", terms.step_score, dtype=pl.Float64) if terms.step_score is not None
             else pl.Series("step_score", [None] * n, dtype=pl.Float64))
    return pl.DataFrame([
        t.df["episode_id"], t.df["step"],
        pl.Series("episode_advantage", terms.episode_advantage, dtype=pl.Float64), score,
        pl.Series("step_advantage", terms.step_advantage, dtype=pl.Float64),
        pl.Series("penalty", pen, dtype=pl.Float64),
        pl.Series("advantage", terms.episode_advantage + terms.step_advantage - pen, dtype=pl.Float64),
    ])


def compute(method: Method, steps: pl.DataFrame, cfg: Section, episode: EpisodeConfig,
            invalid_penalty: float) -> pl.DataFrame:
    """One method's advantages on `steps`, sorted by (`episode_id`, `step`)."""
    missing = [c for c in KEYS + method.columns if c not in steps.columns]
    if missing:
        raise ValueError(f"credit.method {method.name!r} needs columns {missing}, which the input table lacks")
    t = StepTable(steps)
    return output_frame(t, method.terms(t, cfg, episode), penalty(t.valid, invalid_penalty))
