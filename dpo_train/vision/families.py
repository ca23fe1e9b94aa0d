"""The VLM families a packed row can express (image inputs, token counts, positions); others refused by name."""

from __future__ import annotations

from typing import Any

from dpo_data.loading.vision import FAMILIES as DATA_FAMILIES
from dpo_data.loading.vision import Family
from dpo_train.errors import ConfigError

FAMILIES: dict[str, Family] = DATA_FAMILIES
"""model_type -> family: the families whose packed rows are proved equal to each sequence run alone
(tests/vision/test_packed_vision.py); their data side (image inputs, placeholder counts) is the loader's."""

NOT_YET = {
    "qwen2_vl": "Qwen2-VL's rope rule and processor differ in details not yet checked",
    "qwen3_vl": "Qwen3-VL interleaves its M-RoPE sections and adds deepstack features not yet checked",
    "smolvlm": "SmolVLM's own class (Idefics3's near copy) is not yet checked",
    "llava": "LLaVA is not yet checked",
    "gemma3": "Gemma 3's images attend bidirectionally within each image, which the segment attention does not express",
    "mllama": "Mllama reads images through cross-attention layers, which the packed path does not express",
}
"""model_type -> why a known VLM family is refused for now (the message names it)."""

UNKNOWN = "it is not a vision-language family the packed path knows"
"""Why any other model type is refused."""


def family_of(config: Any) -> Family:
    """The family of a VLM config, or a ConfigError naming the model type, why, and the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    why = NOT_YET.get(model_type, UNKNOWN)
    raise ConfigError(
        f"model type {model_type}: cannot train packed vision-language pairs on it ({why}); supported: "
        f"{', '.join(sorted(FAMILIES))} (docs/vision.md)"
    )


TOWERS = {"qwen2_5_vl": "visual", "idefics3": "vision_model"}
"""model_type -> the vision tower's module under the model (`model.model.<name>`): the image encoder, with
Qwen2.5-VL's patch merger inside it; Idefics3's connector (its projection into the decoder) is not part of it."""


def tower_of(model: Any) -> tuple[str, Any] | None:
    """(name, module) of a vision-language model's vision tower, through PEFT's wrapper; None for a text model."""
    config = getattr(model, "config", None)
    name = TOWERS.get(getattr(config, "model_type", None))
    if name is None:
        return None
    for path, module in model.named_modules():
        if path.split(".")[-1] == name:
            return path, module
    return None


NOT_LANGUAGE = {"qwen2_5_vl": ("visual",), "idefics3": ("vision_model", "connector")}
"""model_type -> the modules outside its language model (tower, connector): no LoRA adapter goes on them."""


def lora_excluded(model: Any) -> str | None:
    """PEFT's `exclude_modules` pattern for a vision-language model: every module under its vision tower and
    connector, so that LoRA adapts the language model only; None for a text model."""
    names = NOT_LANGUAGE.get(getattr(getattr(model, "config", None), "model_type", None))
    return rf"(.*\.)?({'|'.join(names)})(\..*)?" if names else None


def outside_language(model: Any) -> list[Any]:
    """The trainable parameters of a vision-language model's vision tower and connector (NOT_LANGUAGE), through
    PEFT's wrapper; [] for a text model. Looked up at each call: FSDP2 swaps a module's parameters between their
    sharded and unsharded forms."""
    names = NOT_LANGUAGE.get(getattr(getattr(model, "config", None), "model_type", None), ())
    found = []
    for path, module in model.named_modules():
        if path.split(".")[-1] in names:
            found += [p for p in module.parameters() if p.requires_grad]
    return found
