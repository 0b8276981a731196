"""SPA (docs/credit-assignment.md, SPA): its advantages on the hand-computed table, the progress estimator on fixed
synthetic batches (the fit stage's replay end to end: tests/e2e/test_learned_models.py)."""

import numpy as np
import pytest
import torch

from pipeline.credit.methods.spa import SpaConfig
from pipeline.data.section import FitBatching
from pipeline.model.progress_estimator import ProgressEstimator, spa_loss, train_progress
from tests.conftest import PAD, ROOT, batch, counting_packs, tiny_llama
from tests.unit.test_credit_methods import advantages


def test_spa_advantages_by_hand():
    a = advantages("spa", gamma=0.5, mode="mean_norm")
    # r = c + 0.5 * valid. ep 0: (0.8, 0.6, 0.7) -> G (1.275, 0.95, 0.7)
    # ep 1: (0.5, -0.2, 0.5, 0.6) -> G (0.6, 0.2, 0.8, 0.6); ep 2: (0.6, 0.5) -> (0.85, 0.5)
    m0 = (1.275 + 0.95 + 0.7 + 0.6 + 0.2 + 0.8 + 0.6 + 0.85 + 0.5) / 9
    assert a[(0, 0)] == pytest.approx(2 / 3 + 1.275 - m0)
    assert a[(1, 1)] == pytest.approx(-1 / 3 + 0.2 - m0 - 0.1)
    assert a[(2, 0)] == pytest.approx(-1 / 3 + 0.85 - m0)
    # group 1: ep 3 (0.7, 0.7) -> (1.05, 0.7); ep 4: 0.9
    m1 = (1.05 + 0.7 + 0.9) / 3
    assert a[(4, 0)] == pytest.approx(0.9 - m1) and a[(3, 0)] == pytest.approx(1.05 - m1)
    scores = advantages("spa", "step_score", gamma=0.5)
    assert scores[(0, 0)] == pytest.approx(1.275) and scores[(1, 1)] == pytest.approx(0.2)
    no_ground = advantages("spa", "step_score", gamma=0.5, grounding_w=0.0, progress_w=2.0)
    # ep 1 with r = 2c: (0, -0.4, 0, 0.2) -> G_1 = -0.4 + 0.5 * (0 + 0.5 * 0.2) = -0.35
    assert no_ground[(4, 0)] == pytest.approx(0.8) and no_ground[(1, 1)] == pytest.approx(-0.35)
    # gamma 0: the step term is the turn's own step reward
    own = advantages("spa", "step_score", gamma=0.0)
    assert own[(0, 0)] == pytest.approx(0.8) and own[(1, 1)] == pytest.approx(-0.2)


def test_spa_loss_by_hand():
    c = torch.tensor([0.2, 0.3, 1.0])
    loss = spa_loss(c, torch.tensor([0, 0, 1]), torch.tensor([1.0, 0.0]))
    assert float(loss) == pytest.approx(((0.5 - 1) ** 2 + 1.0 ** 2) / 2)


def test_spa_estimator_loss_falls_and_round_trips(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "policy")
    est = ProgressEstimator.from_policy(tmp_path / "policy")
    prompts, responses, turn_ep, _, ep_success = batch(n_groups=2, per_group=6, turns=3)
    outcome = ep_success.astype(np.float64)
    assert (est.contributions(prompts, responses, PAD, FitBatching(batch_size=16)) == 0).all()     # zero head: c_t = 0
    cfg = SpaConfig(lr=3e-3, epochs=30, episodes_per_batch=6, batch_size=16)
    opt = torch.optim.AdamW(est.parameters(), lr=cfg.lr)
    stats = train_progress(est, opt, prompts, responses, turn_ep, outcome, cfg, PAD, seed=0)
    first, last = stats["estimator_loss_epoch_0"], stats[f"estimator_loss_epoch_{cfg.epochs - 1}"]
    assert first == pytest.approx(0.5, abs=0.05)            # (0 - 1)^2 for half the episodes at the start
    assert last < 0.25 * first
    c = est.contributions(prompts, responses, PAD, FitBatching(batch_size=16))
    est.save(tmp_path / "est")
    again = ProgressEstimator.load(tmp_path / "est")
    assert torch.allclose(again.contributions(prompts, responses, PAD, FitBatching(batch_size=5)), c, atol=1e-5)


