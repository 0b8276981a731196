"""OPRL's PRM, SPA's estimator and GAE's critic through the workflow: the shared method runs continued with each,
and each with a LoRA model (their maths and models on fixed batches are tests/unit/test_oprl.py, test_spa.py and
test_gae.py)."""

import json

import pytest

from pipeline.credit.methods.spa import REPLAY
from pipeline.data import tables

LEARNED = ("oprl", "spa", "gae")   # the methods with a learned per-turn model


@pytest.mark.e2e
def test_oprl_iteration_1_step_rewards_are_exactly_zero(method_runs):
    """At iteration 1 the PRM is a copy of the initial policy, which also played the rollouts (spec, OPRL)."""
    d = method_runs["oprl"].folder
    r1 = tables.read_table(d / "results/iter_1/step_rewards.parquet", tables.STEP_REWARDS)
    assert r1.height > 0 and (r1["score"] == 0.0).all()
    r2 = tables.read_table(d / "results/iter_2/step_rewards.parquet", tables.STEP_REWARDS)
    assert (r2["score"] != 0.0).any()  # the policy has moved since: log pi_phi - log pi_old is no longer 0
    assert sorted(p.relative_to(d).as_posix() for p in d.glob("results/**/*.pt")) == \
        ["results/iter_2/optimizer/policy.pt", "results/iter_2/optimizer/reward_model.pt"]
    # the drift report: the PRM has not moved from the initial policy (the tiny run has no success/failure pairs
    # to train it on) while the policy has, so r_phi is exactly beta (log pi_init - log pi_old)
    metrics = [json.loads(x) for x in (d / "results/metrics/fit_2.jsonl").read_text().splitlines()]
    fit = {k: v for m in metrics for k, v in m["metrics"].items()}
    assert fit["fit/prm_drift"] == 0.0 and fit["fit/policy_drift"] > 0 and fit["fit/drift_corr"] == pytest.approx(1.0)


@pytest.fixture(scope="module")
def lora_reward_runs(grpo_run, tmp_path_factory):
    """The shared GRPO run continued with OPRL, SPA and GAE, each with a LoRA model (PRM, estimator, critic), up to
    iteration 2's fit (keep_optimizer: all, so that a fit can be rerun alone)."""
    import subprocess

    from tests.conftest import SNAKEMAKE, continue_grpo_run, snakemake_failure

    dirs = {}
    for m in LEARNED:
        d = tmp_path_factory.mktemp(f"lora_{m}")
        continue_grpo_run(grpo_run, d, credit={"method": m, m: {"lora": {"r": 4, "alpha": 8}}},
                          runtime={"keep_optimizer": "all"})
        dirs[m] = d
    procs = {m: subprocess.Popen([SNAKEMAKE, "results/iter_2/step_rewards.parquet", "--cores", "1", "--quiet"],
                                 cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for m, d in dirs.items()}
    for m, p in procs.items():
        out, err = p.communicate(timeout=1200)
        if p.returncode != 0:
            pytest.fail(snakemake_failure(dirs[m], subprocess.CompletedProcess(p.args, p.returncode, out, err)))
    return dirs


@pytest.mark.e2e
@pytest.mark.parametrize("method", LEARNED)
def test_lora_reward_models_are_adapters_on_the_initial_policy_and_a_rerun_fit_reproduces_them(
        lora_reward_runs, method, tmp_path):
    import shutil
    import subprocess
    import sys

    from pipeline.model.policy import adapter_base

    d = lora_reward_runs[method]
    base = d / "results/iter_0/checkpoint"
    for it in (0, 1, 2):
        rm = d / f"results/iter_{it}/reward_model"
        assert json.loads((rm / "adapter_config.json").read_text())["base_model_name_or_path"] == \
            ("../checkpoint" if it == 0 else "../../iter_0/checkpoint")      # relative: the run folder can move
        assert adapter_base(rm) == base.resolve() and not (rm / "model.safetensors").exists()
        assert (rm / "adapter_model.safetensors").stat().st_size < (base / "model.safetensors").stat().st_size / 5
    if method == "oprl":       # B = 0: the PRM of iteration 1 is exactly the policy that played the rollouts
        r1 = tables.read_table(d / "results/iter_1/step_rewards.parquet", tables.STEP_REWARDS)
        assert r1.height > 0 and (r1["score"] == 0.0).all()
    else:                      # the estimator's or critic's scalar head travels beside its adapter
        head = {"spa": "progress_head.pt", "gae": "value_head.pt"}[method]
        assert (d / f"results/iter_2/reward_model/{head}").is_file()
    if method == "gae":        # scored before its fit: the zero head gives V = 0 at iteration 1, not at 2
        r1, r2 = (tables.read_table(d / f"results/iter_{i}/step_rewards.parquet", tables.STEP_REWARDS)
                  for i in (1, 2))
        assert (r1["score"] == 0.0).all() and r2["score"].abs().max() > 0
        fit = json.loads((d / "results/iter_2/fit_metrics.json").read_text())
        assert fit["iteration"] == 2 and fit["critic_loss_after"] < fit["critic_loss_before"]
        assert {"explained_variance_before", "explained_variance_after"} <= set(fit)
    # resume: fit 2 rerun alone from the saved state of iteration 1 writes the same scores and adapter
    rerun = tmp_path / "rerun"
    shutil.copytree(d, rerun)
    rm2 = rerun / "results/iter_2/reward_model"
    before = (rm2 / "adapter_model.safetensors").read_bytes()
    scores = tables.read_table(rerun / "results/iter_2/step_rewards.parquet", tables.STEP_REWARDS)
    shutil.rmtree(rm2)
    r = subprocess.run([sys.executable, "-m", "stages.fit", "--params", "params.yaml", "--iteration", "2"],
                       cwd=rerun, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (rm2 / "adapter_model.safetensors").read_bytes() == before
    again = tables.read_table(rerun / "results/iter_2/step_rewards.parquet", tables.STEP_REWARDS)
    assert again["score"].to_list() == scores["score"].to_list()
    if method != "oprl":
        assert (rm2 / head).read_bytes() == (d / f"results/iter_2/reward_model/{head}").read_bytes()


@pytest.mark.e2e
def test_spa_replay_keeps_recent_iterations(method_runs):
    d = method_runs["spa"].folder
    replay = tables.read_table(d / "results/iter_2/replay.parquet", REPLAY)
    steps1 = tables.read_table(d / "results/iter_1/steps.parquet", tables.STEPS)
    steps2 = tables.read_table(d / "results/iter_2/steps.parquet", tables.STEPS)
    assert sorted(replay["iteration"].unique().to_list()) == [1, 2]       # window of 3 holds both
    assert replay.height == steps1.height + steps2.height
    assert (d / "results/iter_2/reward_model/progress_head.pt").is_file()
