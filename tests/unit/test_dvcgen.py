"""dvc.yaml is generated from the stage registry; the committed file must equal the generator's output."""


import yaml

from pipeline.config.params import load_params
from pipeline.workflow.dvcgen import render
from pipeline.workflow.registry import STAGE_BY_NAME, STAGES, code_for, enabled_stages
from tests.conftest import ROOT


def test_committed_dvc_yaml_matches_generator():
    expected = render(load_params(ROOT / "params.yaml"))
    assert (ROOT / "dvc.yaml").read_text() == expected, "run: python -m pipeline.workflow.dvcgen"


def test_generated_stages_cover_registry_and_iterations():
    p = load_params(ROOT / "params.yaml")
    doc = yaml.safe_load(render(p))["stages"]
    assert list(doc) == [s.name for s in enabled_stages(p)]
    assert list(doc["rollout"]["foreach"]) == list(range(1, p.loop.iterations + 1))
    assert doc["rollout"]["foreach"][3] == {"it": 3, "prev": 2}
    assert list(doc["evaluate"]["foreach"]) == list(range(0, p.loop.iterations + 1))
    assert "results/iter_${item.prev}/checkpoint" in doc["update"]["do"]["deps"]
    assert doc["advantages"]["do"]["params"] == ["credit"]
    # code, every iteration's evaluation, and (report.credit_oracle) the tables of the RL iterations it scores
    code = code_for(STAGE_BY_NAME["report"])
    assert doc["report"]["deps"][:len(code)] == code
    # every iteration's eval_metrics.json and eval.parquet, and with the oracle the RL iterations' three tables
    assert len(doc["report"]["deps"]) == len(code) + 2 * (p.loop.iterations + 1) + 3 * p.loop.iterations
    assert doc["report"]["metrics"] == [{"results/report/metrics.json": {"cache": False}}]
    assert doc["report"]["plots"] == [{"results/report/success_curve.csv": {"cache": False, "x": "iteration",
                                                                            "y": "success_rate"}}]
    off = p.model_copy(update={"report": p.report.model_copy(update={"credit_oracle": False})})
    assert len(yaml.safe_load(render(off))["stages"]["report"]["deps"]) == len(code) + 2 * (p.loop.iterations + 1)


def test_evaluate_every_k_evaluates_iteration_0_every_kth_and_the_last(tmp_path):
    """`evaluate.every: 2` over 5 iterations: evaluations at 0, 2, 4 and 5, and the report and Snakemake's final
    targets read those only."""
    from pipeline.workflow.registry import deps_for, final_targets

    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"loop": {"iterations": 5}, "evaluate": {"every": 2}}))
    p = load_params(f)
    doc = yaml.safe_load(render(p, str(f)))["stages"]
    assert list(doc["evaluate"]["foreach"]) == [0, 2, 4, 5]
    assert list(doc["rollout"]["foreach"]) == [1, 2, 3, 4, 5]
    report = deps_for(STAGE_BY_NAME["report"], p, None)
    assert [d for d in report if d.endswith("eval_metrics.json")] == [
        f"results/iter_{i}/eval_metrics.json" for i in (0, 2, 4, 5)]
    assert [d for d in report if d.endswith("eval.parquet")] == [f"results/iter_{i}/eval.parquet" for i in (0, 2, 4, 5)]
    assert [t for t in final_targets(p) if "eval" in t] == [f"results/iter_{i}/eval_metrics.json" for i in (0, 2, 4, 5)]
    f.write_text(yaml.safe_dump({"loop": {"iterations": 6}, "evaluate": {"every": 3}}))
    assert list(yaml.safe_load(render(load_params(f), str(f)))["stages"]["evaluate"]["foreach"]) == [0, 3, 6]


