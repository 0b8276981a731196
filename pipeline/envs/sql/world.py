"""The SQL world the project ships (`data/sql/`): small SQLite databases and questions about them with their gold
queries, written in Spider's folder layout, generated here.

    python -m pipeline.envs.sql.world            # writes data/sql/ (the same rows and questions on every run)

Spider's layout, which `pipeline.envs.sql.env` reads for a user's Spider or BIRD folder too:
- `tables.json`: one record per database (`db_id`, `table_names_original`, `column_names_original`,
  `column_types`, `primary_keys`, `foreign_keys`, as Spider writes them);
- `train_spider.json` and `dev.json`: lists of questions `{"db_id", "question", "query"}`, plus what only a
  generated world knows: `hardness` (Spider's easy | medium | hard | extra) and `template`;
- `database/<db_id>/<db_id>.sqlite`.

Eight schemas of three tables each, every table with an integer primary key `<table>_id`, a name column, and
categorical and numeric columns; child tables carry foreign keys to their parents. Six are training databases
(school, shop, flights, library, hospital, films) and two are held out (museum, football): held-out questions are
asked of databases no training question touches (Spider's cross-database split).

Questions come from SQL templates paired with English templates at Spider's four hardness levels: easy (one table,
a filter or an aggregate), medium (a join, a group by), hard (a nested query, having, order by + limit, not in)
and extra (intersect, union, except, two levels of nesting). A template's slots are filled from the database's
own rows, and a question is kept only when its gold query returns at least one row, a row that is not NULL, and
(for a list) not every row of the table, so that a guess of the whole table is wrong.
"""

from __future__ import annotations

import json
import random
import sqlite3
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).resolve().parents[3] / "data" / "sql"
SEED = 20261128
TRAIN_DBS = ("school", "shop", "flights", "library", "hospital", "films")
HELD_OUT_DBS = ("museum", "football")
QUESTIONS_PER_TEMPLATE = {"train": 8, "dev": 4}   # per database and template, before duplicates are dropped

# -- schemas ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Col:
    name: str
    kind: str                      # id | name | cat | num | real | fk
    phrase: str = ""               # how a question names it
    values: tuple = ()             # a cat's values; a num's (low, high)
    ref: str = ""                  # fk: the parent table


@dataclass(frozen=True)
class Table:
    name: str
    singular: str
    plural: str
    cols: tuple[Col, ...]
    rows: tuple[int, int] = (8, 12)
    names: str = "person"          # the pool its name column draws from

    @property
    def key(self) -> str:
        return self.cols[0].name

    @property
    def label(self) -> Col:
        return next(c for c in self.cols if c.kind == "name")

    def of(self, *kinds: str) -> list[Col]:
        return [c for c in self.cols if c.kind in kinds]


def _id(t: str) -> Col:
    return Col(f"{t}_id", "id")


CITIES = ("Arden", "Belmor", "Corvale", "Dunmere", "Elstow")
COUNTRIES = ("Astria", "Borland", "Caldera", "Dorvia")

