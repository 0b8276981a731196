"""Branching rollouts (rollout.branching, docs/credit-assignment.md, Branching rollouts): ARPO's rule on hand-made
entropies, the budget, the restored states, hard attribution, the tables' columns, bytes on a rerun.

A scripted sampler makes the tree exact: it answers with a move chosen by the turn's seed and reports the entropy a
test sets for each turn; the environment is real Sokoban."""

import re

import polars as pl
import pyarrow as pa
import pytest
import torch

from pipeline.config.params import Params, ParamsError, load_params
from pipeline.credit.grouping import build_groups
from pipeline.data import tables
from pipeline.envs.sokoban import SokobanEnv
from pipeline.model.policy import EntropySpec, Generation, encode_prompt, generate, load_policy
from pipeline.rollout.branching import (
    ReplayError,
    attribute,
    branch_draw,
    branch_point_groups,
    copies_to_branch,
    rollout_counts,
)
from pipeline.rollout.episodes import Branching, EpisodeSpec, play_episodes

MOVES = ["up", "down", "left", "right"]


class Scripted:
    """A sampler: the move of each response comes from its seed; `entropy(turn)` is the entropy it reports for a
    response at that turn of its episode (read from the prompt's "Turn k state" line)."""
    name = "scripted"

    def __init__(self, entropy=lambda turn: 0.0):
        self.entropy = entropy
        self.batches: list[int] = []

    def __call__(self, prompt_ids, max_new_tokens, temperature, seed, entropy=None):
        self.batches.append(len(prompt_ids))
        return [Generation([1, 2], [-0.5, -0.25], f"<action>{MOVES[s % 4]}</action>", self.entropy(turn))
                for (turn, _), s in zip(prompt_ids, seed)]


def scripted_encode(monkeypatch):
    import pipeline.rollout.episodes as episodes

    monkeypatch.setattr(episodes, "HFSampler", Scripted)   # the player takes a Scripted as a sampler
    monkeypatch.setattr(episodes, "encode_prompt",
                        lambda tok, prompt: [int(re.findall(r"Turn (\d+) state", prompt)[-1]) - 1, 0])


def specs(tasks: int, m: int) -> list[EpisodeSpec]:
    return [EpisodeSpec(100 + t, t, t * 1000 + g) for t in range(tasks) for g in range(m)]


def play(sampler, make_env, branching, n_tasks=2, batch_size=8, seed=0, max_turns=5, progress=None):
    env = make_env or (lambda: SokobanEnv(max_turns=max_turns))
    return play_episodes(sampler, None, env, specs(n_tasks, branching.group_size if branching else 4),
                         history_turns=2, max_new_tokens=4, temperature=1.0, batch_size=batch_size, seed=seed,
                         branching=branching, progress=progress)


def tree(steps: pl.DataFrame) -> dict[int, tuple]:
    eps = steps.group_by("episode_id").agg(pl.col("parent_episode").first(), pl.col("branch_turn").first(),
                                           pl.col("shared").sum(), pl.len())
    return {r["episode_id"]: (r["parent_episode"], r["branch_turn"], r["shared"], r["len"])
            for r in eps.iter_rows(named=True)}


def test_arpo_rule_on_hand_made_entropies():
    draws = [0.3, 0.6, 0.9]   # clip(U - 0.2 dH, 0, 1) <= 0.5
    assert copies_to_branch(draws, 0.0, 0.2, 0.5) == 1          # 0.3 only
    assert copies_to_branch(draws, 1.0, 0.2, 0.5) == 2          # 0.1, 0.4 (0.7 does not)
    assert copies_to_branch(draws, -2.0, 0.2, 0.5) == 0         # 0.7, 1.0, 1.0 after the clip
    assert copies_to_branch(draws, 5.0, 0.2, 0.5) == 3          # all clipped to 0
    assert copies_to_branch([0.5], 0.0, 0.2, 0.5) == 1          # <= tau branches
    u = [branch_draw(7, 1000, 2, c) for c in range(3)]
    assert u == [branch_draw(7, 1000, 2, c) for c in range(3)] and len(set(u)) == 3
    assert u != [branch_draw(8, 1000, 2, c) for c in range(3)]


