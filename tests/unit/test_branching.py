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


def test_responses_of_equal_per_token_entropy_and_different_lengths_have_equal_h():
    """H is the mean over the positions read (ARPO's sum over its always-20 positions, divided by 20): a 3-token
    and an 8-token response whose positions each have the same top-10 candidates give one H, so dH = 0; the sum
    made the longer one's H 8/3 of the shorter's."""
    import math

    from pipeline.model.policy import _SampledLogprobs, arpo_entropy

    position = [math.log(0.5), math.log(0.25), math.log(0.125)]
    per_token = -sum(math.exp(x) * x for x in position) / math.log(400)
    short, long = arpo_entropy([position] * 3, 400), arpo_entropy([position] * 8, 400)
    assert short == pytest.approx(per_token) and long == pytest.approx(per_token) and long - short == 0
    assert arpo_entropy([position] * 25, 400) == pytest.approx(per_token) and arpo_entropy([], 400) == 0.0
    # the Hugging Face sampler's own path: a batch of two rows, 3 and 8 tokens long, each position's terms equal
    probe = _SampledLogprobs(1.0, EntropySpec(20, 3, 400))
    probe.candidates = [torch.full((2,), per_token * math.log(400), dtype=torch.float64)] * 8
    assert probe.entropies([3, 8]) == pytest.approx([per_token, per_token])


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
    """tau 0, beta 1: a copy branches exactly when the response a path samples in a branch point has an entropy at
    least 1 above its first turn's (U < dH), whatever U. The entropy jumps at turn 2 only, so a global path branches
    in its state s(2), where it sampled that response (ARPO reads the tokens after the tool result; the project's
    earlier code read the turn before and branched one turn late, at s(3)), and its copy resamples turn 2 there.
    s(2) is a branch point only where turn 1 changed the state: episode 0's and 1001's turn 1 walked into a wall
    (valid, a no-op), so they never branch; 1 and 1000 each hand one copy, the next episode of their budget."""
    scripted_encode(monkeypatch)
    b = Branching("entropy", 5, 4, 2, 2, 0.0, 1.0, EntropySpec(20, 10, 400))
    steps = play(Scripted(lambda turn: 5.0 if turn == 2 else 0.0), None, b)
    turn1 = {e: (r["action_valid"], r["anchor"]) for e in (0, 1, 1000, 1001)
             for r in steps.filter((pl.col("episode_id") == e) & (pl.col("step") <= 2)).iter_rows(named=True)
             if r["step"] == 1}
    state2 = {e: steps.filter((pl.col("episode_id") == e) & (pl.col("step") == 2))["anchor"][0] for e in turn1}
    assert {e: v and a != state2[e] for e, (v, a) in turn1.items()} == {0: False, 1: True, 1000: True, 1001: False}
    assert tree(steps) == {0: (None, None, 0, 5), 1: (None, None, 0, 5), 2: (1, 2, 2, 5), 3: (None, None, 0, 5),
                           1000: (None, None, 0, 5), 1001: (None, None, 0, 5), 1002: (1000, 2, 2, 5),
                           1003: (None, None, 0, 5)}
    # a branch's first two turns are its parent's rows; it samples turn 2 afresh in the parent's state s(2)
    own = ["prompt_ids", "response", "action", "reward", "observation", "anchor"]
    parent, child = steps.filter(pl.col("episode_id") == 1), steps.filter(pl.col("episode_id") == 2)
    assert child.head(2).select(own).equals(parent.head(2).select(own))
    assert child["observation"][2] == parent["observation"][2]           # the same state at the branch point
    assert child["shared"].to_list() == [True, True, False, False, False]
    # no rise (or a fall): nothing branches; each task's paths end, and one more global trajectory starts a round
    flat = play(Scripted(lambda turn: -3.0 if turn == 2 else 0.0), None, b)
    assert {e: t[:3] for e, t in tree(flat).items()} == {e: (None, None, 0) for e in tree(steps)}
    assert flat.group_by("episode_id").len()["len"].to_list() == [5] * 8


