"""IGPO (pipeline/credit/methods/igpo.py; docs/credit-assignment.md, IGPO): the gold answer's probability after each
turn computed by hand from the tiny policy's logits, the information gains, and the advantages of the paper's
formula on a hand table; refused where the environment has no gold answer."""

import math

import numpy as np
import polars as pl
import pytest
import torch

from pipeline.config.params import CreditConfig, ParamsError, check_dependencies, load_params
from pipeline.credit.methods import compute_advantages
from pipeline.credit.methods.igpo import IgpoConfig, answer_logprobs, information_gains
from pipeline.data.section import FitBatching
from tests.conftest import PAD, tiny_llama


def hand_p(model, prompt, prefix, gold) -> float:
    """exp of the mean over the gold tokens of log softmax(logits) at the token before each, from one plain
    forward pass of prompt + prefix + gold."""
    ids = prompt + prefix + gold
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    start = len(prompt) + len(prefix)
    per_token = [float(logp[start + j - 1, gold[j]]) for j in range(len(gold))]
    return math.exp(sum(per_token) / len(per_token))


@pytest.mark.parametrize("packing", ["none", "tree"])
def test_the_answers_probability_after_each_turn_is_the_geometric_mean_of_its_tokens(packing):
    model = tiny_llama(seed=4)
    question = [5, 6, 7, 8]
    turn0 = [12, 13, 14]                 # the first turn's response and its result, in the second prompt
    prompts = [question, question + turn0 + [9]]
    prefix, gold = [3], [20, 21, 22]
    batching = FitBatching(batch_size=2, packing=packing, micro_batch_tokens=64 if packing == "tree" else None)
    mean_logp = answer_logprobs(model, prompts, [(prefix, gold)] * 2, PAD, batching)
    p0, p1 = hand_p(model, prompts[0], prefix, gold), hand_p(model, prompts[1], prefix, gold)
    assert np.exp(mean_logp) == pytest.approx([p0, p1], abs=1e-6)
    # a two-turn episode: the first turn's gain is P_1 - P_0, the last turn's 0 (its reward is the outcome)
    steps = pl.DataFrame({"episode_id": [7, 7], "step": [0, 1]})
    assert information_gains(steps, mean_logp, "prob") == pytest.approx([p1 - p0, 0.0], abs=1e-6)
    assert information_gains(steps, mean_logp, "log_prob") == pytest.approx(
        [math.log(p1) - math.log(p0), 0.0], abs=1e-6)
    assert p0 != pytest.approx(p1, abs=1e-4)            # the context changed the probability: a gain to measure


def igpo_table() -> pl.DataFrame:
    """One task group of two episodes: A answers right at its second turn (IG 0.2 at its first), B fails after
    three (IG -0.1 and 0.3). `score` is the fit stage's information gain, 0 on a last turn."""
    return pl.DataFrame({
        "episode_id": [1, 1, 2, 2, 2], "step": [0, 1, 0, 1, 2], "task_group": [0] * 5,
        "reward": [0.0, 1.0, 0.0, 0.0, 0.0], "action_valid": [True] * 5,
        "score": [0.2, 0.0, -0.1, 0.3, 0.0]})


@pytest.mark.parametrize("section, expected", [
    # r = [0.2, 1, -0.1, 0.3, 0]: mean 0.28, population std 0.386781592; r_hat = (r - 0.28) / (std + 1e-6);
    # A_t = sum of the episode's r_hat from t on (gamma 1)
    ({}, [1.65467633, 1.861510871, -1.65467633, -0.672212259, -0.723920894]),
    # gamma 0.5: A_0 of B = r_hat_2 + 0.5 r_hat_3 + 0.25 r_hat_4
    ({"gamma": 0.5}, [0.723920894, 1.861510871, -1.137589977, -0.310251812, -0.723920894]),
    # separate: outcomes [1, 0] -> +-0.999998; gains [0.2, -0.1, 0.3] around their mean 0.1333 (std 0.169967)
    ({"normalise": "separate"}, [1.392227963, 0.999998, -1.392227963, -0.019423094, -0.999998]),
])
def test_the_advantage_is_the_discounted_sum_of_the_groups_z_normalised_turn_rewards(section, expected):
    out = compute_advantages(igpo_table(), CreditConfig(method="igpo", igpo=IgpoConfig(**section),
                                                        invalid_penalty=0.0))
    assert out["advantage"].to_list() == pytest.approx(expected, abs=1e-6)
    assert out["episode_advantage"].to_list() == [0.0] * 5          # the outcome is the last turn's reward
    assert out["step_score"].to_list() == pytest.approx([0.2, 1.0, -0.1, 0.3, 0.0])   # r_t, raw


def test_a_turn_that_raises_the_answers_probability_gets_more_advantage_than_one_that_lowers_it():
    t = igpo_table().with_columns(pl.Series("score", [0.2, 0.0, -0.2, 0.0, 0.0]))
    a = compute_advantages(t, CreditConfig(method="igpo", invalid_penalty=0.0))["advantage"].to_list()
    other = compute_advantages(t.with_columns(pl.Series("score", [-0.2, 0.0, -0.2, 0.0, 0.0])),
                               CreditConfig(method="igpo", invalid_penalty=0.0))["advantage"].to_list()
    assert a[0] > other[0]             # the same episode, its first turn's gain +0.2 instead of -0.2


def test_an_environment_without_a_gold_answer_is_refused_when_the_params_load():
    p = load_params("params.yaml", ["credit.method=igpo"])
    with pytest.raises(ParamsError, match=r"params.yaml: key 'credit.method': igpo reads the current task's gold "
                                          r"answer as a response .*, which the sokoban environment does not give"):
        check_dependencies(p, "params.yaml")
    check_dependencies(load_params("configs/search.yaml", ["credit.method=igpo"]), "configs/search.yaml")
    check_dependencies(load_params("configs/sql.yaml", ["credit.method=igpo"]), "configs/sql.yaml")


def test_the_search_and_sql_environments_give_their_gold_answers(tmp_path):
    from pipeline.credit.methods.igpo import gold_answers
    from pipeline.data.seeds import task_seed

    search = load_params("configs/search.yaml")
    task = task_seed("train", 0, 1, 0)
    (pre, ans, post), = gold_answers(search, [task]).values()
    from pipeline.envs.base import make_env

    env = make_env(search.env, tmp_path)
    env.reset(task)
    assert (pre, post) == ("<answer>", "</answer>") and ans == env.question.answers[0]
    assert env.step(f"{pre}{ans}{post}").success                   # the gold response answers correctly
    sql = load_params("configs/sql.yaml")
    (pre, ans, post), = gold_answers(sql, [task]).values()
    env = make_env(sql.env, tmp_path)
    env.reset(task)
    assert ans == env.task.query and env.step(f"{pre}{ans}{post}").success
