"""ALFWorld on its real engine (pipeline/envs/alfworld/env.py): the shipped games load as ALFWorld's own loader
loads the official ones, commands are parsed exactly, the planner's distance falls by one along its plan and is
the shortest, held-out tasks come from their own split, and the tiny configuration runs end to end."""

import json
from collections import deque
from pathlib import Path

import pytest

from pipeline.config.params import Params
from pipeline.data.seeds import task_seed
from pipeline.envs.base import has, make_env
from tests.conftest import ROOT

SHIPPED = ROOT / "data" / "alfworld" / "json_2.1.1"


def alf_params(**env) -> Params:
    return Params.model_validate({"env": {"name": "alfworld", **env}})


def test_shipped_games_are_what_the_generator_writes(tmp_path):
    from pipeline.envs.alfworld.games import main

    main(["--out", str(tmp_path)])
    mine = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    shipped = sorted(p.relative_to(SHIPPED) for p in SHIPPED.rglob("*") if p.is_file())
    assert mine == shipped and len(mine) == 2 * 32
    for rel in mine:
        assert (tmp_path / rel).read_bytes() == (SHIPPED / rel).read_bytes(), rel


def test_shipped_games_load_with_alfworlds_own_loader():
    """`AlfredTWEnv` (ALFWorld's loader for the official release) finds every shipped game and plays it through
    TextWorld's gym interface, with the same first observation the adapter gives."""
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    config = {"env": {"goal_desc_human_anns_prob": 0, "task_types": [1, 3, 4, 5], "domain_randomization": False,
                      "expert_type": "planner"},
              "dataset": {"data_path": str(SHIPPED / "train"), "eval_id_data_path": str(SHIPPED / "valid_seen"),
                          "eval_ood_data_path": str(SHIPPED / "valid_seen"), "num_train_games": -1,
                          "num_eval_games": -1},
              "general": {"training_method": "dqn"}, "rl": {"training": {"max_nb_steps_per_episode": 10}}}
    official = AlfredTWEnv(config, train_eval="train")
    assert official.num_games == 24
    from pipeline.envs.alfworld.env import game_files

    assert sorted(official.game_files) == list(game_files(str(SHIPPED), "train", (1, 3, 4, 5)))
    official.game_files = sorted(official.game_files)[:1]
    gym_env = official.init_env(batch_size=1)
    obs, infos = gym_env.reset()
    gym_env.close()
    env = make_env(alf_params().env)
    env.path = None
    env._start(official.game_files[0])
    env.state = env.env.reset()
    intro = env.state.feedback
    assert obs[0] == intro and "Your task is to: " in intro
    assert "go to " in " ".join(infos["admissible_commands"][0])


def test_an_episode_along_the_planner_on_the_real_engine():
    env = make_env(alf_params().env)
    assert has(env, "oracle_distance") and has(env, "expert_actions") and not has(env, "task_score")
    obs = env.reset(task_seed("train", 0, 1, 0))
    assert obs.text.startswith("You are in the middle of a room.") and obs.anchor == obs.text
    assert env.task_description().startswith("ALFWorld. Your task is to: ")
    assert "help" not in obs.admissible and "look" in obs.admissible
    d = env.oracle_distance()
    assert d >= 4
    res = None
    while d > 0:
        (best,) = env.expert_actions()
        res = env.step(f"<action>{best}</action>")
        assert res.action_valid and res.action == best
        assert env.oracle_distance() == d - 1
        assert res.reward == (1.0 if d == 1 else 0.0)
        d -= 1
    assert res.success and res.terminated and not res.truncated


def test_commands_are_matched_exactly_and_invalid_turns_change_nothing():
    env = make_env(alf_params().env)
    obs = env.reset(task_seed("train", 0, 1, 0))
    go = next(c for c in obs.admissible if c.startswith("go to "))
    d = env.oracle_distance()
    bad = env.step(f"<action>{go.capitalize()}</action>")
    assert not bad.action_valid and bad.action is None and bad.observation == "Nothing happens."
    assert bad.admissible == obs.admissible and env.oracle_distance() == d
    ok = env.step(f"<action> {go} </action>")
    assert ok.action_valid and ok.observation.startswith(f"You arrive at {go[6:]}.")


