"""The one stage registry: the Snakefile builds its rules from it and `dvc.yaml` is generated from it.

Paths are templates: `{it}` is the iteration, `{prev}` the iteration before it, `{src}` the one whose checkpoint
samples iteration `{it}`'s rollout. Iteration 0 is the initial policy (`init` writes its checkpoint); iteration
i >= 1 rolls out with the checkpoint of i-1 (of i-2 with `loop.off_policy_lag: 1`, so that rollout i+1 and update i
depend on the same checkpoint and run side by side), groups, computes advantages and updates the checkpoint of i-1
into that of i; `evaluate` scores every iteration's checkpoint, 0 included, on held-out tasks. A path ending in `/`
is a folder (a checkpoint).
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

from pipeline.config.params import Params, PromptConfig
from pipeline.credit.methods import METHODS, history_params
from pipeline.data.paths import (
    ADVANTAGES,
    CHECKPOINT,
    EVAL,
    EVAL_METRICS,
    FIT_METRICS,
    GROUPS,
    INITIAL_CHECKPOINT,
    ITER_DIR,
    PAIRS,
    PREV_CHECKPOINT,
    PREV_ITER_DIR,
    PREV_REWARD_MODEL,
    REPORT,
    REPORT_DIFFICULTY,
    REPORT_METRICS,
    REWARD_MODEL,
    ROLLOUT_CHECKPOINT,
    STEP_REWARDS,
    STEPS,
    at,
    fill,
    shard_table,
    strip_dir,
)


@dataclass(frozen=True)
class When:
    """A dependency, output or params key that exists only for some params (e.g. only for SPA)."""
    item: str
    cond: Callable[[Params], bool]


@dataclass(frozen=True)
class Named:
    """A dependency outside the run's folder whose path the params give (the user's model file or folder), so
    that replacing it reruns the stage in both tools; none where `get` returns None."""
    get: Callable[[Params], str | None]


def policy_source(p: Params) -> str | None:
    """The model `init` imports (`policy.path`: a GGUF file or a model folder), as the params spell it."""
    return None if p.policy.path is None else strip_dir(os.path.expanduser(p.policy.path))


def needs_fit(p: Params) -> bool:
    return p.credit.needs_fit


def step_dpo(p: Params) -> bool:
    return p.update.objective == "step_dpo"


def oracle_margin(p: Params) -> bool:
    return step_dpo(p) and p.update.step_dpo.margin == "oracle"


def credit_oracle(p: Params) -> bool:
    return p.report.credit_oracle


def lagged(p: Params) -> bool:
    return p.loop.off_policy_lag > 0


def method_is(name: str) -> Callable[[Params], bool]:
    return lambda p: p.credit.method == name


Entry = str | When | Named


def _prompt_follows(p: Params) -> bool:
    return p.warmstart.demonstrations is None


def _warmstart_pool(p: Params) -> bool:
    return bool(p.warmstart.demonstrations)


# the prompt keys of the initial policy: all of `prompt`, or, where `warmstart.demonstrations` sets the warm start's
# own count, all but the retrieved demonstrations' (their pool only where the warm start shows some)
_INIT_PROMPT = (When("prompt", _prompt_follows),
                *(When(f"prompt.{k}", lambda p: not _prompt_follows(p)) for k in PromptConfig.model_fields
                  if k not in ("demonstrations", "demonstration_pool")),
                When("prompt.demonstration_pool", _warmstart_pool))


def _init_view(p: Params) -> Params:
    """The initial policy's params with the warm start's own demonstration count written as the prompt's and
    `warmstart.demonstrations` null: the warm start then hashes alike whether the count is set there or followed
    from `prompt.demonstrations` (a run with `warmstart.demonstrations: 0` and demonstrations in its RL prompts
    reuses, through `run.base`, the initial policy of a run without any). A warm start without demonstrations
    never reads their pool, which the view leaves at its default."""
    if p.warmstart.demonstrations is None:
        return p
    shown = {"demonstrations": p.warmstart.demonstrations}
    if not p.warmstart.demonstrations:
        shown["demonstration_pool"] = PromptConfig.model_fields["demonstration_pool"].default
    prompt = p.prompt.model_copy(update=shown)
    warm = p.warmstart.model_copy(update={"demonstrations": None})
    return p.model_copy(update={"prompt": prompt, "warmstart": warm})


def resolve(entries: tuple[Entry, ...], params: Params) -> list[str]:
    out = []
    for e in entries:
        if isinstance(e, Named):
            path = e.get(params)
            if path is not None:
                out.append(path)
        elif not isinstance(e, When):
            out.append(e)
        elif e.cond(params):
            out.append(e.item)
    return out


def named_inputs(stage: Stage, params: Params) -> list[str]:
    """The stage's dependencies that the params name (outside the run's folder, made by no stage)."""
    return resolve(tuple(e for e in stage.deps if isinstance(e, Named)), params)


@dataclass(frozen=True)
class Stage:
    name: str
    first: int | None          # first iteration it runs for; None: runs once, not per iteration
    deps: tuple[Entry, ...]    # templates over {it} / {prev}
    outs: tuple[Entry, ...]
    params: tuple[Entry, ...]  # params.yaml sections or dotted keys whose change reruns it
    deps_all: tuple[str, ...] = ()  # outputs of another stage, at every iteration that stage writes them
    deps_trained: tuple[Entry, ...] = ()  # templates expanded over the RL iterations 1..N
    metrics: tuple[str, ...] = ()   # outputs DVC shows as metrics (`dvc exp show`), not cached
    plots: tuple[str, ...] = ()     # outputs DVC draws as plots (`dvc plots show`), not cached
    # cores Snakemake gives the job. init, fit and update are alone on the critical path and take 2; rollout of
    # i+1 and evaluate of i run side by side, 1 each
    threads: int = 1
    # its cores with `loop.off_policy_lag: 1`, where fit and update of i run beside rollout i+1 (None: `threads`)
    overlap_threads: int | None = None
    code: tuple[str, ...] = field(default=())  # extra code files beyond what its module imports (`code_for`)
    enabled: Callable[[Params], bool] | None = None  # None: always part of the pipeline
    loads_model: bool = False  # holds a policy or step-reward model: asks for the `gpu` resource on a GPU device
    mem_mb: int = 4000         # default memory and wall time (minutes) a cluster job asks for (runtime.resources)
    runtime: int = 60
    shards: Callable[[Params], int] | None = None  # splits into that many shard jobs and a merge job (`expand`)
    role: str = "whole"        # whole | shard (one slice of a sharded stage) | merge (the shards' tables into one)
    module: str | None = None  # stages.<module> runs it; None: the stage's name
    # runs at iteration `first`, every k-th iteration after it and the last (None: every iteration)
    every: Callable[[Params], int] | None = None
    # the params as the stage sees them, for its fingerprint: two settings that run the stage alike hash alike
    # (None: the params as written)
    effective: Callable[[Params], Params] | None = None

    @property
    def per_iteration(self) -> bool:
        return self.first is not None

    def is_enabled(self, params: Params) -> bool:
        return self.enabled is None or self.enabled(params)

    @property
    def base(self) -> str:
        """The registry stage this job belongs to (`rollout` for `rollout_shard`)."""
        return self.module or self.name

    def module_file(self) -> str:
        return f"stages/{self.base}.py"

    def command(self, python: str, params_file: str, it: str | None, shard: str | None = None,
                processes: int = 1) -> str:
        """The job's command line; `processes` > 1 starts the stage under torchrun (`processes_for`)."""
        launch = python if processes == 1 else (
            f"{python} -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node {processes}")
        cmd = f"{launch} -m stages.{self.base} --params {params_file}"
        if it is not None:
            cmd += f" --iteration {it}"
        if self.role == "shard":
            cmd += f" --shard {shard}"
        elif self.role == "merge":
            cmd += " --merge"
        return cmd

    def outs_for(self, params: Params) -> list[str]:
        """Every output: the cached ones, then the metrics and plots files."""
        return [at(params, o) for o in (*resolve(self.outs, params), *self.metrics, *self.plots)]

    def deps_templates(self, params: Params) -> list[str]:
        return [at(params, d) for d in resolve(self.deps, params)]

    def params_for(self, params: Params) -> list[str]:
        return resolve(self.params, params)


