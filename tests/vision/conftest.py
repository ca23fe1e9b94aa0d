"""Vision fixtures: the tiny random VLM directories, saved once per test session, and sample images."""

from __future__ import annotations

import pytest

from tests.vision.tiny_vlm import idefics3_dir, qwen25vl_dir, sample_images

FAMILIES = {"qwen2_5_vl": qwen25vl_dir, "idefics3": idefics3_dir}


class VLMDirs:
    """Each family's tiny VLM directory, saved on first use and kept for the session."""

    def __init__(self, factory):
        self.factory, self.made = factory, {}

    def __getitem__(self, family: str):
        if family not in self.made:
            self.made[family] = FAMILIES[family](self.factory.mktemp(family))
        return self.made[family]


@pytest.fixture(scope="session")
def vlm_dirs(tmp_path_factory) -> VLMDirs:
    return VLMDirs(tmp_path_factory)


@pytest.fixture(scope="session")
def qwen25vl(vlm_dirs):
    return vlm_dirs["qwen2_5_vl"]


@pytest.fixture(scope="session")
def idefics3(vlm_dirs):
    return vlm_dirs["idefics3"]


@pytest.fixture(scope="session")
def images() -> list[bytes]:
    """Four small deterministic images (PNG and JPEG, square and oblong) as encoded bytes."""
    return sample_images()


class VisionDatasets:
    """Each family's vision dataset (tests.vision.datasets.build_vision), built on first use and kept."""

    def __init__(self, factory, dirs: VLMDirs):
        self.factory, self.dirs, self.made = factory, dirs, {}

    def __getitem__(self, family: str):
        from tests.vision.datasets import build_vision

        if family not in self.made:
            self.made[family] = build_vision(self.dirs[family], self.factory.mktemp(f"{family}-data") / "train")
        return self.made[family]


@pytest.fixture(scope="session")
def vision_datasets(tmp_path_factory, vlm_dirs) -> VisionDatasets:
    return VisionDatasets(tmp_path_factory, vlm_dirs)
