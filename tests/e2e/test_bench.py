"""Smoke versions of the benchmarks: they run, agree with the per-row reference and write their files.

The real runs (`python -m bench.throughput`, `python -m bench.credit_quality`) are on demand; their numbers are in
the README. Also the oracle labels and ROC-AUC the credit-quality benchmark scores with
(docs/credit-assignment.md, Oracle credit), on hand-made cases.
"""

import json
import math

import numpy as np
import polars as pl
import pytest
import yaml

from bench import credit_quality, throughput
from pipeline.config.params import METHOD_NAMES
from tests.conftest import SOKOBAN_METHODS


def test_throughput_smoke(tmp_path):
    df = throughput.run([3000], repeats=1, reference_max=3000, out_dir=tmp_path, log=False)
    assert set(df["what"]) == {"group", "read_checks", *METHOD_NAMES, "group+gigpo", "gigpo_per_row_python"}
    assert (df["turns"] == 3000).all() and (df["seconds"] > 0).all()
    on_disk = pl.read_csv(tmp_path / "throughput.csv")
    assert on_disk.height == df.height
    assert (tmp_path / "throughput.png").stat().st_size > 0


def test_synthetic_steps_look_like_rollouts():
    s = throughput.synthetic_steps(5000)
    assert s.height == 5000
    lengths = s.group_by("episode_id").len()["len"]
    assert lengths.min() >= 1 and lengths.max() <= 15
    assert (s.group_by("task_group").agg(pl.col("episode_id").n_unique())["episode_id"] <= 8).all()
    assert (s.filter(pl.col("step") == 0).group_by("task_group").agg(pl.col("anchor").n_unique())["anchor"] == 1).all()


def test_oracle_labels_on_a_hand_made_room(monkeypatch):
    """Each row is a one-turn episode in the same room, replayed in the real environment."""
    import pipeline.envs.sokoban as sokoban
    from pipeline.config.params import Params

    grid = "____\n@$_.\n____\n____"          # d = 2: push right twice
    monkeypatch.setattr(sokoban, "generate_room", lambda *a, **k: sokoban.parse_grid(grid))
    steps = pl.DataFrame({
        "episode_id": [0, 1, 2, 3, 4], "task_id": [0, 1, 2, 3, 4], "step": [0, 0, 0, 0, 0],
        "response": ["<action>right</action>",   # d 2 -> 1: good
                     "<action>down</action>",    # player walks off the box's row: d 2 -> 3, bad
                     "<action>left</action>",    # into the wall: no move, d unchanged, neither
                     "<action>jump</action>",    # invalid: bad
                     "<action>up</action>"],     # its environment raised: no label
        "action_valid": [True, True, True, False, True],
        "env_error": [None, None, None, None, "RuntimeError: boom"],
    }, schema_overrides={"env_error": pl.String})
    cfg = Params().env.model_copy(update={"dim_room": 6})
    assert credit_quality.oracle_labels(steps, cfg).to_list() == [1, 0, None, 0, None]
    with pytest.raises(ValueError, match="episode 1 .* the environment judged the action valid, the step table says "
                                         "otherwise; are these the params the run used"):
        credit_quality.oracle_labels(steps.with_columns(pl.Series("action_valid", [True, False] + [True] * 3)), cfg)


def test_roc_auc_by_hand():
    # pairs (pos, neg): 0.35>0.1, 0.35<0.4, 0.8>0.1, 0.8>0.4 -> 3 of 4
    assert credit_quality.roc_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    assert credit_quality.roc_auc(np.array([1.0, 1.0]), np.array([0, 1])) == 0.5        # a tie counts half
    assert math.isnan(credit_quality.roc_auc(np.array([1.0, 2.0]), np.array([1, 1])))   # no bad turn


def test_position_baselines_by_hand():
    """Episode 0 succeeds (a good search, a neutral one, a right answer); episode 1 fails (a good search, a wrong
    answer); episode 2 fails (an invalid turn, a wrong answer). Judged: good at turns left 2, 0, 1; bad at 0, 1, 0."""
    labelled = pl.DataFrame({"episode_id": [0, 0, 0, 1, 1, 2, 2], "step": [0, 1, 2, 0, 1, 0, 1],
                             "good": [1, None, 1, 1, 0, 0, 0], "success": [True] * 3 + [False] * 4,
                             "action_valid": [True] * 5 + [False, True]})
    rows = {r["baseline"]: r for r in credit_quality.position_baselines(labelled)}
    # turns left: of the 9 (good, bad) pairs 2 beats all three bad, 1 beats two and ties one, 0 ties two: 6.5 / 9
    assert rows["turns_left"]["auc"] == pytest.approx(6.5 / 9)
    assert rows["turns_left"]["auc_valid"] == pytest.approx(5 / 6)        # without the invalid turn (1 left)
    # success breaks ties: the good scores 2.5, 0.5, 1 against bad 0, 1, 0 -> 3 + 2 + 2.5 of 9
    assert rows["turns_left_then_success"]["auc"] == pytest.approx(7.5 / 9)
    assert rows["turns_left_then_success"]["auc_valid"] == 1.0


