"""What the packed vision path cannot express is refused by name: other families, videos, bad pairs, other paths."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dpo_data.errors import DataError
from dpo_train.errors import ConfigError, ModelError
from dpo_train.logps.scoring import Scoring
from dpo_train.vision.families import NOT_YET, family_of
from dpo_train.vision.rows import pack_vision
from dpo_train.vision.score import vision_pair_logps
from tests.vision.pairs import vision_pairs
from tests.vision.test_packed_vision import load
from tests.vision.tiny_vlm import load_processor


@pytest.mark.parametrize("model_type", sorted(NOT_YET) + ["llama"])
def test_other_families_are_refused_by_name(model_type):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    with pytest.raises(ConfigError, match=f"model type {model_type}: cannot train packed vision-language") as e:
        family_of(config)
    assert "supported: idefics3, qwen2_5_vl" in str(e.value)
    assert NOT_YET.get(model_type, "not a vision-language family") in str(e.value)


@pytest.fixture(scope="module")
def qwen(vlm_dirs, images):
    path = vlm_dirs["qwen2_5_vl"]
    return load(path, "sdpa").eval(), vision_pairs(load_processor(path), images, "qwen2_5_vl")


def _with(pair, **ids):
    return dataclasses.replace(pair, ids=dataclasses.replace(pair.ids, **ids))


def test_a_pair_whose_placeholders_do_not_match_its_images_is_refused(qwen):
    model, pairs = qwen
    fewer = dict(pairs[0].images, image_grid_thw=pairs[0].images["image_grid_thw"][:1])  # one image's grid lost
    fewer = dataclasses.replace(pairs[0], images=fewer)
    with pytest.raises(DataError, match=r"pair 0: its prompt holds \d+ image placeholders .* and its images fill \d+"):
        pack_vision([fewer], model.config)
    with pytest.raises(DataError, match="pair 2: its prompt holds 0 image placeholders"):
        pack_vision([dataclasses.replace(pairs[2], images=pairs[1].images)], model.config)


def test_images_in_a_completion_and_videos_are_refused(qwen):
    model, pairs = qwen
    image, video = model.config.image_token_id, model.config.video_token_id
    chosen = np.concatenate([pairs[2].ids.chosen, np.int32([image])])
    with pytest.raises(DataError, match="pair 2: its chosen completion holds image placeholders.*prompt only"):
        pack_vision([_with(pairs[2], chosen=chosen)], model.config)
    prompt = np.concatenate([np.int32([video]), pairs[2].ids.prompt])
    with pytest.raises(DataError, match="pair 2: its prompt holds video placeholders .* videos are not supported"):
        pack_vision([_with(pairs[2], prompt=prompt)], model.config)
    with pytest.raises(DataError, match="pair 1: its images lack image_grid_thw"):
        pack_vision(
            [dataclasses.replace(pairs[1], images={"pixel_values": pairs[1].images["pixel_values"]})], model.config
        )


def test_paths_that_would_drop_the_images_refuse_the_row(qwen):
    from dpo_train.logps.pairs import pair_logps

    model, pairs = qwen
    batch = pack_vision(pairs, model.config, "shared_prompt", pad_to_multiple_of=16)
    unpacked = Scoring(unpacked=True)
    with pytest.raises(ConfigError, match="model.attention unpacked cannot score vision-language rows"):
        vision_pair_logps(model, batch, unpacked)
    with pytest.raises(ModelError, match="the unpacked path cannot score a vision-language row"):
        pair_logps(model, batch, unpacked)  # the logps room itself never drops the images
    mesh = type("Mesh", (), {"active": True})()
    with pytest.raises(ConfigError, match="distributed.sequence_parallel cannot score vision-language rows"):
        vision_pair_logps(model, batch, Scoring(), mesh=mesh)
    with torch.no_grad():
        assert vision_pair_logps(model, batch, Scoring()).chosen.isfinite().all()  # the model itself is fine


def test_idefics3_crops_of_different_sizes_in_one_row_are_refused(vlm_dirs, images):
    """The processor makes every crop one size (its max_image_size); a pair processed otherwise is named."""
    from transformers import AutoConfig

    path = vlm_dirs["idefics3"]
    pairs = vision_pairs(load_processor(path), images, "idefics3")
    small = {k: v[..., :24, :24] for k, v in pairs[1].images.items()}  # as if cropped at 24 px
    odd = dataclasses.replace(pairs[1], images=small)
    with pytest.raises(DataError, match=r"idefics3 crops of different sizes \[\(24, 24\), \(32, 32\)\] in one row"):
        pack_vision([pairs[0], odd], AutoConfig.from_pretrained(path))