def test_entropy_rise_decides_which_paths_branch(monkeypatch):
    """tau 0, beta 1: a copy branches exactly when its path's entropy rose by at least 1 since its first turn
    (U < dH), whatever U. The entropy jumps at turn 2 only, so after turn 2 each global path of a task hands one copy
    to the budget's next episode, in order; the branches (first turn 3, entropy 0 from then on) never branch."""
    scripted_encode(monkeypatch)
    b = Branching("entropy", 5, 4, 2, 2, 0.0, 1.0, EntropySpec(20, 10, 400))
    steps = play(Scripted(lambda turn: 5.0 if turn == 2 else 0.0), None, b)
    assert tree(steps) == {0: (None, None, 0, 5), 1: (None, None, 0, 5), 2: (0, 3, 3, 5), 3: (1, 3, 3, 5),
                           1000: (None, None, 0, 5), 1001: (None, None, 0, 5), 1002: (1000, 3, 3, 5),
                           1003: (1001, 3, 3, 5)}
    # a branch's first three turns are its parent's rows, its own turns are sampled with its own seeds
    own = ["prompt_ids", "response", "action", "reward", "observation", "anchor"]
    parent, child = steps.filter(pl.col("episode_id") == 0), steps.filter(pl.col("episode_id") == 2)
    assert child.head(3).select(own).equals(parent.head(3).select(own))
    assert child["observation"][3] == parent["observation"][3]           # the same state at the branch point
    assert child["shared"].to_list() == [True, True, True, False, False]
    # no rise (or a fall): nothing branches; each task's paths end, and one more global trajectory starts a round
    flat = play(Scripted(lambda turn: -3.0 if turn == 2 else 0.0), None, b)
    assert {e: t[:3] for e, t in tree(flat).items()} == {e: (None, None, 0) for e in tree(steps)}
    assert flat.group_by("episode_id").len()["len"].to_list() == [5] * 8


def test_the_budget_is_filled_to_exactly_the_group_size(monkeypatch):
    scripted_encode(monkeypatch)
    for seed in range(4):
        b = Branching("uniform", 5, 6, 2, 3, 0.5, 0.2, None)
        steps = play(Scripted(), None, b, n_tasks=3, seed=seed)
        per_task = steps.group_by("task_group").agg(pl.col("episode_id").n_unique())["episode_id"]
        assert per_task.to_list() == [6, 6, 6]
        assert sorted(steps["episode_id"].unique().to_list()) == [t * 1000 + g for t in range(3) for g in range(6)]
    # one-turn episodes leave nothing to branch from: the budget is spent one global trajectory per round
    sampler = Scripted()
    one = play(sampler, lambda: SokobanEnv(max_turns=1), Branching("uniform", 1, 4, 2, 2, 1.0, 0.2, None))
    assert one["parent_episode"].null_count() == one.height == 8
    assert sampler.batches == [4, 2, 2]   # both tasks' two globals together in one block, then one each a round


class NoSnapshot:
    """Sokoban without snapshot()/restore(): a branch replays its parent's responses."""

    def __init__(self, max_turns=5, noise=None):
        self.inner, self.noise = SokobanEnv(max_turns=max_turns), noise
        self.name, self.actions = "sokoban", self.inner.actions

    def task_description(self):
        return self.inner.task_description()

    def reset(self, task):
        obs = self.inner.reset(task)
        if self.noise is not None:   # a different start each time: not deterministic for a task seed
            obs = type(obs)(obs.text + f"\nclock {next(self.noise)}", obs.anchor, obs.admissible)
        return obs

    def step(self, text):
        return self.inner.step(text)


def test_uniform_branches_each_path_once_after_a_turn_drawn_uniformly(monkeypatch):
    """The control: each path draws one turn in [its first turn, horizon - 1) and hands beam - 1 copies after it
    (while the budget lasts), whatever the entropy. One global path and one branch a task: over many tasks the
    branch's first turn covers 1..4 evenly (a global that ends before its drawn turn leaves a second global)."""
    scripted_encode(monkeypatch)
    b = Branching("uniform", 5, 2, 1, 2, 0.5, 0.2, None)
    steps = play(Scripted(lambda turn: 9.0 * turn), None, b, n_tasks=200, batch_size=256)
    heads = steps.filter(pl.col("step") == 0)
    assert heads.height == 400
    counts = heads["branch_turn"].drop_nulls().value_counts().sort("branch_turn")
    assert counts["branch_turn"].to_list() == [1, 2, 3, 4] and counts["count"].min() > 30
    assert counts["count"].sum() > 150


