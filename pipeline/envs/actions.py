"""The action tag: how a response names a command, shared by every environment (which parses it) and the prompt
(which asks for it and shows earlier actions in it).

Of the response, only the first `<action>...</action>` tag counts; its content, trimmed, must be one of the
admissible commands exactly (case preserved, so `click[Buy Now]` stays what it is), and anything else makes the
turn invalid.

An environment whose actions are free text in tags of their own (the search environment's `<search>` and
`<answer>`) says so with an `ActionFormat` as its `action_format` attribute: the instruction the prompt gives, how
an executed action is written back (in the prompt's history and the warm start's demonstrations), and whether
the prompt lists the admissible commands.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_TAG = re.compile(r"<action>(.*?)</action>", re.DOTALL)


def action_content(response: str) -> str | None:
    """The first action tag's content, trimmed, or None where the response has no tag."""
    m = _TAG.search(response)
    return None if m is None else m.group(1).strip()


def parse_action(response: str, admissible: Sequence[str]) -> str | None:
    """The admissible command named by the first action tag, or None (an invalid turn)."""
    content = action_content(response)
    return content if content in admissible else None


def one_tag(response: str, tags: dict[str, re.Pattern]) -> tuple[str, str] | None:
    """(name, raw content) of the one tag of `tags` (name -> pattern with one group) the response holds, or None
    where it holds none of them or more than one kind: the rule of the environments whose actions are free text in
    tags of their own (search, SQL, Python), each of which then trims the content its way."""
    found = [(name, m) for name, pattern in tags.items() if (m := pattern.search(response)) is not None]
    return (found[0][0], found[0][1].group(1)) if len(found) == 1 else None


def format_action(action: str | None) -> str:
    return f"<action>{action}</action>" if action is not None else "(invalid)"


@dataclass(frozen=True)
class ActionFormat:
    instruction: str                              # the prompt's line that says how to answer
    render: Callable[[str | None], str]           # an executed action (None: an invalid turn) as response text
    list_admissible: bool = True                  # the prompt lists the admissible commands


ACTION_TAG = ActionFormat("Answer with one admissible action as <action>...</action>.", format_action)


def format_of(env) -> ActionFormat:
    """The environment's action format: its `action_format`, or the action tag."""
    return getattr(env, "action_format", ACTION_TAG)
