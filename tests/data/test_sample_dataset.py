"""The bundled sample dataset is reproducible from examples/make_sample.py, disjoint across splits, and well formed."""

from __future__ import annotations

import importlib.util
import io
import re
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
import zstandard

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "make_sample.py"
SAMPLE = ROOT / "examples" / "sample"
SPLITS = {"train": SAMPLE, "heldout": SAMPLE / "heldout"}
# file -> (explicit prompt, conversational)
FORMATS = {
    "arith_chat.jsonl": (True, True),
    "arith_implicit.jsonl.zst": (False, True),
    "facts_text.json": (True, False),
    "facts_multiturn.parquet": (True, True),
    "mixed_sources.jsonl": (True, True),
}
EXPR = re.compile(r"\d+ [-+x] \d+")


def load_script():
    """Import make_sample.py from its path (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("make_sample", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_rows(path: Path) -> list[dict]:
    """Rows of one sample file, whatever its format."""
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix == ".json":
        return orjson.loads(path.read_bytes())
    if path.name.endswith(".zst"):
        with path.open("rb") as f, zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True) as r:
            data = r.read()
    else:
        data = path.read_bytes()
    return [orjson.loads(line) for line in data.splitlines()]


def question(row: dict) -> str:
    """The final user question of a row, whatever its format."""
    if "prompt" not in row:
        return row["chosen"][-2]["content"]
    if isinstance(row["prompt"], str):
        return row["prompt"].removeprefix("Q: ").removesuffix("\nA:")
    return row["prompt"][-1]["content"]


def expressions(questions: set[str]) -> set[str]:
    """Arithmetic expressions ('17 + 25') mentioned in the questions."""
    return {e for q in questions for e in EXPR.findall(q)}


def check_turns(messages: list[dict], last: str) -> None:
    """Optional system first, then user/assistant alternating from user, ending with `last`; contents non-empty."""
    assert messages and all(set(m) == {"role", "content"} for m in messages)
    assert all(isinstance(m["content"], str) and m["content"].strip() for m in messages)
    roles = [m["role"] for m in messages]
    if roles[0] == "system":
        roles = roles[1:]
    assert roles and roles == [("user", "assistant")[i % 2] for i in range(len(roles))], roles
    assert roles[-1] == last


def check_row(row: dict) -> None:
    """The validity rules every sample row must satisfy."""
    assert row["chosen"] != row["rejected"]
    if "prompt" not in row:
        check_turns(row["chosen"], "assistant")
        check_turns(row["rejected"], "assistant")
        assert row["chosen"][:-1] == row["rejected"][:-1]
    elif isinstance(row["prompt"], str):
        for key in ("prompt", "chosen", "rejected"):
            assert isinstance(row[key], str) and row[key].strip()
    else:
        check_turns(row["prompt"], "user")
        for key in ("chosen", "rejected"):
            assert [m["role"] for m in row[key]] == ["assistant"]
            check_turns(row["prompt"] + row[key], "assistant")


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, str], list[dict]]:
    return {(split, name): read_rows(folder / name) for split, folder in SPLITS.items() for name in FORMATS}


def test_script_reproduces_committed_files(tmp_path):
    counts = load_script().write_all(tmp_path, seed=0)
    committed = sorted(p.relative_to(SAMPLE) for p in SAMPLE.rglob("*") if p.is_file())
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()) == committed
    for rel in committed:
        if rel.suffix == ".parquet":
            assert pq.read_table(tmp_path / rel).equals(pq.read_table(SAMPLE / rel)), rel
        else:
            assert (tmp_path / rel).read_bytes() == (SAMPLE / rel).read_bytes(), rel
    for split, folder in SPLITS.items():
        for name, n in counts[split].items():
            assert len(read_rows(folder / name)) == n


@pytest.mark.parametrize("folder", SPLITS.values(), ids=SPLITS.keys())
def test_zst_needs_reading_across_frames(folder):
    data = (folder / "arith_implicit.jsonl.zst").read_bytes()
    frames, rest = 0, data
    while rest:
        dobj = zstandard.ZstdDecompressor().decompressobj()
        assert dobj.decompress(rest)
        frames, rest = frames + 1, dobj.unused_data
    assert frames > 1
    # One large read stops at the end of the first frame unless the reader reads across frames.
    dctx = zstandard.ZstdDecompressor()
    whole = dctx.stream_reader(io.BytesIO(data), read_across_frames=True).read(1 << 24)
    first = dctx.stream_reader(io.BytesIO(data), read_across_frames=False).read(1 << 24)
    assert len(first) < len(whole) and whole.startswith(first)
    assert len(whole.splitlines()) == len(read_rows(folder / "arith_implicit.jsonl.zst"))
    assert whole.endswith(b"\n") and all(orjson.loads(line) for line in whole.splitlines())


def test_heldout_questions_not_in_train(rows):
    train = {question(r) for (split, _), rs in rows.items() if split == "train" for r in rs}
    heldout = {question(r) for (split, _), rs in rows.items() if split == "heldout" for r in rs}
    assert heldout and not heldout & train
    assert expressions(heldout) and not expressions(heldout) & expressions(train)


def test_every_row_valid(rows):
    for (split, name), rs in rows.items():
        assert rs, (split, name)
        ids = [r["id"] for r in rs]
        assert len(set(ids)) == len(ids) and all(isinstance(i, str) and i for i in ids)
        for row in rs:
            check_row(row)


@pytest.mark.parametrize("name", FORMATS)
def test_file_format(rows, name):
    explicit, conversational = FORMATS[name]
    for split in SPLITS:
        for i, row in enumerate(rows[split, name]):
            assert ("prompt" in row) == explicit
            assert isinstance(row["chosen"], list) == conversational
            if name == "facts_text.json":
                assert row["prompt"].startswith("Q: ") and row["prompt"].endswith("\nA:")
                assert row["chosen"].startswith(" ") and row["rejected"].startswith(" ")
            if name == "facts_multiturn.parquet":
                assert [m["role"] for m in row["prompt"]] == ["user", "assistant", "user"]
                assert row["source"] == "facts-multiturn"
            if name == "mixed_sources.jsonl":
                assert row["source"] == ("arith-easy", "arith-hard")[i % 2]


def test_some_chat_prompts_have_system_message(rows):
    prompts = [r["prompt"] for r in rows["train", "arith_chat.jsonl"]]
    with_system = sum(p[0]["role"] == "system" for p in prompts)
    assert 0 < with_system < len(prompts) / 2
