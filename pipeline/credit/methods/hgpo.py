"""HGPO (docs/credit-assignment.md, HGPO): `A_t = A^E(τ) + ω Σ_k w_k norm(G_t; key_k group)`, `w_k ∝ (k+1)^α`.

`history_groups[k-1]` is the id of the key (task group, s_{t−k+1}, …, s_t) from the group stage; the sum runs over
the depths whose group is not a singleton and the weights are renormalised over them. With `base_group` (the
default), the shared `A^E` is the k = 0 term of weight 1.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from pipeline.credit.base import (
    EpisodeConfig,
    Method,
    StepTable,
    Terms,
    dense_keys,
    episode_advantage,
    group_norm,
    register,
)
from pipeline.data.section import Mode, Section


class HgpoConfig(Section):
    """Groups keyed by the last k anchors, k = 1..depth."""
    mode: Mode = Field("mean_std_norm", description="normalisation within each key group")
    std: Literal["population", "unbiased"] = Field("population", description="std of mean_std_norm")
    gamma: float = Field(0.95, ge=0.0, le=1.0, description="discount of G_t")
    alpha: float = Field(1.0, description="w_k ∝ (k+1)^alpha")
    depth: int | None = Field(None, ge=1, le=21, description="deepest key K+1; null: prompt.history_turns + 1")
    step_advantage_w: float = Field(1.0, ge=0.0, description="weight ω of the step-level term")
    base_group: bool = Field(True, description="the shared episode term A^E as the k = 0 term of weight 1 "
                             "(off: HGPO's step terms alone, as in its paper's ablation)")


def terms(t: StepTable, cfg: HgpoConfig, episode: EpisodeConfig) -> Terms:
    """HGPO: `ω Σ_k w_k norm(G_t; task group + last k anchors)`, `w_k ∝ (k+1)^α` over non-singleton depths.
    In: the step table `t` (rewards, `history_groups`), the section and the episode settings; out: the terms per row."""
    n = t.n
    lens = t.df["history_groups"].list.len()
    depth = int(lens.min()) if n else 0
    if n and lens.max() != depth:
        raise ValueError("history_groups: rows carry keys of different depths; rerun the group stage")
    keys = (t.df["history_groups"].list.to_array(depth).to_numpy().reshape(n, depth) if n
            else np.zeros((0, 0), np.int64))
    G = t.returns(t.reward, cfg.gamma)
    num, den = np.zeros(n), np.zeros(n)
    for k in range(1, depth + 1):
        key = dense_keys(keys[:, k - 1])
        w = np.where(np.bincount(key)[key] > 1, float((k + 1) ** cfg.alpha), 0.0)
        num += w * group_norm(G, key, cfg.mode, cfg.std)
        den += w
    step = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
    ep = episode_advantage(t, episode) if cfg.base_group else t.zeros()
    return Terms(ep, G, cfg.step_advantage_w * step)


METHOD = register(Method("hgpo", "A^E + ω Σ_k w_k norm(G_t; task group + last k anchors)", HgpoConfig, terms,
                         columns=("history_groups",), step_weight="step_advantage_w", order=3,
                         history_depth="depth"))   # K + 1 anchors deep unless `depth` says
