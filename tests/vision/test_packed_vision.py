"""Packed vision-language rows score each pair as its sequences run alone through the model's own eager attention."""

from __future__ import annotations

import pytest
import torch

from dpo_train.attention import segments
from dpo_train.vision.families import FAMILIES
from dpo_train.vision.rows import pack_vision
from dpo_train.vision.score import vision_pair_logps
from dpo_train.vision.truth import eager_unpacked_vision
from tests.vision.pairs import vision_pairs
from tests.vision.tiny_vlm import load_processor

TOLERANCE = 1e-5  # relative, per pair and per gradient tensor; the paths agree to about 1e-7
LAYOUTS = ("separate", "shared_prompt")
PATHS = {"segments": segments.ATTENTION, "sdpa": "sdpa", "eager": "eager"}
TOWER = {"qwen2_5_vl": "visual", "idefics3": "vision_model"}  # the vision tower, under model.model


def load(path, attention: str):
    """The VLM with `attention` in its decoder and eager attention in its vision tower, in fp32."""
    from transformers import AutoModelForImageTextToText

    segments.register()
    implementation = {"text_config": attention, "vision_config": "eager", "": "eager"}
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation=implementation)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, vlm_dirs, images):
    """(family, model directory, its pairs, the eager unpacked truth [pairs, 2])."""
    path = vlm_dirs[request.param]
    pairs = vision_pairs(load_processor(path), images, request.param)
    truth = eager_unpacked_vision(load(path, "eager").eval(), pairs)
    return request.param, path, pairs, truth


def relative_error(out, truth: torch.Tensor) -> float:
    got = torch.stack([out.chosen, out.rejected], dim=1).double().detach()
    return float(((got - truth).abs() / truth.abs().clamp(min=1e-6)).max())


class EncodedImages:
    """Counts the images (Qwen2.5-VL) or crops (Idefics3) the vision tower encodes, by a forward hook."""

    def __init__(self, model, name: str):
        self.count = 0
        tower = getattr(model.model, TOWER[name])
        self.handle = tower.register_forward_pre_hook(self.seen, with_kwargs=True)

    def seen(self, module, args, kwargs):
        if "grid_thw" in kwargs:
            self.count += int(kwargs["grid_thw"].shape[0])
        else:
            self.count += int((kwargs.get("pixel_values", args[0] if args else None)).shape[0])


@pytest.mark.parametrize("path_name", sorted(PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_row_equals_each_sequence_run_alone(family, layout, path_name):
    name, path, pairs, truth = family
    model = load(path, PATHS[path_name]).eval()
    batch = pack_vision(pairs, model.config, layout, pad_to_multiple_of=16)
    encoded = EncodedImages(model, name)
    with torch.no_grad():
        out = vision_pair_logps(model, batch)
    assert relative_error(out, truth) < TOLERANCE
    # the shared prompt encodes each image once; the separate layout twice (once per completion's segment)
    images = sum(FAMILIES[name].images_of(pair.images) for pair in pairs if pair.images)
    assert encoded.count == images * (1 if layout == "shared_prompt" else 2)
    assert int(batch["segment_images"].sum()) == encoded.count


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_equal_each_sequence_run_alone(family, layout):
    """The LoRA-free policy's gradients (language model and vision tower) from the packed row equal those of
    the sequences run alone, for a loss weighing every pair's chosen and rejected sums differently."""
    name, path, pairs, _ = family
    weights = torch.linspace(0.5, 2.0, 2 * len(pairs), dtype=torch.float64).view(len(pairs), 2)
    packed, alone = load(path, segments.ATTENTION).eval(), load(path, "eager").eval()
    out = vision_pair_logps(packed, pack_vision(pairs, packed.config, layout, pad_to_multiple_of=16))
    (torch.stack([out.chosen, out.rejected], dim=1).double() * weights).sum().backward()
    (eager_unpacked_vision(alone, pairs, grad=True) * weights).sum().backward()
    truth = dict(alone.named_parameters())
    # a tensor whose gradient is zero in exact arithmetic (a key bias: softmax ignores a shift shared by every
    # key) holds rounding noise: its error is measured against a millionth of the model's largest gradient
    floor = 1e-6 * max(float(p.grad.abs().max()) for p in truth.values() if p.grad is not None)
    checked = 0
    for key, parameter in packed.named_parameters():
        want = truth[key].grad
        if want is None:
            assert parameter.grad is None or not parameter.grad.any(), key
            continue
        error = float((parameter.grad - want).abs().max()) / max(float(want.abs().max()), floor)
        assert error < TOLERANCE, f"{key}: gradient off by {error:.1e} relative"
        checked += 1
    language = [k for k in truth if truth[k].grad is not None and ("language_model" in k or "text_model" in k)]
    assert checked > 10 and language and any(TOWER[name] in k for k in truth if truth[k].grad is not None)
