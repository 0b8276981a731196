"""GRPO (docs/credit-assignment.md, "GRPO (episode level only)"): `A_t = A^E(τ)`, the shared episode term alone."""

from __future__ import annotations

from pipeline.credit.base import EpisodeConfig, Method, StepTable, Terms, episode_advantage, register
from pipeline.data.section import Section


class GrpoConfig(Section):
    """No step-level keys: GRPO's only term is the shared episode term (`credit.episode`)."""


def terms(t: StepTable, cfg: GrpoConfig, episode: EpisodeConfig) -> Terms:
    """GRPO (Shao et al., 2024; verl's `compute_grpo_outcome_advantage`): the episode term `A^E` on every turn, no
    step term. In: the step table `t` (rewards, task groups), the section and the shared episode settings; out: the
    terms per row."""
    return Terms(episode_advantage(t, episode), None, t.zeros())


METHOD = register(Method("grpo", "A^E = norm(R(τ); task group)", GrpoConfig, terms, order=0))
