"""LoRA through PEFT: adapters on the policy, and the reference as the same model with its adapters off."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

from dpo_train.errors import ConfigError

# PEFT asks transformers 5 for `is_gradient_checkpointing`, which warns of its rename on every call.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def lora_settings(lora: dict) -> dict:
    """`model.lora` with its defaults filled in: what the identity records and PEFT receives."""
    r = int(lora["r"])
    return {
        "r": r,
        "alpha": float(lora.get("alpha", 2 * r)),
        "dropout": float(lora.get("dropout", 0.0)),
        "target_modules": lora.get("target_modules", "all-linear"),
    }


def apply_lora(model: Any, lora: dict) -> Any:
    """The PEFT model around `model`: adapters on `target_modules`, every base weight frozen. The adapters'
    B matrices start at zero, so before the first step the policy equals the base model (the reference)."""
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("model.lora needs PEFT: pip install 'dpo-toolkit[lora]' (or pip install peft)")
    from peft import LoraConfig, get_peft_model

    settings = lora_settings(lora)
    config = LoraConfig(
        r=settings["r"],
        lora_alpha=settings["alpha"],
        lora_dropout=settings["dropout"],
        target_modules=settings["target_modules"],
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # PEFT names the modules it could not find
        raise ConfigError(f"model.lora.target_modules {settings['target_modules']!r}: {e}") from None


class AdaptersDisabled:
    """The live reference under LoRA: the policy itself, called with its adapters disabled, without
    gradients. No second copy of the weights exists; under FSDP2 it all-gathers the policy's shards.

    PEFT's own `disable_adapter()` also switches the adapters' `requires_grad` off and on again; under
    FSDP2 that flag lands on other parameter objects than the sharded ones the optimizer and the
    checkpoint see, and a saved checkpoint came out without its adapters. So the layers' switch alone
    is flipped here: the flag every PEFT tuner layer reads in its forward (`disable_adapters`)."""

    def __init__(self, model: Any):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    def __call__(self, *args, **kwargs):
        try:
            for layer in self.layers:
                layer._disable_adapters = True
            return self.model(*args, **kwargs)
        finally:
            for layer in self.layers:
                layer._disable_adapters = False

    def parameters(self):
        return self.model.parameters()

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> AdaptersDisabled:
        self.model.train(mode)
        return self

    def eval(self) -> AdaptersDisabled:
        return self.train(False)


def merged_model(base: Any, lora: dict, state: dict) -> Any:
    """A plain HF model: a fresh `base` (the same architecture), the trained adapter and base weights of
    `state` (a full state dict of the PEFT model) loaded into it, then the adapters merged in by PEFT."""
    peft_model = apply_lora(base, lora)
    peft_model.load_state_dict(state, strict=True)
    return peft_model.merge_and_unload()