_fitting = [m for m in METHODS.values() if m.fits]
# the modules of the methods that declare a grouping depth: the group stage's keys depend on them (not on the others)
_ROOT = Path(__file__).resolve().parents[2]
_history_code = tuple(sorted(str(Path(inspect.getfile(m.terms)).resolve().relative_to(_ROOT))
                             for m in METHODS.values() if m.history_depth is not None))
# each fitting method's own section, and the tables it keeps beside its model (SPA's replay), from the method registry
_method_section = tuple(When(f"credit.{m.name}", method_is(m.name)) for m in _fitting)
# the keys that decide what reward_init builds: whether the model is LoRA adapters (and their shape)
_method_lora = tuple(When(f"credit.{m.name}.lora", method_is(m.name)) for m in _fitting
                     if "lora" in m.config.model_fields)


def _model_tables(folder: str) -> tuple[When, ...]:
    return tuple(When(f"{folder}/{name}", method_is(m.name)) for m in _fitting for name in m.reward_model.extra_tables)


STAGES: tuple[Stage, ...] = (
    Stage("init", None, deps=(Named(policy_source),), outs=(INITIAL_CHECKPOINT,),
          params=("seed", "env", *_INIT_PROMPT, "policy.path", "policy.tiny", "policy.max_new_tokens", "policy.dtype",
                  "warmstart", "runtime.device"), threads=2, loads_model=True, effective=_init_view),
    # The learned step-reward model before any RL: a copy of the initial policy (OPRL) or the initial policy's
    # body with a fresh scalar head (SPA), and SPA's empty replay.
    Stage("reward_init", None, deps=(INITIAL_CHECKPOINT,),
          outs=("results/iter_0/reward_model/", *_model_tables("results/iter_0")),
          params=("seed", "credit.method", *_method_lora), enabled=needs_fit, loads_model=True),
    Stage("rollout", 1, deps=(ROLLOUT_CHECKPOINT,), outs=(STEPS,),
          params=("seed", "env", "prompt", "policy.max_new_tokens", "policy.dtype", "rollout", "runtime.device"),
          loads_model=True,
          shards=lambda p: p.rollout.shards),
    Stage("group", 1, deps=(STEPS,), outs=(GROUPS,), params=("prompt.history_turns", *history_params()),
          code=_history_code,
          mem_mb=2000, runtime=30),
    # the policy that sampled the turns (OPRL's π_old), and the initial policy: OPRL reports how far the PRM and the
    # policy have drifted from it
    Stage("fit", 1, deps=(STEPS, ROLLOUT_CHECKPOINT, INITIAL_CHECKPOINT, PREV_REWARD_MODEL,
                          *_model_tables(PREV_ITER_DIR)),
          outs=(REWARD_MODEL, STEP_REWARDS, FIT_METRICS, *_model_tables(ITER_DIR)),
          params=("seed", "credit.method", *_method_section, "policy.dtype", "runtime.device"), threads=2,
          overlap_threads=1, enabled=needs_fit, loads_model=True),
    Stage("advantages", 1, deps=(STEPS, GROUPS, When(STEP_REWARDS, needs_fit)), outs=(ADVANTAGES,),
          params=("credit",), mem_mb=2000, runtime=30),
    # update.objective step_dpo: pairs of turns of one state, ranked by the method's step values; the environment
    # replays them where the margin is the oracle's
    Stage("pairs", 1, deps=(STEPS, GROUPS, When(STEP_REWARDS, needs_fit)), outs=(PAIRS,),
          params=("credit", "update.step_dpo", When("env", oracle_margin)), enabled=step_dpo, mem_mb=2000,
          runtime=30),
    # log-probs are taken at the sampling temperature (docs/credit-assignment.md, Policy update); one step off-policy,
    # the behaviour policy's checkpoint too (One step off-policy)
    Stage("update", 1, deps=(PREV_CHECKPOINT, When(ROLLOUT_CHECKPOINT, lagged), STEPS, ADVANTAGES,
                             When(PAIRS, step_dpo)), outs=(CHECKPOINT,),
          params=("seed", "update", "rollout.temperature", "credit.attribution", "policy.lora", "policy.dtype",
                  "runtime.device", "runtime.update_processes", "runtime.update_sharding"), threads=2,
          overlap_threads=1, loads_model=True),
    Stage("evaluate", 0, deps=(CHECKPOINT,), outs=(EVAL, EVAL_METRICS),
          params=("seed", "env", "prompt", "policy.max_new_tokens", "rollout.engine", "rollout.vllm",
                  "rollout.batch_size", "evaluate", "policy.dtype", "runtime.device"),
          loads_model=True, shards=lambda p: p.evaluate.shards, every=lambda p: p.evaluate.every),
    # the run's own credit quality against the environment's oracle, where `report.credit_oracle` asks for it
    Stage("report", None, deps=(), outs=(REPORT[1], *REPORT_DIFFICULTY),
          params=("report", When("env", credit_oracle)), deps_all=(EVAL_METRICS, EVAL), metrics=(REPORT_METRICS,),
          plots=(REPORT[0],), mem_mb=2000, runtime=30,
          deps_trained=(*(When(t, credit_oracle) for t in (STEPS, GROUPS, ADVANTAGES)),
                        When(STEP_REWARDS, lambda p: credit_oracle(p) and needs_fit(p)))),
)

