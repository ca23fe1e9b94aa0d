"""Shared fixtures: the real SmolLM2 tokenizer, row-file writers, a CLI runner and installed releases."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread per process, as torchrun gives each rank: the suite runs two xdist workers, each starting
# CLI processes and gloo ranks, on two cores, and torch's default of a thread per core oversubscribes them
# (spinning OpenMP threads made a tiny model's step 20x slower). Set before anything here imports torch; the
# subprocesses and spawned ranks inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct directory, materialized once into the user cache."""
    from dpo_train.model.bundled import materialize_smollm2

    return materialize_smollm2()


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def write_jsonl(path: Path, rows: list) -> Path:
    """Write rows as JSON lines; a `bytes` item is written verbatim as one line."""
    with open(path, "wb") as f:
        for row in rows:
            f.write((row if isinstance(row, bytes) else orjson.dumps(row)) + b"\n")
    return path


def chat(prompt: str, chosen: str, rejected: str, system: str | None = None) -> dict:
    """An explicit-prompt conversational row."""
    history = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return {
        "prompt": history,
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


@pytest.fixture
def run_cli():
    """Invoke a click entry point in-process; returns the click Result (exit_code, output, stderr)."""
    from tests.harness import invoke

    return invoke


SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sample"


@pytest.fixture(scope="session")
def sample_dataset(smollm2_dir, tmp_path_factory) -> Path:
    """The bundled sample's train split, built once with the real tokenizer (342 pairs, 2 shards)."""
    from dpo_data.prepare.build import BuildOptions, build

    out = tmp_path_factory.mktemp("sample") / "train"
    inputs = sorted(str(p) for p in SAMPLE.iterdir() if p.is_file() and not p.name.endswith(".md"))
    result = build(inputs, str(smollm2_dir), out, BuildOptions(pairs_per_shard=200))
    assert result.manifest is not None
    return out


@pytest.fixture(scope="session")
def small_dataset(smollm2_dir, tmp_path_factory):
    """24 pairs: 6 steps of 4 pairs per epoch, so runs cross epoch boundaries quickly."""
    from dpo_data.prepare.build import BuildOptions, build

    tmp = tmp_path_factory.mktemp("small")
    rows = [
        chat(
            f"What is {i} plus {i * 3}?",
            f"It is {4 * i}." + " Indeed." * (i % 5),
            f"It is {4 * i + 1}." + " Hmm." * (i % 3),
        )
        for i in range(24)
    ]
    result = build([str(write_jsonl(tmp / "pairs.jsonl", rows))], str(smollm2_dir), tmp / "data", BuildOptions())
    assert result.manifest["totals"]["pairs"] == 24
    return tmp / "data"


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Install a distribution's metadata (a dist-info directory, no code) first on sys.path, as pip's files of
    another release would be: `installed("torch", "2.9.1")`. Imports are untouched; only what pip and
    importlib.metadata read changes."""
    root = tmp_path / "installed-metadata"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("DPO_ALLOW_UNTESTED_DEPENDENCIES", raising=False)

    def install(name: str, version: str) -> None:
        info = root / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")

    return install


HEAVIEST_FIRST = (  # every file over 30 s, longest first (scripts/test.sh --junitxml, 2026-12-06: 772 s on 2 workers)
    "tests/train/checkpoint/test_checkpoint.py",
    "tests/train/test_trainer.py",
    "tests/train/attention/test_sequence_parallel.py",
    "tests/train/test_invariance.py",
    "tests/architectures/test_architectures.py",
    "tests/data/test_light_tokenizer.py",
    "tests/train/test_loss_runs.py",
    "tests/architectures/test_flex.py",
    "tests/test_benchmarks.py",
    "tests/train/model/test_lora.py",
    "tests/train/parallel/test_devices.py",
    "tests/hostile/test_hostile_run.py",
    "tests/vision/test_vision_build.py",
    "tests/train/run/test_rank_agreement.py",
)
"""The files whose tests take longest (scripts/test.sh's --durations), dealt out first: under `--dist loadfile
--no-loadscope-reorder` a worker takes the next file in collection order, so a heavy file collected last runs
alone at the end while the other worker idles (the suite spent its last 7 of 16 minutes so)."""


def pytest_collection_modifyitems(config, items):
    """Move the files of HEAVIEST_FIRST to the front, in that order; every other test keeps its place."""
    root = Path(__file__).resolve().parents[1]
    rank = {name: k for k, name in enumerate(HEAVIEST_FIRST)}

    def place(item) -> int:
        return rank.get(Path(str(item.fspath)).resolve().relative_to(root).as_posix(), len(rank))

    items.sort(key=place)  # stable: within a file, and for every other file, the collected order
