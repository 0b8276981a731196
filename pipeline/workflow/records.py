"""Snakemake's records of a job's outputs, kept right when DVC runs the job (docs/workflow.md).

Snakemake dates and fingerprints every output in `.snakemake/metadata/`; DVC records its hashes in `dvc.lock`. A
stage run by DVC either brings Snakemake's records up to date (`keep_snakemake_records`) or forgets them
(`forget_snakemake_records`), so that both tools agree on what is stale.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from base64 import urlsafe_b64encode
from pathlib import Path

import yaml

from pipeline.data.paths import fill, strip_dir
from pipeline.workflow.registry import (
    code_inputs,
    deps_for,
    enabled_stages,
    job_file,
    params_fingerprint,
    processes_for,
)


def _job(ctx):
    """(registry stage, its outputs as Snakemake and DVC name them, its Snakemake benchmark file) of this job (the
    stage, its iteration and its shard or merge role); None for a run outside the workflow (evaluation only)."""
    a = ctx.args
    if getattr(a, "checkpoint", None) is not None:
        return None
    shard = getattr(a, "shard", None)
    role = "shard" if shard is not None else "merge" if getattr(a, "merge", False) else None

    def name(template: str) -> str:
        return strip_dir(fill(template, ctx.iteration, shard) if ctx.iteration is not None else template)

    for st in enabled_stages(ctx.params):
        if st.base == ctx.stage and (role is None or st.role == role):
            return st, [name(o) for o in st.outs_for(ctx.params)], name(job_file(st, ctx.params, "benchmarks"))
    return None


def job_outputs(ctx) -> list[str]:
    """The job's outputs and its Snakemake benchmark file (`_job`); none for a run outside the workflow."""
    job = _job(ctx)
    return [*job[1], job[2]] if job else []


def _record_path(path: str, root: Path) -> Path:
    """Snakemake's metadata record of output `path`: `.snakemake/metadata/`, named by the URL-safe base64 of the
    path, split into folders of 254 characters."""
    b64 = urlsafe_b64encode(path.encode()).decode()
    parts = [b64[i: i + 254] for i in range(0, len(b64), 254)]
    return (root / ".snakemake" / "metadata").joinpath(*["@" + x for x in parts[:-1]], parts[-1])


def forget_snakemake_records(paths: list[str], root: Path = Path(".")) -> int:
    """Delete Snakemake's metadata records of `paths` and a benchmark file among them (Snakemake dates a job by its
    oldest output or benchmark file). A stage run by DVC calls this for outputs that changed: Snakemake then judges
    them by modification time alone, as files it did not make, instead of by the params and code of the run that
    made them before. Under Snakemake the record and the benchmark are written again when the job ends."""
    if not (root / ".snakemake" / "metadata").is_dir():
        return 0
    gone = 0
    for path in paths:
        if path.endswith(".tsv") and "/benchmarks/" in path:
            (root / path).unlink(missing_ok=True)
            continue
        record = _record_path(path, root)
        if record.is_file():
            record.unlink()
            gone += 1
    return gone


SNAKEMAKE_STAMP = ".snakemake_timestamp"   # Snakemake's date of a folder output; .dvcignore keeps it out of hashes


