"""The word problems the project ships for the code-interpreter environment (`data/python/`), generated here, and the
readers of a user's GSM8K or MATH copy.

    python -m pipeline.envs.python.problems       # writes data/python/ (the same problems on every run)

Each generated problem is arithmetic a small model gets wrong by heart and right with one to three short programs:
large products, compound interest, unit conversions, counting with combinations, date differences, modular
arithmetic. A record: `question`, `answer` (exact: an integer, or a decimal rounded as the question asks), `steps`
(the reference programs, each printing one intermediate result, the last one the answer; a later step writes the
earlier results it needs as literals, as an agent that read them would) and `kind`. Training and held-out problems
come from disjoint seeds.

A user's file (`env.data_path`: a folder with `train.jsonl` and `test.jsonl`) may hold GSM8K's records (`question`,
`answer` ending in `#### 42`) or MATH's (`problem`, `solution` whose last `\\boxed{...}` is the answer); such
problems have no reference steps, so no oracle and no expert.
"""

from __future__ import annotations

import datetime
import json
import math
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.data.tables import write_text_atomic

OUT = Path(__file__).resolve().parents[3] / "data" / "python"
FILES = ("train.jsonl", "test.jsonl")
COUNTS = {"train": 600, "test": 100}
SEEDS = {"train": 11, "test": 97}


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    steps: tuple[str, ...] = ()      # reference programs; empty for a user's GSM8K or MATH record
    kind: str = "user"


def _product(r: random.Random) -> Problem:
    a, b, c = r.randint(120, 9800), r.randint(24, 480), r.randint(35, 990)
    s1 = a * b
    return Problem(f"A warehouse holds {a} crates with {b} bottles in each, and every bottle holds {c} ml. How many "
                   "ml do the bottles hold in all?", str(s1 * c), (f"print({a} * {b})", f"print({s1} * {c})"),
                   "product")


def _interest(r: random.Random) -> Problem:
    p, rate, n = r.randint(10, 900) * 100, r.choice([2.5, 3, 3.5, 4, 4.25, 5, 6.5, 7]), r.randint(3, 25)
    value = f"{p * (1 + rate / 100) ** n:.2f}"
    return Problem(f"{p} dollars earn {rate}% interest compounded once a year. How many dollars are there after {n} "
                   "years, rounded to the cent?", value, (f"print(f'{{{p} * (1 + {rate} / 100) ** {n}:.2f}}')",),
                   "interest")


def _convert(r: random.Random) -> Problem:
    miles = r.randint(3, 400) + r.choice([0, 0.25, 0.5, 0.75])
    secs = r.randint(600, 40000)
    metres = miles * 1609.344
    speed = f"{metres / secs:.3f}"
    return Problem(f"A runner covers {miles} miles in {secs} seconds (a mile is 1609.344 metres). What is the "
                   "average speed in metres per second, to three decimals?", speed,
                   (f"print({miles} * 1609.344)", f"print(f'{{{metres!r} / {secs}:.3f}}')"), "conversion")


def _count(r: random.Random) -> Problem:
    n, k = r.randint(12, 40), r.randint(3, 8)
    j = r.randint(2, k)
    first = math.comb(n, k)
    return Problem(f"A club of {n} members chooses a committee of {k}, then the committee picks a chair, a deputy "
                   f"and so on: {j} distinct ordered roles among its members. In how many ways can this be done?",
                   str(first * math.perm(k, j)),
                   (f"import math\nprint(math.comb({n}, {k}))", f"import math\nprint({first} * math.perm({k}, {j}))"),
                   "counting")


def _dates(r: random.Random) -> Problem:
    d1 = datetime.date(1900, 1, 1) + datetime.timedelta(days=r.randint(0, 40000))
    d2 = d1 + datetime.timedelta(days=r.randint(400, 30000))
    program = (f"import datetime\nprint((datetime.date({d2.year}, {d2.month}, {d2.day}) - "
               f"datetime.date({d1.year}, {d1.month}, {d1.day})).days)")
    return Problem(f"How many days are there from {d1.isoformat()} to {d2.isoformat()}?", str((d2 - d1).days),
                   (program,), "dates")