def test_terms_by_turn_by_hand():
    """Two episodes of two turns. Turn 0: step terms +0.5 and −0.5 with the episode terms +1 and −1 (they agree,
    correlation 1); turn 1: one step term, −0.2, against the episode term +1, and none on the other turn."""
    turns = pl.DataFrame({"method": ["gigpo"] * 4, "episode_id": [0, 0, 1, 1], "step": [0, 1, 0, 1],
                          "episode_advantage": [1.0, 1.0, -1.0, -1.0], "step_advantage": [0.5, -0.2, -0.5, 0.0]})
    rows = credit_quality.terms_by_turn(turns).to_dicts()
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0] == {"method": "gigpo", "step": 0, "turns": 2, "share_step_term": 1.0, "mean_abs_episode_term": 1.0,
                       "mean_abs_step_term": 0.5, "corr_terms": pytest.approx(1.0), "step_term_agrees": 1.0}
    assert rows[1]["share_step_term"] == 0.5 and rows[1]["mean_abs_step_term"] == pytest.approx(0.1)
    assert rows[1]["corr_terms"] == pytest.approx(-1.0)    # (+1, −0.2) and (−1, 0): the terms move apart
    assert rows[1]["step_term_agrees"] == 0.0
    grpo = credit_quality.terms_by_turn(turns.with_columns(pl.lit("grpo").alias("method"),
                                                          pl.lit(0.0).alias("step_advantage")))
    assert grpo["corr_terms"].to_list() == [None, None]      # no step term: nothing to correlate
    assert grpo["step_term_agrees"].to_list() == [None, None]


@pytest.mark.e2e
def test_credit_quality_smoke(grpo_run, tmp_path):
    out = tmp_path / "bench"
    df = credit_quality.run(grpo_run / "results", grpo_run / "params.yaml", out, list(METHOD_NAMES), log=False)
    assert df["method"].to_list() == list(SOKOBAN_METHODS)       # IGPO left out: Sokoban has no gold answer
    rows = {r["method"]: r for r in df.iter_rows(named=True)}
    for m in ("grpo", "rloo"):                     # episode-level only: no step signal at all
        assert rows[m]["share_nonzero_step_signal"] == 0.0
    assert rows["grpo"]["auc_step_term"] == 0.5 or math.isnan(rows["grpo"]["auc_step_term"])
    assert all(0.0 <= rows[m]["share_nonzero_step_signal"] <= 1.0 for m in SOKOBAN_METHODS)
    assert (out / "credit_quality.csv").exists() and (out / "credit_quality.png").stat().st_size > 0
    baselines = pl.read_csv(out / "credit_quality_baselines.csv")
    assert baselines["baseline"].to_list() == ["turns_left", "turns_left_then_success"]
    turns = pl.read_parquet(out / "credit_quality_turns.parquet")   # the rows behind each AUC
    assert turns.height == len(SOKOBAN_METHODS) * rows["grpo"]["turns"]
    for m in SOKOBAN_METHODS:
        t = turns.filter((pl.col("method") == m) & pl.col("good").is_not_null())
        auc = credit_quality.roc_auc(t["advantage"].to_numpy(), t["good"].to_numpy())
        assert auc == pytest.approx(rows[m]["auc"], nan_ok=True)
    assert (turns.filter(pl.col("method") == "grpo")["step_advantage"] == 0).all()
    by_turn = pl.read_csv(out / "credit_quality_terms_by_turn.csv")
    assert by_turn.filter(pl.col("method") == "grpo")["turns"].sum() == rows["grpo"]["turns"]
    assert (turns.filter(~pl.col("action_valid"))["good"] == 0).all()


