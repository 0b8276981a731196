"""The code-interpreter environment (pipeline/envs/python/): answers compared by value, the expert solves the shipped
problems, the oracle's distance is exact over "run one reference program" (brute force), hostile programs come
back as observations, and a user's GSM8K or MATH files load (without an oracle) or are refused by name."""

import json
from itertools import islice

import pytest

from pipeline.config.params import ParamsError, check_dependencies, load_params
from pipeline.data.seeds import task_seed
from pipeline.envs.base import make_env
from pipeline.envs.python import problems
from pipeline.envs.python.env import PythonConfig, _reference_results, same_answer

pytestmark = pytest.mark.xdist_group("sandbox")       # its programs share the sandbox user's process cap


@pytest.mark.parametrize("predicted, gold, right", [
    ("2138322016", "2138322016", True), ("2138322017", "2138322016", False),
    ("2,138,322,016", "2138322016", True), ("\\boxed{2,138,322,016}", "2138322016", True),
    ("$280186.91", "280186.91", True), ("280186.92", "280186.91", False),
    ("11.850", "11.85", True), ("\\frac{1}{3}", "0.333333333", True), ("1/3", "0.3333", False),
    ("7.", "7", True), ("seven", "7", False), ("", "7", False),
])
def test_answers_are_compared_by_value(predicted, gold, right):
    assert same_answer(predicted, gold) is right


def test_the_shipped_problems_are_regenerated_byte_for_byte(tmp_path):
    problems.write(tmp_path)
    for name in problems.FILES:
        assert (tmp_path / name).read_bytes() == (problems.OUT / name).read_bytes(), name
    train, test = problems.load(problems.OUT)
    assert len(train) == 600 and len(test) == 100 and {p.kind for p in test} == {
        "product", "interest", "conversion", "counting", "dates", "modular"}
    assert not {p.question for p in train} & {p.question for p in test}


def test_the_expert_solves_held_out_problems_in_as_many_turns_as_the_oracle_says(tmp_path):
    env = make_env(PythonConfig(max_turns=5), tmp_path)
    for k in range(12):
        env.reset(task_seed("eval", 0, 0, k))
        first = env.oracle_distance()
        assert first == len(env.problem.steps) + 1
        turns = 0
        while True:
            r = env.step(env.expert_actions()[0])
            turns += 1
            if r.terminated:
                break
        assert r.success and r.reward == 1.0 and turns == first and env.oracle_distance() == 0


def test_the_oracle_distance_is_exact_by_brute_force(tmp_path):
    """Breadth-first over the actions "run one reference program whose inputs have appeared" and "answer": the
    fewest turns to a right answer from every reachable state equals the oracle's distance there."""
    env = make_env(PythonConfig(max_turns=10), tmp_path)
    for k in islice(range(0, 600, 37), 12):
        task = task_seed("train", 0, 1, k)
        env.reset(task)
        steps, results = env.problem.steps, _reference_results(env.problem.steps)
        needs = [{j for j in range(len(steps)) if j != i and results[j] in steps[i]} for i in range(len(steps))]
        full = frozenset(range(len(steps)))
        best = {full: 1}               # programs run -> fewest turns to a right answer: from all done, the answer
        states = [frozenset(i for i in range(len(steps)) if m >> i & 1) for m in range(1 << len(steps))]
        for _ in range(len(states)):
            for s in states:
                if s in best:
                    continue
                options = [best[s | {i}] + 1 for i in range(len(steps)) if i not in s and needs[i] <= s
                           and (s | {i}) in best]
                if options:
                    best[s] = min(options)
        assert best[frozenset()] == len(steps) + 1
        for s, turns in best.items():  # replay the state in the environment and ask the oracle
            env.reset(task)
            order = sorted(s, key=lambda i: len(needs[i]))
            for i in order:
                env.step(f"<python>{steps[i]}</python>")
            assert env.oracle_distance() == turns, (task, sorted(s))


