"""Sokoban rules, generation and the exact solver (docs/credit-assignment.md, Oracle credit)."""

import math

import pytest

from pipeline.envs.sokoban import (
    REWARD_BOX_OFF,
    REWARD_BOX_ON,
    REWARD_SOLVED,
    REWARD_STEP,
    SokobanEnv,
    Solver,
    generate_room,
    parse_grid,
)


def dist(grid: str) -> float:
    room, state = parse_grid(grid)
    return Solver(room, state).distance(state)


@pytest.mark.parametrize("grid, expected", [
    ("____\n@$_.\n____\n____", 2),          # push right twice
    (".$@_\n____\n____\n____", 1),          # push left once
    ("_.__\n____\n_$__\n_@__", 2),          # push up twice
    ("____\n_$_.\n@___\n____", 3),          # walk up behind the box, then push twice
    ("$___\n@___\n___.\n____", math.inf),   # box in a corner off target: dead
    ("_*__\n@___\n____\n____", 0),          # already solved
])
def test_bfs_distances_on_hand_made_rooms(grid, expected):
    assert dist(grid) == expected


def test_optimal_actions_and_dead_state():
    room, state = parse_grid("____\n_$_.\n@___\n____")
    solver = Solver(room, state)
    assert solver.optimal_actions(state) == ["up"]
    # the box pushed against the top wall, off the target row: dead
    assert solver.distance(((2, 2), ((1, 2),))) == math.inf
    assert solver.optimal_actions(((2, 2), ((1, 2),))) == []


def test_rewards_follow_gym_sokoban():
    room, state = parse_grid("____\n@$._\n____\n____")
    # push onto target: step penalty + box on target + solved
    nxt, shaped = room.move(state, "right")
    assert shaped == REWARD_BOX_ON and room.solved(nxt)
    room2, s2 = parse_grid("____\n@*__\n____\n____")
    _, shaped_off = room2.move(s2, "right")
    assert shaped_off == REWARD_BOX_OFF
    env = SokobanEnv()
    env.room, env.state, env.turn = room, state, 0
    res = env.step("<action>right</action>")
    assert res.reward == pytest.approx(REWARD_STEP + REWARD_BOX_ON + REWARD_SOLVED)
    assert res.terminated and res.success and res.action_valid and not res.truncated


def test_invalid_action_is_a_noop_and_episode_truncates():
    env = SokobanEnv(max_turns=2)
    obs = env.reset(11)
    assert obs.admissible == ("up", "down", "left", "right")
    res = env.step("I think I'll go north")
    assert not res.action_valid and res.action is None
    assert res.anchor == obs.anchor and res.reward == pytest.approx(REWARD_STEP)
    assert res.admissible == obs.admissible
    res = env.step("<action>sideways</action>")
    assert not res.action_valid and res.truncated and not res.terminated


def test_walking_into_a_wall_is_valid_and_changes_nothing():
    room, state = parse_grid("@___\n_$_.\n____\n____")
    assert room.move(state, "up") == (state, 0.0)


def test_generation_is_deterministic_and_solvable():
    for seed in range(20):
        a, sa = generate_room(seed, min_solution_moves=2)
        b, sb = generate_room(seed, min_solution_moves=2)
        assert a == b and sa == sb
        d = Solver(a, sa).distance(sa)
        assert 2 <= d < math.inf
    assert generate_room(1)[0] != generate_room(2)[0] or generate_room(1)[1] != generate_room(2)[1]


def test_solution_length_bounds_keep_the_rooms_within_them_unchanged():
    """max_solution_moves only skips placements: each room takes 2-4 moves, and a seed whose unbounded room already
    does keeps that room."""
    kept = 0
    for seed in range(30):
        room, start = generate_room(seed, min_solution_moves=2, max_solution_moves=4)
        assert 2 <= Solver(room, start).distance(start) <= 4
        free, free_start = generate_room(seed, min_solution_moves=2)
        if Solver(free, free_start).distance(free_start) <= 4:
            assert (room, start) == (free, free_start)
            kept += 1
    assert 0 < kept < 30      # some seeds' unbounded rooms are longer, and those seeds got another room
    env = SokobanEnv(max_turns=10, min_solution_moves=5, max_solution_moves=5)
    for task in range(5):
        env.reset(task)
        assert env.oracle_distance() == 5


def test_render_round_trips_and_anchor_is_the_grid():
    env = SokobanEnv()
    first = env.reset(5)
    obs, anchor = first.text, first.anchor
    assert obs.startswith(anchor + "\n") and obs.splitlines()[-1].startswith("box: ")
    room, state = parse_grid(anchor)
    assert room.render(state) == anchor and state == env.state and room.targets == env.room.targets


@pytest.mark.parametrize("grid, line", [
    ("____\n@$_.\n____\n____", "box: right 1. target: right 2."),
    ("_.__\n____\n_$__\n_@__", "box: up 1. target: up 2."),
    ("_*__\n@___\n____\n____", "box: up 1, right 1. target: here."),
])
def test_observation_line_locates_box_and_target(grid, line):
    room, state = parse_grid(grid)
    assert room.describe(state) == line


def test_oracle_distance_and_expert_follow_the_solver_along_an_episode():
    """The capabilities the warm start and the credit-quality oracle use: each expert move lowers the oracle
    distance by exactly one, down to 0 at the solved state."""
    from pipeline.envs.base import has

    env = SokobanEnv(max_turns=50)
    env.reset(3)
    assert has(env, "oracle_distance") and has(env, "expert_actions") and not has(env, "task_score")
    d = env.oracle_distance()
    assert 2 <= d < math.inf
    while d > 0:
        res = env.step(f"<action>{env.expert_actions()[0]}</action>")
        assert env.oracle_distance() == d - 1
        d -= 1
    assert res.success and res.terminated and env.expert_actions() == []


def test_an_env_whose_engine_is_missing_names_the_packages():
    from pipeline.envs.base import _REGISTRY, EnvSpec, make_env, register

    register(EnvSpec("ghost", object, lambda cfg, d: None, requires=("no_such_engine_module",),
                     packages="the ghost package"))
    try:
        with pytest.raises(ValueError, match=r"env.name ghost needs the ghost package, and no_such_engine_module "
                                             r"cannot be imported: install the project"):
            make_env(type("Cfg", (), {"name": "ghost"})())
    finally:
        _REGISTRY.pop("ghost")
