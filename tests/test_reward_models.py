"""OPRL's implicit PRM and SPA's progress estimator (credit-assignment.md, OPRL; SPA) on fixed synthetic batches."""

import copy
import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.config import OprlConfig, SpaConfig
from pipeline.reward_models import (ProgressEstimator, episode_scores, pairwise_loss, prm_update, spa_loss,
                                    train_progress, turn_logprob_sums)

PAD = 0


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=PAD, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def batch(n_groups=2, per_group=4, turns=2, seed=0):
    """Turns of n_groups x per_group episodes; half of each group's episodes succeed."""
    rng = np.random.default_rng(seed)
    prompts, responses, turn_ep, ep_group, ep_success = [], [], [], [], []
    e = 0
    for g in range(n_groups):
        for k in range(per_group):
            for _ in range(turns):
                prompts.append(rng.integers(1, 40, size=int(rng.integers(3, 7))).tolist())
                responses.append(rng.integers(1, 40, size=int(rng.integers(1, 4))).tolist())
                turn_ep.append(e)
            ep_group.append(g)
            ep_success.append(k % 2 == 0)
            e += 1
    return prompts, responses, np.array(turn_ep), np.array(ep_group), np.array(ep_success)


def test_pairwise_loss_by_hand():
    S = torch.tensor([2.0, 0.0, 1.0, 5.0, 5.0], dtype=torch.float64)
    group = torch.tensor([0, 0, 0, 1, 1])
    success = torch.tensor([1, 0, 0, 1, 1])                 # group 1 has no success/failure pair
    loss, pairs = pairwise_loss(S, group, success)
    assert pairs == 2
    expected = -(math.log(1 / (1 + math.exp(-2))) + math.log(1 / (1 + math.exp(-1)))) / 2
    assert float(loss) == pytest.approx(expected)
    none, n = pairwise_loss(S, group, torch.tensor([1, 1, 1, 0, 0]) * 0)
    assert n == 0 and float(none) == 0.0


def test_episode_scores_sum_and_mean():
    r = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    te = torch.tensor([0, 0, 1])
    assert episode_scores(r, te, 2, "sum").tolist() == [3.0, 3.0]
    assert episode_scores(r, te, 2, "mean").tolist() == [1.5, 3.0]


def test_spa_loss_by_hand():
    c = torch.tensor([0.2, 0.3, 1.0])
    loss = spa_loss(c, torch.tensor([0, 0, 1]), torch.tensor([1.0, 0.0]))
    assert float(loss) == pytest.approx(((0.5 - 1) ** 2 + 1.0 ** 2) / 2)


def test_oprl_step_rewards_are_exactly_zero_while_the_prm_is_the_rollout_policy():
    policy = tiny_llama()
    prm = copy.deepcopy(policy)
    prompts, responses, *_ = batch()
    old = turn_logprob_sums(policy, prompts, responses, PAD, batch_size=5)
    r = 0.05 * (turn_logprob_sums(prm, prompts, responses, PAD, batch_size=5) - old)
    assert (r == 0.0).all() and (old != 0).all()


def test_oprl_prm_loss_falls_and_its_rewards_then_separate_successes():
    policy = tiny_llama()
    prm = copy.deepcopy(policy)
    prompts, responses, turn_ep, ep_group, ep_success = batch()
    old = turn_logprob_sums(policy, prompts, responses, PAD, batch_size=8)
    cfg = OprlConfig(beta=0.5, lr=3e-3, steps=25, batch_size=8)
    opt = torch.optim.AdamW(prm.parameters(), lr=cfg.lr)
    stats = prm_update(prm, opt, prompts, responses, old, turn_ep, ep_group, ep_success, cfg, PAD)
    assert stats["pairs"] == 2 * 2 * 2                      # 2 successes x 2 failures in each of 2 groups
    assert stats["prm_loss_before"] == pytest.approx(math.log(2))  # PRM = policy: every S is 0
    assert stats["prm_loss_after"] < 0.5 * stats["prm_loss_before"]
    r = 0.5 * (turn_logprob_sums(prm, prompts, responses, PAD, 8) - old)
    S = np.bincount(turn_ep, weights=r)
    assert S[ep_success].min() > S[~ep_success].max()


def test_oprl_gradient_through_chunks_equals_one_big_batch():
    """The chunked two-pass gradient of prm_update is the exact gradient of the pairwise loss."""
    policy = tiny_llama()
    prompts, responses, turn_ep, ep_group, ep_success = batch(turns=3)
    old = turn_logprob_sums(policy, prompts, responses, PAD, batch_size=64)
    grads = []
    for chunk in (3, 64):
        prm = copy.deepcopy(policy)
        opt = torch.optim.SGD(prm.parameters(), lr=0.0)
        cfg = OprlConfig(beta=0.5, steps=1, batch_size=chunk, grad_clip=1e9, score="mean")
        prm_update(prm, opt, prompts, responses, old, turn_ep, ep_group, ep_success, cfg, PAD)
        grads.append(torch.cat([p.grad.flatten() for p in prm.parameters() if p.grad is not None]))
    # reference: autograd through the whole graph at once
    prm = copy.deepcopy(policy)
    from pipeline.policy import pad_batch, token_logprobs

    ids, attn, resp = pad_batch(prompts, responses, PAD)
    logp, _ = token_logprobs(prm, ids, resp)
    r = 0.5 * ((logp * resp).sum(1).double() - torch.tensor(old))
    S = episode_scores(r, torch.tensor(turn_ep), len(ep_group), "mean")
    loss, _ = pairwise_loss(S, torch.tensor(ep_group), torch.tensor(ep_success))
    loss.backward()
    ref = torch.cat([p.grad.flatten() for p in prm.parameters() if p.grad is not None])
    assert torch.allclose(grads[0], ref, atol=1e-6) and torch.allclose(grads[1], ref, atol=1e-6)


def test_spa_estimator_loss_falls_and_round_trips(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "policy")
    est = ProgressEstimator.from_policy(tmp_path / "policy")
    prompts, responses, turn_ep, _, ep_success = batch(n_groups=2, per_group=6, turns=3)
    outcome = ep_success.astype(np.float64)
    assert (est.contributions(prompts, responses, PAD, 16) == 0).all()     # zero head: c_t = 0
    cfg = SpaConfig(lr=3e-3, epochs=30, episodes_per_batch=6, batch_size=16)
    opt = torch.optim.AdamW(est.parameters(), lr=cfg.lr)
    stats = train_progress(est, opt, prompts, responses, turn_ep, outcome, cfg, PAD, seed=0)
    first, last = stats["estimator_loss_epoch_0"], stats[f"estimator_loss_epoch_{cfg.epochs - 1}"]
    assert first == pytest.approx(0.5, abs=0.05)            # (0 - 1)^2 for half the episodes at the start
    assert last < 0.25 * first
    c = est.contributions(prompts, responses, PAD, 16)
    est.save(tmp_path / "est")
    again = ProgressEstimator.load(tmp_path / "est")
    assert torch.allclose(again.contributions(prompts, responses, PAD, 5), c, atol=1e-5)
