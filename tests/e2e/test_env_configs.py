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
