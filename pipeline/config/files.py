"""Params files that name their base: `extends: <file>` and only the differences.

A params file may begin with `extends: params.yaml` (a path relative to the file's own folder, or absolute); the
file's mapping is then laid over its base's, which may extend another in turn:

- mappings merge key by key, at every depth, except a mapping whose `name` differs from the base's (another
  environment: `env: {name: sql, ...}` over params.yaml's Sokoban), which replaces the base's whole;
- anything else (a scalar, a list, null) replaces the base's value whole;
- a chain that comes back to a file already in it, a base that does not exist, or an `extends` that is not a
  string is refused, naming the file.

`read_params` returns the merged mapping (no `extends` left in it) and, for every key, the file that set it, so
that a validation error names the file to edit. Light on purpose (YAML only): the stage launcher reads the thread
count through it before torch is imported.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

EXTENDS = "extends"


class ParamsError(ValueError):
    """A bad params file; the message names the file and the key."""


def _load(path: Path) -> dict:
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    return raw


def _merge(base: dict, over: dict, origin: dict[str, str], source: str, prefix: str = "") -> dict:
    out = dict(base)
    for key, value in over.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(out.get(key), dict) and not _renamed(out[key], value):
            out[key] = _merge(out[key], value, origin, source, f"{dotted}.")
        else:
            for k in [k for k in origin if k == dotted or k.startswith(f"{dotted}.")]:
                del origin[k]     # a value replaced whole: its old keys' files no longer set it
            out[key] = value
            _mark(value, dotted, origin, source)
    return out


def _renamed(base: dict, over: dict) -> bool:
    """A section that names another kind than its base's (`env: {name: sql}` over `env: {name: sokoban}`): the
    base's keys belong to the other kind, so the section replaces it whole."""
    return "name" in over and "name" in base and over["name"] != base["name"]


def _mark(value, dotted: str, origin: dict[str, str], source: str) -> None:
    origin[dotted] = source
    if isinstance(value, dict):
        for k, v in value.items():
            _mark(v, f"{dotted}.{k}", origin, source)


def _base_path(path: Path, base: str) -> Path:
    """`extends: base` of the file `path`: relative to its folder, written without `..` (configs/../params.yaml is
    params.yaml)."""
    return Path(base) if Path(base).is_absolute() else Path(os.path.normpath(path.parent / base))


def read_params(path: str | Path) -> tuple[dict, dict[str, str]]:
    """(the merged params mapping of `path` and its bases, {dotted key: the file that set it})."""
    chain: list[Path] = []
    raws: list[dict] = []
    p = Path(path)
    while True:
        if p.resolve() in [c.resolve() for c in chain]:
            names = " -> ".join(str(c) for c in [*chain, p])
            raise ParamsError(f"{chain[-1]}: key '{EXTENDS}': the files extend each other in a circle ({names})")
        raw = _load(p)
        chain.append(p)
        raws.append(raw)
        base = raw.get(EXTENDS)
        if base is None:
            break
        if not isinstance(base, str) or not base:
            raise ParamsError(f"{p}: key '{EXTENDS}': expected the path of a params file, got {base!r}")
        nxt = _base_path(p, base)
        if not nxt.is_file():
            raise ParamsError(f"{p}: key '{EXTENDS}': the base params file {nxt} is not found")
        p = nxt
    merged: dict = {}
    origin: dict[str, str] = {}
    for f, raw in zip(reversed(chain), reversed(raws), strict=True):
        merged = _merge(merged, {k: v for k, v in raw.items() if k != EXTENDS}, origin, str(f))
    return merged, origin


def chain_of(path: str | Path) -> list[str]:
    """The files `path` is made of, itself first, then its base, and so on."""
    out, p = [], Path(path)
    while True:
        out.append(str(p))
        base = _load(p).get(EXTENDS)
        if not isinstance(base, str) or not base:
            return out
        p = _base_path(p, base)


def origin_of(origin: dict[str, str], loc: str) -> str | None:
    """The file that set the key `loc` (dotted), or that set the nearest section holding it."""
    parts = loc.split(".")
    for i in range(len(parts), 0, -1):
        f = origin.get(".".join(parts[:i]))
        if f is not None:
            return f
    return None
