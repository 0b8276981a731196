"""GAE (docs/credit-assignment.md, GAE): the advantages on a hand-computed 3-episode table, the clipped value loss,
and the critic on fixed synthetic turns (scored before its fit; its fit lowers the loss; LoRA trains adapters and
head only). The fit stage end to end, and a rerun of it from the saved state: tests/e2e/test_learned_models.py.

The table (γ = 0.5; V the critic's values before the fit, in the `score` column):

    ep 0 (task 0): rewards 0, 0, 1   V 0.5, 0.2, 0.4
    ep 1 (task 0): rewards 1, -1     V 0.8, 1.0
    ep 2 (task 1): reward 2          V 0.5

λ = 1, GAE = discounted return − V: returns (0.25, 0.5, 1), (0.5, -1), (2) give
(-0.25, 0.3, 0.6), (-0.3, -2), (1.5).
λ = 0, GAE = δ_t = r_t + γ V(s_{t+1}) − V(s_t), nothing after an episode's last turn:
ep 0: 0 + 0.1 - 0.5 = -0.4, 0 + 0.2 - 0.2 = 0, 1 - 0.4 = 0.6 (not 1 + 0.5 · 0.8 - 0.4: no bootstrap from ep 1);
ep 1: 1 + 0.5 - 0.8 = 0.7, -1 - 1 = -2; ep 2: 2 - 0.5 = 1.5.
λ = 0.5 (γλ = 0.25): ep 0: 0.6, 0 + 0.25 · 0.6 = 0.15, -0.4 + 0.25 · 0.15 = -0.3625.
"""

import math
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
import torch

from pipeline.config.params import CreditConfig, Params
from pipeline.credit.base import EPS
from pipeline.credit.methods import compute_advantages
from pipeline.credit.methods.gae import GaeBatch, GaeState, TurnCritic, gae
from pipeline.credit.reward_model import fit_iteration
from pipeline.data.section import FitBatching
from pipeline.model.critic import Critic, explained_variance, value_loss
from tests.conftest import PAD, batch, counting_packs, tiny_llama

EPISODES = {0: (0, [0.0, 0.0, 1.0], [0.5, 0.2, 0.4]), 1: (0, [1.0, -1.0], [0.8, 1.0]), 2: (1, [2.0], [0.5])}
LAMBDA_1 = [-0.25, 0.3, 0.6, -0.3, -2.0, 1.5]
LAMBDA_0 = [-0.4, 0.0, 0.6, 0.7, -2.0, 1.5]


def table(valid=lambda e, t: True) -> pl.DataFrame:
    rows = [{"episode_id": e, "step": t, "task_group": g, "reward": r, "action_valid": valid(e, t), "score": v}
            for e, (g, rewards, values) in EPISODES.items() for t, (r, v) in enumerate(zip(rewards, values))]
    return pl.DataFrame(rows).with_columns(pl.col("step").cast(pl.Int32))


def run(penalty=0.0, episode=None, **section) -> pl.DataFrame:
    cfg = {"method": "gae", "invalid_penalty": penalty, "gae": {"gamma": 0.5, **section}}
    if episode is not None:
        cfg["episode"] = episode
    return compute_advantages(table(lambda e, t: (e, t) != (1, 0)), CreditConfig.model_validate(cfg))


def test_gae_by_hand():
    df = table()
    args = (df["episode_id"].to_numpy(), df["step"].to_numpy(), df["reward"].to_numpy(), df["score"].to_numpy())
    assert gae(*args, gamma=0.5, lam=1.0).tolist() == pytest.approx(LAMBDA_1)
    assert gae(*args, gamma=0.5, lam=0.0).tolist() == pytest.approx(LAMBDA_0)
    assert gae(*args, gamma=0.5, lam=0.5)[:3].tolist() == pytest.approx([-0.3625, 0.15, 0.6])
    # rows in any order give each turn the same value: gae() receives the shuffled rows as they are
    shuffled = df.with_row_index("row").sample(fraction=1.0, shuffle=True, seed=3)
    assert shuffled["row"].to_list() != list(range(df.height))
    for lam, expected in ((1.0, LAMBDA_1), (0.0, LAMBDA_0)):
        got = gae(*(shuffled[c].to_numpy() for c in ("episode_id", "step", "reward", "score")), 0.5, lam)
        assert got.tolist() == pytest.approx([expected[i] for i in shuffled["row"].to_list()])


