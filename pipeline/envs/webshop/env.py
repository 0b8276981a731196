"""WebShop, the text shop of GiGPO's, OPRL's and SPA's tables, on its own interface, data files and reward
(`env.name: webshop`; docs/environments.md, "WebShop").

Products, attributes and instructions are read in WebShop's JSON formats from `data_path` (a user's copy of the
real files, or the shop the project ships, `pipeline.envs.webshop.catalogue`), as `engine.load_products` and
`goal.get_human_goals` read them: options lowercased, a price range's price drawn between its bounds, a goal's
price bound drawn from the next four multiples of 10 above the price. Every human instruction is a task; the
goals, in a fixed shuffled order, split into the first `heldout` (the held-out tasks, stream "eval") and the
rest (training, warm-start and tokenizer tasks, by a hash of the task seed).

Pages and commands are WebShop's text mode: the search page takes `search[query]`; a results page lists 10 of
the search's top 50 products (asin, title, price) with `click[next >]`, `click[< prev]` and `click[back to
search]`; an item page shows the product's options (`click[<value>]` picks one), its title and price and
`click[description]`, `click[features]`, `click[reviews]`, `click[buy now]`; buying ends the episode with
WebShop's task score (`pipeline.envs.webshop.reward`) as the reward, a success at 1. The admissible commands are
listed as verl-agent's WebShop prompt lists them (`search[<your query>]` where there is a search bar, then the
clickables); a response's `search[...]` takes any query. The anchor is the page's text (no history, no
instruction), verl-agent's; an item page's text names the options clicked so far.

Search: BM25 (bm25s) over each product's title, description, first bullet point and options, lowercased, the text
WebShop's Lucene index holds; English stop words removed; the top 50 by score, ties by catalogue order.

Capabilities: `oracle_distance` (the fewest commands to a purchase of score 1, where the only search is the
instruction's query: the instruction without its price clause, what WebShop's rule baseline types),
`expert_actions` (the commands that start such a plan) and `task_score` (the score of the purchase, 0 before it).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from pipeline.data.section import EnvSection
from pipeline.data.seeds import task_item
from pipeline.envs.actions import action_content
from pipeline.envs.base import EnvSpec, Observation, StepResult, data_error, data_root, register
from pipeline.envs.webshop.catalogue import FILES, OUT
from pipeline.envs.webshop.reward import Purchase, Target, reward

SEARCH_RETURN_N, PRODUCT_WINDOW = 50, 10                       # engine.py
PRICE_RANGE = [10.0 * i for i in range(1, 100)]               # goal.py
BACK, NEXT, PREV, BUY = "back to search", "next >", "< prev", "buy now"
TABS = ("description", "features", "reviews")
_PRICE_CLAUSE = re.compile(r", and price lower than [\d.]+ dollars$")


class WebShopConfig(EnvSection):
    """WebShop's product and instruction files (the real release's, or the shop the project ships)."""
    name: Literal["webshop"] = "webshop"
    data_path: str | None = Field(None, description="folder holding items_shuffle.json, items_ins_v2.json and "
                                  "items_human_ins.json in WebShop's formats; null: the shop the project ships")
    num_products: int | None = Field(None, ge=1, description="read only the first N products (WebShop's "
                                     "num_products); null: all")
    heldout: int = Field(500, ge=1, description="goals held out for evaluation (WebShop's test split: 500)")
    max_turns: int = Field(15, ge=1, le=500, description="turns before an episode is truncated (verl-agent: 15)")

    @field_validator("data_path")
    @classmethod
    def _readable(cls, v):
        check_files(Path(_root(v)))     # a missing file is refused when the params load (the rest when read)
        return v


def _root(data_path: str | None) -> str:
    return str(data_root(data_path, OUT))     # a string: the key of the loaders' caches


@dataclass(frozen=True)
class Product:
    asin: str
    purchase: Purchase
    price: float
    price_tag: str
    options: dict[str, tuple[str, ...]]

    @property
    def title(self) -> str:
        return self.purchase.title

    @property
    def bullets(self) -> tuple[str, ...]:
        return self.purchase.bullets

    @property
    def description(self) -> str:
        return self.purchase.description


@dataclass(frozen=True)
class Goal:
    asin: str
    instruction: str
    target: Target

    @property
    def query(self) -> str:
        """The instruction's query: the instruction without its price clause."""
        return _PRICE_CLAUSE.sub("", self.instruction)


