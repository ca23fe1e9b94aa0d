"""Hostile-but-honest inputs: files someone could write beside their hashes. Every case is refused by
name, nothing in them is executed, and no general unpickler ever runs on a checkpoint file."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dpo_state.commit import write_commit
from tests.harness import TINY_LLAMA

MODEL = TINY_LLAMA


class _CreatesFile:
    """Unpickled by a general unpickler, this opens `path` for writing: the file appears."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _train(config_path, *extra, code=0):
    args = [sys.executable, "-m", "dpo_cli.train", str(config_path), "--quiet", *extra]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, proc.stderr[-3000:]
    return proc


def _state(*args):
    return subprocess.run(
        [sys.executable, "-m", "dpo_cli.state", *map(str, args)], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def trained(sample_dataset, smollm2_dir, tmp_path_factory):
    """A run with committed checkpoints at steps 1 and 2, and its config."""
    tmp = tmp_path_factory.mktemp("hostile")
    config = {
        "model": {"init": {"config": MODEL, "seed": 0}, "tokenizer": str(smollm2_dir)},
        "data": {"path": str(sample_dataset), "pairs_per_step": 4, "max_tokens_per_microbatch": 400},
        "optim": {"lr": 1.0e-3},
        "train": {"output_dir": str(tmp / "run"), "max_steps": 2, "save_every": 1},
    }
    (tmp / "c.yaml").write_text(yaml.safe_dump(config))
    _train(tmp / "c.yaml")
    return tmp, config


@pytest.fixture
def run(trained, tmp_path):
    """A private copy of the trained run, its config pointing at the copy."""
    source, config = trained
    shutil.copytree(source / "run", tmp_path / "run")
    config = {**config, "train": {**config["train"], "output_dir": str(tmp_path / "run"), "max_steps": 3}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def _step(run, k):
    return run / "run" / "checkpoints" / f"step-{k:06d}"


def _every_reader_refuses(run, step, marker, named):
    """verify, diff --values, resume (auto, strict, PATH) and weights_from refuse by name; no file appears."""
    proc = _state("verify", step)
    assert proc.returncode == 1 and named in proc.stderr
    proc = _state("diff", _step(run, 1), step, "--values")
    assert proc.returncode == 2 and named in proc.stderr and "Traceback" not in proc.stderr
    strict = _train(run / "c.yaml", "--set", "train.resume_strict=true", code=2)
    assert named in strict.stderr and "Traceback" not in strict.stderr
    by_path = _train(run / "c.yaml", "--set", f"train.resume={step}", code=2)
    assert named in by_path.stderr
    fresh = _train(
        run / "c.yaml", "--set", f"train.output_dir={run / 'new'}", "--set", f"train.weights_from={step}", code=2
    )
    assert named in fresh.stderr
    auto = _train(run / "c.yaml")  # skips the hostile checkpoint, naming it, and resumes from the one before
    assert f"skipping checkpoint {step}" in auto.stderr and named in auto.stderr
    assert "resumed from" in auto.stderr and "step-000001" in auto.stderr
    assert not marker.exists()


def test_a_pickle_payload_in_the_dcp_metadata_is_refused_before_anything_is_built(run, tmp_path):
    marker = tmp_path / "payload-ran"
    step = _step(run, 2)
    (step / "dcp" / ".metadata").write_bytes(pickle.dumps({"x": _CreatesFile(marker)}))
    write_commit(step, 2)  # whoever can write the checkpoint can also write its hashes
    _every_reader_refuses(run, step, marker, "names io.open")


def test_a_pickled_item_indexed_by_valid_metadata_is_refused(run, tmp_path):
    """DCP unpickles non-tensor items with a general unpickler: metadata that indexes one is refused."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from dpo_state.dcp_io import read_dcp_metadata

    marker = tmp_path / "payload-ran"
    step = _step(run, 2)
    metadata = read_dcp_metadata(step / "dcp")
    payload = pickle.dumps(_CreatesFile(marker))
    (step / "dcp" / "__9_0.distcp").write_bytes(payload)
    metadata.state_dict_metadata["optim.param_groups.0.lr"] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex("optim.param_groups.0.lr")] = _StorageInfo("__9_0.distcp", 0, len(payload))
    (step / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    write_commit(step, 2)
    _every_reader_refuses(run, step, marker, "non-tensor item")


def test_a_pickle_payload_in_the_tensor_data_is_never_executed(run, tmp_path):
    """Tensor bytes are read by torch's weights-only unpickler: the payload fails to load, named."""
    marker = tmp_path / "payload-ran"
    step = _step(run, 2)
    for data in (step / "dcp").glob("*.distcp"):
        data.write_bytes(pickle.dumps(_CreatesFile(marker)) * 64)
    write_commit(step, 2)
    by_path = _train(run / "c.yaml", "--set", f"train.resume={step}", code=2)
    assert "could not read its tensors" in by_path.stderr and "Traceback" not in by_path.stderr
    proc = _state("diff", _step(run, 1), step, "--values")
    assert proc.returncode == 2 and "could not read its tensors" in proc.stderr
    assert not marker.exists()


def test_a_checkpoint_holds_tensors_only_and_its_hyperparameters_as_json(run):
    from dpo_state.dcp_io import read_dcp_metadata
    from dpo_state.state import read_state_tree

    step = _step(run, 2)
    read_dcp_metadata(step / "dcp")  # raises on any non-tensor item
    tree = read_state_tree(step)
    group = tree["optim"]["param_groups"][0]
    assert group["lr"] == 1.0e-3 and group["betas"] == [0.9, 0.999] and group["params"]
    assert all(leaf == {"$tensor": True} for leaf in tree["model"].values())


# -- the run's tokenizer must be the dataset's -------------------------------------------------------------


def test_a_run_tokenizer_that_differs_from_the_datasets_is_refused(run, smollm2_dir, tmp_path):
    """One added token is enough: before, this trained (exit 0) and exported the wrong tokenizer."""
    from transformers import AutoTokenizer

    other = tmp_path / "tokenizer-plus-one"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.add_tokens(["<an-added-token>"])
    tokenizer.save_pretrained(other)
    out = tmp_path / "fresh"
    proc = _train(run / "c.yaml", "--set", f"model.tokenizer={other}", "--set", f"train.output_dir={out}", code=2)
    assert "the run's tokenizer is not the one its data was built with" in proc.stderr
    assert "differing parts:" in proc.stderr and "added_tokens" in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "final").exists()


def test_a_model_that_cannot_embed_every_token_id_is_refused(run, tmp_path):
    small = {**MODEL, "vocab_size": 1000}
    out = tmp_path / "fresh"
    proc = _train(
        run / "c.yaml", "--set", f"model.init={{config: {small}, seed: 0}}", "--set", f"train.output_dir={out}", code=2
    )
    assert "but the model embeds only 1000 ids" in proc.stderr and "Traceback" not in proc.stderr


def test_the_manifest_records_the_largest_token_id(sample_dataset):
    import numpy as np

    from dpo_data import PairStore, read_manifest

    store = PairStore([sample_dataset])
    largest = max(
        int(max(p.prompt.max(), p.chosen.max(), p.rejected.max())) for p in map(store.pair, range(store.num_pairs))
    )
    assert read_manifest(sample_dataset)["totals"]["max_token_id"] == largest == store.max_token_id
    assert np.int64(largest) < 49152


# -- config files cannot hang or fool the trainer ---------------------------------------------------------


def _config_error(text_or_dict, *overrides, match):
    from dpo_train.config import load_config
    from dpo_train.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config(text_or_dict, list(overrides))


@pytest.mark.parametrize(
    "text, match",
    [
        ("model:\n  init:\n    config: &a [1, 1]\n    seed: *a\n", r"line 3: the anchor &a is not allowed"),
        ("data: {path: x}\noptim: {lr: 1.0e-5}\noptim: {lr: 2.0e-5}\n", r"line 3: the key 'optim' appears twice"),
        ("optim: {lr: 1.0e-5, lr: 2.0e-5}\n", r"the key 'lr' appears twice"),
        ("model: {init: {config: {}, sed: 0}}\n", r"model/init: Additional properties are not allowed \('sed'"),
        ("format_version: 2\n", r"format_version is 2; this dpo-train reads config format_version 1"),
    ],
)
def test_a_config_that_could_hang_or_fool_the_trainer_is_refused(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    _config_error(path, match=match)


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("model:\n  init:\n    config:\n" + "".join(f"      {line}\n" for line in levels))
    _config_error(path, match="anchor &a0 is not allowed")


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lr=.inf", "optim.lr"),
        ("optim.lr=.nan", "optim.lr"),
        ("loss.beta=.inf", "loss.beta"),
        ("optim.max_grad_norm=.nan", "optim.max_grad_norm"),
        ("optim.weight_decay=.nan", "optim.weight_decay"),
        ("optim.betas=[.nan, 0.9]", r"optim.betas\[0\]"),
    ],
)
def test_a_non_finite_number_is_refused_naming_its_key(override, key):
    _config_error({"data": {"path": "x"}}, override, match=rf"^{key}: not a finite number")


