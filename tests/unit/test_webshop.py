"""WebShop (`env.name: webshop`): the reward against WebShop's own reward tests and hand-computed cases, the shipped
shop in WebShop's file formats, the oracle distance against a breadth-first search of the page graph, the expert's
plan ending in a purchase of score 1, and bad data refused with the file named."""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path

import pytest
import yaml

from pipeline.config.params import ParamsError, load_params
from pipeline.envs.webshop import catalogue as webshop_catalogue
from pipeline.envs.webshop.env import WebShopConfig, WebShopEnv, load_shop
from pipeline.envs.webshop.reward import (
    Purchase,
    Target,
    attribute_matches,
    option_matches,
    reward,
    title_nouns,
    type_reward,
)


def purchase(**kw) -> Purchase:
    base = dict(query="query 1", product_category="a › b › c", name="Name 1", attributes=(), title="", bullets=(),
                description="")
    return Purchase(**(base | kw))


def target(**kw) -> Target:
    base = dict(query="query 1", product_category="a › b › c", name="Name 1", attributes=(), options=(),
                price_upper=40.0)
    return Target(**(base | kw))


# -- the reward: WebShop's tests/web-agent-site/engine/test_goal.py, case by case ----------------------------------

def test_type_reward_as_webshops_tests():
    g = target()
    assert type_reward(purchase(), g) == 1.0                                          # exact match
    g = target(name="Tea Kettle Stove Whistle Glass Handle")
    for category, match in [("b › c › a", True), ("d › e › f", False), ("a › d › b", True), ("a › a › b", True),
                            ("a › a › d", False)]:
        # WebShop asserts category_match; with another query and a title sharing 1 of the 6 nouns (0.167: between
        # the 0.1 and 0.2 thresholds) it decides r_type: 1 when the categories match, else 0.5
        p = purchase(query="query 2", product_category=category, name="Kettle Lid")
        assert type_reward(p, g) == (1.0 if match else 0.5)
    assert type_reward(purchase(query="query 2", name="Kettle Lid"), g) == 1.0      # the query alone matches too
    assert type_reward(purchase(name="Lid"), g) == 0.0                     # no noun in common: 0, whatever matches
    # titles: WebShop's title scores 0.333, 0.3, 0.15 and < 0.05 (spaCy's nouns); the word rule gives 0.5, 0.278,
    # 0.143 and 0, on the same side of the 0.2 and 0.1 thresholds, so r_type is the same: 1, 1, 0.5, 0
    cases = [
        ("Mens D.O.N. Issue 2 Gca Basketball Sneakers Shoes Casual - Off White",
         "PEAK High Top Mens Basketball Shoes Lou Williams Streetball Master Breathable Non Slip Outdoor Sneakers",
         4 / 8, 1.0),
        ("Saireed UL Listed 2 Prong Power Cord for JBL Bar 3.1 Bar 2.1 Channel 4K Ultra HD Soundbar Home Theater "
         "System Subwoofer",
         "BRST AC Power Cord Outlet Socket Cable Plug Lead for Panasonic SC-HT830V DVD/VCR Combo Home Theater System",
         5 / 18, 1.0),
        ("Saireed UL Listed 2 Prong Power Cord for JBL Bar 3.1 Bar 2.1 Channel 4K Ultra HD Soundbar",
         "BRST AC Power Cord Outlet Socket Cable Plug Lead for Panasonic SC-HT830V DVD/VCR Combo Home Theater System",
         2 / 14, 0.5),
        ("Rusticware 921ORB Kitchen and Bath Cabinet Knob",
         "Minkissy 2pcs Stainless Steel Eyebrow Tweezers Blackhead Acne Remover Portable Makeup Tweezers (Silver)",
         0.0, 0.0),
    ]
    for wanted, bought, score, r_type in cases:
        w, b = title_nouns(wanted), title_nouns(bought)
        assert len(set(w) & set(b)) / len(w) == pytest.approx(score)
        assert type_reward(purchase(query="query 2", product_category="a › d › e", name=bought),
                           target(name=wanted)) == r_type