def test_spa_estimator_batches_are_near_equal(tmp_path, monkeypatch):
    """12 episodes at 5 per batch: three optimiser steps on 4 episodes each, not 5, 5 and a last step on 2."""
    import pipeline.model.progress_estimator as spa

    tiny_llama().save_pretrained(tmp_path / "policy")
    est = ProgressEstimator.from_policy(tmp_path / "policy")
    prompts, responses, turn_ep, _, ep_success = batch(n_groups=2, per_group=6, turns=3)
    sizes, lines = [], []
    real = spa.spa_loss
    monkeypatch.setattr(spa, "spa_loss",
                        lambda c, local, outcome: sizes.append(len(outcome)) or real(c, local, outcome))
    cfg = SpaConfig(lr=1e-3, epochs=2, episodes_per_batch=5, batch_size=16)
    opt = torch.optim.AdamW(est.parameters(), lr=cfg.lr)
    train_progress(est, opt, prompts, responses, turn_ep, ep_success.astype(np.float64), cfg, PAD, seed=0,
                   progress=lines.append)
    assert sizes == [4, 4, 4, 4, 4, 4]
    assert lines[-1].startswith("estimator step 6/6: loss ")


def test_spa_replay_travels_beside_the_estimator_in_both_workflows():
    import yaml

    from pipeline.config.params import load_params
    from pipeline.workflow.dvcgen import render
    from pipeline.workflow.registry import STAGE_BY_NAME, deps_for

    base = load_params(ROOT / "params.yaml")
    p = base.model_copy(update={"credit": base.credit.model_copy(update={"method": "spa"})})
    doc = yaml.safe_load(render(p))["stages"]
    assert "results/iter_0/replay.parquet" in doc["reward_init"]["outs"]
    assert "results/iter_${item.prev}/replay.parquet" in doc["fit"]["do"]["deps"]
    assert "results/iter_${item.it}/replay.parquet" in doc["fit"]["do"]["outs"]
    assert "results/iter_2/replay.parquet" in deps_for(STAGE_BY_NAME["fit"], p, 3)         # Snakemake's inputs
    assert "results/iter_3/replay.parquet" in STAGE_BY_NAME["fit"].outs_for(p)[-1].replace("{it}", "3")