def test_bad_config_files_and_overrides_are_named_errors_not_tracebacks(tmp_path):
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    _config_error(tmp_path / "binary.yaml", match="is not UTF-8 text")
    (tmp_path / "nul.yaml").write_bytes(b"optim: {lr: 1}\x00\n")
    _config_error(tmp_path / "nul.yaml", match="holds NUL bytes")
    _config_error(tmp_path, match="is a directory; pass a YAML file")
    _config_error({"data": {"path": "x"}}, "optim.lr=[1,", match=r"--set 'optim.lr=\[1,': the value is not valid YAML")
    proc = _train(tmp_path / "binary.yaml", code=2)
    assert "error: config file" in proc.stderr and "Traceback" not in proc.stderr


# -- a run that goes non-finite stops, loudly ---------------------------------------------------------------


def test_a_run_that_goes_non_finite_stops_before_the_optimizer_step(run, tmp_path):
    """lr 100 with weight decay 10 is in range; the first updates blow the weights up. Before, this exited 0
    with `loss: null` in metrics.jsonl and an all-NaN model in final/."""
    out = tmp_path / "blowup"
    proc = _train(
        run / "c.yaml",
        "--set",
        "optim.lr=100",
        "--set",
        "optim.weight_decay=10",
        "--set",
        f"train.output_dir={out}",
        code=1,
    )
    assert re.search(r"step (\d+): .*not finite on rank\(s\) 0 .*sources ", proc.stderr), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (out / "final").exists()
    failed = int(re.search(r"step (\d+): ", proc.stderr).group(1))
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints[-1] == f"step-{failed:06d}"  # the last good state: after step failed - 1, nothing later
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(failed))


