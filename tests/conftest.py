"""Shared fixtures: one real Snakemake run of the tiny configuration (GRPO, 2 iterations), reused by the end-to-end
tests of every credit method, which copy it and change only `credit`."""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipeline.config.files import read_params
from pipeline.credit.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
# The suite runs 3 workers' stage processes on 2 cores: OpenMP threads that finish a parallel region sleep at once
# rather than spin for the next one (3 tiny runs side by side: 294 CPU-seconds against 315). Floats are unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# A test skipped because a package or file is missing hides a broken install: every skip fails, but those of tests
# marked as needing a GPU (`gpu`) or more of the machine (`hardware`).
MAY_SKIP = ("gpu", "hardware")


def _skip_fails(rep, what: str) -> None:
    reason = rep.longrepr[-1] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    rep.outcome = "failed"
    rep.longrepr = (f"{what} skipped ({reason}); only tests marked {' or '.join(MAY_SKIP)} may skip: a missing "
                    "package or file is a broken install (run the README's test command)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    if rep.skipped and not hasattr(rep, "wasxfail") and not any(item.get_closest_marker(m) for m in MAY_SKIP):
        _skip_fails(rep, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    rep = (yield).get_result()
    if rep.skipped:
        _skip_fails(rep, collector.nodeid)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium_dom(url: str, profile: Path, budget_ms: int = 5000) -> str:
    """The DOM of `url` after load in headless Chromium (the flags this machine needs: no network, no sandbox),
    given `budget_ms` of virtual time for its scripts and requests."""
    assert CHROMIUM, "no chromium on PATH: run scripts/install-chromium (the README's test command does)"
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def workflow_files(d: Path) -> None:
    """The Snakefile and its workflow profile, as a clone of the repository has them."""
    shutil.copy(ROOT / "Snakefile", d / "Snakefile")
    shutil.copytree(ROOT / "profiles", d / "profiles", dirs_exist_ok=True)


def snakemake_failure(d: Path, r: subprocess.CompletedProcess) -> str:
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(d.glob("**/logs/*.log")))
    return f"snakemake failed in {d}:\n{r.stderr[-4000:]}\n{logs}"


def sh(args, cwd, timeout=900) -> str:
    """Run a command in `cwd`; its output, or the test fails with it and the stages' logs."""
    r = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        logs = "\n".join(p.read_text()[-1500:] for p in sorted(Path(cwd).glob("results/logs/*.log")))
        pytest.fail(f"{' '.join(map(str, args))} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{logs}")
    return r.stdout + r.stderr


def stage_cli(d: Path, name: str, it: int | None = None, timeout: int = 900) -> str:
    """Run stage `name` (of iteration `it`) in run folder `d` as the workflow does; its output, or the test fails
    with it and the stages' logs."""
    cmd = [sys.executable, "-m", f"stages.{name}", "--params", "params.yaml"]
    return sh(cmd + (["--iteration", str(it)] if it is not None else []), d, timeout)


def merge_sections(params: dict, changes: dict) -> dict:
    """`changes` ({section: {key: value}}) merged into `params`' sections in place: the keys a change leaves out
    keep their values."""
    for section, values in changes.items():
        params[section] = {**(params.get(section) or {}), **values}
    return params


def dvc_repo(d: Path, **changes) -> Path:
    """A fresh git + DVC repository in `d` holding the pipeline's code, the tiny params (one iteration, every
    section written out: DVC reads each stage's params from the file) with `changes` merged into their sections,
    and the dvc.yaml generated for them."""
    from pipeline.config.params import load_params

    params = load_params(ROOT / "tests" / "tiny_params.yaml").model_dump()
    params["loop"]["iterations"] = 1
    # DVC runs one stage at a time: let the model stages use both cores (Snakemake gives them as many, too)
    params["runtime"]["resources"] = {"rollout": {"threads": 2}, "evaluate": {"threads": 2}}
    merge_sections(params, changes)
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    for name in ("pipeline", "stages"):
        shutil.copytree(ROOT / name, d / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".dvcignore", d / ".dvcignore")
    for cmd in (["git", "init", "-q"], [str(Path(sys.executable).parent / "dvc"), "init", "-q"],
                [sys.executable, "-m", "pipeline.workflow.dvcgen"]):
        subprocess.run(cmd, cwd=d, check=True, capture_output=True, timeout=300)
    return d


def with_fork_server(*cmd) -> list[str]:
    """`cmd` (a DVC command) under a fork server for the stages it starts: DVC has no start hook, so the tiny
    params' `runtime.fork_server` does nothing there by itself (docs/workflow.md)."""
    return [sys.executable, "-m", "pipeline.workflow.forkserver", "--", *map(str, cmd)]


def run_env_config(d: Path, config: str, every_stage: bool = False, **changes) -> dict:
    """Run `configs/<config>` in `d` at the tiny test sizes, with `changes` to its sections merged in, through every
    stage that plays or reads the environment: init (its warm start on the environment's expert), the held-out
    evaluation of iteration 0, and iteration 1's rollout, groups and advantages (the update, the next evaluation
    and the report do the same for every environment, and the Sokoban runs test them); with `every_stage`, the
    whole one-iteration run. Returns the params written; fails the test with Snakemake's log on error."""
    workflow_files(d)
    params = read_params(ROOT / "configs" / config)[0]      # its `extends` chain merged: a file of its own
    tiny = yaml.safe_load((ROOT / "tests" / "tiny_params.yaml").read_text())
    for section in ("loop", "policy", "rollout", "update", "evaluate"):
        params[section] = tiny[section]
    params["loop"]["iterations"] = 1
    params["warmstart"] = {**tiny["warmstart"], "tasks": 4}
    params["policy"]["tiny"]["tokenizer_corpus_episodes"] = 10
    params["tracking"] = {"enabled": False}
    params["runtime"] = {**(params.get("runtime") or {}), "fork_server": True}   # as the tiny params have it
    merge_sections(params, changes)
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    run = params["run"]["dir"]
    targets = [] if every_stage else [f"{run}/iter_0/eval_metrics.json", f"{run}/iter_1/advantages.parquet"]
    r = subprocess.run([SNAKEMAKE, *targets, "--cores", "2", "--quiet"], cwd=d, capture_output=True, text=True,
                       timeout=1200)
    if r.returncode != 0:
        pytest.fail(snakemake_failure(d, r))
    return params


@pytest.fixture(scope="session")
def grpo_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("e2e")
    workflow_files(d)
    shutil.copy(ROOT / "tests" / "tiny_params.yaml", d / "params.yaml")
    r = subprocess.run([SNAKEMAKE, "--cores", "2", "--quiet"], cwd=d, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.fail(snakemake_failure(d, r))
    return d


def continue_grpo_run(grpo_run: Path, d: Path, **changes) -> Path:
    """The shared GRPO run copied into `d` (without its MLflow store) to be continued there, with `changes` merged
    into its params' sections and tracking off: what a change leaves out stays, the tiny params' fork server
    included. Returns the params file."""
    shutil.copytree(grpo_run, d, dirs_exist_ok=True, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
    params = yaml.safe_load((d / "params.yaml").read_text())
    merge_sections(params, {**changes, "tracking": {"enabled": False}})   # not a stage parameter: reruns nothing
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    return d / "params.yaml"


# each continues the shared GRPO run; RLOO, GRPO's leave-one-out twin, runs end to end in test_bench's learning smoke
SHARED_RUNS = {"grpo_run", "method_runs"}   # built once per worker: their tests run on one worker (xdist group)


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Every test that reads the shared tiny runs goes to one xdist worker, which builds them once; the other worker
    takes the rest meanwhile. Likewise each end-to-end module's tests go to one worker (xdist's loadgroup hands
    out ungrouped tests one by one, and a module-scoped run would be built once per worker)."""
    for item in items:
        if SHARED_RUNS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("shared_runs"))
        elif item.get_closest_marker("e2e") and not item.get_closest_marker("xdist_group"):
            # an end-to-end module's tests share its module-scoped run: one worker builds it once
            item.add_marker(pytest.mark.xdist_group(item.module.__name__.rsplit(".", 1)[-1]))
    items.sort(key=_cost_rank)


# xdist hands out whole groups and modules in collection order (`--no-loadscope-reorder`): the longest first (the
# shared runs, then the real model's and vLLM's runs, then the other end-to-end modules), so that the many short
# unit tests fill the end and neither worker is left alone with a long group.
HEAVY_GROUPS = ("shared_runs", "smollm2", "vllm")


def _cost_rank(item) -> int:
    group = next((m.args[0] for m in item.iter_markers("xdist_group")), None)
    if group in HEAVY_GROUPS:
        return HEAVY_GROUPS.index(group)
    return len(HEAVY_GROUPS) + (0 if item.get_closest_marker("e2e") else 1)


# the methods the tiny Sokoban runs can use: not those that read a capability Sokoban lacks (IGPO's gold answer)
SOKOBAN_METHODS = tuple(m for m, d in METHODS.items() if not d.requires)
SHARED_RUN_METHODS = tuple(m for m in SOKOBAN_METHODS if m not in ("grpo", "rloo"))
# the runs that test_compare's report and test_resume's reference read to the end; the others stop at the last
# update (evaluate and report do not depend on the method: they cost the suite 3 jobs a method and test nothing new)
EVALUATED_METHOD_RUNS = ("gigpo", "oprl")
LAST_UPDATE = "results/iter_2/checkpoint"
JOB = re.compile(r"-m stages\.(\w+) --params \S+(?: --iteration (\d+))?(?: --shard (\d+))?")


def planned_jobs(d, params: str | None = None) -> set[str]:
    config = ["--config", f"params={params}"] if params else []
    r = subprocess.run([SNAKEMAKE, "--cores", "1", "-n", "-p", *config], cwd=d, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return {name if not it else f"{name}_shard@{it}-{shard}" if shard else f"{name}@{it}"
            for name, it, shard in JOB.findall(r.stdout + r.stderr)}


@dataclass(frozen=True)
class MethodRun:
    """One credit method's continuation of the shared GRPO run."""
    folder: Path      # its workflow folder (Snakefile, params files)
    params: Path      # the params file it ran with
    results: Path     # its outputs (run.dir)
    plan: set[str]    # the jobs Snakemake planned before it ran


# GiGPO's run is also the side-by-side run of tests/e2e/test_runs.py: a second params file in the GRPO run's folder,
# its own run.dir, linking the base's initial policy and first rollout (run.base), MLflow tracking on
SIDE_BY_SIDE = "gigpo"


@pytest.fixture(scope="session")
def method_runs(grpo_run, tmp_path_factory) -> dict[str, MethodRun]:
    runs, procs = {}, {}
    for m in SHARED_RUN_METHODS:
        d = tmp_path_factory.mktemp(f"method_{m}")
        if m == SIDE_BY_SIDE:
            shutil.copytree(grpo_run, d, dirs_exist_ok=True, symlinks=True)
            params = yaml.safe_load((grpo_run / "params.yaml").read_text())
            params["credit"] = {"method": m}
            params["run"] = {"dir": f"runs/{m}", "base": {"params": "params.yaml", "through": 1}}
            (d / f"{m}.yaml").write_text(yaml.safe_dump(params))
            runs[m] = MethodRun(d, d / f"{m}.yaml", d / f"runs/{m}", planned_jobs(d, f"{m}.yaml"))
            args = ["--config", f"params={m}.yaml"]
        else:
            runs[m] = MethodRun(d, continue_grpo_run(grpo_run, d, credit={"method": m}), d / "results", planned_jobs(d))
            args = []
            if m not in EVALUATED_METHOD_RUNS:     # GRPO's evaluation and report, which this run does not redo
                args = [LAST_UPDATE]
                shutil.rmtree(d / "results/report")
                for f in d.glob("results/iter_[12]/eval*"):
                    f.unlink()
        procs[m] = subprocess.Popen([SNAKEMAKE, *args, "--cores", "1", "--quiet"], cwd=d, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    for m, p in procs.items():
        out, err = p.communicate(timeout=1200)
        if p.returncode != 0:
            pytest.fail(snakemake_failure(runs[m].folder,
                                          subprocess.CompletedProcess(p.args, p.returncode, out, err)))
    return runs


# Synthetic batches for the learned step-reward models (the tests of the methods that have one).
PAD = 0


def tiny_llama(seed=0, heads=2, kv_heads=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      pad_token_id=PAD, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def counting_packs(monkeypatch) -> list[int]:
    """The sizes of the prefix trees `pipeline.model.packing` packs from here on (a test that a packing key is
    used)."""
    from pipeline.model import packing

    calls, real = [], packing.pack
    monkeypatch.setattr(packing, "pack", lambda seqs: calls.append(len(seqs)) or real(seqs))
    return calls


def sgd_update(model, prompts, responses, advantages, **update):
    """`ppo_update` with plain SGD (AdamW would blow float noise in near-zero gradient entries up to full-size
    steps, hiding what is compared) from log pi_old recomputed on `model`: the weights after it, and its statistics.
    `update`: the UpdateConfig's keys (lr, epochs, minibatch_size, and the memory or packing keys compared)."""
    from pipeline.config.params import UpdateConfig
    from pipeline.model.ppo import Turns, ppo_update, sequence_logprobs

    old = sequence_logprobs(model, prompts, responses, PAD, 4)
    cfg = UpdateConfig(**update)
    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=cfg.lr)
    stats = ppo_update(model, opt, Turns(prompts, responses, advantages, old), cfg, PAD, seed=0).stats
    return {k: v.detach().clone() for k, v in model.named_parameters()}, stats


def batch(n_groups=2, per_group=4, turns=2, seed=0):
    """Turns of n_groups x per_group episodes; half of each group's episodes succeed."""
    rng = np.random.default_rng(seed)
    prompts, responses, turn_ep, ep_group, ep_success = [], [], [], [], []
    e = 0
    for g in range(n_groups):
        for k in range(per_group):
            for _ in range(turns):
                prompts.append(rng.integers(1, 40, size=int(rng.integers(3, 7))).tolist())
                responses.append(rng.integers(1, 40, size=int(rng.integers(1, 4))).tolist())
                turn_ep.append(e)
            ep_group.append(g)
            ep_success.append(k % 2 == 0)
            e += 1
    return prompts, responses, np.array(turn_ep), np.array(ep_group), np.array(ep_success)


# A Hugging Face model folder with a chat template, standing in for Qwen2.5-Instruct (the tests of any-model paths).
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tokenizer():
    from pipeline.config.params import Params, TinyModelConfig
    from pipeline.envs.base import spec_of
    from pipeline.model.policy import train_tokenizer
    from pipeline.rollout.warmstart import tokenizer_corpus

    p = Params(policy={"tiny": TinyModelConfig(tokenizer_corpus_episodes=20)})
    return train_tokenizer(tokenizer_corpus(p, 0), 400, spec_of(p.env).isolate)   # Sokoban keeps grid cells whole


@pytest.fixture(scope="session")
def qwen_folder(tmp_path_factory, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = tmp_path_factory.mktemp("qwen-like")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(d)
    tokenizer.chat_template = None
    return d