def test_attribute_reward_as_webshops_tests():
    g = ("tea tree", "essential oils", "natural ingredients")
    assert attribute_matches(purchase(attributes=("tea tree", "essential oil", "natural ingredients")), g) == 3
    assert attribute_matches(purchase(attributes=("essential oil", "natural ingredients")), g) == 2
    text = purchase(bullets=("This shampoo has essential oils and smells like lemons",),
                    description="Best shampoo on the market, made with natural ingredients")
    assert attribute_matches(text, g) == 2                  # found in the bullet points and the description
    assert attribute_matches(purchase(attributes=("tea bag", "earl gray", "lipton"), title="English tea for breakfast",
                                      bullets=("Soothing aroma", "Calming, great feeling"),
                                      description="Best tea made by Lipton, great to pair with breakfast"), g) == 0


def test_option_reward_as_webshops_tests_and_by_hand():
    assert option_matches(["pack of 12", "grey", "XL"], ["grey", "XL", "pack of 12"]) == 3
    assert option_matches(["pack of 12", "blue", "XL"], ["grey", "XL", "pack of 12"]) == 2
    assert option_matches(["pack of 12", "powder snow", "XL"], ["cool powder snow", "XL", "pack of 12"]) == 3
    assert option_matches(["goal 1"], []) == 0 and option_matches([], ["goal 1", "goal 2"]) == 0
    # sizes: token-set ratio, so "x-large" ({x, large}) contains the goal's "large" (100) but "medium" does not
    assert option_matches(["x-large"], ["large"]) == 1 and option_matches(["medium"], ["large"]) == 0
    # colours reduce to the first colour of WebShop's (alphabetical) list they contain: "navy blue" and "light blue"
    # are both "blue", and "dark grey" is "dark", which no longer matches "grey"
    assert option_matches(["light blue"], ["navy blue"]) == 1 and option_matches(["blue"], ["navy blue"]) == 1
    assert option_matches(["navy"], ["navy blue"]) == 0 and option_matches(["dark grey"], ["grey"]) == 0


def test_total_reward_as_webshops_tests():
    name = "Mens D.O.N. Issue 2 Gca Basketball Sneakers Shoes Casual - Off White"
    g = target(name=name, attributes=("tea tree", "essential oils", "natural ingredients"), options=("grey", "XL"))
    p = purchase(name=name, attributes=("tea tree", "essential oil", "natural ingredients"))
    chosen = {"color": "grey", "size": "XL"}
    assert reward(p, g, 35, chosen) == 1.0
    bullet = "This shampoo has essential oils and smells like lemons"
    desc = "Best shampoo on the market, made with natural ingredients"
    p = purchase(name=name, bullets=(bullet,), description=desc)
    assert reward(p, g, 35, chosen) == pytest.approx(5 / 6)               # 2 of 3 attributes, from the text
    # WebShop's test passes the bullet points as one string, which `' '.join` spreads into letters, so only the
    # description's attribute counts there: 4/6 (it asserts 2/3); the same input here gives the same numbers
    p = purchase(name=name, bullets=tuple(bullet), description=desc)
    assert reward(p, g, 35, chosen) == pytest.approx(4 / 6)
    g = target(name=name, attributes=g.attributes, options=("grey", "XL", "pack of 12"))
    assert reward(p, g, 35, chosen) == pytest.approx(4 / 7)               # WebShop: 0.5714
    assert reward(p, g, 45, chosen) == pytest.approx(3 / 7)               # over the price bound
    g = target(name="Saireed UL Listed 2 Prong Power Cord for JBL Bar 3.1 Bar 2.1 Channel 4K Ultra HD Soundbar",
               attributes=g.attributes, options=g.options)
    p = purchase(query="query 2", product_category="a › d › e", bullets=p.bullets, description=p.description,
                 name="BRST AC Power Cord Outlet Socket Cable Plug Lead for Panasonic SC-HT830V DVD/VCR Combo Home "
                      "Theater System")
    assert reward(p, g, 35, chosen) == pytest.approx(0.5 * 4 / 7)          # WebShop: 0.2857


# -- the shipped shop ---------------------------------------------------------------------------------------------

