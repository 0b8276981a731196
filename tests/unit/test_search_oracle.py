"""The search oracle is exact over its stated query set (pipeline/envs/search/oracle.py): on a sample of the shipped
world's questions, a brute-force breadth-first search over every sequence of queries from that set (the question,
every title read in the question or a shown passage, every pair of them), each set rebuilt here from the texts,
finds the same least number of searches; comparisons, whose two passages the question's own text retrieves
together, take one search, not two; the expert reaches the answer in exactly the oracle's distance."""

from __future__ import annotations

import random
import re
from itertools import combinations

import pytest

from pipeline.config.params import Params
from pipeline.data.seeds import task_seed
from pipeline.envs.base import make_env


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_env(Params(env={"name": "search"}).env, tmp_path_factory.mktemp("envs"))


def read_titles(env, text: str) -> list[str]:
    """The titles that appear in `text`, whole words, case aside (rebuilt here, independently of the oracle)."""
    low = " ".join(re.findall(r"\w+", text.lower()))
    return [t for t in env.corpus.titles
            if re.search(r"(^| )" + re.escape(" ".join(re.findall(r"\w+", t.lower()))) + r"( |$)", low)]


def brute_force(env, question: str, plan: frozenset[int], found: frozenset[int], limit: int) -> int:
    """Breadth-first over every query of each state's set: the least number of searches retrieving `plan`, or
    `limit` where none within fewer does."""
    from pipeline.envs.search.env import _cut

    k, chars = env.cfg.search.top_k, env.cfg.search.passage_chars
    read: dict[int, set[str]] = {}

    def names_of(r: int) -> set[str]:
        if r not in read:
            read[r] = {env.corpus.titles[r], *read_titles(env, _cut(env.corpus.texts[r], chars))}
        return read[r]

    asked = set(read_titles(env, question))

    def query_set(f: frozenset[int]) -> set[str]:
        names = asked.union(*(names_of(r) for r in f))
        return {question} | names | {f"{a} {b}" for a, b in combinations(sorted(names), 2)}

    level = {found}
    for depth in range(limit):
        if any(plan <= f for f in level):
            return depth
        level = {f | set(env.retriever.search(q, k)) for f in level for q in query_set(f)}
    return limit


SAMPLE = {("comparison", 2): 2, ("bridge", 1): 2, ("bridge", 2): 2, ("bridge", 3): 1, ("bridge", 4): 1}


def sample_tasks(env) -> list[int]:
    """The first training tasks of each (type, hops), as many as SAMPLE says (a 4-hop chain's brute force alone
    takes 10-30 s)."""
    out, left = [], dict(SAMPLE)
    for t in range(400):
        task = task_seed("train", 0, 1, t)
        q = env.question_of(task)
        if left.get((q.kind, q.hops), 0) > 0:
            left[(q.kind, q.hops)] -= 1
            out.append(task)
    return out


def test_the_distance_is_the_brute_force_minimum_over_the_query_set(env):
    rng = random.Random(0)
    checked = 0
    for task in sample_tasks(env):
        env.reset(task)
        q = env.question
        plan = frozenset(r for r, _ in q.plan)
        states = [[]]
        if q.hops < 4:
            # a second state: after a search for the plan's first name, with a random title's passages (often a
            # namesake's) read before it
            states.append(list(dict.fromkeys(
                env.retriever.search(rng.choice(env.corpus.titles), env.cfg.search.top_k)
                + env.retriever.search(q.plan[0][1], env.cfg.search.top_k))))
        for found in states:
            env.reset(task)
            env.found = list(found)
            expect = brute_force(env, q.text, plan, frozenset(found), len(plan - set(found)))
            assert env.oracle_distance() == expect + 1, (q.text, found)
            checked += 1
    assert checked == 15


def test_a_comparison_takes_one_search_and_the_expert_follows_the_oracle(env):
    comparisons = bridges = 0
    for t in range(120):
        task = task_seed("train", 0, 1, t)
        env.reset(task)
        q = env.question
        d = env.oracle_distance()
        if q.kind == "comparison":
            comparisons += 1
            both = set(env.retriever.search(q.text, env.cfg.search.top_k))
            if {r for r, _ in q.plan} <= both:
                assert d == 2 and env.expert_actions() == [f"<search>{q.text}</search>"]
        else:
            bridges += 1
        steps, r = 0, None
        while actions := env.expert_actions():
            before = env.oracle_distance()
            r = env.step(actions[0])
            steps += 1
            assert env.oracle_distance() == before - 1
        assert r.success and steps == d
    assert comparisons > 20 and bridges > 40
