"""A process that imports `pipeline.model` (every model stage) imports transformers without scikit-learn and SciPy
(the import hook in `pipeline/model/__init__.py`), and its model still computes the same numbers."""

import json
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = """
import importlib.util, json, sys
if {install}:
    import pipeline.model
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import transformers.generation.candidate_generator, transformers.loss.loss_utils   # what imports them
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2))
ids = torch.tensor([[1, 5, 7, 9, 3, 2]])
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
print(json.dumps({{"installed": [importlib.util.find_spec(p) is not None for p in ("sklearn", "scipy")],
                  "imported": [p in sys.modules for p in ("sklearn", "scipy")], "loss": loss.item(),
                  "grad": model.lm_head.weight.grad.abs().sum().item()}}))
"""


def _run(install: bool) -> dict:
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(install=install)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_stages_import_transformers_without_sklearn_and_scipy():
    plain, lean = _run(False), _run(True)
    assert plain["installed"] == lean["installed"] == [True, True]      # installed: transformers would use them
    assert plain["imported"] == [True, True]
    assert lean["imported"] == [False, False]
    assert lean["loss"] == plain["loss"] and lean["grad"] == plain["grad"] > 0    # the same model, the same numbers


def test_the_stages_without_a_model_do_not_import_torch():
    """Every iteration runs them as processes of their own: torch's import (about 1.5 CPU-seconds here) is theirs
    only where they train or sample a model."""
    code = ("import sys, stages.group, stages.advantages, stages.pairs, stages.report, stages.reward_init; "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"