@dataclass(eq=False)
class Shop:
    products: list[Product]
    by_asin: dict[str, Product]
    goals: list[Goal]
    _index: object = None
    _hits: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def search(self, query: str) -> tuple[str, ...]:
        """The asins of the top 50 products for `query` (BM25 score, ties by catalogue order)."""
        query = query.lower()
        if query not in self._hits:
            self._hits[query] = _search(self, query)
        return self._hits[query]


def check_files(folder: Path) -> None:
    """The folder holds the three files, each starting as WebShop's does (a list, an object, an object)."""
    if not folder.is_dir():
        raise ValueError(f"env.data_path: {folder} is not a folder; expected one holding {', '.join(FILES)}")
    for name, start in zip(FILES, "[{{", strict=True):
        path = folder / name
        if not path.is_file():
            raise data_error(path, "no such file; expected WebShop's " + name)
        with path.open("rb") as f:
            head = f.read(4096).lstrip()
        if not head.startswith(start.encode()):
            raise data_error(path, f"expected a JSON {'list' if start == '[' else 'object'} at the top level, as "
                              f"WebShop's {name}")


def _read(path: Path, kind: type):
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise data_error(path, f"not readable JSON ({e})") from None
    if not isinstance(data, kind):
        raise data_error(path, f"expected a JSON {'list' if kind is list else 'object'} at the top level")
    return data


def _pricing(path: Path, asin: str, pricing) -> list[float]:
    if not pricing:
        return [100.0]
    try:
        return [float(Decimal(re.sub(r"[^\d.]", "", p))) for p in str(pricing).split("$")[1:]][:2] or [100.0]
    except InvalidOperation:
        raise data_error(path, f"product {asin}: pricing {pricing!r} is not a price like '$12.99'") from None


@lru_cache(maxsize=4)
def load_shop(root: str, num_products: int | None) -> Shop:
    """Products and goals as WebShop's `load_products` and `get_human_goals` make them (prices drawn by seeded
    generators, so every stage sees the same shop)."""
    folder = Path(root)
    check_files(folder)
    items_path, attrs_path, human_path = (folder / f for f in FILES)
    items, attrs, human = _read(items_path, list), _read(attrs_path, dict), _read(human_path, dict)
    if num_products is not None:
        items = items[:num_products]
    products, seen = [], set()
    for k, p in enumerate(items):
        try:
            asin = p["asin"]
            if asin == "nan" or len(asin) > 10 or asin in seen:
                continue
            seen.add(asin)
            pricing = _pricing(items_path, asin, p.get("pricing"))
            price = pricing[0] if len(pricing) == 1 else random.Random(f"price {asin}").uniform(*pricing)
            tag = f"${pricing[0]}" if len(pricing) == 1 else f"${pricing[0]} to ${pricing[1]}"
            options = {}
            for name, values in (p["customization_options"] or {}).items():
                if values is None:
                    continue
                options[name.lower()] = tuple(v["value"].strip().replace("/", " | ").lower() for v in values)
            bullets = p["small_description"]
            bullets = tuple(bullets) if isinstance(bullets, list) else (bullets,)
            a = attrs.get(asin, {}).get("attributes") or ["DUMMY_ATTR"]
            purchase = Purchase(query=p["query"].lower().strip(), product_category=p["product_category"],
                                name=p["name"], attributes=tuple(a), title=p["name"], bullets=bullets,
                                description=p["full_description"])
        except (KeyError, TypeError, AttributeError) as e:
            raise data_error(items_path, f"product {k} is not a WebShop product ({type(e).__name__}: {e})") from None
        products.append(Product(asin, purchase, price, tag, options))
    by_asin = {p.asin: p for p in products}
    goals = []
    for asin, entries in human.items():
        if asin not in by_asin:
            continue
        prod = by_asin[asin]
        for j, g in enumerate(entries):
            try:
                instruction, want, options = g["instruction"], g["instruction_attributes"], g["instruction_options"]
                if not isinstance(want, list) or not isinstance(options, list | dict):
                    raise TypeError("instruction_attributes must be a list and instruction_options a list or object")
            except (KeyError, TypeError) as e:
                raise data_error(human_path, f"instruction {j} of {asin} is malformed "
                                             f"({type(e).__name__}: {e})") from None
            if not want:
                continue                    # get_human_goals skips instructions without attributes
            above = [x for x in PRICE_RANGE if x > prod.price][:4]
            if len(above) >= 2:
                upper = max(random.Random(f"goal {asin} {j}").sample(above, 2))
                text = instruction.strip(".") + f", and price lower than {upper:.2f} dollars"
            else:
                upper, text = 1000000.0, instruction.strip(".")
            values = tuple(options.values()) if isinstance(options, dict) else tuple(options)
            goals.append(Goal(asin, text, Target(query=prod.purchase.query,
                                                 product_category=prod.purchase.product_category,
                                                 name=prod.purchase.name, attributes=tuple(want),
                                                 options=values, price_upper=upper)))
    if not goals:
        raise data_error(human_path, "no instruction with attributes names a product of items_shuffle.json")
    random.Random(233).shuffle(goals)                  # WebShop's SimServer: random.seed(233); shuffle(goals)
    return Shop(products, by_asin, goals)


