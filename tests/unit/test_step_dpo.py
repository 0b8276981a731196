"""Step-level preference updates (`update.objective: step_dpo`): each method's step values by hand, the pairs of a
hand-made iteration (different actions, the gap rule, the cap per state, invalid turns, crashed episodes), the
value and oracle margins, the DPO loss by hand, a sign test that one step raises the chosen turn against the
rejected one, a broken pairs table and the params refused."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import torch

from pipeline.config.params import CreditConfig, Params, StepDpoSettings, UpdateConfig
from pipeline.credit.preferences import build_pairs, margin_of, oracle_rewards, pair_stats, turn_values
from pipeline.model.dpo import pair_loss, step_dpo_update
from tests.conftest import tiny_llama


def turns(rows):
    """rows: (episode_id, step, task_group, step_group, action, reward[, score])."""
    cols = ["episode_id", "step", "task_group", "step_group", "action", "reward", "score"]
    data = [r if len(r) == 7 else (*r, 0.0) for r in rows]
    df = pl.DataFrame(data, schema=cols, orient="row").with_columns(
        pl.col("episode_id").cast(pl.Int64), pl.col("step").cast(pl.Int32), pl.col("task_group").cast(pl.Int64),
        pl.col("step_group").cast(pl.Int64), pl.col("reward").cast(pl.Float64), pl.col("score").cast(pl.Float64))
    return df.with_columns(pl.col("action").is_not_null().alias("action_valid"),
                           pl.lit(None, pl.String).alias("env_error"))


# One task group of 4 episodes. Every episode starts in state 10; episodes 0 and 1 both then reach state 11.
#   ep 0: up (0), down (0), right (+1)     returns at gamma 0.5: 0.25, 0.5, 1
#   ep 1: up (0), left (0)                 0, 0 (truncated)
#   ep 2: left (0), right (+1)             0.5, 1
#   ep 3: invalid (0), up (0)              0, 0
ITER = turns([
    (0, 0, 0, 10, "up", 0.0), (0, 1, 0, 11, "down", 0.0), (0, 2, 0, 12, "right", 1.0),
    (1, 0, 0, 10, "up", 0.0), (1, 1, 0, 11, "left", 0.0),
    (2, 0, 0, 10, "left", 0.0), (2, 1, 0, 13, "right", 1.0),
    (3, 0, 0, 10, None, 0.0), (3, 1, 0, 14, "up", 0.0),
])


def values(table, method="grpo", gamma=0.5, **section):
    credit = CreditConfig(method=method, **({method: section} if section else {}))
    return turn_values(table, credit, gamma)


def test_the_step_value_of_reward_methods_is_the_discounted_return():
    for method in ("grpo", "rloo", "gigpo", "hgpo"):
        v = values(ITER, method)
        assert v["value"].to_list() == [0.25, 0.5, 1.0, 0.0, 0.0, 0.5, 1.0, 0.0, 0.0], method


def test_learned_methods_rank_by_their_own_scores():
    t = turns([(0, 0, 0, 1, "a", 0.0, 0.2), (0, 1, 0, 2, "b", 1.0, -0.4), (1, 0, 0, 1, "c", 0.0, 0.6)])
    for method in ("oprl", "spa"):     # the return of the learned score at gamma 0.5, not of the reward
        assert values(t, method)["value"].to_list() == pytest.approx([0.2 - 0.2, -0.4, 0.6]), method
    # GAE: the critic's lambda-return GAE_t + V(s_t), at its own gamma 0.9 and lambda 0.8
    # ep 0: delta_1 = 1 - (-0.4) = 1.4; delta_0 = 0 + 0.9 * (-0.4) - 0.2 = -0.56; GAE_0 = -0.56 + 0.72 * 1.4
    # ep 1: delta_0 = 0 - 0.6, so GAE_0 + V = 0
    v = turn_values(t, CreditConfig(method="gae", gae={"gamma": 0.9, "lam": 0.8}), 0.5)["value"].to_list()
    assert v == pytest.approx([-0.56 + 0.72 * 1.4 + 0.2, 1.4 - 0.4, 0.0])


def pairs_of(table, cfg, **kw):
    return build_pairs(table, values(table), cfg, **kw).table


def keyed(pairs, what="margin"):
    return {(r["chosen_episode"], r["chosen_step"], r["rejected_episode"], r["rejected_step"]): r[what]
            for r in pairs.iter_rows(named=True)}


def test_pairs_of_a_hand_made_iteration():
    cfg = StepDpoSettings(min_gap=0.0, margin_form="linear", margin_scale=2.0)
    pairs = pairs_of(ITER, cfg)
    got = {k: (v, m) for (k, v), m in zip(keyed(pairs, "gap").items(), pairs["margin"].to_list(), strict=True)}
    # state 10: up (0.25, ep 0), up (0, ep 1), left (0.5, ep 2), invalid (0, ep 3). Same action never pairs (the
    # two ups); every other pair with a gap: left > up(0.25), left > up(0), left > invalid, up(0.25) > invalid.
    # State 11: down (0.5) > left (0)
    assert got == {(2, 0, 0, 0): (0.25, 0.5), (2, 0, 1, 0): (0.5, 1.0), (2, 0, 3, 0): (0.5, 1.0),
                   (0, 0, 3, 0): (0.25, 0.5), (0, 1, 1, 1): (0.5, 1.0)}
    # the gap must exceed min_gap; the cap keeps each state's largest gaps, ties in the turns' order
    assert pairs_of(ITER, StepDpoSettings(min_gap=0.25)).height == 3
    capped = pairs_of(ITER, StepDpoSettings(max_pairs_per_state=2))
    assert capped.filter(pl.col("step_group") == 10).select("chosen_episode", "rejected_episode").rows() == [
        (2, 1), (2, 3)]
    stats = pair_stats(pairs, ITER.height, 0)
    assert stats["pairs"] == 5 and stats["share_turns_in_pair"] == 6 / 9 and stats["states_with_pairs"] == 2
    assert stats["pairs_undefined_margin"] == 0


def test_the_margin_is_learnats_log_offset_by_default():
    """LearNAT's released trainer: m = alpha * log(r_w - r_l), so a small gap gives a negative offset (the linear
    form, the project's earlier one, gave +gap); ratio: alpha * log(r_w / r_l), defined on positive rewards only."""
    got = keyed(pairs_of(ITER, StepDpoSettings()))
    assert got == pytest.approx({(2, 0, 0, 0): math.log(0.25), (2, 0, 1, 0): math.log(0.5),
                                 (2, 0, 3, 0): math.log(0.5), (0, 0, 3, 0): math.log(0.25),
                                 (0, 1, 1, 1): math.log(0.5)})
    assert got[(2, 0, 0, 0)] == pytest.approx(-1.3862944) and got[(2, 0, 0, 0)] < 0
    alpha = keyed(pairs_of(ITER, StepDpoSettings(alpha=0.5)))
    assert alpha[(0, 1, 1, 1)] == pytest.approx(0.5 * math.log(0.5))
    # ratio: only left(0.5) > up(0.25) has two positive values, log 2; the four others are counted, not made
    ratio = build_pairs(ITER, values(ITER), StepDpoSettings(margin_form="ratio"))
    assert keyed(ratio.table) == pytest.approx({(2, 0, 0, 0): math.log(2)}) and ratio.undefined == 4


