"""Properties of the estimators on random step tables (docs/credit-assignment.md, GiGPO and Terms), with Hypothesis."""


import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config.params import METHOD_NAMES, CreditConfig, load_params
from pipeline.credit.base import discounted_returns
from pipeline.credit.grouping import build_groups
from pipeline.credit.methods import METHODS, compute_advantages
from pipeline.credit.naive import gigpo_naive
from tests.conftest import ROOT

episode = st.tuples(
    st.lists(st.sampled_from("abcde"), min_size=1, max_size=6),                       # anchors
    st.lists(st.sampled_from([-1.0, -0.1, 0.0, 0.5, 1.0, 10.0]), min_size=6, max_size=6),  # rewards
    st.lists(st.booleans(), min_size=6, max_size=6),                                 # action_valid
)
tables = st.lists(st.lists(episode, min_size=1, max_size=4), min_size=1, max_size=3)  # task groups of episodes


def build(groups, distinct_anchors: bool = False) -> pl.DataFrame:
    rows = []
    eid = 0
    for g, eps in enumerate(groups):
        for anchors, rewards, valid in eps:
            for t, s in enumerate(anchors):
                rows.append({"episode_id": eid, "step": t, "task_group": g,
                             "anchor": f"{eid}:{t}" if distinct_anchors else s,
                             "reward": rewards[t], "action_valid": valid[t], "score": rewards[t] / 3 + t / 7})
            eid += 1
    steps = pl.DataFrame(rows).with_columns(pl.col("step").cast(pl.Int32))
    return steps.join(build_groups(steps, 3).drop("task_group"), on=["episode_id", "step"])


def cfg(method, episode=None, **section):
    return CreditConfig.model_validate({"method": method, method: section, "episode": episode or {}})


def adv(df, c, col="advantage"):
    return compute_advantages(df, c)[col].to_list()