def _doc(p: Product) -> str:
    opts = ", and ".join(f"{n}: {', '.join(v)}" for n, v in p.options.items())
    return " ".join([p.title, p.description, p.bullets[0] if p.bullets else "", opts]).lower()


def _search(shop: Shop, query: str) -> tuple[str, ...]:
    import bm25s  # start-up cost: bm25s
    import numpy as np

    if shop._index is None:
        index = bm25s.BM25()
        index.index(bm25s.tokenize([_doc(p) for p in shop.products], stopwords="en", show_progress=False),
                    show_progress=False)
        shop._index = index
    tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
    known = [t for t in tokens if t in shop._index.vocab_dict]
    if not known:
        return ()
    scores = shop._index.get_scores(known)
    order = np.lexsort((np.arange(len(scores)), -scores))
    return tuple(shop.products[i].asin for i in order[:SEARCH_RETURN_N] if scores[i] > 0)


# -- pages ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    kind: str                             # search | results | item | tab | done
    query: str = ""
    page: int = 1
    asin: str = ""
    chosen: tuple[tuple[str, str], ...] = ()   # option name -> value, in the product's option order
    tab: str = ""
    score: float = 0.0


def _choose(p: Product, chosen: tuple[tuple[str, str], ...], value: str) -> tuple[tuple[str, str], ...]:
    name = next(n for n, vs in p.options.items() if value in vs)
    now = dict(chosen) | {name: value}
    return tuple((n, now[n]) for n in p.options if n in now)