def _modular(r: random.Random) -> Problem:
    a, b, c, d = r.randint(7, 999), r.randint(50, 5000), r.randint(7, 999), r.randint(50, 5000)
    m = r.choice([97, 101, 1009, 7919, 10007, 65537])
    x, y = pow(a, b, m), pow(c, d, m)
    return Problem(f"What is ({a}^{b} + {c}^{d}) mod {m}?", str((x + y) % m),
                   (f"print(pow({a}, {b}, {m}))", f"print(pow({c}, {d}, {m}))", f"print(({x} + {y}) % {m})"),
                   "modular")


KINDS = (_product, _interest, _convert, _count, _dates, _modular)


def generate(seed: int, n: int, exclude: frozenset[str] = frozenset()) -> list[Problem]:
    """`n` problems of the kinds in turn, none twice and none whose question is in `exclude`."""
    r = random.Random(seed)
    out, seen = [], set(exclude)
    while len(out) < n:
        p = KINDS[len(out) % len(KINDS)](r)
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


def draw(seed: int, exclude: frozenset[str] = frozenset()) -> Problem:
    """One problem of a kind picked by `seed` and drawn from it, never one whose question is in `exclude` (the
    held-out set): a training task's own problem under `env.train_problems: generated`."""
    r = random.Random(seed)
    while True:
        p = KINDS[r.randrange(len(KINDS))](r)
        if p.question not in exclude:
            return p


def write(folder: Path = OUT) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    train = generate(SEEDS["train"], COUNTS["train"])
    test = generate(SEEDS["test"], COUNTS["test"], frozenset(p.question for p in train))   # held out: unseen
    for name, split in zip(FILES, (train, test), strict=True):
        rows = [{"question": p.question, "answer": p.answer, "steps": list(p.steps), "kind": p.kind} for p in split]
        write_text_atomic(folder / name, "".join(json.dumps(row) + "\n" for row in rows))


# -- a user's files -----------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed\{")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[starts[-1]:i - 1].strip() if depth == 0 else None


def record_problem(path: Path, k: int, r) -> Problem:
    """A problem of one JSON record: the shipped format, GSM8K's or MATH's; a clear error naming the file and the
    line otherwise."""
    where = f"{path}: line {k + 1}"
    if not isinstance(r, dict):   # a data error like the others below, which callers report as ValueError
        raise ValueError(f"{where}: expected a JSON object, got {type(r).__name__}")  # noqa: TRY004
    if "steps" in r and "question" in r and "answer" in r:
        return Problem(str(r["question"]), str(r["answer"]), tuple(map(str, r["steps"])), str(r.get("kind", "")))
    if "question" in r and "answer" in r:                                   # GSM8K
        answer = str(r["answer"])
        if "####" not in answer:
            raise ValueError(f"{where}: a GSM8K answer ends in '#### <number>'; this one has no '####'")
        return Problem(str(r["question"]), answer.rsplit("####", 1)[1].strip())
    if "problem" in r and "solution" in r:                                  # MATH
        boxed = last_boxed(str(r["solution"]))
        if not boxed:
            raise ValueError(f"{where}: a MATH solution carries its answer in \\boxed{{...}}; none found")
        return Problem(str(r["problem"]), boxed)
    raise ValueError(f"{where}: expected question and answer (GSM8K, or the shipped format with steps) or problem "
                     f"and solution (MATH), got keys {sorted(r)}")


def load(folder: Path) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
    """(training problems, held-out problems) of `folder`'s train.jsonl and test.jsonl."""
    out = []
    for name in FILES:
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{path}: missing; a python data folder holds {' and '.join(FILES)}")
        problems = []
        for k, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {k + 1}: not JSON ({e})") from None
                problems.append(record_problem(path, k, r))
        if not problems:
            raise ValueError(f"{path}: no problems")
        out.append(tuple(problems))
    return out[0], out[1]


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
    print(f"wrote {', '.join(FILES)} to {OUT if len(sys.argv) < 2 else sys.argv[1]}")