def test_the_shipped_shop_regenerates_byte_for_byte(tmp_path):
    webshop_catalogue.write(tmp_path)
    for name in webshop_catalogue.FILES:
        assert (tmp_path / name).read_bytes() == (webshop_catalogue.OUT / name).read_bytes(), name


def test_the_shipped_files_have_the_keys_webshop_reads():
    """What engine.load_products and goal.get_human_goals read of each file, and what they make of it."""
    items = json.loads((webshop_catalogue.OUT / "items_shuffle.json").read_text())
    attrs = json.loads((webshop_catalogue.OUT / "items_ins_v2.json").read_text())
    human = json.loads((webshop_catalogue.OUT / "items_human_ins.json").read_text())
    keys = {"asin", "name", "category", "query", "product_category", "full_description", "small_description",
            "pricing", "customization_options", "images"}
    assert len(items) == 300 and all(keys <= set(p) for p in items)
    assert all(len(p["asin"]) == 10 and p["pricing"].startswith("$") for p in items)
    assert all({"value", "image"} <= set(v) for p in items for vs in p["customization_options"].values() for v in vs)
    assert set(attrs) == {p["asin"] for p in items} and all("attributes" in a for a in attrs.values())
    assert all({"instruction", "instruction_attributes", "instruction_options"} <= set(g)
               for gs in human.values() for g in gs)
    shop = load_shop(str(webshop_catalogue.OUT), None)
    first = shop.by_asin[items[0]["asin"]]
    assert first.price == float(items[0]["pricing"][1:]) and first.price_tag == items[0]["pricing"]
    assert all(v == v.lower() for p in shop.products for vs in p.options.values() for v in vs)
    assert len(shop.goals) == 300
    g = shop.goals[0]
    assert g.instruction.endswith(f", and price lower than {g.target.price_upper:.2f} dollars")
    # the bound is one of the next four multiples of 10 above the price, never the first (the larger of two drawn)
    price = shop.by_asin[g.asin].price
    assert price < g.target.price_upper - 10 < price + 40


# -- the page graph and the oracle ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def env():
    return WebShopEnv(WebShopConfig(heldout=50), Path("unused"))


def _graph_distances(env) -> dict:
    """Breadth-first search over every page reachable from the search page (searching only the instruction's
    query), then backwards from the purchases of score 1."""
    start = env.state
    succ, seen, todo = {}, {start}, deque([start])
    while todo:
        s = todo.popleft()
        moves = [f"search[{env.goal.query}]"] if s.kind == "search" else list(env.commands(s))
        succ[s] = [env.transition(s, c) for c in moves]
        for t in succ[s]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    pred = {s: [] for s in seen}
    for s, ts in succ.items():
        for t in ts:
            pred[t].append(s)
    dist = {s: 0 for s in seen if s.kind == "done" and s.score >= 1.0}
    todo = deque(dist)
    while todo:
        t = todo.popleft()
        for s in pred[t]:
            if s not in dist:
                dist[s] = dist[t] + 1
                todo.append(s)
    return {s: dist.get(s, math.inf) for s in seen}


@pytest.mark.parametrize("task", [0, 1, 2])
def test_the_oracle_distance_is_the_shortest_path_of_the_page_graph(env, task):
    from pipeline.data.seeds import task_seed

    env.reset(task_seed("eval", 0, 0, task))
    truth = _graph_distances(env)
    assert len(truth) > 500                                  # results pages, items with their options, tabs
    assert truth[env.state] == env.oracle_distance() >= 4   # search, click, options, buy
    wrong = {s: (d, env.distance(s)) for s, d in truth.items() if env.distance(s) != d}
    assert not wrong, list(wrong.items())[:3]


def test_the_experts_plan_buys_with_score_1_in_the_oracles_moves(env):
    from pipeline.data.seeds import task_seed

    for k in range(50):
        obs = env.reset(task_seed("eval", 0, 0, k))
        assert obs.admissible == ("search[<your query>]",)
        d = env.oracle_distance()
        for turn in range(int(d)):
            res = env.step(f"<action>{env.expert_actions()[0]}</action>")
            assert res.action_valid and env.oracle_distance() == d - turn - 1
        assert res.terminated and res.success and res.reward == 1.0 == env.task_score()