@pytest.mark.e2e
def test_packing_smoke(grpo_run, tmp_path):
    """`bench.packing` on the tiny run: the iteration's tokens, prefix trees that hold fewer of them the larger their
    budget, both passes timed per budget and tree attention, and SPA's fit timed padded and packed on the first task
    group's turns (`--fits`, the credit benchmark's replay of the fit stage; every episode of the tiny run's group
    fails, so both score 0)."""
    from bench import packing

    out = tmp_path / "bench"
    packing.main(["--run", str(grpo_run / "results"), "--params", str(grpo_run / "params.yaml"), "--iterations", "1",
                  "--turns", "4", "--repeats", "1", "--micro-batch-tokens", "200", "4096", "--attention", "paths",
                  "mask", "--fits", "spa", "--fit-groups", "1", "--out", str(out)])
    steps = pl.read_parquet(grpo_run / "results" / "iter_1" / "steps.parquet")
    tokens = pl.read_csv(out / "packing_tokens.csv")
    total = sum(len(p) + len(r) for p, r in zip(steps["prompt_ids"].to_list(), steps["response_ids"].to_list()))
    assert tokens["budget"].to_list() == [200, 4096] and tokens["tokens"].to_list() == [total, total]
    small, large = tokens["tree_budget"].to_list()
    assert large < small < total                   # a group's episodes share their first prompt
    assert tokens["tree_whole_iteration"][0] <= large
    times = pl.read_csv(out / "packing_time.csv")
    assert times.select("packing", "budget", "attention").rows() == [
        ("none", None, None), ("tree", 200, "paths"), ("tree", 200, "mask"), ("tree", 4096, "paths"),
        ("tree", 4096, "mask")]
    assert (times["update_s"] > 0).all() and times["device"].n_unique() == 1
    fits = pl.read_csv(out / "packing_fits.csv")
    assert fits["packing"].to_list() == ["none", "tree"]
    first_group = steps.filter(pl.col("task_group") == steps["task_group"][0]).height
    assert fits["turns"].to_list() == [first_group, first_group]
    assert fits["score_abs_mean"].to_list() == [0.0, 0.0] and (fits["fit_s"] > 0).all()


def test_learning_summary_by_hand():
    from bench.learning import summarise

    curves = pl.DataFrame({
        "method": ["grpo"] * 6 + ["gigpo"] * 6,
        "seed": [0, 0, 0, 1, 1, 1] * 2,
        "iteration": [0, 1, 2] * 4,
        "success_rate": [0.1, 0.3, 0.2, 0.1, 0.2, 0.4,      # grpo: final 0.2, 0.4; best 0.3, 0.4
                         0.1, 0.5, 0.6, 0.1, 0.3, 0.5],     # gigpo: final 0.6, 0.5; best 0.6, 0.5
    })
    credit = pl.DataFrame({"method": ["grpo", "grpo", "gigpo", "gigpo"], "seed": [0, 1, 0, 1],
                           "auc_step_term": [0.5, 0.5, 0.7, 0.6], "auc": [0.6, 0.62, 0.7, 0.72],
                           "share_nonzero_step_signal": [0.0, 0.0, 0.9, 0.8]})
    table, vs = summarise(curves, credit)
    rows = {r["method"]: r for r in table.iter_rows(named=True)}
    assert rows["grpo"]["gain_mean"] == pytest.approx(0.2)                      # gains 0.1 and 0.3
    assert rows["gigpo"]["oracle_auc_step_term"] == pytest.approx(0.65)
    assert rows["gigpo"]["share_nonzero_step_signal"] == pytest.approx(0.85)
    assert rows["grpo"]["final_mean"] == pytest.approx(0.3) and rows["grpo"]["final_std"] == pytest.approx(0.1414214)
    assert rows["gigpo"]["best_mean"] == pytest.approx(0.55)
    assert rows["grpo"]["auc_mean"] == pytest.approx((0.6 / 3 + 0.7 / 3) / 2)
    diff = {r["method"]: r for r in vs.iter_rows(named=True)}
    assert diff["gigpo"]["final_minus_grpo_mean"] == pytest.approx(0.25)        # +0.4 and +0.1
    assert diff["gigpo"]["final_minus_grpo_std"] == pytest.approx(0.2121320)
    assert diff["grpo"]["final_minus_grpo_mean"] == 0.0


def test_learning_arms(tmp_path):
    """`--arm` adds a labelled run of a method with params of its own beside the methods; bad arms are refused."""
    from bench import learning

    arms = learning.parse_arms(["grpo"], [["dpo", "gigpo", "update.objective=step_dpo", "update.step_dpo.beta=0.5"]])
    assert arms == {"grpo": ("grpo", []), "dpo": ("gigpo", ["update.objective=step_dpo", "update.step_dpo.beta=0.5"])}
    d = learning.continuing_run(tmp_path / "dpo_s1", {"update": {"lr": 0.001}}, "gigpo", 1, "sqlite:///m.db",
                                tmp_path / "base_s1", through=1, sets=arms["dpo"][1])
    p = yaml.safe_load((d / "params.yaml").read_text())
    assert p["update"] == {"lr": 0.001, "objective": "step_dpo", "step_dpo": {"beta": 0.5}}
    assert (p["seed"], p["credit"]["method"], p["run"]["base"]["through"]) == (1, "gigpo", 1)
    for bad, words in ((["grpo", "rloo"], "used twice"), (["x", "ppo"], "unknown credit method 'ppo'"),
                       (["x", "grpo", "update.objective"], "is not KEY=VALUE"), (["x"], "LABEL METHOD")):
        with pytest.raises(SystemExit, match=words):
            learning.parse_arms(["grpo"], [bad])


