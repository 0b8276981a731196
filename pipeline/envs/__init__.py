"""Environments, one module each, registered by name (`pipeline.envs.base`)."""

from pipeline.envs.base import Env, EnvSpec, Observation, StepResult, has, make_env, register, require

__all__ = ["Env", "EnvSpec", "Observation", "StepResult", "has", "make_env", "register", "require"]
