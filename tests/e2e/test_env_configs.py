"""The TextWorld, ALFWorld and WebShop configurations at the tiny test sizes, through every stage that plays or
reads the environment (`run_env_config`): the warm start, the held-out evaluation, a rollout, its groups and
advantages (the environments' own rules are tests/unit/test_textworld.py, test_alfworld.py and test_webshop.py)."""

import pytest

from tests.conftest import run_env_config


@pytest.mark.e2e
def test_tiny_textworld_configuration_end_to_end(tmp_path):
    run = tmp_path / run_env_config(tmp_path, "textworld.yaml")["run"]["dir"]
    assert run == tmp_path / "results/textworld"            # its own folder (configs/textworld.yaml)
    games = list((tmp_path / "results/envs/textworld").rglob("*.z8"))     # the checkout's cache of games
    assert len(games) >= 4 + 2 + 4              # warm start, an iteration's training tasks, held-out tasks
    import polars as pl

    steps = pl.read_parquet(run / "iter_1/steps.parquet")
    assert pl.read_parquet(run / "iter_1/advantages.parquet").height == steps.height
    assert steps["prompt"][0].startswith("TextWorld. ") and "Admissible actions: [" in steps["prompt"][0]


@pytest.mark.e2e
def test_tiny_alfworld_configuration_end_to_end(tmp_path):
    run = tmp_path / run_env_config(tmp_path, "alfworld.yaml", env={"max_turns": 6}, credit={"method": "gigpo"})[
        "run"]["dir"]
    import polars as pl

    steps = pl.read_parquet(run / "iter_1/steps.parquet")
    assert pl.read_parquet(run / "iter_1/advantages.parquet").height == steps.height
    assert steps["prompt"][0].startswith("ALFWorld. Your task is to: ") and "Admissible actions: [go to " in \
        steps["prompt"][0]
    held_out = pl.read_parquet(run / "iter_0/eval.parquet")
    assert held_out.height == 8 and held_out["optimal_moves"].min() >= 4


@pytest.mark.e2e
def test_tiny_webshop_configuration_end_to_end(tmp_path):
    run = tmp_path / run_env_config(tmp_path, "webshop.yaml", policy={"max_new_tokens": 30})["run"]["dir"]
    import polars as pl

    steps = pl.read_parquet(run / "iter_1/steps.parquet")
    assert pl.read_parquet(run / "iter_1/advantages.parquet").height == steps.height
    assert steps["prompt"][0].startswith("WebShop. Instruction: ") and \
        "Admissible actions: [search[<your query>]]" in steps["prompt"][0]
    held_out = pl.read_parquet(run / "iter_0/eval.parquet")
    assert held_out.height == 8 and held_out["optimal_moves"].min() >= 4     # search, click, options, buy


@pytest.mark.e2e
def test_tiny_search_configuration_runs_every_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("CREDITRL_CACHE", str(tmp_path / "cache"))     # the stages inherit it
    params = run_env_config(tmp_path, "search.yaml", every_stage=True, credit={"method": "gigpo"},
                            policy={"max_new_tokens": 16})
    run = tmp_path / params["run"]["dir"]
    import polars as pl

    steps = pl.read_parquet(run / "iter_1/steps.parquet")
    assert pl.read_parquet(run / "iter_1/advantages.parquet").height == steps.height
    prompt = steps["prompt"][0]
    assert "Question: " in prompt and "<search>query</search>" in prompt and "Admissible actions" not in prompt
    assert steps["anchor"][0].endswith("| retrieved: ")                  # nothing found yet at a first turn
    held_out = pl.read_parquet(run / "iter_0/eval.parquet")
    assert held_out.height == 8 and held_out["optimal_moves"].min() >= 2           # a search, then the answer
    assert (run / "iter_1/checkpoint").is_dir() and (run / "iter_1/eval_metrics.json").is_file()
    assert (run / "report/report.html").is_file() or any((run / "report").iterdir())
    assert len(list((tmp_path / "cache/search-index").iterdir())) == 1     # one index for every stage, in the cache
    assert not (tmp_path / "results/envs/search-index").exists()          # none under the working directory


def test_tiny_search_configuration_with_igpo_scores_every_turn_in_the_fit_stage(tmp_path, monkeypatch):
    """IGPO through the stages: the fit stage scores each turn's information gain with the policy that sampled it
    (0 on an episode's last turn, whose reward is the outcome), keeps no model but a marker, and the advantages
    read them."""
    import json

    import polars as pl

    monkeypatch.setenv("CREDITRL_CACHE", str(tmp_path / "cache"))
    params = run_env_config(tmp_path, "search.yaml", credit={"method": "igpo"}, policy={"max_new_tokens": 16})
    run = tmp_path / params["run"]["dir"]
    steps = pl.read_parquet(run / "iter_1/steps.parquet").sort("episode_id", "step")
    scores = pl.read_parquet(run / "iter_1/step_rewards.parquet").sort("episode_id", "step")
    last = (steps["step"] == steps["episode_length"] - 1).to_list()
    assert scores.height == steps.height and all(s == 0.0 for s, lst in zip(scores["score"], last) if lst)
    assert any(s != 0.0 for s, lst in zip(scores["score"], last) if not lst)      # gains measured on the others
    fit = json.loads((run / "iter_1/fit_metrics.json").read_text())
    assert 0.0 < fit["answer_prob_mean"] < 1.0
    assert json.loads((run / "iter_1/reward_model/igpo.json").read_text())["learned"] is False
    adv = pl.read_parquet(run / "iter_1/advantages.parquet")
    assert adv.height == steps.height and (adv["episode_advantage"] == 0.0).all()


@pytest.mark.xdist_group("sandbox")     # its programs share the sandbox user's process cap with the sandbox tests
def test_tiny_python_configuration_end_to_end(tmp_path):
    import polars as pl

    params = run_env_config(tmp_path, "python.yaml", credit={"method": "gigpo"}, policy={"max_new_tokens": 24},
                            rollout={"branching": {"mode": "entropy", "threshold": 1.0}})
    run = tmp_path / params["run"]["dir"]
    steps = pl.read_parquet(run / "iter_1/steps.parquet")
    assert steps["entropy"].null_count() == 0     # branching on: the sampler scored every response's entropy
    assert pl.read_parquet(run / "iter_1/advantages.parquet").height == steps.height
    assert "<python>code</python>" in steps["prompt"][0] and "Problem: " in steps["prompt"][0]
    held_out = pl.read_parquet(run / "iter_0/eval.parquet")
    assert held_out["optimal_moves"].min() >= 2                   # a program, then the answer