def test_learning_pairs_per_run_and_iteration(tmp_path):
    """learning_pairs.csv's figures for a step-DPO run: 2 pairs over 3 distinct turns of the iteration's 5."""
    from bench.learning import collect_pairs

    it = tmp_path / "dpo_s0/results/iter_2"
    it.mkdir(parents=True)
    pl.DataFrame({"episode_id": [1, 1, 2, 2, 3]}).write_parquet(it / "steps.parquet")
    pl.DataFrame({"step_group": [7, 7], "chosen_episode": [1, 1], "chosen_step": [0, 0], "rejected_episode": [2, 3],
                  "rejected_step": [0, 0], "gap": [1.0, 3.0], "margin": [0.5, 1.5]}).write_parquet(it / "pairs.parquet")
    (tmp_path / "grpo_s0/results/iter_2").mkdir(parents=True)          # a PPO run: no pairs, no rows
    row = collect_pairs(tmp_path, ["grpo", "dpo"], [0]).row(0, named=True)
    assert row == {"method": "dpo", "seed": 0, "iteration": 2, "pairs": 2.0, "share_turns_in_pair": 0.6,
                   "states_with_pairs": 1.0, "gap_mean": 2.0, "margin_mean": 1.0}
    assert collect_pairs(tmp_path, ["grpo"], [0]).height == 0


@pytest.mark.e2e
def test_learning_smoke(tmp_path):

    from bench import learning

    params = yaml.safe_load((learning.ROOT / "tests" / "tiny_params.yaml").read_text())
    params["loop"] = {"iterations": 1}
    params["tracking"] = {"enabled": False}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
    work, out = tmp_path / "work", tmp_path / "out"
    learning.run_all(tmp_path / "p.yaml", ["grpo", "rloo"], [0], work, jobs=2, cores=1)
    # both methods continue from the same base: its first rollouts, linked (run.base), not copied
    a, b = (work / f"{m}_s0" / "results" / "iter_1" / "steps.parquet" for m in ("grpo", "rloo"))
    assert a.is_symlink() and b.is_symlink() and a.resolve() == b.resolve() == \
        (work / "base_s0" / "results" / "iter_1" / "steps.parquet").resolve()
    # RLOO end to end: episode advantages only, no step score, the terms adding up
    from pipeline.data import tables

    adv = tables.read_table(work / "rloo_s0/results/iter_1/advantages.parquet", tables.ADVANTAGES)
    assert adv.height > 0 and adv["step_score"].null_count() == adv.height
    assert (adv["advantage"] - adv["episode_advantage"] - adv["step_advantage"] + adv["penalty"]).abs().max() < 1e-12
    assert (work / "rloo_s0/results/iter_1/checkpoint/model.safetensors").is_file()
    table = learning.report(work, ["grpo", "rloo"], [0], out, log=False)
    curves = pl.read_csv(out / "learning_curves.csv")
    assert curves.height == 4 and curves["iteration"].to_list() == [0, 1, 0, 1]
    grpo = curves.filter(pl.col("method") == "grpo")["success_rate"].to_list()
    row = table.filter(pl.col("method") == "grpo").row(0, named=True)
    assert row["final_mean"] == grpo[1] and row["auc_mean"] == pytest.approx(sum(grpo) / 2)
    assert (out / "learning.png").stat().st_size > 0
    # the verdicts: RLOO against GRPO from the held-out tasks of the same runs (every task 2 episodes, so the mean
    # of the tasks' rates is the run's rate); one seed: p = 1, undecided, no spread over seeds to size seeds by
    rloo = curves.filter(pl.col("method") == "rloo")["success_rate"].to_list()
    final, auc = pl.read_csv(out / "learning_verdicts.csv").iter_rows(named=True)
    assert (final["method"], final["baseline"], final["metric"], final["seeds"], final["tasks"]) == \
        ("rloo", "grpo", "final", 1, 4)
    assert final["diff"] == pytest.approx(100 * (rloo[1] - grpo[1]))
    # iteration 0 is the runs' shared initial policy: the mean over iterations reads iteration 1 alone
    assert auc["metric"] == "auc" and auc["diff"] == pytest.approx(100 * (rloo[1] - grpo[1]))
    assert auc["iterations"] == "iterations 1" and auc["primary"] and not final["primary"]
    assert final["p_value"] == 1.0 and final["verdict"] == "undecided" and final["seeds_for_power"] is None
    # the same pair from the command line, iteration by iteration, and one run's gain over its iteration 0
    from bench import verdicts

    verdicts.main(["--runs", str(work / "rloo_s0/results"), str(work / "grpo_s0/results"), "--name", "rloo",
                   "--baseline-name", "grpo", "--out", str(out / "pair.csv")])
    pair = pl.read_csv(out / "pair.csv")
    assert pair["iteration"].to_list() == [0, 1] and pair["tasks"].to_list() == [4, 4]
    assert pair["diff"].to_list() == pytest.approx([100 * (rloo[0] - grpo[0]), final["diff"]])
    verdicts.main(["--runs", str(work / "grpo_s0/results"), "--out", str(out / "gain.csv")])
    assert pl.read_csv(out / "gain.csv")["diff"].to_list() == pytest.approx([100 * (grpo[1] - grpo[0])])
    with pytest.raises(SystemExit, match="no iter_<i>/eval.parquet"):
        verdicts.main(["--runs", str(tmp_path)])


