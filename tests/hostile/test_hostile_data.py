"""Hostile datasets: damaged shards and edited manifests are refused by every reader, named by `dpo-data verify`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dpo_cli.data import main as dpo_data
from dpo_cli.train import main as dpo_train
from tests.harness import tiny_config, write_yaml


@pytest.fixture
def dataset_copy(sample_dataset, tmp_path):
    target = tmp_path / "data"
    shutil.copytree(sample_dataset, target)
    return target


def _edit_manifest(dataset, edit):
    path = dataset / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _config_for(dataset, tokenizer, tmp_path, **data):
    """A one-step run on `dataset` into tmp_path/out, saving nothing; `data` adds to its data section."""
    config = tiny_config(dataset, tokenizer, tmp_path / "out", max_steps=1, save_every=0)
    config["data"].update(data)
    return write_yaml(tmp_path / "data.yaml", config)


def _refused(run_cli, config_path) -> str:
    """dpo-train's refusal of `config_path` (exit 2, no traceback), in-process: its stderr."""
    result = run_cli(dpo_train, config_path, "--quiet")
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr


def _flip(path, offset, mask=0x01):
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


# -- the trainer reads only verified data --------------------------------------------------------------------


def test_a_flipped_byte_in_a_shard_is_refused_before_the_first_step(dataset_copy, smollm2_dir, tmp_path, run_cli):
    """Before, the run trained silently on the altered token."""
    shard = dataset_copy / "shards" / "shard-00000.arrow"
    _flip(shard, shard.stat().st_size // 2)
    stderr = _refused(run_cli, _config_for(dataset_copy, smollm2_dir, tmp_path))
    assert "the data does not match its manifests" in stderr
    assert "shards/shard-00000.arrow: sha256 differs from its manifest" in stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not (tmp_path / "out" / "metrics.jsonl").read_text()


def _chosen_id_offset(dataset, index):
    """The byte offset, in its shard, of the first chosen token id of pair `index` (one dataset)."""
    import pyarrow as pa

    from dpo_data import read_manifest
    from dpo_data.dataset.shards import RECORD_BATCH_ROWS

    shard = next(
        s
        for s in read_manifest(dataset)["shards"]
        if s["first_pair_index"] <= index < s["first_pair_index"] + s["rows"]
    )
    data = pa.py_buffer((dataset / shard["path"]).read_bytes())
    row = index - shard["first_pair_index"]
    batch = pa.ipc.open_file(data).get_batch(row // RECORD_BATCH_ROWS)  # zero-copy views into `data`
    ids = batch.column("chosen_ids")
    values = ids.values
    start = ids.offsets[row % RECORD_BATCH_ROWS].as_py() + values.offset
    return values.buffers()[1].address + 4 * start - data.address


def test_a_token_id_out_of_range_is_a_named_error_even_when_only_sizes_are_verified(
    dataset_copy, smollm2_dir, tmp_path, run_cli
):
    """Before: an IndexError at step 0 that named no dataset."""
    import yaml

    from dpo_data import LoaderConfig, PairStore, plan_document

    config_path = _config_for(dataset_copy, smollm2_dir, tmp_path, verify="size")
    config = yaml.safe_load(config_path.read_text())["data"]
    step0 = plan_document(
        [dataset_copy],
        LoaderConfig(
            pairs_per_step=config["pairs_per_step"], max_tokens_per_microbatch=config["max_tokens_per_microbatch"]
        ),
        steps=1,
    )["steps"][0]["ranks"][0]["microbatches"][0]["pairs"]
    store = PairStore([dataset_copy])
    directory, shard_path = store.locate(step0[0])
    shard = Path(directory) / shard_path
    _flip(shard, _chosen_id_offset(dataset_copy, step0[0]) + 3, mask=0x80)  # the high bit: a negative token id
    stderr = _refused(run_cli, config_path)
    assert "outside the model's 49152 embedding rows" in stderr and shard_path in stderr
    assert "IndexError" not in stderr


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda m: m["totals"].update(pairs=m["totals"]["pairs"] + 1), "shards hold 342 rows, totals.pairs is 343"),
        (lambda m: m.update(fingerprint="sha256:" + "0" * 64), "does not match its content"),
        (lambda m: m["tokenizer"]["components"].update(chat_template="0" * 64), "not the digest of the recorded"),
    ],
)
def test_an_edited_manifest_is_refused_by_every_reader(dataset_copy, smollm2_dir, tmp_path, run_cli, edit, named):
    _edit_manifest(dataset_copy, edit)
    for command in (["plan", dataset_copy, "--batching", "pairs", "--world-size", "1"], ["inspect", dataset_copy]):
        r = run_cli(dpo_data, *command)
        assert r.exit_code == 2 and named in r.output and "contradicts itself" in r.output
    r = run_cli(dpo_data, "verify", dataset_copy)
    assert r.exit_code == 1 and named in r.output
    assert named in _refused(run_cli, _config_for(dataset_copy, smollm2_dir, tmp_path))


# -- dpo-data verify names what is wrong ----------------------------------------------------------------------


def test_a_flipped_footer_byte_is_named_by_verify_not_a_traceback(dataset_copy, run_cli):
    shard = dataset_copy / "shards" / "shard-00000.arrow"
    _flip(shard, shard.stat().st_size - 3)
    r = run_cli(dpo_data, "verify", dataset_copy)
    assert r.exit_code == 1 and "shard-00000.arrow: not a readable Arrow IPC file" in r.output


def test_verify_recomputes_what_the_manifest_states_about_the_data(dataset_copy, run_cli):
    _edit_manifest(dataset_copy, lambda m: m["lengths"]["chosen"].update(max=m["lengths"]["chosen"]["max"] + 1))
    _edit_manifest(dataset_copy, lambda m: m["totals"].update(max_token_id=m["totals"]["max_token_id"] - 1))
    r = run_cli(dpo_data, "verify", dataset_copy)
    assert r.exit_code == 1 and "lengths.chosen: manifest says" in r.output
    assert "totals.max_token_id: manifest says" in r.output


def test_verify_lists_unnamed_files_and_fails_on_them_with_strict(dataset_copy, run_cli):
    (dataset_copy / "shards" / "stray.arrow").write_bytes(b"x")
    r = run_cli(dpo_data, "verify", dataset_copy)
    assert r.exit_code == 0 and "note: shards/stray.arrow is in" in r.output
    r = run_cli(dpo_data, "verify", dataset_copy, "--strict")
    assert r.exit_code == 1 and "shards/stray.arrow: in the dataset directory but not named" in r.output


def test_verify_rehashes_raw_inputs(dataset_copy, tmp_path, run_cli):
    from tests.conftest import SAMPLE

    original = SAMPLE / "arith_chat.jsonl"
    assert run_cli(dpo_data, "verify", dataset_copy, "--inputs", original).exit_code == 0
    changed = tmp_path / "arith_chat.jsonl"
    changed.write_bytes(original.read_bytes() + b"\n")
    r = run_cli(dpo_data, "verify", dataset_copy, "--inputs", changed)
    assert r.exit_code == 1 and f"input {changed}: " in r.output and "truncated or appended to" in r.output