STAGE_BY_NAME = {s.name: s for s in STAGES}


def expand(stage: Stage, params: Params) -> list[Stage]:
    """The jobs' stages of a registry stage: itself, or for N > 1 shards a `<name>_shard` stage (one job per
    iteration and shard, each writing its slice's step table) and the merge, which keeps the stage's name and
    outputs and reads the N tables."""
    n = stage.shards(params) if stage.shards is not None else 1
    if n == 1:
        return [stage]
    table = shard_table(stage.name)
    shard = replace(stage, name=f"{stage.name}_shard", outs=(table,), metrics=(), plots=(), shards=None,
                    role="shard", module=stage.name)
    merge = replace(stage, deps=tuple(table.replace("{shard}", str(k)) for k in range(n)), threads=1,
                    loads_model=False, mem_mb=2000, runtime=30, shards=None, role="merge", module=stage.name)
    return [shard, merge]


def enabled_stages(params: Params) -> list[Stage]:
    """Every job's stage of the pipeline for these params, in order (sharded stages expanded)."""
    return [e for s in STAGES if s.is_enabled(params) for e in expand(s, params)]


def shard_ids(stage: Stage, params: Params) -> list[int]:
    """The shard indices of a shard stage's jobs (per iteration)."""
    return list(range(STAGE_BY_NAME[stage.base].shards(params))) if stage.role == "shard" else []


