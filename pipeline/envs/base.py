"""The environment interface every stage talks to.

`reset(seed)` returns the first observation and its anchor; `step(response_text)` parses the policy's response,
executes it (an unparseable or inadmissible action is a no-op with `action_valid = False`) and returns a
`StepResult`. The anchor is the environment's own key of the state (credit-assignment.md, Terms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StepResult:
    observation: str
    anchor: str
    reward: float
    terminated: bool
    truncated: bool
    action_valid: bool
    success: bool
    action: str | None  # the parsed action, None when the response held none that is admissible


class Env(Protocol):
    name: str
    actions: tuple[str, ...]

    def task_description(self) -> str: ...

    def reset(self, seed: int) -> tuple[str, str]: ...

    def step(self, response_text: str) -> StepResult: ...


def make_env(cfg) -> Env:
    """Build the environment named by `cfg.name` (an `EnvConfig`)."""
    if cfg.name == "sokoban":
        from pipeline.envs.sokoban import SokobanEnv

        return SokobanEnv(
            dim_room=cfg.dim_room,
            num_boxes=cfg.num_boxes,
            max_turns=cfg.max_turns,
            min_solution_moves=cfg.min_solution_moves,
        )
    raise ValueError(f"env.name: unknown environment {cfg.name!r}; expected one of ['sokoban']")
