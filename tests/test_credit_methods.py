"""Every advantage method on one hand-computed table (credit-assignment.md: RLOO, GiGPO, HGPO, OPRL, SPA;
Invalid actions), plus the group stage's keys on it.

The table (γ = 0.5 wherever a method discounts, invalid penalty 0.1):

    task group 0                                    task group 1 (every episode succeeds)
    ep 0: a -> b -> c        rewards 0, 0, 1  (R 1)   ep 3: x -> y   rewards 0, 1 (R 1)
    ep 1: a -> d -> d -> b   rewards 0 (R 0); turn 1 invalid, a no-op, so state d is revisited
    ep 2: a -> b             rewards 0 (R 0)         ep 4: x        reward 1 (R 1)

Step groups: a {0.0, 1.0, 2.0}, b {0.1, 1.3, 2.1}, d {1.1, 1.2}, x {3.0, 4.0}; c and y are singletons.
Discounted returns G: ep 0: 0.25, 0.5, 1; ep 3: 0.5, 1; ep 4: 1; all others 0 (ep 1 turn 1 scores -0.1).
"""

import math

import polars as pl
import pytest

from pipeline.config import CreditConfig
from pipeline.credit import EPS, compute_advantages
from pipeline.grouping import build_groups

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


def advantages(method: str, column: str = "advantage", **section) -> dict:
    cfg = CreditConfig.model_validate({"method": method, "invalid_penalty": 0.1, method: section})
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
    import pipeline.grouping as grouping

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
    # A^S: a: G (0.25, 0, 0), mean 1/12; b: G (0.5, 0, 0), mean 1/6; d: (-0.1, 0), mean -0.05; x: (0.5, 1).
    expected = {
        (0, 0): 2 / 3 + (0.25 - 1 / 12), (0, 1): 2 / 3 + (0.5 - 1 / 6), (0, 2): 2 / 3 + 0.0,
        (1, 0): -1 / 3 - 1 / 12, (1, 1): -1 / 3 - 0.1 + (-0.1 + 0.05), (1, 2): -1 / 3 + 0.05,
        (1, 3): -1 / 3 - 1 / 6,
        (2, 0): -1 / 3 - 1 / 12, (2, 1): -1 / 3 - 1 / 6,
        (3, 0): 0 - 0.25, (3, 1): 0.0, (4, 0): 0 + 0.25,
    }
    assert a == pytest.approx(expected)
    s = advantages("gigpo", "step_advantage", gamma=0.5)
    assert s[(0, 2)] == 0.0 and s[(3, 1)] == 0.0                   # singleton step groups


def test_gigpo_mean_std_norm_and_weight():
    a = advantages("gigpo", gamma=0.5, mode="mean_std_norm", step_advantage_w=2.0)
    ae = (2 / 3) / (math.sqrt(1 / 3) + EPS)                         # A^E of ep 0, unbiased std of (1, 0, 0)
    std_a = math.sqrt(((0.25 - 1 / 12) ** 2 + 2 * (1 / 12) ** 2) / 2)  # unbiased std of (0.25, 0, 0)
    assert a[(0, 0)] == pytest.approx(ae + 2 * (0.25 - 1 / 12) / (std_a + EPS))
    std_d = math.sqrt(2 * 0.05 ** 2 / 1)
    ae1 = (-1 / 3) / (math.sqrt(1 / 3) + EPS)
    assert a[(1, 1)] == pytest.approx(ae1 - 0.1 + 2 * (-0.05) / (std_d + EPS))
    assert a[(3, 0)] == pytest.approx(0 + 2 * (-0.25) / (math.sqrt(2 * 0.25 ** 2) + EPS))


def test_gigpo_similarity_grouping_merges_near_identical_anchors():
    t = table().with_columns(
        pl.when(pl.col("anchor") == "c").then(pl.lit("a")).otherwise(pl.col("anchor")).alias("anchor"))
    cfg = CreditConfig.model_validate({"method": "gigpo", "gigpo": {"gamma": 0.5, "similarity_threshold": 1.0}})
    exact = compute_advantages(t.drop("step_group").with_columns(
        pl.struct("task_group", "anchor").rank("dense").alias("step_group")), cfg.model_copy(
            update={"gigpo": cfg.gigpo.model_copy(update={"similarity_threshold": None})}))
    assert compute_advantages(t, cfg)["advantage"].to_list() == pytest.approx(exact["advantage"].to_list())
    # long anchors that differ in one character of 40 (ratio 0.975) merge at 0.95, not at 0.99
    from pipeline.grouping import similarity_groups

    frame = pl.DataFrame({"episode_id": [1, 2, 3], "step": [0, 0, 0], "task_group": [0, 0, 0],
                          "anchor": ["#" * 39 + "a", "#" * 39 + "b", "x" * 40]})
    assert similarity_groups(frame, 0.95).to_list() == [0, 0, 1]
    assert similarity_groups(frame, 0.99).to_list() == [0, 1, 2]


