"""The group-sequential design of a claim's campaign (bench/campaign.py): the spending function and the exact
boundaries by hand, the decisions at a look, and its error rate under no difference in simulation."""

import math

import numpy as np
import polars as pl
import pytest
from scipy import stats

from bench.campaign import CLAIMS, Design, boundaries, decide, spent


def test_obrien_fleming_spending_by_hand():
    # 2 - 2 Phi(1.95996 / sqrt(t)): t = 1 spends all of alpha, t = 1/2 about a ninth of it
    assert spent(1.0) == pytest.approx(0.05)
    assert spent(0.5) == pytest.approx(2 - 2 * stats.norm.cdf(1.959964 / math.sqrt(0.5)))
    assert spent(0.5) == pytest.approx(0.005575, abs=1e-5)
    assert spent(0.0) == 0.0 and spent(8 / 20) < spent(12 / 20) < spent(16 / 20) < 0.05


def test_the_boundaries_are_exact_on_the_sign_patterns_by_hand():
    d = np.arange(1.0, 7.0)                        # 1 2 3 4 5 6, looks after 4 and 6 seeds of 6
    c1, c2 = boundaries(d, (4, 6), 6)
    # at 4 seeds spent(2/3) = 0.0164 of 16 patterns is 0.26: not one pattern may cross
    assert c1 == math.inf
    # at 6 seeds 0.05 x 64 = 3.2 patterns: +-all (|mean| 3.5) are 2; the next, with the 1 flipped (19/6), two more
    # would make 4 > 3.2, so the boundary is 3.5
    assert c2 == pytest.approx(3.5)
    # a boundary already crossed by some patterns at look 1 leaves less room at look 2: with looks (2, 6) of
    # 1..6, spent(1/3) x 4 = 0.0006: none at look 1 either
    assert boundaries(d, (2, 6), 6)[0] == math.inf
    assert boundaries(d[:4], (4, 6), 6) == [math.inf]     # a look the data have not reached is not computed


def test_a_design_is_checked_before_any_run():
    with pytest.raises(ValueError, match="first look at 6 seeds; the sign-flip test cannot reach"):
        Design("c", "gigpo", "grpo", "auc", (6, 12))
    with pytest.raises(ValueError, match="looks .* must be increasing"):
        Design("c", "gigpo", "grpo", "auc", (12, 8))
    with pytest.raises(ValueError, match="metric 'best'"):
        Design("c", "gigpo", "grpo", "best", (8, 16))
    assert Design("c", "gigpo", "grpo", "auc", (8, 12, 16)).seeds == tuple(range(16))


def test_decisions_stop_at_the_first_look_that_decides():
    design = Design("c", "gigpo", "grpo", "auc", (8, 12, 16))
    # every seed +6 to +13 points: at 8 seeds |mean| 9.5 is the largest of the 256 patterns' (2 of them), and
    # spent(1/2) x 256 = 1.4 allows 1: not yet; at 12 seeds spent(3/4) = 0.0236 x 4096 = 97 patterns: better
    up = np.array([6.0, 7, 8, 9, 10, 11, 12, 13, 8, 9, 10, 11, 7, 7, 7, 7])
    looks = decide(design, up)
    assert [x.seeds for x in looks] == [8, 12] and [x.decision for x in looks] == ["continue", "better"]
    assert looks[0].boundary == math.inf and looks[1].boundary <= up[:12].mean()
    assert [x.decision for x in decide(design, -up)][-1] == "worse"
    # small differences around 0 with a small spread: equivalent within +-5 at the first look
    flat = np.array([0.5, -0.5, 1.0, -1.0, 0.2, -0.2, 0.0, 0.3, 0.1, -0.1, 0.4, -0.4, 0.0, 0.2, -0.3, 0.1])
    eq = decide(design, flat)
    assert len(eq) == 1 and eq[0].decision == "equivalent" and -5 < eq[0].ci90[0] < eq[0].ci90[1] < 5
    # noise of 20 points around +3: on to the maximum, undecided, with the seeds a decision is expected to need
    rng = np.random.default_rng(3)
    noisy = 3 + rng.normal(0, 20, 16)
    last = decide(design, noisy)
    assert [x.seeds for x in last] == [8, 12, 16] and last[-1].decision == "undecided"
    assert last[-1].seeds_to_decide is None or last[-1].seeds_to_decide > 16


