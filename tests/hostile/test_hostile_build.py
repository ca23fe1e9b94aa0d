"""Hostile builds: zstd bombs in bounded memory, and concurrent, killed or overwriting builds never lose or mix data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import tracemalloc

import orjson
import pytest
import zstandard

from dpo_cli.data import main as dpo_data
from dpo_data.errors import InputFileError
from dpo_data.prepare.inputs import OversizedLine, iter_rows, open_input
from tests.conftest import SAMPLE, chat, write_jsonl
from tests.data.test_build import build
from tests.harness import cli_argv, data_cli, run_process

MIB = 1 << 20
GOOD = [chat(f"What is {i} + {i}?", f"It is {2 * i}.", f"It is {2 * i + 1}.") for i in range(3)]


def _zst_lines(path, *lines):
    """Write a .jsonl.zst of `lines`, each a list of byte pieces: streamed, so a GiB line costs KB of disk."""
    with open(path, "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as w:
        for pieces in lines:
            for piece in pieces:
                w.write(piece)
            w.write(b"\n")
    return path


def _long_row(mib: int) -> list[bytes]:
    """A row whose prompt is `mib` MiB of 'x', as pieces of 1 MiB."""
    return [b'{"prompt": "', *([b"x" * MIB] * mib), b'", "chosen": " a", "rejected": " b"}']


# -- a zstd bomb ------------------------------------------------------------------------------------------

_MEASURE = textwrap.dedent(
    """
    import resource, sys
    from dpo_cli.data import main
    small, big, tokenizer, warm, out = sys.argv[1:]
    main(["build", small, "--tokenizer", tokenizer, "--out", warm], standalone_mode=False)  # imports, tokenizer
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    main(["build", big, "--tokenizer", tokenizer, "--out", out], standalone_mode=False)
    print("RSS_KIB", before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """
)


def test_a_1_5_gib_zst_line_is_rejected_as_too_large_in_bounded_memory(smollm2_dir, tmp_path):
    """Before: a chunk of input was decompressed whole (1.5 GiB in one bytes object, then copied) and the
    rest re-sliced on every read, so this build ran out of memory or for hours."""
    size = 1536 * MIB
    big = _zst_lines(tmp_path / "bomb.jsonl.zst", _long_row(1536), [orjson.dumps(GOOD[0])])
    assert big.stat().st_size < 200_000
    small = write_jsonl(tmp_path / "small.jsonl", GOOD[:1])
    out = tmp_path / "ds"
    proc = run_process([sys.executable, "-c", _MEASURE, small, big, smollm2_dir, tmp_path / "warm", out], timeout=120)
    before, after = map(int, proc.stdout.split("RSS_KIB")[1].split())
    assert after - before < 300 * 1024, f"peak RSS grew by {(after - before) // 1024} MiB"  # ru_maxrss is in KiB
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    row_bytes = size + len(b'{"prompt": "') + len(b'", "chosen": " a", "rejected": " b"}')
    assert reject["line"] == 1 and reject["reason"] == "row_too_large"
    assert reject["message"] == f"the row has {row_bytes} bytes, over --max-row-bytes {8 * MIB}"
    assert json.loads((out / "manifest.json").read_text())["totals"]["pairs"] == 1


def test_long_zst_rows_are_read_in_memory_bounded_by_a_few_rows(tmp_path):
    """Rows under the limit are read whole, but the reader holds only a few rows and at most the 8 MiB one
    feed of the decompressor yields, not the file: 16 rows of 8 MiB peak under 64 MiB, not 128 MiB or more.
    Each read copies at most that much, so the time is linear in the file (before: quadratic re-slicing)."""
    path = _zst_lines(tmp_path / "long.jsonl.zst", *([_long_row(8)] * 16))
    tracemalloc.start()
    try:
        sizes = [len(item) for _, item in iter_rows(open_input(str(path)), 16 * MIB)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sizes == [len(b"".join(_long_row(8)))] * 16
    assert peak < 64 * MIB, f"peak {peak // MIB} MiB"


def test_many_small_frames_are_all_read_and_a_cut_one_is_still_an_error(tmp_path):
    """One frame per line, so frames start and end inside the pieces the reader feeds the decompressor."""
    c = zstandard.ZstdCompressor()
    data = b"".join(c.compress(orjson.dumps({"n": i}) + b"\n") for i in range(3000))
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(data)
    assert [item for _, item in iter_rows(open_input(str(path)), 1024)] == [orjson.dumps({"n": i}) for i in range(3000)]
    path.write_bytes(data[:-3])
    with pytest.raises(InputFileError, match=r"frames\.jsonl\.zst: truncated: the last zstd frame is incomplete"):
        list(iter_rows(open_input(str(path)), 1024))


def test_an_oversized_zst_line_is_skipped_to_its_end(tmp_path):
    path = _zst_lines(tmp_path / "a.jsonl.zst", _long_row(20), [b'{"n": 2}'])
    (n1, big), (n2, small) = iter_rows(open_input(str(path)), 8 * MIB)
    assert (n1, n2, small) == (1, 2, b'{"n": 2}')
    assert isinstance(big, OversizedLine) and big.size == len(b"".join(_long_row(20))) and len(big.head) == 1024


# -- --overwrite deletes only what a build wrote -----------------------------------------------------------


@pytest.fixture
def good(tmp_path):
    return write_jsonl(tmp_path / "good.jsonl", GOOD)


def test_overwrite_refuses_a_dataset_holding_anything_a_build_did_not_write(smollm2_dir, tmp_path, good, run_cli):
    """Before: a valid manifest was enough, and the swap deleted the training run kept inside the dataset."""
    out = tmp_path / "ds"
    assert build(run_cli, smollm2_dir, out, good).exit_code == 0
    manifest = (out / "manifest.json").read_bytes()
    (out / "run" / "checkpoints").mkdir(parents=True)
    (out / "run" / "checkpoints" / "state.json").write_text("{}")
    (out / "notes.txt").write_text("keep me")
    (out / "shards" / "mine.arrow").write_text("mine")
    r = build(run_cli, smollm2_dir, out, good, extra=["--overwrite"])
    assert r.exit_code == 2
    assert (
        f"error: --out {out} is a dataset that also holds notes.txt, run, shards/mine.arrow, which no build "
        f"wrote; --overwrite would delete them with the old dataset: move them out of {out}, or choose "
        "another --out"
    ) in r.output
    assert (out / "run" / "checkpoints" / "state.json").read_text() == "{}"
    assert (out / "notes.txt").read_text() == "keep me" and (out / "shards" / "mine.arrow").read_text() == "mine"
    assert (out / "manifest.json").read_bytes() == manifest and not list(tmp_path.glob("ds.incomplete-*"))


def test_what_appears_in_out_during_a_build_is_refused_before_the_swap(
    smollm2_dir, tmp_path, good, run_cli, monkeypatch
):
    import dpo_data.prepare.build as build_module

    out = tmp_path / "ds"
    assert build(run_cli, smollm2_dir, out, good).exit_code == 0
    real = build_module._build_into

    def build_while_a_run_starts(*args, **kwargs):
        result = real(*args, **kwargs)
        (out / "run").mkdir()  # a training run started inside the dataset while it was being rebuilt
        return result

    monkeypatch.setattr(build_module, "_build_into", build_while_a_run_starts)
    r = build(run_cli, smollm2_dir, out, good, extra=["--overwrite"])
    assert r.exit_code == 2 and "is a dataset that also holds run, which no build wrote" in r.output
    (staging,) = tmp_path.glob("ds.incomplete-*")
    assert f"(nothing was committed; the new build is in {staging})" in r.output
    assert (out / "run").is_dir() and (staging / "manifest.json").is_file()


# -- leftovers of refused builds ---------------------------------------------------------------------------


def test_the_next_successful_build_removes_refused_builds_staging_but_nothing_else(
    smollm2_dir, tmp_path, good, run_cli
):
    """Before: every refused build left an OUT.incomplete-* directory for good, though the docs said the next
    build removes it."""
    out = tmp_path / "ds"
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [GOOD[0], b"{", b"[]"])
    refused = build(run_cli, smollm2_dir, out, mixed, extra=["--max-reject-fraction", "0.5"])
    assert refused.exit_code == 1 and "2 of 3 rows were rejected" in refused.output
    (left,) = tmp_path.glob("ds.incomplete-*")
    assert len((left / "rejects.jsonl").read_text().splitlines()) == 2 and (left / "shards").is_dir()
    annotated = tmp_path / "ds.incomplete-0123456789ab"  # a leftover the user wrote a note into
    (annotated / "shards").mkdir(parents=True)
    (annotated / "rejects.jsonl").write_text("")
    (annotated / "why.txt").write_text("mine")
    others = [tmp_path / "ds.incomplete-mine", tmp_path / "ds2.incomplete-0123456789ab"]  # not this --out's
    for other in others:
        (other / "shards").mkdir(parents=True)

    assert build(run_cli, smollm2_dir, out, good).exit_code == 0
    assert not left.exists()
    assert [p.name for p in annotated.iterdir()] == ["why.txt"]
    assert all((other / "shards").is_dir() for other in others)


def test_a_json_input_too_large_to_parse_whole_is_refused_naming_jsonl(tmp_path):
    from dpo_data.prepare.inputs import MAX_JSON_INPUT_BYTES

    big = tmp_path / "rows.json"
    with open(big, "wb") as f:  # sparse: no disk or memory is spent on it
        f.truncate(MAX_JSON_INPUT_BYTES + 1)
    with pytest.raises(InputFileError, match=r"over the \d+-byte limit for a \.json input.*\.jsonl"):
        list(iter_rows(open_input(str(big)), max_row_bytes=1 << 20))


# -- building into a directory never loses or mixes data ----------------------------------------------------


def _fingerprint(out):
    return json.loads((out / "manifest.json").read_text())["fingerprint"]


def test_concurrent_builds_into_one_out_never_mix_and_the_loser_is_named(smollm2_dir, tmp_path, run_cli):
    """Before: both shared OUT.incomplete; the winner could commit one input's manifest over the other's shards."""
    out = tmp_path / "ds"
    a, b = SAMPLE / "arith_chat.jsonl", SAMPLE / "facts_text.json"
    for _ in range(3):
        procs = [
            subprocess.Popen(
                cli_argv("data", "build", src, "--tokenizer", smollm2_dir, "--out", out, "--overwrite"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for src in (a, b)
        ]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
        assert all(code in (0, 2) for code, _ in results) and any(code == 0 for code, _ in results), results
        for code, err in results:
            assert "Traceback" not in err
            if code == 2:
                assert "is being built by another process (pid " in err
        assert run_cli(dpo_data, "verify", out).exit_code == 0
        assert not list(tmp_path.glob("ds.incomplete*"))


def test_overwrite_replaces_only_a_dataset(smollm2_dir, tmp_path, run_cli):
    notes = tmp_path / "mine"
    notes.mkdir()
    (notes / "notes.txt").write_text("keep me")
    r = build(run_cli, smollm2_dir, notes, SAMPLE / "arith_chat.jsonl", extra=["--overwrite"])
    assert r.exit_code == 2 and "is not a dataset" in r.stderr and "notes.txt" in r.stderr
    assert (notes / "notes.txt").read_text() == "keep me"
    inside = notes / "rows.jsonl"
    shutil.copy(SAMPLE / "arith_chat.jsonl", inside)
    r = build(run_cli, smollm2_dir, notes, inside, extra=["--overwrite"])
    assert r.exit_code == 2 and "lies inside --out" in r.stderr and inside.exists()


@pytest.mark.parametrize("point", ["before-swap", "after-swap", "after-delete"])
def test_a_build_killed_at_any_point_of_its_commit_leaves_the_old_or_the_new_dataset(
    smollm2_dir, tmp_path, run_cli, point
):
    out = tmp_path / "ds"
    assert build(run_cli, smollm2_dir, out, SAMPLE / "arith_chat.jsonl").exit_code == 0
    old = _fingerprint(out)
    args = ["build", SAMPLE / "facts_text.json", "--tokenizer", smollm2_dir, "--out", out, "--overwrite"]
    data_cli(*args, env={"DPO_DATA_KILL": point}, code=-9)
    assert run_cli(dpo_data, "verify", out).exit_code == 0
    now = _fingerprint(out)
    assert now == old if point == "before-swap" else now != old  # the old dataset, or the whole new one


def test_small_build_hazards_are_handled(smollm2_dir, tmp_path, run_cli):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (SAMPLE / "arith_chat.jsonl").read_bytes())
    out = tmp_path / "bom-ds"
    assert build(run_cli, smollm2_dir, out, bom).exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["totals"]["rejected"] == 0  # the BOM is not a reject

    twice = build(run_cli, smollm2_dir, tmp_path / "t", bom, bom)
    assert twice.exit_code == 2 and "given twice" in twice.stderr

    cut = tmp_path / "cut.jsonl"
    cut.write_bytes((SAMPLE / "arith_chat.jsonl").read_bytes()[:-30])
    broken = build(run_cli, smollm2_dir, tmp_path / "c", cut)
    assert broken.exit_code == 2 and "truncated" in broken.stderr and not list(tmp_path.glob("c.incomplete*"))

    (tmp_path / "a-file").write_text("")
    unwritable = build(run_cli, smollm2_dir, tmp_path / "a-file" / "ds", bom)
    assert unwritable.exit_code == 2 and "error: " in unwritable.stderr and "Traceback" not in unwritable.stderr