def test_one_pairs_loss_by_hand_under_each_margin_form():
    """r_w = 0.75, r_l = 0.25, beta 0.5, summed log-probs: policy -2 (w) and -3 (l), reference -2.5 both, so the
    implicit reward difference is 0.5 * (0.5 - (-0.5)) = 0.5 and the loss is softplus(m - 0.5)."""
    cfg = StepDpoSettings(alpha=2.0, margin_scale=3.0)
    expect = {"log": 2.0 * math.log(0.5), "ratio": 2.0 * math.log(3.0), "linear": 3.0 * 0.5}
    for form, m in expect.items():
        margin = margin_of(form, 0.75, 0.25, cfg)
        assert margin == pytest.approx(m), form
        loss, _ = pair_loss(torch.tensor([-2.0]), torch.tensor([-3.0]), torch.tensor([-2.5]), torch.tensor([-2.5]),
                            torch.tensor([margin]), beta=0.5)
        assert float(loss[0]) == pytest.approx(math.log1p(math.exp(m - 0.5)), rel=1e-6), form
    # log form by hand: m = 2 log 0.5 = -1.3863, softplus(-1.8863) = log(1 + 0.15163) = 0.14118
    assert float(pair_loss(torch.tensor([-2.0]), torch.tensor([-3.0]), torch.tensor([-2.5]), torch.tensor([-2.5]),
                           torch.tensor([2.0 * math.log(0.5)]), beta=0.5)[0][0]) == pytest.approx(0.14118, abs=1e-5)
    # undefined: no gap, a reversed gap, a non-positive reward under ratio
    assert margin_of("log", 0.5, 0.5, cfg) is None and margin_of("linear", 0.2, 0.5, cfg) is None
    assert margin_of("ratio", 0.5, 0.0, cfg) is None and margin_of("ratio", 0.5, -0.5, cfg) is None