def test_skip_step_logs_and_counts_a_non_finite_step_and_leaves_the_optimizer_alone(run, tmp_path):
    out = tmp_path / "skips"
    _train(
        run / "c.yaml",
        "--set",
        "optim.lr=100",
        "--set",
        "optim.weight_decay=10",
        "--set",
        "train.on_nonfinite=skip_step",
        "--set",
        f"train.output_dir={out}",
        "--set",
        "train.save_every=0",
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if r.get("skipped")]
    assert skipped and records[-1]["skipped_steps"] == len(skipped) and skipped[0]["nonfinite_ranks"] == [0]
    assert all(r["lr"] == records[0]["lr"] for r in records)  # constant schedule; nothing else moved it


# -- any loader's micro-batches are checked ------------------------------------------------------------------


def _good_batch():
    import numpy as np

    from dpo_data import pack_microbatch
    from dpo_data.dataset.store import PairIds

    ids = lambda xs: np.array(xs, dtype=np.int32)
    pairs = [PairIds(0, 0, ids([1, 2, 3]), ids([4, 5]), ids([6])), PairIds(1, 0, ids([8]), ids([9]), ids([10, 11]))]
    batch = pack_microbatch(pairs, pad_to_multiple_of=8)
    batch.update(step_pairs=2, microbatch=0, microbatches_in_step=1)
    return batch