@pytest.mark.e2e
def test_similarity_smoke(grpo_run, tmp_path):
    from bench import similarity

    df = similarity.run(grpo_run / "results", 0.95, tmp_path, reference_max=200)
    rows = {r["grouping"]: r for r in df.iter_rows(named=True)}
    exact, sim = rows["exact anchors"], rows["similarity >= 0.95"]
    assert sim["step_groups"] <= exact["step_groups"]                  # clustering can only merge groups
    assert sim["seconds_per_1e4_turns"] > 0 and (tmp_path / "similarity.csv").is_file()


def test_rollout_engines_smoke(tmp_path):
    """The rollout benchmark on the tiny shape with HF: Sokoban episodes of a random policy run to max_turns (no
    action ever solves a room in 2 turns of babble), so the rollout plays exactly episodes x turns turns, and raw
    generation replays the same batches."""
    from bench import rollout_engines

    rollout_engines.main(["--models", "tiny", "--engines", "hf", "--episodes", "6", "--turns", "2",
                          "--new-tokens", "4", "--models-dir", str(tmp_path / "models"), "--out", str(tmp_path)])
    df = pl.read_csv(tmp_path / "rollout_engines.csv")
    assert df.height == 1 and df["turns"][0] == 12 and df["engine"][0] == "hf"
    assert df["rollout_share_of_raw"][0] > 0


@pytest.mark.e2e
def test_real_size_smoke(tmp_path):
    """The real-size benchmark on the tiny shape (the LoRA variant; full fine-tuning is the tiny runs' default): the
    whole workflow on a model folder (`policy.path`), each job's row, and LoRA's checkpoint and optimiser state the
    adapter's, smaller than the full model (AdamW's state for every weight would be twice the model)."""
    from bench import real_size

    real_size.main(["--model", "tiny", "--dtype", "float32", "--tasks", "1", "--group-size", "2", "--max-turns",
                    "2", "--new-tokens", "3", "--cores", "2", "--variants", "lora", "--fork-server",
                    "--models-dir", str(tmp_path / "models"), "--work", str(tmp_path / "runs"), "--out", str(tmp_path)])
    df = pl.read_csv(tmp_path / "real_size.csv")
    jobs = {(r["variant"], r["stage"], r["iteration"]) for r in df.iter_rows(named=True)}
    assert jobs == {("lora", s, i) for s, i in
                    (("init", None), ("rollout", 1), ("group", 1), ("advantages", 1), ("update", 1),
                     ("evaluate", 0), ("evaluate", 1), ("report", None))}
    size = df.filter(pl.col("stage") == "update").row(0, named=True)
    assert size["checkpoint_mb"] < 0.5 * size["initial_checkpoint_mb"]
    assert size["optimizer_mb"] < size["initial_checkpoint_mb"]
    # Forked from the server, each stage reports its own peak (torch imported: some 400 MB), not the launcher's
    # 17 MB that Snakemake's sampler sees, nor the 0 it records for a job shorter than its interval.
    assert (df["max_rss_mb"] > 200).all() and (tmp_path / "real_size.png").stat().st_size > 0


def test_score_advantages_on_valid_turns_by_hand():
    """Five judged turns and one neutral: the valid turns alone rank differently from all of them."""
    from pipeline.credit.oracle import score_advantages

    adv = pl.DataFrame({
        "advantage": [0.9, 0.2, -0.5, 0.6, 0.1, 0.0],
        "step_advantage": [0.4, -0.1, 0.3, 0.0, 0.2, 0.0],
        "good": [1, 1, 0, 0, 0, None],
        "action_valid": [True, True, True, False, True, True],
    }, schema_overrides={"good": pl.Int8})
    s = score_advantages(adv)
    # all judged: good {0.9, 0.2} vs bad {-0.5, 0.6, 0.1}: 0.9 beats 3, 0.2 beats 2 -> 5/6
    assert s["auc"] == pytest.approx(5 / 6)
    # step terms: good {0.4, -0.1} vs bad {0.3, 0.0, 0.2}: 0.4 beats 3, -0.1 beats 0 -> 3/6
    assert s["auc_step_term"] == pytest.approx(3 / 6)
    # valid only (the invalid 0.6 drops out): good {0.9, 0.2} vs bad {-0.5, 0.1} -> 4/4
    assert s["auc_valid"] == pytest.approx(1.0)
    # step terms, valid only: good {0.4, -0.1} vs bad {0.3, 0.2} -> 2/4
    assert s["auc_step_term_valid"] == pytest.approx(0.5)
    assert s["share_nonzero_step_signal"] == pytest.approx(4 / 6) and s["turns"] == 6
    assert "auc_valid" not in score_advantages(adv.drop("action_valid"))
    # a learned model's own score is judged on every judged turn, the invalid one included (good vs bad as above)
    assert score_advantages(adv.with_columns(pl.col("advantage").alias("score")), "turn")["auc_score"] \
        == pytest.approx(5 / 6)


