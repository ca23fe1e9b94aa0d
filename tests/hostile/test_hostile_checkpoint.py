"""Hostile checkpoints and exports: pickled payloads never run; tampered rank files, commit records, lineage, logs,
export records and linked export files are refused."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest

from dpo_state.commit import write_commit
from dpo_state.export_record import write_export_record
from tests.harness import invoke, state_here, tiny_config, train_here, write_yaml


class _CreatesFile:
    """Unpickled by a general unpickler, this opens `path` for writing: the file appears."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def trained(sample_dataset, smollm2_dir, tmp_path_factory):
    """A run with committed checkpoints at steps 1 and 2 and its export (final/), and its config. Trained
    in-process, as are the runs of the tests below: what they check is what a run reads, says and leaves on disk,
    the same in a process of its own (no test here is about a process, a signal or the installed command)."""
    tmp = tmp_path_factory.mktemp("hostile")
    config = tiny_config(sample_dataset, smollm2_dir, tmp / "run", max_steps=2, save_every=1)
    train_here(invoke, write_yaml(tmp / "c.yaml", config))
    return tmp, config


@pytest.fixture
def run(trained, tmp_path):
    """A private copy of the trained run, its config pointing at the copy."""
    source, config = trained
    shutil.copytree(source / "run", tmp_path / "run")
    config = {**config, "train": {**config["train"], "output_dir": str(tmp_path / "run"), "max_steps": 3}}
    write_yaml(tmp_path / "c.yaml", config)
    return tmp_path


def _step(run, k):
    return run / "run" / "checkpoints" / f"step-{k:06d}"


def _every_reader_refuses(run_cli, run, step, marker, named):
    """verify, diff --values, resume (auto, strict, PATH) and weights_from refuse by name; no file appears. All
    in-process (the same code path, seconds cheaper): a payload that ran would create the marker from here too."""
    proc = state_here(run_cli, "verify", step, code=1)
    assert named in proc.stderr
    proc = state_here(run_cli, "diff", _step(run, 1), step, "--values", code=2)
    assert named in proc.stderr and "Traceback" not in proc.stderr
    strict = train_here(run_cli, run / "c.yaml", "--set", "train.resume_strict=true", code=2)
    assert named in strict.stderr and "Traceback" not in strict.stderr
    by_path = train_here(run_cli, run / "c.yaml", "--set", f"train.resume={step}", code=2)
    assert named in by_path.stderr
    elsewhere = ("--set", f"train.output_dir={run / 'new'}", "--set", f"train.weights_from={step}")
    fresh = train_here(run_cli, run / "c.yaml", *elsewhere, code=2)
    assert named in fresh.stderr
    auto = train_here(run_cli, run / "c.yaml")  # skips the hostile checkpoint, naming it, and resumes from step 1
    assert f"skipping checkpoint {step}" in auto.stderr and named in auto.stderr
    assert "resumed from" in auto.stderr and "step-000001" in auto.stderr
    assert not marker.exists()


# -- no general unpickler ever runs on a checkpoint file ------------------------------------------------------


def test_a_pickle_payload_in_the_dcp_metadata_is_refused_before_anything_is_built(run, tmp_path, run_cli):
    marker = tmp_path / "payload-ran"
    step = _step(run, 2)
    (step / "dcp" / ".metadata").write_bytes(pickle.dumps({"x": _CreatesFile(marker)}))
    write_commit(step, 2)  # whoever can write the checkpoint can also write its hashes
    _every_reader_refuses(run_cli, run, step, marker, f"names {open.__module__}.open")  # _io.open from Python 3.12


def test_a_pickled_item_indexed_by_valid_metadata_is_refused(run, tmp_path, run_cli):
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
    _every_reader_refuses(run_cli, run, step, marker, "non-tensor item")


def test_a_pickle_payload_in_the_tensor_data_is_never_executed(run, tmp_path, run_cli):
    """Tensor bytes are read by torch's weights-only unpickler: the payload fails to load, named."""
    marker = tmp_path / "payload-ran"
    step = _step(run, 2)
    for data in (step / "dcp").glob("*.distcp"):
        data.write_bytes(pickle.dumps(_CreatesFile(marker)) * 64)
    write_commit(step, 2)
    by_path = train_here(run_cli, run / "c.yaml", "--set", f"train.resume={step}", code=2)
    assert "could not read its tensors" in by_path.stderr and "Traceback" not in by_path.stderr
    proc = state_here(run_cli, "diff", _step(run, 1), step, "--values", code=2)
    assert "could not read its tensors" in proc.stderr
    assert not marker.exists()


