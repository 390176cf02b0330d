"""Write gsm8k_sample.jsonl: grade-school word problems in GSM8K's own format.

Each row is {"question": ..., "answer": "<worked solution with <<a+b=c>> notes>\\n#### <number>"},
like GSM8K's files, so the GSM8K path is exercised without the Hub. The problems are generated
from templates with a fixed seed: run this script again and the file is the same.

    python examples/data/make_gsm8k_sample.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = [("Ana", "She"), ("Ben", "He"), ("Chloe", "She"), ("Dev", "He"), ("Emma", "She"), ("Farid", "He")]
ITEMS = ["apples", "stickers", "marbles", "books", "shells", "cards"]


def _buy_and_give(rng: random.Random) -> tuple[str, str]:
    (name, pronoun), item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(5, 40), rng.randint(2, 30)
    c = rng.randint(1, a + b - 1)
    s, r = a + b, a + b - c
    question = f"{name} has {a} {item}. {pronoun} buys {b} more and then gives {c} to a friend. How many {item} does {name} have now?"
    answer = f"After buying, {name} has {a}+{b}=<<{a}+{b}={s}>>{s} {item}.\nAfter giving some away, {name} has {s}-{c}=<<{s}-{c}={r}>>{r} {item}.\n#### {r}"
    return question, answer


def _boxes(rng: random.Random) -> tuple[str, str]:
    item = rng.choice(ITEMS)
    a, b = rng.randint(3, 25), rng.randint(2, 12)
    question = f"A box holds {a} {item}. How many {item} are there in {b} full boxes?"
    answer = f"There are {a}*{b}=<<{a}*{b}={a * b}>>{a * b} {item} in {b} boxes.\n#### {a * b}"
    return question, answer


def _wages(rng: random.Random) -> tuple[str, str]:
    name, pronoun = rng.choice(NAMES)
    rate, hours = rng.randint(8, 30), rng.randint(3, 40)
    earned = rate * hours
    spent = rng.randint(1, earned - 1)
    left = earned - spent
    question = f"{name} earns ${rate} an hour and works {hours} hours this week. {pronoun} spends ${spent} on groceries. How many dollars does {name} have left from this week's pay?"
    answer = (
        f"{name} earns {rate}*{hours}=$<<{rate}*{hours}={earned}>>{earned}.\n"
        f"After groceries, {name} has {earned}-{spent}=$<<{earned}-{spent}={left}>>{left} left.\n#### {left:,}"
    )
    return question, answer


def _share(rng: random.Random) -> tuple[str, str]:
    item = rng.choice(ITEMS)
    people, each = rng.randint(2, 9), rng.randint(2, 15)
    total = people * each
    question = f"{total} {item} are shared equally among {people} children. How many {item} does each child get?"
    answer = f"Each child gets {total}/{people}=<<{total}/{people}={each}>>{each} {item}.\n#### {each}"
    return question, answer


def _trip(rng: random.Random) -> tuple[str, str]:
    speed, hours, extra = rng.randint(30, 70), rng.randint(2, 6), rng.randint(5, 60)
    first = speed * hours
    total = first + extra
    question = f"A bus drives at {speed} miles per hour for {hours} hours, then {extra} more miles to the depot. How many miles does it drive in all?"
    answer = f"First it drives {speed}*{hours}=<<{speed}*{hours}={first}>>{first} miles.\nIn all it drives {first}+{extra}=<<{first}+{extra}={total}>>{total} miles.\n#### {total}"
    return question, answer


TEMPLATES = (_buy_and_give, _boxes, _wages, _share, _trip)


def rows(count: int = 60, seed: int = 8) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        question, answer = TEMPLATES[i % len(TEMPLATES)](rng)
        out.append({"question": question, "answer": answer})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("gsm8k_sample.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()), encoding="utf-8")
    print(f"wrote {path}")
