"""LoRA through PEFT: adapters on the policy, their settings, and a merged export."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import torch

from dpo_state.installed import check_installed, environment
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


def run_environment(lora: dict | None) -> dict[str, str]:
    """The Python and library releases a run's checkpoints and model card record: PEFT's too with model.lora."""
    return environment("lora" if lora else None)


def apply_lora(model: Any, lora: dict) -> Any:
    """The PEFT model around `model`: adapters on `target_modules` (of a vision-language model's language model
    only), every base weight frozen. The adapters' B matrices start at zero, so before the first step the policy
    equals the base model (the reference)."""
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("model.lora needs PEFT: pip install 'dpo-toolkit[lora]' (or pip install peft)")
    check_installed("lora")
    from peft import LoraConfig, get_peft_model

    from dpo_train.vision.families import lora_excluded

    settings = lora_settings(lora)
    config = LoraConfig(
        r=settings["r"],
        lora_alpha=settings["alpha"],
        lora_dropout=settings["dropout"],
        target_modules=settings["target_modules"],
        exclude_modules=lora_excluded(model),  # a vision-language model's tower and connector: language model only
        task_type="CAUSAL_LM",
    )
    shared = _shared_weights(model)  # before PEFT wraps the targets
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:  # PEFT names the modules it could not find
        raise ConfigError(f"model.lora.target_modules {settings['target_modules']!r}: {e}") from None
    _refuse_tied_targets(peft_model, shared, settings["target_modules"])
    return peft_model


def _shared_weights(model: Any) -> dict[str, list[str]]:
    """Each module whose weight another module also uses (tied word embeddings: embed_tokens and
    lm_head), mapped to the names of those others."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            owners.setdefault(id(weight), []).append(name)
    return {name: [o for o in group if o != name] for group in owners.values() if len(group) > 1 for name in group}


def _refuse_tied_targets(peft_model: Any, shared: dict[str, list[str]], targets: Any) -> None:
    """An adapter on a tied layer changes one of its uses only, while merging it (train.export merged or
    both, or PEFT's merge_and_unload later) writes the change into the one shared weight, so into every
    use: the merged model would not be the model trained. Refused, naming the layers."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = peft_model.get_base_model()
    tied = [(n, shared[n]) for n, m in base.named_modules() if isinstance(m, BaseTunerLayer) and n in shared]
    if tied:
        named = "; ".join(f"{n} shares its weight with {', '.join(others)}" for n, others in tied)
        raise ConfigError(
            f"model.lora.target_modules {targets!r} adapts a tied layer ({named}: the model ties its word "
            "embeddings). The adapter would change one use of the shared weight and a merge would change all of "
            "them, so a merged model would not be the trained one; drop those layers from target_modules "
            "(all-linear never takes them)"
        )


def merged_model(base: Any, lora: dict, state: dict) -> Any:
    """A plain HF model: a fresh `base` (the same architecture), the trained adapter and base weights of
    `state` (a full state dict of the PEFT model) loaded into it, then the adapters merged in by PEFT."""
    peft_model = apply_lora(base, lora)
    peft_model.load_state_dict(state, strict=True)
    return peft_model.merge_and_unload()
