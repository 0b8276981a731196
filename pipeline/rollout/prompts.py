"""The prompt of a turn: the task, the last K turns (observation and action), the current observation and the
commands admissible in it, as verl-agent's ALFWorld prompt lists them. The action tag it asks for is
`pipeline.envs.actions`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.envs.actions import format_action


def build_prompt(task: str, history: Sequence[tuple[str, str | None]], observation: str,
                 admissible: Sequence[str], history_turns: int) -> str:
    """The user-facing prompt text.

    `history` is every earlier (observation, parsed action or None) of the episode; the last `history_turns`
    are shown, numbered by their turn in the episode. `admissible` are the commands valid in `observation`.
    """
    lines = [task, "Answer with one admissible action as <action>...</action>."]
    shown = history[-history_turns:] if history_turns > 0 else []
    first = len(history) - len(shown)
    for i, (obs, act) in enumerate(shown):
        lines.append(f"Turn {first + i + 1} state:\n{obs}\nTurn {first + i + 1} action: {format_action(act)}")
    lines.append(f"Turn {len(history) + 1} state:\n{observation}\nAdmissible actions: [{', '.join(admissible)}]\n"
                 "Your action:")
    return "\n".join(lines)
