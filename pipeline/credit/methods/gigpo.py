"""GiGPO (docs/credit-assignment.md, GiGPO): `A_t = A^E(τ) + ω · norm(G_t; step group of t)`.

Step groups come from the group stage (`step_group`: same task group, same anchor) or, with
`similarity_threshold`, from greedy clustering of the anchor strings within each task group.
"""

from __future__ import annotations

from pydantic import Field

from pipeline.credit.base import EpisodeConfig, Method, StepTable, Terms, episode_advantage, group_norm, register
from pipeline.credit.grouping import similarity_groups
from pipeline.data.section import Mode, Section


class GigpoConfig(Section):
    """Step level over anchor-state groups; the episode level is the shared `credit.episode`."""
    mode: Mode = Field("mean_norm", description="normalisation of G_t within its step group")
    gamma: float = Field(0.95, ge=0.0, le=1.0, description="discount of the step-level return G_t")
    step_advantage_w: float = Field(1.0, ge=0.0, description="weight ω of the step-level advantage")
    similarity_threshold: float | None = Field(
        None, gt=0.0, le=1.0, description="null: exact anchors; else greedy clustering of anchors whose "
        "difflib ratio to a cluster's first member is at least this (0.95 in the paper)")


def terms(t: StepTable, cfg: GigpoConfig, episode: EpisodeConfig) -> Terms:
    """GiGPO (Feng et al., 2025; verl-agent's `gigpo` core): `A^E + ω · norm(G_t; same task group and anchor)`.
    In: the step table `t` (rewards, `step_group`), the section (γ, mode, ω) and the episode settings; out: the terms
    per row, the step score `G_t`."""
    if cfg.similarity_threshold is not None:
        groups = similarity_groups(t.df, cfg.similarity_threshold).to_numpy()
    else:
        groups = t.col("step_group")
    G = t.returns(t.reward, cfg.gamma)
    return Terms(episode_advantage(t, episode), G, cfg.step_advantage_w * group_norm(G, groups, cfg.mode))


METHOD = register(Method("gigpo", "A^E + ω · norm(G_t; same task group and anchor)", GigpoConfig, terms,
                         columns=("step_group", "anchor"), step_weight="step_advantage_w", order=2))
