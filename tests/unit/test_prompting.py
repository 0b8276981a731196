"""Prompt layout and action parsing."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.envs.actions import parse_action
from pipeline.rollout.prompts import build_prompt

ACTIONS = ("up", "down", "left", "right")


@pytest.mark.parametrize("text, expected", [
    ("<action>up</action>", "up"),
    ("I will push. <action> left </action>", "left"),         # trimmed
    ("<action>Left</action>", None),                           # exact: case preserved
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


def test_prompt_holds_task_last_k_turns_and_the_admissible_commands():
    history = [("obs1", "up"), ("obs2", None), ("obs3", "left")]
    p = build_prompt("TASK", history, "obs4", ACTIONS, history_turns=2)
    assert p.splitlines()[:2] == ["TASK", "Answer with one admissible action as <action>...</action>."]
    assert "obs1" not in p and "Turn 2 state:\nobs2\nTurn 2 action: (invalid)" in p
    assert "Turn 3 action: <action>left</action>" in p
    assert p.endswith("Turn 4 state:\nobs4\nAdmissible actions: [up, down, left, right]\nYour action:")


def test_free_text_commands_match_exactly_with_their_case():
    admissible = ("take apple 1 from countertop 2", "click[Buy Now]", "go to fridge 1")
    assert parse_action("<action>click[Buy Now]</action>", admissible) == "click[Buy Now]"
    assert parse_action("<action>click[buy now]</action>", admissible) is None
    assert parse_action("<action> take apple 1 from countertop 2\n</action>", admissible) == admissible[0]
    assert parse_action("<action>take apple from countertop 2</action>", admissible) is None
