"""The building blocks of the params schema, shared by `pipeline.config` and the credit methods' own sections
(each method module declares its section with these, so the schema can be assembled from the method registry)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Mode = Literal["mean_std_norm", "mean_norm"]
EpisodeStats = Literal["per_episode", "per_turn"]


class Section(BaseModel):
    """A params section: unknown keys are errors, values are frozen once validated."""
    model_config = ConfigDict(extra="forbid", frozen=True)


class EnvSection(Section):
    """What every environment's section has besides its own keys: its name (the discriminator of `env`) and the
    episode length."""
    name: str
    max_turns: int
