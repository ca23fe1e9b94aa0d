"""What a model's attention applies, per layer: sliding window, chunk, logit softcap, sinks (and what a call passed)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from dpo_train.attention import temperature
from dpo_train.errors import ModelError

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED)
"""The `config.layer_types` entries that are attention; any other entry ("conv", "linear_attention",
"mamba", ...) is a sequence mixer that does not see packed segment boundaries."""

# Keyword arguments transformers (or PEFT) passes to an attention function that change nothing about the
# result: the positions (rotary embeddings are applied before the call), cache, router and output flags.
_INERT = frozenset(
    {"position_ids", "use_cache", "output_router_logits", "cache_position", "past_key_values", "output_hidden_states"}
)


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention pattern beyond full causal: a query at position p sees keys at positions q
    with q <= p, p - q < window (transformers' sliding window), p // chunk == q // chunk (chunked); and
    the scores are soft-capped, tanh(s / softcap) * softcap, before the mask."""

    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None

    @property
    def restricts_keys(self) -> bool:
        return self.window is not None or self.chunk is not None


FULL_CAUSAL = LayerAttention()


def layer_kinds(config: Any) -> list[str]:
    """Each decoder layer's kind: `config.layer_types` where the model has them; else every layer is
    sliding when the config has an active `sliding_window`, chunked with `attention_chunk_size`, else full."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)
    count = int(getattr(config, "num_hidden_layers", 0) or 0)
    if getattr(config, "attention_chunk_size", None):
        return [CHUNKED] * count
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False:
        return [SLIDING] * count
    return [FULL] * count


def kind_attention(config: Any, kind: str) -> LayerAttention:
    """The pattern of every layer of `kind` (as the model's mask functions build it)."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if kind == SLIDING:
        return LayerAttention(window=int(config.sliding_window), softcap=softcap)
    if kind == CHUNKED:
        return LayerAttention(chunk=int(config.attention_chunk_size), softcap=softcap)
    return LayerAttention(softcap=softcap)


def call_attention(module: Any, path: str, kwargs: dict) -> tuple[LayerAttention, Any]:
    """The pattern and the sink logits (GPT-OSS `s_aux`, one per head, or None) one attention call asks
    for. Every keyword is accounted for: one this path does not know is an error, never dropped."""
    if kwargs.get("output_attentions"):
        raise ModelError(f"attention path {path} returns no attention weights; call the model without them")
    unknown = sorted(set(kwargs) - _INERT - {"sliding_window", "softcap", "s_aux", "is_causal", "output_attentions"})
    if unknown:
        raise ModelError(
            f"attention path {path} got keyword argument(s) {', '.join(unknown)} from {type(module).__name__}, "
            "which it does not know how to apply; run model.attention eager (the model's own attention), "
            "or report the model so the path learns them"
        )
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ModelError(
            f"{type(module).__name__} runs bidirectional attention (is_causal false); DPO needs a causal language model"
        )
    window, chunk = kwargs.get("sliding_window"), None
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    kinds = getattr(config, "layer_types", None)
    if kinds and index is not None:
        kind = kinds[index]
        if kind == CHUNKED:
            chunk = int(config.attention_chunk_size)
        elif kind == SLIDING and window is None:
            raise ModelError(
                f"layer {index} of {type(module).__name__} is a sliding-window layer but passed no "
                f"sliding_window to attention path {path}; use model.attention auto (its start-up probe takes a path "
                "it checked exact for the model)"
            )
    return LayerAttention(window=window, chunk=chunk, softcap=kwargs.get("softcap")), kwargs.get("s_aux")


@dataclass(frozen=True)
class ModelAttention:
    """What a loaded model's layers need from an attention path, each feature with the first layer
    that needs it (for the error that names it)."""

    window: int | None  # first sliding layer
    chunk: int | None  # first chunked layer
    softcap: int | None  # first soft-capped layer
    sinks: int | None  # first layer with sink logits
    mixers: tuple[tuple[int, str], ...]  # (layer, kind) of every non-attention sequence mixer
    temperature: int | None = None  # first layer scaling its queries by position (Llama 4's NoPE layers)

    def needs(self) -> dict[str, int]:
        """feature -> first layer, for the features present."""
        found = {"sliding window": self.window, "chunked attention": self.chunk}
        found |= {"attention logit softcapping": self.softcap, "attention sinks": self.sinks}
        found |= {"temperature tuning": self.temperature}
        return {name: layer for name, layer in found.items() if layer is not None}


def model_attention(model: Any) -> ModelAttention:
    """The features of a loaded model (a PEFT or DDP wrapper is looked through)."""
    config = text_config(model)
    kinds = layer_kinds(config)
    first = lambda wanted: next((i for i, kind in enumerate(kinds) if kind == wanted), None)
    # the attention modules that hand a softcap to the attention call keep it (Gemma2's family); the config
    # key alone is not enough: a Llama given `attn_logit_softcapping` ignores it, and sdpa runs it exactly
    capped = (getattr(m, "layer_idx", 0) for m in model.modules() if getattr(m, "attn_logit_softcapping", None))
    softcap = next(capped, None)
    sinks = next((_layer_of(name) for name, _ in model.named_parameters() if name.endswith("self_attn.sinks")), None)
    mixers = tuple((i, kind) for i, kind in enumerate(kinds) if kind not in ATTENTION_KINDS)
    tuned = (getattr(m, "layer_idx", 0) for m in model.modules() if temperature.tuned(m))
    return ModelAttention(first(SLIDING), first(CHUNKED), softcap, sinks, mixers, next(tuned, None))


def wrapped(model: Any) -> tuple[Any, ...]:
    """`model` and what it may wrap: DDP's `.module`, the LoRA reference's `.model` (None where absent)."""
    return model, getattr(model, "module", None), getattr(model, "model", None)


def model_config(model: Any) -> Any:
    """A Hugging Face model's config, through the DDP (`.module`) and LoRA reference (`.model`) wrappers."""
    for candidate in wrapped(model):
        config = getattr(candidate, "config", None)
        if config is not None:
            return config
    raise AttributeError(f"{type(model).__name__} has no config")


def text_config(model: Any) -> Any:
    """The decoder's config (a multimodal model's text part)."""
    config = model_config(model)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layer_of(name: str) -> int:
    """`model.layers.3.self_attn.sinks` -> 3."""
    parts = name.split(".")
    return int(next(p for p in parts if p.isdigit()))


@contextmanager
def attention_as(config: Any, implementation: str | None) -> Iterator[None]:
    """Meanwhile, the model of `config` (a decoder's `text_config`, or a model's) runs attention `implementation`
    (None: as it is), and afterwards what it ran before: the one swap of transformers' `_attn_implementation` that
    the start-up checks, the truths and the alone check make."""
    saved = config._attn_implementation
    if implementation is not None:
        config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = saved


def computes_router_loss(model: Any) -> bool:
    """Whether the model returns a router load-balancing loss (`aux_loss`) when asked for router logits: a
    two-token forward without gradients, in eval mode. Some mixture-of-experts models have the config key
    but no such loss (Llama 4, GLM-4-MoE, dots1, Hunyuan-MoE, EXAONE-MoE): TRL adds nothing for them either."""
    device, training = next(model.parameters()).device, model.training
    try:  # eager: the forward runs alone, without the row a packed path needs
        with attention_as(model_config(model), "eager"), torch.no_grad():
            out = model.eval()(input_ids=torch.ones(1, 2, dtype=torch.long, device=device), output_router_logits=True)
    finally:
        model.train(training)
    return getattr(out, "aux_loss", None) is not None
