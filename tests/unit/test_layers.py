"""The library's layers (docs/architecture.md): imports run one way, no stage imports another, what a method knows
stays in its module, and every seed comes from one place."""

import ast
import re
from types import SimpleNamespace

import polars as pl
import pytest

from pipeline.config.params import ResourcesConfig
from pipeline.credit.base import Method, Terms
from pipeline.credit.methods import METHODS, history_depth, history_params, own_history
from pipeline.data.section import Section
from pipeline.data.seeds import stage_seed
from pipeline.workflow.registry import STAGE_BY_NAME
from tests.conftest import ROOT

# a layer may import its own layer and the ones below; envs and model share a floor and do not import each other
LEVEL = {"data": 0, "envs": 1, "model": 1, "rollout": 2, "credit": 3, "config": 4, "workflow": 5}
LAZY = re.compile(r"#\s*(start-up cost|optional)\b")


def imports(path):
    """(line, module, inside a function, the import's source lines) of every import in `path`."""
    tree = ast.parse(path.read_text())
    inner = {id(sub) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))}
    lines = path.read_text().split("\n")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        for m in mods:
            yield node.lineno, m, id(node) in inner, "\n".join(lines[node.lineno - 1:node.end_lineno])


def library():
    return sorted((ROOT / "pipeline").rglob("*.py"))


def test_imports_run_down_the_layers_only():
    wrong = []
    for f in library():
        rel = f.relative_to(ROOT / "pipeline").parts
        layer = rel[0] if len(rel) > 1 else None
        for line, m, _, _ in imports(f):
            parts = m.split(".")
            if layer is None or parts[0] != "pipeline" or len(parts) < 2 or parts[1] not in LEVEL:
                continue
            if LEVEL[parts[1]] > LEVEL[layer] or (LEVEL[parts[1]] == LEVEL[layer] and parts[1] != layer):
                wrong.append(f"{f.relative_to(ROOT)}:{line} imports {m}")
    assert wrong == []


def test_project_imports_inside_functions_say_why():
    """Only for start-up cost (torch, MLflow, matplotlib) or an optional dependency, with a comment saying which."""
    silent = [f"{f.relative_to(ROOT)}:{line} {m}" for f in library() for line, m, inner, src in imports(f)
              if inner and m.split(".")[0] == "pipeline" and not LAZY.search(src)]
    assert silent == []


def test_no_stage_imports_another():
    found = [f"{f.name}: {m}" for f in sorted((ROOT / "stages").glob("*.py")) for _, m, _, _ in imports(f)
             if m.startswith("stages")]
    assert found == []


def test_no_code_outside_credit_names_a_method():
    names = "|".join(METHODS)
    pattern = re.compile(rf"""["'](?:{names})["']|credit\.(?:{names})\b|\.(?:{names})\.""")
    files = [f for f in library() if "credit" not in f.relative_to(ROOT / "pipeline").parts[:1]]
    files += sorted((ROOT / "stages").glob("*.py"))
    named = [f"{f.relative_to(ROOT)}:{i + 1}" for f in files for i, line in enumerate(f.read_text().split("\n"))
             if pattern.search(line)]
    assert named == []


def test_runtime_resources_has_an_entry_for_each_registry_stage_and_no_other():
    assert set(ResourcesConfig.model_fields) == set(STAGE_BY_NAME)


def test_stage_seeds_are_todays_formulas():
    """The formulas the outputs were made with (a change would change every table): rollout, evaluate, update (and
    the policy's LoRA init), a step-reward model's fit and init."""
    assert stage_seed("rollout", 3, 2) == 3_000_011
    assert stage_seed("evaluate", 3, 2) == 3_500_011
    assert stage_seed("update", 3, 2) == 23_759
    assert stage_seed("fit", 3, 2) == 23_791
    assert stage_seed("init", 3) == stage_seed("reward_init", 3) == 3
    assert len({stage_seed(s, 5, 1) for s in ("rollout", "evaluate", "update", "fit")}) == 4
    with pytest.raises(ValueError, match="no seed for stage 'group'"):
        stage_seed("group", 0, 1)


class _DepthConfig(Section):
    pass


def _terms(t, cfg, episode):
    return Terms(t.zeros(), None, t.zeros())


def test_a_method_asks_for_its_grouping_depth_through_its_registry_entry(monkeypatch):
    """The group stage keys history groups as deep as any method asks (at least K + 1); the advantages stage cuts
    them to the chosen method's own depth and refuses a group table of another depth."""
    credit = SimpleNamespace(method="deep", deep=_DepthConfig(), hgpo=SimpleNamespace(depth=None))
    monkeypatch.setitem(METHODS, "deep", Method("deep", "test", _DepthConfig, _terms, columns=("history_groups",),
                                                history_depth=5))
    assert history_depth(credit, 2) == 5                     # HGPO asks for K + 1 = 3, the new method for 5
    credit.hgpo.depth = 7
    assert history_depth(credit, 2) == 7                     # HGPO's own key says 7
    credit.hgpo.depth = None
    monkeypatch.setitem(METHODS, "deep", Method("deep", "test", _DepthConfig, _terms, columns=("history_groups",),
                                                history_depth=2))
    assert history_depth(credit, 2) == 3                     # never below K + 1
    table = pl.DataFrame({"history_groups": [[1, 2, 3], [4, 5, 6]]})
    assert own_history(table, credit, 2, "g")["history_groups"].to_list() == [[1, 2], [4, 5]]
    with pytest.raises(ValueError, match=r"g: history_groups hold 2 depths, these params ask for 3 \(credit.deep\)"):
        own_history(table.with_columns(pl.col("history_groups").list.head(2)), credit, 2, "g")
    assert history_params() == ["credit.hgpo.depth"]         # HGPO's depth key is a parameter of the group stage