class WebShopEnv:
    name = "webshop"

    def __init__(self, cfg: WebShopConfig, cache_dir: Path):
        self.cfg = cfg
        self.shop = load_shop(_root(cfg.data_path), cfg.num_products)
        if cfg.heldout >= len(self.shop.goals):
            raise ValueError(f"env.heldout: {cfg.heldout} held-out goals leave none of the "
                             f"{len(self.shop.goals)} goals for training")
        self.goal: Goal | None = None
        self.state = Page("search")
        self.turn = 0
        self._dist: dict[Page, float] = {}       # per goal: a page's distance, a product's clicks to win
        self._clicks: dict[tuple, float] = {}

    # -- the page graph ---------------------------------------------------------------------------------------

    def goal_of(self, task: int) -> Goal:
        goals, k = self.shop.goals, self.cfg.heldout     # the first k instructions are the held-out ones
        return task_item(task, goals[k:], goals[:k])

    def commands(self, s: Page) -> tuple[str, ...]:
        if s.kind == "search":
            return ("search[<your query>]",)
        if s.kind == "results":
            hits = self.shop.search(s.query)
            out = [BACK] + ([PREV] if s.page > 1 else []) + ([NEXT] if s.page * PRODUCT_WINDOW < len(hits) else [])
            out += [a.lower() for a in hits[(s.page - 1) * PRODUCT_WINDOW:s.page * PRODUCT_WINDOW]]
            return tuple(f"click[{c}]" for c in out)
        if s.kind == "item":
            p = self.shop.by_asin[s.asin]
            values = list(dict.fromkeys(v for vs in p.options.values() for v in vs))
            return tuple(f"click[{c}]" for c in (BACK, PREV, *values, *TABS, BUY))
        if s.kind == "tab":
            return tuple(f"click[{c}]" for c in (BACK, PREV))
        return ()

    def transition(self, s: Page, command: str) -> Page | None:
        """The page a command leads to, or None when it is not valid on page `s`."""
        m = re.fullmatch(r"(search|click)\[(.+)\]", command.strip())
        if m is None:
            return None
        verb, arg = m.group(1), m.group(2).strip()
        if verb == "search":
            return Page("results", query=arg.lower()) if s.kind == "search" and arg else None
        if f"click[{arg}]" not in self.commands(s):
            return None
        if arg == BACK:
            return Page("search")
        if s.kind == "results":
            if arg == NEXT:
                return replace(s, page=s.page + 1)
            if arg == PREV:
                return replace(s, page=s.page - 1)
            return Page("item", query=s.query, page=s.page, asin=arg.upper())
        if s.kind == "tab":
            return replace(s, kind="item", tab="")
        if arg == PREV:
            return Page("results", query=s.query, page=s.page)
        if arg in TABS:
            return replace(s, kind="tab", tab=arg)
        p = self.shop.by_asin[s.asin]
        if arg == BUY:
            return replace(s, kind="done", score=self.score(p, dict(s.chosen)))
        return replace(s, chosen=_choose(p, s.chosen, arg))

    def score(self, p: Product, chosen: dict[str, str]) -> float:
        return reward(p.purchase, self.goal.target, p.price, chosen)

    def render(self, s: Page) -> str:
        if s.kind == "search":
            return "Search"
        if s.kind == "done":
            return f"Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] {s.score:.4g}"
        if s.kind == "results":
            hits = self.shop.search(s.query)
            parts = ["Back to Search", f"Page {s.page} (Total results: {len(hits)})"]
            parts += (["< Prev"] if s.page > 1 else []) + (["Next >"] if s.page * PRODUCT_WINDOW < len(hits) else [])
            for a in hits[(s.page - 1) * PRODUCT_WINDOW:s.page * PRODUCT_WINDOW]:
                p = self.shop.by_asin[a]
                parts += [a, p.title, p.price_tag]
            return " [SEP] ".join(parts)
        p = self.shop.by_asin[s.asin]
        if s.kind == "tab":
            body = {"description": [p.description], "features": list(p.bullets), "reviews": []}[s.tab]
            return " [SEP] ".join(["Back to Search", "< Prev", *body])
        clicked = [f"You have clicked {v}." for _, v in s.chosen]
        parts = ["Back to Search", "< Prev"]
        for name, values in p.options.items():
            parts += [name, *values]
        parts += [p.title, f"Price: {p.price_tag}", "Rating: N.A.", "Description", "Features", "Reviews", "Buy Now"]
        return " ".join(clicked + [" [SEP] ".join(parts)])

    # -- the Env interface ------------------------------------------------------------------------------------

    def task_description(self) -> str:
        return f"WebShop. Instruction: {self.goal.instruction}"

    def _observe(self) -> Observation:
        text = self.render(self.state)
        return Observation(text, text, self.commands(self.state))

    def reset(self, task: int) -> Observation:
        self.goal = self.goal_of(task)
        self.state, self.turn = Page("search"), 0
        self._dist.clear()
        self._clicks.clear()
        return self._observe()

    def step(self, response_text: str) -> StepResult:
        if self.goal is None:
            raise RuntimeError("WebShopEnv.step called before reset")
        self.turn += 1
        content = action_content(response_text)
        nxt = self.transition(self.state, content) if content is not None else None
        action = content if nxt is not None else None
        if nxt is not None:
            self.state = nxt
        done = self.state.kind == "done"
        obs = self._observe()
        return StepResult(observation=obs.text, anchor=obs.anchor, reward=self.state.score if done else 0.0,
                          terminated=done, truncated=not done and self.turn >= self.cfg.max_turns,
                          action_valid=action is not None, success=done and self.state.score >= 1.0,
                          action=action, admissible=obs.admissible)

    # -- capabilities -----------------------------------------------------------------------------------------

    def task_score(self) -> float:
        return self.state.score if self.state.kind == "done" else 0.0

    def snapshot(self) -> tuple:
        return self.goal, self.state, self.turn      # a goal and a page are frozen

    def restore(self, snap: tuple) -> None:
        if snap[0] != self.goal:                     # the planner's caches are per goal
            self._dist.clear()
            self._clicks.clear()
        self.goal, self.state, self.turn = snap

    def oracle_distance(self) -> float:
        return self.distance(self.state)

    def expert_actions(self) -> list[str]:
        d = self.distance(self.state)
        if d == 0 or math.isinf(d):
            return []
        moves = [f"search[{self.goal.query}]"] if self.state.kind == "search" else list(self.commands(self.state))
        return [c for c in moves if self.distance(self.transition(self.state, c)) == d - 1]

    def distance(self, s: Page) -> float:
        """The fewest commands from page `s` to a purchase of score 1 (searching only the instruction's query)."""
        if s not in self._dist:
            self._dist[s] = _plan(self, s)
        return self._dist[s]

    def clicks_to_win(self, asin: str, chosen: tuple[tuple[str, str], ...]) -> float:
        """The fewest option clicks that make buying `asin` score 1 from the options `chosen`, inf where none does."""
        key = (asin, chosen)
        if key not in self._clicks:
            self._clicks[key] = _clicks(self, asin, chosen)
        return self._clicks[key]


