"""`dpo-state inspect / diff / verify` on a real checkpoint, and on broken or hostile ones: every failure named,
nothing executed, nothing partly loaded."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import yaml

from dpo_state.commit import write_commit
from tests.harness import invoke, state_cli, state_here, tiny_config, train_here, write_yaml


@pytest.fixture(scope="module")
def run_dir(sample_dataset, smollm2_dir, tmp_path_factory):
    """A 3-step run, checkpoints at every step, trained in-process (what is read is its files, not its process)."""
    tmp = tmp_path_factory.mktemp("state")
    config = tiny_config(sample_dataset, smollm2_dir, tmp / "run", max_steps=3, save_every=1)
    train_here(invoke, write_yaml(tmp / "c.yaml", config))
    return tmp / "run"


@pytest.fixture
def copy(run_dir, tmp_path):
    """A private copy of the latest checkpoint to break."""
    target = tmp_path / "step-000003"
    shutil.copytree(run_dir / "checkpoints" / "step-000003", target)
    return target


def test_inspect_reads_json_only_and_names_what_the_checkpoint_holds(run_dir, run_cli):
    """`inspect --json` as the installed command; the text form in-process (the same code path)."""
    info = json.loads(state_cli("inspect", run_dir, "--json").stdout)
    assert info["step"] == 3 and info["committed"] and info["consumed"]["pairs"] == 12
    assert info["tensors"]["model"]["count"] == 21 and info["tensors"]["optim"]["count"] == 63
    assert sorted(info["tensors"]) == ["model", "optim"]  # no reference group: it only moves under TR-DPO
    assert info["ranks"][0]["loader_position"] == {"epoch": 0, "step": 3, "microbatch": 0}
    assert info["lineage"]["parent"] == "step-000002"
    text = state_here(run_cli, "inspect", run_dir).stdout
    assert "step 3, epoch 0" in text and "AdamW, 21 parameters" in text and "tensors     optim: 63 tensors" in text


def test_verify_passes_a_sound_checkpoint(run_dir):
    assert state_cli("verify", run_dir).stdout.startswith("ok:")


def test_diff_exit_codes_and_values(run_dir, copy, run_cli):
    """The exit code of a difference (1) from the installed command; equal (0) and unreadable (2) in-process."""
    same = state_here(run_cli, "diff", run_dir, copy, "--values")
    assert "tensors: 0 of 84 differ" in same.stdout
    older = state_cli("diff", run_dir / "checkpoints" / "step-000002", run_dir, "--values", "--json", code=1)
    result = json.loads(older.stdout)
    assert not result["equal"]
    assert any(row["path"] == "step" for row in result["sections"]["positions"])
    assert result["tensors"]["differ"] > 0
    state_here(run_cli, "diff", run_dir, copy.parent / "nowhere", code=2)


def _corrupt(path, fn):
    data = bytearray(path.read_bytes())
    fn(data)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, expected",
    [
        (
            lambda c: _corrupt(next((c / "dcp").glob("*.distcp")), lambda d: d.__delitem__(slice(-100, None))),
            "bytes, the commit record says",
        ),
        (
            lambda c: _corrupt(next((c / "dcp").glob("*.distcp")), lambda d: d.__setitem__(500, d[500] ^ 1)),
            "sha256 differs from the commit record",
        ),
        (lambda c: (c / "rank-00000.json").unlink(), "rank-00000.json: missing"),
        (lambda c: (c / "dcp" / ".metadata").unlink(), "dcp/.metadata: missing"),
        (lambda c: (c / "commit.json").unlink(), "commit.json is missing"),
        (lambda c: (c / "extra.bin").write_bytes(b"x"), "extra.bin: present but not in the commit record"),
    ],
)
def test_verify_names_every_damage(copy, damage, expected, run_cli):
    damage(copy)
    proc = state_here(run_cli, "verify", copy, code=1)
    assert expected in proc.stderr, proc.stderr


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this would create the marker file
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("kind", ["pickle", "oversized", "malformed", "format_version"])
def test_hostile_state_files_are_named_and_never_executed(copy, tmp_path, kind, run_cli):
    """In-process: a payload that ran would create the marker from this process as from any other."""
    marker = tmp_path / "pwned"
    state = copy / "state.json"
    if kind == "pickle":
        state.write_bytes(pickle.dumps(_Payload(str(marker))))
    elif kind == "oversized":
        state.write_bytes(b'{"pad": "' + b"x" * (65 << 20) + b'"}')
    elif kind == "malformed":
        state.write_bytes(state.read_bytes()[:-40])
    else:
        document = json.loads(state.read_text())
        document["format_version"] = 99
        state.write_text(json.dumps(document))
    write_commit(copy, 3)  # even with a matching commit record, the content is refused
    expected = {
        "pickle": "is a pickle, not JSON",
        "oversized": "over the 67108864-byte limit",
        "malformed": "is not valid JSON",
        "format_version": "format_version 99",
    }[kind]
    for args in (("verify", copy), ("inspect", copy), ("diff", copy, copy)):
        proc = state_here(run_cli, *args, code=None)
        assert proc.exit_code in (1, 2) and expected in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not marker.exists()


def test_resume_reports_a_damaged_latest_and_takes_the_previous(run_dir, tmp_path, run_cli):
    """Both runs in-process: what is checked is what they say and what they leave, not their process."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    config = yaml.safe_load((run_dir.parent / "c.yaml").read_text())
    config["train"].update(output_dir=str(run), max_steps=4)
    write_yaml(tmp_path / "c.yaml", config)
    _corrupt(run / "checkpoints" / "step-000003" / "rank-00000.json", lambda d: d.__setitem__(10, ord("#")))
    proc = train_here(run_cli, tmp_path / "c.yaml")
    assert "skipping checkpoint" in proc.stderr and "rank-00000.json: sha256 differs" in proc.stderr
    assert f"resumed from {run / 'checkpoints' / 'step-000002'}" in proc.stderr
    strict = ("--set", "train.resume_strict=true", "--set", "train.max_steps=5")
    train_here(run_cli, tmp_path / "c.yaml", *strict)  # exit 0: the resumed run replaced damaged step 3; 4 verifies
