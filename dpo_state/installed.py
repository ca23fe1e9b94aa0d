"""What a process runs on: its libraries against the ranges dpo-toolkit declares (checked before a command produces
anything), the releases a checkpoint records, and a fingerprint of the toolkit's own source."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

from dpo_state.errors import DependencyError

DISTRIBUTION = "dpo-toolkit"
UNTESTED = "DPO_ALLOW_UNTESTED_DEPENDENCIES"
"""Set to 1 to run outside the declared ranges anyway: the refusal becomes a warning on stderr."""
PACKAGES = ("dpo_state", "dpo_data", "dpo_train", "dpo_report", "dpo_cli")
"""This toolkit's own packages, whose source `code_fingerprint` hashes."""
UNREADABLE = "(metadata not UTF-8)"
"""`release`'s answer for metadata that is not UTF-8, as `dpo-state env --json` shows it."""
SHOWN = 40
"""The characters of a release that messages print (a 500-digit version string would fill the screen)."""
NUMERIC = ("torch", "torchdata", "transformers")
"""The libraries whose release can change a step's numbers (kernels, model code) or a checkpoint's loader state,
recorded with the Python in a checkpoint's `environment` (with the PEFT of a LoRA run)."""


def declared(extra: str | None = None) -> list[Requirement]:
    """dpo-toolkit's requirements as installed with it (its metadata's Requires-Dist, written from pyproject.toml):
    the unconditional ones, or those of `extra` alone. None when the code runs from a tree never installed."""
    try:
        lines = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    requirements = [Requirement(line) for line in lines]
    if extra is None:
        return [r for r in requirements if r.marker is None]
    return [r for r in requirements if r.marker is not None and r.marker.evaluate({"extra": extra})]


def outside(requirements: list[Requirement]) -> dict[Requirement, str]:
    """Each requirement the installed distribution does not meet -> what is installed ("not installed", or its
    version). A pre-release counts as the version it precedes (torch 2.10.0a0, a nightly or a vendor's build
    of the 2.10 branch, is older than 2.10), as pip compares them."""
    unmet = {}
    for requirement in requirements:
        found = release(requirement.name)
        if found is None:
            unmet[requirement] = "not installed"
            continue
        version = parsed(found)
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            unmet[requirement] = found
    return unmet


def release(name: str) -> str | None:
    """`name`'s installed release as its metadata says: None when not installed, "" when the metadata names
    none, UNREADABLE when its METADATA file is not UTF-8 text (a broken or hostile install beside the toolkit
    must make a check say so, never end it in a traceback)."""
    try:
        return metadata.version(name) or ""
    except metadata.PackageNotFoundError:
        return None
    except UnicodeDecodeError:
        return UNREADABLE


def parsed(found: str) -> Version | None:
    """`found` as a PEP 440 version, or None where it is not one (ValueError too: a release of more digits than
    Python converts to an int, 4300, fails in int() rather than in packaging's pattern)."""
    try:
        return Version(found)
    except (InvalidVersion, ValueError):
        return None


def shown(found: str | None) -> str:
    """An installed release as messages and `dpo-state env` print it: escape sequences and control characters
    escaped (a version string must not drive the terminal), cut at SHOWN characters, and one that PEP 440
    cannot read said to be so, since no range can be checked against it."""
    if found is None:
        return "not installed"
    if found == UNREADABLE:
        return "metadata not UTF-8, its version cannot be read"
    text = found.encode("unicode_escape").decode("ascii")
    text = text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(found)} characters)"
    return text if parsed(found) is not None else f"'{text}', not a PEP 440 version"


def check_installed(extra: str | None = None) -> None:
    """Refuse a process whose libraries are outside dpo-toolkit's declared ranges (the unconditional ones, or
    those of `extra`). Releases older than the floors are not just untested: torch 2.9 leaves the embedding out of
    an FSDP2 gradient norm (each rank clips by another) and 2.6 cannot save a one-process checkpoint
    (docs/dependencies.md). pip enforces the ranges at install; this catches what pip did not see (--no-deps,
    a container's own torch, a later downgrade). With DPO_ALLOW_UNTESTED_DEPENDENCIES=1 the refusal is a
    warning on stderr."""
    unmet = outside(declared(extra))
    if not unmet:
        return
    found = "\n".join(f"  - {r.name}: {_described(version)}; needed: {_pinned(r)}" for r, version in unmet.items())
    what = f"installed libraries outside the ranges dpo-toolkit is tested on (docs/dependencies.md):\n{found}"
    if os.environ.get(UNTESTED) == "1":
        print(f"warning: {what}\n({UNTESTED}=1: running anyway, untested)", file=sys.stderr)
        return
    fix = " ".join(f"'{_pinned(r)}'" for r in unmet)
    raise DependencyError(f"{what}\nFix: pip install {fix}; or set {UNTESTED}=1 to run anyway, untested")


def environment(extra: str | None = None) -> dict[str, str]:
    """Python's version and each installed library of NUMERIC's (and of `extra`'s requirements): what a
    checkpoint records, so that a resume under other releases says so (a step's numbers may change)."""
    names = [*NUMERIC, *(r.name for r in declared(extra))] if extra else list(NUMERIC)
    found = {"python": _printable(platform.python_version())}
    for name in names:
        if (release_found := release(name)) is not None:
            found[name] = _printable(release_found)
    return found


def releases() -> list[dict]:
    """Every requirement dpo-toolkit declares, the unconditional ones first, then each extra's (the test tools
    aside), with what is installed: {name, extra, needed, installed (None: not), within (None: an extra's
    library that is not installed, which only that extra's feature needs), shown (the release as `shown` prints
    it)}. What `dpo-state env` shows."""
    try:
        extras = metadata.metadata(DISTRIBUTION).get_all("Provides-Extra") or []
    except metadata.PackageNotFoundError:
        return []
    rows = []
    for extra in [None, *(e for e in extras if e != "test")]:
        for requirement in declared(extra):
            installed = release(requirement.name)
            rows.append(
                {
                    "name": requirement.name,
                    "extra": extra,
                    "needed": str(requirement.specifier) or "any",
                    "installed": installed,
                    "within": None if installed is None and extra else not outside([requirement]),
                    "shown": shown(installed),
                }
            )
    return rows


def code_fingerprint() -> str:
    """`sha256:<hex>` of this toolkit's own source as this process imports it: every .py file of PACKAGES, by
    package and path within it. Ranks on two checkouts of one version number (two nodes' copies) differ here."""
    digest = hashlib.sha256()
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(Path(root).rglob("*.py")):
                digest.update(f"{package}/{path.relative_to(root).as_posix()}\0".encode())
                digest.update(hashlib.sha256(path.read_bytes()).digest())
    return f"sha256:{digest.hexdigest()}"


def _printable(release: str) -> str:
    """`release` as the checkpoint schema holds it: PEP 440's characters, at most 128 (anything else, which no
    release pip installs has, becomes `_`), so that a save never fails on an odd build's version string."""
    return re.sub(r"[^A-Za-z0-9.+!_-]", "_", release)[:128] or "_"


def _described(found: str) -> str:
    """What `outside` found, as a refusal prints it."""
    return found if found == "not installed" else shown(found)


def _pinned(requirement: Requirement) -> str:
    """`peft>=0.18`: the name and range, without the extra's marker (what pip install takes)."""
    return f"{requirement.name}{requirement.specifier}"