class _ByName(pickle.Pickler):
    """Pickles an enum's member as `getattr(its class, its name)`, as Python 3.11.2 does; `extra` maps an object
    to another getattr call of the same form, as a hostile file could write."""

    def __init__(self, file, extra=None):
        super().__init__(file)
        self.extra = extra or {}

    def reducer_override(self, obj):
        import enum

        if id(obj) in self.extra:
            return getattr, self.extra[id(obj)]
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _repickled(metadata, extra=None) -> bytes:
    import io

    buffer = io.BytesIO()
    _ByName(buffer, extra).dump(metadata)
    return buffer.getvalue()


def _resumes_from(run, run_cli, step, written: bytes, original) -> None:
    """`written` as step's DCP metadata (its hashes rewritten): it reads back as `original`, verifies, and the run
    resumes from it."""
    from dpo_state.dcp_io import read_dcp_metadata

    (step / "dcp" / ".metadata").write_bytes(written)
    write_commit(step, 2)
    assert read_dcp_metadata(step / "dcp") == original
    state_here(run_cli, "verify", step)
    resumed = train_here(run_cli, run / "c.yaml")
    assert "resumed from" in resumed.stderr and "step-000002" in resumed.stderr, resumed.stderr


def test_metadata_written_by_python_3_11_2_is_read_and_resumed(run, run_cli):
    """Python 3.11.2 pickles DCP's `_MEM_FORMAT_ENCODING` members as `getattr(class, name)`. Before: every
    checkpoint it wrote failed `verify` as replaced, and `train.resume: auto` skipped them all and trained
    again from step 0 (found by scripts/device_run.sh on Debian's Python 3.11.2)."""
    from dpo_state.dcp_io import read_dcp_metadata

    step = _step(run, 2)
    original = read_dcp_metadata(step / "dcp")
    written = _repickled(original)
    assert b"getattr" in written
    _resumes_from(run, run_cli, step, written, original)


def test_metadata_written_by_python_3_13_is_read_and_resumed(run, run_cli):
    """Python 3.13 pickles the checkpoint id's path as `pathlib._local.PosixPath`. Before: every checkpoint it
    wrote failed `verify` as replaced and `train.resume: auto` trained again from step 0 (found by the suite on
    Python 3.13 at stop 50). Any Python reads either name."""
    import re

    from dpo_state.dcp_io import read_dcp_metadata

    step = _step(run, 2)
    original = read_dcp_metadata(step / "dcp")
    written, count = re.subn(
        rb"cpathlib(\._local)?\nPosixPath\n", b"cpathlib._local\nPosixPath\n", pickle.dumps(original, protocol=2)
    )
    assert count >= 1
    _resumes_from(run, run_cli, step, written, original)