def test_a_branch_replays_its_parent_to_the_recorded_state(monkeypatch):
    scripted_encode(monkeypatch)
    b = Branching("uniform", 5, 4, 2, 2, 0.5, 0.2, None)
    snap = play(Scripted(), None, b, seed=3)
    replayed = play(Scripted(), lambda: NoSnapshot(), b, seed=3)
    assert tree(snap) == tree(replayed) and snap["parent_episode"].null_count() < snap.height
    assert snap.equals(replayed)
    import itertools

    clock = itertools.count()
    with pytest.raises(ReplayError, match=r"env sokoban: replaying episode \d+ to branch from it, turn 0 gives "
                       r"observation .*not deterministic for a task seed.*mode: none"):
        play(Scripted(), lambda: NoSnapshot(noise=clock), b, seed=3)


def test_hard_attribution_by_hand():
    """Episode 0 global; 1 branches from 0 at turn 2; 2 from 1 at turn 3. Advantages a_e + 0.1 t with a = 1.0, -0.5,
    0.2. Turns 0-1 are 0's (three copies), turn 2 of 2 copies 1's, turn 3 is each episode's own."""
    rows = []
    for e, parent, start, a in [(0, None, None, 1.0), (1, 0, 2, -0.5), (2, 1, 3, 0.2)]:
        for t in range(4):
            rows.append({"episode_id": e, "step": t, "parent_episode": parent, "branch_turn": start,
                         "shared": start is not None and t < start, "advantage": a + 0.1 * t})
    table = pl.DataFrame(rows, schema_overrides={"parent_episode": pl.Int64, "branch_turn": pl.Int32})
    assert attribute(table, "soft").equals(table)
    hard = attribute(table, "hard").sort("episode_id", "step")
    assert hard.select("episode_id", "step").rows() == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert hard["advantage"].to_list() == pytest.approx([0.7 / 3, 1.0 / 3, 1.2, 1.3, 0.05, -0.2, 0.5])


def test_branch_points_fall_into_one_step_group(monkeypatch):
    scripted_encode(monkeypatch)
    b = Branching("uniform", 5, 4, 2, 2, 0.5, 0.2, None)
    steps = play(Scripted(), None, b, seed=1)
    report = branch_point_groups(steps, build_groups(steps))
    branches = steps.filter(pl.col("parent_episode").is_not_null())["episode_id"].n_unique()
    assert report["branch_points"] == branches == 4 and report["branch_points_grouped"] == 1.0
    # by hand: two episodes of one task, the second branched at turn 1; turn 1's state is shared, turn 2's is not
    hand = pl.DataFrame({
        "episode_id": [0, 0, 0, 1, 1, 1], "step": [0, 1, 2, 0, 1, 2], "task_group": [0] * 6,
        "anchor": ["s0", "s1", "s2", "s0", "s1", "s9"], "parent_episode": [None, None, None, 0, 0, 0],
        "branch_turn": [None, None, None, 1, 1, 1], "shared": [False, False, False, True, False, False],
    }, schema_overrides={"parent_episode": pl.Int64, "branch_turn": pl.Int32})
    got = branch_point_groups(hand, build_groups(hand))
    assert got == {"step_signal_share": 2 / 5, "branch_points": 1.0, "branch_points_grouped": 1.0}
    counts = rollout_counts(hand.with_columns(pl.Series("action", ["<search>a</search>", "<answer>b</answer>", None,
                                                                   "<search>a</search>", "<search>c</search>",
                                                                   "<answer>d</answer>"])),
                            lambda a: a.startswith("<search>"))
    assert counts == {"sampled_turns": 5.0, "shared_turns": 1.0, "branches": 1.0, "sampled_tool_calls": 2.0,
                      "shared_tool_calls": 1.0}


