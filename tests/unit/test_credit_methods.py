"""Every advantage method on one hand-computed table (docs/credit-assignment.md: RLOO, GiGPO, HGPO, OPRL, SPA;
Invalid actions; Episode level, shared), plus the group stage's keys on it.

The table (γ = 0.5 wherever a method discounts, invalid penalty 0.1, subtracted from the invalid turn's final
advantage only):

    task group 0                                    task group 1 (every episode succeeds)
    ep 0: a -> b -> c        rewards 0, 0, 1  (R 1)   ep 3: x -> y   rewards 0, 1 (R 1)
    ep 1: a -> d -> d -> b   rewards 0 (R 0); turn 1 invalid, a no-op, so state d is revisited
    ep 2: a -> b             rewards 0 (R 0)         ep 4: x        reward 1 (R 1)

Step groups: a {0.0, 1.0, 2.0}, b {0.1, 1.3, 2.1}, d {1.1, 1.2}, x {3.0, 4.0}; c and y are singletons.
Discounted returns G: ep 0: 0.25, 0.5, 1; ep 3: 0.5, 1; ep 4: 1; all others 0.
"""

import math

import polars as pl
import pytest

from pipeline.config.params import METHOD_NAMES, CreditConfig
from pipeline.credit.base import EPS
from pipeline.credit.grouping import build_groups
from pipeline.credit.methods import compute_advantages

EPISODES = {  # episode: (task_group, anchors, rewards, valid)
    0: (0, "abc", [0, 0, 1], [True] * 3),
    1: (0, "addb", [0, 0, 0, 0], [True, False, True, True]),
    2: (0, "ab", [0, 0], [True] * 2),
    3: (1, "xy", [0, 1], [True] * 2),
    4: (1, "x", [1], [True]),
}
SCORES = {  # fit-stage scores for OPRL (r_phi) and SPA (c_t)
    0: [0.3, 0.1, 0.2], 1: [0.0, -0.2, 0.0, 0.1], 2: [0.1, 0.0], 3: [0.2, 0.2], 4: [0.4],
}


def table(depth: int = 3) -> pl.DataFrame:
    rows = []
    for e, (g, anchors, rewards, valid) in EPISODES.items():
        for t, (s, r, v) in enumerate(zip(anchors, rewards, valid, strict=True)):
            rows.append({"episode_id": e, "step": t, "task_group": g, "anchor": s, "reward": float(r),
                         "action_valid": v, "score": SCORES[e][t]})
    steps = pl.DataFrame(rows).with_columns(pl.col("step").cast(pl.Int32))
    groups = build_groups(steps, depth).drop("task_group")
    return steps.join(groups, on=["episode_id", "step"])


PER_EPISODE_MEAN = {"mode": "mean_norm", "episode_stats": "per_episode"}   # A^E = R - 1/3 in group 0, 0 in 1
PER_EPISODE_STD = {"mode": "mean_std_norm", "episode_stats": "per_episode"}
AE0, AE1 = (2 / 3) / (math.sqrt(1 / 3) + EPS), (-1 / 3) / (math.sqrt(1 / 3) + EPS)  # PER_EPISODE_STD, group 0


def advantages(method: str, column: str = "advantage", episode: dict = PER_EPISODE_MEAN, penalty: float = 0.1,
               **section) -> dict:
    cfg = CreditConfig.model_validate({"method": method, "invalid_penalty": penalty, "episode": episode,
                                       method: section})
    out = compute_advantages(table(), cfg)
    return {(r["episode_id"], r["step"]): r[column] for r in out.iter_rows(named=True)}


def test_group_keys():
    df = table().sort("episode_id", "step")
    sg = {(r["episode_id"], r["step"]): r["step_group"] for r in df.iter_rows(named=True)}
    size = {(r["episode_id"], r["step"]): r["step_group_size"] for r in df.iter_rows(named=True)}
    assert sg[(0, 0)] == sg[(1, 0)] == sg[(2, 0)] and size[(0, 0)] == 3
    assert sg[(0, 1)] == sg[(1, 3)] == sg[(2, 1)] and size[(1, 3)] == 3
    assert sg[(1, 1)] == sg[(1, 2)] and size[(1, 2)] == 2          # the revisit within one episode
    assert size[(0, 2)] == 1 and size[(3, 1)] == 1                  # singletons c, y
    assert sg[(3, 0)] == sg[(4, 0)] != sg[(0, 0)]
    hg = {(r["episode_id"], r["step"]): r["history_groups"] for r in df.iter_rows(named=True)}
    assert all(len(v) == 3 for v in hg.values())
    # depth 2 and 3: (b, a) and (b, a, start) join ep 0 and ep 2; (b, d) and (b, d, d) leave ep 1 alone
    assert hg[(0, 1)][1] == hg[(2, 1)][1] != hg[(1, 3)][1]
    assert hg[(0, 1)][2] == hg[(2, 1)][2] != hg[(1, 3)][2]
    # first turns share their keys at every depth ("before the start" padding)
    assert hg[(0, 0)] == hg[(1, 0)] == hg[(2, 0)]
    assert hg[(1, 1)][1] != hg[(1, 2)][1]                           # (d, a) vs (d, d)