SCHEMAS: dict[str, tuple[Table, ...]] = {
    "school": (
        Table("school", "school", "schools", (_id("school"), Col("name", "name"), Col("city", "cat", "city", CITIES),
              Col("founded", "num", "founding year", (1850, 2010))), (6, 8), "place"),
        Table("teacher", "teacher", "teachers", (_id("teacher"), Col("name", "name"),
              Col("subject", "cat", "subject", ("Maths", "History", "Biology", "Music")),
              Col("salary", "num", "salary", (30000, 70000)), Col("school_id", "fk", ref="school")), (12, 16)),
        Table("student", "student", "students", (_id("student"), Col("name", "name"),
              Col("age", "num", "age", (11, 18)), Col("grade", "cat", "grade", ("A", "B", "C")),
              Col("school_id", "fk", ref="school")), (18, 24)),
    ),
    "shop": (
        Table("store", "store", "stores", (_id("store"), Col("name", "name"), Col("city", "cat", "city", CITIES),
              Col("area", "num", "floor area", (80, 900))), (6, 8), "place"),
        Table("employee", "employee", "employees", (_id("employee"), Col("name", "name"),
              Col("role", "cat", "role", ("cashier", "manager", "clerk")), Col("wage", "num", "wage", (1200, 4200)),
              Col("store_id", "fk", ref="store")), (12, 16)),
        Table("product", "product", "products", (_id("product"), Col("name", "name"),
              Col("category", "cat", "category", ("food", "toys", "tools", "books")),
              Col("price", "real", "price", (1, 300)), Col("store_id", "fk", ref="store")), (16, 22), "thing"),
    ),
    "flights": (
        Table("airline", "airline", "airlines", (_id("airline"), Col("name", "name"),
              Col("country", "cat", "country", COUNTRIES), Col("fleet", "num", "fleet size", (5, 180))), (6, 8),
              "place"),
        Table("pilot", "pilot", "pilots", (_id("pilot"), Col("name", "name"),
              Col("rank", "cat", "rank", ("captain", "first officer")),
              Col("hours", "num", "flight hours", (500, 20000)),
              Col("airline_id", "fk", ref="airline")), (12, 16)),
        Table("flight", "flight", "flights", (_id("flight"), Col("code", "name"),
              Col("destination", "cat", "destination", CITIES), Col("distance", "num", "distance", (200, 9000)),
              Col("airline_id", "fk", ref="airline")), (16, 22), "code"),
    ),
    "library": (
        Table("author", "author", "authors", (_id("author"), Col("name", "name"),
              Col("nationality", "cat", "nationality", COUNTRIES), Col("born", "num", "birth year", (1900, 1990))),
              (6, 8)),
        Table("book", "book", "books", (_id("book"), Col("title", "name"),
              Col("genre", "cat", "genre", ("crime", "poetry", "history", "science")),
              Col("pages", "num", "page count", (90, 900)), Col("author_id", "fk", ref="author")), (16, 22), "thing"),
        Table("member", "member", "members", (_id("member"), Col("name", "name"), Col("city", "cat", "city", CITIES),
              Col("age", "num", "age", (16, 80))), (10, 14)),
    ),
    "hospital": (
        Table("department", "department", "departments", (_id("department"), Col("name", "name"),
              Col("building", "cat", "building", ("North", "South", "East")),
              Col("floor", "num", "floor", (1, 9))), (5, 7), "place"),
        Table("doctor", "doctor", "doctors", (_id("doctor"), Col("name", "name"),
              Col("specialty", "cat", "specialty", ("surgery", "cardiology", "pediatrics")),
              Col("experience", "num", "years of experience", (1, 35)),
              Col("department_id", "fk", ref="department")), (12, 16)),
        Table("patient", "patient", "patients", (_id("patient"), Col("name", "name"),
              Col("blood_type", "cat", "blood type", ("A", "B", "AB", "O")), Col("age", "num", "age", (1, 95)),
              Col("doctor_id", "fk", ref="doctor")), (18, 24)),
    ),
    "films": (
        Table("studio", "studio", "studios", (_id("studio"), Col("name", "name"),
              Col("country", "cat", "country", COUNTRIES), Col("founded", "num", "founding year", (1910, 2010))),
              (5, 7), "place"),
        Table("director", "director", "directors", (_id("director"), Col("name", "name"),
              Col("nationality", "cat", "nationality", COUNTRIES), Col("born", "num", "birth year", (1930, 1995))),
              (8, 10)),
        Table("film", "film", "films", (_id("film"), Col("title", "name"),
              Col("genre", "cat", "genre", ("drama", "comedy", "horror", "western")),
              Col("budget", "real", "budget", (0.5, 90)), Col("studio_id", "fk", ref="studio")), (16, 22), "thing"),
    ),
    "museum": (
        Table("museum", "museum", "museums", (_id("museum"), Col("name", "name"), Col("city", "cat", "city", CITIES),
              Col("opened", "num", "opening year", (1800, 2015))), (5, 7), "place"),
        Table("artist", "artist", "artists", (_id("artist"), Col("name", "name"),
              Col("country", "cat", "country", COUNTRIES), Col("born", "num", "birth year", (1600, 1990))), (8, 10)),
        Table("painting", "painting", "paintings", (_id("painting"), Col("title", "name"),
              Col("style", "cat", "style", ("baroque", "cubist", "realist", "abstract")),
              Col("year", "num", "year", (1620, 2020)), Col("museum_id", "fk", ref="museum")), (16, 22), "thing"),
    ),
    "football": (
        Table("club", "club", "clubs", (_id("club"), Col("name", "name"), Col("city", "cat", "city", CITIES),
              Col("founded", "num", "founding year", (1870, 1990))), (6, 8), "place"),
        Table("player", "player", "players", (_id("player"), Col("name", "name"),
              Col("position", "cat", "position", ("goalkeeper", "defender", "midfielder", "forward")),
              Col("goals", "num", "goal count", (0, 40)), Col("club_id", "fk", ref="club")), (18, 24)),
        Table("coach", "coach", "coaches", (_id("coach"), Col("name", "name"),
              Col("nationality", "cat", "nationality", COUNTRIES), Col("age", "num", "age", (32, 70)),
              Col("club_id", "fk", ref="club")), (6, 9)),
    ),
}

