"""Every stage that reads a table refuses each broken version of it with exit status 1, one `error ...` line and
no traceback, and writes nothing (README, Failures and resuming).

The tables come from the shared OPRL run of the tiny configuration (it has every kind: steps, groups, step rewards,
advantages). Each case copies the run, breaks one table the way a user or a crashed tool would, runs the stage,
and checks the message names the file and the problem. The first case of each stage runs it as Snakemake or DVC
would (`python -m stages.X`, a process of its own: its exit status and whole output); the others call the same
entry point (`stages.X.main`) in the test's process, one after another, which checks the same frame
(`pipeline.workflow.cli.stage_job`) without importing torch again for every case.
"""

import contextlib
import importlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e



def _set(col: str, row: int, value):
    return lambda df: df.with_columns(pl.when(pl.int_range(pl.len()) == row).then(value).otherwise(pl.col(col))
                                      .alias(col))


def _drop_rows(*rows):
    return lambda df: df.filter(~pl.int_range(pl.len()).is_in(list(rows)))


TRUNCATE, REMOVE = "truncate", "remove"
TABLE_CASES = {   # table -> case -> (edit of the frame, or TRUNCATE / REMOVE; what the error line must say)
    "steps": {
        "empty": (lambda df: df.head(0), "the table has no rows"),
        "duplicated turn": (lambda df: pl.concat([df, df.slice(3, 1)]), "appears more than once"),
        "gap in steps": (lambda df: df.filter(~((pl.col("episode_id") == df["episode_id"][0])
                                                & (pl.col("step") == 1))), "expected 0, 1, 2, ... without gaps"),
        "NaN reward": (_set("reward", 2, float("nan")), "column 'reward' holds nan"),
        "infinite log-prob": (_set("response_logprobs", 4, pl.lit([float("-inf")])),
                              "column 'response_logprobs' holds [-inf]"),
        "null anchor": (_set("anchor", 1, None), "column 'anchor' is null"),
        "missing column": (lambda df: df.drop("reward"), "column 'reward' is missing"),
        "wrong type": (lambda df: df.with_columns(pl.col("reward").cast(pl.String)),
                       "column 'reward' has type large_string; expected double"),
        "truncated file": (TRUNCATE, "not a readable Parquet file"),
        "missing file": (REMOVE, "table not found"),
    },
    "groups": {
        "missing turns": (_drop_rows(0, 5), "does not cover the turns of"),
        "extra turn": (lambda df: pl.concat([df, df.head(1).with_columns(
            pl.lit(10**15, pl.Int64).alias("episode_id"))]), "1 turns that"),
        "duplicated turn": (lambda df: pl.concat([df, df.slice(1, 1)]), "appears more than once"),
        "truncated file": (TRUNCATE, "not a readable Parquet file"),
        "missing file": (REMOVE, "table not found"),
    },
    "step_rewards": {
        "missing turns": (_drop_rows(3), "1 of its turns missing"),
        "NaN score": (_set("score", 0, float("nan")), "column 'score' holds nan"),
        "truncated file": (TRUNCATE, "not a readable Parquet file"),
        "missing file": (REMOVE, "table not found"),
    },
    "advantages": {
        "missing turns": (_drop_rows(0), "1 of its turns missing"),
        "infinite advantage": (_set("advantage", 1, float("inf")), "column 'advantage' holds inf"),
        "wrong type": (lambda df: df.with_columns(pl.col("advantage").cast(pl.String)), "column 'advantage' has type"),
        "truncated file": (TRUNCATE, "not a readable Parquet file"),
        "missing file": (REMOVE, "table not found"),
    },
}
READS = {"group": ["steps"], "advantages": ["steps", "groups", "step_rewards"], "fit": ["steps"],
         "update": ["steps", "advantages"]}
WRITES = {"group": ["groups.parquet"], "advantages": ["advantages.parquet"],
          "fit": ["reward_model", "step_rewards.parquet"], "update": ["checkpoint"]}


def break_table(path: Path, how) -> None:
    if how == TRUNCATE:
        path.write_bytes(path.read_bytes()[:100])
    elif how == REMOVE:
        path.unlink()
    else:
        how(pl.read_parquet(path)).write_parquet(path)   # written by polars: large types, as a user's edit is


def run_in_process(stage: str, d: Path) -> tuple[int, str]:
    """`stages.<stage>.main` in folder `d`, as its command line would run it: (exit status, stderr); an exception
    that escapes the stage's frame comes back as a traceback in stderr, as it would from the process."""
    err, cwd, code = io.StringIO(), os.getcwd(), 0
    os.chdir(d)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            importlib.import_module(f"stages.{stage}").main(["--params", "params.yaml", "--iteration", "1"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:     # noqa: BLE001 - reported as the process would show it
        code = 1
        err.write(f"Traceback (most recent call last):\n{type(e).__name__}: {e}\n")
    finally:
        os.chdir(cwd)
    return code, err.getvalue()


def run_case(source: Path, work: Path, stage: str, table: str, case: str, process: bool) -> str | None:
    """Run one case, as a process of its own or in this one; returns what went wrong, or None."""
    how, expected = TABLE_CASES[table][case]
    d = work / f"{stage}-{table}-{case.replace(' ', '_')}"
    shutil.copytree(source, d, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts", ".snakemake", "iter_2"))
    it1 = d / "results" / "iter_1"
    for out in WRITES[stage]:
        p = it1 / out
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    break_table(it1 / f"{table}.parquet", how)
    if process:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CREDITRL_THREADS": "1"}
        r = subprocess.run([sys.executable, "-m", f"stages.{stage}", "--params", "params.yaml", "--iteration", "1"],
                           cwd=d, capture_output=True, text=True, timeout=300, env=env)
        code, stderr = r.returncode, r.stderr + r.stdout
    else:
        code, stderr = run_in_process(stage, d)
    errors = [line for line in stderr.splitlines() if line.startswith("error")]
    problems = []
    if code != 1:
        problems.append(f"exit status {code}")
    if "Traceback" in stderr:
        problems.append("a traceback")
    if len(errors) != 1:
        problems.append(f"{len(errors)} error lines")
    elif f"{table}.parquet" not in errors[0] or expected not in errors[0]:
        problems.append(f"the line {errors[0]!r} lacks {table}.parquet or {expected!r}")
    written = [out for out in WRITES[stage] if (it1 / out).exists()]
    if written:
        problems.append(f"wrote {written}")
    if list(it1.glob(".*.tmp-*")):
        problems.append("left temporaries")
    return f"{stage} / {table} / {case}: " + ", ".join(problems) + f"\n{stderr[-1500:]}" if problems else None


@pytest.fixture(scope="module")
def oprl_run(method_runs, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_input_source")
    shutil.copytree(method_runs["oprl"].folder, d, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts", ".snakemake"))
    params = yaml.safe_load((d / "params.yaml").read_text())
    params["tracking"] = {"enabled": False}
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    return d


@pytest.mark.parametrize("stage", list(READS))
def test_every_broken_table_is_refused_in_one_line(oprl_run, tmp_path, stage):
    cases = [(table, case) for table in READS[stage] for case in TABLE_CASES[table]]
    results = [run_case(oprl_run, tmp_path, stage, table, case, process=i == 0)
               for i, (table, case) in enumerate(cases)]
    failures = [r for r in results if r]
    assert not failures, "\n\n".join(failures)
    assert len(cases) >= 9
