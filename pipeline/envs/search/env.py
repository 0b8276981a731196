"""Search agents: question answering with a search engine, Search-R1's and ARPO's knowledge tasks (`env.name:
search`; docs/environments.md, "Search").

A task is a question. Each turn the policy writes `<search>query</search>` or `<answer>text</answer>` (free text
around them allowed; a response with neither tag, with both, or with an empty one is invalid, a no-op). A search
returns the top `env.search.top_k` passages of the corpus by BM25 (`pipeline.envs.search.index`), shown as
Search-R1 shows them, `<information>Doc 1 (Title: ...) text ...</information>`, each passage's text cut at
`env.search.passage_chars` characters (at a word, with "..."). An answer ends the episode: reward 1 when it
matches a golden answer exactly after Search-R1's normalisation (lowercase, punctuation and the articles a, an,
the removed, single spaces), else 0; success is that exact match; `task_score` is the best token F1 against the
golden answers (HotpotQA's F1: "yes", "no" and "noanswer" only match themselves).

The state is what the agent knows: the question and the passages retrieved so far. The anchor is that, the set
of passage ids (order-free), so GiGPO's step groups join turns that know the same facts; the prompt carries the
earlier turns' queries and information (`prompt.history_turns`).

Data (`env.data_path`; null: the generated world the project ships, `pipeline.envs.search.world`):
- Search-R1's (FlashRAG's) format: `corpus.jsonl` with `id` and `contents` (`"Title"\\ntext`), and the questions
  in `train.jsonl` or `train.parquet` and `test.jsonl` / `test.parquet` (or `dev.*`), with `question` and
  `golden_answers`; a question may carry a `plan` (the passages it needs, `[{"id", "name"}]`, as the generated
  world writes);
- HotpotQA's JSON: `train.json` (or `hotpot_train_v1.1.json`) and `dev.json` (or `hotpot_dev_distractor_v1.json`,
  `hotpot_dev_fullwiki_v1.json`), each a list of {question, answer, supporting_facts, context}; the corpus is every
  context paragraph (one passage per title, its sentences joined), and a question's plan is its supporting titles.

Capabilities, where every question has a plan: `oracle_distance` (the least number of searches that retrieve the
plan's passages, over the queries an agent can write from what it has read: the question, the titles it has read,
their pairs (`pipeline.envs.search.oracle`), plus one for the answer; 0 after a correct answer, inf after a wrong
one), `expert_actions` (the first search of such a shortest sequence, the plan's next name where it is one; then
the answer). A folder whose questions carry no plans has neither, and what needs them (the warm start's expert,
retrieved demonstrations, the oracle margin) is refused when the params are checked. `task_score` always.

The BM25 index is kept in the user's cache (`pipeline.envs.base.user_cache`), keyed by the corpus's hash.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from pipeline.data.section import EnvSection, Section
from pipeline.data.seeds import task_item
from pipeline.envs.actions import ActionFormat, one_tag
from pipeline.envs.base import EnvSpec, Observation, StepResult, data_error, data_root, first_file, register, user_cache
from pipeline.envs.search.index import Retriever
from pipeline.envs.search.oracle import SearchOracle
from pipeline.envs.search.world import OUT

_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NOTHING_YET = "(nothing searched yet)"
PUNCTUATION = frozenset(string.punctuation)
HOTPOT_TRAIN = ("train.json", "hotpot_train_v1.1.json")
HOTPOT_DEV = ("dev.json", "hotpot_dev_distractor_v1.json", "hotpot_dev_fullwiki_v1.json")


class SearchSettings(Section):
    top_k: int = Field(3, ge=1, le=50, description="passages a search returns (Search-R1: 3)")
    passage_chars: int = Field(240, ge=20, le=5000, description="a shown passage's text is cut at this many "
                               "characters (at a word, with '...'); the title is always shown whole")


class SearchConfig(EnvSection):
    """Questions answered with a search engine over a corpus (the generated world, or a user's Search-R1 or
    HotpotQA files)."""
    name: Literal["search"] = "search"
    data_path: str | None = Field(None, description="folder of Search-R1-format files (corpus.jsonl, train and "
                                  "test questions) or HotpotQA's JSON (train.json, dev.json); null: the generated "
                                  "world the project ships (data/search)")
    max_turns: int = Field(5, ge=1, le=100, description="turns before an episode is truncated (searches and the "
                           "answer)")
    search: SearchSettings = SearchSettings()

    @field_validator("data_path")
    @classmethod
    def _readable(cls, v):
        check_files(Path(_root(v)))    # missing files and malformed first records are refused when the params load
        return v


def _root(data_path: str | None) -> str:
    return str(data_root(data_path, OUT))     # a string: the key of the loaders' caches


# -- data ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Question:
    text: str
    answers: tuple[str, ...]
    plan: tuple[tuple[int, str], ...] | None    # (corpus row, the name that finds it), in the order to find them
    hops: int | None = None
    kind: str | None = None


@dataclass(frozen=True)
class Corpus:
    titles: tuple[str, ...]
    texts: tuple[str, ...]
    train: tuple[Question, ...]
    test: tuple[Question, ...]
    source: str                                   # the files, for messages

    @property
    def planned(self) -> bool:
        return all(q.plan is not None for q in self.train + self.test)


def _question_file(folder: Path, split: str) -> Path | None:
    names = [f"{s}.{e}" for s in ((split,) if split == "train" else ("test", "dev")) for e in ("jsonl", "parquet")]
    return first_file(folder, names)


def data_format(folder: Path) -> str:
    if (folder / "corpus.jsonl").is_file():
        return "search_r1"
    if first_file(folder, HOTPOT_TRAIN + HOTPOT_DEV):
        return "hotpotqa"
    raise ValueError(f"env.data_path: {folder} holds neither Search-R1's corpus.jsonl (with train.jsonl and "
                     f"test.jsonl) nor HotpotQA's {HOTPOT_TRAIN[0]} and {HOTPOT_DEV[0]}")


def check_files(folder: Path) -> None:
    """The folder holds one of the two layouts, and each file's first record has the fields it needs; Search-R1's
    questions are read whole, every golden answer checked."""
    if not folder.is_dir():
        raise ValueError(f"env.data_path: {folder} is not a folder; expected one holding corpus.jsonl, train.jsonl "
                         "and test.jsonl (Search-R1) or HotpotQA's train.json and dev.json")
    if data_format(folder) == "search_r1":
        _check_record(folder / "corpus.jsonl", _first_line(folder / "corpus.jsonl"), ("id", "contents"))
        for split in ("train", "test"):
            path = _question_file(folder, split)
            if path is None:
                want = "train.jsonl or train.parquet" if split == "train" else "test.jsonl, test.parquet or dev.*"
                raise data_error(folder, f"no {want}: Search-R1's questions (question, golden_answers)")
            if path.suffix == ".jsonl":
                _check_record(path, _first_line(path), ("question", "golden_answers"))
            else:
                _parquet_columns(path)
            for where, r in _question_records(path):       # every question's answers: the files are small
                _answers(path, where, r["golden_answers"])
        return
    for names in (HOTPOT_TRAIN, HOTPOT_DEV):
        path = first_file(folder, names)
        if path is None:
            raise data_error(folder, f"no {' or '.join(names)}: HotpotQA's questions")
        with path.open("rb") as f:
            if not f.read(4096).lstrip().startswith(b"["):
                raise data_error(path, "expected a JSON list of HotpotQA records at the top level")


def _first_line(path: Path) -> str:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                return line
    raise data_error(path, "empty file")


def _check_record(path: Path, line: str, keys, lineno: int = 1) -> dict:
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise data_error(path, f"line {lineno} is not JSON ({e})") from None
    if not isinstance(rec, dict):
        raise data_error(path, f"line {lineno} is not a JSON object")
    for k in keys:
        if k not in rec:
            raise data_error(path, f"line {lineno} has no field {k!r}; expected {', '.join(keys)}")
    return rec


def _parquet_columns(path: Path) -> None:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise data_error(path, f"not a readable Parquet file ({e})") from None
    for k in ("question", "golden_answers"):
        if k not in names:
            raise data_error(path, f"no column {k!r}; expected question and golden_answers (Search-R1's)")


def _answers(path: Path, where: str, value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    try:
        answers = tuple(str(a) for a in value)
    except TypeError:
        answers = ()
    if not answers or not all(a.strip() for a in answers):
        raise data_error(path, f"{where}: golden_answers must be a non-empty list of non-empty strings, not {value!r}")
    for a in answers:
        if not normalize_answer(a):
            raise data_error(path, f"{where}: golden answer {a!r} is empty after Search-R1's normalisation (case, "
                             "punctuation and the articles a, an, the removed), so an empty answer would match it")
    return answers


def _question_records(path: Path) -> tuple[tuple[str, dict], ...]:
    """(where, record) of every question of a Search-R1 file, each checked for its fields. Read once per version of
    the file in a process: the params check, the plan check and the corpus load share it."""
    st = path.stat()
    return _read_question_records(path, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=8)
def _read_question_records(path: Path, size: int, mtime_ns: int) -> tuple[tuple[str, dict], ...]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        _parquet_columns(path)
        return tuple((f"row {k}", r) for k, r in enumerate(pq.read_table(path).to_pylist()))
    out = []
    with path.open(encoding="utf-8") as f:
        for k, line in enumerate(f, 1):
            if line.strip():
                out.append((f"line {k}", _check_record(path, line, ("question", "golden_answers"), k)))
    return tuple(out)


def _search_r1(folder: Path) -> Corpus:
    corpus_path = folder / "corpus.jsonl"
    titles, texts, row = [], [], {}
    with corpus_path.open(encoding="utf-8") as f:
        for k, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = _check_record(corpus_path, line, ("id", "contents"), k)
            contents = rec["contents"]
            if not isinstance(contents, str):
                raise data_error(corpus_path, f"line {k}: contents must be a string (\"Title\"\\ntext)")
            title, _, text = contents.partition("\n")
            row[str(rec["id"])] = len(titles)
            titles.append(title.strip().strip('"'))
            texts.append(text.strip())
    if not titles:
        raise data_error(corpus_path, "no passages")
    splits = []
    for split in ("train", "test"):
        path = _question_file(folder, split)
        if path is None:
            raise data_error(folder, f"no {split} questions (train.jsonl or .parquet; test.jsonl, .parquet or dev.*)")
        qs = []
        for where, r in _question_records(path):
            if not isinstance(r["question"], str) or not r["question"].strip():
                raise data_error(path, f"{where}: question must be a non-empty string")
            plan = r.get("plan")
            if plan is not None:
                try:
                    plan = tuple((row[str(h["id"])], str(h["name"])) for h in plan)
                except KeyError as e:
                    raise data_error(path, f"{where}: plan names passage {e} that corpus.jsonl does not hold, or a "
                                      "hop lacks id or name") from None
                except TypeError:
                    raise data_error(path, f"{where}: plan must be a list of {{id, name}}") from None
            qs.append(Question(r["question"].strip(), _answers(path, where, r["golden_answers"]), plan,
                               r.get("hops"), r.get("type")))
        if not qs:
            raise data_error(path, "no questions")
        splits.append(tuple(qs))
    return Corpus(tuple(titles), tuple(texts), splits[0], splits[1], str(folder))


def _hotpotqa(folder: Path) -> Corpus:
    titles, texts, row = [], [], {}
    splits = []
    for names in (HOTPOT_TRAIN, HOTPOT_DEV):
        path = first_file(folder, names)
        if path is None:
            raise data_error(folder, f"no {' or '.join(names)}: HotpotQA's questions")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise data_error(path, f"not readable JSON ({e})") from None
        if not isinstance(data, list):
            raise data_error(path, "expected a JSON list of HotpotQA records")
        qs = []
        for k, r in enumerate(data):
            try:
                for title, sentences in r["context"]:
                    if title not in row:
                        row[title] = len(titles)
                        titles.append(title)
                        texts.append("".join(sentences).strip())
                plan = tuple((row[t], t) for t in dict.fromkeys(t for t, _ in r["supporting_facts"]))
                qs.append(Question(r["question"].strip(), _answers(path, f"record {k}", r["answer"]), plan,
                                   len(plan), r.get("type")))
            except KeyError as e:
                raise data_error(path, f"record {k}: no field {e} (or a supporting fact's title is in no context); "
                                  "expected question, answer, supporting_facts, context") from None
            except (TypeError, ValueError, AttributeError):
                raise data_error(path, f"record {k}: context must be [[title, [sentences]], ...] and supporting_facts "
                                  "[[title, sentence index], ...]") from None
        if not qs:
            raise data_error(path, "no questions")
        splits.append(tuple(qs))
    return Corpus(tuple(titles), tuple(texts), splits[0], splits[1], str(folder))


@lru_cache(maxsize=4)
def load_corpus(root: str) -> Corpus:
    folder = Path(root)
    check_files(folder)
    return _search_r1(folder) if data_format(folder) == "search_r1" else _hotpotqa(folder)


@lru_cache(maxsize=4)
def retriever_of(root: str) -> Retriever:
    """The corpus's BM25 index (title and text of each passage), once per process: every episode's environment
    shares it. It is kept in the user's cache (`user_cache`), keyed by the corpus's SHA-256, whichever folder a
    run works in."""
    c = load_corpus(root)
    return Retriever.cached([f"{t}\n{x}" for t, x in zip(c.titles, c.texts, strict=True)], user_cache())


# -- answers ------------------------------------------------------------------------------------------------------


def normalize_answer(s: str) -> str:
    """Search-R1's (and SQuAD's) normalisation: lowercase, punctuation removed, articles removed, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, answers) -> float:
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(a) for a in answers))


