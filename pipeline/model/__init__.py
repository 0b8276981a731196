"""Policies as Hugging Face causal LMs: loading (GGUF files included), saving, LoRA, the tiny model, sampling
engines, PPO, precision, AdamW and its state, the update's processes and FSDP. Imports only `pipeline.data`."""

import sys


class _WithoutUnusedBackends:
    """Import hook: two transformers modules import an optional package at import time whenever it is installed,
    though the project never calls what needs it: assisted decoding imports scikit-learn's metrics (mlflow
    installs scikit-learn, a noticeable share of every model stage's start), and the object-detection losses import
    SciPy's optimiser. Each module is told its package is absent as it is imported.
    Costs nothing otherwise."""

    ABSENT = {"transformers.generation.candidate_generator": "is_sklearn_available",
              "transformers.loss.loss_for_object_detection": "is_scipy_available"}

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name in cls.ABSENT and "transformers.utils" in sys.modules:
            setattr(sys.modules["transformers.utils"], cls.ABSENT[name], lambda: False)
        return None     # the regular finders import the module


sys.meta_path.insert(0, _WithoutUnusedBackends)
