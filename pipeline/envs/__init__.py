"""Text environments: text in, text out, each state keyed by an anchor string (credit-assignment.md, Terms)."""

from pipeline.envs.base import Env, StepResult, make_env

__all__ = ["Env", "StepResult", "make_env"]
