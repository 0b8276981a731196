"""The search environment (`env.name: search`): Search-R1's answer normalisation and HotpotQA's F1, BM25 scores by
hand, both data formats and broken files refused with the file named, the oracle's distances through a 3-hop
question, the expert on every question of a generated world, the anchor, and the prompt."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.config.params import ParamsError, load_params
from pipeline.envs.search import world as search_world
from pipeline.envs.base import make_env
from pipeline.envs.search.env import (
    SEARCH_FORMAT,
    PlannedSearchEnv,
    SearchConfig,
    SearchEnv,
    exact_match,
    f1_score,
    load_corpus,
    make,
    name_words,
    normalize_answer,
    parse_response,
)
from pipeline.envs.search.index import Retriever
from pipeline.rollout.prompts import build_prompt

# -- answers: Search-R1's normalisation (its qa_em.py) and HotpotQA's F1 -------------------------------------------


def test_exact_match_normalises_as_search_r1():
    assert normalize_answer("The  Beatles!") == "beatles"
    assert normalize_answer("An Apple a day") == "apple day"
    assert normalize_answer("U.S.A.") == "usa"
    assert normalize_answer("Alabama theatre") == "alabama theatre"       # articles only as whole words
    assert exact_match("the eiffel tower.", ["Eiffel Tower"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel Tower", "Paris"]) == 0.0
    assert exact_match("  PARIS ", ["Eiffel Tower", "Paris"]) == 1.0           # any golden answer
    assert exact_match("Paris, France", ["Paris"]) == 0.0


def test_token_f1_as_hotpotqa():
    # prediction tokens: eiffel tower in paris ("the" removed), golden: eiffel tower; precision 2/4, recall 1
    assert f1_score("The Eiffel Tower in Paris", ["Eiffel Tower"]) == pytest.approx(2 * (2 / 4) * 1 / (2 / 4 + 1))
    assert f1_score("Tower", ["Eiffel Tower", "Tower"]) == 1.0                 # the best over the answers
    assert f1_score("yes", ["no"]) == 0.0 and f1_score("no", ["no"]) == 1.0
    assert f1_score("yes it is", ["yes"]) == 0.0           # a yes/no answer scores only when matched exactly
    assert f1_score("London", ["Paris"]) == 0.0


def test_a_response_needs_exactly_one_non_empty_tag():
    assert parse_response("I should look. <search> Lev   Arawend </search> then") == ("search", "Lev Arawend")
    assert parse_response("<answer>Palmouth</answer>") == ("answer", "Palmouth")
    assert parse_response("Palmouth") is None                                  # neither
    assert parse_response("<search>a b</search><answer>c</answer>") is None     # both
    assert parse_response("<answer>  </answer>") is None                       # empty
    assert parse_response("<search>x</search> <search>y</search>") == ("search", "x")   # the first of one kind


# -- BM25 by hand ---------------------------------------------------------------------------------------------------

CORPUS = ["Tarn\nThe Tarn is a river.", "Elsen\nThe Elsen is a river longer than the Tarn.",
          "Tarnholm\nTarnholm is a city.", "Tarn\nThe Tarn is a river."]


def test_bm25_scores_and_order_by_hand():
    # tokens after stop words: [tarn tarn river] (3), [elsen elsen river longer than tarn] (6), [tarnholm tarnholm
    # city] (3), [tarn tarn river] (3); avgdl 15/4; "tarn" and "river" each in 3 of 4: idf ln(1 + 1.5/3.5)
    idf = math.log(1 + 1.5 / 3.5)
    short, long_ = 1.5 * (0.25 + 0.75 * 3 / 3.75), 1.5 * (0.25 + 0.75 * 6 / 3.75)
    d0 = idf * (2 / (2 + short) + 1 / (1 + short))
    d1 = idf * (1 / (1 + long_) + 1 / (1 + long_))
    assert (d0, d1) == pytest.approx((0.374597, 0.224677), abs=1e-6)
    r = Retriever(CORPUS)
    assert r.scores("Tarn river").tolist() == pytest.approx([d0, d1, 0.0, d0], rel=1e-5)
    assert r.search("Tarn river", 3) == (0, 3, 1)          # passage 0 and its copy tie: corpus order
    assert r.search("Tarn river", 2) == (0, 3)
    assert r.search("river river TARN", 3) == (0, 3, 1)      # case and repeats do not count
    assert r.search("the city", 3) == (2,)                   # zero scores are not results
    assert r.search("nothing known", 3) == ()


def test_the_index_is_built_once_per_corpus_and_cached_on_disk(tmp_path):
    from pipeline.envs.search.index import _cached

    _cached.cache_clear()
    a = Retriever.cached(CORPUS, tmp_path)
    folders = list((tmp_path / "search-index").iterdir())
    assert len(folders) == 1 and (folders[0] / "done.json").is_file()
    _cached.cache_clear()
    b = Retriever.cached(CORPUS, tmp_path)                  # a new process: read from disk
    assert b is not a and b.search("Tarn river", 3) == (0, 3, 1)
    Retriever.cached(CORPUS[:3], tmp_path)
    assert len(list((tmp_path / "search-index").iterdir())) == 2    # another corpus, another index


# -- data formats ---------------------------------------------------------------------------------------------------

WORLD = [  # a 3-hop chain: film -> company -> founder -> (answer: birthplace), with namesakes
    {"id": "f1", "contents": '"The Oribraes"\nThe Oribraes is a 1990 film made by Velmor Pictures.'},
    {"id": "c1", "contents": '"Velmor Pictures"\nVelmor Pictures is a film company founded by Ada Tarsk.'},
    {"id": "p1", "contents": '"Ada Tarsk"\nAda Tarsk is a poet born in Palmouth.'},
    {"id": "p2", "contents": '"Ida Tarsk"\nIda Tarsk is a painter born in Stouton.'},
    {"id": "x1", "contents": '"Palmouth"\nPalmouth is a city in Elsaria.'},
]
QUESTION = {"id": "q0", "question": "In which city was the founder of the company that made The Oribraes born?",
            "golden_answers": ["Palmouth"], "plan": [{"id": "f1", "name": "The Oribraes"},
                                                     {"id": "c1", "name": "Velmor Pictures"},
                                                     {"id": "p1", "name": "Ada Tarsk"}]}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def search_r1_folder(tmp_path, plan=True, test_parquet=False):
    d = tmp_path / "sr1"
    d.mkdir()
    write_jsonl(d / "corpus.jsonl", WORLD)
    q = QUESTION if plan else {k: v for k, v in QUESTION.items() if k != "plan"}
    write_jsonl(d / "train.jsonl", [q])
    if test_parquet:
        pq.write_table(pa.Table.from_pylist([{"question": "Who founded Velmor Pictures?",
                                              "golden_answers": ["Ada Tarsk", "A. Tarsk"]}]), d / "test.parquet")
    else:
        write_jsonl(d / "test.jsonl", [q])
    return d


def env_on(folder, tmp_path, **search) -> SearchEnv:
    cfg = SearchConfig(data_path=str(folder), search=search)
    return make(cfg, tmp_path / "cache")


def train_task() -> int:
    from pipeline.data.seeds import task_seed

    return task_seed("train", 0, 1, 0)


def test_a_3_hop_questions_oracle_distance_at_each_turn(tmp_path):
    env = env_on(search_r1_folder(tmp_path), tmp_path, top_k=1)
    assert isinstance(env, PlannedSearchEnv)
    env.reset(train_task())
    assert env.oracle_distance() == 4                         # 3 passages to find, then the answer
    assert env.step("<search>Ada Tarsk</search>").action_valid and env.oracle_distance() == 3   # out of order
    env.step("<search>Ida Tarsk</search>")
    assert env.oracle_distance() == 3                         # a namesake: nothing of the plan
    env.step("no tag at all")
    assert env.oracle_distance() == 3
    env.step("<search>The Oribraes</search>")
    assert env.oracle_distance() == 2
    r = env.step("<search>Velmor Pictures</search>")
    assert env.oracle_distance() == 1 and r.truncated         # the 5th turn: max_turns


def test_the_episode_ends_on_an_answer_with_em_reward_and_f1_score(tmp_path):
    env = env_on(search_r1_folder(tmp_path), tmp_path)
    env.reset(train_task())
    r = env.step("It must be <answer>the palmouth</answer>.")
    assert (r.reward, r.success, r.terminated, r.action) == (1.0, True, True, "<answer>the palmouth</answer>")
    assert env.oracle_distance() == 0 and env.task_score() == 1.0
    env.reset(train_task())
    r = env.step("<answer>Palmouth in Elsaria</answer>")
    assert (r.reward, r.success, r.terminated) == (0.0, False, True)
    assert env.oracle_distance() == math.inf and env.task_score() == pytest.approx(0.5)   # P 1/3, R 1


def test_search_r1_files_load_and_play_with_em_by_hand(tmp_path):
    env = env_on(search_r1_folder(tmp_path, plan=False, test_parquet=True), tmp_path, top_k=2, passage_chars=30)
    assert type(env) is SearchEnv and not hasattr(env, "oracle_distance")    # no plan: no oracle, no expert
    from pipeline.data.seeds import task_seed

    obs = env.reset(task_seed("eval", 0, 0, 0))
    assert env.task_description().endswith("Question: Who founded Velmor Pictures?")
    assert obs.text == "(nothing searched yet)" and obs.anchor.endswith("| retrieved: ")
    r = env.step("<search>Velmor Pictures</search>")
    # "velmor" and "pictures" are in passages 0 and 1; passage 1 holds each twice and is as long: it ranks first
    assert r.observation == ("<information>Doc 1 (Title: Velmor Pictures) Velmor Pictures is a film...\n"
                             "Doc 2 (Title: The Oribraes) The Oribraes is a 1990 film...</information>")
    assert r.anchor.endswith("| retrieved: 0,1") and r.reward == 0 and not r.terminated
    assert env.step("<answer>A. Tarsk</answer>").reward == 1.0     # the second golden answer


FLASHRAG = Path(__file__).resolve().parents[1] / "data" / "flashrag"


def test_search_r1_files_the_project_did_not_write_load_and_play(tmp_path):
    # FlashRAG's sample of Search-R1's wiki-18 corpus and its 17 Natural Questions (tests/data/flashrag/README.md);
    # the questions serve as both splits, as for a user who has only a test set
    d = tmp_path / "nq"
    d.mkdir()
    shutil.copy(FLASHRAG / "corpus.jsonl", d)
    shutil.copy(FLASHRAG / "test.jsonl", d)
    shutil.copy(FLASHRAG / "test.jsonl", d / "train.jsonl")
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump({"env": {"name": "search", "data_path": str(d)}}))
    env = make_env(load_params(p).env, tmp_path / "cache")
    assert type(env) is SearchEnv and len(env.corpus.titles) == 40 and len(env.corpus.test) == 17
    from pipeline.data.seeds import task_seed

    def em(k: int, answer: str) -> tuple[float, float]:
        env.reset(task_seed("eval", 0, 0, k))
        r = env.step(f"<answer>{answer}</answer>")
        return r.reward, env.task_score()

    env.reset(task_seed("eval", 0, 0, 0))
    assert env.task_description().endswith("Question: who got the first nobel prize in physics")
    r = env.step("<search>Pavia Cathedral</search>")
    # the two passages titled Pavia Cathedral (rows 4 and 5) are the only ones that hold either word; row 4 holds
    # "cathedral" twice
    assert r.anchor.endswith("| retrieved: 4,5") and r.observation.count("(Title: Pavia Cathedral)") == 2
    assert r.observation.startswith("<information>Doc 1 (Title: Pavia Cathedral) on March 17, 1989. The cathedral")
    assert em(0, "Wilhelm Conrad Röntgen.") == (1.0, 1.0)      # golden: Wilhelm Conrad R\u00f6ntgen
    assert em(0, "Röntgen") == (0.0, pytest.approx(2 * 1 * (1 / 3) / (1 + 1 / 3)))    # P 1, R 1/3: F1 0.5
    assert em(6, "dai yongge") == (1.0, 1.0)                   # one of four golden answers
    assert em(7, "February 1, 2018")[0] == 1.0                 # golden: February\u00a01,\u00a02018
    assert em(8, "the Super Bowl LII")[0] == 1.0               # golden: "Super Bowl LII," (article, comma)
    assert em(12, "291 episodes")[0] == 1.0 and em(12, "291 eps")[0] == 0.0


def test_hotpotqa_files_build_the_corpus_from_contexts(tmp_path):
    d = tmp_path / "hotpot"
    d.mkdir()
    record = {"_id": "a", "question": "Which city was Ada Tarsk born in?", "answer": "Palmouth", "type": "bridge",
              "supporting_facts": [["Ada Tarsk", 0], ["Ada Tarsk", 1], ["Palmouth", 0]],
              "context": [["Ada Tarsk", ["Ada Tarsk is a poet.", " She was born in Palmouth."]],
                          ["Palmouth", ["Palmouth is a city."]], ["Stouton", ["Stouton is a town."]]]}
    other = {**record, "question": "Is Stouton a town?", "answer": "yes", "supporting_facts": [["Stouton", 0]],
             "context": [["Stouton", ["Stouton is a town."]], ["Elsen", ["The Elsen is a river."]]]}
    (d / "hotpot_train_v1.1.json").write_text(json.dumps([record]))
    (d / "dev.json").write_text(json.dumps([other]))
    c = load_corpus(str(d))
    assert c.titles == ("Ada Tarsk", "Palmouth", "Stouton", "Elsen")          # one passage per title
    assert c.texts[0] == "Ada Tarsk is a poet. She was born in Palmouth."
    assert c.train[0].plan == ((0, "Ada Tarsk"), (1, "Palmouth")) and c.test[0].answers == ("yes",)
    env = env_on(d, tmp_path)
    env.reset(train_task())
    # the question's own text retrieves both supporting passages (its "city" finds Palmouth's): one search, then
    # the answer, where a search for each supporting title takes two
    assert env.retriever.search(env.question.text, 3)[:2] == (0, 1)
    assert env.oracle_distance() == 2 and env.expert_actions() == [f"<search>{env.question.text}</search>"]


@pytest.mark.parametrize("breakage, fragment", [
    ("no corpus", "holds neither Search-R1's corpus.jsonl"),
    ("no test", "no test.jsonl, test.parquet or dev.*"),
    ("corpus field", "corpus.jsonl: line 1 has no field 'contents'"),
    ("question field", "train.jsonl: line 1 has no field 'golden_answers'"),
    ("not json", "test.jsonl: line 1 is not JSON"),
    ("parquet column", "test.parquet: no column 'golden_answers'"),
])
def test_broken_files_are_refused_when_the_params_load(tmp_path, breakage, fragment):
    d = search_r1_folder(tmp_path, test_parquet=breakage == "parquet column")
    if breakage == "no corpus":
        (d / "corpus.jsonl").unlink()
    elif breakage == "no test":
        (d / "test.jsonl").unlink()
    elif breakage == "corpus field":
        write_jsonl(d / "corpus.jsonl", [{"id": "f1", "text": "x"}])
    elif breakage == "question field":
        write_jsonl(d / "train.jsonl", [{"question": "q", "answers": ["a"]}])
    elif breakage == "not json":
        (d / "test.jsonl").write_text("{'question': 'single quotes'}\n")
    else:
        pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), d / "test.parquet")
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump({"env": {"name": "search", "data_path": str(d)}}))
    with pytest.raises(ParamsError) as e:
        load_params(p)
    assert fragment in str(e.value) and "env.data_path" in str(e.value) and "Traceback" not in str(e.value)


@pytest.mark.parametrize("breakage, fragment", [
    ("plan id", "train.jsonl: line 1: plan names passage 'zz' that corpus.jsonl does not hold"),
    ("answers", "train.jsonl: line 2: golden_answers must be a non-empty list of non-empty strings"),
    ("hotpot context", "record 0: context must be [[title, [sentences]], ...]"),
])
def test_broken_records_beyond_the_first_are_refused_naming_the_line(tmp_path, breakage, fragment):
    if breakage == "hotpot context":
        d = tmp_path / "h"
        d.mkdir()
        (d / "train.json").write_text(json.dumps([{"question": "q", "answer": "a", "supporting_facts": [],
                                                   "context": "not a list of pairs"}]))
        (d / "dev.json").write_text("[]")
    else:
        d = search_r1_folder(tmp_path)
        bad = {**QUESTION, "plan": [{"id": "zz", "name": "n"}]} if breakage == "plan id" else \
            {**QUESTION, "golden_answers": []}
        write_jsonl(d / "train.jsonl", [bad] if breakage == "plan id" else [QUESTION, bad])
    load_corpus.cache_clear()
    with pytest.raises(ValueError, match="env.data_path") as e:
        load_corpus(str(d))
    assert fragment in str(e.value)


def test_a_golden_answer_that_normalises_to_nothing_is_refused(tmp_path):
    """Search-R1's normalisation removes articles and punctuation: "The The" would be matched by
    <answer>.</answer>, so the file is refused, naming the line."""
    d = search_r1_folder(tmp_path)
    write_jsonl(d / "test.jsonl", [QUESTION, {**QUESTION, "golden_answers": ["Palmouth", "The The"]}])
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump({"env": {"name": "search", "data_path": str(d)}}))
    load_corpus.cache_clear()
    with pytest.raises(ParamsError) as e:
        load_params(p)
    assert "test.jsonl: line 2: golden answer 'The The' is empty after Search-R1's normalisation" in str(e.value)
    assert exact_match(".", ["The The"]) == 1.0           # what it guards against


def test_questions_without_plans_are_refused_for_the_warm_start_at_plan_time(tmp_path):
    """Search-R1's own files carry no plans: no expert, so the tiny policy's warm start (and retrieved
    demonstrations, and the oracle margin) are refused when the work is planned, naming the key; without a warm
    start the folder is accepted."""
    from pipeline.config.params import check_dependencies

    d = search_r1_folder(tmp_path, plan=False)
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump({"env": {"name": "search", "data_path": str(d)}}))
    load_corpus.cache_clear()
    with pytest.raises(ParamsError) as e:
        check_dependencies(load_params(p), p)
    text = str(e.value)
    assert "key 'warmstart': the warm start (800 steps, random_action_share 0.65 < 1)" in text
    assert "2 of 2 questions in" in text and "carry no plan" in text and "set warmstart.steps: 0" in text
    assert "\n" not in text
    # the folder holds one held-out question: evaluate.tasks at most 1 (params.yaml's 128 is refused by name)
    assert "key 'evaluate.tasks': 128 held-out tasks, but env search's data holds 1" in text
    one = {"tasks": 1}
    p.write_text(yaml.safe_dump({"env": {"name": "search", "data_path": str(d)}, "warmstart": {"steps": 0},
                                 "evaluate": one}))
    check_dependencies(load_params(p), p)
    p.write_text(yaml.safe_dump({"env": {"name": "search", "data_path": str(d)}, "warmstart": {"steps": 0},
                                 "evaluate": one, "update": {"objective": "step_dpo", "step_dpo": {"margin": "oracle"}}}))
    with pytest.raises(ParamsError, match="key 'update.step_dpo.margin': the oracle margin"):
        check_dependencies(load_params(p), p)
    (tmp_path / "x").mkdir()
    p.write_text(yaml.safe_dump({"env": {"name": "search", "data_path": str(search_r1_folder(tmp_path / "x"))},
                                 "evaluate": one}))
    check_dependencies(load_params(p), p)                   # planned: an expert, accepted


# -- the generated world ---------------------------------------------------------------------------------------------

def test_the_shipped_world_regenerates_byte_for_byte(tmp_path):
    search_world.write(tmp_path)
    for name in search_world.FILES:
        assert (tmp_path / name).read_bytes() == (search_world.OUT / name).read_bytes(), name


def test_the_shipped_world_has_every_kind_of_question():
    c = load_corpus(str(search_world.OUT))
    assert len(c.titles) == 2034 and len(c.train) == 4454 and len(c.test) == 1109
    every = {("bridge", 1), ("bridge", 2), ("bridge", 3), ("bridge", 4), ("comparison", 2)}
    assert {(q.kind, q.hops) for q in c.test} == {(q.kind, q.hops) for q in c.train} == every
    train_starts = {q.plan[0][0] for q in c.train}
    assert not train_starts & {q.plan[0][0] for q in c.test}     # held-out questions start from unseen entities
    surnames = [t.split()[-1] for t in c.titles if len(t.split()) == 2]
    assert max(surnames.count(s) for s in set(surnames)) >= 5          # namesakes: distractors for a search


def play_expert(env) -> tuple[int, float, bool]:
    start, steps, r = env.oracle_distance(), 0, None
    while actions := env.expert_actions():
        before = env.oracle_distance()
        r = env.step(actions[0])
        steps += 1
        assert env.oracle_distance() == before - 1, (env.question, actions)
    return steps, start, r is not None and r.success


def test_the_expert_answers_every_question_of_a_small_world_in_its_oracle_distance(tmp_path):
    counts = {"country": 4, "city": 20, "river": 8, "university": 8, "person": 80, "company": 20, "film": 30}
    corpus, train, test = search_world.generate(seed=7, counts=counts)
    d = tmp_path / "small"
    d.mkdir()
    write_jsonl(d / "corpus.jsonl", corpus)
    write_jsonl(d / "train.jsonl", search_world.followable(corpus, train))
    write_jsonl(d / "test.jsonl", search_world.followable(corpus, test))
    env = env_on(d, tmp_path)
    n, shorter = 0, {"bridge": 0, "comparison": 0}
    for questions, stream in ((env.corpus.train, "train"), (env.corpus.test, "eval")):
        for q in questions:
            env.question = q            # every question, not a sample of tasks
            env.found, env.answer, env.turn = [], None, 0
            steps, start, success = play_expert(env)
            assert success and steps == start <= len(q.plan) + 1
            shorter[q.kind] += start < len(q.plan) + 1
            n += 1
    assert n == len(env.corpus.train) + len(env.corpus.test) > 150
    # a search for the question's text finds both passages of most comparisons: fewer turns than the plan's hops
    assert shorter["comparison"] > 0.5 * sum(q.kind == "comparison" for q in env.corpus.train + env.corpus.test)


def test_the_expert_answers_the_shipped_held_out_questions_in_their_oracle_distance(tmp_path):
    from pipeline.data.seeds import task_seed

    env = env_on(search_world.OUT, tmp_path)
    hops = {}
    for k in range(len(env.corpus.test)):
        env.reset(task_seed("eval", 0, 0, k))
        steps, start, success = play_expert(env)
        assert success and steps == start
        hops[env.question.hops] = hops.get(env.question.hops, 0) + 1
    assert set(hops) == {1, 2, 3, 4}


def test_the_anchor_is_the_set_of_passages_retrieved(tmp_path):
    env = env_on(search_r1_folder(tmp_path), tmp_path, top_k=1)
    a, b = [], []
    for order, out in ((["Ada Tarsk", "The Oribraes"], a), (["The Oribraes", "Ada Tarsk", "Ada Tarsk"], b)):
        out.append(env.reset(train_task()).anchor)
        for query in order:
            out.append(env.step(f"<search>{query}</search>").anchor)
    assert a[-1] == b[-1] == f"{QUESTION['question']} | retrieved: 0,2"        # the same facts, any order
    assert a[1] != b[1] and a[0] == b[0]


def test_the_prompt_asks_for_the_tags_and_shows_earlier_searches_without_a_command_list(tmp_path):
    env = env_on(search_r1_folder(tmp_path), tmp_path, top_k=1)
    obs = env.reset(train_task())
    r = env.step("<search>Ada Tarsk</search>")
    p = build_prompt(env.task_description(), [(obs.text, r.action)], r.observation, r.admissible, 4, SEARCH_FORMAT)
    assert p == ("Answer the question, searching as needed. Question: In which city was the founder of the company "
                 "that made The Oribraes born?\n" + SEARCH_FORMAT.instruction + "\n"
                 "Turn 1 state:\n(nothing searched yet)\nTurn 1 action: <search>Ada Tarsk</search>\n"
                 "Turn 2 state:\n<information>Doc 1 (Title: Ada Tarsk) Ada Tarsk is a poet born in Palmouth."
                 "</information>\nYour action:")


def test_the_warm_start_demonstrates_tagged_searches_and_answers(tmp_path, monkeypatch):
    from pipeline.config.params import Params
    from pipeline.rollout.warmstart import demonstrations

    monkeypatch.setenv("CREDITRL_CACHE", str(tmp_path))     # the index's cache
    p = Params(env={"name": "search"}, prompt={"history_turns": 4})
    pairs = demonstrations(p, 30, 0.3, seed=0)
    responses = [r for _, r, _ in pairs]
    assert all(parse_response(r) is not None for r in responses)
    assert {parse_response(r)[0] for r in responses} == {"search", "answer"}
    optimal = [o for _, _, o in pairs if o is not None]
    assert len(optimal) > 0.5 * len(pairs) and all(parse_response(o) for o in optimal)


def test_the_tiny_tokenizer_gets_every_title_word_whole(tmp_path):
    words = name_words(SearchConfig())
    assert "Arawend" in words and "Pictures" in words and len(words) == len(set(words))
    env = make_env(SearchConfig(), tmp_path)
    assert isinstance(env, PlannedSearchEnv)
    rng = random.Random(0)
    assert rng.choice(env.reset(train_task()).admissible).startswith("<search>")


def test_task_stats_by_hand(tmp_path, monkeypatch):
    from bench.task_stats import iteration_stats
    from pipeline.data.seeds import task_seed

    monkeypatch.chdir(tmp_path)
    env = make_env(SearchConfig(), tmp_path)
    run = tmp_path / "run"
    (run / "iter_0").mkdir(parents=True)
    (run / "iter_1").mkdir()
    t0, t1 = task_seed("eval", 0, 0, 0), task_seed("eval", 0, 0, 5)
    q0, q1 = env.question_of(t0), env.question_of(t1)
    assert (q0.kind, q0.hops) == ("bridge", 2) and (q1.kind, q1.hops) == ("comparison", 2)   # two labels, one hops
    pl.DataFrame({"task_id": [t0, t0, t1], "success": [True, False, True], "invalid_turns": [0, 1, 0],
                  "episode_length": [2, 3, 3]}).write_parquet(run / "iter_0/eval.parquet")
    # two episodes of one task group: the first searches twice and answers, the second searches once, writes one
    # invalid turn and is truncated; their first turns share the empty anchor, and so do the two turns after a
    # search that found the same passages
    pl.DataFrame({"task_group": [0] * 6, "episode_id": [0, 0, 0, 1, 1, 1],
                  "anchor": ["a", "b", "c", "a", "b", "b"],
                  "action": ["<search>x</search>", "<search>y</search>", "<answer>z</answer>",
                             "<search>x</search>", None, "<answer>w</answer>"],
                  "action_valid": [True, True, True, True, False, True],
                  "terminated": [False, False, True, False, False, True]}).write_parquet(run / "iter_1/steps.parquet")
    stats, hops = iteration_stats(run, env, lambda action: action.startswith("<search>"))
    row0, row1 = stats.row(0, named=True), stats.row(1, named=True)
    assert row0["heldout_success"] == pytest.approx(2 / 3) and row0["heldout_well_formed"] == pytest.approx(1 - 1 / 8)
    assert row1["tool_calls_per_episode"] == 1.5 and row1["answered"] == 1.0
    assert row1["train_well_formed"] == pytest.approx(5 / 6)
    assert row1["turns_sharing_anchor"] == pytest.approx(5 / 6)      # a a b b b share; c is alone
    got = {(r["kind"], r["hops"]): (r["episodes"], r["success"]) for r in hops.iter_rows(named=True)}
    want = {}
    for q, s in ((q0, 1.0), (q0, 0.0), (q1, 1.0)):
        n, total = want.get((q.kind, q.hops), (0, 0.0))
        want[(q.kind, q.hops)] = (n + 1, total + s)
    assert got == {k: (n, pytest.approx(total / n)) for k, (n, total) in want.items()}
    # pooled over the question types: by hops alone
    _, by_hops = iteration_stats(run, env, lambda action: action.startswith("<search>"), by=["hops"])
    pooled = {}
    for (_, hops), (n, total) in want.items():
        m, s = pooled.get(hops, (0, 0.0))
        pooled[hops] = (m + n, s + total)
    assert by_hops.columns == ["iteration", "hops", "episodes", "success"]
    assert {r["hops"]: (r["episodes"], r["success"]) for r in by_hops.iter_rows(named=True)} == {
        h: (n, pytest.approx(s / n)) for h, (n, s) in pooled.items()}
    with pytest.raises(ValueError, match=r"--by hardness: not a task label of this environment \(its labels: "):
        iteration_stats(run, env, lambda action: True, by=["hardness"])
