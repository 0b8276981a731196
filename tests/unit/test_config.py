"""params.yaml validation: one message naming the key and what was expected."""

from pathlib import Path

import pytest
import yaml

from pipeline.config.files import read_params
from pipeline.config.params import Params, ParamsError, load_params
from tests.conftest import ROOT


def write(tmp_path, data) -> Path:
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_default_params_file_is_valid_and_matches_schema_defaults():
    p = load_params(ROOT / "params.yaml")
    assert p.credit.method == "grpo" and p.rollout.group_size == 8 and p.env.max_turns == 15
    assert p.prompt.history_turns == 2 and p.credit.invalid_penalty == 0.1
    assert p.credit.episode.episode_stats == "per_turn" and p.credit.episode.mode == "mean_std_norm"
    # the deliberate differences: OPRL's, SPA's and GAE's learned models set for the tiny policy (README, Step terms on
    # the tiny policy); the schema keeps the papers' values
    tiny = {"oprl": {"lr": 1e-3, "steps": 4}, "spa": {"grounding_w": 0.0, "lr": 3e-3, "epochs": 4},
            "gae": {"lr": 1e-3}}
    paper = Params().credit
    assert (paper.oprl.lr, paper.oprl.steps, paper.spa.grounding_w, paper.gae.lr) == (1e-6, 1, 0.5, 1e-5)
    for method, keys in tiny.items():
        assert getattr(p.credit, method) == getattr(paper, method).model_copy(update=keys)
    credit = p.credit.model_copy(update={m: getattr(paper, m) for m in tiny})
    # the warm start's steps and lr are spelled out for the tiny policy; the schema leaves them to the model
    # (a pretrained folder or GGUF file gets no warm start unless asked, and a small lr when asked)
    assert (p.warmstart.steps, p.warmstart.lr) == (800, 2e-3)
    assert (p.warmstart.steps_for(p.policy), p.warmstart.lr_for(p.policy)) == (800, 2e-3)
    real = p.policy.model_copy(update={"path": "models/x.gguf"})
    assert (Params().warmstart.steps_for(real), Params().warmstart.lr_for(real)) == (0, 1e-5)
    warmstart = p.warmstart.model_copy(update={"steps": None, "lr": None})
    assert p.model_copy(update={"credit": credit, "warmstart": warmstart}) == Params()


@pytest.mark.parametrize("data, fragment", [
    ({"rollout": {"group_sise": 8}}, "key 'rollout.group_sise': unknown key"),
    ({"bogus": 1}, "key 'bogus': unknown key"),
    ({"rollout": {"group_size": "eight"}}, "key 'rollout.group_size'"),
    ({"rollout": {"group_size": -2}}, "key 'rollout.group_size': Input should be greater than or equal to 1"),
    ({"rollout": {"group_size": 1}}, "rollout.group_size is 1, but credit.method 'grpo'"),
    ({"credit": {"method": "ppo-magic"}}, "key 'credit.method'"),
    ({"loop": {"iterations": 0}}, "key 'loop.iterations': Input should be greater than or equal to 1"),
    ({"policy": {"path": "/nonexistent/model"}}, "is not a Hugging Face model folder"),
    ({"update": {"clip_ratio": 1.5}}, "key 'update.clip_ratio'"),
    ({"policy": {"tiny": {"hidden_size": 30, "num_attention_heads": 4}}}, "must be divisible"),
    ({"env": {"name": "chess"}}, "key 'env.name'"),
    ({"env": {"name": "sokoban", "min_solution_moves": 4, "max_solution_moves": 3}},
     "max_solution_moves 3 is below min_solution_moves 4"),
    ({"warmstart": {"random_action_share": 1.2}}, "key 'warmstart.random_action_share'"),
    ({"runtime": {"device": "gpu"}}, "key 'runtime.device'"),
    ({"credit": {"gigpo": {"episode_stats": "per_turn"}}},
     "key 'credit.gigpo.episode_stats': unknown key (not in the schema; check its spelling and section); the "
     "episode level is shared by every method now: set credit.episode.episode_stats"),
    ({"credit": {"grpo": {"mode": "mean_norm"}}}, "set credit.episode.mode"),
    ({"runtime": {"update_sharding": "zero3"}}, "key 'runtime.update_sharding'"),
    ({"update": {"packing": "trie"}}, "key 'update.packing'"),
    ({"update": {"micro_batch_tokens": 2048}}, "micro_batch_tokens 2048 sizes prefix trees: set packing: tree, "
     "or size padded batches with micro_batch_size"),
    ({"credit": {"gae": {"micro_batch_tokens": 4096}}}, "key 'credit.gae': micro_batch_tokens 4096 sizes prefix "
     "trees: set packing: tree, or size padded batches with batch_size"),
    ({"runtime": {"update_sharding": "fsdp", "update_processes": 2}, "policy": {"dtype": "float16"}},
     "runtime.update_sharding: fsdp does not scale fp16 losses across shards; use policy.dtype (or update.dtype) bfloat16"),
])
def test_bad_params_name_the_key(tmp_path, data, fragment):
    path = write(tmp_path, data)
    with pytest.raises(ParamsError) as e:
        load_params(path)
    msg = str(e.value)
    assert str(path) in msg and fragment in msg