def _clicks(env: WebShopEnv, asin: str, chosen: tuple[tuple[str, str], ...]) -> float:
    p = env.shop.by_asin[asin]
    now = dict(chosen)
    best = math.inf
    names = list(p.options)
    # each option name: keep what is chosen (or nothing) or click one of its values
    for pick in itertools.product(*[(None, *p.options[n]) for n in names]):
        clicks = sum(v is not None and now.get(n) != v for n, v in zip(names, pick, strict=True))
        if clicks >= best:
            continue
        final = now | {n: v for n, v in zip(names, pick, strict=True) if v is not None}
        if env.score(p, final) >= 1.0:
            best = clicks
    return float(best)


def _results_distance(env: WebShopEnv, query: str, page: int) -> float:
    """From page `page` of a query's results, without going back to search: next/prev to a winner's page, click
    it, click its options, buy."""
    hits = env.shop.search(query)
    best = math.inf
    for k, a in enumerate(hits):
        c = env.clicks_to_win(a, ())
        if not math.isinf(c):
            best = min(best, abs(k // PRODUCT_WINDOW + 1 - page) + 1 + c + 1)
    return best


def _plan(env: WebShopEnv, s: Page) -> float:
    if s.kind == "done":
        return 0.0 if s.score >= 1.0 else math.inf
    from_search = 1 + _results_distance(env, env.goal.query, 1)
    if s.kind == "search":
        return from_search
    back = 1 + from_search
    if s.kind == "results":
        return min(back, _results_distance(env, s.query, s.page))
    here = env.clicks_to_win(s.asin, s.chosen) + 1
    item = min(back, here, 1 + _results_distance(env, s.query, s.page))
    return item if s.kind == "item" else min(back, 1 + item)


MAX_ID_TOKENS = 10_000   # products whose ids the tiny tokenizer adds whole; beyond, ids stay BPE pieces


def id_words(cfg: WebShopConfig) -> list[str]:
    """Each product's id as the results page shows it and as `click[...]` writes it: the tiny policy copies an id
    as one token (as BPE pieces it wrote ids that are on no page). Not for the full 1.18M-product shop."""
    ids = list(load_shop(_root(cfg.data_path), cfg.num_products).by_asin)
    return [w for a in ids for w in (a, a.lower())] if len(ids) <= MAX_ID_TOKENS else []


SPEC = register(EnvSpec("webshop", WebShopConfig, WebShopEnv, requires=("bm25s", "thefuzz", "spacy"),
                        tool_call=lambda action: action.strip().startswith("search["),
                        packages="the bm25s, thefuzz and spacy packages", words=id_words,
                        held_out=lambda cfg: cfg.heldout))
