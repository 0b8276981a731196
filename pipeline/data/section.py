"""The building blocks of the params schema, shared by `pipeline.config.params` and the credit methods' own sections
(each method module declares its section with these, so the schema can be assembled from the method registry)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class _TokenBudget(Section):
    """A section with `packing` and `micro_batch_tokens`: a token budget sizes prefix trees only."""

    _padded_size_key: ClassVar[str]   # the key that sizes this section's padded batches

    @model_validator(mode="after")
    def _tokens_need_trees(self):
        if self.micro_batch_tokens is not None and self.packing != "tree":
            raise ValueError(f"micro_batch_tokens {self.micro_batch_tokens} sizes prefix trees: set packing: tree, "
                             f"or size padded batches with {self._padded_size_key}")
        return self


class FitBatching(_TokenBudget):
    """How a learned step-reward model (a credit method's PRM, estimator or critic) runs turns through its network
    when it fits and scores them: memory and speed, not maths."""
    _padded_size_key: ClassVar[str] = "batch_size"
    batch_size: int = Field(64, ge=1, description="turns per forward pass (memory, not maths)")
    packing: Packing = Field("none", description="tree: each forward pass as one prefix tree, each distinct prefix "
                             "computed once, the same values and gradient (docs/models.md, Tree packing)")
    micro_batch_tokens: int | None = Field(None, ge=1, description="packing tree: a forward pass holds at most this "
                                           "many packed tokens (its turns sorted so that shared prefixes fall "
                                           "together; a longer turn goes alone) instead of batch_size turns, so "
                                           "memory is bounded by tokens however long the prompts are")


class MicroBatching(_TokenBudget):
    """How a batch of turns goes through the model in a training step (the update's minibatches, the warm start's
    batches): in micro-batches whose gradients are accumulated, padded or packed as prefix trees. Memory and speed,
    not maths: the loss stays the token mean over the whole batch."""
    _padded_size_key: ClassVar[str] = "micro_batch_size"
    micro_batch_size: int | None = Field(None, ge=1, description="turns per forward/backward pass; a batch's "
                                         "gradients are accumulated over its micro-batches, with the same token-mean "
                                         "loss (memory, not maths; null: the whole batch at once)")
    packing: Packing = Field("none", description="none: each micro-batch is a right-padded batch of "
                                             "its turns; tree: one prefix tree of them, each distinct prefix computed "
                                             "once, the same log-probs and gradient (docs/models.md, Tree packing)")
    micro_batch_tokens: int | None = Field(None, ge=1, description="packing tree: a micro-batch holds at most this "
                                           "many packed tokens (its turns sorted so that shared prefixes fall "
                                           "together; a longer turn goes alone), instead of micro_batch_size turns")
    gradient_checkpointing: bool = Field(False, description="recompute each layer's activations in the backward "
                                         "pass instead of keeping them (less memory, about a third more compute)")
