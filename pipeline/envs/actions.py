"""The action tag: how a response names a command, shared by every environment (which parses it) and the prompt
(which asks for it and shows earlier actions in it).

Of the response, only the first `<action>...</action>` tag counts; its content, trimmed, must be one of the
admissible commands exactly (case preserved, so `click[Buy Now]` stays what it is), and anything else makes the
turn invalid.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_TAG = re.compile(r"<action>(.*?)</action>", re.DOTALL)


def action_content(response: str) -> str | None:
    """The first action tag's content, trimmed, or None where the response has no tag."""
    m = _TAG.search(response)
    return None if m is None else m.group(1).strip()


def parse_action(response: str, admissible: Sequence[str]) -> str | None:
    """The admissible command named by the first action tag, or None (an invalid turn)."""
    content = action_content(response)
    return content if content in admissible else None


def format_action(action: str | None) -> str:
    return f"<action>{action}</action>" if action is not None else "(invalid)"