@pytest.mark.parametrize("config, fragment", [
    ("{}", "config.json names no model_type, so transformers cannot load the folder as a model"),
    ("{not json", "config.json is not readable JSON"),
])
def test_a_folder_that_is_not_a_loadable_model_is_refused_when_the_params_load(tmp_path, config, fragment):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(config)
    path = write(tmp_path, {"policy": {"path": str(folder)}})
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert str(path) in str(e.value) and "key 'policy'" in str(e.value) and fragment in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ParamsError, match="params file not found"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: [1,\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)


def test_stage_refuses_bad_params_before_any_work(tmp_path):
    import subprocess
    import sys

    path = write(tmp_path, {"rollout": {"group_size": 0}})
    r = subprocess.run([sys.executable, "-m", "stages.init", "--params", str(path)], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "rollout.group_size" in r.stderr
    assert not (tmp_path / "results").exists()


def test_overrides_are_validated_like_a_file():
    from pipeline.config.params import with_overrides

    p = with_overrides(Params(), ["credit.oprl.lr=2e-4", "credit.method=oprl", "credit.gigpo.gamma=0"])
    assert p.credit.oprl.lr == 2e-4 and p.credit.method == "oprl" and p.credit.gigpo.gamma == 0.0
    with pytest.raises(ParamsError, match="key 'credit.oprl.lr': Input should be greater than 0"):
        with_overrides(Params(), ["credit.oprl.lr=-1"])
    with pytest.raises(ParamsError, match="expected KEY=VALUE"):
        with_overrides(Params(), ["credit.oprl.lr"])


def test_a_benchs_overrides_apply_before_the_file_is_validated(tmp_path):
    """`load_params(path, overrides)` validates the file with its overrides: an override mends what the file alone
    is refused for, and a bad override is reported with the file's name."""
    path = write(tmp_path, {"env": {"name": "sokobann"}, "update": {"lr": 3e-4}})
    with pytest.raises(ParamsError, match="unknown env 'sokobann'"):
        load_params(path)
    p = load_params(path, ["env.name=sokoban", "update.lr=1e-5"])
    assert p.env.name == "sokoban" and p.update.lr == 1e-5
    with pytest.raises(ParamsError, match=r"params.yaml with its --set overrides: invalid parameters:\n  key "
                                          r"'update.lr': Input should be greater than 0"):
        load_params(path, ["env.name=sokoban", "update.lr=-1"])


def test_schema_defaults_equal_an_empty_file(tmp_path):
    assert load_params(write(tmp_path, {})) == Params()


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_loads(name, monkeypatch):
    """A shipped config that the schema has moved away from fails here, not in a user's first run (the model paths
    are relative to the repository root, where scripts/install-models puts the GGUF files)."""
    monkeypatch.chdir(ROOT)
    p = load_params(ROOT / "configs" / name)
    raw = read_params(ROOT / "configs" / name)[0]     # its `extends` chain merged
    assert p.env.name == raw["env"]["name"] and p.seed == raw.get("seed", 0)


def test_no_two_shipped_runs_share_a_folder_unless_one_continues_the_other():
    """Every params file of the checkout (params.yaml and configs/) runs into its own run.dir, found by the one
    rule every tool shares (pipeline.workflow.runs.run_folder): two that share one would overwrite each other's
    outputs, unless one continues the other through run.base."""
    from pipeline.workflow.runs import run_folder

    files = [ROOT / "params.yaml", *sorted((ROOT / "configs").glob("*.yaml"))]
    raw = {f: read_params(f)[0] for f in files}
    where = {f: run_folder(Params.model_validate({"run": r.get("run", {})}), f).resolve() for f, r in raw.items()}
    assert where[ROOT / "params.yaml"] == ROOT / "results"
    assert where[ROOT / "configs" / "webshop.yaml"] == ROOT / "results" / "webshop"   # the checkout, not configs/

    def continues(a, b) -> bool:
        base = (raw[a].get("run") or {}).get("base")
        return bool(base) and (ROOT / base["params"]).resolve() == b.resolve()

    shared = [(a.name, b.name) for i, a in enumerate(files) for b in files[i + 1:]
              if where[a] == where[b] and not (continues(a, b) or continues(b, a))]
    assert not shared, f"configs sharing a run.dir: {shared}"


def test_missing_dependencies_are_refused_in_one_line_naming_the_key(monkeypatch, tmp_path):
    """rollout.engine: vllm without vLLM importable is refused before any work (found with find_spec, nothing
    imported), and so is an environment whose engine is missing; a GGUF file that is not there names the script
    that installs it."""
    import importlib.util

    from pipeline.config.params import check_dependencies

    real = importlib.util.find_spec
    hidden = {"vllm", "textworld", "spacy"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a))
    f = write(tmp_path, {"rollout": {"engine": "vllm"}})
    with pytest.raises(ParamsError) as e:
        check_dependencies(load_params(f), f)
    assert str(e.value) == (f"{f}: key 'rollout.engine': vllm, but vLLM is not installed: run scripts/install-vllm "
                            "(docs/models.md, Rollout engines), or set rollout.engine: hf")
    check_dependencies(load_params(write(tmp_path, {})), f)          # hf and sokoban need nothing more
    tw = write(tmp_path, {"env": {"name": "textworld"}})
    with pytest.raises(ParamsError, match=r"key 'env.name': textworld needs .*textworld cannot be imported"):
        check_dependencies(load_params(tw), tw)
    shop = write(tmp_path, {"env": {"name": "webshop"}})
    with pytest.raises(ParamsError, match=r"key 'env.name': webshop needs the bm25s, thefuzz and spacy packages, and "
                       r"spacy cannot be imported"):       # WebShop's reward reads spaCy's stop words
        check_dependencies(load_params(shop), shop)
    monkeypatch.undo()
    gguf = write(tmp_path, {"policy": {"path": str(tmp_path / "absent.gguf")}})
    with pytest.raises(ParamsError, match=r"absent.gguf: no such GGUF file; scripts/install-models installs"):
        load_params(gguf)


