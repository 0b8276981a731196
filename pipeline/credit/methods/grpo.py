"""GRPO (docs/credit-assignment.md, "GRPO (episode level only)"): `A_t = A^E(τ)`, the shared episode term alone."""

from __future__ import annotations

from pipeline.credit.base import Method, Terms, episode_advantage, register
from pipeline.data.section import Section


class GrpoConfig(Section):
    """No step-level keys: GRPO's only term is the shared episode term (`credit.episode`)."""


def terms(t, cfg, episode) -> Terms:
    return Terms(episode_advantage(t, episode), None, t.zeros())


METHOD = register(Method("grpo", "A^E = norm(R(τ); task group)", GrpoConfig, terms, order=0))
