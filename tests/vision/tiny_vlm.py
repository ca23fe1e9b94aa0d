"""Tiny random vision-language model directories, saved offline, and a few deterministic images."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

SMOLLM2 = Path("/root/.cache/dpo-toolkit/SmolLM2-135M-Instruct")
# The language model both families share: narrow, two layers, so a forward takes milliseconds.
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)

# Qwen2-VL's own chat template (Qwen/Qwen2-VL-7B-Instruct), with its <|vision_start|><|image_pad|><|vision_end|> parts.
QWEN_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# SmolVLM's chat template (HuggingFaceTB/SmolVLM-Instruct), also accepting a plain-string content as TRL's text rows do.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# The vision towers: narrow, Qwen2.5-VL's of two blocks (windowed, then full attention), Idefics3's of one.
QWEN_TOWER = dict(hidden_size=32, intermediate_size=64, layers=2, heads=2)
IDEFICS3_TOWER = dict(hidden_size=32, intermediate_size=64, layers=1, heads=2)

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]


def _tokenizer(special: list[str]):
    """The real SmolLM2 tokenizer with a family's special tokens added."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    tok.add_special_tokens({"additional_special_tokens": special})
    return tok


def qwen25vl_dir(path: Path, seed: int = 0, *, text: dict = TEXT, tower: dict = QWEN_TOWER, edge: int = 112) -> Path:
    """Save a tiny random Qwen2.5-VL (model, Qwen2VLImageProcessorPil, SmolLM2 tokenizer, chat template) to `path`:
    `text` its language model, `tower` its vision tower, images resized to at most `edge` x `edge` pixels with
    attention windows of half that (the defaults are the tests'; benchmarks/vision.py builds a larger one)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = _tokenizer(QWEN_TOKENS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    # 14 px patches merged 2x2: a 56 px square is a 4x4 grid, 4 image tokens; pixels bounded so images stay tiny.
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": edge * edge}, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    processor = Qwen25VLImageProcessor(image_processor=image_processor, tokenizer=tok, chat_template=QWEN_TEMPLATE)
    rope_pairs = text["hidden_size"] // text["num_attention_heads"] // 2
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _thirds(rope_pairs)},
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            **text,
        ),
        vision_config=dict(
            depth=tower["layers"],
            hidden_size=tower["hidden_size"],
            intermediate_size=tower["intermediate_size"],
            num_heads=tower["heads"],
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=edge // 2,
            fullatt_block_indexes=[tower["layers"] - 1],
            out_hidden_size=text["hidden_size"],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return _save(Qwen2_5_VLForConditionalGeneration, config, processor, path, seed)


def _thirds(pairs: int) -> list[int]:
    """Qwen2.5-VL's M-RoPE sections (temporal, height, width) over a head's rotary `pairs`, as its 16/24/24."""
    t = pairs // 4
    return [t, (pairs - t) // 2, pairs - t - (pairs - t) // 2]


def idefics3_dir(path: Path, seed: int = 0, *, text: dict = TEXT, tower: dict = IDEFICS3_TOWER, edge: int = 64) -> Path:
    """Save a tiny random Idefics3/SmolVLM (model, Idefics3ImageProcessorPil, SmolLM2 tokenizer, chat template):
    `text` its language model, `tower` its vision tower, images resized to at most `edge` px a side and split into
    crops of half that (the defaults are the tests'; benchmarks/vision.py builds a larger one)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = _tokenizer(IDEFICS3_TOKENS)
    # 32 px crops of 8 px patches, pixel-shuffled by 2: 4 image tokens a crop; a 56 px image splits into 2x2 crops
    # plus the global one, as SmolVLM splits its 512 px crops.
    crop = edge // 2
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": edge}, max_image_size={"longest_edge": crop}, do_image_splitting=True
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_len=(crop // 16) ** 2, chat_template=SMOLVLM_TEMPLATE
    )
    config = Idefics3Config(
        text_config=dict(
            model_type="llama",
            vocab_size=len(tok),
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            **text,
        ),
        vision_config=dict(
            hidden_size=tower["hidden_size"],
            intermediate_size=tower["intermediate_size"],
            num_hidden_layers=tower["layers"],
            num_attention_heads=tower["heads"],
            image_size=crop,
            patch_size=8,
        ),
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
    )
    return _save(Idefics3ForConditionalGeneration, config, processor, path, seed)


def _save(model_class, config, processor, path: Path, seed: int) -> Path:
    """Random weights from a fixed seed, saved beside the processor as the family's real checkpoints are."""
    torch.manual_seed(seed)
    model = model_class(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    # The image-only Qwen processor records its own class name: record the family's, as a real checkpoint does.
    for name in ("processor_config.json", "preprocessor_config.json"):
        file = path / name
        if file.exists():
            doc = json.loads(file.read_text())
            if doc.get("processor_class") == "Qwen25VLImageProcessor":
                doc["processor_class"] = "Qwen2_5_VLProcessor"
                file.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def load_processor(path: Path):
    """The directory's processor: `AutoProcessor`, or for Qwen2.5-VL without torchvision its image-only form.

    transformers 5.24's Qwen2.5-VL processor requires a video processor, and every video processor requires
    torchvision, so `AutoProcessor.from_pretrained` raises ImportError here; images are processed by
    Qwen2VLImageProcessorPil either way, so the image-only processor yields the same ids and pixels.
    """
    from transformers import AutoConfig, AutoProcessor
    from transformers.utils import is_torchvision_available

    if AutoConfig.from_pretrained(path).model_type == "qwen2_5_vl" and not is_torchvision_available():
        return Qwen25VLImageProcessor.from_pretrained(path)
    return AutoProcessor.from_pretrained(path)


def _image_only_qwen():
    """Qwen2_5_VLProcessor without its video processor (whose every class needs torchvision)."""
    from transformers import Qwen2_5_VLProcessor

    class Qwen25VLImageProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor for images: the tokenizer and image processor only (`attributes` read __init__)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return Qwen25VLImageProcessor


Qwen25VLImageProcessor = _image_only_qwen()


def image_bytes(index: int, size: tuple[int, int] = (56, 56), fmt: str = "PNG") -> bytes:
    """A deterministic RGB image (a seeded noise field) encoded as PNG or JPEG bytes."""
    rng = np.random.default_rng(1000 + index)
    pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format=fmt)
    return out.getvalue()


# A few images of different shapes and formats: different grids and crop counts in both families.
IMAGES = [
    dict(index=0, size=(56, 56), fmt="PNG"),
    dict(index=1, size=(84, 56), fmt="JPEG"),
    dict(index=2, size=(56, 84), fmt="PNG"),
    dict(index=3, size=(28, 28), fmt="JPEG"),
]


def sample_images() -> list[bytes]:
    """The bytes of IMAGES, in order."""
    return [image_bytes(**spec) for spec in IMAGES]