def f1_score(prediction: str, answers) -> float:
    """HotpotQA's token F1, the best over the golden answers."""
    best = 0.0
    p = normalize_answer(prediction)
    for a in answers:
        g = normalize_answer(a)
        if (p in ("yes", "no", "noanswer") or g in ("yes", "no", "noanswer")) and p != g:
            continue
        common = Counter(p.split()) & Counter(g.split())
        same = sum(common.values())
        if same:
            precision, recall = same / len(p.split()), same / len(g.split())
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def parse_response(response: str) -> tuple[str, str] | None:
    """("search" | "answer", content) of a response, or None where it has neither tag, both, or an empty one."""
    found = one_tag(response, {"search": _SEARCH, "answer": _ANSWER})
    if found is None:
        return None
    kind, content = found[0], " ".join(found[1].split())
    return (kind, content) if content else None


def _render_action(action: str | None) -> str:
    return action if action is not None else "(invalid)"


SEARCH_FORMAT = ActionFormat(
    "Search the knowledge base with <search>query</search>; each search shows the top passages in "
    "<information>...</information>. When you know the answer, give it with <answer>text</answer>.",
    _render_action, list_admissible=False)


# -- the environment ----------------------------------------------------------------------------------------------


class SearchEnv:
    name = "search"
    action_format = SEARCH_FORMAT

    def __init__(self, cfg: SearchConfig, cache_dir: Path):
        self.cfg = cfg
        self.corpus = load_corpus(_root(cfg.data_path))
        self.retriever = retriever_of(_root(cfg.data_path))
        self.question: Question | None = None
        self.found: list[int] = []        # corpus rows retrieved so far, in order
        self.text = NOTHING_YET
        self.turn = 0
        self.answer: str | None = None

    def question_of(self, task: int) -> Question:
        return task_item(task, self.corpus.train, self.corpus.test)

    def task_labels(self, task: int) -> dict:
        q = self.question_of(task)
        return {"kind": q.kind or "unknown", "hops": q.hops if q.hops is not None else -1}

    def render(self, rows) -> str:
        if not rows:
            return "<information>No passage matches the query.</information>"
        cut = self.cfg.search.passage_chars
        docs = [f"Doc {k + 1} (Title: {self.corpus.titles[r]}) {_cut(self.corpus.texts[r], cut)}"
                for k, r in enumerate(rows)]
        return "<information>" + "\n".join(docs) + "</information>"

    def anchor(self) -> str:
        return f"{self.question.text} | retrieved: {','.join(map(str, sorted(set(self.found))))}"

    def admissible(self) -> tuple[str, ...]:
        """Commands for the warm start's random turns (the prompt does not list them): a search for the question,
        and a search for and an answer with each passage title retrieved so far."""
        titles = [self.corpus.titles[r] for r in dict.fromkeys(self.found)]
        return (f"<search>{self.question.text}</search>", *(f"<search>{t}</search>" for t in titles),
                *(f"<answer>{t}</answer>" for t in titles))

    def task_description(self) -> str:
        return f"Answer the question, searching as needed. Question: {self.question.text}"

    def _observe(self) -> Observation:
        return Observation(self.text, self.anchor(), self.admissible())

    def reset(self, task: int) -> Observation:
        self.question = self.question_of(task)
        self.found, self.text, self.turn, self.answer = [], NOTHING_YET, 0, None
        return self._observe()

    def step(self, response_text: str) -> StepResult:
        if self.question is None:
            raise RuntimeError("SearchEnv.step called before reset")
        if self.answer is not None:
            raise RuntimeError("SearchEnv.step called after the episode's answer")
        self.turn += 1
        parsed = parse_response(response_text)
        action, reward, done = None, 0.0, False
        if parsed is not None:
            kind, content = parsed
            action = f"<{kind}>{content}</{kind}>"
            if kind == "search":
                rows = self.retriever.search(content, self.cfg.search.top_k)
                self.found.extend(rows)
                self.text = self.render(rows)
            else:
                self.answer, done = content, True
                reward = exact_match(content, self.question.answers)
                self.text = f"Answered: {content}"
        obs = self._observe()
        return StepResult(observation=obs.text, anchor=obs.anchor, reward=reward, terminated=done,
                          truncated=not done and self.turn >= self.cfg.max_turns, action_valid=action is not None,
                          success=done and reward == 1.0, action=action, admissible=obs.admissible)

    def task_score(self) -> float:
        return f1_score(self.answer, self.question.answers) if self.answer is not None else 0.0

    def gold_answer(self) -> tuple[str, str, str]:
        """The first golden answer, as IGPO's released code takes it, in the answer tag."""
        return "<answer>", self.question.answers[0], "</answer>"

    def snapshot(self) -> tuple:
        return self.question, tuple(self.found), self.text, self.turn, self.answer

    def restore(self, snap: tuple) -> None:
        self.question, found, self.text, self.turn, self.answer = snap
        self.found = list(found)


