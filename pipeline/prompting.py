"""Prompts and action parsing (issue: "Prompt and parsing").

The prompt holds the task, the last K turns (observation and action), the current observation and the answer
format `<action>a|b|...</action>`. Of the response, only the first `<action>...</action>` tag counts; its content
(trimmed, case-insensitive) must be an admissible action, and anything else makes the turn invalid.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_TAG = re.compile(r"<action>(.*?)</action>", re.DOTALL)


def parse_action(response: str, admissible: Sequence[str]) -> str | None:
    """The admissible action named by the first action tag, or None (an invalid turn)."""
    m = _TAG.search(response)
    if m is None:
        return None
    content = m.group(1).strip().lower()
    return content if content in admissible else None


def format_action(action: str | None) -> str:
    return f"<action>{action}</action>" if action is not None else "(invalid)"


def build_prompt(task: str, history: Sequence[tuple[str, str | None]], observation: str,
                 actions: Sequence[str], history_turns: int) -> str:
    """The user-facing prompt text.

    `history` is every earlier (observation, parsed action or None) of the episode; the last `history_turns`
    are shown, numbered by their turn in the episode.
    """
    lines = [task, f"Answer with <action>{'|'.join(actions)}</action>."]
    shown = history[-history_turns:] if history_turns > 0 else []
    first = len(history) - len(shown)
    for i, (obs, act) in enumerate(shown):
        lines.append(f"Turn {first + i + 1} state:\n{obs}\nTurn {first + i + 1} action: {format_action(act)}")
    lines.append(f"Turn {len(history) + 1} state:\n{observation}\nYour action:")
    return "\n".join(lines)
