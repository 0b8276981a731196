"""The prompt of a turn: the task, the last K turns (observation and action), the current observation and the
commands admissible in it, as verl-agent's ALFWorld prompt lists them. The action tag it asks for is
`pipeline.envs.actions`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.envs.actions import ACTION_TAG, ActionFormat


def build_prompt(task: str, history: Sequence[tuple[str, str | None]], observation: str,
                 admissible: Sequence[str], history_turns: int, fmt: ActionFormat = ACTION_TAG) -> str:
    """The user-facing prompt text.

    `history` is every earlier (observation, parsed action or None) of the episode; the last `history_turns`
    are shown, numbered by their turn in the episode. `admissible` are the commands valid in `observation`,
    listed where the environment's action format (`fmt`) lists them.
    """
    lines = [task, fmt.instruction]
    shown = history[-history_turns:] if history_turns > 0 else []
    first = len(history) - len(shown)
    for i, (obs, act) in enumerate(shown):
        lines.append(f"Turn {first + i + 1} state:\n{obs}\nTurn {first + i + 1} action: {fmt.render(act)}")
    listed = f"Admissible actions: [{', '.join(admissible)}]\n" if fmt.list_admissible else ""
    lines.append(f"Turn {len(history) + 1} state:\n{observation}\n{listed}Your action:")
    return "\n".join(lines)
