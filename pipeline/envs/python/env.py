"""Agents that compute with a Python interpreter: ARPO's and Tool-Star's code tool (`env.name: python`;
docs/environments.md, Python).

A task is a word problem. Each turn the policy writes `<python>code</python>`, which runs in the sandbox
(`pipeline.envs.sandbox`: a fresh child process, no network, nothing of the machine, rlimits and a wall limit) and
whose stdout and stderr come back capped as `<result>...</result>`, or `<answer>...</answer>`, which ends the
episode. Free text around the tags is allowed; a response with neither tag, both, or an empty one is invalid, a
no-op. Reward 1 when the answer equals the gold one (`same_answer`): integers exactly, decimals and fractions by
value within a relative 1e-9, `\\boxed{}`, `$` and thousands separators accepted; success is that reward.

The state is what the agent has computed: the anchor is the problem and the set of reference results that have
appeared in a result so far. Capabilities, for the shipped problems (and a user's with reference `steps`):
`oracle_distance` (the reference computations whose results have not yet appeared in a result, plus one for the
answer: exact over the actions "run one reference program", checked by brute force in the tests; 0 after a
correct answer, inf after a wrong one), `expert_actions` (the first reference program not yet run, then the
answer), and `gold_answer` (IGPO).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.data.section import EnvSection, Section
from pipeline.data.seeds import fields, task_hash, task_item
from pipeline.envs.actions import ActionFormat, one_tag
from pipeline.envs.base import EnvSpec, Observation, StepResult, data_root, register
from pipeline.envs.python.problems import OUT, Problem, draw, load
from pipeline.envs.sandbox import Limits, run_python, unavailable

_CODE = re.compile(r"<python>(.*?)</python>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NOTHING_YET = "(no program run yet)"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")   # a number as results show it
TOLERANCE = 1e-9   # relative: float noise only (11.85 is 11.850, 1/3 is 0.333333333; 280186.92 is not .91)


class SandboxSettings(Section):
    cpu_s: int = Field(5, ge=1, le=600, description="CPU seconds of one program")
    wall_s: float = Field(10.0, gt=0, le=600, description="wall-clock seconds of one program, its children included")
    memory_mb: int = Field(512, ge=64, le=65536, description="address space of one program")
    processes: int = Field(32, ge=4, le=4096, description="processes of the sandbox's user at once")
    output_chars: int = Field(400, ge=40, le=100_000, description="stdout and stderr shown, each cut at this")


class PythonConfig(EnvSection):
    """Word problems solved with a Python interpreter in a sandbox (the shipped set, or a user's GSM8K or MATH)."""
    name: Literal["python"] = "python"
    data_path: str | None = Field(None, description="a folder with train.jsonl and test.jsonl (the shipped format, "
                                  "GSM8K's or MATH's records); null: the generated problems the project ships "
                                  "(data/python)")
    max_turns: int = Field(5, ge=1, le=100, description="turns before an episode is truncated (programs and the "
                           "answer)")
    train_problems: Literal["shipped", "generated"] = Field(
        "shipped", description="shipped: a training task plays one of the shipped training problems "
        "(data/python/train.jsonl, 600); generated: a problem of the same kinds drawn from the task's seed, never "
        "a held-out question, so that no answer can be learned by heart (the tiny policy learned the 600 training "
        "answers and solved no held-out problem); the held-out problems are the shipped ones either way. Only "
        "without env.data_path")
    sandbox: SandboxSettings = SandboxSettings()

    @field_validator("data_path")
    @classmethod
    def _readable(cls, v):
        _problems(_root(v))          # missing files and malformed records refused when params load
        return v

    @model_validator(mode="after")
    def _generated_from_the_shipped_kinds(self):
        if self.train_problems == "generated" and self.data_path is not None:
            raise ValueError(f"env.train_problems: generated draws problems of the shipped kinds; with env.data_path "
                             f"({self.data_path}) set it to shipped (the folder's train.jsonl is the training set)")
        return self

    @model_validator(mode="after")
    def _sandbox_runs(self):
        why = _sandbox_unavailable()
        if why is not None:
            raise ValueError(f"env python runs the policy's programs in a sandbox, but {why}")
        return self


def _root(data_path: str | None) -> str:
    return str(data_root(data_path, OUT))


@lru_cache(maxsize=1)
def _sandbox_unavailable() -> str | None:
    return unavailable()


@lru_cache(maxsize=4)
def _problems(root: str) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
    return load(Path(root))


# -- answers ------------------------------------------------------------------------------------------------------

def _number(text: str) -> Fraction | None:
    t = text.strip()
    m = re.fullmatch(r"\\boxed\{(.*)\}", t)
    if m:
        t = m.group(1).strip()
    t = t.replace("$", "").replace("\\!", "").strip().rstrip(".")
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", t):
        t = t.replace(",", "")
    frac = re.fullmatch(r"\\[dt]?frac\{([-+]?\d+)\}\{(\d+)\}", t)
    if frac:
        t = f"{frac.group(1)}/{frac.group(2)}"
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(predicted: str, gold: str) -> bool:
    """Whether an answer equals the gold one: by value where both are numbers (integers exactly, decimals and
    fractions within a relative `TOLERANCE`), else as text with spaces removed."""
    p, g = _number(predicted), _number(gold)
    if p is not None and g is not None:
        if p.denominator == 1 and g.denominator == 1:
            return p == g
        return abs(float(p) - float(g)) <= TOLERANCE * max(1.0, abs(float(g)))
    return "".join(predicted.split()) == "".join(gold.split()) != ""


def results_in(text: str) -> set[str]:
    """The numbers a result shows, as the reference results are compared with them."""
    return set(_NUMBER.findall(text))


def parse_response(response: str) -> tuple[str, str] | None:
    """("python" | "answer", content) of a response, or None where it has neither tag, both, or an empty one."""
    found = one_tag(response, {"python": _CODE, "answer": _ANSWER})
    if found is None:
        return None
    kind, raw = found
    content = raw.strip("\n") if kind == "python" else raw.strip()
    return (kind, content) if content.strip() else None


def _render_action(action: str | None) -> str:
    return action if action is not None else "(invalid)"


PYTHON_FORMAT = ActionFormat(
    "Compute with <python>code</python>: the program runs and what it prints comes back in <result>...</result>. "
    "When you know the answer, give it with <answer>number</answer>.", _render_action, list_admissible=False)


class PythonEnv:
    name = "python"
    action_format = PYTHON_FORMAT

    def __init__(self, cfg: PythonConfig, cache_dir: Path | None = None):
        self.cfg = cfg
        self.train, self.test = _problems(_root(cfg.data_path))
        self.held_out = frozenset(p.question for p in self.test)
        s = cfg.sandbox
        self.limits = Limits(cpu_s=s.cpu_s, wall_s=s.wall_s, memory_mb=s.memory_mb, processes=s.processes,
                             output_bytes=4 * s.output_chars)
        self.problem: Problem | None = None

    def problem_of(self, task: int) -> Problem:
        if self.cfg.train_problems == "generated" and fields(task)[0] != "eval":
            return draw(task_hash(task), self.held_out)
        return task_item(task, self.train, self.test)

    def reset(self, task: int) -> Observation:
        self.problem = self.problem_of(task)
        self.turn, self.answer, self.correct, self.text = 0, None, False, NOTHING_YET
        self.seen: set[str] = set()          # numbers that have appeared in results
        return self._observe()

    # reference results whose value has appeared in a result (the computations done)
    def _done(self) -> tuple[bool, ...]:
        return tuple(self._result_of(k) in self.seen for k in range(len(self.problem.steps)))

    def _result_of(self, k: int) -> str:
        return _reference_results(self.problem.steps)[k]

    def anchor(self) -> str:
        done = "".join("1" if d else "0" for d in self._done())
        return f"{self.problem.question} | computed: {done}"

    def admissible(self) -> tuple[str, ...]:
        """Commands for the warm start's random turns (the prompt does not list them): each reference program,
        and an answer with each number of the problem's text and of the results so far (detours)."""
        numbers = dict.fromkeys([*re.findall(r"\d+(?:\.\d+)?", self.problem.question), *sorted(self.seen)])
        return (*(f"<python>{s}</python>" for s in self.problem.steps), *(f"<answer>{n}</answer>" for n in numbers),
                "<python>print(0)</python>")

    def _observe(self) -> Observation:
        return Observation(self.text, self.anchor(), self.admissible())

    def task_description(self) -> str:
        return f"Solve the problem, computing with Python as needed. Problem: {self.problem.question}"

    def step(self, response_text: str) -> StepResult:
        if self.problem is None:
            raise RuntimeError("PythonEnv.step called before reset")
        if self.answer is not None:
            raise RuntimeError("PythonEnv.step called after the episode's answer")
        self.turn += 1
        parsed = parse_response(response_text)
        action, reward, done = None, 0.0, False
        if parsed is not None:
            kind, content = parsed
            action = f"<{kind}>{content}</{kind}>"
            if kind == "python":
                o = run_python(content, self.limits)
                self.text = render(o, self.cfg.sandbox.output_chars)
                self.seen |= results_in(o.stdout)
            else:
                self.answer, done = content, True
                self.correct = same_answer(content, self.problem.answer)
                reward = float(self.correct)
                self.text = f"Answered: {content}"
        obs = self._observe()
        return StepResult(observation=obs.text, anchor=obs.anchor, reward=reward, terminated=done,
                          truncated=not done and self.turn >= self.cfg.max_turns, action_valid=action is not None,
                          success=done and self.correct, action=action, admissible=obs.admissible)

    def gold_answer(self) -> tuple[str, str, str]:
        return "<answer>", self.problem.answer, "</answer>"

    def snapshot(self) -> tuple:
        return self.problem, self.turn, self.answer, self.correct, self.text, frozenset(self.seen)

    def restore(self, snap: tuple) -> None:
        self.problem, self.turn, self.answer, self.correct, self.text, seen = snap
        self.seen = set(seen)


class PlannedPythonEnv(PythonEnv):
    """Problems with reference steps (the shipped ones): an oracle and an expert."""

    def oracle_distance(self) -> float:
        if self.answer is not None:
            return 0.0 if self.correct else math.inf
        return float(sum(not d for d in self._done()) + 1)

    def expert_actions(self) -> list[str]:
        if self.answer is not None:
            return []
        done = self._done()
        if self.turn < self.cfg.max_turns - 1:
            for k, step in enumerate(self.problem.steps):
                if not done[k]:
                    return [f"<python>{step}</python>"]
        return [f"<answer>{self.problem.answer}</answer>"]


def render(o, chars: int) -> str:
    """A program's outcome as the policy reads it."""
    def cut(s: str) -> str:
        s = s.rstrip("\n")
        return s if len(s) <= chars else s[:chars] + "..."
    parts = [cut(o.stdout)] if o.stdout.strip() else []
    if o.stderr.strip():
        parts.append("stderr: " + cut(o.stderr.strip().splitlines()[-1]))
    if o.timed_out:
        parts.append("stopped at the time limit")
    elif o.signal is not None:
        parts.append(f"stopped by signal {o.signal}")
    return "<result>" + ("\n".join(parts) if parts else "(no output)") + "</result>"


@lru_cache(maxsize=8192)
def _reference_results(steps: tuple[str, ...]) -> tuple[str, ...]:
    """What each reference program prints (its last number), computed once per problem in the sandbox."""
    out = []
    for step in steps:
        o = run_python(step, Limits(wall_s=30.0))
        numbers = _NUMBER.findall(o.stdout)
        if o.exit_code != 0 or not numbers:
            raise ValueError(f"a reference program printed no number: {step!r} ({o.stderr.strip()[-200:]})")
        out.append(numbers[-1])
    return tuple(out)


def make(cfg: PythonConfig, cache_dir: Path | None = None) -> PythonEnv:
    train, test = _problems(_root(cfg.data_path))
    planned = all(p.steps for p in (*train, *test))
    return (PlannedPythonEnv if planned else PythonEnv)(cfg, cache_dir)


def lacks(cfg: PythonConfig, capability: str) -> str | None:
    if capability not in ("expert_actions", "oracle_distance"):
        return None
    train, test = _problems(_root(cfg.data_path))
    missing = sum(not p.steps for p in (*train, *test))
    if not missing:
        return None
    return (f"{missing} problems in {_root(cfg.data_path)} carry no reference steps (GSM8K's and MATH's records "
            "have none), so env python has no expert and no oracle")


# The tiny tokenizer keeps every digit a token of its own: copying a <result> into the answer is then one lookup a
# digit, which the tiny policy learns in RL (docs/results/python.md); with merged digit runs it never did.
SPEC = register(EnvSpec("python", PythonConfig, make, requires=(), isolate=r"[0-9]",
                        tool_call=lambda action: action.startswith("<python>"), lacks=lacks,
                        held_out=lambda cfg: len(_problems(_root(cfg.data_path))[1])))