def test_the_critics_target_is_the_lambda_return_plus_the_old_value():
    """λ = 0.5, γ = 0.5 and the table's non-zero values V_old: target_t = GAE_t + V_old(s_t).
    ep 0: GAE (-0.3625, 0.15, 0.6) + V (0.5, 0.2, 0.4) = (0.1375, 0.35, 1.0);
    ep 1: δ = (0.7, -2), GAE = (0.7 + 0.25 · -2, -2) = (0.2, -2) + V (0.8, 1.0) = (1.0, -1.0);
    ep 2: 1.5 + 0.5 = 2.0."""
    df = table()
    b = GaeBatch(None, df["episode_id"].to_numpy(), df["step"].to_numpy(), df["reward"].to_numpy(), seed=0,
                 values=df["score"].to_numpy())
    target = TurnCritic()._targets(b, SimpleNamespace(gamma=0.5, lam=0.5))
    assert target.tolist() == pytest.approx([0.1375, 0.35, 1.0, 1.0, -1.0, 2.0])


def test_the_step_term_is_the_whitened_gae_and_there_is_no_episode_term():
    out = run(penalty=0.1, lam=1.0, step_advantage_w=2.0)
    # mean of LAMBDA_1 = -0.15 / 6 = -0.025; squared deviations 0.050625 + 0.105625 + 0.390625 + 0.075625
    # + 3.900625 + 2.325625 = 6.84875, unbiased variance 6.84875 / 5
    std = math.sqrt(6.84875 / 5)
    assert out["step_score"].to_list() == pytest.approx(LAMBDA_1)
    assert out["step_advantage"].to_list() == pytest.approx([2 * (a + 0.025) / (std + EPS) for a in LAMBDA_1])
    assert out["episode_advantage"].to_list() == [0.0] * 6
    assert out["advantage"][3] == pytest.approx(2 * (-0.3 + 0.025) / (std + EPS) - 0.1)   # ep 1's turn 0: invalid
    assert out["step_advantage"][2] == pytest.approx(2 * 0.625 / (std + EPS))


def test_the_hybrid_adds_grpos_episode_term():
    episode = {"mode": "mean_std_norm", "episode_stats": "per_episode"}
    hybrid = run(episode=episode, lam=0.0, episode_term=True)
    grpo = compute_advantages(table(), CreditConfig.model_validate({"method": "grpo", "episode": episode}))
    # task 0: returns 1 and 0 -> (1 - 0.5) / (std 0.7071 + ε) and its negative; task 1 alone: 0
    ae = 0.5 / (math.sqrt(0.5) + EPS)
    assert hybrid["episode_advantage"].to_list() == pytest.approx([ae] * 3 + [-ae] * 2 + [0.0])
    assert hybrid["episode_advantage"].to_list() == grpo["episode_advantage"].to_list()
    pure = run(lam=0.0)
    assert (hybrid["advantage"] - pure["advantage"]).to_list() == pytest.approx(hybrid["episode_advantage"].to_list())


def test_value_loss_by_hand():
    v, old, target = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 1.9]), torch.tensor([1.2, -1.0, 1.0])
    # unclipped: 0.5 * mean(0.04, 1, 1)
    assert float(value_loss(v, old, target, None)) == pytest.approx(0.5 * (0.04 + 1 + 1) / 3)
    # clip 0.5: row 0's clipped value 0.5 -> (0.5 - 1.2)^2 = 0.49 > 0.04; row 1 unchanged; row 2's clipped 2.0 -> 1
    assert float(value_loss(v, old, target, 0.5)) == pytest.approx(0.5 * (0.49 + 1 + 1) / 3)
    assert explained_variance(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0])) == 1.0
    assert explained_variance(np.full(3, 2.0), np.array([1.0, 2.0, 3.0])) == 0.0