def test_a_crashed_episode_never_pairs():
    broken = ITER.with_columns(pl.when(pl.col("episode_id") == 2).then(pl.lit("RuntimeError: x"))
                               .otherwise(pl.col("env_error")).alias("env_error"))
    pairs = pairs_of(broken, StepDpoSettings())
    assert 2 not in pairs["chosen_episode"].to_list() + pairs["rejected_episode"].to_list()
    assert pairs.height == 2                  # up(0.25) > invalid in state 10, down > left in state 11


def test_the_oracle_margin_reads_the_similarity_of_the_state_after_each_turn():
    """r = 1 - d(s')/d(s_0), clipped, a dead state 0; the pairs are those of the values, the margin LearNAT's log
    of the rewards' gap; a pair whose chosen turn is not nearer the goal than the rejected one is not made."""
    replay = pl.DataFrame({"episode_id": [0, 0, 0, 1, 1, 2, 2, 3, 3], "step": [0, 1, 2, 0, 1, 0, 1, 0, 1],
                           "distance": [4.0, 2.0, 1.0, 4.0, 2.0, 4.0, 1.0, 4.0, 3.0],
                           "distance_after": [2.0, 1.0, 0.0, 2.0, math.inf, 1.0, 0.0, 3.0, 4.0]},
                          schema={"episode_id": pl.Int64, "step": pl.Int32, "distance": pl.Float64,
                                  "distance_after": pl.Float64})
    oracle = oracle_rewards(replay)
    assert oracle["reward"].to_list() == [0.5, 0.75, 1.0, 0.5, 0.0, 0.75, 1.0, 0.25, 0.0]
    got = build_pairs(ITER, values(ITER), StepDpoSettings(margin="oracle"), oracle)
    # state 10: left (0.75) > up ep 0 (0.5), > up ep 1 (0.5), > invalid (0.25); up ep 0 (0.5) > invalid (0.25).
    # state 11: down (0.75) > left, which ended in a dead state (0)
    assert keyed(got.table) == pytest.approx({
        (2, 0, 0, 0): math.log(0.25), (2, 0, 1, 0): math.log(0.25), (2, 0, 3, 0): math.log(0.5),
        (0, 0, 3, 0): math.log(0.25), (0, 1, 1, 1): math.log(0.75)}) and got.undefined == 0
    assert keyed(got.table, "chosen_reward")[(0, 1, 1, 1)] == 0.75
    # a chosen turn the oracle says is farther: episode 2's left now ends dead, so its three pairs are not made
    worse = oracle.with_columns(pl.when((pl.col("episode_id") == 2) & (pl.col("step") == 0)).then(0.0)
                                .otherwise(pl.col("reward")).alias("reward"))
    got = build_pairs(ITER, values(ITER), StepDpoSettings(margin="oracle"), worse)
    assert set(keyed(got.table)) == {(0, 0, 3, 0), (0, 1, 1, 1)} and got.undefined == 3
    with pytest.raises(ValueError, match="needs the environment's oracle rewards"):
        build_pairs(ITER, values(ITER), StepDpoSettings(margin="oracle"))


def tree(rows):
    """rows: (episode_id, step, step_group, action, value, parent_episode, branch_turn, shared)."""
    df = pl.DataFrame(rows, orient="row", schema={
        "episode_id": pl.Int64, "step": pl.Int32, "step_group": pl.Int64, "action": pl.String, "value": pl.Float64,
        "parent_episode": pl.Int64, "branch_turn": pl.Int32, "shared": pl.Boolean})
    return df.with_columns(pl.lit(0, pl.Int64).alias("task_group"), pl.lit(None, pl.String).alias("env_error"))