def test_an_invalid_turn_or_a_no_tool_turn_is_no_branch_point(monkeypatch):
    """With the environment's tool calls named, a state reached by a move that is no tool call is no branch point;
    an invalid response's state never is (tau 1: every branch point branches)."""
    scripted_encode(monkeypatch)
    everything = Branching("entropy", 5, 4, 2, 2, 1.0, 0.2, EntropySpec(20, 10, 400))
    assert tree(play(Scripted(), None, everything))[2][0] is not None         # moves that change the state: branch
    only_up = Branching("entropy", 5, 4, 2, 2, 1.0, 0.2, EntropySpec(20, 10, 400), tool_call=lambda a: a == "up")
    steps = play(Scripted(), None, only_up)
    heads = steps.filter(pl.col("parent_episode").is_not_null() & (pl.col("step") == pl.col("branch_turn") - 1))
    parents = steps.join(heads.select(pl.col("parent_episode").alias("episode_id"), "step"), on=["episode_id", "step"])
    assert heads.height > 0 and set(parents["action"].to_list()) == {"up"}   # each branch follows an "up"

    class Garbled(Scripted):
        def __call__(self, prompt_ids, *a, **k):
            return [Generation(g.response_ids, g.logprobs, "no move", g.entropy)
                    for g in super().__call__(prompt_ids, *a, **k)]

    none = play(Garbled(), None, everything)
    assert none["parent_episode"].null_count() == none.height and not none["action_valid"].any()


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


class AnyMove(SokobanEnv):
    """Sokoban where every response is a move (chosen by its text's CRC-32): an untrained model's turns are valid."""

    def step(self, text):
        import zlib

        return super().step(f"<action>{MOVES[zlib.crc32(text.encode()) % 4]}</action>")


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
    """`generate`'s entropy is -sum p log p over each of the first k positions' top-10 candidates, averaged over
    the k positions, divided by log |V|, from the distribution it sampled (here recomputed by a teacher-forced
    pass)."""
    model, tok = load_policy(qwen_folder)
    spec = EntropySpec(tokens=3, top_k=10, vocab=len(tok))
    prompts = [encode_prompt(tok, "Sokoban. push"), encode_prompt(tok, "a longer prompt than the other one")]
    gens = generate(model, tok, prompts, 6, 0.7, seed=[5, 9], entropy=spec)
    assert [g.response_ids for g in gens] == [g.response_ids for g in generate(model, tok, prompts, 6, 0.7, [5, 9])]
    for p, g in zip(prompts, gens):
        ids = torch.tensor([p + g.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(p) - 1: -1].float() / 0.7, -1)
        h, k = 0.0, min(3, len(g.response_ids))
        for j in range(k):
            h -= sum(float(logp[j, c].exp() * logp[j, c]) for c in torch.topk(logp[j], 10).indices.tolist())
        assert g.entropy == pytest.approx(h / k / torch.log(torch.tensor(float(len(tok)))).item(), rel=1e-5)
    assert generate(model, tok, prompts, 6, 0.7, seed=[5, 9])[0].entropy is None


def test_a_rerun_and_a_sharded_rollout_write_the_same_bytes(qwen_folder, tmp_path):
    """The tiny model samples with entropy branching: the same seed gives the same table byte for byte, and the
    tasks played as two shards of whole blocks (a killed job's finished shard kept, the rest played on resume) give
    the same rows as the whole. An interrupted call leaves nothing, and its rerun matches."""
    model, tok = load_policy(qwen_folder)
    b = Branching("entropy", 4, 4, 2, 2, 0.5, 0.2, EntropySpec(20, 10, len(tok)))
    all_specs = specs(4, 4)

    def run(sp, progress=None):
        return play_episodes(model, tok, lambda: AnyMove(max_turns=4), sp, history_turns=2, max_new_tokens=4,
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
