"""What every stage entry point shares: arguments, validated params, threads, progress lines, tracking."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline import threads
from pipeline.config import ParamsError, load_params
from pipeline.tables import TableError


@dataclass
class StageContext:
    params: object
    params_file: str
    iteration: int | None
    stage: str
    started: float
    args: argparse.Namespace | None = None   # the stage's own options (`options` of parse_args)

    def log(self, msg: str) -> None:
        elapsed = time.perf_counter() - self.started
        where = self.stage if self.iteration is None else f"{self.stage}[{self.iteration}]"
        print(f"[{where} {elapsed:7.1f}s] {msg}", flush=True)

    def path(self, template: str, it: int | None = None) -> Path:
        from pipeline.registry import at, fill, strip_dir

        it = self.iteration if it is None else it
        template = at(self.params, template)
        return Path(strip_dir(fill(template, it) if it is not None else template))


def parse_args(stage: str, per_iteration: bool, argv: list[str] | None = None, options=None,
               iteration_needed=None) -> StageContext:
    """Parse a stage's command line and load its params. `options(parser)` adds the stage's own arguments;
    `iteration_needed(args)` says whether `--iteration` must be given (default: always, for a per-iteration stage)."""
    ap = argparse.ArgumentParser(prog=f"python -m stages.{stage}")
    ap.add_argument("--params", default="params.yaml", help="validated parameters file")
    if per_iteration:
        ap.add_argument("--iteration", type=int, required=iteration_needed is None)
    if options is not None:
        options(ap)
    args = ap.parse_args(argv)
    if per_iteration and args.iteration is None and iteration_needed is not None and iteration_needed(args):
        ap.error("the following arguments are required: --iteration")
    started = time.perf_counter()
    try:
        params = load_params(args.params)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    it = getattr(args, "iteration", None)
    if it is not None and not (0 <= it <= params.loop.iterations):
        print(f"error: --iteration {it} is outside 0..loop.iterations ({params.loop.iterations}) of {args.params}",
              file=sys.stderr)
        sys.exit(2)
    n = threads.resolve(params.runtime.torch_threads)
    threads.apply(n)                                          # stages/__init__.py exported it before any import
    ctx = StageContext(params, args.params, it, stage, started, args)
    ctx.log(f"{n} threads (runtime.torch_threads {params.runtime.torch_threads})")
    return ctx


def _job(ctx: StageContext):
    """(registry stage, its outputs as Snakemake and DVC name them, its Snakemake benchmark file) of this job (the
    stage, its iteration and its shard or merge role); None for a run outside the workflow (evaluation only)."""
    from pipeline.registry import enabled_stages, fill, job_file, strip_dir

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


def job_outputs(ctx: StageContext) -> list[str]:
    """The job's outputs and its Snakemake benchmark file (`_job`); none for a run outside the workflow."""
    job = _job(ctx)
    return [*job[1], job[2]] if job else []


def _record_path(path: str, root: Path) -> Path:
    """Snakemake's metadata record of output `path`: `.snakemake/metadata/`, named by the URL-safe base64 of the
    path, split into folders of 254 characters."""
    from base64 import urlsafe_b64encode

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


def keep_snakemake_records(ctx: StageContext, root: Path = Path(".")) -> bool:
    """Bring Snakemake's records of this job's outputs up to date, as Snakemake writes them when it runs the job:
    the params fingerprint and the checksums of the inputs the outputs were made from now (Snakemake takes an
    input newer than the outputs but with the recorded checksum as unchanged). Where the job made again exactly the
    outputs `dvc.lock` records, each also gets back the date of its record (a folder through its timestamp file,
    which DVC ignores and leaves in place; a file DVC copies again from its cache after the stage, so the jobs
    after it recognise it by the checksum their own records hold). Snakemake then plans neither this job nor the
    jobs after it, as DVC reruns nothing after an unchanged output. False, touching nothing, where Snakemake never
    made the outputs or made them with another command or other inputs; the caller then forgets the records."""
    import ast
    import re

    from pipeline.registry import code_inputs, deps_for, params_fingerprint, processes_for

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


@contextmanager
def stage_errors(ctx: StageContext):
    """Turn the errors a user can cause into one clear line and exit status 1 (no traceback noise). On success,
    keep Snakemake's records of outputs made again byte for byte (`keep_snakemake_records`), else forget them
    (`forget_snakemake_records`); under torchrun process 0 alone does this."""
    try:
        yield
        if int(os.environ.get("RANK", "0")) == 0 and not keep_snakemake_records(ctx):
            forget_snakemake_records(job_outputs(ctx))
    except (TableError, ParamsError, FileNotFoundError, ValueError, ArithmeticError) as e:
        print(f"error in stage {ctx.stage}"
              f"{'' if ctx.iteration is None else f' (iteration {ctx.iteration})'}: {e}", file=sys.stderr)
        sys.exit(1)
