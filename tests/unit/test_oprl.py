"""OPRL (docs/credit-assignment.md, OPRL): its advantages on the hand-computed table and the implicit PRM on fixed
synthetic batches (the fit stage end to end: tests/e2e/test_learned_models.py)."""

import copy
import math

import numpy as np
import pytest
import torch

from pipeline.credit.base import EPS
from pipeline.credit.methods.oprl import OprlConfig, episode_scores, pairwise_loss, prm_update, turn_logprob_sums
from pipeline.data.section import FitBatching
from tests.conftest import PAD, batch, tiny_llama
from tests.unit.test_credit_methods import AE0, AE1, PER_EPISODE_STD, advantages


def test_oprl_advantages_by_hand():
    a = advantages("oprl", episode=PER_EPISODE_STD)
    # group 0 values r_phi (in 1/30): 9 3 6 | 0 -6 0 3 | 3 0: mean 1/15, unbiased std sqrt(144/900/8) = sqrt(0.02)
    s0 = math.sqrt(0.02)
    assert a[(0, 0)] == pytest.approx(AE0 + (0.3 - 1 / 15) / (s0 + EPS))
    assert a[(1, 1)] == pytest.approx(AE1 - 0.1 + (-0.2 - 1 / 15) / (s0 + EPS))
    assert a[(2, 1)] == pytest.approx(AE1 + (0 - 1 / 15) / (s0 + EPS))
    # group 1: (0.2, 0.2, 0.4), mean 4/15, unbiased std sqrt(3)/15; A^E 0
    s1 = math.sqrt(3) / 15
    assert a[(4, 0)] == pytest.approx((2 / 15) / (s1 + EPS))
    assert a[(3, 1)] == pytest.approx((-1 / 15) / (s1 + EPS))
    half = advantages("oprl", alpha=0.5)
    assert half[(0, 0)] == pytest.approx(2 / 3 + 0.5 * (0.3 - 1 / 15) / (s0 + EPS))


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


def test_oprl_step_rewards_are_exactly_zero_while_the_prm_is_the_rollout_policy():
    policy = tiny_llama()
    prm = copy.deepcopy(policy)
    prompts, responses, *_ = batch()
    old = turn_logprob_sums(policy, prompts, responses, PAD, FitBatching(batch_size=5))
    r = 0.05 * (turn_logprob_sums(prm, prompts, responses, PAD, FitBatching(batch_size=5)) - old)
    assert (r == 0.0).all() and (old != 0).all()


def test_oprl_prm_loss_falls_and_its_rewards_then_separate_successes():
    policy = tiny_llama()
    prm = copy.deepcopy(policy)
    prompts, responses, turn_ep, ep_group, ep_success = batch()
    old = turn_logprob_sums(policy, prompts, responses, PAD, FitBatching(batch_size=8))
    cfg = OprlConfig(beta=0.5, lr=3e-3, steps=25, batch_size=8)
    opt = torch.optim.AdamW(prm.parameters(), lr=cfg.lr)
    stats = prm_update(prm, opt, prompts, responses, old, turn_ep, ep_group, ep_success, cfg, PAD)
    assert stats["pairs"] == 2 * 2 * 2                      # 2 successes x 2 failures in each of 2 groups
    assert stats["prm_loss_before"] == pytest.approx(math.log(2))  # PRM = policy: every S is 0
    assert stats["prm_loss_after"] < 0.5 * stats["prm_loss_before"]
    r = 0.5 * (turn_logprob_sums(prm, prompts, responses, PAD, FitBatching(batch_size=8)) - old)
    S = np.bincount(turn_ep, weights=r)
    assert S[ep_success].min() > S[~ep_success].max()


def test_oprl_lora_prm_starts_at_the_policy_and_trains_adapters_only():
    """`credit.oprl.lora`: adapters with B = 0 leave the PRM exactly the policy (r_phi = 0), and the PRM's update
    moves only the adapters while still separating successes from failures."""
    from pipeline.data.section import LoraSettings
    from pipeline.model.policy import with_lora

    policy = tiny_llama()
    prm = with_lora(copy.deepcopy(policy), LoraSettings(r=4, alpha=8), seed=0)
    prompts, responses, turn_ep, ep_group, ep_success = batch()
    old = turn_logprob_sums(policy, prompts, responses, PAD, FitBatching(batch_size=8))
    assert (turn_logprob_sums(prm, prompts, responses, PAD, FitBatching(batch_size=8)) == old).all()
    cfg = OprlConfig(beta=0.5, lr=3e-2, steps=25, batch_size=8)
    opt = torch.optim.AdamW([q for q in prm.parameters() if q.requires_grad], lr=cfg.lr)
    stats = prm_update(prm, opt, prompts, responses, old, turn_ep, ep_group, ep_success, cfg, PAD)
    assert stats["prm_loss_before"] == pytest.approx(math.log(2))
    assert stats["prm_loss_after"] < 0.5 * stats["prm_loss_before"]
    r = 0.5 * (turn_logprob_sums(prm, prompts, responses, PAD, FitBatching(batch_size=8)) - old)
    S = np.bincount(turn_ep, weights=r)
    assert S[ep_success].min() > S[~ep_success].max()
    frozen = dict(policy.named_parameters())
    for name, w in prm.named_parameters():
        if "lora_" not in name:
            assert not w.requires_grad
            assert torch.equal(w, frozen[name.removeprefix("base_model.model.").replace(".base_layer", "")]), name