def test_update_fit_summary_by_hand():
    from bench import update_fit

    turns = pl.DataFrame({"advantage": [1.0, -1.0, 2.0, 0.0], "dlogp": [0.5, 0.1, -0.2, 0.3],
                          "action": ["up", "up", "down", "down"]})
    s = update_fit.summary(turns)
    assert (s["positive"], s["negative"], s["zero"]) == (2, 1, 1)
    assert s["dlogp_mean_positive"] == pytest.approx(0.15)        # (0.5 - 0.2) / 2
    assert s["dlogp_mean_negative"] == pytest.approx(0.1) and s["dlogp_mean_zero"] == pytest.approx(0.3)
    assert s["sign_agreement"] == pytest.approx(1 / 3)             # only the first turn moved with its sign
    assert s["spearman"] == pytest.approx(-0.5)                    # ranks (2,1,3) against (3,2,1): 1 - 6*6/24
    assert s["by_action"] == [{"action": "down", "turns": 2, "advantage_sum": 2.0, "dlogp_mean": pytest.approx(0.05)},
                              {"action": "up", "turns": 2, "advantage_sum": 0.0, "dlogp_mean": pytest.approx(0.3)}]


@pytest.mark.e2e
def test_update_fit_smoke(grpo_run, tmp_path, capsys):
    from bench import update_fit
    from pipeline.data import tables

    update_fit.main(["--run", str(grpo_run), "--iteration", "1", "--out", str(tmp_path)])
    steps = tables.read_table(grpo_run / "results/iter_1/steps.parquet", tables.STEPS)
    rows = pl.read_parquet(tmp_path / "update_fit_1.parquet")
    assert rows.height == steps.filter(pl.col("response_ids").list.len() > 0).height
    s = json.loads((tmp_path / "update_fit_1.json").read_text())
    assert s["positive"] + s["negative"] + s["zero"] == rows.height == sum(a["turns"] for a in s["by_action"])
    assert f"iteration 1: {rows.height} turns" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="iter_9"):
        update_fit.run(grpo_run, 9, tmp_path)


@pytest.mark.e2e
def test_branching_smoke(tmp_path):
    """Plain and entropy-branching GiGPO from one initial policy, one iteration each, through every stage: the
    initial policy is the base's (linked), the entropy arm's tasks hold exactly group_size episodes with copied turns,
    its branch points fall into one step group, and the report pairs the arms."""

    from bench import branching

    params = yaml.safe_load((branching.ROOT / "tests" / "tiny_params.yaml").read_text())
    params["loop"] = {"iterations": 1}
    params["tracking"] = {"enabled": False}
    # a policy that moves (branch points follow valid turns that change the state): vLLM's test model, warm-started
    params["policy"]["tiny"].update(hidden_size=64, intermediate_size=128, num_attention_heads=2)
    params["warmstart"].update(episodes=60, steps=120)
    params["rollout"]["temperature"] = 0.8
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
    work, out = tmp_path / "work", tmp_path / "out"
    arms = {"none": ["rollout.branching.mode=none"],
            "entropy": ["rollout.branching.mode=entropy", "rollout.branching.threshold=0.7"]}
    branching.run_all(tmp_path / "p.yaml", arms, ["gigpo"], [0], work, jobs=2, cores=1)
    ck = [work / a / "gigpo_s0/results/iter_0/checkpoint/model.safetensors" for a in arms]
    assert ck[0].resolve() == ck[1].resolve() == (work / "base_s0/results/iter_0/checkpoint/model.safetensors")
    table = branching.report(work, list(arms), ["gigpo"], [0], out, log=False,
                             controls=branching.control_pairs(arms))
    rollouts = pl.read_csv(out / "branching_rollouts.csv")
    plain, tree = (rollouts.filter(pl.col("arm") == a).row(0, named=True) for a in arms)
    g = params["rollout"]["group_size"]
    assert plain["episodes_per_task"] == tree["episodes_per_task"] == g
    assert plain["shared_turns_per_task"] == 0 and plain["branches_per_task"] == 0
    assert tree["shared_turns_per_task"] > 0 and tree["branches_per_task"] > 0 and tree["branch_points_grouped"] == 1.0
    assert "oracle_auc" in rollouts.columns                              # scored against Sokoban's oracle
    assert table["arm"].to_list() == ["none", "entropy"] and (out / "branching.png").stat().st_size > 0
    final = pl.read_csv(out / "branching_verdicts.csv").row(0, named=True)
    assert (final["method"], final["baseline"], final["metric"]) == ("gigpo/entropy", "none", "final")