def synthetic_steps(n_groups=2, per_group=6, turns=3) -> pl.DataFrame:
    """Turns of the conftest's synthetic episodes; a success gets reward 1 on its last turn."""
    prompts, _, turn_ep, _, ep_success = batch(n_groups=n_groups, per_group=per_group, turns=turns)
    step = [t % turns for t in range(len(prompts))]
    reward = [float(ep_success[e] and s == turns - 1) for e, s in zip(turn_ep, step)]
    return pl.DataFrame({"episode_id": turn_ep, "step": step, "prompt_ids": prompts, "reward": reward},
                        schema_overrides={"step": pl.Int32, "prompt_ids": pl.List(pl.Int32)})


def critic_state(tmp_path, lr, lora=None) -> GaeState:
    tiny_llama().save_pretrained(tmp_path / "policy")
    critic = Critic.from_policy(tmp_path / "policy", lora=lora, seed=0)
    return GaeState(critic, SimpleNamespace(pad_token_id=PAD), torch.optim.AdamW(critic.parameters(), lr=lr))


def gae_params(**section) -> Params:
    return Params.model_validate({"credit": {"method": "gae", "gae": {"gamma": 0.9, "lam": 1.0, **section}}})


def test_the_critic_scores_before_its_fit_and_its_fit_lowers_the_loss(tmp_path):
    steps = synthetic_steps()
    p = gae_params(epochs=40, minibatch_size=12, lr=3e-3, value_clip=None, batch_size=16)
    state = critic_state(tmp_path, lr=3e-3)
    scores, stats = fit_iteration(TurnCritic(), state, steps, None, None, 1, p)
    assert (scores == 0).all()                        # the zero head, before the fit
    # λ = 1 and V = 0: the targets are the discounted returns, 0.81, 0.9, 1 on successes (half the episodes) and
    # 0 on failures
    returns = [0.81, 0.9, 1.0] + [0.0] * 3
    assert stats["critic_loss_before"] == pytest.approx(0.5 * np.mean(np.square(returns)))
    assert stats["critic_loss_after"] < 0.1 * stats["critic_loss_before"]
    assert stats["explained_variance_before"] == 0.0   # V = 0 explains none of the returns' variance
    assert stats["explained_variance_after"] > 0.8
    # iteration 2 scores with the critic as the fit of iteration 1 left it
    batch2 = TurnCritic().prepare(state, steps, None, None, 2, p)
    expected = TurnCritic()._values(state, batch2, p)
    again, _ = fit_iteration(TurnCritic(), state, steps, None, None, 2, p)
    assert again.tolist() == expected.tolist() and np.abs(again).max() > 0.3


def test_value_clipping_limits_the_first_fit(tmp_path):
    steps = synthetic_steps()
    clipped = fit_iteration(TurnCritic(), critic_state(tmp_path / "a", lr=3e-3), steps, None, None, 1,
                            gae_params(epochs=40, minibatch_size=12, value_clip=0.05))[1]
    free = fit_iteration(TurnCritic(), critic_state(tmp_path / "b", lr=3e-3), steps, None, None, 1,
                         gae_params(epochs=40, minibatch_size=12, value_clip=None))[1]
    # the clipped loss stops pulling a value once it is 0.05 beyond V_old = 0 on the far side of its target, and
    # its gradient is the unclipped one otherwise: the fit still learns, by less than without the clip
    assert free["critic_loss_after"] < clipped["critic_loss_after"] < clipped["critic_loss_before"]


