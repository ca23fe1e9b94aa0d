"""The installed libraries against dpo-toolkit's declared ranges: an old torch, transformers or PEFT is refused
by the commands that produce something, before they start, with the pip command that fixes it."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from dpo_state.errors import DependencyError
from dpo_state.installed import NUMERIC, UNTESTED, check_installed, declared, environment, outside
from tests.harness import data_here, train_here, write_yaml

ROOT = Path(__file__).resolve().parents[2]
TORCH, TRANSFORMERS = (next(str(r) for r in declared() if r.name == name) for name in ("torch", "transformers"))
"""The floors as pyproject.toml declares them: the old releases faked below are under them."""


def test_the_installed_ranges_are_pyprojects():
    """The ranges checked at run time are the ones pyproject.toml declares (an install older than the
    pyproject would check stale ones: scripts/env.sh reinstalls when pyproject.toml changes)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {str(r) for r in declared()} == {str(Requirement(r)) for r in project["dependencies"]}
    assert [str(r.specifier) for r in declared("lora")] == [
        str(Requirement(r).specifier) for r in project["optional-dependencies"]["lora"]
    ]
    assert outside(declared()) == {}, "this environment is outside the declared ranges"


@pytest.mark.parametrize(
    ("version", "met"),
    [
        ("2.11.0", True),
        ("2.11.0+cu130", True),  # a local build label: the release it labels
        ("2.14.1", True),
        ("2.15.0.dev20261201+cu130", True),  # a nightly past the floor
        ("2.9.1", False),  # its FSDP2 gradient norm leaves the embedding out (docs/dependencies.md)
        ("2.11.0a0+git1234", False),  # a pre-release of 2.11 is older than 2.11, as pip reads it
        ("not-a-version", False),
    ],
)
def test_torch_releases_against_the_floor(installed, version, met):
    installed("torch", version)
    unmet = outside([Requirement("torch>=2.11")])
    assert unmet == ({} if met else {Requirement("torch>=2.11"): version})


def test_a_missing_library_is_named():
    unmet = outside([Requirement("no-such-library-anywhere>=1")])
    assert list(unmet.values()) == ["not installed"]


def test_the_error_names_each_library_its_version_the_range_and_the_fix(installed):
    installed("torch", "2.9.1")
    installed("transformers", "4.57.0")
    with pytest.raises(DependencyError) as refused:
        check_installed()
    message = str(refused.value)
    assert f"  - torch: 2.9.1; needed: {TORCH}" in message
    assert f"  - transformers: 4.57.0; needed: {TRANSFORMERS}" in message
    assert f"Fix: pip install '{TORCH}' '{TRANSFORMERS}'" in message
    assert "docs/dependencies.md" in message and UNTESTED in message
    assert "tokenizers" not in message  # the ones in range are not listed


def test_untested_runs_with_a_warning(installed, monkeypatch, capsys):
    installed("torch", "2.9.1")
    monkeypatch.setenv(UNTESTED, "1")
    check_installed()
    warned = capsys.readouterr().err
    assert warned.startswith("warning: ") and f"torch: 2.9.1; needed: {TORCH}" in warned
    assert f"{UNTESTED}=1: running anyway" in warned


def test_dpo_train_refuses_an_old_torch_before_it_starts(installed, run_cli, tmp_path):
    installed("torch", "2.9.1")
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "c.yaml", {"data": {"path": str(tmp_path / "none")}, "output_dir": str(out)})
    result = train_here(run_cli, config, code=2)
    assert "error: installed libraries outside the ranges" in result.stderr
    assert f"torch: 2.9.1; needed: {TORCH}" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


def test_dpo_train_runs_on_under_the_untested_switch(installed, run_cli, tmp_path, monkeypatch):
    """With the switch the check warns and the run goes on: here to the next refusal, its missing dataset."""
    installed("torch", "2.9.1")
    monkeypatch.setenv(UNTESTED, "1")
    config = write_yaml(tmp_path / "c.yaml", {"data": {"path": str(tmp_path / "none")}})
    result = train_here(run_cli, config, code=2)
    assert "warning: installed libraries outside the ranges" in result.stderr
    assert "error: installed libraries" not in result.stderr
    assert "none: no such directory" in result.stderr


@pytest.mark.parametrize("command", ["build", "merge"])
def test_dpo_data_refuses_an_old_transformers_before_it_writes(installed, run_cli, tmp_path, command):
    installed("transformers", "4.57.0")
    out = tmp_path / "out"
    source = tmp_path / "rows.jsonl"
    source.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    args = [source, "--tokenizer", tmp_path] if command == "build" else [tmp_path]
    result = data_here(run_cli, command, *args, "--out", out, code=2)
    assert f"transformers: 4.57.0; needed: {TRANSFORMERS}" in result.stderr
    assert not out.exists()


def test_lora_refuses_an_old_peft(installed):
    from dpo_train.model.lora import apply_lora

    installed("peft", "0.17.0")
    with pytest.raises(DependencyError, match=r"peft: 0\.17\.0; needed: peft>=0\.18"):
        apply_lora(object(), {"r": 4})


def test_the_environment_a_checkpoint_records():
    import platform

    assert environment() == {"python": platform.python_version(), **{n: metadata.version(n) for n in NUMERIC}}
    assert environment("lora") == {**environment(), "peft": metadata.version("peft")}


@pytest.mark.parametrize("release", ["2.13.0+cpu", "3.13.0 (clang)", "\x1b[2J", "", "9" * 300])
def test_a_recorded_release_always_fits_the_checkpoint_schema(release):
    """A save must never fail on an odd build's version string: it is recorded in the schema's characters."""
    import json
    import re

    from dpo_state.installed import _printable

    schema = json.loads((ROOT / "schemas" / "checkpoint-state.schema.json").read_text())
    pattern = schema["properties"]["environment"]["additionalProperties"]["pattern"]
    assert re.fullmatch(pattern, _printable(release))
    assert _printable("2.13.0+cpu") == "2.13.0+cpu"


def test_env_lists_every_declared_library_against_its_range(run_cli):
    import json

    from tests.harness import state_cli, state_here

    shown = state_cli("env").stdout  # as a user's shell runs it (python -m dpo_cli.state env)
    assert f"  torch         {metadata.version('torch')}" in shown and "ok" in shown
    assert "[lora]" in shown and "platform" in shown and "accelerators" in shown
    document = json.loads(state_here(run_cli, "env", "--json").stdout)
    names = [row["name"] for row in document["libraries"]]
    assert names[: len(declared())] == [r.name for r in declared()] and "peft" in names and "pytest" not in names
    assert all(row["within"] for row in document["libraries"] if row["installed"])


@pytest.mark.parametrize(("name", "version", "extra"), [("torch", "2.9.1", ""), ("peft", "0.17.0", "  [lora]")])
def test_env_names_a_release_outside_its_range_and_exits_1(installed, run_cli, name, version, extra):
    from tests.harness import state_here

    installed(name, version)
    shown = state_here(run_cli, "env", code=1).stdout
    line = next(line for line in shown.splitlines() if line.startswith(f"  {name} "))
    assert version in line and line.endswith(f"OUTSIDE THE RANGE{extra}")
