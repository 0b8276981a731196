"""Params files that name their base (`extends`, pipeline/config/files.py): the merge rules, the errors, and the
shipped configs, which are overlays on params.yaml."""

import glob
from pathlib import Path

import pytest
import yaml

from pipeline.config.files import read_params
from pipeline.config.params import ParamsError, load_params, main, resolved_yaml


def write(path, text):
    path.write_text(text)
    return path


def test_mappings_merge_key_by_key_and_anything_else_replaces(tmp_path):
    write(tmp_path / "base.yaml", "seed: 3\nloop: {iterations: 6}\nupdate: {lr: 0.001, epochs: 2}\n"
                                  "env: {name: sokoban, dim_room: 6, max_turns: 15}\nlist: [1, 2, 3]\n")
    write(tmp_path / "mid.yaml", "extends: base.yaml\nupdate: {epochs: 1}\nlist: [9]\n")
    top = write(tmp_path / "top.yaml", "extends: mid.yaml\nupdate: {lr: 0.5}\nenv: {name: sql, max_turns: 5}\n")
    merged, origin = read_params(top)
    assert merged == {"seed": 3, "loop": {"iterations": 6}, "update": {"lr": 0.5, "epochs": 1},
                      "env": {"name": "sql", "max_turns": 5},       # another environment: the section whole
                      "list": [9]}                                   # a list replaced, not appended to
    assert origin["update.lr"] == str(top) and origin["update.epochs"] == str(tmp_path / "mid.yaml")
    assert origin["seed"] == str(tmp_path / "base.yaml") and "env.dim_room" not in origin


def test_a_bad_key_is_named_with_the_file_that_set_it(tmp_path):
    write(tmp_path / "base.yaml", "update: {lr: -1.0}\n")
    top = write(tmp_path / "top.yaml", "extends: base.yaml\nloop: {iterations: 2}\n")
    with pytest.raises(ParamsError) as e:
        load_params(top)
    assert f"key 'update.lr' (set in {tmp_path / 'base.yaml'}): Input should be greater than 0" in str(e.value)
    assert str(e.value).startswith(f"{top}: invalid parameters")


@pytest.mark.parametrize("files, message", [
    ({"a.yaml": "extends: b.yaml\n", "b.yaml": "extends: a.yaml\n"},
     "{d}/b.yaml: key 'extends': the files extend each other in a circle ({d}/a.yaml -> {d}/b.yaml -> {d}/a.yaml)"),
    ({"a.yaml": "extends: nowhere.yaml\n"},
     "{d}/a.yaml: key 'extends': the base params file {d}/nowhere.yaml is not found"),
    ({"a.yaml": "extends: [b.yaml]\n"},
     "{d}/a.yaml: key 'extends': expected the path of a params file, got ['b.yaml']"),
])
def test_a_broken_chain_is_refused_naming_the_file(tmp_path, files, message):
    for name, text in files.items():
        write(tmp_path / name, text)
    with pytest.raises(ParamsError) as e:
        load_params(tmp_path / "a.yaml")
    assert str(e.value) == message.format(d=tmp_path)


def test_resolve_prints_a_self_contained_file_with_the_same_params(tmp_path, capsys):
    assert main(["configs/sql.yaml", "--resolve"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# configs/sql.yaml, resolved: params.yaml <- configs/sql.yaml\n")
    raw = yaml.safe_load(text)
    assert "extends" not in raw and raw["env"]["name"] == "sql" and raw["run"]["dir"] == "results/sql"
    alone = write(tmp_path / "resolved.yaml", text)
    assert load_params(alone) == load_params("configs/sql.yaml")


@pytest.mark.parametrize("config", sorted(glob.glob("configs/*.yaml")))
def test_every_shipped_config_is_an_overlay_on_params_yaml(config):
    raw = yaml.safe_load(Path(config).read_text())
    assert raw["extends"] == "../params.yaml"
    base = yaml.safe_load(Path("params.yaml").read_text())
    # only differences: no key repeats params.yaml's value (a section switched to another environment aside)
    same = [k for sec, v in raw.items() if isinstance(v, dict) and isinstance(base.get(sec), dict)
            and v.get("name", base[sec].get("name")) == base[sec].get("name")
            for k, x in v.items() if base[sec].get(k) == x and not isinstance(x, dict)]
    assert same == [], f"{config} repeats params.yaml's {same}"
    assert resolved_yaml(config).count("extends") == 0