def test_the_error_rate_under_no_difference_stays_at_alpha_in_simulation():
    """400 campaigns of symmetric differences (no effect), looks at 8, 12 and 16 seeds: at most 5 % (plus two
    standard errors of the simulation) end better or worse; under an effect of one spread most do."""
    design = Design("c", "a", "b", "auc", (8, 12, 16))
    rng = np.random.default_rng(0)
    wrong = sum(decide(design, rng.normal(0, 6, 16), estimate=False)[-1].decision in ("better", "worse")
                for _ in range(400))
    assert wrong / 400 <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / 400)
    found = sum(decide(design, rng.normal(6, 6, 16), estimate=False)[-1].decision == "better" for _ in range(100))
    assert found >= 80


def _claim_folder(tmp_path, looks=(8, 12)):
    import yaml

    folder = tmp_path / "claim"
    folder.mkdir()
    (folder / "design.yaml").write_text(yaml.safe_dump({
        "claim": "gigpo-sokoban", "method": "gigpo", "baseline": "grpo", "metric": "final", "looks": list(looks),
        "params": "params.yaml", "arms": {"gigpo": ["gigpo"], "grpo": ["grpo"]}}))
    return folder


def _record(folder, label, seed, finals, cpu="AMD EPYC", iterations=(0, 1), **machine):
    import json

    import polars as pl

    d = folder / "runs" / f"{label}_s{seed}"
    d.mkdir(parents=True)
    rows = [{"iteration": it, "task_id": t, "success": 0.5 if it == 0 else s}
            for it in iterations for t, s in enumerate(finals)]
    pl.DataFrame(rows).write_csv(d / "task_success.csv")
    (d / "run.json").write_text(json.dumps({"status": "ok", "cpu": cpu, **machine}))


def test_a_campaign_resumes_from_its_records_and_asks_for_the_next_look(tmp_path):
    """Eight recorded pairs, GiGPO +25 points on six seeds and -25 on two (two tasks, 0.75 or 0.25 against 0.5):
    at 8 seeds of 12, spent(2/3) x 256 = 4.2 patterns may cross; only the two extreme ones (|mean| 25) fit, the
    observed 12.5 does not: the next batch is seeds 8-11, and a seed recorded for one arm only is asked for again.
    Had every seed been +25, the observed pattern would be an extreme one: better at the first look."""
    import shutil

    from bench.campaign import differences, load_claim, next_batch, recorded, report

    folder = _claim_folder(tmp_path)
    for s in range(8):
        _record(folder, "gigpo", s, [0.75, 0.75] if s < 6 else [0.25, 0.25])
        _record(folder, "grpo", s, [0.5, 0.5])
    _record(folder, "gigpo", 8, [1.0, 1.0])
    claim = load_claim(folder)
    runs = recorded(claim)
    seeds, d = differences(claim, runs)
    assert seeds == list(range(8)) and d.tolist() == [25.0] * 6 + [-25.0] * 2
    assert next_batch(claim, runs) == [8, 9, 10, 11]
    looks = report(claim)
    assert [x.decision for x in looks] == ["continue"] and looks[0].boundary == pytest.approx(25.0)
    assert (folder / "looks.csv").is_file() and (folder / "campaign.png").stat().st_size > 10_000
    for s in (6, 7):
        shutil.rmtree(folder / "runs" / f"gigpo_s{s}")
        _record(folder, "gigpo", s, [0.75, 0.75])
    assert [x.decision for x in report(claim)] == ["better"] and next_batch(claim, recorded(claim)) == []


