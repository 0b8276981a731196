"""Environment discovery (pipeline/envs/base.py): every environment module and package is found, a package's parts
other than its `env` module are not imported to find it, and a name registered twice is an error."""

import ast
import subprocess
import sys

import pytest

from pipeline.envs import base
from pipeline.envs.base import EnvSpec, register, registered


def test_every_environment_is_found_by_its_name():
    assert sorted(registered()) == ["alfworld", "python", "search", "sokoban", "sql", "textworld", "webshop"]
    assert registered()["sql"].make.__module__ == "pipeline.envs.sql.env"


def test_discovery_imports_no_data_generator_and_not_sqlglot():
    code = ("import sys; from pipeline.envs.base import registered; registered(); "
            "print(sorted(m for m in sys.modules if m.startswith('pipeline.envs.') or m == 'sqlglot'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = ast.literal_eval(out)
    assert "sqlglot" not in loaded and "pipeline.envs.sql.ast_oracle" not in loaded
    assert "pipeline.envs.alfworld.games" not in loaded
    assert {"pipeline.envs.sql.env", "pipeline.envs.search.env", "pipeline.envs.webshop.env"} <= set(loaded)


def test_a_name_registered_by_another_module_is_an_error(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", dict(registered()))

    def make(cfg, cache_dir):  # a factory of this test module: another module than the SQL environment's
        raise AssertionError

    with pytest.raises(ValueError, match=r"environment 'sql' is registered twice: by pipeline\.envs\.sql\.env and by "
                                         r"\S*test_env_registry$"):
        register(EnvSpec("sql", object, make))
    sql = registered()["sql"]
    assert register(sql) is sql                  # the same module registering again (a reload) is not
