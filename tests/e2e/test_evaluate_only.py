"""Evaluation only (`python -m stages.evaluate --checkpoint PATH --out DIR`): any local checkpoint, through the
evaluate stage's own code, into a folder of the user's choice. Covered: a project checkpoint (the same table as the
stage's), a LoRA adapter folder (an identity adapter evaluates exactly as its base), a Hugging Face model folder
with a chat template (Qwen2.5-Instruct's layout), and the errors a user can make."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from pipeline.data import tables
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def evaluate_only(cwd, params, checkpoint, out, *extra):
    return subprocess.run([sys.executable, "-m", "stages.evaluate", "--params", str(params), "--checkpoint",
                           str(checkpoint), "--out", str(out), *extra], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})


def frame(path):
    return tables.read_table(path, tables.EVAL_EPISODES)


def test_a_project_checkpoint_evaluates_as_the_stage_did(grpo_run, tmp_path):
    out = tmp_path / "ev"
    r = evaluate_only(tmp_path, grpo_run / "params.yaml", grpo_run / "results/iter_1/checkpoint", out,
                      "--iteration", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert frame(out / "eval.parquet").equals(frame(grpo_run / "results/iter_1/eval.parquet"))
    metrics = json.loads((out / "eval_metrics.json").read_text())
    assert metrics == json.loads((grpo_run / "results/iter_1/eval_metrics.json").read_text())
    logged = [json.loads(x) for x in (out / "evaluate_1.jsonl").read_text().splitlines()]
    assert any(m["metrics"].get("eval/success_rate") == metrics["success_rate"] for m in logged)
    from mlflow import MlflowClient  # tracking on (the tiny params): a run named after the checkpoint

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("creditrl")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`creditrl.checkpoint` LIKE '%iter_1%'")
    assert [x.info.run_name for x in runs] == [f"evaluate {(grpo_run / 'results/iter_1/checkpoint').resolve()}"]
    assert runs[0].data.metrics["eval/success_rate"] == metrics["success_rate"]


def test_a_lora_adapter_folder_evaluates_as_base_plus_adapter(grpo_run, tmp_path):
    """An adapter with B = 0 computes its base exactly, so it evaluates to the stage's table of iteration 0."""
    from pipeline.data.section import LoraSettings
    from pipeline.model.policy import load_policy, save_policy, with_lora

    base = grpo_run / "results/iter_0/checkpoint"
    model, tok = load_policy(base)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_policy(with_lora(model, LoraSettings(r=4, alpha=8), seed=0), tok, adapter, base=base)
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "model.safetensors").exists()
    r = evaluate_only(tmp_path, grpo_run / "params.yaml", adapter, tmp_path / "ev")
    assert r.returncode == 0, r.stderr[-3000:]
    assert frame(tmp_path / "ev/eval.parquet").equals(frame(grpo_run / "results/iter_0/eval.parquet"))


def test_a_hugging_face_model_folder_with_a_chat_template(qwen_folder, tmp_path):
    params = yaml.safe_load((ROOT / "tests" / "tiny_params.yaml").read_text())
    params["tracking"] = {"enabled": False}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = evaluate_only(tmp_path, tmp_path / "params.yaml", qwen_folder, tmp_path / "ev")
    assert r.returncode == 0, r.stderr[-3000:]
    ev = frame(tmp_path / "ev/eval.parquet")
    assert ev.height == 4 * 2 and ev["task_id"].n_unique() == 4          # evaluate.tasks x episodes_per_task
    assert (ev["iteration"] == 0).all()
    # random weights never write an admissible <action>: every turn is an invalid no-op, every episode runs out
    assert (ev["invalid_turns"] == ev["episode_length"]).all() and (ev["episode_length"] == 4).all()
    assert json.loads((tmp_path / "ev/eval_metrics.json").read_text())["invalid_action_rate"] == 1.0
    assert not (tmp_path / "results").exists()       # nothing of a run's tree is written


@pytest.mark.parametrize("args, status, message", [
    (["--checkpoint", "no/such/folder", "--out", "ev"], 1, "--checkpoint no/such/folder: no such folder"),
    (["--checkpoint", "."], 2, "--checkpoint and --out go together"),
    ([], 2, "the following arguments are required: --iteration"),
])
def test_evaluate_only_refuses_bad_arguments_in_one_line(tmp_path, args, status, message):
    (tmp_path / "params.yaml").write_text((ROOT / "tests" / "tiny_params.yaml").read_text())
    r = subprocess.run([sys.executable, "-m", "stages.evaluate", "--params", "params.yaml", *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == status and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "ev").exists()


def test_a_folder_that_is_no_model_is_named(tmp_path):
    (tmp_path / "params.yaml").write_text((ROOT / "tests" / "tiny_params.yaml").read_text())
    (tmp_path / "empty").mkdir()
    r = evaluate_only(tmp_path, "params.yaml", tmp_path / "empty", tmp_path / "ev")
    assert r.returncode == 1 and "not a Hugging Face model folder (config.json missing)" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "ev/eval.parquet").exists()