def test_code_dependencies_are_what_each_stage_imports():
    """Code deps come from the stage modules' imports (function-level ones too), less the plumbing; a registry
    package counts as all its modules. The credit methods are the advantages' and not the rollout's."""
    rollout, advantages = code_for(STAGE_BY_NAME["rollout"]), code_for(STAGE_BY_NAME["advantages"])
    assert {"stages/rollout.py", "pipeline/rollout/episodes.py", "pipeline/model/engines.py",
            "pipeline/model/policy.py", "pipeline/envs/sokoban.py", "pipeline/envs/alfworld/env.py",
            "pipeline/rollout/prompts.py"} <= set(rollout)
    assert not any(f.startswith("pipeline/credit/methods/") for f in rollout)
    assert {"pipeline/credit/methods/gigpo.py", "pipeline/credit/methods/spa.py",
            "pipeline/credit/grouping.py"} <= set(advantages)
    assert "pipeline/config/params.py" not in advantages and "pipeline/workflow/tracking.py" not in rollout
    evaluate = code_for(STAGE_BY_NAME["evaluate"])   # evaluate plays with the rollout's code, not its stage's
    assert {"pipeline/rollout/episodes.py", "pipeline/rollout/shards.py"} <= set(evaluate)
    assert "stages/rollout.py" not in evaluate
    group = code_for(STAGE_BY_NAME["group"])         # HGPO declares the depth of the keys; the others do not
    assert "pipeline/credit/methods/hgpo.py" in group and "pipeline/credit/methods/gigpo.py" not in group
    fit = code_for(STAGE_BY_NAME["fit"])             # the learned step-reward models live in their methods
    assert {"pipeline/credit/methods/oprl.py", "pipeline/credit/methods/spa.py"} <= set(fit)


def test_shards_are_dvc_stages_too(tmp_path):
    """With shards, dvc.yaml has a shard stage per (iteration, shard) and the stage itself becomes the merge."""
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"loop": {"iterations": 2}, "rollout": {"shards": 4, "batch_size": 64},
                                 "runtime": {"update_processes": 2}}))
    doc = yaml.safe_load(render(load_params(f), str(f)))["stages"]
    assert list(doc)[:3] == ["init", "rollout_shard", "rollout"]
    shard = doc["rollout_shard"]
    assert list(shard["foreach"]) == ["1-0", "1-1", "1-2", "1-3", "2-0", "2-1", "2-2", "2-3"]
    assert shard["foreach"]["2-3"] == {"it": 2, "prev": 1, "shard": 3}
    # each command exports the threads its Snakemake rule declares (registry defaults: 1 for a rollout shard)
    assert shard["do"]["cmd"] == (f"CREDITRL_THREADS=1 python -m stages.rollout --params {f} "
                                  "--iteration ${item.it} --shard ${item.shard}")
    assert shard["do"]["outs"] == ["results/iter_${item.it}/shards/rollout_${item.shard}.parquet"]
    assert "results/iter_${item.prev}/checkpoint" in shard["do"]["deps"]
    merge = doc["rollout"]["do"]
    assert merge["cmd"].endswith("--iteration ${item.it} --merge")
    assert [d for d in merge["deps"] if d.startswith("results/")] == [
        f"results/iter_${{item.it}}/shards/rollout_{k}.parquet" for k in range(4)]
    assert merge["outs"] == ["results/iter_${item.it}/steps.parquet"]
    assert "evaluate_shard" not in doc                         # evaluate.shards is 1
    assert doc["update"]["do"]["cmd"].startswith(
        "CREDITRL_THREADS=2 python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2 "
        "-m stages.update")


def test_fit_stages_appear_only_for_methods_with_a_step_reward_model():
    from pipeline.credit.methods import METHODS

    base = load_params(ROOT / "params.yaml")
    assert "oprl" in {n for n, m in METHODS.items() if m.fits}
    for method, definition in METHODS.items():
        fit = definition.fits
        p = base.model_copy(update={"credit": base.credit.model_copy(update={"method": method})})
        doc = yaml.safe_load(render(p))["stages"]
        assert ("fit" in doc) is fit and ("reward_init" in doc) is fit, method
        adv_deps = doc["advantages"]["do"]["deps"]
        assert ("results/iter_${item.it}/step_rewards.parquet" in adv_deps) is fit, method
        if fit:
            fit_deps, fit_outs = doc["fit"]["do"]["deps"], doc["fit"]["do"]["outs"]
            assert "results/iter_${item.prev}/reward_model" in fit_deps and "results/iter_0/checkpoint" in fit_deps
            for table in definition.reward_model.extra_tables:             # SPA's replay.parquet
                assert f"results/iter_${{item.prev}}/{table}" in fit_deps
                assert f"results/iter_${{item.it}}/{table}" in fit_outs
                assert f"results/iter_0/{table}" in doc["reward_init"]["outs"]
            assert doc["fit"]["do"]["params"] == ["seed", "credit.method", f"credit.{method}", "policy.dtype",
                                                      "runtime.device"]
    assert {s.name for s in STAGES} >= {"fit", "reward_init"}