def _digest(path: Path, algorithm: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()


def _output_files(path: Path) -> list[Path]:
    """The files DVC hashes for an output: the file itself, or a folder's files less Snakemake's timestamp."""
    if not path.is_dir():
        return [path]
    return [f for f in path.rglob("*") if f.is_file() and f.name != SNAKEMAKE_STAMP]


def dvc_hash(path: Path, files: list[Path] | None = None) -> str:
    """DVC's md5 of an output: of the bytes for a file; for a folder, of the JSON list of its files' md5s and
    relative paths, with ".dir" appended (dvc_data's Tree.digest). `files`: `_output_files(path)`, if known."""
    files = _output_files(path) if files is None else files
    if not path.is_dir():
        return _digest(path, "md5")
    entries = sorted(({"md5": _digest(f, "md5"), "relpath": f.relative_to(path).as_posix()} for f in files),
                     key=lambda e: e["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir"


def _locked_hashes(root: Path) -> dict[str, dict]:
    """Output path -> its entry in `dvc.lock` (md5, size, nfiles for a folder), for DVC 3 hashes."""
    lock = root / "dvc.lock"
    if not lock.is_file():
        return {}
    try:
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    except yaml.YAMLError:
        return {}
    return {o["path"].rstrip("/"): o for body in stages.values() for o in body.get("outs") or []
            if o.get("hash") == "md5" and "md5" in o}


def same_as_locked(path: Path, entry: dict | None) -> bool:
    """Whether `path` holds the bytes `dvc.lock`'s entry records: sizes first (and the number of files of a
    folder), the md5 only where they agree."""
    if entry is None or not path.exists():
        return False
    files = _output_files(path)
    if entry.get("size") != sum(f.stat().st_size for f in files):
        return False
    if path.is_dir() and entry.get("nfiles") != len(files):
        return False
    return dvc_hash(path, files) == entry["md5"]


CHECKSUM_LIMIT = 1 << 30   # the profiles' max-checksum-file-size: Snakemake checksums inputs up to this size


def keep_snakemake_records(ctx, root: Path = Path(".")) -> bool:
    """Bring Snakemake's records of this job's outputs up to date, as Snakemake writes them when it runs the job:
    the params fingerprint and the checksums of the inputs the outputs were made from now (Snakemake takes an
    input newer than the outputs but with the recorded checksum as unchanged). Where the job made again exactly the
    outputs `dvc.lock` records, each also gets back the date of its record (a folder through its timestamp file,
    which DVC ignores and leaves in place; a file DVC copies again from its cache after the stage, so the jobs
    after it recognise it by the checksum their own records hold). Snakemake then plans neither this job nor the
    jobs after it, as DVC reruns nothing after an unchanged output. False, touching nothing, where Snakemake never
    made the outputs or made them with another command or other inputs; the caller then forgets the records."""
    job = _job(ctx)
    if job is None:
        return False
    stage, outs, benchmark = job
    records = {}
    for o in outs:
        try:
            records[o] = json.loads(_record_path(o, root).read_text())
        except (OSError, ValueError):
            return False
    inputs = sorted(set(deps_for(stage, ctx.params, ctx.iteration)) | set(code_inputs(stage)))
    fingerprint = repr(params_fingerprint(stage, ctx.params))
    it = None if ctx.iteration is None else str(ctx.iteration)
    shard = getattr(ctx.args, "shard", None)
    params = None
    for r in records.values():
        recorded = r.get("params")
        if (not isinstance(r.get("endtime"), (int, float)) or set(r.get("input") or ()) != set(inputs)
                or not isinstance(recorded, list) or len(recorded) != 2):
            return False
        cmd = [x for x in recorded if not re.fullmatch(r"'[0-9a-f]{16}'", str(x))]
        try:
            python = ast.literal_eval(cmd[0]).split()[0] if len(cmd) == 1 else None
        except (ValueError, SyntaxError, IndexError):
            return False
        if python is None or cmd[0] != repr(stage.command(python, ctx.params_file, it,
                                                          None if shard is None else str(shard),
                                                          processes_for(stage, ctx.params))):
            return False
        params = sorted([cmd[0], fingerprint])
    checksums = {i: "sha256:" + _digest(root / i, "sha256") for i in inputs
                 if (root / i).is_file() and (root / i).stat().st_size <= CHECKSUM_LIMIT}
    locked = _locked_hashes(root)
    same = all(same_as_locked(root / o, locked.get(o)) for o in outs)
    # a folder input newer than the old date has no checksum to vouch for it: the outputs keep their new dates
    same = same and not any((root / i).is_dir() and _mtime(root / i) > r["endtime"]
                            for i in inputs for r in records.values())
    for o, r in records.items():
        r.update(params=params, input_checksums=checksums, incomplete=False)
        target = root / o
        if same:
            if target.is_dir():   # DVC leaves the stamp in place when it relinks the folder from its cache
                target = target / SNAKEMAKE_STAMP
                target.touch()
            os.utime(target, (r["endtime"], r["endtime"]))
        else:
            r["endtime"] = _mtime(target)
        record = _record_path(o, root)
        tmp = record.with_name(record.name + ".tmp")
        tmp.write_text(json.dumps(r))
        os.replace(tmp, record)
    (root / benchmark).unlink(missing_ok=True)   # Snakemake's timing of a run this one replaces (and a date)
    return True


def _mtime(path: Path) -> float:
    """Snakemake's date of a path: a folder's timestamp file where it has one."""
    stamp = path / SNAKEMAKE_STAMP
    return (stamp if path.is_dir() and stamp.exists() else path).stat().st_mtime
