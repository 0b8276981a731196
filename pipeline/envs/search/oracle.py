"""The search environment's oracle and expert (docs/environments.md, "Search"): the exact number of searches that
retrieve a question's plan passages, over a stated set of queries.

A state is the question and the passages retrieved so far (F). The queries an agent in that state can write from
what it has read, `queries(F)`:
- the question's text;
- every entity name it has read: a passage title that appears, word for word (case aside), in the question or in
  a retrieved passage as the environment shows it (cut at `env.search.passage_chars`), and the titles of the
  retrieved passages, in the order first read;
- every pair of those names, "A B" (BM25 scores a bag of words, so one order stands for both).

`searches_needed(F)` is the least number of searches from these sets (each search's set read in the state it is
made in) after which every plan passage has been retrieved; found by iterative deepening, a query tried only where
it retrieves something new, a depth ruled out where the passages missing outnumber what the searches left can
return. The oracle's distance is that plus one for the answer. It is exact over these queries; the search is cut
at the plan's missing passages, which the plan's own names retrieve in as many searches in the shipped world
(`pipeline.envs.search.world.followable`); a user's planned data where they do not (and no query set does better) keeps that
count, which is then an upper bound.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from itertools import combinations

_WORD = re.compile(r"\w+")


class NameIndex:
    """The corpus's titles found in a text: the entity names an agent has read."""

    def __init__(self, titles: tuple[str, ...]):
        self.by_first: dict[str, list[tuple[tuple[str, ...], str]]] = defaultdict(list)
        for t in dict.fromkeys(titles):
            words = tuple(_WORD.findall(t.lower()))
            if words:
                self.by_first[words[0]].append((words, t))

    def names_in(self, text: str) -> list[str]:
        words = _WORD.findall(text.lower())
        found: dict[str, None] = {}
        for i, w in enumerate(words):
            for title_words, title in self.by_first.get(w, ()):
                if tuple(words[i:i + len(title_words)]) == title_words:
                    found[title] = None
        return list(found)


class SearchOracle:
    """Exact search distances and optimal first searches for one corpus and retrieval setting.

    `search(query)` returns the rows a search shows (top k); `shown(row)` the text of a retrieved passage as the
    agent reads it; `titles[row]` its title. Results are memoised per (question, plan, retrieved rows)."""

    def __init__(self, titles: tuple[str, ...], shown: Callable[[int], str], search: Callable[[str], tuple[int, ...]],
                 top_k: int):
        self.titles, self.shown, self.search, self.top_k = titles, shown, search, top_k
        self.names = NameIndex(titles)
        self._read: dict[int, list[str]] = {}
        self._memo: dict[tuple, bool] = {}

    def read_names(self, row: int) -> list[str]:
        if row not in self._read:
            self._read[row] = list(dict.fromkeys([self.titles[row], *self.names.names_in(self.shown(row))]))
        return self._read[row]

    def queries(self, question: str, found) -> list[str]:
        """The query set of a state (the module's docstring), in a fixed order: the question, the names in the
        order first read, their pairs."""
        names = dict.fromkeys(self.names.names_in(question))
        for r in dict.fromkeys(found):
            names.update(dict.fromkeys(self.read_names(r)))
        names = list(names)
        return [question, *names, *(f"{a} {b}" for a, b in combinations(names, 2))]

    def _can(self, question: str, plan: frozenset[int], found: frozenset[int], depth: int) -> bool:
        """Whether `depth` searches from `found` can retrieve every passage of `plan`."""
        missing = plan - found
        if not missing:
            return True
        if depth == 0 or len(missing) > depth * self.top_k:
            return False
        key = (question, plan, found, depth)
        if key not in self._memo:
            ok = False
            for q in self.queries(question, sorted(found)):
                got = set(self.search(q))
                if depth == 1:
                    ok = missing <= got
                elif not got <= found:
                    ok = self._can(question, plan, found | got, depth - 1)
                if ok:
                    break
            self._memo[key] = ok
        return self._memo[key]

    def searches_needed(self, question: str, plan: tuple[int, ...], found) -> int:
        """The least number of searches after which every plan passage is retrieved (the module's docstring)."""
        p, f = frozenset(plan), frozenset(found)
        bound = len(p - f)
        for depth in range(bound):
            if self._can(question, p, f, depth):
                return depth
        return bound

    def first_searches(self, question: str, plan: tuple[tuple[int, str], ...], found: list[int]) -> list[str]:
        """The query that starts an optimal sequence of searches from the rows `found` (in the order retrieved):
        the plan's next name where it is one, else the first such in the query set's order; none when every plan
        passage is retrieved."""
        rows = tuple(r for r, _ in plan)
        need = self.searches_needed(question, rows, found)
        if need == 0:
            return []
        have = frozenset(found)
        following = [name for r, name in plan if r not in have][:1]
        for q in following + self.queries(question, found):
            if self.searches_needed(question, rows, have | set(self.search(q))) == need - 1:
                return [q]
        return following
