"""The shop the project ships (`data/webshop/`): a few hundred products in WebShop's own file formats, generated here.

    python -m pipeline.envs.webshop.catalogue            # writes data/webshop/ (deterministic: byte for byte)

Three files, as WebShop's `web_agent_site/utils.py` names them and `engine.load_products` reads them:
- `items_shuffle.json`: the products (asin, name, category, query, product_category, full_description,
  small_description, pricing as "$12.99", customization_options {name: [{value, image}]}, images);
- `items_ins_v2.json`: {asin: {attributes, instruction, instruction_attributes}}, the products' attributes;
- `items_human_ins.json`: {asin: [{asin, instruction, instruction_attributes, instruction_options}]}, the
  instructions (WebShop's human goals; here written from templates).

Five categories (WebShop's: beauty, electronics, fashion, food, furniture), three product types each, 20 products
per type. Products of one type share their title's type words and differ in attributes, options and price, so a
search for a type returns near misses: products that miss one of the goal's attributes or options, or cost more.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from pipeline.data.tables import write_text_atomic

OUT = Path(__file__).resolve().parents[3] / "data" / "webshop"
PER_TYPE = 20
SEED = 2022

# category -> product types: (query, title words, category path, attribute pool, options {name: values})
TYPES = {
    "beauty": [
        ("shampoo", "Shampoo", "Beauty & Personal Care › Hair Care › Shampoo & Conditioner",
         ["tea tree", "sulfate free", "paraben free", "argan oil", "dry hair", "natural ingredients"],
         {"size": ["8 fl oz", "12 fl oz", "16 fl oz"]}),
        ("lipstick", "Matte Lipstick", "Beauty & Personal Care › Makeup › Lips",
         ["long lasting", "cruelty free", "vegan", "waterproof", "moisturizing"],
         {"color": ["red", "pink", "nude", "plum", "coral"]}),
        ("face serum", "Face Serum", "Beauty & Personal Care › Skin Care › Face",
         ["vitamin c", "hyaluronic acid", "anti aging", "fragrance free", "sensitive skin"],
         {"size": ["1 fl oz", "2 fl oz"]}),
    ],
    "electronics": [
        ("bluetooth speaker", "Bluetooth Speaker", "Electronics › Portable Audio & Video › Bluetooth Speakers",
         ["waterproof", "portable", "long battery life", "stereo sound", "built in microphone"],
         {"color": ["black", "blue", "red", "grey"]}),
        ("usb c cable", "USB C Cable", "Electronics › Computers & Accessories › Cables",
         ["fast charging", "braided nylon", "high speed", "durable"],
         {"size": ["3 ft", "6 ft", "10 ft"], "color": ["black", "white"]}),
        ("wireless earbuds", "Wireless Earbuds", "Electronics › Headphones › Earbud Headphones",
         ["noise cancelling", "charging case", "sweat resistant", "touch control", "long battery life"],
         {"color": ["black", "white", "navy"]}),
    ],
    "fashion": [
        ("men's t-shirt", "Men's T-Shirt", "Clothing, Shoes & Jewelry › Men › Clothing › Shirts",
         ["cotton", "short sleeve", "slim fit", "machine wash", "crew neck"],
         {"color": ["black", "white", "navy", "grey", "green"], "size": ["small", "medium", "large", "x-large"]}),
        ("women's running shoes", "Women's Running Shoes", "Clothing, Shoes & Jewelry › Women › Shoes › Athletic",
         ["breathable", "lightweight", "non slip", "memory foam", "arch support"],
         {"color": ["pink", "black", "white", "purple"], "size": ["6", "7", "8", "9"]}),
        ("winter beanie", "Knit Beanie Hat", "Clothing, Shoes & Jewelry › Accessories › Hats & Caps",
         ["warm", "soft", "acrylic", "one size fits most"],
         {"color": ["black", "red", "grey", "beige"]}),
    ],
    "food": [
        ("green tea", "Green Tea Bags", "Grocery & Gourmet Food › Beverages › Tea",
         ["organic", "decaffeinated", "gluten free", "non gmo", "caffeine free"],
         {"size": ["20 count", "40 count", "100 count"]}),
        ("protein bar", "Protein Bars", "Grocery & Gourmet Food › Snacks › Bars",
         ["high protein", "low sugar", "gluten free", "keto friendly", "plant based"],
         {"flavor": ["chocolate", "peanut butter", "vanilla"], "size": ["12 count", "24 count"]}),
        ("coffee beans", "Whole Bean Coffee", "Grocery & Gourmet Food › Beverages › Coffee",
         ["dark roast", "medium roast", "fair trade", "organic", "single origin"],
         {"size": ["12 ounce", "2 pound"]}),
    ],
    "furniture": [
        ("office chair", "Office Chair", "Home & Kitchen › Furniture › Home Office Furniture › Chairs",
         ["ergonomic", "lumbar support", "adjustable height", "mesh back", "easy assembly"],
         {"color": ["black", "grey", "white"]}),
        ("bookshelf", "Bookshelf", "Home & Kitchen › Furniture › Living Room Furniture › Bookcases",
         ["5 tier", "solid wood", "easy assembly", "industrial style", "space saving"],
         {"color": ["walnut", "white", "black"]}),
        ("bedside table", "Nightstand", "Home & Kitchen › Furniture › Bedroom Furniture › Nightstands",
         ["with drawer", "wood", "storage space", "mid century", "easy assembly"],
         {"color": ["white", "brown", "black"]}),
    ],
}
BRANDS = ["Acme", "Brightline", "Corvo", "Dalby", "Everfin", "Fennic", "Glowra", "Hallam", "Ivora", "Joventa",
          "Kestrel", "Lumio", "Marlow", "Norvik", "Orrin", "Pellar", "Quenby", "Rovan", "Solace", "Tamsin"]
ASIN_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"


def _asin(rng: random.Random, taken: set[str]) -> str:
    while True:
        a = "B0" + "".join(rng.choice(ASIN_CHARS) for _ in range(8))
        if a not in taken:
            taken.add(a)
            return a


def _instruction(rng: random.Random, query: str, attrs: list[str], options: dict[str, str]) -> str:
    opener = rng.choice(["i need a", "i am looking for a", "find me a", "i want a"])
    text = f"{opener} {attrs[0]} {query}"
    if len(attrs) > 1:
        text += f" that is {attrs[1]}" if rng.random() < 0.5 else f" with {attrs[1]}"
    for name, value in options.items():
        text += f", {name} {value}" if name != "color" else f", {value} color"
    return text


def generate() -> tuple[list, dict, dict]:
    """The three files' contents."""
    rng = random.Random(SEED)
    products, attributes, human = [], {}, {}
    taken: set[str] = set()
    for category, types in TYPES.items():
        for query, words, path, pool, option_pool in types:
            for _ in range(PER_TYPE):
                asin = _asin(rng, taken)
                attrs = sorted(rng.sample(pool, rng.choice([2, 3])), key=pool.index)
                brand = rng.choice(BRANDS)
                title = f"{brand} {' '.join(a.title() for a in attrs[:2])} {words}"
                options = {name: sorted(rng.sample(values, max(1, len(values) - rng.choice([0, 1]))),
                                        key=values.index)
                           for name, values in option_pool.items()}
                price = round(rng.uniform(6, 95), 2)
                bullets = [f"{a.capitalize()}: made to last, tested by our team." for a in attrs]
                products.append({
                    "asin": asin, "name": title, "category": category, "query": query,
                    "product_category": path,
                    "full_description": f"The {brand} {words.lower()} is {', '.join(attrs)}. "
                                        f"Ships in a recyclable box.",
                    "small_description": bullets,
                    "pricing": f"${price:.2f}",
                    "customization_options": {name.capitalize(): [{"value": v.title() if name == "color" else v,
                                                                   "image": None} for v in values]
                                              for name, values in options.items()},
                    "images": [""],
                })
                want = rng.sample(attrs, rng.choice([1, 2]))
                chosen = {name: rng.choice(values) for name, values in options.items()}
                instruction = _instruction(rng, query, want, chosen)
                attributes[asin] = {"attributes": attrs, "instruction": instruction, "instruction_attributes": want}
                human[asin] = [{"asin": asin, "instruction": instruction, "instruction_attributes": want,
                                "instruction_options": list(chosen.values())}]
    rng.shuffle(products)    # items_shuffle.json: WebShop's products come shuffled
    return products, attributes, human


FILES = ("items_shuffle.json", "items_ins_v2.json", "items_human_ins.json")


def write(out: Path = OUT) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, content in zip(FILES, generate(), strict=True):
        write_text_atomic(out / name, json.dumps(content, indent=1) + "\n")
        paths.append(out / name)
    return paths


if __name__ == "__main__":
    for p in write(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(f"wrote {p}")