def test_oprl_gradient_through_chunks_equals_one_big_batch():
    """The chunked two-pass gradient of prm_update is the exact gradient of the pairwise loss."""
    policy = tiny_llama()
    prompts, responses, turn_ep, ep_group, ep_success = batch(turns=3)
    old = turn_logprob_sums(policy, prompts, responses, PAD, FitBatching(batch_size=64))
    grads = []
    for chunk in (3, 64):
        prm = copy.deepcopy(policy)
        opt = torch.optim.SGD(prm.parameters(), lr=0.0)
        cfg = OprlConfig(beta=0.5, steps=1, batch_size=chunk, grad_clip=1e9, score="mean")
        prm_update(prm, opt, prompts, responses, old, turn_ep, ep_group, ep_success, cfg, PAD)
        grads.append(torch.cat([p.grad.flatten() for p in prm.parameters() if p.grad is not None]))
    # reference: autograd through the whole graph at once
    prm = copy.deepcopy(policy)
    from pipeline.model.policy import pad_batch, token_logprobs

    ids, attn, resp = pad_batch(prompts, responses, PAD)
    logp, _ = token_logprobs(prm, ids, resp)
    r = 0.5 * ((logp * resp).sum(1).double() - torch.tensor(old))
    S = episode_scores(r, torch.tensor(turn_ep), len(ep_group), "mean")
    loss, _ = pairwise_loss(S, torch.tensor(ep_group), torch.tensor(ep_success))
    loss.backward()
    ref = torch.cat([p.grad.flatten() for p in prm.parameters() if p.grad is not None])
    assert torch.allclose(grads[0], ref, atol=1e-6) and torch.allclose(grads[1], ref, atol=1e-6)


def test_a_reward_model_saved_without_lora_is_refused_when_lora_is_set(tmp_path):
    from pipeline.config.params import Params
    from pipeline.credit.methods.oprl import ImplicitPRM

    tiny_llama().save_pretrained(tmp_path / "reward_model")
    p = Params.model_validate({"credit": {"method": "oprl", "oprl": {"lora": {"r": 4}}}})
    with pytest.raises(ValueError, match=r"reward_model: the saved step-reward model is a whole model but "
                                         r"credit\.oprl\.lora is set; rerun from the reward_init stage"):
        ImplicitPRM().load(tmp_path / "reward_model", {}, p)


def test_oprl_sums_and_prm_gradient_are_alike_packed_or_not(monkeypatch):
    """`credit.oprl.packing: tree` (docs/models.md, Tree packing): the same sums and PRM gradient."""
    policy = tiny_llama()
    prompts, responses, turn_ep, ep_group, ep_success = batch(turns=3)
    prompts = [[3, 4, 5, 6] + p for p in prompts]                # a shared system prefix
    old = turn_logprob_sums(policy, prompts, responses, PAD, FitBatching(batch_size=8))
    packed = turn_logprob_sums(policy, prompts, responses, PAD, FitBatching(batch_size=8, packing="tree"))
    assert np.abs(packed - old).max() <= 1e-5
    grads, packs, trees = {}, {}, tree_sizes(monkeypatch)
    budget = 3 * max(len(p) + len(r) for p, r in zip(prompts, responses))
    for packing, tokens in (("none", None), ("tree", None), ("tree", budget)):
        before = len(trees)
        prm = copy.deepcopy(policy)
        cfg = OprlConfig(beta=0.5, steps=1, batch_size=8, grad_clip=1e9, packing=packing, micro_batch_tokens=tokens)
        prm_update(prm, torch.optim.SGD(prm.parameters(), lr=0.0), prompts, responses, old, turn_ep, ep_group,
                   ep_success, cfg, PAD)
        grads[packing, tokens] = torch.cat([p.grad.flatten() for p in prm.parameters() if p.grad is not None])
        packs[packing, tokens] = trees[before:]
    # 24 turns, 8 a tree: the sums, the backward pass, the sums after the step
    assert packs["none", None] == [] and [n for n, _ in packs["tree", None]] == [8] * 9
    # with a token budget the trees hold at most that many tokens, so more of them, each turn in one
    assert max(t for _, t in packs["tree", budget]) <= budget and sum(n for n, _ in packs["tree", budget]) == 24 * 3
    assert len(packs["tree", budget]) > 9
    none = grads["none", None]
    assert none.abs().max() > 1e-4
    for key in (("tree", None), ("tree", budget)):
        assert (grads[key] - none).abs().max() <= 1e-5 * none.abs().max()
    packed = turn_logprob_sums(policy, prompts, responses, PAD,
                               FitBatching(batch_size=8, packing="tree", micro_batch_tokens=budget))
    assert np.abs(packed - old).max() <= 1e-5


def tree_sizes(monkeypatch) -> list[tuple[int, int]]:
    """(turns, tokens) of each prefix tree `pipeline.model.packing` packs from here on."""
    import pipeline.model.packing as packing

    calls, real = [], packing.pack

    def pack(seqs):
        tree = real(seqs)
        calls.append((len(seqs), len(tree.ids)))
        return tree

    monkeypatch.setattr(packing, "pack", pack)
    return calls