def test_a_crashed_arm_scores_zero_and_a_pair_stays_on_one_machine(tmp_path):
    from bench.campaign import differences, load_claim, recorded

    folder = _claim_folder(tmp_path)
    _record(folder, "gigpo", 0, [1.0, 1.0], iterations=(0,))       # crashed after iteration 0
    _record(folder, "grpo", 0, [0.5, 1.0])
    _record(folder, "gigpo", 1, [1.0, 1.0], cpu="Intel Xeon")
    _record(folder, "grpo", 1, [0.5, 1.0])
    claim = load_claim(folder)
    with pytest.raises(SystemExit, match=r"seed 1's arms ran on cpu 'Intel Xeon' and 'AMD EPYC' \(runs/gigpo_s1/run"
                       r"\.json, runs/grpo_s1/run\.json\); a pair is compared within one machine"):
        differences(claim, recorded(claim))
    import shutil

    shutil.rmtree(folder / "runs" / "gigpo_s1")
    seeds, d = differences(claim, recorded(claim))
    # gigpo evaluated iteration 0 only: at iteration 1 it scores 0 on both tasks, against 0.5 and 1.0
    assert seeds == [0] and d.tolist() == [-75.0]


def test_two_epycs_named_alike_are_told_apart_by_their_family(tmp_path):
    """A virtual machine names a Zen 4 and a Zen 5 EPYC alike ("AMD EPYC", both with avx512_bf16): their family
    (25, 26) splits the pair. A record made before the family was kept is compared by its name only."""
    from bench import cpu_generation
    from bench.campaign import differences, load_claim, recorded

    cpuinfo = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
               "\nprocessor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\n")
    assert cpu_generation(cpuinfo) == {"cpu_family": 26, "cpu_model": 2}
    assert cpu_generation("model name\t: something\n") == {}

    folder = _claim_folder(tmp_path)
    zen5 = {"cpu_family": 26, "cpu_model": 2, "bf16_flags": ["avx512_bf16"]}
    _record(folder, "gigpo", 0, [1.0, 1.0], **zen5)
    _record(folder, "grpo", 0, [0.5, 1.0], **{**zen5, "cpu_family": 25, "cpu_model": 17})
    claim = load_claim(folder)
    with pytest.raises(SystemExit, match="seed 0's arms ran on cpu_family 26 and 25 "):
        differences(claim, recorded(claim))
    import shutil

    shutil.rmtree(folder / "runs" / "grpo_s0")
    _record(folder, "grpo", 0, [0.5, 1.0])                              # an older record: the name only
    assert differences(claim, recorded(claim)) == ([0], pytest.approx([25.0]))
    shutil.rmtree(folder / "runs" / "grpo_s0")
    _record(folder, "grpo", 0, [0.5, 1.0], **{**zen5, "bf16_flags": []})  # the same family, bf16 flags masked
    with pytest.raises(SystemExit, match=r"seed 0's arms ran on bf16_flags \['avx512_bf16'\] and \[\]"):
        differences(claim, recorded(claim))


def test_a_record_names_the_cpus_family_and_model(tmp_path):
    """A run that crashed before its first evaluation is recorded too (an empty table), with the machine it ran on:
    the CPU's name, family and model, and bf16 flags, as /proc/cpuinfo gives them here."""
    import json

    from bench import cpu_generation, cpu_name
    from bench.campaign import load_claim, record
    from pipeline.model.precision import cpu_bf16_flags

    folder = _claim_folder(tmp_path)
    run = tmp_path / "work" / "gigpo_s3"
    run.mkdir(parents=True)
    record(load_claim(folder), "gigpo", 3, run, "crashed", 12.34)
    out = folder / "runs" / "gigpo_s3"
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "crashed" and meta["wall_s"] == 12.3 and meta["iterations"] == []
    assert meta["cpu"] == cpu_name() and meta["bf16_flags"] == cpu_bf16_flags()
    assert {k: meta[k] for k in ("cpu_family", "cpu_model")} == cpu_generation() != {}
    assert (out / "task_success.csv").read_text().strip() == "iteration,task_id,success"
    assert sorted(p.name for p in (folder / "runs").iterdir()) == ["gigpo_s3"]      # nothing half written left


