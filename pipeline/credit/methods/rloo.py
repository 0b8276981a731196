"""RLOO (docs/credit-assignment.md, RLOO): `A^E(τ) = R(τ) − mean of the other episodes' R = N/(N−1)(R − mean_g R)`.

RLOO is an episode-level method whose whole definition is its baseline, so it is the one method whose episode
term is its own rather than the shared `credit.episode` term: comparing it with GRPO compares the two baselines.
"""

from __future__ import annotations

import numpy as np

from pipeline.credit.base import EpisodeConfig, Method, StepTable, Terms, dense_keys, group_norm, register
from pipeline.data.section import Section


class RlooConfig(Section):
    """Leave-one-out baseline over the task group's episodes; no knobs."""


def terms(t: StepTable, cfg: RlooConfig, episode: EpisodeConfig) -> Terms:
    """RLOO (Ahmadian et al., 2024): `N/(N−1)(R − mean_g R)` on every turn of an episode, its own episode term.
    In: the step table `t` (rewards, task groups); out: the terms per row (no step term)."""
    task_ep = t.task[t.starts]
    k = dense_keys(task_ep)
    N = np.bincount(k)[k]
    centred = group_norm(t.episode_sum(t.reward), task_ep, "mean_norm")
    a_ep = np.where(N > 1, N / np.maximum(N - 1, 1) * centred, 0.0)
    return Terms(np.repeat(a_ep, t.lengths), None, t.zeros())


METHOD = register(Method("rloo", "R(τ) − mean of the other episodes' R (its own episode term)", RlooConfig,
                         terms, order=1, own_episode_term=True))