def test_getattr_in_the_metadata_reaches_an_enums_members_only(run, tmp_path, run_cli):
    """The getattr a pickle may name is held to an enum member of an allowed class: the same call on another
    attribute, another class or an object is refused by name, before it is made."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    from dpo_state.dcp_io import read_dcp_metadata
    from dpo_state.errors import StateError

    step, source = _step(run, 2), read_dcp_metadata(_step(run, 1) / "dcp")
    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT  # in every tensor's properties: its uses are replaced
    for reached, named in (
        ((_MEM_FORMAT_ENCODING, "__class__"), "_MEM_FORMAT_ENCODING.__class__"),
        ((Metadata, "__init__"), "Metadata.__init__"),
        ((source, "storage_data"), "Metadata.storage_data"),
    ):
        (step / "dcp" / ".metadata").write_bytes(_repickled(source, {id(member): reached}))
        with pytest.raises(StateError, match=f"asks builtins.getattr for {named}"):
            read_dcp_metadata(step / "dcp")
    write_commit(step, 2)
    _every_reader_refuses(run_cli, run, step, tmp_path / "never", "asks builtins.getattr for Metadata.storage_data")


def test_a_checkpoint_holds_tensors_only_and_its_hyperparameters_as_json(run):
    from dpo_state.dcp_io import read_dcp_metadata
    from dpo_state.state import read_state_tree

    step = _step(run, 2)
    read_dcp_metadata(step / "dcp")  # raises on any non-tensor item
    tree = read_state_tree(step)
    group = tree["optim"]["param_groups"][0]
    assert group["lr"] == 1.0e-3 and group["betas"] == [0.9, 0.999] and group["params"]
    assert all(leaf == {"$tensor": True} for leaf in tree["model"].values())


# -- one checkpoint verdict, on one lineage -------------------------------------------------------------------


def _rewrite_state(step, edit):
    path = step / "state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    write_commit(step, state["step"])


def test_resuming_an_older_step_moves_the_later_ones_aside_and_keeps_one_lineage(run, run_cli):
    """Before: save() deleted the committed step directory of the abandoned branch, or auto-resume later
    picked the abandoned branch's newest checkpoint."""
    first, second = _step(run, 1), _step(run, 2)
    proc = train_here(run_cli, run / "c.yaml", "--set", f"train.resume={first}", "--set", "train.max_steps=2")
    assert "the later checkpoints step-000002 are moved aside to" in proc.stderr
    (aside,) = (run / "run" / "checkpoints" / "abandoned").iterdir()
    assert (aside / "step-000002" / "commit.json").is_file()
    state_here(run_cli, "verify", aside / "step-000002")
    state_here(run_cli, "verify", second)  # the new branch's own step 2
    auto = train_here(run_cli, run / "c.yaml")  # max_steps 3: continues the new branch
    assert f"resumed from {second}" in auto.stderr


def test_a_rank_file_outside_the_checkpoint_is_refused_everywhere(run, run_cli):
    step = _step(run, 2)
    _rewrite_state(step, lambda s: s["ranks"][0].update(state="../../outside.json"))
    for command in ("verify", "inspect"):
        proc = state_here(run_cli, command, step, code=None)
        assert proc.exit_code in (1, 2) and "'../../outside.json'" in proc.stderr and "Traceback" not in proc.stderr
    proc = train_here(run_cli, run / "c.yaml", "--set", f"train.resume={step}", code=2)
    assert "'../../outside.json'" in proc.stderr


@pytest.mark.parametrize(
    ("name", "release"), [("torch", "\x1b[2J2.13.0"), ("torch", "2" * 129), ("a library\x1b[2J", "1.0")]
)
def test_a_release_record_a_terminal_would_run_is_refused(run, run_cli, name, release):
    """`inspect` prints the releases a checkpoint records: one that is not a version (an escape sequence, a
    screenful) is refused by the schema before anything prints it, as every reader refuses a malformed state."""
    step = _step(run, 2)
    _rewrite_state(step, lambda s: s["environment"].update({name: release}))
    for command in ("verify", "inspect"):
        proc = state_here(run_cli, command, step, code=None)
        assert proc.exit_code in (1, 2) and "environment" in proc.stderr and "\x1b" not in proc.stdout
    proc = train_here(run_cli, run / "c.yaml", "--set", f"train.resume={step}", code=2)
    assert "checkpoint-state.schema.json" in proc.stderr and "environment" in proc.stderr
    assert "\x1b" not in proc.stderr  # named by its repr, never sent to the terminal as is


def test_diff_of_a_checkpoint_whose_commit_record_does_not_parse_is_an_error(run, run_cli):
    """Before: `dpo-state diff` said "equal" (exit 0)."""
    (_step(run, 2) / "commit.json").write_text("{not json")
    proc = state_here(run_cli, "diff", _step(run, 2), _step(run, 2), code=2)
    assert "does not verify" in proc.stderr and "not valid JSON" in proc.stderr


def test_verify_fails_a_commit_record_of_another_step(run, run_cli):
    step = _step(run, 2)
    write_commit(step, 7)
    proc = state_here(run_cli, "verify", step, code=1)
    assert "commit.json is for step 7, state.json for step 2" in proc.stderr