class PlannedSearchEnv(SearchEnv):
    """Questions whose passages are known (the generated world's plans, HotpotQA's supporting facts): an oracle and
    an expert, exact over the queries an agent can write from what it has read (`pipeline.envs.search.oracle`)."""

    def __init__(self, cfg: SearchConfig, cache_dir: Path):
        super().__init__(cfg, cache_dir)
        self.oracle = oracle_of(_root(cfg.data_path), cfg.search.top_k, cfg.search.passage_chars)

    def _plan_rows(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.question.plan)

    def oracle_distance(self) -> float:
        if self.answer is not None:
            return 0.0 if exact_match(self.answer, self.question.answers) else math.inf
        return float(self.oracle.searches_needed(self.question.text, self._plan_rows(), self.found) + 1)

    def expert_actions(self) -> list[str]:
        if self.answer is not None:
            return []
        first = self.oracle.first_searches(self.question.text, self.question.plan, list(dict.fromkeys(self.found)))
        if first:
            return [f"<search>{first[0]}</search>"]
        return [f"<answer>{self.question.answers[0]}</answer>"]


@lru_cache(maxsize=4)
def oracle_of(root: str, top_k: int, passage_chars: int) -> SearchOracle:
    """One oracle per corpus and retrieval setting in a process: its memo serves every episode."""
    c = load_corpus(root)
    retriever = retriever_of(root)
    return SearchOracle(c.titles, lambda r: _cut(c.texts[r], passage_chars), lambda q: retriever.search(q, top_k),
                        top_k)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text[:limit]
    return (cut[:cut.rfind(" ")] if " " in cut else cut).rstrip(" ,;:") + "..."