def _break(kind):
    batch = _good_batch()
    if kind == "lengths":
        batch["segment_length"][0] += 1
    elif kind == "cu_seqlens":
        batch["cu_seqlens"][1] += 1
    elif kind == "two_chosen":
        batch["segment_role"][1] = 0
    elif kind == "padding_in_a_pair":
        batch["segment_pair"][-1] = 0
    elif kind == "label_on_padding":
        batch["labels"][0, -1] = 7
    elif kind == "label_across_a_boundary":
        batch["labels"][0, int(batch["cu_seqlens"][1]) - 1] = 7
    elif kind == "positions":
        batch["position_ids"][0, int(batch["cu_seqlens"][1])] = 5
    elif kind == "step_pairs":
        batch["step_pairs"] = 1
    elif kind == "pair_fields":
        batch["pair_index"] = batch["pair_index"][:1]
    return batch


KINDS = {
    "lengths": "segment lengths add up to",
    "cu_seqlens": "cu_seqlens does not match",
    "two_chosen": "have 2 chosen segments",
    "padding_in_a_pair": "padding is never part of a pair",
    "label_on_padding": "outside completion segments",
    "label_across_a_boundary": "nothing may predict across a segment boundary",
    "positions": "position_ids do not restart",
    "step_pairs": "step_pairs is 1",
    "pair_fields": "pair_index has 1 entries, num_pairs is 2",
}


def test_a_well_formed_micro_batch_passes_the_contract_check():
    from dpo_data import contract_problems

    assert contract_problems(_good_batch()) == []


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_of_malformed_micro_batch_is_named(kind):
    from dpo_data import contract_problems

    problems = contract_problems(_break(kind))
    assert any(KINDS[kind] in p for p in problems), problems


def test_the_trainer_refuses_a_malformed_micro_batch_before_its_forward(sample_dataset):
    from dpo_data import PairStore
    from dpo_data.errors import DataError
    from dpo_train.config import load_config
    from dpo_train.parallel.device import placement
    from dpo_train.trainer import Trainer

    config = load_config(
        {
            "model": {"init": {"config": MODEL, "seed": 0}},
            "data": {"path": str(sample_dataset)},
            "optim": {"name": "sgd", "lr": 1.0},
            "distributed": {"device": "cpu"},
        }
    )
    trainer = Trainer(config, placement("cpu", "fp32"), 0, 1, PairStore([sample_dataset]))
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    with pytest.raises(
        DataError, match=r"(?s)micro-batch 0 of step 0 on rank 0 breaks the micro-batch contract.*2 chosen"
    ):
        trainer.microbatch(_break("two_chosen"))
    assert all(p.grad is None for p in trainer.policy.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


# -- the trainer reads only verified data --------------------------------------------------------------------


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


def _config_for(run, dataset, tmp_path, **data):
    config = yaml.safe_load((run / "c.yaml").read_text())
    config["data"] = {**config["data"], "path": str(dataset), **data}
    config["train"] = {**config["train"], "output_dir": str(tmp_path / "out"), "save_every": 0, "max_steps": 1}
    path = tmp_path / "data.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _flip(path, offset, mask=0x01):
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_shard_is_refused_before_the_first_step(run, dataset_copy, tmp_path):
    """Before, the run trained silently on the altered token."""
    shard = dataset_copy / "shards" / "shard-00000.arrow"
    _flip(shard, shard.stat().st_size // 2)
    proc = _train(_config_for(run, dataset_copy, tmp_path), code=2)
    assert "the data does not match its manifests" in proc.stderr
    assert "shards/shard-00000.arrow: sha256 differs from its manifest" in proc.stderr
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


def test_a_token_id_out_of_range_is_a_named_error_even_when_only_sizes_are_verified(run, dataset_copy, tmp_path):
    """Before: an IndexError at step 0 that named no dataset."""
    from dpo_data import LoaderConfig, PairStore, plan_document

    config_path = _config_for(run, dataset_copy, tmp_path, verify="size")
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
    proc = _train(config_path, code=2)
    assert "outside the model's 49152 embedding rows" in proc.stderr and shard_path in proc.stderr
    assert "IndexError" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_flipped_footer_byte_is_named_by_verify_not_a_traceback(dataset_copy, run_cli):
    from dpo_cli.data import main as dpo_data

    shard = dataset_copy / "shards" / "shard-00000.arrow"
    _flip(shard, shard.stat().st_size - 3)
    r = run_cli(dpo_data, "verify", dataset_copy)
    assert r.exit_code == 1 and "shard-00000.arrow: not a readable Arrow IPC file" in r.output


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda m: m["totals"].update(pairs=m["totals"]["pairs"] + 1), "shards hold 342 rows, totals.pairs is 343"),
        (lambda m: m.update(fingerprint="sha256:" + "0" * 64), "does not match its content"),
        (lambda m: m["tokenizer"]["components"].update(chat_template="0" * 64), "not the digest of the recorded"),
    ],
)
def test_an_edited_manifest_is_refused_by_every_reader(run, dataset_copy, tmp_path, run_cli, edit, named):
    from dpo_cli.data import main as dpo_data

    _edit_manifest(dataset_copy, edit)
    for command in (["plan", dataset_copy, "--batching", "pairs", "--world-size", "1"], ["inspect", dataset_copy]):
        r = run_cli(dpo_data, *command)
        assert r.exit_code == 2 and named in r.output and "contradicts itself" in r.output
    r = run_cli(dpo_data, "verify", dataset_copy)
    assert r.exit_code == 1 and named in r.output
    proc = _train(_config_for(run, dataset_copy, tmp_path), code=2)
    assert named in proc.stderr and "Traceback" not in proc.stderr


