"""The SQL configuration at the tiny test sizes, with retrieved demonstrations and the step-level preference
objective (GiGPO's step values, the AST oracle's margin), through every stage of a one-iteration run (the
environment's own rules are tests/unit/test_sql.py, the objective's tests/unit/test_step_dpo.py)."""

import json

import pytest

from tests.conftest import run_env_config


@pytest.mark.e2e
def test_tiny_sql_configuration_with_demonstrations_and_step_dpo_runs_every_stage(tmp_path):
    params = run_env_config(tmp_path, "sql.yaml", every_stage=True, credit={"method": "gigpo"},
                            prompt={"history_turns": 2, "demonstrations": 1, "demonstration_pool": 20},
                            policy={"max_new_tokens": 16},
                            update={"objective": "step_dpo", "step_dpo": {"margin": "oracle"}})
    run = tmp_path / params["run"]["dir"]
    import polars as pl

    steps = pl.read_parquet(run / "iter_1/steps.parquet")
    assert pl.read_parquet(run / "iter_1/advantages.parquet").height == steps.height
    prompt = steps["prompt"][0]
    assert prompt.startswith("Database ") and "\nSolved examples of similar tasks:\n\nExample 1:\nTask: " in prompt
    assert prompt.index("CREATE TABLE") < prompt.index("Solved examples") < prompt.index("Question: ")
    assert "CREATE TABLE" in prompt and "<sql>query</sql>" in prompt and "Admissible actions" not in prompt
    assert steps["anchor"][0].endswith("| ran: ")                          # nothing run yet at a first turn
    held_out = pl.read_parquet(run / "iter_0/eval.parquet")
    assert held_out.height == 8 and held_out["optimal_moves"].min() >= 3           # a table, a projection, the answer
    assert (run / "iter_1/checkpoint").is_dir() and (run / "iter_1/eval_metrics.json").is_file()
    pairs = pl.read_parquet(run / "iter_1/pairs.parquet")
    assert pairs.columns[:2] == ["task_group", "step_group"] and (pairs["gap"] > 0).all()
    log = (run / "logs/update_1.log").read_text()
    assert f"step-DPO on {pairs.height} pairs" in log and "margin oracle" in log
    pools = list((tmp_path / "results/envs").glob("demonstrations-*.json"))
    assert len(pools) == 1 and len(json.loads(pools[0].read_text())) == 20         # one pool for every stage