def test_a_step_table_without_branching_columns_reads_as_plain_rollouts(tmp_path, monkeypatch):
    scripted_encode(monkeypatch)
    steps = play(Scripted(), None, Branching("uniform", 5, 4, 2, 2, 0.5, 0.2, None)).with_columns(
        pl.lit(1, pl.Int32).alias("iteration"))
    path = tmp_path / "steps.parquet"
    tables.write_table(steps, path, tables.STEPS)
    back = tables.read_table(path, tables.STEPS)
    assert back.select("parent_episode", "branch_turn", "shared").equals(
        steps.select("parent_episode", "branch_turn", "shared"))
    old = tmp_path / "old.parquet"
    tables.write_table(steps.drop("entropy", "parent_episode", "branch_turn", "shared"), old,
                       pa.schema([f for f in tables.STEPS_SCHEMA if f.name not in tables.BRANCH_DEFAULTS]))
    plain = tables.read_table(old, tables.STEPS)
    assert plain["shared"].to_list() == [False] * steps.height and plain["parent_episode"].null_count() == steps.height


def test_generate_reports_arpo_entropy_of_its_own_samples(qwen_folder):
    """`generate`'s entropy is -sum p log p over each of the first k positions' top-10 candidates, divided by log
    |V|, from the distribution it sampled (here recomputed by a teacher-forced pass)."""
    model, tok = load_policy(qwen_folder)
    spec = EntropySpec(tokens=3, top_k=10, vocab=len(tok))
    prompts = [encode_prompt(tok, "Sokoban. push"), encode_prompt(tok, "a longer prompt than the other one")]
    gens = generate(model, tok, prompts, 6, 0.7, seed=[5, 9], entropy=spec)
    assert [g.response_ids for g in gens] == [g.response_ids for g in generate(model, tok, prompts, 6, 0.7, [5, 9])]
    for p, g in zip(prompts, gens):
        ids = torch.tensor([p + g.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(p) - 1: -1].float() / 0.7, -1)
        h = 0.0
        for j in range(min(3, len(g.response_ids))):
            h -= sum(float(logp[j, c].exp() * logp[j, c]) for c in torch.topk(logp[j], 10).indices.tolist())
        assert g.entropy == pytest.approx(h / torch.log(torch.tensor(float(len(tok)))).item(), rel=1e-5)
    assert generate(model, tok, prompts, 6, 0.7, seed=[5, 9])[0].entropy is None


def test_a_rerun_and_a_sharded_rollout_write_the_same_bytes(qwen_folder, tmp_path):
    """The tiny model samples with entropy branching: the same seed gives the same table byte for byte, and the
    tasks played as two shards of whole blocks (a killed job's finished shard kept, the rest played on resume) give
    the same rows as the whole. An interrupted call leaves nothing, and its rerun matches."""
    model, tok = load_policy(qwen_folder)
    b = Branching("entropy", 4, 4, 2, 2, 0.5, 0.2, EntropySpec(20, 10, len(tok)))
    all_specs = specs(4, 4)

    def run(sp, progress=None):
        return play_episodes(model, tok, lambda: SokobanEnv(max_turns=4), sp, history_turns=2, max_new_tokens=4,
                             temperature=1.0, batch_size=8, seed=11, branching=b, progress=progress).with_columns(
            pl.lit(1, pl.Int32).alias("iteration"))

    def killed(line):
        if line.startswith("turn 2:"):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run(all_specs, killed)
    first, again = run(all_specs), run(all_specs)
    for name, df in (("a", first), ("b", again)):
        tables.write_table(df, tmp_path / f"{name}.parquet", tables.STEPS)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    assert first["shared"].any() and first["entropy"].null_count() == 0
    shards = pl.concat([run(all_specs[:8]), run(all_specs[8:])]).sort("episode_id", "step")
    assert shards.equals(first)


def test_branching_params_are_checked_when_they_load(tmp_path):
    p = Params(rollout={"group_size": 8, "branching": {"mode": "entropy"}})
    assert p.rollout.branching.initial_for(8) == 4 and p.credit.attribution == "soft"
    bad = tmp_path / "params.yaml"
    bad.write_text("rollout:\n  group_size: 4\n  branching: {mode: entropy, initial: 4}\n")
    with pytest.raises(ParamsError, match=r"key 'rollout': branching.initial \(4\) must be below group_size \(4\)"):
        load_params(bad)
    bad.write_text("credit:\n  attribution: mean\n")
    with pytest.raises(ParamsError, match=r"credit.attribution.*'soft' or 'hard'"):
        load_params(bad)
