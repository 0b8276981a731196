"""The building blocks of the params schema, shared by `pipeline.config.params` and the credit methods' own sections
(each method module declares its section with these, so the schema can be assembled from the method registry)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Mode = Literal["mean_std_norm", "mean_norm"]
EpisodeStats = Literal["per_episode", "per_turn"]
Packing = Literal["none", "tree"]     # padded batches, or prefix trees (docs/models.md, Tree packing)


class Section(BaseModel):
    """A params section: unknown keys are errors, values are frozen once validated."""
    model_config = ConfigDict(extra="forbid", frozen=True)


class EnvSection(Section):
    """What every environment's section has besides its own keys: its name (the discriminator of `env`) and the
    episode length."""
    name: str
    max_turns: int


class LoraSettings(Section):
    """LoRA through peft: the update trains low-rank adapters on the frozen policy (docs/credit-assignment.md's update
    is unchanged); checkpoints are the adapter plus a pointer to the initial policy it adapts."""
    r: int = Field(16, ge=1, le=1024, description="adapter rank")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: the adapter's output is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input (0 keeps the PPO ratio "
                           "exact: log pi_old and log pi are then taken by the same deterministic network)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names that get adapters, or all-linear (every linear layer but the LM "
        "head, as verl's and TRL's defaults)")