def test_a_claim_folder_is_checked_by_key(tmp_path):
    import yaml

    from bench.campaign import load_claim

    folder = _claim_folder(tmp_path)
    raw = yaml.safe_load((folder / "design.yaml").read_text())
    (folder / "design.yaml").write_text(yaml.safe_dump({**raw, "arms": {"gigpo": ["gigpo"]}}))
    with pytest.raises(SystemExit, match=r"design.yaml: arms has no 'grpo'"):
        load_claim(folder)
    (folder / "design.yaml").write_text(yaml.safe_dump({**raw, "looks": [4, 8]}))
    with pytest.raises(SystemExit, match=r"design.yaml: design gigpo-sokoban: the first look at 4 seeds"):
        load_claim(folder)
    (folder / "design.yaml").write_text(yaml.safe_dump({**raw, "seeds": 3}))
    with pytest.raises(SystemExit, match=r"unknown keys \['seeds'\]"):
        load_claim(folder)
    (folder / "design.yaml").write_text(yaml.safe_dump({**raw, "shared_through": 2}))
    with pytest.raises(SystemExit, match=r"design.yaml: shared_through 2; expected 1 .* or 0"):
        load_claim(folder)


def test_a_batch_runs_both_arms_from_one_base_sharing_what_the_design_says(tmp_path, monkeypatch):
    """run_batch hands bench.learning the claim's two arms, its overrides and `shared_through` (0 for arms whose
    rollouts differ from the first iteration, e.g. branching), and records each run the moment it ends: a run
    that evaluated its last iteration as ok with its own wall time, one that failed as crashed, and one that never
    ran as crashed when the batch ends."""
    import json

    import polars as pl
    import yaml

    from bench import campaign, learning

    folder = _claim_folder(tmp_path)
    raw = yaml.safe_load((folder / "design.yaml").read_text())
    raw["arms"]["other"] = ["rloo"]
    (folder / "design.yaml").write_text(yaml.safe_dump({**raw, "shared_through": 0, "sets": ["loop.iterations=1"]}))
    calls = []

    def fake_run_all(*a, on_done):
        calls.append(a)
        work = a[3]
        ok = work / "gigpo_s3"              # evaluated its last iteration (1)
        for it in (0, 1):
            (ok / "results" / f"iter_{it}").mkdir(parents=True)
            pl.DataFrame({"task_id": [5], "success": [it == 1], "episode_id": [0]}).write_parquet(
                ok / "results" / f"iter_{it}" / "eval.parquet")
        (ok / "params.yaml").write_text(yaml.safe_dump({"loop": {"iterations": 1}}))
        on_done(ok, None, 12.5)
        assert json.loads((folder / "runs" / "gigpo_s3" / "run.json").read_text())["status"] == "ok"   # at once
        on_done(work / "grpo_s3", RuntimeError("snakemake failed"), 3.0)
        raise RuntimeError("1 of 2 runs failed")

    monkeypatch.setattr(learning, "run_all", fake_run_all)
    monkeypatch.setattr(campaign, "task_success", lambda results, its: pl.DataFrame(
        {"iteration": its, "task_id": [5] * len(its), "success": [float(i == 1) for i in its]}))
    claim = campaign.load_claim(folder)
    (tmp_path / "b").mkdir()
    assert claim.shared_through == 0 and campaign.load_claim(_claim_folder(tmp_path / "b")).shared_through == 1
    campaign.run_batch([claim], [3, 4], tmp_path / "work", jobs=2, cores=1)
    (_, _, seeds, _, _, _, sets, arms, through), = calls
    assert seeds == [3, 4] and sets == ["loop.iterations=1"] and through == 0
    assert arms == {"gigpo": ("gigpo", []), "grpo": ("grpo", [])}          # not the third arm
    status = {d.name: json.loads((d / "run.json").read_text()) for d in (folder / "runs").iterdir()}
    assert {k: v["status"] for k, v in status.items()} == {"gigpo_s3": "ok", "grpo_s3": "crashed",
                                                           "gigpo_s4": "crashed", "grpo_s4": "crashed"}
    assert status["gigpo_s3"]["wall_s"] == 12.5 and status["gigpo_s3"]["iterations"] == [0, 1]


def _second_claim(tmp_path, name, arms, **extra):
    import yaml

    folder = tmp_path / name
    folder.mkdir()
    method, baseline = arms
    (folder / "design.yaml").write_text(yaml.safe_dump({
        "claim": name, "method": method, "baseline": baseline, "metric": "auc", "looks": [8, 12],
        "params": "params.yaml", "arms": arms, **extra}))
    return folder


