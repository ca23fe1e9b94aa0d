"""The tiny VLM fixture: each family loads offline and runs a forward on processed images."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from tests.vision.conftest import FAMILIES
from tests.vision.tiny_vlm import load_processor

IMAGE_TOKEN = {"qwen2_5_vl": "<|image_pad|>", "idefics3": "<image>"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_loads_and_runs(family, vlm_dirs, images):
    from transformers import AutoModelForImageTextToText

    path = vlm_dirs[family]
    processor = load_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert model.config.model_type == family
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which is it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert IMAGE_TOKEN[family] in text  # the template renders the image part as the family does
    batch = processor(text=[text], images=[[Image.open(io.BytesIO(images[0]))]], return_tensors="pt")
    image_token_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[family])
    assert image_token_id == model.config.image_token_id
    assert (batch["input_ids"] == image_token_id).sum() > 1  # expanded to the image's token count
    logits = model(**batch).logits
    assert logits.shape[:2] == batch["input_ids"].shape and logits.isfinite().all()