def test_verify_recomputes_what_the_manifest_states_about_the_data(dataset_copy, run_cli):
    from dpo_cli.data import main as dpo_data

    _edit_manifest(dataset_copy, lambda m: m["lengths"]["chosen"].update(max=m["lengths"]["chosen"]["max"] + 1))
    _edit_manifest(dataset_copy, lambda m: m["totals"].update(max_token_id=m["totals"]["max_token_id"] - 1))
    r = run_cli(dpo_data, "verify", dataset_copy)
    assert r.exit_code == 1 and "lengths.chosen: manifest says" in r.output
    assert "totals.max_token_id: manifest says" in r.output


def test_verify_lists_unnamed_files_and_fails_on_them_with_strict(dataset_copy, run_cli):
    from click.testing import CliRunner

    from dpo_cli.data import main as dpo_data

    (dataset_copy / "shards" / "stray.arrow").write_bytes(b"x")
    r = CliRunner().invoke(dpo_data, ["verify", str(dataset_copy)])
    assert r.exit_code == 0 and "note: shards/stray.arrow is in" in r.output
    r = run_cli(dpo_data, "verify", dataset_copy, "--strict")
    assert r.exit_code == 1 and "shards/stray.arrow: in the dataset directory but not named" in r.output


def test_verify_rehashes_raw_inputs(dataset_copy, tmp_path, run_cli):
    from dpo_cli.data import main as dpo_data
    from tests.conftest import SAMPLE

    original = SAMPLE / "arith_chat.jsonl"
    assert run_cli(dpo_data, "verify", dataset_copy, "--inputs", original).exit_code == 0
    changed = tmp_path / "arith_chat.jsonl"
    changed.write_bytes(original.read_bytes() + b"\n")
    r = run_cli(dpo_data, "verify", dataset_copy, "--inputs", changed)
    assert r.exit_code == 1 and f"input {changed}: " in r.output and "truncated or appended to" in r.output


# -- building into a directory never loses or mixes data ----------------------------------------------------


def _build_args(smollm2_dir, out, *inputs, extra=()):
    return [
        sys.executable,
        "-m",
        "dpo_cli.data",
        "build",
        *map(str, inputs),
        "--tokenizer",
        str(smollm2_dir),
        "--out",
        str(out),
        *extra,
    ]


def _fingerprint(out):
    return json.loads((out / "manifest.json").read_text())["fingerprint"]


def _verify(out):
    return subprocess.run([sys.executable, "-m", "dpo_cli.data", "verify", str(out)], capture_output=True, text=True)