def test_a_lora_critic_trains_adapters_and_head_only(tmp_path):
    from pipeline.data.section import LoraSettings

    steps = synthetic_steps()
    state = critic_state(tmp_path, lr=3e-3, lora=LoraSettings(r=4, alpha=8))
    plain = Critic.from_policy(tmp_path / "policy")
    trainable = {n for n, q in state.critic.modules.named_parameters() if q.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    _, stats = fit_iteration(TurnCritic(), state, steps, None, None, 1,
                             gae_params(epochs=40, minibatch_size=12, value_clip=None))
    assert stats["critic_loss_after"] < 0.5 * stats["critic_loss_before"]
    frozen = dict(plain.body.named_parameters())
    moved = 0
    for name, w in state.critic.body.named_parameters():
        if "lora_" in name:
            moved += int("lora_B" in name and w.abs().max() > 0)
        else:
            assert torch.equal(w, frozen[name.removeprefix("base_model.model.").replace(".base_layer", "")]), name
    assert moved > 0 and state.critic.head.weight.abs().max() > 0
    state.critic.save(tmp_path / "critic")
    again = Critic.load(tmp_path / "critic")
    b = GaeBatch(steps["prompt_ids"].to_list(), None, None, None, 0)
    assert torch.allclose(again.state_values(b.prompts, PAD, FitBatching(batch_size=5)),
                          state.critic.state_values(b.prompts, PAD, FitBatching(batch_size=16)),
                          atol=1e-5)


def test_the_critic_leaves_out_episodes_whose_environment_raised(tmp_path):
    """The advantages stage gives a crashed episode advantage 0 and keeps it out of every statistic; the critic's
    fit leaves it out too: the fit on a table with one crashed episode is the fit on the table without it, and the
    crashed turns score 0."""
    steps = synthetic_steps().with_columns(pl.lit(None, pl.String).alias("env_error"))
    success = steps.group_by("episode_id").agg(pl.col("reward").sum())
    crashed = success.filter(pl.col("reward") > 0)["episode_id"].min()    # a success: its return would count
    marked = steps.with_columns(pl.when((pl.col("episode_id") == crashed) & (pl.col("step") == 2))
                                .then(pl.lit("RuntimeError: engine died")).otherwise("env_error").alias("env_error"))
    p = gae_params(epochs=3, minibatch_size=12, lr=3e-3, value_clip=None, batch_size=16)
    scores, stats = fit_iteration(TurnCritic(), critic_state(tmp_path / "a", lr=3e-3), marked, None, None, 1, p)
    clean = steps.filter(pl.col("episode_id") != crashed)
    state_b = critic_state(tmp_path / "b", lr=3e-3)
    ref_scores, ref_stats = fit_iteration(TurnCritic(), state_b, clean, None, None, 1, p)
    assert stats.pop("env_error_episodes_left_out") == 1.0
    assert stats == pytest.approx(ref_stats)
    # 5 successes of 0.81, 0.9, 1 and 6 failures of 0s left: 0.5 · 5 · (0.81² + 0.9² + 1) / 33
    assert stats["critic_loss_before"] == pytest.approx(0.5 * 5 * (0.81 ** 2 + 0.9 ** 2 + 1) / 33)
    keep = (marked.sort("episode_id", "step")["episode_id"] != crashed).to_numpy()
    assert scores[~keep].tolist() == [0.0] * 3
    assert scores[keep].tolist() == ref_scores.tolist()


def test_the_critic_packed_or_not_fits_and_scores_alike(tmp_path, monkeypatch):
    """`credit.gae.packing: tree` (docs/models.md, Tree packing): the states as prefix trees."""
    steps = synthetic_steps()
    packs = counting_packs(monkeypatch)
    out = {}
    for packing in ("none", "tree"):
        p = gae_params(epochs=3, minibatch_size=12, lr=3e-3, value_clip=None, batch_size=16, packing=packing)
        state = critic_state(tmp_path / packing, lr=3e-3)
        _, stats = fit_iteration(TurnCritic(), state, steps, None, None, 1, p)
        out[packing] = stats, state.critic.state_values(steps["prompt_ids"].to_list(), PAD,
                                                         FitBatching(batch_size=16, packing=packing))
    assert packs and max(packs) <= 16
    (s0, v0), (s1, v1) = out["none"], out["tree"]
    assert s1 == pytest.approx(s0, rel=1e-5) and s0["critic_loss_after"] < s0["critic_loss_before"]
    assert (v1 - v0).abs().max() <= 1e-5 * v0.abs().max() and v0.abs().max() > 1e-3