FIRST = ("Ada", "Bram", "Cora", "Dario", "Edda", "Finn", "Greta", "Hugo", "Ines", "Joel", "Kira", "Lars", "Mira",
         "Nils", "Olga", "Piet", "Rosa", "Sven", "Tara", "Ugo", "Vera", "Wim", "Yara", "Zeno")
LAST = ("Amsel", "Brandt", "Calder", "Dorn", "Eckel", "Falk", "Gunn", "Holm", "Ivers", "Jansen", "Kolb", "Lind",
        "Moser", "Nagel", "Orth", "Pohl", "Quast", "Roth", "Stahl", "Thiel")
SYLLABLES = ("al", "ber", "cor", "dan", "el", "fen", "gar", "hol", "is", "jor", "kel", "lun", "mar", "nor", "or",
             "pel", "quin", "ros", "sel", "tor", "ul", "ven", "wyn")
PLACE_WORDS = ("Hall", "House", "Works", "Centre", "Group", "Union")
THING_WORDS = ("Rain", "Stone", "River", "Night", "Glass", "Winter", "Orchard", "Harbour", "Lantern", "Meadow",
               "Falcon", "Echo", "Ember", "Tide", "Compass", "Willow")


def _name(rng: random.Random, pool: str, table: Table) -> str:
    if pool == "person":
        return f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    if pool == "place":
        return f"{(rng.choice(SYLLABLES) + rng.choice(SYLLABLES)).capitalize()} {rng.choice(PLACE_WORDS)}"
    if pool == "code":
        return f"{rng.choice('ABCDEFGHKLMNPRSTVW')}{rng.choice('ABCDEFGHKLMNPRSTVW')}{rng.randint(100, 999)}"
    return f"The {rng.choice(THING_WORDS)} of {(rng.choice(SYLLABLES) + rng.choice(SYLLABLES)).capitalize()}"


def _rows(rng: random.Random, tables: tuple[Table, ...]) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {}
    for t in tables:
        n = rng.randint(*t.rows)
        names: list[str] = []
        while len(names) < n:
            s = _name(rng, t.names, t)
            if s not in names:
                names.append(s)
        rows = []
        for i, nm in enumerate(names, 1):
            row = []
            for c in t.cols:
                if c.kind == "id":
                    row.append(i)
                elif c.kind == "name":
                    row.append(nm)
                elif c.kind == "cat":
                    row.append(rng.choice(c.values))
                elif c.kind == "num":
                    row.append(rng.randint(*c.values))
                elif c.kind == "real":
                    row.append(round(rng.uniform(*c.values), 2))
                else:
                    # a child of a parent with no children is what "which ... have no ..." asks about
                    row.append(rng.randint(1, max(1, len(out[c.ref]) - 1)))
            rows.append(tuple(row))
        out[t.name] = rows
    return out


SQL_TYPES = {"id": "INTEGER", "name": "TEXT", "cat": "TEXT", "num": "INTEGER", "real": "REAL", "fk": "INTEGER"}


def create_statement(t: Table) -> str:
    cols = [f"  {c.name} {SQL_TYPES[c.kind]}" + (" PRIMARY KEY" if c.kind == "id" else "") for c in t.cols]
    cols += [f"  FOREIGN KEY ({c.name}) REFERENCES {c.ref}({c.ref}_id)" for c in t.of("fk")]
    return f"CREATE TABLE {t.name} (\n" + ",\n".join(cols) + "\n)"


