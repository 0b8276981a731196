"""Runs side by side: a run reuses the outputs of a base run (`run.base`) by linking them, not copying them.

Where a run is (one rule for Snakemake, DVC, the stages and every `bench.*` tool, docs/workflow.md, Where a run's
outputs are): a relative `run.dir` is relative to the run's workflow folder, the folder Snakemake and DVC run in,
which holds the Snakefile. From a params file, that folder is the nearest one at or above the file that holds a
Snakefile (`configs/x.yaml` -> the checkout), or else the working directory (`workflow_dir`, `run_folder`).

The base run is named by its params file, and found by that rule. The base run's jobs of iterations
0..`run.base.through` whose stage params this run shares are reused: each of their outputs is linked into this
run's folder (a file as a symlink, a folder as a real folder of symlinked files), together with the optimiser state
the next job resumes from. A job is reused only when every job it depends on is,
so a change anywhere upstream (another seed, another rollout setting) reuses nothing after it. Snakemake then sees
the outputs in place and plans only the jobs after them.

Links never let this run write into the base: every output is written to a temporary name and renamed over the
link (`pipeline.data.tables`), and deleting a linked folder deletes links only.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.config.params import Params, load_params, resolved_yaml
from pipeline.credit import reward_model
from pipeline.data.paths import INITIAL_CHECKPOINT, ITER_DIR, at, fill, strip_dir
from pipeline.data.tables import write_text_atomic
from pipeline.workflow.records import SNAKEMAKE_STAMP
from pipeline.workflow.registry import enabled_stages, named_inputs, params_fingerprint, resolve, stage_iterations

OPTIMIZER_DIR = ITER_DIR + "/optimizer"
# the optimiser state (OPTIMIZER_DIR/<name>.pt) a job of the next iteration resumes from, by stage: the update's
# (stages/update.py, OPTIMIZER) and a learned step-reward model's fit
RESUMED_STATE = {"update": "policy", "fit": reward_model.OPTIMIZER}


def workflow_dir(params_file: str | Path) -> Path:
    """The folder a run of `params_file` runs in: the nearest folder at or above the file holding a Snakefile, else
    the working directory."""
    for d in Path(params_file).resolve().parents:
        if (d / "Snakefile").is_file():
            return d
    return Path.cwd()


def run_folder(params: Params, params_file: str | Path) -> Path:
    """Where the outputs of the run of `params_file` (`params`, loaded from it) are: its `run.dir` under the run's
    `workflow_dir` (or as it is, when absolute)."""
    return workflow_dir(params_file) / params.run.dir


RESOLVED = "params.resolved.yaml"


def record_params(params_file: str | Path, folder: str | Path) -> Path:
    """`folder/params.resolved.yaml`: the params the run ran with, its `extends` chain merged
    (`python -m pipeline.config.params --resolve`), rewritten only when they changed."""
    out = Path(folder) / RESOLVED
    text = resolved_yaml(params_file)
    if not out.is_file() or out.read_text() != text:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, text)
    return out


def ordered_jobs(params: Params, through: int):
    """(stage, iteration) of the jobs up to iteration `through`, in the order the workflow makes them."""
    for it in range(through + 1):
        for stage in enabled_stages(params):
            if stage.name == "report":
                continue
            if not stage.per_iteration:
                if it == 0:
                    yield stage, None
            elif it in stage_iterations(stage, params):
                yield stage, it


def job_paths(stage, params: Params, it: int | None, templates: list[str], shard: int | None = None) -> list[str]:
    """The job's paths from `templates` (iteration, shard and the rollout's source checkpoint filled in)."""
    lag = params.loop.off_policy_lag
    return [strip_dir(fill(t, it, shard, lag=lag) if it is not None else t) for t in templates]


def _inputs(stage, params: Params, it: int | None) -> list[str]:
    """The job's inputs relative to its run's folder (which checkpoint a rollout reads depends on the lag)."""
    return job_paths(stage, params, it, [d for d in resolve(stage.deps, params) if d.startswith("results/")])


def _link(src: Path, dst: Path) -> int:
    """Link `src` (a file, or a folder's files) at `dst`; returns the files linked. Existing files are kept.

    A folder's Snakemake timestamp is made anew, not linked: linked, it would date the folder to when the base made
    it, older than the links to the inputs it was made from, and Snakemake would run the job again and everything
    after it. It is made once, when the folder is first linked, so that a later Snakemake call (which links again)
    leaves the dates as they were."""
    if src.is_dir():
        n = sum(_link(child, dst / child.name) for child in sorted(src.iterdir()) if child.name != SNAKEMAKE_STAMP)
        if (src / SNAKEMAKE_STAMP).exists() and not (dst / SNAKEMAKE_STAMP).exists():
            dst.mkdir(parents=True, exist_ok=True)
            (dst / SNAKEMAKE_STAMP).touch()
        return n
    if dst.exists() or dst.is_symlink():
        return 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(src.resolve(), dst)
    return 1


def _same_precision(params: Params, base: Params, root: Path) -> None:
    """With `policy.dtype: auto` in both, the base's initial policy must have been computed in the dtype `auto` is
    on this machine (the init stage's record, `pipeline.model.precision`): a run never continues another's in
    another precision. A base without a record, or a device this machine cannot see, is not checked."""
    if params.policy.dtype != "auto" or base.policy.dtype != "auto":
        return          # explicit dtypes: a difference is a difference of params, and nothing is reused
    from pipeline.model.policy import resolve_params  # start-up cost: torch, only for an auto run.base
    from pipeline.model.precision import RECORD, read_record  # start-up cost: torch, as above

    folder = root / strip_dir(at(base, INITIAL_CHECKPOINT))
    record = read_record(folder)
    if record is None:
        return
    try:
        here, why = resolve_params(params, fresh=True)
    except ValueError:          # runtime.device names a GPU this machine (the planning one) does not have
        return
    if here.policy.dtype != record["dtype"]:
        raise ValueError(
            f"run.base.params {params.run.base.params}: its initial policy computes in {record['dtype']} "
            f"({record['why']}; {folder / RECORD}), but policy.dtype auto is {here.policy.dtype} here ({why}); "
            f"run this one on a machine where auto is {record['dtype']}, or drop run.base")


def share_base(params: Params, log=print) -> list[str]:
    """Link the reusable outputs of `run.base` into `run.dir`; returns the jobs reused ("rollout@1", ...)."""
    if params.run.base is None:
        return []
    base = load_params(params.run.base.params)
    root = workflow_dir(params.run.base.params)     # where the base's run.dir is (the module's rule)
    if (root / base.run.dir).resolve() == Path(params.run.dir).resolve():
        raise ValueError(f"run.base.params {params.run.base.params}: its run.dir {base.run.dir!r} is this run's own; "
                         "give this run another run.dir")
    _same_precision(params, base, root)
    # an update (or fit) reused without its optimiser state (`runtime.keep_optimizer: last` deleted it in the base)
    # cannot be resumed from: where this run makes the next one itself, the job runs here too, and so on back
    stateless: set = set()
    while True:
        plan, missing = _reuse_plan(params, base, root, stateless)
        reused = {(stage.name, it) for stage, it, *_ in plan}
        more = {(stage.name, it) for stage, it, *_ in plan
                if stage.name in RESUMED_STATE and _state_lost(base, root, stage.name, it)
                and it + 1 in stage_iterations(stage, params) and (stage.name, it + 1) not in reused}
        if not more:
            break
        stateless |= more
    if stateless:
        log(f"run.base: {base.run.dir} kept no optimiser state of {', '.join(f'{n}@{i}' for n, i in sorted(stateless))}"
            " (runtime.keep_optimizer: last), which the next iteration resumes from: it runs here")
    files = 0
    for stage, it, _, base_paths, own_outs in plan:
        for src, dst in zip(base_paths, own_outs, strict=True):
            files += _link(src, Path(dst))
        if stage.name in RESUMED_STATE and it is not None:      # the state the next job resumes from
            state = root / fill(at(base, OPTIMIZER_DIR), it)
            if state.is_dir():
                files += _link(state, Path(fill(at(params, OPTIMIZER_DIR), it)))
    names = [name for _, _, name, _, _ in plan]
    if names:
        log(f"run.base: reusing {len(names)} jobs of {base.run.dir} ({', '.join(names)}), {files} files linked "
            f"into {params.run.dir}")
    if missing:
        log(f"run.base: {base.run.dir} lacks the outputs of {', '.join(missing)}; they and what follows run here")
    return names


def _state_lost(base: Params, root: Path, stage: str, it: int) -> bool:
    """Whether the base ran `stage` of iteration `it` with an optimiser state and no longer has it: it has none of
    that iteration and one of another (a fit that learns nothing, IGPO's, keeps none anywhere)."""
    def state(i: int) -> Path:
        return root / fill(at(base, OPTIMIZER_DIR), i) / f"{RESUMED_STATE[stage]}.pt"

    return not state(it).is_file() and any(state(i).is_file() for i in range(1, base.loop.iterations + 1))


def _reuse_plan(params: Params, base: Params, root: Path, exclude: set) -> tuple[list, list[str]]:
    """The base's jobs this run can reuse, in order, as (stage, iteration, name, the base's outputs, this run's),
    leaving out the (stage name, iteration) pairs of `exclude` and every job that depends on one not reused; and
    the names of the jobs the base should have made but lacks."""
    base_outs = {(s.name, it) for s, it in ordered_jobs(base, params.run.base.through)}
    plan, missing = [], []
    made: set[str] = set()      # this run's paths the reused jobs provide
    for stage, it in ordered_jobs(params, params.run.base.through):
        deps = job_paths(stage, params, it, stage.deps_templates(params))
        external = set(named_inputs(stage, params))     # the same params name the same file (fingerprint)
        own_outs = job_paths(stage, params, it, stage.outs_for(params))
        name = f"{stage.name}@{it}" if it is not None else stage.name
        # the same inputs too: one step off-policy, rollout i reads another checkpoint than the base's did
        if ((stage.name, it) not in base_outs or (stage.name, it) in exclude
                or params_fingerprint(stage, params) != params_fingerprint(stage, base)
                or _inputs(stage, params, it) != _inputs(stage, base, it)
                or any(d not in made for d in deps if d not in external)):
            continue
        base_paths = [root / x for x in job_paths(stage, base, it, stage.outs_for(base))]
        if not all(p.exists() for p in base_paths):
            missing.append(name)
            continue
        made.update(own_outs)
        plan.append((stage, it, name, base_paths, own_outs))
    return plan, missing