@pytest.mark.parametrize("env, held_out", [("sql", 113), ("python", 100), ("search", 1109), ("webshop", 500)])
def test_evaluate_tasks_beyond_the_held_out_list_are_refused(tmp_path, env, held_out):
    """An environment with a fixed list of held-out tasks (the shipped data: 113 SQL questions of the held-out
    databases, 100 problems, 1,109 questions, WebShop's 500 goals) refuses more evaluation tasks than it holds, which
    would play some twice as different tasks; as many is accepted."""
    from pipeline.config.params import check_dependencies, missing_dependencies

    ok = write(tmp_path, {"env": {"name": env}, "evaluate": {"tasks": held_out}})
    assert not [p for p in missing_dependencies(load_params(ok)) if "evaluate.tasks" in p]
    f = write(tmp_path, {"env": {"name": env}, "evaluate": {"tasks": held_out + 1}})
    with pytest.raises(ParamsError, match=rf"key 'evaluate.tasks': {held_out + 1} held-out tasks, but env {env}'s "
                       rf"data holds {held_out}: .* set evaluate.tasks at most {held_out}"):
        check_dependencies(load_params(f), f)


def test_the_snakefile_refuses_a_missing_vllm_at_plan_time(tmp_path):
    """The README's real-model command without vLLM: Snakemake stops while it plans, in one line, before any job."""
    import subprocess
    import sys

    from tests.conftest import workflow_files

    workflow_files(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"rollout": {"engine": "vllm"}}))
    hide = tmp_path / "hide"
    hide.mkdir()
    # a sitecustomize that makes vLLM unfindable, as on a machine without it
    (hide / "sitecustomize.py").write_text(
        "import importlib.util as u\n_f = u.find_spec\n"
        "u.find_spec = lambda n, *a: None if n == 'vllm' else _f(n, *a)\n")
    import os

    r = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "-n"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": f"{hide}:{ROOT}"})
    assert r.returncode != 0
    assert ("error: params.yaml: key 'rollout.engine': vllm, but vLLM is not installed: run scripts/install-vllm"
            in r.stderr), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "results").exists()