def iterations(params: Params) -> list[int]:
    return list(range(params.loop.iterations + 1))


def stage_iterations(stage: Stage, params: Params) -> list[int]:
    """The iterations the stage has a job for: from its first on, or every k-th from it and the last
    (`Stage.every`, the evaluation's `evaluate.every`)."""
    if not stage.per_iteration:
        return []
    its = [i for i in iterations(params) if i >= stage.first]
    k = stage.every(params) if stage.every is not None else 1
    return [i for i in its if (i - stage.first) % k == 0 or i == its[-1]]


def made_at(template: str, params: Params) -> list[int]:
    """The iterations at which a stage writes `template`, one of its outputs (`EVAL_METRICS`: the evaluated
    iterations, `evaluate.every`)."""
    for stage in STAGES:
        if template in stage.outs:
            return stage_iterations(stage, params)
    raise KeyError(f"no stage writes {template}")


def param_value(params: Params, key: str):
    obj = params.model_dump()
    for part in key.split("."):
        obj = obj[part]
    return obj


def params_fingerprint(stage: Stage, params: Params) -> str:
    """A hash of the params this stage depends on (Snakemake reruns the stage when it changes)."""
    view = stage.effective(params) if stage.effective is not None else params
    blob = json.dumps({k: param_value(view, k) for k in stage.params_for(view)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def deps_for(stage: Stage, params: Params, it: int | None) -> list[str]:
    """The stage's input paths for iteration `it`, each once (at iteration 1 the previous checkpoint is the
    initial one)."""
    deps = stage.deps_templates(params)
    lag = params.loop.off_policy_lag
    out = [strip_dir(fill(d, it, lag=lag)) for d in deps] if it is not None else [strip_dir(d) for d in deps]
    for t in stage.deps_all:
        out.extend(strip_dir(fill(at(params, t), i)) for i in made_at(t, params))
    for t in resolve(stage.deps_trained, params):
        out.extend(strip_dir(fill(at(params, t), i)) for i in iterations(params) if i >= 1)
    return list(dict.fromkeys(out))


def uses_gpu(device: str) -> bool:
    """Whether `runtime.device` puts the models on a GPU (`auto`: when torch sees one; torch is imported only
    where an NVIDIA or AMD driver is present, so that planning the DAG stays fast on a CPU machine)."""
    if device == "cpu":
        return False
    if device != "auto":
        return True
    if not (Path("/dev/nvidiactl").exists() or Path("/dev/kfd").exists()):
        return False
    import torch  # start-up cost: torch

    return torch.cuda.is_available()


def gpus_for(stage: Stage, params: Params) -> int:
    """The `gpu` resource the stage's job asks Snakemake for: 1 for a stage that loads a model on a GPU, else 0
    (`runtime.resources.<stage>.gpu` overrides it). With `--resources gpu=N` (the default profile sets 1) at
    most N such jobs run at once; the cluster executors ask the scheduler for that many GPUs per job."""
    return resources_for(stage, params)["gpu"]


def job_file(stage: Stage, params: Params, kind: str) -> str:
    """Template of a job's Snakemake log (`kind` "logs") or benchmark ("benchmarks") file."""
    tag = ("{it}_{shard}" if stage.role == "shard" else "{it}") if stage.per_iteration else ""
    ext = "log" if kind == "logs" else "tsv"
    return at(params, f"results/{kind}/{stage.name}{'_' + tag if tag else ''}.{ext}")


def processes_for(stage: Stage, params: Params) -> int:
    """Processes the stage's job starts: `runtime.update_processes` for the update, else 1."""
    return params.runtime.update_processes if stage.name == "update" else 1


def resources_for(stage: Stage, params: Params) -> dict[str, int]:
    """What the stage's job declares to Snakemake: threads, mem_mb, runtime (minutes) and gpu. The registry's
    defaults suit the tiny policy; `runtime.resources.<stage>` (by the registry's stage name, shards included)
    overrides any of them. A merge job keeps its own small defaults."""
    procs = processes_for(stage, params)
    threads = stage.overlap_threads if lagged(params) and stage.overlap_threads is not None else stage.threads
    out = {"threads": threads, "mem_mb": stage.mem_mb, "runtime": stage.runtime,
           "gpu": procs if stage.loads_model and uses_gpu(params.runtime.device) else 0}
    if stage.role != "merge":
        own = getattr(params.runtime.resources, stage.base)
        if own is not None:
            out.update({k: v for k, v in own.model_dump().items() if v is not None})
    return out


CODE_ROOT = _ROOT   # the checkout whose `pipeline` and `stages` run the stages
# Modules every stage imports for its plumbing (params schema, this registry, command line, MLflow, threads); a
# change to them changes outputs only through params, which are dependencies of their own.
PLUMBING = frozenset({"pipeline.config.params", "pipeline.workflow.registry", "pipeline.workflow.cli",
                      "pipeline.workflow.tracking", "pipeline.workflow.threads", "pipeline.data.section",
                      # how a stage's process starts, not what it computes
                      "pipeline.workflow.forkserver", "pipeline.workflow.launcher", "pipeline.config.allocator",
                      # the layers' packages: a docstring each, no code
                      "pipeline", "pipeline.data", "pipeline.model", "pipeline.rollout", "pipeline.credit",
                      "pipeline.config", "pipeline.workflow"})


def _module_file(name: str) -> Path | None:
    p = CODE_ROOT.joinpath(*name.split("."))
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return p.with_suffix(".py") if p.with_suffix(".py").is_file() else None


def _statements(body):
    """Every statement of `body`, nested ones too (functions, classes, branches, loops, with, try), and no
    expression: imports are statements, and walking the expressions too cost most of a stage's start-up check."""
    for node in body:
        yield node
        for attr in ("body", "orelse", "finalbody"):
            yield from _statements(getattr(node, attr, ()))
        for handler in getattr(node, "handlers", ()):
            yield from _statements(handler.body)
        for case in getattr(node, "cases", ()):
            yield from _statements(case.body)


@cache
def _imports(name: str) -> frozenset[str]:
    """The project modules `name` imports, anywhere in it (function-level imports too), with the packages they lie
    in. A package a name is taken from (`from pipeline.credit.methods import METHODS`) counts as all of its
    modules and subpackages: the method and environment registries import their members by name."""
    found: set[str] = set()
    whole: set[str] = set()   # packages something is taken from
    source = _module_file(name).read_text()
    if "pkgutil.iter_modules" in source:   # a registry that imports every module of its package
        whole.add(name if _module_file(name).name == "__init__.py" else name.rsplit(".", 1)[0])
    for node in _statements(ast.parse(source).body):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if _module_file(sub) is not None:
                    found.add(sub)
                else:
                    whole.add(node.module)
    out: set[str] = set()
    for m in found:
        parts = m.split(".")
        if parts[0] not in ("pipeline", "stages") or _module_file(m) is None:
            continue
        out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1) if _module_file(".".join(parts[:i]))}
    for pkg in whole:
        f = _module_file(pkg) if pkg.split(".")[0] in ("pipeline", "stages") else None
        if f is not None and f.name == "__init__.py" and pkg.count(".") >= 1:
            # its modules, and its subpackages whole (an environment with several parts is a package)
            out |= {f"{pkg}.{g.stem}" for g in f.parent.glob("*.py") if g.stem != "__init__"}
            out |= {f"{pkg}.{g.parent.name}" + ("" if g.stem == "__init__" else f".{g.stem}")
                    for g in f.parent.glob("*/*.py") if (g.parent / "__init__.py").is_file()}
    return frozenset(out)