def test_hash_collision_between_different_anchors_is_an_error(monkeypatch):
    import pipeline.credit.grouping as grouping

    monkeypatch.setattr(grouping.xxhash, "xxh3_64_intdigest", lambda b: 42)   # every string collides
    with pytest.raises(grouping.AnchorCollisionError, match=r"'a'.*'b'.*share hash 42"):
        build_groups(pl.DataFrame({"episode_id": [0, 0], "step": [0, 1], "task_group": [0, 0],
                                   "anchor": ["a", "b"]}))
    # the same string many times is no collision
    out = build_groups(pl.DataFrame({"episode_id": [0, 1], "step": [0, 0], "task_group": [0, 0],
                                     "anchor": ["a", "a"]}))
    assert out["step_group_size"].to_list() == [2, 2]

def test_rloo():
    a = advantages("rloo")
    # group 0: R = 1, 0, 0. ep 0: 1 - mean(0, 0) = 1; ep 1, 2: 0 - mean(1, 0) = -0.5. Group 1: 1 - 1 = 0.
    assert a[(0, 0)] == a[(0, 2)] == pytest.approx(1.0)
    assert a[(1, 0)] == a[(2, 1)] == pytest.approx(-0.5)
    assert a[(1, 1)] == pytest.approx(-0.6)                         # invalid: -0.5 - 0.1
    assert a[(3, 0)] == a[(4, 0)] == 0.0


def test_gigpo_mean_norm():
    a = advantages("gigpo", gamma=0.5)
    # A^E = R - 1/3 in group 0 (2/3, -1/3, -1/3), 0 in group 1.
    # A^S: a: G (0.25, 0, 0), mean 1/12; b: G (0.5, 0, 0), mean 1/6; d: (0, 0), mean 0; x: (0.5, 1).
    # The invalid turn (1, 1) gets -0.1 on top and changes no group statistic: d's other turn gets 0.
    expected = {
        (0, 0): 2 / 3 + (0.25 - 1 / 12), (0, 1): 2 / 3 + (0.5 - 1 / 6), (0, 2): 2 / 3 + 0.0,
        (1, 0): -1 / 3 - 1 / 12, (1, 1): -1 / 3 - 0.1, (1, 2): -1 / 3, (1, 3): -1 / 3 - 1 / 6,
        (2, 0): -1 / 3 - 1 / 12, (2, 1): -1 / 3 - 1 / 6,
        (3, 0): 0 - 0.25, (3, 1): 0.0, (4, 0): 0 + 0.25,
    }
    assert a == pytest.approx(expected)
    s = advantages("gigpo", "step_advantage", gamma=0.5)
    assert s[(0, 2)] == 0.0 and s[(3, 1)] == 0.0                   # singleton step groups
    assert s[(1, 1)] == 0.0 and s[(1, 2)] == 0.0                   # the penalty is not a step-group statistic
    assert advantages("gigpo", "penalty", gamma=0.5) == {k: (0.1 if k == (1, 1) else 0.0) for k in expected}


def test_gigpo_mean_std_norm_and_weight():
    a = advantages("gigpo", episode=PER_EPISODE_STD, gamma=0.5, mode="mean_std_norm", step_advantage_w=2.0)
    std_a = math.sqrt(((0.25 - 1 / 12) ** 2 + 2 * (1 / 12) ** 2) / 2)  # unbiased std of (0.25, 0, 0)
    assert a[(0, 0)] == pytest.approx(AE0 + 2 * (0.25 - 1 / 12) / (std_a + EPS))
    assert a[(1, 1)] == pytest.approx(AE1 - 0.1)                  # d: (0, 0) has no spread
    assert a[(3, 0)] == pytest.approx(0 + 2 * (-0.25) / (math.sqrt(2 * 0.25 ** 2) + EPS))


def test_penalty_is_applied_once_after_normalisation_and_acts_linearly():
    """docs/credit-assignment.md, Invalid actions: every method's advantage moves by exactly -p on the invalid turn and
    not at all elsewhere, whatever the normalisation mode (its size would not matter inside a std norm)."""
    for method in METHOD_NAMES:
        section = {"mode": "mean_std_norm"} if method == "gigpo" else {}
        base = advantages(method, episode=PER_EPISODE_STD, penalty=0.0, **section)
        for p in (0.001, 0.1, 0.7):
            moved = advantages(method, episode=PER_EPISODE_STD, penalty=p, **section)
            assert {k: moved[k] - base[k] for k in base} == pytest.approx(
                {k: (-p if k == (1, 1) else 0.0) for k in base}, abs=1e-12), (method, p)