def test_claims_from_one_config_share_each_seeds_base_and_their_common_arms(tmp_path, monkeypatch):
    """GiGPO against GRPO and OPRL against GRPO on one config: three runs a seed, not four. The GRPO run is
    recorded under both claims, each naming the other in `shared_with`; a third claim whose arm is labelled
    `grpo` but runs other overrides gets a run of its own, `<claim>.grpo`. Claims that start from different
    configs are refused before any run."""
    import json

    import polars as pl
    import yaml

    from bench import campaign, learning

    a = campaign.load_claim(_claim_folder(tmp_path))
    b = campaign.load_claim(_second_claim(tmp_path, "oprl", {"oprl": ["oprl"], "grpo": ["grpo"]}))
    c = campaign.load_claim(_second_claim(tmp_path, "kl", {"gigpo": ["gigpo"], "grpo": ["grpo", "update.kl_coef=0"]}))
    runs = campaign.shared_runs([a, b, c])
    assert {k: (m, o, [(x.design.claim, lab) for x, lab in u]) for k, (m, o, u) in runs.items()} == {
        "gigpo": ("gigpo", [], [("gigpo-sokoban", "gigpo"), ("kl", "gigpo")]),
        "grpo": ("grpo", [], [("gigpo-sokoban", "grpo"), ("oprl", "grpo")]),
        "oprl": ("oprl", [], [("oprl", "oprl")]),
        "kl.grpo": ("grpo", ["update.kl_coef=0"], [("kl", "grpo")])}

    calls = []

    def fake_run_all(*args, on_done):
        calls.append(args)
        for name in args[7]:
            d = args[3] / f"{name}_s0"
            for it in (0, 1):
                (d / "results" / f"iter_{it}").mkdir(parents=True)
                (d / "results" / f"iter_{it}" / "eval.parquet").write_bytes(b"")
            (d / "params.yaml").write_text(yaml.safe_dump({"loop": {"iterations": 1}}))
            on_done(d, None, 10.0)

    monkeypatch.setattr(learning, "run_all", fake_run_all)
    monkeypatch.setattr(campaign, "evaluated_iterations", lambda results: [0, 1])
    monkeypatch.setattr(campaign, "task_success", lambda results, its: pl.DataFrame(
        {"iteration": its, "task_id": [5] * len(its), "success": [0.5] * len(its)}))
    campaign.run_batch([a, b], [0], tmp_path / "work", jobs=2, cores=1)
    (_, _, seeds, _, _, _, _, arms, _), = calls
    assert seeds == [0] and arms == {"gigpo": ("gigpo", []), "grpo": ("grpo", []), "oprl": ("oprl", [])}
    runs_json = {f"{x.design.claim}/{d.name}": json.loads((d / "run.json").read_text())
                 for x in (a, b) for d in sorted((x.folder / "runs").iterdir())}
    assert {k: (v["status"], v.get("shared_with")) for k, v in runs_json.items()} == {
        "gigpo-sokoban/gigpo_s0": ("ok", None), "gigpo-sokoban/grpo_s0": ("ok", ["oprl"]),
        "oprl/grpo_s0": ("ok", ["gigpo-sokoban"]), "oprl/oprl_s0": ("ok", None)}

    other = _second_claim(tmp_path, "sql", {"gigpo": ["gigpo"], "grpo": ["grpo"]}, sets=["loop.iterations=1"])
    with pytest.raises(SystemExit, match=r"claims gigpo-sokoban and sql differ in sets \(\(\), \('loop.iterations=1',\)\)"):
        campaign.together([a, campaign.load_claim(other)])


def test_seeds_needed_by_the_same_claims_form_one_batch(tmp_path):
    """Seeds 0-2 are needed by both claims and run from one base each; seeds 3-4 only by the second, which runs
    them alone; the order is the first claim's."""
    from bench import campaign

    a = campaign.load_claim(_claim_folder(tmp_path))
    b = campaign.load_claim(_second_claim(tmp_path, "oprl", {"oprl": ["oprl"], "grpo": ["grpo"]}))
    steps = campaign.plan([a, b], {"gigpo-sokoban": [2, 0, 1], "oprl": [0, 1, 2, 3, 4]})
    assert [([c.design.claim for c in cs], seeds) for cs, seeds in steps] == [
        (["gigpo-sokoban", "oprl"], [2, 0, 1]), (["oprl"], [3, 4])]
    assert campaign.plan([a, b], {"gigpo-sokoban": [], "oprl": []}) == []


