"""A stage process imports transformers without scikit-learn and SciPy, which no stage uses.

transformers imports `sklearn.metrics` (assisted generation's acceptance threshold) and `scipy.optimize` (the
object-detection losses) whenever the packages are installed, and scikit-learn is installed here (MLflow requires
it), so every model stage paid about 1.3 CPU-seconds of its start-up for them (docs/results.md, the suite's
time). `stages/__init__.py` calls `install` in a process started as `python -m stages.X`: when
`transformers.utils` is first imported, its `is_sklearn_available` and `is_scipy_available` answer False, so
transformers' modules skip those imports as they would on a machine without the packages. Nothing is imported
early (a stage that never imports transformers pays nothing), and the packages stay importable by name.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "transformers.utils"
HIDDEN = ("is_sklearn_available", "is_scipy_available")


def _unavailable() -> bool:
    return False


def _hide(module) -> None:
    for name in HIDDEN:
        if callable(getattr(module, name, None)):
            setattr(module, name, _unavailable)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `_hide` on `transformers.utils` right after its module code has run, then steps aside."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)      # the real finders locate it; this finder is needed once
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _hide(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Hide scikit-learn and SciPy from transformers in this process (no effect once transformers is imported)."""
    if TARGET in sys.modules:
        return
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