def write_database(path: Path, tables: tuple[Table, ...], rows: dict[str, list[tuple]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(tmp)
    try:
        for t in tables:
            con.execute(create_statement(t))
            con.executemany(f"INSERT INTO {t.name} VALUES ({', '.join('?' * len(t.cols))})", rows[t.name])
        con.commit()
    finally:
        con.close()
    tmp.replace(path)


def tables_record(db_id: str, tables: tuple[Table, ...]) -> dict:
    """Spider's `tables.json` record of a schema."""
    cols, types, pks, fks = [[-1, "*"]], ["text"], [], []
    index: dict[tuple[str, str], int] = {}
    for ti, t in enumerate(tables):
        for c in t.cols:
            index[(t.name, c.name)] = len(cols)
            cols.append([ti, c.name])
            types.append("number" if c.kind in ("id", "num", "real", "fk") else "text")
            if c.kind == "id":
                pks.append(index[(t.name, c.name)])
    for t in tables:
        for c in t.of("fk"):
            fks.append([index[(t.name, c.name)], index[(c.ref, f"{c.ref}_id")]])
    names = [t.name for t in tables]
    return {"db_id": db_id, "table_names_original": names, "table_names": [n.replace("_", " ") for n in names],
            "column_names_original": cols, "column_names": [[i, n.replace("_", " ")] for i, n in cols],
            "column_types": types, "primary_keys": pks, "foreign_keys": fks}


# -- questions ----------------------------------------------------------------------------------------------------


@dataclass
class Draft:
    hardness: str
    template: str
    question: str
    query: str
    lists: str | None = None       # the table whose every row a list question must not return
    extra: dict = field(default_factory=dict)


def _q(v) -> str:
    return "'" + str(v).replace("'", "''") + "'" if isinstance(v, str) else str(v)


def _pairs(tables: tuple[Table, ...]) -> list[tuple[Table, Table, Col]]:
    """(child, parent, foreign key) of every foreign key."""
    by = {t.name: t for t in tables}
    return [(t, by[c.ref], c) for t in tables for c in t.of("fk")]


def _draft(rng: random.Random, template: str, tables: tuple[Table, ...], rows) -> Draft | None:
    """One question of `template` with slots drawn from the rows; None where the schema has no fitting tables."""
    t = rng.choice(tables)
    nums, cats, label = t.of("num", "real"), t.of("cat"), t.label
    col = {c.name: i for i, c in enumerate(t.cols)}

    def value(c: Col, table: Table = t):
        return rng.choice(rows[table.name])[[x.name for x in table.cols].index(c.name)]

    num = rng.choice(nums) if nums else None
    cat = rng.choice(cats) if cats else None
    L, P = label.name, t.plural
    if template == "filter_num":
        v = value(num)
        return Draft("easy", template, f"List the {L}s of the {P} whose {num.phrase} is greater than {v}.",
                     f"SELECT {L} FROM {t.name} WHERE {num.name} > {v}", t.name)
    if template == "count_cat":
        v = value(cat)
        return Draft("easy", template, f"How many {P} have the {cat.phrase} {v}?",
                     f"SELECT COUNT(*) FROM {t.name} WHERE {cat.name} = {_q(v)}")
    if template == "aggregate":
        fn, word = rng.choice((("MAX", "highest"), ("MIN", "lowest"), ("AVG", "average")))
        return Draft("easy", template, f"What is the {word} {num.phrase} of all {P}?",
                     f"SELECT {fn}({num.name}) FROM {t.name}")
    if template == "attribute":
        row = rng.choice(rows[t.name])
        return Draft("easy", template, f"What is the {num.phrase} of the {t.singular} {row[col[L]]}?",
                     f"SELECT {num.name} FROM {t.name} WHERE {L} = {_q(row[col[L]])}")
    if template == "group_count":
        return Draft("medium", template, f"How many {P} are there for each {cat.phrase}?",
                     f"SELECT {cat.name}, COUNT(*) FROM {t.name} GROUP BY {cat.name}")
    if template == "avg_cat":
        v = value(cat)
        return Draft("medium", template, f"What is the average {num.phrase} of the {P} whose {cat.phrase} is {v}?",
                     f"SELECT AVG({num.name}) FROM {t.name} WHERE {cat.name} = {_q(v)}")
    if template == "above_avg":
        return Draft("hard", template, f"List the {L}s of the {P} whose {num.phrase} is above the average.",
                     f"SELECT {L} FROM {t.name} WHERE {num.name} > (SELECT AVG({num.name}) FROM {t.name})", t.name)
    if template == "top":
        order, word = rng.choice((("DESC", "highest"), ("ASC", "lowest")))
        ranked = sorted(rows[t.name], key=lambda r: r[col[num.name]], reverse=order == "DESC")
        if len(ranked) > 1 and ranked[0][col[num.name]] == ranked[1][col[num.name]]:
            return None        # a tie: the question would have two answers
        return Draft("hard", template, f"Which {t.singular} has the {word} {num.phrase}?",
                     f"SELECT {L} FROM {t.name} ORDER BY {num.name} {order} LIMIT 1")
    if template in ("intersect", "union", "except"):
        v, w = value(cat), value(num)
        joiner = {"intersect": "and also", "union": "or", "except": "except those"}[template]
        return Draft("extra", template,
                     f"List the {L}s of the {P} whose {cat.phrase} is {v}, {joiner} whose {num.phrase} is greater "
                     f"than {w}.",
                     f"SELECT {L} FROM {t.name} WHERE {cat.name} = {_q(v)} {template.upper()} SELECT {L} FROM {t.name} "
                     f"WHERE {num.name} > {w}", t.name)
    pairs = _pairs(tables)
    if not pairs:
        return None
    c, p, fk = rng.choice(pairs)
    cl, pl, pk = c.label.name, p.label.name, p.key
    prow = rng.choice(rows[p.name])
    pname = prow[[x.name for x in p.cols].index(pl)]
    join = f"FROM {c.name} AS T1 JOIN {p.name} AS T2 ON T1.{fk.name} = T2.{pk}"
    if template == "join_filter":
        return Draft("medium", template, f"List the {cl}s of the {c.plural} of the {p.singular} {pname}.",
                     f"SELECT T1.{cl} {join} WHERE T2.{pl} = {_q(pname)}", c.name)
    if template == "join_count":
        pc = rng.choice(p.of("cat"))
        v = value(pc, p)
        return Draft("medium", template, f"How many {c.plural} belong to a {p.singular} whose {pc.phrase} is {v}?",
                     f"SELECT COUNT(*) {join} WHERE T2.{pc.name} = {_q(v)}")
    if template == "having":
        n = rng.randint(2, 4)
        return Draft("hard", template, f"Which {p.plural} have at least {n} {c.plural}?",
                     f"SELECT T2.{pl} {join} GROUP BY T2.{pk} HAVING COUNT(*) >= {n}", p.name)
    if template == "not_in":
        return Draft("hard", template, f"Which {p.plural} have no {c.plural}?",
                     f"SELECT {pl} FROM {p.name} WHERE {pk} NOT IN (SELECT {fk.name} FROM {c.name})", p.name)
    if template == "nested_twice":
        cn = rng.choice(c.of("num", "real"))
        return Draft("extra", template,
                     f"Which {p.plural} have a {c.singular} whose {cn.phrase} is above the average {cn.phrase} of all "
                     f"{c.plural}?",
                     f"SELECT {pl} FROM {p.name} WHERE {pk} IN (SELECT {fk.name} FROM {c.name} WHERE {cn.name} > "
                     f"(SELECT AVG({cn.name}) FROM {c.name}))", p.name)
    raise ValueError(f"unknown template {template!r}")


TEMPLATES = ("filter_num", "count_cat", "aggregate", "attribute", "group_count", "avg_cat", "join_filter",
             "join_count", "above_avg", "top", "having", "not_in", "intersect", "union", "except", "nested_twice")


def _keep(con: sqlite3.Connection, d: Draft, rows) -> bool:
    result = con.execute(d.query).fetchall()
    if not result or all(v is None for r in result for v in r):
        return False
    return d.lists is None or len(result) < len(rows[d.lists])


def questions(db_id: str, tables, rows, con: sqlite3.Connection, per_template: int, rng: random.Random) -> list[dict]:
    out, seen = [], set()
    for template in TEMPLATES:
        kept = 0
        for _ in range(per_template * 6):
            if kept == per_template:
                break
            d = _draft(rng, template, tables, rows)
            if d is None or d.query in seen or not _keep(con, d, rows):
                continue
            seen.add(d.query)
            kept += 1
            out.append({"db_id": db_id, "question": d.question, "query": d.query, "hardness": d.hardness,
                        "template": d.template})
    return out


def generate(out: Path = OUT, seed: int = SEED) -> dict[str, int]:
    rng = random.Random(seed)
    splits: dict[str, list[dict]] = {"train": [], "dev": []}
    records = []
    for db_id in TRAIN_DBS + HELD_OUT_DBS:
        tables = SCHEMAS[db_id]
        rows = _rows(rng, tables)
        path = out / "database" / db_id / f"{db_id}.sqlite"
        write_database(path, tables, rows)
        records.append(tables_record(db_id, tables))
        split = "train" if db_id in TRAIN_DBS else "dev"
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            splits[split] += questions(db_id, tables, rows, con, QUESTIONS_PER_TEMPLATE[split], rng)
        finally:
            con.close()
    for split in splits.values():
        rng.shuffle(split)      # the first N held-out questions (what evaluate plays) mix databases and hardness
    (out / "tables.json").write_text(json.dumps(records, indent=1) + "\n")
    (out / "train_spider.json").write_text(json.dumps(splits["train"], indent=1) + "\n")
    (out / "dev.json").write_text(json.dumps(splits["dev"], indent=1) + "\n")
    return {k: len(v) for k, v in splits.items()}


if __name__ == "__main__":
    counts = generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
    print(f"wrote {OUT if len(sys.argv) == 1 else sys.argv[1]}: {counts['train']} training and {counts['dev']} "
          "held-out questions")