# A three-level tree of one task. Episode 0 samples a (state 1), b (state 2), c (state 3). Episode 1 branches from
# it at turn 1: it copies a and samples x in state 2, then y in state 3 (an anchor it reaches as 0 did). Episode 2
# branches from episode 1 at turn 2: it copies a and x and samples z in state 3. Values:
#   ep 0: a 1.0, b 0.0, c 0.0          ep 1: a' 0.4, x 0.6, y 0.8          ep 2: a'' 0.1, x' 0.2, z 0.9
TREE = tree([
    (0, 0, 1, "a", 1.0, None, None, False), (0, 1, 2, "b", 0.0, None, None, False),
    (0, 2, 3, "c", 0.0, None, None, False),
    (1, 0, 1, "a", 0.4, 0, 1, True), (1, 1, 2, "x", 0.6, 0, 1, False), (1, 2, 3, "y", 0.8, 0, 1, False),
    (2, 0, 1, "a", 0.1, 1, 2, True), (2, 1, 2, "x", 0.2, 1, 2, True), (2, 2, 3, "z", 0.9, 1, 2, False),
])


def tree_pairs(attribution):
    return build_pairs(TREE.drop("value"), TREE.select("episode_id", "step", "value"),
                       StepDpoSettings(margin_form="linear"), attribution=attribution).table


def test_pairs_on_a_branching_tree_treat_a_turn_and_its_copies_as_one():
    """State 1 holds a and its two copies: one turn, no pair. State 2: b (0.0) against x (0.6) and its copy x'
    (0.2). Under soft each copy keeps its value, and (x > b) is made once, through the larger gap; under hard x is
    one turn of value (0.6 + 0.2) / 2 = 0.4. State 3 has three sampled turns: c < y < z."""
    soft = keyed(tree_pairs("soft"), "gap")
    assert soft == pytest.approx({(1, 1, 0, 1): 0.6, (2, 2, 0, 2): 0.9, (1, 2, 0, 2): 0.8, (2, 2, 1, 2): 0.1})
    hard = keyed(tree_pairs("hard"), "gap")
    assert hard == pytest.approx({(1, 1, 0, 1): 0.4, (2, 2, 0, 2): 0.9, (1, 2, 0, 2): 0.8, (2, 2, 1, 2): 0.1})
    # the copies' values in the other order: soft still makes (x > b) once, never also (b > x')
    # (x' = -0.5 < b): (x > b, gap 0.6) is made and (b > x', gap 0.5), the same turns reversed, is not
    flipped = TREE.with_columns(pl.when((pl.col("episode_id") == 2) & (pl.col("step") == 1)).then(-0.5)
                                .otherwise(pl.col("value")).alias("value"))
    got = build_pairs(flipped.drop("value"), flipped.select("episode_id", "step", "value"),
                      StepDpoSettings(margin_form="linear"), attribution="soft").table
    assert got.filter(pl.col("step_group") == 2).select("chosen_episode", "rejected_episode").rows() == [(1, 0)]


def test_the_dpo_loss_by_hand():
    w, lo = torch.tensor([-2.0, -1.0]), torch.tensor([-3.0, -0.5])
    rw, rl = torch.tensor([-2.5, -1.0]), torch.tensor([-2.5, -1.0])
    loss, stats = pair_loss(w, lo, rw, rl, torch.tensor([0.1, 0.0]), beta=0.5, sft_weight=0.2)
    # pair 0: 0.5 * (0.5 - (-0.5)) - 0.1 = 0.4; pair 1: 0.5 * (0 - 0.5) - 0 = -0.25
    expect = [math.log1p(math.exp(-0.4)) + 0.2 * 2.0, math.log1p(math.exp(0.25)) + 0.2 * 1.0]
    assert loss.tolist() == pytest.approx(expect)
    assert stats["accuracy"] == 1.0 and stats["reward_margin"] == pytest.approx(0.5 - 0.25)
    assert stats["chosen_reward"] == pytest.approx(0.25 + 0.0) and stats["rejected_reward"] == pytest.approx(
        -0.25 + 0.25)


def test_one_step_raises_the_chosen_turn_against_the_rejected_one():
    model = tiny_llama(seed=3).train()
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [9, 10, 11]]
    responses = [[12, 13], [14, 15, 16], [17], [18, 19]]
    pairs = [(0, 1, 0.0), (3, 2, 0.5)]

    def sums():
        from pipeline.model.dpo import summed_logprobs

        with torch.no_grad():
            return summed_logprobs(model, prompts, responses, 0, "none").tolist()

    before = sums()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    update = UpdateConfig(epochs=1, micro_batch_size=2)
    stats = step_dpo_update(model, opt, prompts, responses, pairs, before, StepDpoSettings(beta=1.0, sft_weight=0),
                            update, 0, seed=0).stats
    after = sums()
    assert after[0] - after[1] > before[0] - before[1] and after[3] - after[2] > before[3] - before[2]
    # at the reference the implicit rewards are 0: loss -log sigmoid(-m), the mean of log 2 and softplus(0.5)
    assert stats["loss"] == pytest.approx((math.log(2) + math.log1p(math.exp(0.5))) / 2, rel=1e-5)
    assert stats["pairs"] == 2 and stats["accuracy"] == 0.0


