"""Property tests: no input row, however malformed, escapes as an exception instead of a pair or a reject."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpo_data.prepare.chunk import init_worker, process_chunk
from dpo_data.prepare.inputs import InputFile
from dpo_data.prepare.options import BuildOptions
from dpo_data.prepare.rows import RowReject, normalize_row

text = st.text(max_size=20)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "robot", ""]),
        "content": st.one_of(text, st.integers()),
    }
)
part = st.one_of(text, st.lists(message, max_size=4), st.integers(), st.none(), st.lists(st.integers(), max_size=2))
rows = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "prompt": part,
            "chosen": part,
            "rejected": part,
            "id": st.one_of(text, st.integers(), st.booleans(), st.none()),
            "source": st.one_of(text, st.integers(), st.none()),
        },
    ),
    st.lists(st.integers(), max_size=3),
    st.integers(),
    text,
    st.none(),
)


@given(rows)
@settings(max_examples=400, deadline=None)
def test_normalize_returns_a_pair_or_raises_a_documented_reject(row):
    try:
        pair = normalize_row(row)
    except RowReject as reject:
        assert reject.reason and reject.message
    else:
        assert pair.kind in ("text", "chat") and pair.chosen != pair.rejected


@pytest.fixture(scope="module")
def worker(tokenizer):
    init_worker(tokenizer, BuildOptions(max_length=64), [InputFile("x.jsonl", "jsonl", "x")])


@given(st.lists(st.one_of(st.binary(max_size=60), rows.map(lambda r: json.dumps(r).encode())), min_size=1, max_size=8))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_line_becomes_exactly_one_pair_or_one_reject(worker, lines):
    result = process_chunk((0, [(0, n, n - 1, line) for n, line in enumerate(lines, start=1)]))
    rejected = [record["line"] for _, record in result.rejects]
    kept = result.block.input_row.tolist()
    assert sorted(rejected + kept) == list(range(1, len(lines) + 1))  # each line exactly once
    assert rejected == sorted(rejected) and kept == sorted(kept)
    assert result.block.row_index.tolist() == [n - 1 for n in kept]  # each pair carries its row's global index
    assert all(record["reason"] for _, record in result.rejects)
    assert (result.block.lengths > 0).all()  # every kept pair has a prompt and two completions
