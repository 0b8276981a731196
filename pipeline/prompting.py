"""Prompts and action parsing.

The prompt holds the task, the last K turns (observation and action), the current observation and the commands
admissible in it, as verl-agent's ALFWorld prompt lists them. Of the response, only the first
`<action>...</action>` tag counts; its content, trimmed, must be one of the admissible commands exactly (case
preserved, so `click[Buy Now]` stays what it is), and anything else makes the turn invalid.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_TAG = re.compile(r"<action>(.*?)</action>", re.DOTALL)


def parse_action(response: str, admissible: Sequence[str]) -> str | None:
    """The admissible command named by the first action tag, or None (an invalid turn)."""
    m = _TAG.search(response)
    if m is None:
        return None
    content = m.group(1).strip()
    return content if content in admissible else None


def format_action(action: str | None) -> str:
    return f"<action>{action}</action>" if action is not None else "(invalid)"


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
