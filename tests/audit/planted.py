"""Datasets with planted findings, every count known, built by `dpo_data.prepare.build` with the real SmolLM2
tokenizer: what tests/audit checks the audit and the filter against."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import chat, write_jsonl

WORDS = (
    "apple river stone cloud garden window silver market forest engine bridge candle doctor island summer "
    "winter planet pocket ladder mirror rocket violin yellow orange purple basket camera dragon feather hammer "
    "jungle kettle lemon marble needle ocean pepper rabbit saddle tiger tunnel velvet wagon zebra anchor "
    "button castle desert falcon glacier harbor helmet jacket kitten lantern meadow napkin pillow quartz "
    "ribbon shadow thunder umbrella valley walnut blanket canyon dolphin ember fountain goblet hollow iris "
    "jigsaw kernel lagoon magnet nectar orchid parrot quiver raven sapphire timber utensil vessel willow"
).split()


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def changed(text: str, at: int, seed: int) -> str:
    """`text` with its word `at` replaced by another word: a near-duplicate (a few tokens changed)."""
    parts = text.split()
    parts[at] = random.Random(seed).choice([w for w in WORDS if w != parts[at]])
    return " ".join(parts)


def prompt(i: int) -> str:
    return f"Question {i}: " + words(1000 + i, 40) + "?"


@dataclass(frozen=True)
class Expected:
    """What the audit must find in `base` + `degenerate` + `long` (in that order), against `heldout`."""

    pairs: int = 30 + 16 + 3
    exact_duplicates: int = 2
    conflicting_pairs: int = 2
    near_duplicate_prompts: int = 2
    near_duplicate_clusters: int = 2
    contaminated_prompts: int = 2
    prefix: int = 4
    last_k_differ: int = 4
    whitespace_equal: int = 4
    truncated: int = 2
    multi_turn: int = 2
    base_chosen_longer: tuple[int, int] = (23, 30)
    """In source base: pairs with a longer chosen, of pairs of unequal lengths."""


def base_rows() -> list[dict]:
    """Source `base`, 30 pairs: 24 distinct prompts (chosen longer in 0..17, rejected in 18..23), exact copies of
    pairs 0 and 1, pair 2 swapped (a conflict: both count), near-duplicates of prompts 3 and 4 (one word changed),
    and a decoy: pair 7's prompt and chosen with another rejected (no duplicate: it differs in its rejected)."""
    long_, short = (lambda i: words(2000 + i, 20)), (lambda i: words(3000 + i, 5))
    rows = [chat(prompt(i), long_(i), short(i)) if i < 18 else chat(prompt(i), short(i), long_(i)) for i in range(24)]
    rows += [dict(rows[0]), dict(rows[1])]
    rows.append(chat(prompt(2), short(2), long_(2)))
    rows += [chat(changed(prompt(i), 10, i), long_(100 + i), short(100 + i)) for i in (3, 4)]
    rows.append(chat(prompt(7), long_(7), short(107)))
    return [{**row, "source": "base"} for row in rows]


def degenerate_rows() -> list[dict]:
    """Source `degenerate`, 16 pairs of distinct prompts: 0-3 the chosen a prefix of the rejected (6 words more),
    4-7 equal but for their last word, 8-11 equal but for a doubled space (whitespace), 12-15 unrelated
    completions, 12 and 13 with a multi-turn prompt."""
    rows = []
    for j in range(16):
        p, text = prompt(500 + j), words(4000 + j, 12)
        if j < 4:
            row = chat(p, text, text + " " + words(4100 + j, 6))
        elif j < 8:
            row = chat(p, text + " yes", text + " no")
        elif j < 12:
            head, tail = text.split(" ", 1)
            row = chat(p, text, head + "  " + tail)
        else:
            row = chat(p, text, words(4200 + j, 12))
            if j < 14:
                row["prompt"] = [
                    {"role": "user", "content": words(4300 + j, 8)},
                    {"role": "assistant", "content": words(4400 + j, 8)},
                    {"role": "user", "content": p},
                ]
        rows.append({**row, "source": "degenerate"})
    return rows


def long_rows() -> list[dict]:
    """Source `long`, 3 pairs built with --max-length 64 --overlength truncate-prompt: 2 truncated prompts."""
    return [
        {**chat(words(5000 + j, 80 if j < 2 else 4), words(5100 + j, 4), words(5200 + j, 3)), "source": "long"}
        for j in range(3)
    ]


def heldout_rows() -> list[dict]:
    """An evaluation set of 16 prompts: pair 5's prompt exactly, pair 6's with one word changed, 14 others."""
    rows = [chat(prompt(5), "yes", "no"), chat(changed(prompt(6), 20, 6), "yes", "no")]
    rows += [chat(prompt(900 + j), "yes", "no") for j in range(14)]
    return rows


@dataclass(frozen=True)
class Planted:
    base: Path
    long: Path
    heldout: Path
    expected: Expected

    @property
    def dirs(self) -> list[Path]:
        return [self.base, self.long]


def build_planted(folder: Path, tokenizer: Path) -> Planted:
    """The datasets: `base` (sources base and degenerate), `long` (truncated prompts) and `heldout`."""
    from dpo_data.prepare.build import BuildOptions, build

    def made(name: str, rows: list[dict], **options) -> Path:
        out = folder / name
        result = build([str(write_jsonl(folder / f"{name}.jsonl", rows))], str(tokenizer), out, BuildOptions(**options))
        assert result.manifest is not None and result.pairs == len(rows), result.error
        return out

    base = made("base", base_rows() + degenerate_rows())
    long = made("long", long_rows(), max_length=64, overlength="truncate-prompt")
    return Planted(base, long, made("heldout", heldout_rows()), Expected())