def test_a_hostile_program_is_an_observation_and_the_episode_goes_on(tmp_path):
    env = make_env(PythonConfig(max_turns=4, sandbox={"wall_s": 2.0, "cpu_s": 1}), tmp_path)
    env.reset(task_seed("train", 0, 1, 0))
    r = env.step("<python>import os\nwhile True:\n    os.fork()</python>")
    assert r.action_valid and not r.terminated and r.observation.startswith("<result>")
    r = env.step("<python>while True: pass</python>")
    assert "stopped" in r.observation and not r.terminated
    r = env.step("I think. <python>print(open('/etc/passwd').read())</python>")
    assert "stderr: FileNotFoundError" in r.observation
    r = env.step("no tag at all")
    assert not r.action_valid and r.truncated


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_gsm8k_and_math_files_load_as_they_are_and_have_no_oracle(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"question": "Tom has 3 apples and buys 4. How many?",
                                            "answer": "3 + 4 = 7\n#### 7"}])
    write_jsonl(tmp_path / "test.jsonl", [{"problem": "What is $\\frac{1}{2} + \\frac{1}{3}$?",
                                           "solution": "The sum is $\\boxed{\\frac{5}{6}}$."}])
    train, test = problems.load(tmp_path)
    assert (train[0].answer, test[0].answer) == ("7", "\\frac{5}{6}") and not train[0].steps
    env = make_env(PythonConfig(data_path=str(tmp_path)), tmp_path)
    env.reset(task_seed("eval", 0, 0, 0))
    assert not hasattr(env, "oracle_distance") and env.gold_answer() == ("<answer>", "\\frac{5}{6}", "</answer>")
    assert env.step("<answer>0.8333333333</answer>").success
    p = load_params("configs/python.yaml", [f"env.data_path={tmp_path}"])
    with pytest.raises(ParamsError, match="carry no reference steps"):
        check_dependencies(p, "configs/python.yaml")          # the warm start needs the expert


