"""The credit methods, one module each, registered by name (`pipeline.methods.base.Method`).

Every module of this package except `base` and `reward_model` is a method and is imported here, so that adding a
method means adding one module (and its tests): the params schema, the stage registry, the fit stage and the
benchmarks read the registry.
"""

from __future__ import annotations

import importlib
import pkgutil

from pipeline.methods.base import EpisodeConfig, Method, compute, registered

_SUPPORT = {"base", "reward_model"}
for _m in pkgutil.iter_modules(__path__):
    if _m.name not in _SUPPORT:
        importlib.import_module(f"{__name__}.{_m.name}")

METHODS: dict[str, Method] = registered()


def get(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"credit.method: unknown method {name!r}; expected one of {list(METHODS)}")
    return METHODS[name]


def compute_advantages(steps, credit):
    """Advantages of `credit.method` (a validated `credit` section) on `steps`, sorted by (episode_id, step)."""
    method = get(credit.method)
    return compute(method, steps, getattr(credit, method.name), credit.episode, credit.invalid_penalty)


__all__ = ["METHODS", "EpisodeConfig", "Method", "compute_advantages", "get"]