def test_concurrent_builds_into_one_out_never_mix_and_the_loser_is_named(smollm2_dir, tmp_path):
    """Before: both shared OUT.incomplete; the winner could commit one input's manifest over the other's shards."""
    from tests.conftest import SAMPLE

    out = tmp_path / "ds"
    a, b = SAMPLE / "arith_chat.jsonl", SAMPLE / "facts_text.json"
    for _ in range(3):
        procs = [
            subprocess.Popen(
                _build_args(smollm2_dir, out, src, extra=["--overwrite"]),
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
        assert _verify(out).returncode == 0
        assert not list(tmp_path.glob("ds.incomplete*"))


def test_overwrite_replaces_only_a_dataset(smollm2_dir, tmp_path):
    from tests.conftest import SAMPLE

    notes = tmp_path / "mine"
    notes.mkdir()
    (notes / "notes.txt").write_text("keep me")
    proc = subprocess.run(
        _build_args(smollm2_dir, notes, SAMPLE / "arith_chat.jsonl", extra=["--overwrite"]),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "is not a dataset" in proc.stderr and "notes.txt" in proc.stderr
    assert (notes / "notes.txt").read_text() == "keep me"
    inside = notes / "rows.jsonl"
    shutil.copy(SAMPLE / "arith_chat.jsonl", inside)
    proc = subprocess.run(
        _build_args(smollm2_dir, notes, inside, extra=["--overwrite"]), capture_output=True, text=True
    )
    assert proc.returncode == 2 and "lies inside --out" in proc.stderr and inside.exists()


@pytest.mark.parametrize("point", ["before-swap", "after-swap", "after-delete"])
def test_a_build_killed_at_any_point_of_its_commit_leaves_the_old_or_the_new_dataset(smollm2_dir, tmp_path, point):
    import os

    from tests.conftest import SAMPLE

    out = tmp_path / "ds"
    assert (
        subprocess.run(_build_args(smollm2_dir, out, SAMPLE / "arith_chat.jsonl"), capture_output=True).returncode == 0
    )
    old = _fingerprint(out)
    args = _build_args(smollm2_dir, out, SAMPLE / "facts_text.json", extra=["--overwrite"])
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "DPO_DATA_KILL": point})
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert _verify(out).returncode == 0
    now = _fingerprint(out)
    assert now == old if point == "before-swap" else now != old  # the old dataset, or the whole new one


def test_small_build_hazards_are_handled(smollm2_dir, tmp_path):
    from tests.conftest import SAMPLE

    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (SAMPLE / "arith_chat.jsonl").read_bytes())
    out = tmp_path / "bom-ds"
    assert subprocess.run(_build_args(smollm2_dir, out, bom), capture_output=True).returncode == 0
    assert json.loads((out / "manifest.json").read_text())["totals"]["rejected"] == 0  # the BOM is not a reject

    twice = subprocess.run(_build_args(smollm2_dir, tmp_path / "t", bom, bom), capture_output=True, text=True)
    assert twice.returncode == 2 and "given twice" in twice.stderr

    cut = tmp_path / "cut.jsonl"
    cut.write_bytes((SAMPLE / "arith_chat.jsonl").read_bytes()[:-30])
    broken = subprocess.run(_build_args(smollm2_dir, tmp_path / "c", cut), capture_output=True, text=True)
    assert broken.returncode == 2 and "truncated" in broken.stderr and not list(tmp_path.glob("c.incomplete*"))

    (tmp_path / "a-file").write_text("")
    unwritable = subprocess.run(
        _build_args(smollm2_dir, tmp_path / "a-file" / "ds", bom), capture_output=True, text=True
    )
    assert unwritable.returncode == 2 and "error: " in unwritable.stderr and "Traceback" not in unwritable.stderr


# -- one checkpoint verdict, on one lineage -------------------------------------------------------------------


def _rewrite_state(step, edit):
    path = step / "state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    write_commit(step, state["step"])


def test_resuming_an_older_step_moves_the_later_ones_aside_and_keeps_one_lineage(run):
    """Before: save() deleted the committed step directory of the abandoned branch, or auto-resume later
    picked the abandoned branch's newest checkpoint."""
    first, second = _step(run, 1), _step(run, 2)
    proc = _train(run / "c.yaml", "--set", f"train.resume={first}", "--set", "train.max_steps=2")
    assert "the later checkpoints step-000002 are moved aside to" in proc.stderr
    (aside,) = (run / "run" / "checkpoints" / "abandoned").iterdir()
    assert (aside / "step-000002" / "commit.json").is_file() and _state("verify", aside / "step-000002").returncode == 0
    assert _state("verify", second).returncode == 0  # the new branch's own step 2
    auto = _train(run / "c.yaml")  # max_steps 3: continues the new branch
    assert f"resumed from {second}" in auto.stderr


