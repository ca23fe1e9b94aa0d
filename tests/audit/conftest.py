"""The planted datasets, built once per session with the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from tests.audit.planted import build_planted


@pytest.fixture(scope="session")
def planted(smollm2_dir, tmp_path_factory):
    return build_planted(tmp_path_factory.mktemp("planted"), smollm2_dir)


from tests.vision.conftest import idefics3, vision_datasets, vlm_dirs  # noqa: E402,F401 - the vision fixtures, here too
