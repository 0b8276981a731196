"""The search world the project ships (`data/search/`): a fictional encyclopedia and multi-hop questions about it,
written in Search-R1's file formats, generated here.

    python -m pipeline.envs.search.world            # writes data/search/ (deterministic: byte for byte)

Three files, as Search-R1 (and FlashRAG, whose dataset layout it reads) names them:
- `corpus.jsonl`: one passage a line, `{"id", "contents"}` with `contents` = `"Title"\\ntext`;
- `train.jsonl`, `test.jsonl`: one question a line, `{"id", "question", "golden_answers"}`, plus what only a
  generated world can know: `type` (bridge | comparison), `hops` and `plan`, the passages the question needs in
  the order they can be found, each `{"id", "name"}` with the name that finds it (written in the question, or in
  the plan's previous passage).

About 2,000 entities of seven kinds: countries, cities, rivers, universities, people, companies and films. Each
has one passage of 2-4 sentences naming its relations (a city's country, a person's birthplace and university,
a company's founder and headquarters, a film's company and director, a river's country and city) and attributes
(years, lengths, populations). Names are drawn from syllables; people come in families that share a surname and
first names recur, companies and universities are named after surnames and cities, so a search for a name also
returns the passages of its namesakes.

Questions (HotpotQA's two types):
- bridge chains of 1 to 4 hops, each hop's answer naming the next passage ("In which country was the founder of
  the company that made <film> born?": the film, its company, its founder, the founder's birthplace);
- comparisons of two entities of one kind on an attribute ("Which is longer, the Elsen or the Tarn?").

Kept are the questions whose plan can be followed with BM25 at k = 3 (`pipeline.envs.search.index`): the search
for each name returns its passage, and no other passage of the plan, so the plan's names retrieve the plan in as
many searches as it has hops. That is an upper bound of the oracle's distance, which is exact over the queries an
agent can write from what it has read (`pipeline.envs.search.oracle`): a comparison's own question retrieves both
of its passages, so it takes one search, not two. Held out (`test.jsonl`): every question about the last fifth of
the films, people, rivers, companies and universities as a chain's first entity or a comparison's first, so
held-out chains start from entities that no training question starts from. Both files are shuffled, so the first
N held-out questions (what `evaluate.tasks` plays) mix every type and length.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from pipeline.data.tables import write_text_atomic
from pipeline.envs.search.index import Retriever

OUT = Path(__file__).resolve().parents[3] / "data" / "search"
FILES = ("corpus.jsonl", "train.jsonl", "test.jsonl")
SEED = 2018                                    # HotpotQA's year
COUNTS = {"country": 14, "city": 160, "river": 70, "university": 90, "person": 1160, "company": 240, "film": 300}
TOP_K = 3                                      # the retrieval the kept plans are checked at (top_k default)

ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v",
          "w", "z", "th", "sh", "el", "or", "an", "ar"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ia", "y", "ou"]
CODAS = ["", "", "n", "r", "l", "s", "m", "th", "nd", "rk", "x", "v"]
FIRST = ["Ada", "Bram", "Cora", "Dario", "Edda", "Falk", "Greta", "Hugo", "Ines", "Jonas", "Kaia", "Lev", "Mira",
         "Nils", "Odile", "Pavel", "Quinn", "Rosa", "Sven", "Tilde", "Ugo", "Vera", "Wim", "Xenia", "Yann", "Zora",
         "Anselm", "Berit", "Cyril", "Dagny", "Emil", "Freya", "Gideon", "Hedda", "Ivo", "Juno", "Konrad", "Liv",
         "Magnus", "Nora", "Otto", "Petra", "Rune", "Selma", "Teo", "Una", "Viggo", "Wanda"]
JOBS = ["painter", "engineer", "physician", "composer", "architect", "novelist", "chemist", "banker", "sculptor",
        "economist", "botanist", "poet", "lawyer", "astronomer", "historian"]
REGIONS = ["the northern continent", "the southern continent", "the eastern archipelago", "the western coast"]
COMPANY_KINDS = ["Pictures", "Studios", "Films", "Media", "Works", "Motion", "Screen", "Productions"]
GENRES = ["drama", "comedy", "thriller", "musical", "western", "documentary", "romance", "mystery"]
CITY_ENDS = ["holm", "burg", "ford", "vik", "stad", "mouth", "bridge", "ton"]


def _word(rng: random.Random, syllables: int) -> str:
    w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)) + rng.choice(CODAS)
    return w.capitalize()


def _unique(rng: random.Random, taken: set[str], make) -> str:
    while True:
        w = make()
        if w.lower() not in taken and len(w) >= 4:
            taken.add(w.lower())
            return w


def generate(seed: int = SEED, counts: dict[str, int] = COUNTS) -> tuple[list[dict], list[dict], list[dict]]:
    """The corpus's passages and the training and held-out questions (before the retrieval check)."""
    rng = random.Random(seed)
    taken: set[str] = set()
    words = lambda n: _unique(rng, taken, lambda: _word(rng, n))  # noqa: E731
    E: dict[str, list[dict]] = {k: [] for k in counts}

    for _ in range(counts["country"]):
        E["country"].append({"kind": "country", "name": words(3), "region": rng.choice(REGIONS),
                             "area": rng.randrange(20, 900) * 1000})
    for _ in range(counts["city"]):
        E["city"].append({"kind": "city", "name": _unique(rng, taken, lambda: _word(rng, 1) + rng.choice(CITY_ENDS)),
                          "country": rng.choice(E["country"]), "founded": rng.randrange(800, 1900),
                          "population": rng.randrange(8, 2400) * 1000})
    for c in E["country"]:
        c["capital"] = rng.choice([x for x in E["city"] if x["country"] is c] or E["city"])
    for _ in range(counts["river"]):
        city = rng.choice(E["city"])
        E["river"].append({"kind": "river", "name": words(2), "country": city["country"], "city": city,
                           "length": rng.randrange(40, 3000)})
    surnames = [words(2) for _ in range(counts["person"] // 4)]
    people_names: set[str] = set()
    for _ in range(counts["person"]):
        while True:
            name = f"{rng.choice(FIRST)} {rng.choice(surnames)}"
            if name not in people_names:
                people_names.add(name)
                break
        E["person"].append({"kind": "person", "name": name, "born": rng.randrange(1850, 2000),
                            "city": rng.choice(E["city"]), "job": rng.choice(JOBS)})
    for _ in range(counts["university"]):
        city = rng.choice(E["city"])
        name = _unique(rng, taken, lambda: rng.choice([f"University of {city['name']}",
                                                       f"{rng.choice(surnames)} University",
                                                       f"{city['name']} Institute of Technology",
                                                       f"{rng.choice(surnames)} College"]))
        E["university"].append({"kind": "university", "name": name, "city": city,
                                "founded": rng.randrange(1100, 1990)})
    for p in E["person"]:
        p["university"] = rng.choice(E["university"])
    for _ in range(counts["company"]):
        founder = rng.choice(E["person"])
        name = _unique(rng, taken, lambda: f"{rng.choice([founder['name'].split()[1], words(2)])} "
                                           f"{rng.choice(COMPANY_KINDS)}")
        E["company"].append({"kind": "company", "name": name, "founder": founder, "city": rng.choice(E["city"]),
                             "founded": max(founder["born"] + 20, rng.randrange(1890, 2015))})
    for _ in range(counts["film"]):
        n = rng.choice([1, 2])
        name = _unique(rng, taken, lambda: " ".join(["The"] * (n == 1) + [_word(rng, 2) for _ in range(n)]))
        company = rng.choice(E["company"])
        E["film"].append({"kind": "film", "name": name, "company": company, "director": rng.choice(E["person"]),
                          "year": rng.randrange(company["founded"], 2025), "genre": rng.choice(GENRES)})

    entities = [e for k in counts for e in E[k]]
    order = list(range(len(entities)))
    rng.shuffle(order)                                     # passages in no particular order, as a real corpus
    for pid, i in enumerate(order):
        entities[i]["id"] = str(pid)
    corpus = sorted(({"id": e["id"], "contents": f'"{e["name"]}"\n{_passage(e)}'} for e in entities),
                    key=lambda d: int(d["id"]))
    held = {k: {id(e) for e in E[k][len(E[k]) * 4 // 5:]} for k in E}
    train, test = [], []
    for q in _questions(rng, E):
        (test if id(q.pop("start")) in held[q.pop("start_kind")] else train).append(q)
    rng.shuffle(train)          # the first N held-out questions (evaluate.tasks) mix every type and length
    rng.shuffle(test)
    return corpus, train, test


def _passage(e: dict) -> str:
    k, n = e["kind"], e["name"]
    if k == "country":
        return (f"{n} is a country in {e['region']}. Its capital is {e['capital']['name']}. "
                f"It covers {e['area']:,} square kilometres.")
    if k == "city":
        return (f"{n} is a city in {e['country']['name']}. It was founded in {e['founded']} and has a population "
                f"of {e['population']:,}.")
    if k == "river":
        return (f"The {n} is a river of {e['country']['name']}, {e['length']:,} kilometres long. It flows through "
                f"{e['city']['name']}.")
    if k == "person":
        article = "an" if e["job"][0] in "aeiou" else "a"
        return (f"{n} (born {e['born']}) is {article} {e['job']} born in {e['city']['name']}. {n.split()[0]} studied "
                f"at {e['university']['name']}.")
    if k == "university":
        return f"{n} is a university in {e['city']['name']}. It was founded in {e['founded']}."
    if k == "company":
        return (f"{n} is a film company founded in {e['founded']} by {e['founder']['name']}. It is headquartered in "
                f"{e['city']['name']}.")
    return (f"{n} is a {e['year']} {e['genre']} film made by {e['company']['name']}. It was directed by "
            f"{e['director']['name']}.")


# bridge chains: (hops as relations from the first entity's kind, question template); `{0}` is the first entity
CHAINS = {
    "film": [
        (["company"], "Which company made {0}?"),
        (["director"], "Who directed {0}?"),
        (["company", "founder"], "Who founded the company that made {0}?"),
        (["director", "city"], "In which city was the director of {0} born?"),
        (["company", "city"], "In which city is the company that made {0} headquartered?"),
        (["company", "founder", "city"], "In which city was the founder of the company that made {0} born?"),
        (["director", "city", "country"], "In which country was the director of {0} born?"),
        (["director", "university", "city"], "In which city is the university where the director of {0} "
                                             "studied?"),
        (["company", "founder", "city", "country"], "In which country was the founder of the company that made "
                                                    "{0} born?"),
        (["company", "founder", "university", "city"], "In which city is the university where the founder of the "
                                                       "company that made {0} studied?"),
        (["director", "university", "city", "country"], "In which country is the university where the director "
                                                        "of {0} studied?"),
    ],
    "person": [
        (["city"], "In which city was {0} born?"),
        (["university"], "Where did {0} study?"),
        (["city", "country"], "In which country was {0} born?"),
        (["university", "city"], "In which city is the university where {0} studied?"),
        (["university", "city", "country"], "In which country is the university where {0} studied?"),
    ],
    "company": [
        (["founder"], "Who founded {0}?"),
        (["founder", "city"], "In which city was the founder of {0} born?"),
        (["founder", "city", "country"], "In which country was the founder of {0} born?"),
        (["city", "country"], "In which country is {0} headquartered?"),
    ],
    "river": [
        (["country"], "Through which country does the {0} flow?"),
        (["city", "country"], "The {0} flows through a city: in which country is that city?"),
    ],
    "university": [
        (["city"], "In which city is {0}?"),
        (["city", "country"], "In which country is {0}?"),
    ],
}
# comparisons: kind -> (attribute, question template, True when the larger value wins)
COMPARE = {
    "river": ("length", "Which is longer, the {0} or the {1}?", True),
    "person": ("born", "Who was born first, {0} or {1}?", False),
    "company": ("founded", "Which was founded earlier, {0} or {1}?", False),
    "university": ("founded", "Which is older, {0} or {1}?", False),
    "city": ("population", "Which city has more people, {0} or {1}?", True),
    "film": ("year", "Which film came out first, {0} or {1}?", False),
}


def _questions(rng: random.Random, E: dict[str, list[dict]]):
    n = 0
    for kind, chains in CHAINS.items():
        for e in E[kind]:
            for hops, template in rng.sample(chains, min(2, len(chains))):
                plan, cur = [e], e
                for rel in hops:
                    cur = cur[rel]
                    plan.append(cur)
                answer, plan = plan[-1], plan[:-1]
                yield {"id": f"q{n}", "question": template.format(e["name"]), "golden_answers": [answer["name"]],
                       "type": "bridge", "hops": len(plan), "plan": [{"id": p["id"], "name": p["name"]} for p in plan],
                       "start": e, "start_kind": kind}
                n += 1
    for kind, (attr, template, larger) in COMPARE.items():
        for e in E[kind]:
            other = e
            while other is e or other[attr] == e[attr]:
                other = rng.choice(E[kind])
            a, b = e, other                        # the question's first entity decides its split
            win = max((a, b), key=lambda x: x[attr] if larger else -x[attr])
            yield {"id": f"q{n}", "question": template.format(a["name"], b["name"]), "golden_answers": [win["name"]],
                   "type": "comparison", "hops": 2, "plan": [{"id": a["id"], "name": a["name"]},
                                                              {"id": b["id"], "name": b["name"]}],
                   "start": e, "start_kind": kind}
            n += 1


def followable(corpus: list[dict], questions: list[dict], top_k: int = TOP_K) -> list[dict]:
    """The questions whose plan the expert follows at `top_k`: each hop's search (its name) returns its passage and
    none of the plan's later passages (so each search finds exactly one new hop)."""
    retriever = Retriever([d["contents"] for d in corpus])
    ids = [d["id"] for d in corpus]
    row = {pid: k for k, pid in enumerate(ids)}
    kept = []
    for q in questions:
        plan = [row[h["id"]] for h in q["plan"]]
        if len(set(plan)) == len(plan) and all(
                plan[j] in (found := set(retriever.search(h["name"], top_k))) and not found & set(plan[j + 1:])
                for j, h in enumerate(q["plan"])):
            kept.append(q)
    return kept


def write(out: Path = OUT) -> list[Path]:
    corpus, train, test = generate()
    contents = (corpus, followable(corpus, train), followable(corpus, test))
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in zip(FILES, contents, strict=True):
        write_text_atomic(out / name, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        paths.append(out / name)
    return paths


if __name__ == "__main__":
    for p in write(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(f"wrote {p} ({sum(1 for _ in p.open())} lines)")