@cache
def _code_files(module: str) -> tuple[str, ...]:
    seen: set[str] = set()
    todo = [f"stages.{module}", "stages"]
    while todo:
        m = todo.pop()
        if m not in seen and m not in PLUMBING:
            seen.add(m)
            todo.extend(_imports(m))
    return tuple(sorted(str(_module_file(m).relative_to(CODE_ROOT)) for m in seen))


def code_for(stage: Stage) -> list[str]:
    """The code a stage's job runs, relative to the checkout: its module and every project module it imports,
    transitively, less the plumbing (`PLUMBING`). Snakemake and DVC both take it as the job's code dependencies,
    so editing, say, a credit method marks advantages and what follows as stale, and not the rollouts."""
    return [*_code_files(stage.base), *stage.code]


def code_inputs(stage: Stage) -> list[str]:
    """`code_for` as the Snakefile names the job's code inputs: relative when the workflow runs in the checkout,
    else where the imported `pipeline` lives."""
    here = Path.cwd().resolve() == CODE_ROOT
    return code_for(stage) if here else [str(CODE_ROOT / f) for f in code_for(stage)]


def final_targets(params: Params) -> list[str]:
    return ([at(params, r) for r in (*REPORT, *REPORT_DIFFICULTY, REPORT_METRICS)]
            + [fill(at(params, EVAL_METRICS), i) for i in made_at(EVAL_METRICS, params)])