def test_pages_commands_and_an_invalid_turn(env):
    from pipeline.data.seeds import task_seed

    env.reset(task_seed("eval", 0, 0, 0))
    res = env.step("<action>search[Bluetooth Speaker]</action>")
    assert res.action == "search[Bluetooth Speaker]" and res.observation.startswith(
        "Back to Search [SEP] Page 1 (Total results: ")
    assert res.admissible[:2] == ("click[back to search]", "click[next >]") and len(res.admissible) == 12
    top = res.admissible[2][len("click["):-1]
    assert "Bluetooth Speaker" in env.shop.by_asin[top.upper()].title
    res = env.step("<action>click[buy now]</action>")        # no buy button on a results page
    assert not res.action_valid and res.action is None and res.observation.startswith("Back to Search [SEP] Page 1")
    res = env.step(f"<action>click[{top}]</action>")
    assert "Buy Now" in res.observation and "click[buy now]" in res.admissible
    value = env.shop.by_asin[top.upper()].options["color"][0]
    res = env.step(f"<action>click[{value}]</action>")
    assert res.observation.startswith(f"You have clicked {value}. Back to Search")
    res = env.step("<action>click[buy now]</action>")
    assert res.terminated and 0.0 <= res.reward == env.task_score() and res.success == (res.reward == 1.0)


def test_the_tiny_tokenizer_keeps_each_product_id_one_token(env):
    """The tiny policy copies `click[<id>]` from its prompt: each id of the 300 products, as the page shows it
    and as the command writes it, is one token, and pages still decode to their text."""
    from pipeline.envs.base import spec_of
    from pipeline.envs.webshop.env import Page
    from pipeline.model.policy import train_tokenizer

    words = spec_of(env.cfg).words(env.cfg)
    assert len(words) == 600 and {"B0NTK3SQ0U", "b0ntk3sq0u"} <= set(words)
    corpus = ["Back to Search [SEP] Page 1 click[buy now]"] * 4
    tok = train_tokenizer(corpus, 300, None, words)
    assert len(tok) == len(train_tokenizer(corpus, 300)) + 600
    pieces = [tok.decode([i]) for i in tok("click[b0ntk3sq0u] [SEP] B0NTK3SQ0U")["input_ids"]]
    assert pieces[pieces.index("[") + 1] == "b0ntk3sq0u" and pieces[-1] == "B0NTK3SQ0U"
    env.reset(0)
    page = env.render(Page("results", query="bluetooth speaker"))
    assert tok.decode(tok(page)["input_ids"]) == page


# -- bad data -----------------------------------------------------------------------------------------------------

def _copy_shop(d: Path) -> Path:
    for name in webshop_catalogue.FILES:
        (d / name).write_bytes((webshop_catalogue.OUT / name).read_bytes())
    return d


def test_a_missing_file_is_refused_when_the_params_load(tmp_path):
    _copy_shop(tmp_path)
    (tmp_path / "items_ins_v2.json").unlink()
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"env": {"name": "webshop", "data_path": str(tmp_path)}}))
    with pytest.raises(ParamsError, match=r"(?s)p\.yaml.*items_ins_v2\.json: no such file"):
        load_params(tmp_path / "p.yaml")


@pytest.mark.parametrize("broken, file, fragment", [
    ("no options", "items_shuffle.json", "product 0 is not a WebShop product (KeyError: 'customization_options')"),
    ("instruction", "items_human_ins.json", "instruction 0 of"),
    ("not json", "items_human_ins.json", "not readable JSON"),
])
def test_bad_data_names_the_file(tmp_path, broken, file, fragment):
    _copy_shop(tmp_path)
    path = tmp_path / file
    data = json.loads(path.read_text())
    if broken == "no options":
        del data[0]["customization_options"]
        path.write_text(json.dumps(data))
    elif broken == "instruction":
        first = next(iter(data))
        del data[first][0]["instruction_options"]
        path.write_text(json.dumps(data))
    else:
        path.write_text("{ not json")
    with pytest.raises(ValueError) as e:
        load_shop(str(tmp_path), None)
    assert str(path) in str(e.value) and fragment in str(e.value)