def test_params_yaml_spells_out_every_key_a_dvc_stage_reads():
    """DVC looks each stage's params keys up in params.yaml itself, so none may be left to the schema defaults."""
    from pipeline.config.params import METHOD_NAMES

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    base = load_params(ROOT / "params.yaml")
    for method in METHOD_NAMES:
        p = base.model_copy(update={"credit": base.credit.model_copy(update={"method": method})})
        for stage in enabled_stages(p):
            for key in stage.params_for(p):
                node = raw
                for part in key.split("."):
                    assert isinstance(node, dict) and part in node, f"params.yaml lacks {key} ({stage.name})"
                    node = node[part]


def planned_resources(d, *args: str) -> dict[str, tuple[int, dict[str, str]]]:
    """Each rule's threads and resources in `snakemake -n`'s listing (the first job of each rule)."""
    import re
    import subprocess

    from tests.conftest import SNAKEMAKE

    r = subprocess.run([SNAKEMAKE, "-n", "--cores", "4", *args], cwd=d, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = {}
    for block in re.split(r"\n(?=rule \w+:)", r.stdout):
        m = re.match(r"rule (\w+):", block)
        res = re.search(r"\n\s+resources: ([^\n]*)", block)
        if m and res and m.group(1) not in out and m.group(1) != "all":
            threads = re.search(r"\n\s+threads: (\d+)", block)
            out[m.group(1)] = (int(threads.group(1)) if threads else 1,
                               dict(kv.split("=", 1) for kv in res.group(1).split(", ")))
    return out


def test_model_stages_ask_snakemake_for_the_gpu(tmp_path):
    """With runtime.device a GPU, every job that loads a model asks for gpu=1 and the others for none; on the CPU
    none does. The default profile caps the GPU jobs that run at once at one (a cap per job on a cluster)."""
    from tests.conftest import workflow_files

    workflow_files(tmp_path)
    params = yaml.safe_load((ROOT / "tests" / "tiny_params.yaml").read_text())
    params["credit"] = {"method": "oprl"}       # reward_init and fit load a model too
    asked = {}
    for device in ("cuda", "cpu"):
        params["runtime"] = {"device": device}
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
        asked[device] = {rule: res.get("gpu", "0") for rule, (_, res) in planned_resources(tmp_path).items()}
    assert asked["cuda"] == {"init": "1", "reward_init": "1", "rollout": "1", "fit": "1", "update": "1",
                             "evaluate": "1", "group": "0", "advantages": "0", "report": "0"}
    assert set(asked["cpu"].values()) == {"0"}
    profile = yaml.safe_load((ROOT / "profiles/default/config.yaml").read_text())
    assert profile["resources"] == ["gpu=1"]
    assert 'resource_scopes:\n    gpu="local"' in (ROOT / "Snakefile").read_text()


def test_rules_declare_the_resources_of_params(tmp_path):
    """Every rule declares threads, mem_mb and runtime: the registry's defaults, or `runtime.resources`; shards take
    their stage's entry, the merge its own small one; update_processes GPUs for a multi-process update (a machine
    with 8 GPUs: Snakemake lowers a job's ask to what `--resources` offers)."""
    from tests.conftest import workflow_files

    workflow_files(tmp_path)
    params = yaml.safe_load((ROOT / "tests" / "tiny_params.yaml").read_text())
    params["rollout"].update(batch_size=3, shards=2)
    params["runtime"] = {"device": "cuda", "update_processes": 2,
                         "resources": {"rollout": {"mem_mb": 12000, "runtime": 90, "threads": 4},
                                       "update": {"mem_mb": 64000}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    got = {rule: (threads, {k: res[k] for k in ("mem_mb", "runtime", "gpu") if k in res})
           for rule, (threads, res) in planned_resources(tmp_path, "--resources", "gpu=8").items()}
    assert got["rollout_shard"] == (4, {"mem_mb": "12000", "runtime": "90", "gpu": "1"})
    assert got["rollout"] == (1, {"mem_mb": "2000", "runtime": "30"})          # the merge
    assert got["update"] == (2, {"mem_mb": "64000", "runtime": "60", "gpu": "2"})
    assert got["group"] == (1, {"mem_mb": "2000", "runtime": "30"})
    assert got["init"] == (2, {"mem_mb": "4000", "runtime": "60", "gpu": "1"})
