"""Shared fixtures: one real Snakemake run of the tiny configuration (GRPO, 2 iterations), reused by the end-to-end
tests of every credit method, which copy it and change only `credit`."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def snakemake_failure(d: Path, r: subprocess.CompletedProcess) -> str:
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((d / "results/logs").glob("*.log")))
    return f"snakemake failed in {d}:\n{r.stderr[-4000:]}\n{logs}"


@pytest.fixture(scope="session")
def grpo_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("e2e")
    shutil.copy(ROOT / "Snakefile", d / "Snakefile")
    shutil.copy(ROOT / "tests" / "tiny_params.yaml", d / "params.yaml")
    r = subprocess.run([SNAKEMAKE, "--cores", "2", "--quiet"], cwd=d, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.fail(snakemake_failure(d, r))
    return d