def test_spa_estimator_with_lora_trains_adapters_and_head_only(tmp_path):
    """`credit.spa.lora`: the body's own weights stay those of the policy, the saved estimator is the adapter (with a
    pointer to the policy it adapts) and the head, and it reloads to the same contributions."""
    import json

    from pipeline.data.section import LoraSettings
    from pipeline.model.policy import pad_batch

    tiny_llama().save_pretrained(tmp_path / "policy")
    est = ProgressEstimator.from_policy(tmp_path / "policy", lora=LoraSettings(r=4, alpha=8), seed=0)
    plain = ProgressEstimator.from_policy(tmp_path / "policy")
    prompts, responses, turn_ep, _, ep_success = batch(n_groups=2, per_group=6, turns=3)
    ids, attn, _ = pad_batch(prompts[:8], responses[:8], PAD)
    with torch.no_grad():                                   # B = 0: the adapted body computes the policy's states
        same = est.body(input_ids=ids, attention_mask=attn).last_hidden_state
        assert torch.equal(same, plain.body(input_ids=ids, attention_mask=attn).last_hidden_state)
    trainable = {n for n, q in est.modules.named_parameters() if q.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    assert "head.weight" in trainable
    cfg = SpaConfig(lr=3e-3, epochs=30, episodes_per_batch=6, batch_size=16)
    opt = torch.optim.AdamW(est.parameters(), lr=cfg.lr)
    stats = train_progress(est, opt, prompts, responses, turn_ep, ep_success.astype(np.float64), cfg, PAD, seed=0)
    assert stats[f"estimator_loss_epoch_{cfg.epochs - 1}"] < 0.5 * stats["estimator_loss_epoch_0"]
    frozen = dict(plain.body.named_parameters())
    moved = 0
    for name, w in est.body.named_parameters():
        if "lora_" in name:
            moved += int("lora_B" in name and w.abs().max() > 0)
        else:
            assert torch.equal(w, frozen[name.removeprefix("base_model.model.").replace(".base_layer", "")]), name
    assert moved > 0
    c = est.contributions(prompts, responses, PAD, FitBatching(batch_size=16))
    est.save(tmp_path / "reward_model")
    saved = tmp_path / "reward_model"
    assert not (saved / "model.safetensors").exists() and (saved / "adapter_model.safetensors").is_file()
    assert json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"] == "../policy"
    again = ProgressEstimator.load(saved)
    assert again.base == (tmp_path / "policy").resolve()
    assert torch.allclose(again.contributions(prompts, responses, PAD, FitBatching(batch_size=5)), c, atol=1e-5)
    assert {n for n, q in again.modules.named_parameters() if q.requires_grad} == trainable


def test_spa_estimator_packed_or_not_gives_the_same_contributions_fit_and_gradient(tmp_path, monkeypatch):
    """`credit.spa.packing: tree` (docs/models.md, Tree packing)."""
    tiny_llama().save_pretrained(tmp_path / "policy")
    prompts, responses, turn_ep, _, ep_success = batch(n_groups=2, per_group=6, turns=3)
    prompts = [[3, 4, 5, 6] + p for p in prompts]                # a shared system prefix
    packs = counting_packs(monkeypatch)
    fits = {}
    for packing in ("none", "tree"):
        est = ProgressEstimator.from_policy(tmp_path / "policy")
        cfg = SpaConfig(lr=3e-3, epochs=3, episodes_per_batch=6, batch_size=16, packing=packing)
        stats = train_progress(est, torch.optim.AdamW(est.parameters(), lr=cfg.lr), prompts, responses, turn_ep,
                               ep_success.astype(np.float64), cfg, PAD, seed=0)
        for q in est.parameters():
            q.grad = None
        c = est.contributions(prompts, responses, PAD, FitBatching(batch_size=16, packing=packing), grad=True)
        (c * torch.linspace(-1, 1, len(c))).sum().backward()
        grad = torch.cat([q.grad.flatten() for q in est.parameters() if q.grad is not None])
        fits[packing] = stats, c.detach(), grad
    # 3 epochs x 2 minibatches of 6 episodes (18 turns: chunks of 16 and 2), then the 36 turns scored in chunks of 16
    # (two passes each: the values without a graph, then each pass again with its graph: `fit_step`)
    assert packs == [16, 2, 16, 2] * 6 + [16, 16, 4]
    # trees of at most 3 turns' tokens (`micro_batch_tokens`): the turns regrouped, each value back in its place
    budget = 3 * max(len(p) + len(r) for p, r in zip(prompts, responses))
    est = ProgressEstimator.from_policy(tmp_path / "policy")
    cfg = SpaConfig(lr=3e-3, epochs=3, episodes_per_batch=6, batch_size=16, packing="tree", micro_batch_tokens=budget)
    stats = train_progress(est, torch.optim.AdamW(est.parameters(), lr=cfg.lr), prompts, responses, turn_ep,
                           ep_success.astype(np.float64), cfg, PAD, seed=0)
    for q in est.parameters():
        q.grad = None
    c = est.contributions(prompts, responses, PAD,
                          FitBatching(batch_size=16, packing="tree", micro_batch_tokens=budget), grad=True)
    (c * torch.linspace(-1, 1, len(c))).sum().backward()
    fits["budget"] = stats, c.detach(), torch.cat([q.grad.flatten() for q in est.parameters() if q.grad is not None])
    assert len(packs) - 15 > 15          # more, smaller trees than chunks of 16 turns
    (s0, c0, g0) = fits["none"]
    assert s0["estimator_loss_epoch_2"] < s0["estimator_loss_epoch_0"] and c0.abs().max() > 1e-3
    for s1, c1, g1 in (fits["tree"], fits["budget"]):
        assert s1 == pytest.approx(s0, rel=1e-5)
        assert (c1 - c0).abs().max() <= 1e-5 * c0.abs().max()
        assert (g1 - g0).abs().max() <= 1e-5 * g0.abs().max()


@pytest.mark.parametrize("batching", [dict(batch_size=4), dict(batch_size=64, packing="tree", micro_batch_tokens=40)])
def test_a_step_on_a_batch_of_episodes_holds_one_pass_at_a_time_with_the_same_gradient(tmp_path, monkeypatch,
                                                                                        batching):
    """SPA's loss couples an episode's turns, so the estimator once held the graph of a whole batch of episodes
    (24 GB on SQL's prompts): `fit_step` now computes the values without a graph, then back-propagates each pass
    weighted by the loss's gradient there. The gradient is the one-pass gradient, and no pass holds more than the
    budget."""
    import pipeline.model.scalar_head as sh
    from pipeline.model.precision import Stepper

    tiny_llama().save_pretrained(tmp_path / "policy")
    prompts, responses, turn_ep, _, ep_success = batch(n_groups=2, per_group=3, turns=3)   # 18 turns
    prompts = [[3, 4, 5, 6] + p for p in prompts]
    target = torch.as_tensor(ep_success.astype(np.float64))
    local = torch.as_tensor(turn_ep, dtype=torch.long)
    grads, losses, graph_sizes = {}, {}, {}
    real = sh.ScalarHeadModel._pass
    for name, cfg in (("one pass", FitBatching(batch_size=64)), ("passes", FitBatching(**batching))):
        est = ProgressEstimator.from_policy(tmp_path / "policy")
        torch.nn.init.normal_(est.head.weight, std=0.5, generator=torch.Generator().manual_seed(0))   # a live head
        sizes = []
        monkeypatch.setattr(sh.ScalarHeadModel, "_pass", lambda self, ps, rs, pad, packing: sizes.append(
            (len(ps), sum(len(p) + len(r) for p, r in zip(ps, rs)), torch.is_grad_enabled()))
            or real(self, ps, rs, pad, packing))
        opt = torch.optim.SGD(est.parameters(), lr=0.0)
        losses[name] = est.fit_step(prompts, responses, PAD, cfg, lambda c: spa_loss(c, local, target),
                                    Stepper(est.modules, opt, grad_clip=1e9), "test")
        grads[name] = torch.cat([q.grad.flatten() for q in est.parameters() if q.grad is not None])
        graph_sizes[name] = [n for n, _, g in sizes if g]
        if name == "passes":
            with_graph = [(n, tokens) for n, tokens, g in sizes if g]
            assert len(with_graph) > 1 and sum(n for n, _ in with_graph) == 18
            assert [n for n, _, g in sizes if not g] and sum(n for n, _, g in sizes if not g) == 18
            if "micro_batch_tokens" not in batching:
                assert max(n for n, _ in with_graph) == 4
    assert graph_sizes["one pass"] == [18]
    assert losses["passes"] == pytest.approx(losses["one pass"], rel=1e-6)
    g0, g1 = grads["one pass"], grads["passes"]
    assert g0.abs().max() > 1e-3 and len(g1) == len(g0)
    assert (g1 - g0).abs().max() <= 1e-5 * g0.abs().max()
