"""Prompt layout and action parsing (issue 2, point 4)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.prompting import build_prompt, parse_action

ACTIONS = ("up", "down", "left", "right")


@pytest.mark.parametrize("text, expected", [
    ("<action>up</action>", "up"),
    ("I will push. <action> Left </action>", "left"),
    ("<action>down</action><action>up</action>", "down"),      # the first tag counts
    ("<action>jump</action><action>up</action>", None),        # first tag inadmissible: invalid
    ("<action>up", None),                                      # unclosed
    ("up", None),                                              # no tag
    ("", None),
    ("<ACTION>up</ACTION>", None),                             # the tag itself is case-sensitive
    ("<action>up down</action>", None),
])
def test_parse_action(text, expected):
    assert parse_action(text, ACTIONS) == expected


@given(st.text())
def test_parser_never_raises_and_returns_admissible(text):
    assert parse_action(text, ACTIONS) in (None, *ACTIONS)


def test_prompt_holds_task_last_k_turns_and_format():
    history = [("obs1", "up"), ("obs2", None), ("obs3", "left")]
    p = build_prompt("TASK", history, "obs4", ACTIONS, history_turns=2)
    assert p.splitlines()[0] == "TASK"
    assert "<action>up|down|left|right</action>" in p
    assert "obs1" not in p and "Turn 2 state:\nobs2\nTurn 2 action: (invalid)" in p
    assert "Turn 3 action: <action>left</action>" in p
    assert p.endswith("Turn 4 state:\nobs4\nYour action:")