def test_a_rank_file_outside_the_checkpoint_is_refused_everywhere(run):
    step = _step(run, 2)
    _rewrite_state(step, lambda s: s["ranks"][0].update(state="../../outside.json"))
    for command in ("verify", "inspect"):
        proc = _state(command, step)
        assert proc.returncode in (1, 2) and "'../../outside.json'" in proc.stderr and "Traceback" not in proc.stderr
    proc = _train(run / "c.yaml", "--set", f"train.resume={step}", code=2)
    assert "'../../outside.json'" in proc.stderr


def test_diff_of_a_checkpoint_whose_commit_record_does_not_parse_is_an_error(run):
    """Before: `dpo-state diff` said "equal" (exit 0)."""
    (_step(run, 2) / "commit.json").write_text("{not json")
    proc = _state("diff", _step(run, 2), _step(run, 2))
    assert proc.returncode == 2 and "does not verify" in proc.stderr and "not valid JSON" in proc.stderr


def test_verify_fails_a_commit_record_of_another_step(run):
    step = _step(run, 2)
    write_commit(step, 7)
    proc = _state("verify", step)
    assert proc.returncode == 1 and "commit.json is for step 7, state.json for step 2" in proc.stderr


def test_each_rank_position_is_recorded_and_cross_checked(run):
    step = _step(run, 2)
    state = json.loads((step / "state.json").read_text())
    assert state["ranks"][0]["position"] == {"epoch": 0, "step": 2, "microbatch": 0}
    rank_file = step / "rank-00000.json"
    document = json.loads(rank_file.read_text())
    document["loader"]["position"]["step"] = 1
    rank_file.write_text(json.dumps(document))
    write_commit(step, 2)
    proc = _state("verify", step)
    assert proc.returncode == 1 and "rank-00000.json: loader position" in proc.stderr
    proc = _train(run / "c.yaml", "--set", f"train.resume={step}", code=2)
    assert "differs from the one state.json records for rank 0" in proc.stderr


# -- every persisted document has a schema and a version -------------------------------------------------------


def test_logs_and_rank_files_match_their_schemas_and_resume_reads_them_back(run):
    from dpo_state.schema import schema_problems
    from dpo_state.state import read_rank_state

    records = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records and all(schema_problems("metrics-record", r) == [] for r in records)
    rank = read_rank_state(_step(run, 2) / "rank-00000.json")
    assert rank["format_version"] == 1 and rank["loader"]["format_version"] == 2
    log = run / "run" / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": 9, "lo')  # a crash in the middle of a write
    assert _train(run / "c.yaml").returncode == 0  # the torn line is dropped with the steps after step 2
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == [0, 1, 2]
    lines = log.read_text().splitlines()
    log.write_text("\n".join([lines[0], "not json", *lines[1:]]) + "\n")
    proc = _train(run / "c.yaml", "--set", "train.max_steps=4", code=2)
    assert "metrics.jsonl line 2 is not JSON" in proc.stderr


def test_a_loader_state_that_breaks_its_schema_is_refused(sample_dataset):
    from dpo_data import DataError, DPOLoader, LoaderConfig

    loader = DPOLoader([sample_dataset], LoaderConfig())
    state = loader.state_dict()
    state["position"] = "somewhere"
    with pytest.raises(DataError, match="does not match schemas/loader-state.schema.json"):
        DPOLoader([sample_dataset], LoaderConfig()).load_state_dict(state)
    state["format_version"] = 1
    with pytest.raises(DataError, match="loader state format_version 1; this dpo-data reads format_version 2"):
        DPOLoader([sample_dataset], LoaderConfig()).load_state_dict(state)


def test_a_config_format_version_is_checked_not_dropped():
    _config_error({"format_version": 7, "data": {"path": "x"}}, match="format_version is 7")
