"""TextWorld on its real engine (pipeline/envs/textworld_env.py): games generated offline and cached, free-text
commands parsed exactly, the exact logic-state oracle and expert, and the tiny configuration end to end."""


import pytest

from pipeline.config.params import Params
from pipeline.envs.base import has, make_env


def tw_params(**env) -> Params:
    return Params.model_validate({"env": {"name": "textworld", "challenge": "tw-coin_collector", "level": 3,
                                          **env}})


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tw_games")


def test_same_task_same_game_generated_once(cache):
    from pipeline.envs.textworld_env import game_file

    cfg = tw_params().env
    a = game_file(cfg, cache, 7)
    stamp = a.stat().st_mtime_ns
    assert game_file(cfg, cache, 7) == a and a.stat().st_mtime_ns == stamp          # cached, not regenerated
    fresh = cache / "again"
    b = game_file(cfg, fresh, 7)
    assert b.with_suffix(".json").read_text() == a.with_suffix(".json").read_text()  # same seed, same game
    assert game_file(cfg, cache, 8).with_suffix(".json").read_text() != a.with_suffix(".json").read_text()
    assert sorted(p.suffix for p in a.parent.iterdir() if p.stem == "7") == [".json", ".ni", ".z8"]


def test_an_episode_along_the_expert_on_the_real_engine(cache):
    env = make_env(tw_params().env, cache)
    assert has(env, "oracle_distance") and has(env, "expert_actions") and has(env, "task_score")
    obs = env.reset(7)
    assert "go" in " ".join(obs.admissible) and "look" in obs.admissible
    assert obs.anchor in obs.text and "You are carrying" in obs.anchor
    assert env.task_description().startswith("TextWorld. ") and "coin" in env.task_description()
    d = env.oracle_distance()
    assert d == 3
    res = None
    while d > 0:
        best = env.expert_actions()
        assert best and set(best) <= set(env.state.admissible_commands)
        res = env.step(f"<action>{best[0]}</action>")
        assert res.action_valid and env.oracle_distance() == d - 1
        d -= 1
    assert res.success and res.terminated and res.reward == 1.0 and env.task_score() == 1.0


def test_commands_are_matched_exactly(cache):
    env = make_env(tw_params().env, cache)
    obs = env.reset(7)
    go = next(c for c in obs.admissible if c.startswith("go "))
    bad = env.step(f"<action>{go.upper()}</action>")
    assert not bad.action_valid and bad.action is None and bad.anchor == obs.anchor
    assert bad.observation.startswith("That is not an admissible action.")
    ok = env.step(f"I will move. <action> {go} </action>")
    assert ok.action_valid and ok.action == go and ok.anchor != obs.anchor
    assert env.step("<action>look</action>").anchor == ok.anchor                    # look changes no state


@pytest.mark.parametrize("task", [3, 4, 5, 6])
def test_oracle_distance_equals_the_walkthrough_on_coin_collector(cache, task):
    """TextWorld's own walkthrough (the quest's solution) is optimal on coin collector; the exact search agrees
    at every state along it."""
    env = make_env(tw_params().env, cache)
    env.reset(task)
    commands = env.state["_game_progression"].game.walkthrough
    assert len(commands) == 3                      # level 3: a quest of three steps
    for k, command in enumerate(commands):
        assert env.oracle_distance() == len(commands) - k
        env.step(f"<action>{command}</action>")
    assert env.oracle_distance() == 0


def test_a_game_too_large_for_the_oracle_says_so(cache):
    env = make_env(tw_params(oracle_max_states=2).env, cache)
    env.reset(9)
    with pytest.raises(ValueError, match="more than env.oracle_max_states = 2 logic states"):
        env.oracle_distance()
