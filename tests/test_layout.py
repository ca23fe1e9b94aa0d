"""Package boundaries: dpo_data stands alone (no dpo_train), dpo_state imports neither, torch_npu stays optional."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"dpo_data": {"dpo_train", "cli"}, "dpo_state": {"dpo_train", "dpo_data", "cli"}}


def imported_packages(package: str) -> set[str]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_one_way(package):
    assert imported_packages(package) & FORBIDDEN[package] == set()


def test_the_data_pipeline_imports_without_the_trainer_or_npu():
    code = (
        "import sys, pkgutil, importlib, dpo_data\n"
        "for m in pkgutil.iter_modules(dpo_data.__path__): importlib.import_module('dpo_data.' + m.name)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('dpo_train', 'cli', 'torch_npu')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_every_schema_is_a_valid_draft_2020_12_schema():
    from dpo_state.schema import load_schema

    names = [p.name.removesuffix(".schema.json") for p in (ROOT / "schemas").glob("*.schema.json")]
    assert names and all(load_schema(n)["$schema"].endswith("2020-12/schema") for n in names)
