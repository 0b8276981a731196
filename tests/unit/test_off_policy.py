"""One step off-policy (`loop.off_policy_lag: 1`): the plan (which rollout reads which checkpoint, which jobs can run
together), lag 0 planning today's jobs, and the decoupled loss on hand-computed tokens."""

import math

import pytest
import torch
import yaml

from pipeline.config.params import load_params
from pipeline.data.paths import fill
from pipeline.model.ppo import policy_loss
from pipeline.workflow.dvcgen import render
from pipeline.workflow.registry import STAGE_BY_NAME, deps_for, enabled_stages, resources_for, stage_iterations
from stages.update import behaviour_weights
from tests.conftest import ROOT


def params_with(tmp_path, lag: int, method: str = "grpo", iterations: int = 4):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["loop"] = {"iterations": iterations, "off_policy_lag": lag}
    raw["credit"]["method"] = method
    f = tmp_path / f"lag{lag}_{method}.yaml"
    f.write_text(yaml.safe_dump(raw))
    return load_params(f)


def jobs(p) -> dict[str, set[str]]:
    """Every job of the plan ("rollout@3") and the jobs it depends on directly, from the registry's paths."""
    made, needs = {}, {}
    for st in enabled_stages(p):
        for it in stage_iterations(st, p) if st.per_iteration else [None]:
            name = st.name if it is None else f"{st.name}@{it}"
            for o in st.outs_for(p):
                made[(fill(o, it) if it is not None else o).rstrip("/")] = name
            needs[name] = deps_for(st, p, it)
    return {name: {made[d] for d in deps if d in made} for name, deps in needs.items()}


def ancestors(graph: dict[str, set[str]], job: str) -> set[str]:
    seen, todo = set(), list(graph[job])
    while todo:
        j = todo.pop()
        if j not in seen:
            seen.add(j)
            todo.extend(graph[j])
    return seen


def test_lag_one_rollout_reads_the_checkpoint_two_back_and_update_reads_both(tmp_path):
    p = params_with(tmp_path, 1, "oprl")
    rollout, update, fit = (STAGE_BY_NAME[s] for s in ("rollout", "update", "fit"))
    assert [deps_for(rollout, p, i) for i in (1, 2, 3, 4)] == [
        ["results/iter_0/checkpoint"], ["results/iter_0/checkpoint"], ["results/iter_1/checkpoint"],
        ["results/iter_2/checkpoint"]]
    # the update starts from the checkpoint of i-1 (proximal) and reads the one that sampled its turns (behaviour)
    assert deps_for(update, p, 1) == ["results/iter_0/checkpoint", "results/iter_1/steps.parquet",
                                      "results/iter_1/advantages.parquet"]
    assert deps_for(update, p, 3) == ["results/iter_2/checkpoint", "results/iter_1/checkpoint",
                                      "results/iter_3/steps.parquet", "results/iter_3/advantages.parquet"]
    # OPRL's π_old is the policy that sampled the turns
    assert deps_for(fit, p, 3)[:2] == ["results/iter_3/steps.parquet", "results/iter_1/checkpoint"]
    # the trainer's jobs leave a core to the rollout beside them
    assert [resources_for(STAGE_BY_NAME[s], p)["threads"] for s in ("init", "rollout", "fit", "update")] == [2, 1, 1, 1]


def test_lag_one_lets_rollout_i_plus_1_run_beside_update_i(tmp_path):
    lagged = jobs(params_with(tmp_path, 1))
    for i in (1, 2, 3):
        assert f"update@{i}" not in ancestors(lagged, f"rollout@{i + 1}")
        assert f"rollout@{i + 1}" not in ancestors(lagged, f"update@{i}")
    assert "update@1" in ancestors(lagged, "rollout@3") and "update@2" in ancestors(lagged, "rollout@4")
    assert lagged["rollout@2"] == {"init"} and lagged["rollout@3"] == {"update@1"}
    assert lagged["evaluate@2"] == {"update@2"}   # every checkpoint's evaluation as before
    today = jobs(params_with(tmp_path, 0))
    for i in (1, 2, 3):
        assert f"update@{i}" in ancestors(today, f"rollout@{i + 1}")


def test_lag_zero_plans_exactly_todays_jobs(tmp_path):
    p = params_with(tmp_path, 0, "oprl")
    rollout, update, fit = (STAGE_BY_NAME[s] for s in ("rollout", "update", "fit"))
    assert deps_for(rollout, p, 3) == ["results/iter_2/checkpoint"]
    assert deps_for(update, p, 3) == ["results/iter_2/checkpoint", "results/iter_3/steps.parquet",
                                      "results/iter_3/advantages.parquet"]
    assert deps_for(fit, p, 3)[:2] == ["results/iter_3/steps.parquet", "results/iter_2/checkpoint"]
    assert [resources_for(STAGE_BY_NAME[s], p)["threads"] for s in ("rollout", "fit", "update")] == [1, 2, 2]
    doc = yaml.safe_load(render(p))["stages"]
    assert doc["rollout"]["foreach"][3] == {"it": 3, "prev": 2}
    assert doc["rollout"]["do"]["deps"][-1] == "results/iter_${item.prev}/checkpoint"
    assert [d for d in doc["update"]["do"]["deps"] if d.startswith("results/")] == [
        "results/iter_${item.prev}/checkpoint", "results/iter_${item.it}/steps.parquet",
        "results/iter_${item.it}/advantages.parquet"]