def test_branching_pairs_each_entropy_arm_with_the_uniform_arm_of_its_budget():
    """An equal-turns entropy arm is judged against the equal-turns uniform arm, not the equal-episodes one; an
    entropy arm without a uniform arm of the same keys has no control."""
    from bench.branching import control_pairs

    m = "rollout.branching.mode="
    arms = {"none": [m + "none"], "uniform": [m + "uniform"], "entropy": [m + "entropy"],
            "entropy_turns": [m + "entropy", "rollout.group_size=5"],
            "uniform_turns": [m + "uniform", "rollout.group_size=5"],
            "entropy_wide": [m + "entropy", "rollout.branching.beam=3"]}
    assert control_pairs(arms) == [("uniform", "entropy"), ("uniform_turns", "entropy_turns")]
    assert control_pairs({k: arms[k] for k in ("none", "uniform", "entropy_turns")}) == []


def test_branching_report_pools_the_seeds_of_earlier_benches_by_hand(tmp_path):
    """`--merge`: seed 0 from one bench's output folder, seed 1 from another's, paired as if run in one; final
    entropy - plain differences per task (+0.5, 0) on seed 0 and (0, +0.5) on seed 1: +25 points; over the
    iterations the arms do not share (iteration 0 is the shared initial policy) +25 too. A seed in two benches, or
    a folder without its per-task table, is refused by name."""
    from bench import branching

    finals = {0: {"none": [0.5, 1.0], "entropy": [1.0, 1.0]}, 1: {"none": [0.0, 0.5], "entropy": [0.0, 1.0]}}
    folders = []
    for seed, arms in finals.items():
        d = tmp_path / f"bench{seed}"
        d.mkdir()
        tasks = pl.DataFrame([{"arm": a, "method": "gigpo", "seed": seed, "iteration": it, "task_id": 10 + k,
                               "success": (0.5 if it == 0 else arms[a][k])}
                              for a in arms for it in (0, 1) for k in range(2)])
        tasks.write_csv(d / "branching_tasks.csv")
        tasks.group_by("arm", "method", "seed", "iteration", maintain_order=True).agg(
            pl.col("success").mean().alias("success_rate")).write_csv(d / "branching_curves.csv")
        pl.DataFrame([{"arm": a, "method": "gigpo", "seed": seed, "iteration": 1, "sampled_turns_per_task": 9.0,
                       "shared_turns_per_task": 0.0 if a == "none" else 2.0} for a in arms]).write_csv(
            d / "branching_rollouts.csv")
        folders.append(d)
    out = tmp_path / "out"
    table = branching.report(tmp_path / "work", ["none", "entropy"], ["gigpo"], [], out, log=False, merge=folders)
    v = {r["metric"]: r for r in pl.read_csv(out / "branching_verdicts.csv").iter_rows(named=True)}
    assert v["final"]["seeds"] == 2 and v["final"]["tasks"] == 2
    assert v["final"]["diff"] == pytest.approx(25.0) and v["auc"]["diff"] == pytest.approx(25.0)
    assert table["final_mean"].to_list() == pytest.approx([0.5, 0.75])
    assert pl.read_csv(out / "branching_tasks.csv").height == 16
    with pytest.raises(SystemExit, match=r"--merge .*bench0: arm, method and seed \('entropy', 'gigpo', 0\) are "
                       r"in this bench too"):
        branching.report(tmp_path / "work", ["none", "entropy"], ["gigpo"], [], out, log=False,
                         merge=[folders[0], folders[0]])
    (folders[1] / "branching_tasks.csv").unlink()
    with pytest.raises(SystemExit, match=r"--merge .*bench1: branching_tasks.csv is missing"):
        branching.report(tmp_path / "work", ["none", "entropy"], ["gigpo"], [], out, log=False, merge=folders)


