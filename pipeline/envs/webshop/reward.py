"""WebShop's task score of a purchase, as `web_agent_site/engine/goal.py:get_reward` computes it (docs/environments.md,
"WebShop").

    score = r_type * (attributes matched + options matched + [price <= bound]) / (attributes + options + 1)

- attributes: a goal attribute matches when one of the product's attributes has a fuzzy token-set ratio above 85
  with it (thefuzz's `token_set_ratio`, as WebShop), or it appears in the title, the bullet points or the
  description (lowercase substring);
- options: a goal option value matches when a chosen option value, both reduced to the first colour word they
  contain (`normalize_color`), has a token-set ratio above 85 with it;
- r_type: 1, lowered to 0.5 when neither the search query, two of the category path's levels nor more than 20 % of
  the goal title's nouns match, to 0.1 when under 10 % of them match and to 0 when none does.

The one part that differs from the original: WebShop takes the titles' nouns from spaCy's `en_core_web_sm` (not on
the package index, so not installable here). `title_nouns` keeps the title's words that are not English stop words
(spaCy's list), colours or numbers: product titles are noun phrases, so nearly all of their other words are nouns
or proper nouns. tests/unit/test_webshop.py runs WebShop's own reward tests (tests/web-agent-site/engine/
test_goal.py) against this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

COLOR_SET = (
    'alabaster', 'apricot', 'aqua', 'ash', 'asphalt', 'azure', 'banana', 'beige', 'black', 'blue', 'blush', 'bordeaux',
    'bronze', 'brown', 'burgundy', 'camel', 'camo', 'caramel', 'champagne', 'charcoal', 'cheetah', 'chestnut',
    'chocolate', 'christmas', 'coffee', 'cognac', 'copper', 'coral', 'cranberry', 'cream', 'crystal', 'dark', 'denim',
    'eggplant', 'elephant', 'espresso', 'fuchsia', 'gold', 'granite', 'grape', 'graphite', 'grass', 'gray', 'green',
    'grey', 'heather', 'indigo', 'ivory', 'ivy', 'khaki', 'lavender', 'lemon', 'leopard', 'light', 'lilac', 'lime',
    'magenta', 'maroon', 'mauve', 'merlot', 'midnight', 'mint', 'mocha', 'multicolor', 'mushroom', 'mustard',
    'natural', 'navy', 'nude', 'olive', 'orange', 'peach', 'pewter', 'pink', 'plum', 'purple', 'rainbow', 'red',
    'rose', 'royal', 'rust', 'sand', 'sapphire', 'seashell', 'silver', 'skull', 'slate', 'steel', 'stone',
    'stonewash', 'sunflower', 'tan', 'taupe', 'teal', 'tiger', 'turquoise', 'violet', 'walnut', 'wheat', 'white',
    'wine', 'yellow',
)   # web_agent_site/engine/normalize.py


def normalize_color(value: str) -> str:
    """The first colour of COLOR_SET the value contains (as a substring, in the set's order), else the value."""
    for c in COLOR_SET:
        if c in value:
            return c
    return value


def fuzzy(a: str, b: str) -> int:
    from thefuzz import fuzz  # start-up cost: rapidfuzz

    return fuzz.token_set_ratio(a, b)


_LETTER = re.compile(r"[a-z]")


def title_nouns(title: str) -> list[str]:
    """The title's words a noun parse would keep: its lowercase words (split at spaces, outer punctuation
    stripped) that have a letter and are not stop words or colours."""
    from spacy.lang.en.stop_words import STOP_WORDS  # a word list only: no model is loaded

    words = (w.strip("()[]{},.:;!?\"'-/|&*") for w in title.lower().split())
    return [w for w in words if _LETTER.search(w) and w not in STOP_WORDS and w not in COLOR_SET]


@dataclass(frozen=True)
class Purchase:
    """What the reward reads of a product (WebShop's loaded product's keys)."""
    query: str
    product_category: str
    name: str
    attributes: tuple[str, ...]
    title: str
    bullets: tuple[str, ...]
    description: str


@dataclass(frozen=True)
class Target:
    """What the reward reads of a goal."""
    query: str
    product_category: str
    name: str
    attributes: tuple[str, ...]
    options: tuple[str, ...]
    price_upper: float


def type_reward(p: Purchase, g: Target) -> float:
    query_match = p.query == g.query
    levels = lambda s: {x.strip() for x in s.split("›")}          # noqa: E731
    category_match = len(levels(p.product_category) & levels(g.product_category)) >= 2
    bought, wanted = title_nouns(p.name), title_nouns(g.name)
    title_score = 0.2 if not wanted else len(set(bought) & set(wanted)) / len(wanted)
    r = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r = 0.1
    if title_score == 0.0:
        r = 0.0
    return r


def attribute_matches(p: Purchase, goal_attributes: Iterable[str]) -> int:
    text = (p.title.lower(), " ".join(p.bullets).lower(), p.description.lower())
    n = 0
    for g in goal_attributes:
        if any(fuzzy(a, g) > 85 for a in p.attributes) or any(g in t for t in text):
            n += 1
    return n


def option_matches(chosen: Iterable[str], goal_options: Iterable[str]) -> int:
    chosen = [normalize_color(o) for o in chosen]
    return sum(any(fuzzy(c, normalize_color(g)) > 85 for c in chosen) for g in goal_options)


def reward(p: Purchase, g: Target, price: float, chosen: Mapping[str, str]) -> float:
    """The task score in [0, 1] of buying `p` at `price` with the option values `chosen` (name -> value)."""
    matched = attribute_matches(p, g.attributes) + option_matches(chosen.values(), g.options) + (price <= g.price_upper)
    return type_reward(p, g) * matched / (len(g.attributes) + len(g.options) + 1)
