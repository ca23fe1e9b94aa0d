"""Hostile round 4 (issue 55), dpo-state's and the dependency check's points: absurd version strings installed
beside the toolkit are named and printed safely, never a traceback; `verify` refuses symbolic links in a
checkpoint and an export directory that is one."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.harness import data_cli, state_cli, state_here, tiny_config, train_cli, write_yaml

ABSURD = {
    "pyyaml": "not-a-version",
    "tqdm": "1..2",
    "zstandard": "1.0\x1b]0;pwned\x07\x08\x08\x1b[31m",  # retitles the terminal, backspaces, turns it red
    "jsonschema": "9" * 5000,  # PEP 440's pattern, but past the digits Python's int() converts
    "jinja2": "",
}
"""Declared libraries shadowed by a release no range can be checked against (none of them is imported by the
commands under test before the check, so the import itself does not fail)."""
CONTROL = ("\x1b", "\x07", "\x08")


def _shadow(root: Path, releases: dict[str, str], raw: dict[str, bytes] | None = None) -> dict[str, str]:
    """Real dist-info directories in `root` for each name's release (`raw`: METADATA's bytes as given), and the
    environment that puts `root` first on a CLI process's path, where importlib.metadata finds them first."""
    for name, version in releases.items():
        _dist_info(root, name).write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", "utf-8")
    for name, body in (raw or {}).items():
        _dist_info(root, name).write_bytes(body)
    return {"PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _dist_info(root: Path, name: str) -> Path:
    info = root / f"{name}-0.dist-info"
    info.mkdir(parents=True)
    return info / "METADATA"


def _not_utf8(name: str) -> bytes:
    return f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0".encode() + b"\xff\xfe\n"


def _assert_named_safely(text: str) -> None:
    assert "Traceback" not in text and not any(c in text for c in CONTROL), text
    assert "'not-a-version', not a PEP 440 version" in text and "'1..2', not a PEP 440 version" in text
    assert "'1.0\\x1b]0;pwned\\x07\\x08\\x08\\x1b[31m', not a PEP 440 version" in text
    assert f"'{'9' * 40}... (5000 characters)', not a PEP 440 version" in text
    assert "'', not a PEP 440 version" in text and "metadata not UTF-8, its version cannot be read" in text


def test_dpo_state_env_names_absurd_releases_escaped_and_exits_1(tmp_path):
    env = _shadow(tmp_path / "site", ABSURD, {"orjson": _not_utf8("orjson")})
    shown = state_cli("env", env=env, code=1)
    _assert_named_safely(shown.stdout + shown.stderr)
    line = next(line for line in shown.stdout.splitlines() if line.startswith("  pyyaml "))
    assert " >=6 " in line and line.endswith("OUTSIDE THE RANGE")


def test_the_dependency_check_names_each_unreadable_release_and_its_range(tmp_path):
    env = _shadow(tmp_path / "site", ABSURD, {"orjson": _not_utf8("orjson")})
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    refused = data_cli("build", rows, "--tokenizer", tmp_path, "--out", tmp_path / "out", env=env, code=2)
    _assert_named_safely(refused.stderr)
    assert refused.stderr.startswith("error: installed libraries outside the ranges")
    assert "  - pyyaml: 'not-a-version', not a PEP 440 version; needed: pyyaml>=6\n" in refused.stderr
    assert "  - orjson: metadata not UTF-8, its version cannot be read; needed: orjson>=3.9\n" in refused.stderr
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_records_a_release_its_metadata_does_not_name(tmp_path, monkeypatch):
    """A dist-info without a Version (importlib.metadata answers None) is recorded as `_`, not a save's
    traceback; one whose METADATA is not UTF-8 as the schema's characters too."""
    from dpo_state.installed import environment

    root = tmp_path / "site"
    (info := _dist_info(root, "torchdata")).write_text("Metadata-Version: 2.1\nName: torchdata\n")
    _dist_info(root, "transformers").write_bytes(_not_utf8("transformers"))
    monkeypatch.syspath_prepend(str(root))
    assert info.exists() and str(root) == sys.path[0]
    recorded = environment()
    assert recorded["torchdata"] == "_" and recorded["transformers"] == "_metadata_not_UTF-8_"


# -- verify refuses links in a checkpoint, and an export directory that is one ----------------------------------


@pytest.fixture(scope="module")
def trained(small_dataset, smollm2_dir, tmp_path_factory):
    """A tiny real run: its committed checkpoint of step 1 and its export (final/)."""
    tmp = tmp_path_factory.mktemp("round4-state")
    train_cli(
        write_yaml(tmp / "c.yaml", tiny_config(small_dataset, smollm2_dir, tmp / "run", max_steps=1, save_every=1))
    )
    return tmp / "run"


@pytest.fixture
def run(trained, tmp_path):
    """A private copy of the trained run."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def _linked(path: Path, elsewhere: Path) -> Path:
    """`path` moved to `elsewhere` (identical bytes) and replaced by a symbolic link to it."""
    shutil.move(path, elsewhere)
    path.symlink_to(elsewhere)
    return elsewhere


@pytest.mark.parametrize("name", ["rank-00000.json", "dcp"])
def test_verify_refuses_a_checkpoint_whose_files_are_links(run, tmp_path, run_cli, name):
    """Before: a rank file or dcp/ linked to an identical copy verified, and a copied run would verify against
    whatever the link then pointed to."""
    step = run / "checkpoints" / "step-000001"
    target = _linked(step / name, tmp_path / "elsewhere")
    refused = state_here(run_cli, "verify", run, code=1)
    assert f"{name}: a symbolic link (to {target}), not a file of the checkpoint. Fix: " in refused.stderr
    assert "Traceback" not in refused.stderr


def test_verify_refuses_a_step_directory_that_is_a_link(run, tmp_path, run_cli):
    step = run / "checkpoints" / "step-000001"
    target = _linked(step, tmp_path / "elsewhere")
    refused = state_here(run_cli, "verify", run, code=1)
    assert f"{step}: a symbolic link (to {target}), not the checkpoint itself. Fix: give the directory" in (
        refused.stderr
    )


def test_verify_refuses_an_export_directory_that_is_a_link(run, tmp_path, run_cli):
    """Before: final/ linked to an identical copy verified (and `push` would have sent the link's target)."""
    state_here(run_cli, "verify", run / "final")
    target = _linked(run / "final", tmp_path / "elsewhere")
    refused = state_here(run_cli, "verify", run / "final", code=1)
    assert f"{run / 'final'}: a symbolic link (to {target}), not the export itself" in refused.stderr
    state_here(run_cli, "verify", target)  # the directory itself verifies
