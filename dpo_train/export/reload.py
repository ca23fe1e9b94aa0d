"""An export loaded back as a user loads it, before it is moved into place: it must hold the weights it was given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpo_state.bitwise import bitwise_difference

SHOWN = 4
"""Keys named per kind of difference; the rest are counted."""


def reload_difference(model: Any, staging: Path, written: dict[str, Any], dtype: Any) -> list[str]:
    """What the export of `model` in `staging` does not hold of `written` (the state dict it was saved from, in
    the export dtype), one line per kind ([] when nothing): a whole model is loaded by its config's architecture
    class with `from_pretrained`, as a user loads it (so a weight its save drops, renames or ties is found); a PEFT
    adapter's weights by PEFT's own reader, against the adapter's part of `written`."""
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict
        from peft.utils import load_peft_weights

        adapter = get_peft_model_state_dict(model, state_dict=written)
        return _differences(adapter, load_peft_weights(str(staging), device="cpu"))
    import transformers

    config = transformers.AutoConfig.from_pretrained(staging)
    model = getattr(transformers, config.architectures[0]).from_pretrained(staging, dtype=dtype)
    return _differences(written, model.state_dict())


def _differences(written: dict[str, Any], read: dict[str, Any]) -> list[str]:
    lines = [
        f"{what}: {_named(sorted(keys))}"
        for what, keys in (
            ("missing from the export", written.keys() - read.keys()),
            ("in the export but not written", read.keys() - written.keys()),
        )
        if keys
    ]
    both = sorted(written.keys() & read.keys())
    differing = [d for key in both if (d := bitwise_difference(key, written[key], read[key]))]
    more = [f"and {len(differing) - SHOWN} more tensors differ"] if len(differing) > SHOWN else []
    return lines + differing[:SHOWN] + more


def _named(keys: list[str]) -> str:
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return ", ".join(keys[:SHOWN]) + more