def test_hgpo():
    a = advantages("hgpo", gamma=0.5)
    # population std; weights w_k = k + 1 over the non-singleton depths k = 1..3
    s_a = math.sqrt(((0.25 - 1 / 12) ** 2 + 2 * (1 / 12) ** 2) / 3)   # a at every depth: G (0.25, 0, 0)
    s_b = math.sqrt(((0.5 - 1 / 6) ** 2 + 2 * (1 / 6) ** 2) / 3)      # b at depth 1: G (0.5, 0, 0)
    a_b1, a_b23 = (1 / 3) / (s_b + EPS), 0.25 / (0.25 + EPS)         # depths 2, 3: (0.5, 0) for eps 0 and 2
    expected = {
        (0, 0): (1 / 6) / (s_a + EPS),
        (0, 1): (2 * a_b1 + 3 * a_b23 + 4 * a_b23) / 9,
        (2, 1): (2 * -(1 / 6) / (s_b + EPS) - 7 * a_b23) / 9,
        (1, 3): -(1 / 6) / (s_b + EPS),                              # (b, d) and (b, d, d) are singletons
        (1, 1): -0.05 / (0.05 + EPS), (1, 2): 0.05 / (0.05 + EPS),  # depth 1 only
        (0, 2): 0.0, (3, 1): 0.0,                                    # singletons at every depth
        (3, 0): -0.25 / (0.25 + EPS), (4, 0): 0.25 / (0.25 + EPS),
        (1, 0): -(1 / 12) / (s_a + EPS), (2, 0): -(1 / 12) / (s_a + EPS),
    }
    assert a == pytest.approx(expected)
    with_base = advantages("hgpo", gamma=0.5, base_group=True, episode_mode="mean_norm")
    assert with_base[(0, 0)] == pytest.approx(2 / 3 + expected[(0, 0)])
    assert with_base[(1, 1)] == pytest.approx(-1 / 3 - 0.1 + expected[(1, 1)])
    assert with_base[(4, 0)] == pytest.approx(expected[(4, 0)])


def test_oprl():
    a = advantages("oprl")
    # group 0 step values r_phi - penalty: 0.3 0.1 0.2 | 0 -0.3 0 0.1 | 0.1 0: mean 1/18, unbiased std 1/6
    ae0, ae1 = (2 / 3) / (math.sqrt(1 / 3) + EPS), (-1 / 3) / (math.sqrt(1 / 3) + EPS)
    assert a[(0, 0)] == pytest.approx(ae0 + (0.3 - 1 / 18) / (1 / 6 + EPS))
    assert a[(1, 1)] == pytest.approx(ae1 - 0.1 + (-0.3 - 1 / 18) / (1 / 6 + EPS))
    assert a[(2, 1)] == pytest.approx(ae1 + (0 - 1 / 18) / (1 / 6 + EPS))
    # group 1: (0.2, 0.2, 0.4), mean 4/15, unbiased std sqrt(1/75); A^E 0
    s1 = math.sqrt(((0.2 - 4 / 15) ** 2 * 2 + (0.4 - 4 / 15) ** 2) / 2)
    assert a[(4, 0)] == pytest.approx((0.4 - 4 / 15) / (s1 + EPS))
    assert a[(3, 1)] == pytest.approx((0.2 - 4 / 15) / (s1 + EPS))
    half = advantages("oprl", alpha=0.5, episode_mode="mean_norm")
    assert half[(0, 0)] == pytest.approx(2 / 3 + 0.5 * (0.3 - 1 / 18) / (1 / 6 + EPS))


def test_spa():
    a = advantages("spa", gamma=0.5, mode="mean_norm", episode_mode="mean_norm")
    # r = c + 0.5 * valid. ep 0: (0.8, 0.6, 0.7) -> G (1.275, 0.95, 0.7)
    # ep 1: (0.5, -0.2, 0.5, 0.6) -> G (0.6, 0.2, 0.8, 0.6), turn 1 penalised to 0.1; ep 2: (0.6, 0.5) -> (0.85, 0.5)
    m0 = (1.275 + 0.95 + 0.7 + 0.6 + 0.1 + 0.8 + 0.6 + 0.85 + 0.5) / 9
    assert a[(0, 0)] == pytest.approx(2 / 3 + 1.275 - m0)
    assert a[(1, 1)] == pytest.approx(-1 / 3 - 0.1 + 0.1 - m0)
    assert a[(2, 0)] == pytest.approx(-1 / 3 + 0.85 - m0)
    # group 1: ep 3 (0.7, 0.7) -> (1.05, 0.7); ep 4: 0.9
    m1 = (1.05 + 0.7 + 0.9) / 3
    assert a[(4, 0)] == pytest.approx(0.9 - m1) and a[(3, 0)] == pytest.approx(1.05 - m1)
    scores = advantages("spa", "step_score", gamma=0.5)
    assert scores[(0, 0)] == pytest.approx(1.275) and scores[(1, 1)] == pytest.approx(0.1)
    no_ground = advantages("spa", "step_score", gamma=0.5, grounding_w=0.0, progress_w=2.0)
    # ep 1 with r = 2c: (0, -0.4, 0, 0.2) -> G_1 = -0.4 + 0.5 * (0 + 0.5 * 0.2) = -0.35, penalised -0.45
    assert no_ground[(4, 0)] == pytest.approx(0.8) and no_ground[(1, 1)] == pytest.approx(-0.35 - 0.1)


def test_episode_level_methods_have_no_step_score():
    for method in ("grpo", "rloo"):
        assert set(advantages(method, "step_score").values()) == {None}
        assert set(advantages(method, "step_advantage").values()) == {0.0}


def test_missing_column_is_named():
    cfg = CreditConfig(method="oprl")
    with pytest.raises(ValueError, match=r"oprl.*\['score'\]"):
        compute_advantages(table().drop("score"), cfg)
