"""Every credit method end to end on the tiny configuration, 2 iterations.

Each method starts from a copy of the GRPO run (shared fixture) with only `credit.method` changed, so the test also
shows what reruns: Snakemake's dry run must plan the method's stages and everything downstream of the advantages,
and never the initial policy or iteration 1's rollout and groups. The runs then execute concurrently. RLOO runs
end to end in `tests/e2e/test_bench.py::test_learning_smoke`.
"""

import polars as pl
import pytest

from pipeline.credit.methods import METHODS
from pipeline.data import tables

# the method_runs fixture is in conftest, shared with test_resume
from tests.conftest import EVALUATED_METHOD_RUNS, SHARED_RUN_METHODS

pytestmark = pytest.mark.e2e

@pytest.mark.parametrize("method", SHARED_RUN_METHODS)
def test_only_what_depends_on_the_method_reruns(method_runs, method):
    plan = method_runs[method].plan
    downstream = {"advantages@1", "update@1", "evaluate@1", "rollout@2", "group@2", "advantages@2", "update@2",
                  "evaluate@2", "report"}
    fit = {"reward_init", "fit@1", "fit@2"} if METHODS[method].fits else set()
    assert plan == downstream | fit
    assert not plan & {"init", "rollout@1", "group@1", "evaluate@0"}


@pytest.mark.parametrize("method", SHARED_RUN_METHODS)
def test_method_runs_end_to_end(method_runs, method):
    results = method_runs[method].results
    for it in (1, 2):
        steps = tables.read_table(results / f"iter_{it}/steps.parquet", tables.STEPS)
        adv = tables.read_table(results / f"iter_{it}/advantages.parquet", tables.ADVANTAGES)
        assert adv.height == steps.height and adv["advantage"].is_finite().all()
        composed = adv["episode_advantage"] + adv["step_advantage"] - adv["penalty"]
        assert (adv["advantage"] - composed).abs().max() < 1e-12
        assert adv["step_score"].null_count() == 0
        assert (results / f"iter_{it}/checkpoint/model.safetensors").is_file()
        if method in EVALUATED_METHOD_RUNS:
            assert (results / f"iter_{it}/eval_metrics.json").is_file()
        fit_out = results / f"iter_{it}/step_rewards.parquet"
        assert fit_out.is_file() is METHODS[method].fits
    if method in EVALUATED_METHOD_RUNS:
        assert pl.read_csv(results / "report/success_curve.csv")["iteration"].to_list() == [0, 1, 2]
    assert not list(results.glob("**/.*.tmp-*"))






def test_hgpo_keys_have_history_depth(method_runs):
    groups = tables.read_table(method_runs["hgpo"].results / "iter_1/groups.parquet", tables.GROUPS)
    assert (groups["history_groups"].list.len() == 3).all()  # prompt.history_turns 2 -> K + 1 = 3
