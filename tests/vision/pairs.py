"""Vision-language pairs for the tests: prompts with images rendered by the family's processor, as the loader will."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from dpo_data.dataset.store import PairIds
from dpo_train.vision.rows import VisionPair

# (image indexes of tests.vision.tiny_vlm.IMAGES in the prompt, question, chosen, rejected)
ROWS = [
    ((0, 1), "Which of the two pictures is brighter?", "The first one.", "Neither, they are the same picture."),
    ((2,), "Describe the picture.", "Coloured noise, taller than wide.", "A cat."),
    ((), "What is two plus two?", "Four.", "Five, as everyone knows."),
    ((3, 0), "Are these the same size?", "No: the second is larger.", "Yes."),
]


def vision_pairs(processor, images: list[bytes], family: str) -> list[VisionPair]:
    """ROWS as VisionPairs: each prompt rendered by the processor's chat template with its images (placeholders
    expanded by the processor), each completion its text and the template's end-of-turn tokens."""
    end = "<|im_end|>\n" if family == "qwen2_5_vl" else "<end_of_utterance>\n"
    out = []
    for index, (picks, question, chosen, rejected) in enumerate(ROWS):
        content = [{"type": "image"} for _ in picks] + [{"type": "text", "text": question}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        pictures = [Image.open(io.BytesIO(images[i])) for i in picks]
        got = processor(text=[text], images=[pictures] if pictures else None, return_tensors="pt")
        prompt = got["input_ids"][0].numpy().astype(np.int32)
        keys = (
            ("pixel_values", "image_grid_thw") if family == "qwen2_5_vl" else ("pixel_values", "pixel_attention_mask")
        )
        batch_row = family != "qwen2_5_vl"  # Idefics3's image inputs have a batch dimension; drop it (one prompt)
        found = {k: (got[k][0] if batch_row else got[k]) for k in keys if k in got and pictures}
        tokenize = lambda t: np.asarray(processor.tokenizer(t + end, add_special_tokens=False)["input_ids"], np.int32)
        out.append(VisionPair(PairIds(index, 0, prompt, tokenize(chosen), tokenize(rejected)), found))
    return out