def test_each_rank_position_is_recorded_and_cross_checked(run, run_cli):
    step = _step(run, 2)
    state = json.loads((step / "state.json").read_text())
    assert state["ranks"][0]["position"] == {"epoch": 0, "step": 2, "microbatch": 0}
    rank_file = step / "rank-00000.json"
    document = json.loads(rank_file.read_text())
    document["loader"]["position"]["step"] = 1
    rank_file.write_text(json.dumps(document))
    write_commit(step, 2)
    proc = state_here(run_cli, "verify", step, code=1)
    assert "rank-00000.json: loader position" in proc.stderr
    proc = train_here(run_cli, run / "c.yaml", "--set", f"train.resume={step}", code=2)
    assert "differs from the one state.json records for rank 0" in proc.stderr


# -- every persisted document has a schema and a version -------------------------------------------------------


def test_logs_and_rank_files_match_their_schemas_and_resume_reads_them_back(run, run_cli):
    from dpo_state.schema import schema_problems
    from dpo_state.state import read_rank_state

    records = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records and all(schema_problems("metrics-record", r) == [] for r in records)
    rank = read_rank_state(_step(run, 2) / "rank-00000.json")
    assert rank["format_version"] == 1 and rank["loader"]["format_version"] == 2
    log = run / "run" / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": 9, "lo')  # a crash in the middle of a write
    train_here(run_cli, run / "c.yaml")  # the torn line is dropped with the steps after step 2
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == [0, 1, 2]
    lines = log.read_text().splitlines()
    log.write_text("\n".join([lines[0], "not json", *lines[1:]]) + "\n")
    proc = train_here(run_cli, run / "c.yaml", "--set", "train.max_steps=4", code=2)
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


# -- an export (final/) against its export.json, its model card and its run -------------------------------------


def _edit_record(final, **fields):
    path = final / "export.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_an_export_without_its_record_is_named_as_one(run, run_cli):
    """Before: "holds no committed checkpoint (looked in .../final/checkpoints)"."""
    final = run / "run" / "final"
    (final / "export.json").unlink()
    proc = state_here(run_cli, "verify", final, code=1)
    assert f"{final} is an export (it holds config.json, model.safetensors, tokenizer.json" in proc.stderr
    assert "without its export.json, the record its files are checked against" in proc.stderr
    assert "checkpoint" not in proc.stderr


@pytest.mark.parametrize("field, value", [("step", 7), ("run_id", "another-run")])
def test_an_edited_step_or_run_id_of_an_export_record_fails_verify(field, value, run, run_cli):
    """Before: verify passed; the model card (hashed in the record) says both."""
    final = run / "run" / "final"
    _edit_record(final, **{field: value})
    proc = state_here(run_cli, "verify", final, code=1)
    assert f"export.json: {field} is {value!r}, but README.md says" in proc.stderr
    assert "(edited or corrupted)" in proc.stderr


def test_a_forged_run_id_is_caught_by_the_run_s_checkpoints_but_not_in_a_copy(run, tmp_path, run_cli):
    """Card and record rewritten together, hashes and all: the run directory's checkpoints still name the run. A copy
    away from them verifies, as docs/checkpoints.md says: the record protects against corruption, not an editor."""
    final = run / "run" / "final"
    record = json.loads((final / "export.json").read_text())
    card = final / "README.md"
    card.write_text(card.read_text().replace(f"| run id | {record['run_id']} |", "| run id | forged |"))
    write_export_record(final, record["step"], "forged")
    proc = state_here(run_cli, "verify", final, code=1)
    assert f"export.json: run_id is 'forged', but the checkpoints of {run / 'run'} are of run {record['run_id']}" in (
        proc.stderr
    )
    state_here(run_cli, "verify", shutil.copytree(final, tmp_path / "copy"))


def test_a_file_of_an_export_replaced_by_a_link_is_refused_by_name(run, tmp_path, run_cli):
    """Before: a link to an identical file outside final/ verified (and would have been pushed)."""
    final = run / "run" / "final"
    outside = shutil.copy(final / "config.json", tmp_path / "config.json")
    (final / "config.json").unlink()
    (final / "config.json").symlink_to(outside)
    proc = state_here(run_cli, "verify", final, code=1)
    assert f"config.json: a symbolic link (to {outside}), not a file of the export" in proc.stderr
