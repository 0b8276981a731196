"""Environments, one module each, registered by name (`base`), and the action tag they parse (`actions`).
Imports only `pipeline.data`."""

from pipeline.envs.base import Env, EnvSpec, Observation, StepResult, has, make_env, register, require

__all__ = ["Env", "EnvSpec", "Observation", "StepResult", "has", "make_env", "register", "require"]
