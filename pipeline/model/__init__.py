"""Policies as Hugging Face causal LMs: loading (GGUF files included), saving, LoRA, the tiny model, sampling
engines, PPO, precision, AdamW and its state, the update's processes and FSDP. Imports only `pipeline.data`."""

import sys


class _WithoutSklearn:
    """Import hook: transformers' assisted-decoding module imports scikit-learn's metrics at import time whenever
    scikit-learn is installed (mlflow installs it), about 0.9 s of every model stage's start on a small CPU; the
    project never uses assisted decoding, so that module is told scikit-learn is absent. Costs nothing otherwise."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "transformers.generation.candidate_generator" and "transformers.utils" in sys.modules:
            sys.modules["transformers.utils"].is_sklearn_available = lambda: False
        return None     # the regular finders import the module


sys.meta_path.insert(0, _WithoutSklearn)