@settings(max_examples=60, deadline=None)
@given(tables, st.sampled_from(["mean_norm", "mean_std_norm"]), st.sampled_from(["per_episode", "per_turn"]))
def test_gigpo_with_weight_zero_is_grpo(groups, mode, stats):
    df = build(groups)
    episode = {"mode": mode, "episode_stats": stats}
    g = adv(df, cfg("gigpo", episode, step_advantage_w=0.0))
    assert g == pytest.approx(adv(df, cfg("grpo", episode)), abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(tables, st.sampled_from(["mean_norm", "mean_std_norm"]))
def test_gigpo_with_every_anchor_distinct_is_grpo(groups, mode):
    df = build(groups, distinct_anchors=True)
    episode = {"mode": mode}
    assert adv(df, cfg("gigpo", episode, mode=mode)) == pytest.approx(adv(df, cfg("grpo", episode)), abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(tables)
def test_gigpo_mean_norm_step_advantages_sum_to_zero_in_each_step_group(groups):
    df = build(groups)
    out = compute_advantages(df, cfg("gigpo", mode="mean_norm")).join(
        df.select("episode_id", "step", "step_group", "step_group_size"), on=["episode_id", "step"])
    sums = out.filter(pl.col("step_group_size") > 1).group_by("step_group").agg(pl.col("step_advantage").sum())
    assert sums["step_advantage"].abs().max() is None or sums["step_advantage"].abs().max() < 1e-9
    assert (out.filter(pl.col("step_group_size") == 1)["step_advantage"] == 0).all()


@settings(max_examples=30, deadline=None)
@given(tables, st.sampled_from(METHOD_NAMES), st.integers(0, 2**31 - 1))
def test_shuffling_rows_changes_no_advantage(groups, method, seed):
    df = build(groups)
    c = cfg(method)
    base = compute_advantages(df, c)
    shuffled = compute_advantages(df.sample(fraction=1.0, shuffle=True, seed=seed), c)
    assert base["episode_id"].to_list() == shuffled["episode_id"].to_list()
    assert base["advantage"].to_list() == pytest.approx(shuffled["advantage"].to_list(), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(tables, st.sampled_from(["mean_norm", "mean_std_norm"]), st.sampled_from(["per_episode", "per_turn"]),
       st.floats(0.0, 1.0))
def test_gigpo_equals_the_per_row_reference(groups, mode, stats, gamma):
    df = build(groups)
    out = compute_advantages(df, cfg("gigpo", {"mode": mode, "episode_stats": stats}, mode=mode, gamma=gamma))
    ref = gigpo_naive(df.to_dicts(), mode, mode, stats, gamma, 1.0, 0.1)
    got = {(r["episode_id"], r["step"]): r["advantage"] for r in out.iter_rows(named=True)}
    assert got == pytest.approx(ref, abs=1e-9)


SHIPPED = load_params(ROOT / "params.yaml").credit


@settings(max_examples=40, deadline=None)
@given(tables)
def test_shipped_params_give_every_method_grpos_episode_term(groups):
    """docs/credit-assignment.md, Episode level, shared: under params.yaml every method with an episode term has GRPO's,
    so methods differ only in their step-level credit; with the step weight at 0 they are GRPO exactly. RLOO is
    the one method whose episode term is its own (its definition is its baseline)."""
    df = build(groups)
    grpo = compute_advantages(df, SHIPPED.model_copy(update={"method": "grpo"}))
    for name, method in METHODS.items():
        if method.own_episode_term:      # RLOO's baseline, IGPO's outcome reward
            continue
        shipped = SHIPPED
        if not getattr(getattr(SHIPPED, name), "episode_term", True):   # GAE: none unless asked (pure PPO)
            out = compute_advantages(df, SHIPPED.model_copy(update={"method": name}))
            assert (out["episode_advantage"] == 0).all(), name
            section = getattr(SHIPPED, name).model_copy(update={"episode_term": True})
            shipped = SHIPPED.model_copy(update={name: section})
        out = compute_advantages(df, shipped.model_copy(update={"method": name}))
        assert out["episode_advantage"].to_list() == grpo["episode_advantage"].to_list(), name
        if method.step_weight is None:
            assert (out["step_advantage"] == 0).all(), name
            continue
        section = getattr(shipped, name).model_copy(update={method.step_weight: 0.0})
        zero = compute_advantages(df, shipped.model_copy(update={"method": name, name: section}))
        assert zero["advantage"].to_list() == grpo["advantage"].to_list(), name
        assert (zero["step_advantage"] == 0).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(-5, 5), min_size=1, max_size=8), min_size=1, max_size=6), st.floats(0.0, 1.0))
def test_discounted_returns_match_the_recursion(episodes, gamma):
    ids, steps, rewards, expected = [], [], [], []
    for e, rs in enumerate(episodes):
        G, back = 0.0, []
        for r in reversed(rs):
            G = r + gamma * G
            back.append(G)
        for t, r in enumerate(rs):
            ids.append(e), steps.append(t), rewards.append(r)
        expected.extend(reversed(back))
    import numpy as np

    order = np.random.default_rng(0).permutation(len(ids))
    got = discounted_returns(np.array(ids)[order], np.array(steps)[order], np.array(rewards)[order], gamma)
    back_to_sorted = np.empty_like(got)
    back_to_sorted[order] = got
    assert back_to_sorted.tolist() == pytest.approx(expected, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["the kitchen. a fridge", "the kitchen. a fridge!",
                                                              "a dark cellar", "a dark cellar.", "x" * 30,
                                                              "x" * 29 + "y", ""])), min_size=1, max_size=40),
       st.sampled_from([0.5, 0.9, 0.95, 1.0]))
def test_similarity_grouping_equals_the_per_pair_reference(rows, threshold):
    from bench.similarity import same_partition
    from pipeline.credit.grouping import similarity_groups
    from pipeline.credit.naive import similarity_groups_naive

    df = pl.DataFrame({"episode_id": list(range(len(rows))), "step": [0] * len(rows),
                       "task_group": [g for g, _ in rows], "anchor": [a for _, a in rows]})
    ref = similarity_groups_naive(df.to_dicts(), threshold)
    got = similarity_groups(df, threshold).to_list()
    assert same_partition(got, [ref[(e, 0)] for e in range(len(rows))])