@pytest.mark.parametrize("row, message", [
    ({"question": "q", "answer": "no marker"}, "a GSM8K answer ends in '#### <number>'"),
    ({"problem": "p", "solution": "no box"}, "a MATH solution carries its answer in \\\\boxed"),
    ({"text": "x"}, "expected question and answer"),
])
def test_a_bad_record_is_refused_naming_the_file_and_line(tmp_path, row, message):
    write_jsonl(tmp_path / "train.jsonl", [{"question": "q", "answer": "#### 1"}, row])
    write_jsonl(tmp_path / "test.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(ValueError, match=rf"{tmp_path}/train.jsonl: line 2: {message}"):
        PythonConfig(data_path=str(tmp_path))


def test_igpo_runs_on_it():
    check_dependencies(load_params("configs/python.yaml", ["credit.method=igpo"]), "configs/python.yaml")


def test_generated_training_problems_are_new_each_task_and_never_held_out(tmp_path):
    env = make_env(PythonConfig(train_problems="generated"), tmp_path)
    shipped = make_env(PythonConfig(), tmp_path)
    tasks = [task_seed("train", 0, 1, k) for k in range(300)] + [task_seed("warmstart", 0, 0, k) for k in range(300)]
    drawn = [env.problem_of(t) for t in tasks]
    # a draw per task: repeats only where a kind has few problems (counting: about 700), against the shipped 600's
    assert len({p.question for p in drawn}) >= 585 and len({shipped.problem_of(t).question for t in tasks}) < 450
    assert not {p.question for p in drawn} & {p.question for p in shipped.test}
    assert {p.kind for p in drawn} == {"product", "interest", "conversion", "counting", "dates", "modular"}
    assert env.problem_of(tasks[7]) == drawn[7]                  # the task's seed fixes its problem
    assert env.problem_of(task_seed("eval", 0, 0, 3)) == shipped.problem_of(task_seed("eval", 0, 0, 3))
    env.reset(tasks[5])                                          # the expert solves it in the oracle's turns
    first, turns = env.oracle_distance(), 0
    while not (r := env.step(env.expert_actions()[0])).terminated:
        turns += 1
    assert r.success and turns + 1 == first == len(env.problem.steps) + 1


def test_generated_training_problems_need_the_shipped_kinds(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"question": "q", "answer": "#### 1"}])
    write_jsonl(tmp_path / "test.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(ValueError, match="env.train_problems: generated draws problems of the shipped kinds"):
        PythonConfig(data_path=str(tmp_path), train_problems="generated")


def test_arpo_branching_runs_on_the_python_env_unchanged(monkeypatch):
    """ARPO's entropy branching (tau 1: every branch point branches) on the interpreter: a branch point is the state
    after a program that computed one of the problem's steps (a tool call that changed the state), so each global
    trajectory hands one copy that shares its program turn, with the program's real result in its observation, and
    resamples its answer there. The scripted policy runs the problem's first reference program, then answers 42 or
    41 by its sampling seed."""
    import re

    import polars as pl

    from pipeline.envs.base import spec_of
    from pipeline.model.policy import EntropySpec, Generation
    from pipeline.rollout import episodes
    from pipeline.rollout.episodes import Branching, EpisodeSpec, play_episodes

    train, _ = problems.load(problems.OUT)
    steps_of = [p.steps[0] for p in train]
    index = {p.question: i for i, p in enumerate(train)}

    class Scripted:
        name = "scripted"

        def __init__(self, *a):
            pass

        def __call__(self, prompt_ids, max_new_tokens, temperature, seed, entropy=None):
            return [Generation([1], [-0.5], f"<python>{steps_of[q]}</python>" if turn == 0 else
                               f"<answer>{42 - s % 2}</answer>", 0.0) for (turn, q), s in zip(prompt_ids, seed)]

    def encode(tok, prompt):       # (turns so far, the problem): what the scripted policy reads of its prompt
        return [len(re.findall(r"<result>\s*-?\d", prompt)), index[re.search(r"Problem: (.*)", prompt)[1].strip()]]

    monkeypatch.setattr(episodes, "HFSampler", Scripted)
    monkeypatch.setattr(episodes, "encode_prompt", encode)
    cfg = load_params("configs/python.yaml").env
    b = Branching("entropy", cfg.max_turns, 4, 2, 2, 1.0, 0.2, EntropySpec(20, 10, 400),
                  tool_call=spec_of(cfg).tool_call)
    specs = [EpisodeSpec(task_seed("train", 0, 1, t), t, t * 1000 + g) for t in range(2) for g in range(4)]
    steps = play_episodes(Scripted(), None, lambda: make_env(cfg), specs, history_turns=4, max_new_tokens=8,
                          temperature=1.0, batch_size=8, seed=0, branching=b)
    eps = steps.group_by("episode_id").agg(pl.col("parent_episode").first(), pl.col("branch_turn").first(),
                                           pl.col("shared").sum(), pl.len()).sort("episode_id")
    assert eps.height == 8 and eps["len"].to_list() == [2] * 8       # a program and an answer each
    branches = eps.filter(pl.col("parent_episode").is_not_null())
    assert branches["parent_episode"].to_list() == [0, 1, 1000, 1001]   # one copy per global trajectory
    assert branches["branch_turn"].to_list() == [1] * 4 and branches["shared"].to_list() == [1] * 4
    for r in branches.iter_rows(named=True):
        child = steps.filter(pl.col("episode_id") == r["episode_id"]).sort("step")
        parent = steps.filter(pl.col("episode_id") == r["parent_episode"]).sort("step")
        assert child["shared"].to_list() == [True, False] and child["action"][0] == parent["action"][0]
        assert child["observation"][1] == parent["observation"][1] and child["observation"][1].startswith("<result>")
        assert child["action"][1] in ("<answer>41</answer>", "<answer>42</answer>")


def test_the_tiny_tokenizer_keeps_each_digit_a_token_so_a_result_is_copied_digit_by_digit():
    """The tiny policy copies a <result> into its answer only where each digit is a token of its own: a result and
    the answer that repeats it tokenize to the same digit tokens, whatever numbers the corpus merged."""
    from pipeline.config.params import Params, TinyModelConfig
    from pipeline.envs.base import spec_of
    from pipeline.model.policy import train_tokenizer
    from pipeline.rollout.warmstart import tokenizer_corpus

    p = Params(env={"name": "python"}, policy={"tiny": TinyModelConfig(tokenizer_corpus_episodes=20)})
    tok = train_tokenizer(tokenizer_corpus(p, 0), 600, spec_of(p.env).isolate)
    result = tok.tokenize("<result>467169.792</result>")
    answer = tok.tokenize("<answer>467169.792</answer>")
    digits = [t for t in result if t.isdigit()]
    assert digits == list("467169792")
    assert digits == [t for t in answer if t.isdigit()]
