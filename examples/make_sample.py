"""Generate the small bundled DPO preference dataset (arithmetic and facts) deterministically from a seed."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

DEFAULT_OUT = Path(__file__).resolve().parent / "sample"
FRAME_LINES = 16  # lines per zstd frame in the implicit file
ZSTD_LEVEL = 10
PARQUET_ROW_GROUP = 32

# Rows per file: (train, heldout).
COUNTS = {
    "arith_chat.jsonl": (72, 18),
    "arith_implicit.jsonl.zst": (70, 18),
    "facts_text.json": (64, 18),
    "facts_multiturn.parquet": (64, 18),
    "mixed_sources.jsonl": (72, 18),
}

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful math tutor.",
    "Answer with one short sentence.",
]
ARITH_TEMPLATES = ["What is {}?", "Compute {}.", "Calculate {}.", "What does {} equal?"]

CAPITALS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Germany", "Berlin"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Australia", "Canberra"),
    ("Brazil", "Brasilia"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Norway", "Oslo"),
    ("Greece", "Athens"),
    ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"),
    ("Poland", "Warsaw"),
    ("Austria", "Vienna"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Thailand", "Bangkok"),
    ("Mexico", "Mexico City"),
    ("Argentina", "Buenos Aires"),
    ("Chile", "Santiago"),
    ("Cuba", "Havana"),
    ("India", "New Delhi"),
    ("China", "Beijing"),
    ("Russia", "Moscow"),
    ("Turkey", "Ankara"),
    ("Iran", "Tehran"),
    ("Vietnam", "Hanoi"),
]
PLANETS = ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]
ELEMENTS = [
    ("hydrogen", "H"),
    ("helium", "He"),
    ("carbon", "C"),
    ("nitrogen", "N"),
    ("oxygen", "O"),
    ("sodium", "Na"),
    ("iron", "Fe"),
    ("gold", "Au"),
    ("silver", "Ag"),
    ("copper", "Cu"),
    ("lead", "Pb"),
    ("potassium", "K"),
    ("calcium", "Ca"),
    ("zinc", "Zn"),
    ("tin", "Sn"),
    ("neon", "Ne"),
    ("sulfur", "S"),
    ("mercury", "Hg"),
    ("chlorine", "Cl"),
    ("silicon", "Si"),
]
OPENERS = [
    ("Name a planet.", "{} is a planet.", PLANETS),
    ("Name a country.", "{} is a country.", [c for c, _ in CAPITALS]),
    ("Name a chemical element.", "{} is a chemical element.", [e.capitalize() for e, _ in ELEMENTS]),
]


def msg(role: str, content: str) -> dict:
    """One chat message."""
    return {"role": role, "content": content}


# ---------------------------------------------------------------- arithmetic


def solve(a: int, op: str, b: int) -> int:
    """Exact result of a small integer operation."""
    return a + b if op == "+" else a - b if op == "-" else a * b


def operands(rng: random.Random, op: str, hard: bool) -> tuple[int, int]:
    """Operands for one problem; subtraction never goes negative."""
    if op == "x":
        return (rng.randint(12, 30), rng.randint(3, 12)) if hard else (rng.randint(2, 12), rng.randint(2, 12))
    lo, hi = (100, 499) if hard else (2, 50)
    if op == "+":
        return rng.randint(lo, hi), rng.randint(lo, hi)
    a = rng.randint(lo + 10, 2 * hi)
    return a, rng.randint(lo, a - 1)


def wrong_answer(rng: random.Random, n: int) -> int:
    """A plausible wrong result: off by one, off by ten, or last two digits swapped."""
    kind = rng.choice(["one", "ten", "swap"])
    if kind == "swap" and n >= 10:
        s = str(n)
        t = s[:-2] + s[-1] + s[-2]
        if t != s and not t.startswith("0"):
            return int(t)
    step = 10 if kind == "ten" else 1
    sign = rng.choice([1, -1]) if n >= step else 1
    return n + sign * step


def draw_problems(rng: random.Random, n: int, hard: bool, used: set) -> list[tuple[str, str, str]]:
    """n (question, chosen, rejected) triples whose operations are not in `used` (updated in place)."""
    out = []
    while len(out) < n:
        op = rng.choice("+-x")
        a, b = operands(rng, op, hard)
        if (a, op, b) in used:
            continue
        used.add((a, op, b))
        expr, ans = f"{a} {op} {b}", solve(a, op, b)
        question = rng.choice(ARITH_TEMPLATES).format(expr)
        out.append((question, f"{expr} = {ans}.", f"{expr} = {wrong_answer(rng, ans)}."))
    return out


def arith_chat(rng: random.Random, n: int, used: set, prefix: str) -> list[dict]:
    """Explicit-prompt conversational rows; every fifth prompt starts with a system message."""
    rows = []
    for i, (q, good, bad) in enumerate(draw_problems(rng, n, False, used)):
        prompt = [msg("system", rng.choice(SYSTEM_PROMPTS))] if i % 5 == 0 else []
        rows.append(
            {
                "id": f"{prefix}-{i + 1:04d}",
                "prompt": prompt + [msg("user", q)],
                "chosen": [msg("assistant", good)],
                "rejected": [msg("assistant", bad)],
            }
        )
    return rows


def arith_implicit(rng: random.Random, n: int, used: set, prefix: str) -> list[dict]:
    """Implicit-prompt rows: chosen and rejected are full conversations sharing the user turn."""
    return [
        {
            "id": f"{prefix}-{i + 1:04d}",
            "chosen": [msg("user", q), msg("assistant", good)],
            "rejected": [msg("user", q), msg("assistant", bad)],
        }
        for i, (q, good, bad) in enumerate(draw_problems(rng, n, False, used))
    ]


def mixed_sources(rng: random.Random, n: int, used: set, prefix: str) -> list[dict]:
    """Explicit conversational rows whose `source` alternates arith-easy / arith-hard."""
    rows = []
    for i in range(n):
        hard = i % 2 == 1
        ((q, good, bad),) = draw_problems(rng, 1, hard, used)
        rows.append(
            {
                "id": f"{prefix}-{i + 1:04d}",
                "source": "arith-hard" if hard else "arith-easy",
                "prompt": [msg("user", q)],
                "chosen": [msg("assistant", good)],
                "rejected": [msg("assistant", bad)],
            }
        )
    return rows


# ---------------------------------------------------------------- facts


def fact_table() -> list[tuple[str, str, str, list[str]]]:
    """All facts as (question, answer template, true value, values to draw false ones from)."""
    capitals = [c for _, c in CAPITALS]
    symbols = [s for _, s in ELEMENTS]
    return (
        [(f"What is the capital of {k}?", f"The capital of {k} is {{}}.", c, capitals) for k, c in CAPITALS]
        + [
            (f"Which planet is {o} from the Sun?", f"The {o} planet from the Sun is {{}}.", p, PLANETS)
            for o, p in zip(ORDINALS, PLANETS)
        ]
        + [
            (f"What is the chemical symbol for {e}?", f"The chemical symbol for {e} is {{}}.", s, symbols)
            for e, s in ELEMENTS
        ]
    )


def split_facts(seed: int) -> tuple[list, list]:
    """Split the fact table into disjoint (train, heldout) question sets, a fifth of each kind held out."""
    rng = random.Random(f"{seed}-fact-split")
    table = fact_table()
    a, b = len(CAPITALS), len(CAPITALS) + len(PLANETS)
    groups = [table[:a], table[a:b], table[b:]]  # capitals, planets, elements
    train, heldout = [], []
    for group in groups:
        rng.shuffle(group)
        cut = max(1, round(len(group) / 5))
        heldout += group[:cut]
        train += group[cut:]
    return train, heldout


def fact_pairs(rng: random.Random, facts: list, n: int) -> list[tuple[str, str, str]]:
    """n distinct (question, true sentence, false sentence) triples cycling over the given facts."""
    out, seen = [], set()
    order = list(facts)
    rng.shuffle(order)
    i = 0
    while len(out) < n:
        question, template, value, pool = order[i % len(order)]
        i += 1
        false = rng.choice([v for v in pool if v != value])
        if (question, false) in seen:
            continue
        seen.add((question, false))
        out.append((question, template.format(value), template.format(false)))
    return out


def facts_text(rng: random.Random, facts: list, n: int, prefix: str) -> list[dict]:
    """Plain-text rows: a Q/A prompt and completions that start with a space."""
    return [
        {"id": f"{prefix}-{i + 1:04d}", "prompt": f"Q: {q}\nA:", "chosen": f" {good}", "rejected": f" {bad}"}
        for i, (q, good, bad) in enumerate(fact_pairs(rng, facts, n))
    ]


def opener(rng: random.Random, facts: list, question: str) -> tuple[str, str]:
    """A first (user, assistant) exchange: 'Name a ...' or another true fact from the same split."""
    if rng.random() < 0.5:
        ask, template, values = rng.choice(OPENERS)
        return ask, template.format(rng.choice(values))
    q, template, value, _ = rng.choice([f for f in facts if f[0] != question])
    return q, template.format(value)


def facts_multiturn(rng: random.Random, facts: list, n: int, prefix: str) -> list[dict]:
    """Explicit multi-turn rows: prompt = [user, assistant, user], one assistant message per completion."""
    rows = []
    for i, (q, good, bad) in enumerate(fact_pairs(rng, facts, n)):
        ask, answer = opener(rng, facts, q)
        rows.append(
            {
                "id": f"{prefix}-{i + 1:04d}",
                "source": "facts-multiturn",
                "prompt": [msg("user", ask), msg("assistant", answer), msg("user", q)],
                "chosen": [msg("assistant", good)],
                "rejected": [msg("assistant", bad)],
            }
        )
    return rows


# ---------------------------------------------------------------- build and write


def build_split(seed: int, split: str, facts: list, used: set) -> dict[str, list[dict]]:
    """Rows of one split, keyed by file name; `used` holds arithmetic problems already drawn."""
    col, tag = (0, "") if split == "train" else (1, "-heldout")
    n = {name: counts[col] for name, counts in COUNTS.items()}

    def rng(name: str) -> random.Random:
        return random.Random(f"{seed}-{split}-{name}")

    return {
        "arith_chat.jsonl": arith_chat(rng("arith_chat"), n["arith_chat.jsonl"], used, f"arith-chat{tag}"),
        "arith_implicit.jsonl.zst": arith_implicit(
            rng("arith_implicit"), n["arith_implicit.jsonl.zst"], used, f"arith-implicit{tag}"
        ),
        "facts_text.json": facts_text(rng("facts_text"), facts, n["facts_text.json"], f"facts-text{tag}"),
        "facts_multiturn.parquet": facts_multiturn(
            rng("facts_multiturn"), facts, n["facts_multiturn.parquet"], f"facts-multiturn{tag}"
        ),
        "mixed_sources.jsonl": mixed_sources(rng("mixed"), n["mixed_sources.jsonl"], used, f"mixed{tag}"),
    }


def build(seed: int = 0) -> dict[str, dict[str, list[dict]]]:
    """All rows, keyed by split ('train', 'heldout') then file name; heldout problems are disjoint from train."""
    used: set = set()
    train_facts, heldout_facts = split_facts(seed)
    return {
        "train": build_split(seed, "train", train_facts, used),
        "heldout": build_split(seed, "heldout", heldout_facts, used),
    }


def jsonl_bytes(rows: list[dict]) -> bytes:
    """One compact JSON object per line."""
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


def write_zst_frames(path: Path, rows: list[dict]) -> None:
    """JSONL compressed as several independent zstd frames (FRAME_LINES lines each), concatenated."""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    chunks = [jsonl_bytes(rows[i : i + FRAME_LINES]) for i in range(0, len(rows), FRAME_LINES)]
    path.write_bytes(b"".join(cctx.compress(c) for c in chunks))


def write_parquet(path: Path, rows: list[dict]) -> None:
    """Parquet with list<struct<role, content>> message columns, fixed row groups, no key-value metadata."""
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("source", pa.string()),
            ("prompt", messages),
            ("chosen", messages),
            ("rejected", messages),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path, row_group_size=PARQUET_ROW_GROUP, compression="zstd", store_schema=False)


def write_file(path: Path, rows: list[dict]) -> None:
    """Write rows in the format implied by the file name."""
    if path.name.endswith(".jsonl.zst"):
        write_zst_frames(path, rows)
    elif path.suffix == ".parquet":
        write_parquet(path, rows)
    elif path.suffix == ".json":
        path.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2) + b"\n")
    else:
        path.write_bytes(jsonl_bytes(rows))


def write_all(out: Path, seed: int = 0) -> dict[str, dict[str, int]]:
    """Write both splits under `out` (heldout in out/heldout); return row counts per split and file."""
    counts = {}
    for split, files in build(seed).items():
        folder = Path(out) if split == "train" else Path(out) / "heldout"
        folder.mkdir(parents=True, exist_ok=True)
        for name, rows in files.items():
            write_file(folder / name, rows)
        counts[split] = {name: len(rows) for name, rows in files.items()}
    return counts


def main(argv: list[str] | None = None) -> None:
    """Command line: --seed (default 0), --out (default examples/sample)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for split, files in write_all(args.out, args.seed).items():
        for name, count in files.items():
            print(f"{split:8} {name:28} {count:4d} rows")


if __name__ == "__main__":
    main()
