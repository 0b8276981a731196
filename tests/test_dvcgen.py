"""dvc.yaml is generated from the stage registry; the committed file must equal the generator's output."""

from pathlib import Path

import yaml

from pipeline.config import load_params
from pipeline.dvcgen import render
from pipeline.registry import STAGES

ROOT = Path(__file__).resolve().parents[1]


def test_committed_dvc_yaml_matches_generator():
    expected = render(load_params(ROOT / "params.yaml"))
    assert (ROOT / "dvc.yaml").read_text() == expected, "run: python -m pipeline.dvcgen"


def test_generated_stages_cover_registry_and_iterations():
    p = load_params(ROOT / "params.yaml")
    doc = yaml.safe_load(render(p))["stages"]
    assert list(doc) == [s.name for s in STAGES]
    assert list(doc["rollout"]["foreach"]) == list(range(1, p.loop.iterations + 1))
    assert doc["rollout"]["foreach"][3] == {"it": 3, "prev": 2}
    assert list(doc["evaluate"]["foreach"]) == list(range(0, p.loop.iterations + 1))
    assert "results/iter_${item.prev}/checkpoint" in doc["update"]["do"]["deps"]
    assert doc["advantages"]["do"]["params"] == ["credit"]
    assert len(doc["report"]["deps"]) == 2 + p.loop.iterations + 1