def test_secondary_arms_run_on_the_same_seeds_and_are_reported_outside_the_stopping_rule(tmp_path, capsys):
    """A secondary arm (rloo) runs on every seed of the batch beside the claim's two and the claim's method is
    compared with it on the paired seeds, final success, by hand: seed 0 gigpo [0.75, 0.75] against rloo [0.5, 1.0]
    (0 points), seed 1 [0.75, 0.75] against [0.25, 0.25] (+50): mean +25; the se adds the seeds' variance 1250 / 2
    and the panel's (tasks +37.5 and +12.5 averaged over seeds: variance 312.5 over 2 tasks), t with 1 df; all 4
    sign patterns reach |mean| 25: p = 1. Seed 2's rloo ran on another machine: left out, and said so."""
    import yaml

    from bench import campaign

    folder = _claim_folder(tmp_path)
    raw = yaml.safe_load((folder / "design.yaml").read_text())
    for bad, match in (({"secondary": ["grpo"]}, "secondary arm 'grpo' is not an arm of its own"),
                       ({"secondary": ["ppo"]}, "secondary arm 'ppo' is not an arm of its own"),
                       ({"secondary": "rloo"}, "secondary 'rloo'; expected a list")):
        (folder / "design.yaml").write_text(yaml.safe_dump({**raw, "arms": {**raw["arms"], "rloo": ["rloo"]}, **bad}))
        with pytest.raises(SystemExit, match=match):
            campaign.load_claim(folder)
    (folder / "design.yaml").write_text(yaml.safe_dump({**raw, "arms": {**raw["arms"], "rloo": ["rloo"]},
                                                        "secondary": ["rloo"]}))
    claim = campaign.load_claim(folder)
    assert claim.labels == ("gigpo", "grpo", "rloo")
    for s in range(3):
        _record(folder, "gigpo", s, [0.75, 0.75])
        _record(folder, "grpo", s, [0.5, 0.5])
    _record(folder, "rloo", 0, [0.5, 1.0])
    _record(folder, "rloo", 1, [0.25, 0.25])
    _record(folder, "rloo", 2, [1.0, 1.0], cpu="Intel Xeon")
    runs = campaign.recorded(claim)
    assert campaign.next_batch(claim, runs) == list(range(3, 8))
    del runs[("rloo", 1)]
    assert campaign.next_batch(claim, runs) == [1, *range(3, 8)]      # a seed missing its secondary arm runs again

    assert campaign.report(claim) == []                                # no look before 8 seeds
    out = capsys.readouterr().out
    assert "Left out: rloo seed 2 ran on another machine." in out and "gigpo − rloo" in out
    row = pl.read_csv(folder / "secondary.csv").filter(pl.col("metric") == "final").row(0, named=True)
    se = math.sqrt(1250 / 2 + 312.5 / 2)
    h = stats.t.ppf(0.975, 1) * se
    assert (row["method"], row["baseline"], row["seeds"], row["primary"]) == ("gigpo", "rloo", 2, True)
    assert row["diff"] == pytest.approx(25.0)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((25.0 - h, 25.0 + h))
    assert row["p_value"] == 1.0 and row["verdict"] == "undecided"


@pytest.mark.parametrize("claim", sorted(p.parent.name for p in CLAIMS.glob("*/design.yaml")))
def test_every_committed_design_loads_and_its_arms_validate(claim):
    """The designs in docs/data/claims are fixed before their runs: each loads, and both arms' params (the config,
    the design's overrides, the arm's method and overrides) pass the checks a run makes before any work, and so do
    its secondary arms'."""
    from bench.campaign import load_claim
    from pipeline.config.params import check_dependencies, load_params

    c = load_claim(CLAIMS / claim)
    for label in c.labels:
        method, *own = c.arms[label]
        check_dependencies(load_params(c.params, [*c.sets, f"credit.method={method}", *own]), c.params)