def make(cfg: SearchConfig, cache_dir: Path) -> SearchEnv:
    planned = load_corpus(_root(cfg.data_path)).planned
    return (PlannedSearchEnv if planned else SearchEnv)(cfg, cache_dir)


MAX_NAME_WORDS = 20_000   # title words the tiny tokenizer adds whole; beyond (a real corpus), none


def name_words(cfg: SearchConfig) -> list[str]:
    """The words of the passages' titles, one token each for the tiny policy, which copies names from the
    information it reads into its searches and answers."""
    words = list(dict.fromkeys(w for t in load_corpus(_root(cfg.data_path)).titles for w in re.findall(r"\w+", t)))
    return words if len(words) <= MAX_NAME_WORDS else []


def lacks(cfg: SearchConfig, capability: str) -> str | None:
    """Why the environment of `cfg` has no expert or oracle: Search-R1 questions without a plan (a user's files).
    Reads the question files only, not the corpus (HotpotQA's questions always have their supporting titles)."""
    if capability not in ("expert_actions", "oracle_distance"):
        return None
    return _unplanned(_root(cfg.data_path))


def held_out(cfg: SearchConfig) -> int:
    """The number of held-out questions (the test file's records), read once per data folder and process: every
    stage checks it when its params load."""
    return _held_out_count(_root(cfg.data_path))


@lru_cache(maxsize=4)
def _held_out_count(root: str) -> int:
    return sum(1 for _ in _question_records(_question_file(Path(root), "test")))


def _unplanned(root: str) -> str | None:
    folder = Path(root)
    if data_format(folder) != "search_r1":
        return None
    total, missing, first = 0, 0, None
    for split in ("train", "test"):
        for _, r in _question_records(_question_file(folder, split)):
            total += 1
            if r.get("plan") is None:
                missing += 1
                first = first or str(r["question"])
    if not missing:
        return None
    return (f"{missing} of {total} questions in {folder} carry no plan (the passages each needs, a 'plan' of "
            f"{{id, name}}; first: {first[:80]!r}), so env search has no expert and no oracle")


SPEC = register(EnvSpec("search", SearchConfig, make, words=name_words, requires=("bm25s",),
                        tool_call=lambda action: action.startswith("<search>"),
                        packages="the bm25s package", lacks=lacks, held_out=held_out))
