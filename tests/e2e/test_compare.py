"""The comparison report (`python -m bench.compare`): one self-contained page over finished runs, its tables, its
MLflow runs, and every plot rendered in a real browser (headless Chromium)."""

import json
import re
import shutil

import polars as pl
import pytest

from bench import compare
from tests.conftest import chromium_dom

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def report(grpo_run, method_runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    runs = [grpo_run, method_runs["gigpo"].params, method_runs["oprl"].folder]   # a folder or a params file
    path, summary, _ = compare.build(runs, out)
    return path, summary, out, runs


def test_the_report_summarises_each_method_from_its_own_files(report):
    path, summary, out, runs = report
    curves = pl.read_csv(out / "compare_curves.csv")
    assert sorted(summary["method"].to_list()) == ["gigpo", "grpo", "oprl"]
    for run in map(compare.Run, runs):
        name = run.method
        final = pl.read_csv(run.results / "report/success_curve.csv").filter(pl.col("iteration") == 2)
        row = summary.filter(pl.col("method") == name)
        assert row["final_mean"][0] == pytest.approx(final["success_rate"][0])
        assert curves.filter(pl.col("method") == name).height == 3          # iterations 0, 1, 2
    credit = pl.read_csv(out / "compare_credit.csv")
    # GRPO has no step term; GiGPO's anchor groups give most turns one
    assert credit.filter(pl.col("method") == "grpo")["share_nonzero_step_signal"].max() == 0.0
    assert sorted(credit["iteration"].unique().to_list()) == [1, 2]
    # held-out success by solution length: its buckets add up to each evaluation's own metrics file
    dif = pl.read_csv(out / "compare_difficulty.csv")
    for run in map(compare.Run, runs):
        name = run.method
        for it in (0, 1, 2):
            m = json.loads((run.results / f"iter_{it}/eval_metrics.json").read_text())
            rows = dif.filter((pl.col("method") == name) & (pl.col("iteration") == it))
            assert rows["episodes"].sum() == m["episodes"]
            assert rows["successes"].sum() == round(m["success_rate"] * m["episodes"])
            if it == 0:
                assert rows["tasks_up"].sum() == rows["tasks_down"].sum() == 0


def test_every_plot_of_the_page_renders_in_chromium(report, tmp_path):
    path, *_ = report
    text = path.read_text()
    assert "<script src" not in text and "http" not in text.split("<body>")[0]     # self-contained
    dom = chromium_dom(path.as_uri(), tmp_path / "profile")
    plots = re.search(r'data-plots="(\d+)"', dom)
    rendered = re.search(r'data-plots-rendered="(\d+)"', dom)
    assert plots and rendered, "the page's load handler did not run"
    assert int(plots.group(1)) == 6 == int(rendered.group(1))   # success, gained/lost, credit, groups, terms, time
    for title in ("Held-out success", "Tasks gained and lost", "Credit quality against the oracle", "Step groups",
                  "Advantage terms", "Time"):
        assert f"<h2>{title}</h2>" in dom


def test_the_report_is_logged_as_a_parent_run_with_a_child_per_run(report, grpo_run, method_runs, tmp_path,
                                                                    monkeypatch):
    from mlflow import MlflowClient

    path, summary, out, runs = report
    monkeypatch.setenv("CREDITRL_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("CREDITRL_ROOT", str(tmp_path))
    parent = compare.log_mlflow([compare.Run(r) for r in runs], path, summary,
                                pl.read_csv(out / "compare_curves.csv"))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("creditrl-bench")
    children = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
    assert sorted(c.data.tags["creditrl.method"] for c in children) == ["gigpo", "grpo", "oprl"]
    assert {c.data.tags["creditrl.method"]: c.data.tags["creditrl.run_dir"] for c in children} == {
        "grpo": str(grpo_run / "results"), "gigpo": str(method_runs["gigpo"].results),
        "oprl": str(method_runs["oprl"].folder / "results")}
    assert [a.path for a in client.list_artifacts(parent)] == ["report.html"]


def test_runs_of_one_group_and_seed_are_refused(grpo_run, tmp_path):
    with pytest.raises(ValueError, match=r"several runs of grpo \(seed 3\) by credit.method"):
        compare.build([grpo_run, grpo_run], tmp_path)
    with pytest.raises(FileNotFoundError, match="no params.yaml"):
        compare.build([tmp_path], tmp_path / "out")


def test_a_params_file_in_configs_is_compared_where_snakemake_ran_it(grpo_run, tmp_path):
    """`snakemake --config params=configs/x.yaml` puts a relative run.dir under the folder it runs in (the one
    holding the Snakefile); bench.compare, given configs/x.yaml, looks there too, not beside the file."""
    work = tmp_path / "checkout"
    (work / "configs").mkdir(parents=True)
    shutil.copy(grpo_run / "Snakefile", work / "Snakefile")
    (work / "results").symlink_to(grpo_run / "results")          # the run, as Snakemake left it
    shutil.copy(grpo_run / "params.yaml", work / "configs" / "x.yaml")
    run = compare.Run(work / "configs" / "x.yaml")
    assert run.results == work / "results" and run.iterations() == [0, 1, 2]
    # beside the file there is no run: the rule that looked there failed with "no iter_0/eval_metrics.json"
    assert not (work / "configs" / "results").exists()