READ_ONLY = ("look", "inventory", "help", "examine")   # commands whose only effect is a `checked` fact


def _state(env) -> frozenset[str]:
    """The game's facts, less `checked(...)`: no precondition or goal reads it (the test checks the domain)."""
    return frozenset(f for f in map(str, env._pddl()._pddl_state.facts) if not f.startswith("checked("))


def _shortest(env, limit: int) -> int | None:
    """Breadth-first search over the game's states (facts) from its start, replaying each path from a reset:
    the length of the shortest winning path, or None if none is at most `limit` long. Commands that only read
    (`READ_ONLY`) lead back to the same state (`_state`) and are not tried."""
    def replay(path):
        env.state = env.env.reset()
        for c in path:
            env.state, _, _ = env.env.step(c)
        return env.state

    start = replay(())
    seen = {_state(env)}
    queue = deque([((), start)])
    while queue:
        path, state = queue.popleft()
        if len(path) == limit:
            continue
        for c in state.admissible_commands:
            if c.startswith(READ_ONLY):
                continue
            nxt = replay(path + (c,))
            if nxt.won:
                return len(path) + 1
            key = _state(env)
            if key not in seen:
                seen.add(key)
                queue.append((path + (c,), nxt))
    return None


def test_the_planners_distance_is_the_shortest_path():
    """On a shipped game, exhaustive search finds no winning path shorter than the planner's distance."""
    env = make_env(alf_params(task_types=[1]).env)
    env.reset(task_seed("train", 0, 1, 0))
    d = int(env.oracle_distance())
    game = json.loads(Path(env.path).read_text())
    for action in game["pddl_domain"].split("(:action")[1:]:     # `checked` is only ever an effect
        assert "checked" not in action.split(":effect")[0], action[:40]
    assert "checked" not in game["pddl_problem"].split("(:goal")[1]
    start = env.env.reset()
    facts = _state(env)
    for c in [c for c in start.admissible_commands if c.startswith(READ_ONLY)]:
        env.env.step(c)
        assert _state(env) == facts, c
    assert _shortest(env, d) == d


def test_held_out_tasks_come_from_the_eval_split_in_order():
    from pipeline.envs.alfworld.env import game_files, game_of

    cfg = alf_params().env
    valid = game_files(str(SHIPPED), "valid_seen", (1, 2, 3, 4, 5, 6))
    assert [game_of(cfg, task_seed("eval", 0, 0, i)) for i in range(9)] == [*valid, valid[0]]
    train = {game_of(cfg, task_seed("train", s, it, i)) for s in range(3) for it in range(3) for i in range(16)}
    assert train <= set(game_files(str(SHIPPED), "train", (1, 2, 3, 4, 5, 6))) and len(train) >= 20
    assert not train & set(valid)


def test_a_missing_data_path_is_named_when_the_params_load(tmp_path):
    import yaml

    from pipeline.config.params import ParamsError, load_params

    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"env": {"name": "alfworld",
                                                             "data_path": str(tmp_path / "nowhere")}}))
    with pytest.raises(ParamsError, match=r"(?s)p\.yaml.*key 'env.alfworld'.*data_path: .*nowhere/train is not a "
                                          r"folder; expected ALFWorld's split folders"):
        load_params(tmp_path / "p.yaml")
    (tmp_path / "json" / "train").mkdir(parents=True)                  # the held-out split is checked too
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"env": {"name": "alfworld", "data_path": str(tmp_path / "json")}}))
    with pytest.raises(ParamsError, match=r"json/valid_seen is not a folder"):
        load_params(tmp_path / "p.yaml")
    with pytest.raises(ValueError, match="env.task_types: unknown task types"):
        make_env(alf_params(task_types=[7]).env).reset(task_seed("train", 0, 1, 0))