def test_one_invalid_turn_among_equal_step_values_only_loses_the_penalty():
    """The spec's measured case: r_phi = 0 everywhere (OPRL at iteration 1), one invalid turn among 10. Inside a
    std normalisation the penalty made it -2.85 and every valid turn +0.32; now only the invalid turn moves."""
    rows = [{"episode_id": e, "step": t, "task_group": 0, "reward": 0.0, "action_valid": (e, t) != (1, 2),
             "score": 0.0} for e in range(2) for t in range(5)]
    df = pl.DataFrame(rows).with_columns(pl.col("step").cast(pl.Int32))
    for p in (0.001, 0.1):
        out = compute_advantages(df, CreditConfig(method="oprl", invalid_penalty=p))
        assert out["advantage"].to_list() == [0.0] * 7 + [-p] + [0.0] * 2


def test_gigpo_similarity_grouping_merges_near_identical_anchors():
    t = table().with_columns(
        pl.when(pl.col("anchor") == "c").then(pl.lit("a")).otherwise(pl.col("anchor")).alias("anchor"))
    cfg = CreditConfig.model_validate({"method": "gigpo", "gigpo": {"gamma": 0.5, "similarity_threshold": 1.0}})
    exact = compute_advantages(t.drop("step_group").with_columns(
        pl.struct("task_group", "anchor").rank("dense").alias("step_group")), cfg.model_copy(
            update={"gigpo": cfg.gigpo.model_copy(update={"similarity_threshold": None})}))
    assert compute_advantages(t, cfg)["advantage"].to_list() == pytest.approx(exact["advantage"].to_list())
    # long anchors that differ in one character of 40 (ratio 0.975) merge at 0.95, not at 0.99
    from pipeline.credit.grouping import similarity_groups

    frame = pl.DataFrame({"episode_id": [1, 2, 3], "step": [0, 0, 0], "task_group": [0, 0, 0],
                          "anchor": ["#" * 39 + "a", "#" * 39 + "b", "x" * 40]})
    assert similarity_groups(frame, 0.95).to_list() == [0, 0, 1]
    assert similarity_groups(frame, 0.99).to_list() == [0, 1, 2]


def test_hgpo():
    s = advantages("hgpo", "step_advantage", gamma=0.5)
    # population std; weights w_k = k + 1 over the non-singleton depths k = 1..3
    s_a = math.sqrt(((0.25 - 1 / 12) ** 2 + 2 * (1 / 12) ** 2) / 3)   # a at every depth: G (0.25, 0, 0)
    s_b = math.sqrt(((0.5 - 1 / 6) ** 2 + 2 * (1 / 6) ** 2) / 3)      # b at depth 1: G (0.5, 0, 0)
    a_b1, a_b23 = (1 / 3) / (s_b + EPS), 0.25 / (0.25 + EPS)         # depths 2, 3: (0.5, 0) for eps 0 and 2
    expected = {
        (0, 0): (1 / 6) / (s_a + EPS),
        (0, 1): (2 * a_b1 + 3 * a_b23 + 4 * a_b23) / 9,
        (2, 1): (2 * -(1 / 6) / (s_b + EPS) - 7 * a_b23) / 9,
        (1, 3): -(1 / 6) / (s_b + EPS),                              # (b, d) and (b, d, d) are singletons
        (1, 1): 0.0, (1, 2): 0.0,                                    # d at depth 1: G (0, 0)
        (0, 2): 0.0, (3, 1): 0.0,                                    # singletons at every depth
        (3, 0): -0.25 / (0.25 + EPS), (4, 0): 0.25 / (0.25 + EPS),
        (1, 0): -(1 / 12) / (s_a + EPS), (2, 0): -(1 / 12) / (s_a + EPS),
    }
    assert s == pytest.approx(expected)
    # base_group (default): the shared A^E is the k = 0 term of weight 1
    a = advantages("hgpo", gamma=0.5)
    assert a[(0, 0)] == pytest.approx(2 / 3 + expected[(0, 0)])
    assert a[(1, 1)] == pytest.approx(-1 / 3 - 0.1)
    assert a[(4, 0)] == pytest.approx(expected[(4, 0)])
    half = advantages("hgpo", gamma=0.5, step_advantage_w=0.5, base_group=False)
    assert half[(0, 0)] == pytest.approx(0.5 * expected[(0, 0)]) and half[(1, 1)] == pytest.approx(-0.1)
    assert set(advantages("hgpo", "episode_advantage", gamma=0.5, base_group=False).values()) == {0.0}


def test_episode_level_methods_have_no_step_score():
    for method in ("grpo", "rloo"):
        assert set(advantages(method, "step_score").values()) == {None}
        assert set(advantages(method, "step_advantage").values()) == {0.0}


def test_missing_column_is_named():
    cfg = CreditConfig(method="oprl")
    with pytest.raises(ValueError, match=r"oprl.*\['score'\]"):
        compute_advantages(table().drop("score"), cfg)