def test_pairs_in_prefix_trees_of_a_token_budget_train_as_in_padded_passes(monkeypatch):
    import copy

    from tests.conftest import counting_packs

    model = tiny_llama(seed=3)
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [9, 10, 11], [5, 6, 2], [5, 6, 2]]
    responses = [[12, 13], [14, 15, 16], [17], [18, 19], [20], [21, 22]]
    pairs = [(0, 1, 0.0), (3, 2, 0.5), (4, 5, 0.2)]
    ref = [-3.0, -4.0, -2.0, -2.5, -1.0, -3.5]
    settings = StepDpoSettings(beta=1.0, sft_weight=1.0, minibatch_pairs=3)
    runs = {}
    for name, update in {"padded": UpdateConfig(epochs=2, micro_batch_size=2),
                         "trees": UpdateConfig(epochs=2, packing="tree", micro_batch_tokens=13)}.items():
        packs = counting_packs(monkeypatch)
        m = copy.deepcopy(model).train()
        trace = step_dpo_update(m, torch.optim.SGD(m.parameters(), lr=0.1), prompts, responses, pairs, ref, settings,
                                update, 0, seed=0).step_losses
        runs[name] = (trace, list(packs))
    # the pairs sharing 5 6 (0 and 2: 13 tokens as one tree) go together, the third alone (6): 2 trees an epoch
    assert runs["trees"][1] == [4, 2] * 2 and runs["padded"][1] == []
    assert runs["trees"][0] == pytest.approx(runs["padded"][0], rel=1e-5) and len(runs["padded"][0]) == 2


def test_step_dpo_is_refused_with_several_update_processes_or_off_policy():
    with pytest.raises(ValueError, match="step_dpo runs in one process"):
        Params(update={"objective": "step_dpo"}, runtime={"update_processes": 2})
    with pytest.raises(ValueError, match="loop.off_policy_lag: 0"):
        Params(update={"objective": "step_dpo"}, loop={"off_policy_lag": 1})
    assert np.isclose(Params(update={"objective": "step_dpo"}).update.step_dpo.beta, 0.1)


def test_a_broken_pairs_table_is_refused_by_the_update(tmp_path):
    """The update reads iter_<i>/pairs.parquet against the step table: a pair naming a turn the steps lack, a
    non-finite margin and a missing column are each refused with the file and what is wrong."""
    from pipeline.data import paths, tables
    from stages.update import read_pairs
    from tests.unit.test_tables import steps_frame

    class Job:
        def path(self, template):
            return tmp_path / {paths.PAIRS: "pairs.parquet", paths.STEPS: "steps.parquet"}[template]

    tables.write_table(steps_frame(), tmp_path / "steps.parquet", tables.STEPS)    # episodes 0 and 1, steps 0-2
    good = pl.DataFrame({"task_group": [7], "step_group": [3], "chosen_episode": [1], "chosen_step": [1],
                         "rejected_episode": [0], "rejected_step": [1], "chosen_value": [1.0],
                         "rejected_value": [0.0], "gap": [1.0], "chosen_reward": [1.0], "rejected_reward": [0.0],
                         "margin": [0.5]})
    tables.write_table(good, tmp_path / "pairs.parquet", tables.PAIRS)
    got = read_pairs(Job())
    assert got.triples == [(1, 0, 0.5)] and got.prompts == [[1, 2], [1, 2]]     # turns in (episode, step) order
    tables.write_table(good.with_columns(pl.lit(4, pl.Int64).alias("rejected_episode")), tmp_path / "pairs.parquet",
                       tables.PAIRS)
    with pytest.raises(ValueError, match=r"pairs.parquet: pairs name turns that \S*steps.parquet does not hold; "
                                         r"rerun the pairs stage"):
        read_pairs(Job())
    good.with_columns(pl.lit(float("nan")).alias("margin")).write_parquet(tmp_path / "pairs.parquet")
    with pytest.raises(tables.TableError, match=r"pairs.parquet: column 'margin' holds nan"):
        read_pairs(Job())
    good.drop("gap").write_parquet(tmp_path / "pairs.parquet")
    with pytest.raises(tables.TableError, match=r"pairs.parquet: column 'gap' is missing"):
        read_pairs(Job())
