"""The run's file layout: where every stage's outputs live, as templates over the iteration.

`{it}` is the iteration, `{prev}` the iteration before it, `{src}` the iteration whose checkpoint sampled iteration
`{it}`'s rollout (`{prev}`, or with `loop.off_policy_lag: 1` the one before it, never below 0), `{shard}` a
shard's index. A path ending in `/` is a
folder (a checkpoint). Every template starts with `results/`, the run's folder, which `at` replaces by `run.dir`.
The tables' schemas are `pipeline.data.tables`; a stage reads `paths.STEPS` with the schema `tables.STEPS`.
"""

from __future__ import annotations

import re
from pathlib import Path

ITER_DIR = "results/iter_{it}"
CHECKPOINT = ITER_DIR + "/checkpoint/"
PREV_CHECKPOINT = "results/iter_{prev}/checkpoint/"
ROLLOUT_CHECKPOINT = "results/iter_{src}/checkpoint/"   # the behaviour policy of iteration i's turns
STEPS = ITER_DIR + "/steps.parquet"
GROUPS = ITER_DIR + "/groups.parquet"
PREV_ITER_DIR = "results/iter_{prev}"
INITIAL_CHECKPOINT = "results/iter_0/checkpoint/"
REWARD_MODEL = ITER_DIR + "/reward_model/"          # the learned model: OPRL's PRM, SPA's estimator, GAE's critic
PREV_REWARD_MODEL = PREV_ITER_DIR + "/reward_model/"
STEP_REWARDS = ITER_DIR + "/step_rewards.parquet"
FIT_METRICS = ITER_DIR + "/fit_metrics.json"        # the fit's statistics (losses, the critic's explained variance)
ADVANTAGES = ITER_DIR + "/advantages.parquet"
PAIRS = ITER_DIR + "/pairs.parquet"                  # update.objective step_dpo: the preference pairs
EVAL = ITER_DIR + "/eval.parquet"
EVAL_METRICS = ITER_DIR + "/eval_metrics.json"
REPORT_DIR = "results/report"
REPORT = (REPORT_DIR + "/success_curve.csv", REPORT_DIR + "/success_curve.png")
# held-out success by the oracle's solution length, and the tasks each iteration solves more or less often than
# iteration 0 (environments without an oracle: one bucket)
REPORT_DIFFICULTY = (REPORT_DIR + "/success_by_difficulty.csv", REPORT_DIR + "/success_by_difficulty.png")
REPORT_METRICS = REPORT_DIR + "/metrics.json"   # the run's final success and credit quality (DVC metrics)


def shard_table(stage: str) -> str:
    """The step table of one shard of a sharded stage (`{shard}`: 0..N-1)."""
    return ITER_DIR + f"/shards/{stage}_{{shard}}.parquet"


RESULTS = "results"   # the templates' run folder, replaced by `run.dir`


def at(params, path: str) -> str:
    """`path` (a template or a path under `results/`) under the run's folder `params.run.dir`."""
    if path == RESULTS or path.startswith(RESULTS + "/"):
        return params.run.dir.rstrip("/") + path[len(RESULTS):]
    return path


def rollout_source(it: int, lag: int) -> int:
    """The iteration whose checkpoint samples iteration `it`'s rollout: `it` - 1 - `lag`, at least 0."""
    return max(it - 1 - lag, 0)


def fill(template: str, it: int, shard: int | None = None, lag: int = 0) -> str:
    out = (template.replace("{it}", str(it)).replace("{prev}", str(it - 1))
           .replace("{src}", str(rollout_source(it, lag))))
    return out if shard is None else out.replace("{shard}", str(shard))


def strip_dir(path: str) -> str:
    return path.rstrip("/")


def iterations_with(results: str | Path, name: str = "") -> list[int]:
    """The iterations i, in order, whose folder `results/iter_<i>/` exists and holds `name` (a file or a folder;
    empty: the folder itself) in a run's results folder."""
    found = []
    for d in Path(results).glob("iter_*"):
        m = re.fullmatch(r"iter_(\d+)", d.name)
        if m and d.is_dir() and (not name or (d / name).exists()):
            found.append(int(m.group(1)))
    return sorted(found)
