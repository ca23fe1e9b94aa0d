"""`dpo-state inspect / diff / verify` on a real checkpoint, and on broken or hostile ones: every failure named,
nothing executed, nothing partly loaded."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys

import pytest
import yaml

from dpo_state.commit import write_commit
from tests.harness import TINY_LLAMA

MODEL = TINY_LLAMA


@pytest.fixture(scope="module")
def run_dir(sample_dataset, smollm2_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("state")
    config = {
        "model": {"init": {"config": MODEL, "seed": 0}, "tokenizer": str(smollm2_dir)},
        "data": {"path": str(sample_dataset), "pairs_per_step": 4, "max_tokens_per_microbatch": 400},
        "optim": {"lr": 1.0e-3},
        "train": {"output_dir": str(tmp / "run"), "max_steps": 3, "save_every": 1},
    }
    (tmp / "c.yaml").write_text(yaml.safe_dump(config))
    args = [sys.executable, "-m", "dpo_cli.train", str(tmp / "c.yaml"), "--quiet"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "run"


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dpo_cli.state", *map(str, args)], capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def copy(run_dir, tmp_path):
    """A private copy of the latest checkpoint to break."""
    target = tmp_path / "step-000003"
    shutil.copytree(run_dir / "checkpoints" / "step-000003", target)
    return target


def test_inspect_reads_json_only_and_names_what_the_checkpoint_holds(run_dir):
    info = json.loads(cli("inspect", run_dir, "--json").stdout)
    assert info["step"] == 3 and info["committed"] and info["consumed"]["pairs"] == 12
    assert info["tensors"]["model"]["count"] == 21 and info["tensors"]["optim"]["count"] == 63
    assert info["ranks"][0]["loader_position"] == {"epoch": 0, "step": 3, "microbatch": 0}
    assert info["lineage"]["parent"] == "step-000002"
    text = cli("inspect", run_dir).stdout
    assert "step 3, epoch 0" in text and "AdamW, 21 parameters" in text and "tensors     optim: 63 tensors" in text


def test_verify_passes_a_sound_checkpoint(run_dir):
    proc = cli("verify", run_dir)
    assert proc.returncode == 0 and proc.stdout.startswith("ok:")


def test_diff_exit_codes_and_values(run_dir, copy):
    same = cli("diff", run_dir, copy, "--values")
    assert same.returncode == 0 and "tensors: 0 of 84 differ" in same.stdout
    older = cli("diff", run_dir / "checkpoints" / "step-000002", run_dir, "--values", "--json")
    result = json.loads(older.stdout)
    assert older.returncode == 1 and not result["equal"]
    assert any(row["path"] == "step" for row in result["sections"]["positions"])
    assert result["tensors"]["differ"] > 0
    assert cli("diff", run_dir, copy.parent / "nowhere").returncode == 2


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
def test_verify_names_every_damage(copy, damage, expected):
    damage(copy)
    proc = cli("verify", copy)
    assert proc.returncode == 1 and expected in proc.stderr, proc.stderr


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this would create the marker file
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("kind", ["pickle", "oversized", "malformed", "format_version"])
def test_hostile_state_files_are_named_and_never_executed(copy, tmp_path, kind):
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
        proc = cli(*args)
        assert proc.returncode in (1, 2) and expected in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not marker.exists()


def test_resume_reports_a_damaged_latest_and_takes_the_previous(run_dir, sample_dataset, smollm2_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    config = yaml.safe_load((run_dir.parent / "c.yaml").read_text())
    config["train"].update(output_dir=str(run), max_steps=4)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    _corrupt(run / "checkpoints" / "step-000003" / "rank-00000.json", lambda d: d.__setitem__(10, ord("#")))
    proc = subprocess.run(
        [sys.executable, "-m", "dpo_cli.train", str(tmp_path / "c.yaml"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping checkpoint" in proc.stderr and "rank-00000.json: sha256 differs" in proc.stderr
    assert f"resumed from {run / 'checkpoints' / 'step-000002'}" in proc.stderr
    strict = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpo_cli.train",
            str(tmp_path / "c.yaml"),
            "--quiet",
            "--set",
            "train.resume_strict=true",
            "--set",
            "train.max_steps=5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert strict.returncode == 0  # the resumed run replaced the damaged step 3; the latest, step 4, verifies