def test_learning_bands_by_hand():
    """The curves' bands: several seeds give ± std over seeds; one seed ± one standard error over its held-out tasks
    (std of the tasks' rates over the root of their number), and its difference to GRPO the paired 95 % bootstrap
    interval over the tasks."""
    from bench.learning import curve_bands, diff_bands

    def tasks(*per_iteration):
        return pl.DataFrame([{"iteration": it, "task_id": t, "success": float(x)}
                             for it, xs in enumerate(per_iteration) for t, x in enumerate(xs)])

    curves = pl.DataFrame({"method": ["grpo", "grpo", "gigpo", "gigpo"], "seed": [0] * 4, "iteration": [0, 1, 0, 1],
                           "success_rate": [0.5, 0.75, 0.5, 0.5]})
    tables = {("grpo", 0): tasks([1, 0, 1, 0], [1, 1, 1, 0]), ("gigpo", 0): tasks([1, 0, 1, 0], [1, 1, 0, 0])}
    b = curve_bands(curves, tasks=tables).filter(pl.col("method") == "grpo")
    assert b["band"].to_list() == ["tasks", "tasks"]
    assert b["s"].to_list() == pytest.approx([0.2886751, 0.25])             # sqrt(1/3) / 2, 0.5 / 2
    assert curve_bands(curves)["band"].unique().to_list() == ["none"]
    d = diff_bands(curves, "grpo", tables)
    # iteration 1: per task 0, 0, −100, 0 points; of 4 tasks drawn, 3 or more at −100 has probability 0.051
    assert d.select("iteration", "m", "low", "high", "band").rows() == [(0, 0.0, 0.0, 0.0, "tasks"),
                                                                        (1, -25.0, -75.0, 0.0, "tasks")]
    two = pl.concat([curves, pl.DataFrame({"method": ["grpo", "grpo", "gigpo", "gigpo"], "seed": [1] * 4,
                                           "iteration": [0, 1, 0, 1], "success_rate": [0.3, 0.45, 0.3, 0.65]})])
    g = curve_bands(two, tasks=tables).filter(pl.col("method") == "grpo", pl.col("iteration") == 1).row(0, named=True)
    assert (g["n"], g["m"], g["s"], g["band"]) == (2, pytest.approx(0.6), pytest.approx(0.2121320), "seeds")
    d = diff_bands(two, "grpo", tables).filter(pl.col("iteration") == 1).row(0, named=True)
    # seed 0: −25 points, seed 1: +20 points
    assert (d["m"], d["low"], d["high"], d["band"]) == (pytest.approx(-2.5), pytest.approx(-2.5 - 31.8198052),
                                                        pytest.approx(-2.5 + 31.8198052), "seeds")


def test_precision_smoke(grpo_run, tmp_path):
    """`bench.precision` on the tiny run: a profiled update minibatch per dtype whose parts add up to its wall time,
    with the matrix products found in the forward and the backward and AdamW in the optimiser step; and the update
    job run in a scratch folder per dtype, the run's own outputs untouched."""
    from bench import precision

    out, scratch = tmp_path / "out", tmp_path / "scratch"
    source = grpo_run / "results" / "iter_1" / "checkpoint"
    before = {f.name: f.stat().st_mtime_ns for f in source.iterdir()}
    precision.main(["--params", str(grpo_run / "params.yaml"), "--run", str(grpo_run / "results"), "--profile",
                    "--jobs", "update@1", "--repeats", "1", "--scratch", str(scratch), "--out", str(out)])
    prof = pl.read_csv(out / "precision_profile.csv")
    for dtype in ("float32", "bfloat16"):
        rows = prof.filter(pl.col("dtype") == dtype)
        assert rows["seconds"].sum() == pytest.approx(rows["wall_s"][0], abs=0.01)
        matmul = {ph: s for ph, k, s in rows.select("phase", "kind", "seconds").rows() if k == "matmul"}
        assert matmul["forward"] > 0 and matmul["backward"] > 0
        assert rows.filter(pl.col("phase") == "optimizer")["seconds"].sum() > 0
    jobs = pl.read_csv(out / "precision_jobs.csv")
    assert jobs.select("job", "dtype").rows() == [("update@1", "float32"), ("update@1", "bfloat16")]
    for dtype in ("float32", "bfloat16"):
        made = scratch / f"update_1_{dtype}" / "iter_1" / "checkpoint"
        assert (made / "model.safetensors").is_file() and not (made / "model.safetensors").is_symlink()
        assert yaml.safe_load((scratch / f"update_1_{dtype}.yaml").read_text())["policy"]["dtype"] == dtype
    assert {f.name: f.stat().st_mtime_ns for f in source.iterdir()} == before


def test_precision_jobs_make_first_what_the_run_lacks(grpo_run, tmp_path):
    """A GAE fit timed on a GRPO run, which has no step-reward model: its `reward_init` runs first in each scratch
    folder, untimed, and only the fit is a row; the run's own folder gains nothing."""
    from bench import precision

    out, scratch = tmp_path / "out", tmp_path / "scratch"
    assert not (grpo_run / "results" / "iter_0" / "reward_model").exists()
    precision.main(["--params", str(grpo_run / "params.yaml"), "--run", str(grpo_run / "results"), "--jobs",
                    "fit@1", "--set", "credit.method=gae", "--repeats", "1", "--scratch", str(scratch),
                    "--out", str(out)])
    jobs = pl.read_csv(out / "precision_jobs.csv")
    assert jobs.select("job", "dtype").rows() == [("fit@1", "float32"), ("fit@1", "bfloat16")]
    for dtype in ("float32", "bfloat16"):
        made = scratch / f"fit_1_{dtype}"
        assert (made / "iter_0" / "reward_model").is_dir() and not (made / "iter_0" / "reward_model").is_symlink()
        assert (made / "iter_1" / "reward_model").is_dir()
    assert not (grpo_run / "results" / "iter_0" / "reward_model").exists()