def test_lag_one_dvc_yaml_names_the_rollout_checkpoint_per_iteration(tmp_path):
    doc = yaml.safe_load(render(params_with(tmp_path, 1)))["stages"]
    assert [doc["rollout"]["foreach"][i] for i in (1, 2, 3)] == [
        {"it": 1, "prev": 0, "src": 0}, {"it": 2, "prev": 1, "src": 0}, {"it": 3, "prev": 2, "src": 1}]
    assert doc["rollout"]["do"]["deps"][-1] == "results/iter_${item.src}/checkpoint"
    assert [d for d in doc["update"]["do"]["deps"] if d.startswith("results/")] == [
        "results/iter_${item.prev}/checkpoint", "results/iter_${item.src}/checkpoint",
        "results/iter_${item.it}/steps.parquet", "results/iter_${item.it}/advantages.parquet"]
    assert doc["evaluate"]["do"]["deps"][-1] == "results/iter_${item.it}/checkpoint"


# Two tokens of one turn: the new policy's probabilities 1.5 and 0.5 times the proximal policy's, the behaviour
# policy's 0.5 and 2 times the proximal's, so the weights are 2 and 0.5.
LOGP = [math.log(1.5), math.log(0.5)]
PROX = [0.0, 0.0]
BEHAV = [math.log(0.5), math.log(2.0)]


def decoupled(adv: float, weight: list[float] | None):
    logp = torch.tensor([LOGP], requires_grad=True)
    w = None if weight is None else torch.tensor([weight])
    loss, _ = policy_loss(logp, torch.tensor([PROX]), torch.tensor([[adv]]), torch.ones(1, 2, dtype=torch.bool),
                          clip_ratio=0.2, dual_clip=3.0, weight=w)
    loss.backward()
    return loss.item(), logp.grad[0].tolist()


def test_decoupled_loss_on_hand_computed_tokens():
    weights, stats = behaviour_weights([torch.tensor(PROX)], [torch.tensor(BEHAV)], cap=5.0)
    assert weights[0].tolist() == pytest.approx([2.0, 0.5])
    assert stats == pytest.approx({"behaviour_weight_mean": 1.25, "behaviour_weight_capped_share": 0.0,
                                   "behaviour_kl": 0.0})
    # A = +1: token 1 clipped at 1.2 (-1.2 x 2), token 2 unclipped (-0.5 x 0.5); mean -1.325. The clipped token has
    # no gradient; the other's is -A ρ w / 2 = -0.125
    loss, grad = decoupled(1.0, [2.0, 0.5])
    assert loss == pytest.approx(-1.325)
    assert grad == pytest.approx([0.0, -0.125])
    # A = -1: token 1 at ρ = 1.5 (1.5 x 2, under the dual clip's 3), token 2 clipped at 0.8 (x 0.5); mean 1.7
    loss, grad = decoupled(-1.0, [2.0, 0.5])
    assert loss == pytest.approx(1.7)
    assert grad == pytest.approx([1.5, 0.0])
    # the weight is truncated at the cap
    weights, stats = behaviour_weights([torch.tensor(PROX)], [torch.tensor(BEHAV)], cap=1.5)
    assert weights[0].tolist() == pytest.approx([1.5, 0.5])
    assert stats["behaviour_weight_capped_share"] == 0.5


def test_behaviour_kl_is_the_mean_log_ratio_of_the_behaviour_policy_to_the_proximal_one():
    """The tokens were sampled by the behaviour policy b, so mean(log b − log π_prox) over them estimates
    KL(b || π_prox). Ratios b / π_prox of 3 and 0.25 (not symmetric in the log, so the sign and the argument order
    show): (log 3 + log 0.25) / 2 = log(0.75) / 2 = -0.143841; the arguments swapped give +0.143841."""
    prox, behav = [torch.tensor([-1.0, -2.0])], [torch.tensor([-1.0 + math.log(3.0), -2.0 + math.log(0.25)])]
    _, stats = behaviour_weights(prox, behav, cap=5.0)
    assert stats["behaviour_kl"] == pytest.approx(-0.1438410362, abs=1e-6)
    assert behaviour_weights(behav, prox, cap=5.0)[1]["behaviour_kl"] == pytest.approx(0.1438410362, abs=1e-6)
    # the weights π_prox / b: 1/3 and 4, the second capped at 2
    weights, stats = behaviour_weights(prox, behav, cap=2.0)
    assert weights[0].tolist() == pytest.approx([1 / 3, 2.0]) and stats["behaviour_weight_capped_share"] == 0.5


def test_equal_behaviour_and_proximal_policies_give_todays_loss():
    weights, stats = behaviour_weights([torch.tensor(PROX)], [torch.tensor(PROX)], cap=5.0)
    assert weights[0].tolist() == [1.0, 1.0] and stats["behaviour_kl"] == 0.0
    for adv in (1.0, -1.0, 0.3):
        assert decoupled(adv, weights[0].tolist()) == decoupled(adv, None)
    # on-policy the loss is PPO's: A = +1 gives mean(-1.2, -0.5)
    assert decoupled(1.0, None)[0] == pytest.approx(-0.85)
