"""The unpacked path: a packed row run as a right-padded batch, one sequence a row, through the model's attention."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from dpo_data.progress import say
from dpo_train.attention.features import ATTENTION_KINDS, attention_as, layer_kinds, model_config, text_config

ATTENTION = "unpacked"
"""`model.attention: unpacked` (and auto's choice for a model packing cannot serve)."""

ALIBI_MODEL_TYPES = frozenset({"bloom"})
"""Model types whose attention is ALiBi by design (no config flag says so)."""


def alibi(config: Any) -> bool:
    """Whether the model biases attention by ALiBi: Falcon's `alibi`, MPT's `attn_config.alibi`, Bloom always.
    Its bias is built from the 2D attention mask's running count, never from `position_ids`, so a packed
    row would give a segment the distances of the whole row."""
    attn_config = getattr(config, "attn_config", None)
    if isinstance(attn_config, dict):
        mpt = attn_config.get("alibi", False)
    else:
        mpt = getattr(attn_config, "alibi", False)
    return bool(getattr(config, "alibi", False) or mpt or getattr(config, "model_type", None) in ALIBI_MODEL_TYPES)


def eager_wrong(config: Any) -> bool:
    """Whether transformers' eager attention is not the model (so the truth runs sdpa): Falcon with ALiBi,
    whose eager attention in transformers 5.24 adds the bias twice (as `alibi`, and again folded into the
    mask), while its sdpa adds it once, as Falcon's own code did."""
    return getattr(config, "model_type", None) == "falcon" and bool(getattr(config, "alibi", False))


def default_attention(model: Any) -> str:
    """transformers' default attention for the model's class, the one the unpacked path and step 1's alone check
    run: sdpa where the class has it (and where its eager attention is known wrong: Falcon with ALiBi), else eager
    (Gemma2, GPT-OSS, Bloom). Found under DDP's and PEFT's wrappers."""
    from transformers import PreTrainedModel

    loaded = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    return "sdpa" if eager_wrong(model_config(loaded)) or type(loaded)._supports_sdpa else "eager"


@contextmanager
def eager_attention(model: Any) -> Iterator[None]:
    """Meanwhile, the model's decoder runs transformers' eager attention, or its sdpa where eager is known not
    to be the model (`eager_wrong`: Falcon with ALiBi); a vision-language model's tower keeps its own. A backward
    that recomputes checkpointed layers needs it too."""
    config = text_config(model)
    with attention_as(config, "sdpa" if eager_wrong(config) else "eager"):
        yield


def reason(config: Any) -> str | None:
    """Why packing cannot keep this model's segments apart, in words, or None when it can."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    mixers = [(i, kind) for i, kind in enumerate(layer_kinds(config)) if kind not in ATTENTION_KINDS]
    if mixers:
        layer, kind = mixers[0]
        return (
            f"layer {layer} is a '{kind}' layer, a sequence mixer that carries state from one token to the "
            "next without seeing segment boundaries"
        )
    if alibi(config):
        return "its ALiBi attention bias is built from the row's attention mask, not from the segments' positions"
    return None


def note(model: Any, why: str) -> None:
    """The one stderr line saying packing is off for this model (rank 0 only under torchrun)."""
    if os.environ.get("RANK", "0") != "0":
        return
    say(
        f"note: {type(model).__name__}: packing is off for this model ({why}); model.attention unpacked runs "
        "each chosen and rejected sequence alone in a right-padded batch, through the model's own "
        f"{model_config(model)._attn_implementation} attention: exact, but it costs the padding to each "
        "micro-batch's longest sequence, and a shared prompt is run once per completion (docs/train-config.md)"
    )


@dataclass(frozen=True)
class UnpackedRow:
    """A packed row as a padded batch: `inputs` [N, L] for the model, and `where[t]`, for each position t of
    the packed row, the flat index n * L + column of that token in the first sequence holding it (-1: in
    none: row padding, or a segment of no pair)."""

    inputs: dict
    where: torch.Tensor
    shape: tuple[int, int]
    row_start: torch.Tensor
    """[segments] for each chosen or rejected segment, the flat index of its sequence's first column; -1 for
    other segments."""

    @property
    def lengths(self) -> torch.Tensor:
        """[N, 1] each row's sequence length (a length-dependent rope's, `dpo_train.attention.rope`)."""
        return self.inputs["attention_mask"].sum(-1, keepdim=True)

    def keep(self, positions: torch.Tensor, segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat index of each target's position, the [N, L] boolean `logits_to_keep` that keeps them): only the
        positions that predict a target reach the vocabulary head. Each target (`segments`: the segment it
        counts for) is read in its own segment's sequence: a completion's first token, predicted from its
        shared prompt's last position, there too, where the prompt ran as it runs alone with that completion
        (a length-dependent rope rotates the prompt by the whole sequence's length)."""
        first = self.where[positions]  # a shared prompt's column is the same in each sequence that holds it
        row = self.row_start[segments]
        flat = torch.where(row >= 0, row + first % self.shape[1], first)
        keep = torch.zeros(self.shape[0] * self.shape[1], dtype=torch.bool, device=flat.device)
        keep[flat] = True
        return flat, keep


def sequences(batch: dict[str, Any]) -> list[list[int]]:
    """The segments of each sequence to run alone: every chosen or rejected segment (roles 0 and 1), after
    its context segment in the shared-prompt layout (the pair's prompt: positions then run on from it, as
    in the packed row). Padding and prompt segments are no sequence of their own."""
    roles = batch["segment_role"].tolist()
    context = batch["segment_context"].tolist() if "segment_context" in batch else [-1] * len(roles)
    return [([context[s]] if context[s] >= 0 else []) + [s] for s, role in enumerate(roles) if role in (0, 1)]


def unpack(batch: dict[str, Any]) -> UnpackedRow:
    """The padded batch of a packed row (right padding, so each sequence's positions run from 0 and its
    causal layers, attention or not, never see a padding token before a real one)."""
    ids = batch["input_ids"][0]
    device, length = ids.device, int(ids.shape[0])
    lengths, starts = batch["segment_length"].tolist(), batch["cu_seqlens"][:-1].tolist()
    groups = sequences(batch)
    if not groups:  # a micro-batch without pairs: its padding row as one sequence, so the forward still runs
        ones = torch.ones_like(ids)[None]
        where = torch.full((length,), -1, dtype=torch.long, device=device)
        none = torch.full((len(lengths),), -1, dtype=torch.long, device=device)
        inputs = {"input_ids": ids[None], "attention_mask": ones, "use_cache": False}
        return UnpackedRow(inputs, where, (1, length), none)
    spans = [torch.cat([torch.arange(starts[s], starts[s] + lengths[s], device=device) for s in g]) for g in groups]
    width = max(len(span) for span in spans)
    # id 0 fills the padding: any id in the vocabulary does, the attention mask hides it
    input_ids = ids.new_zeros(len(spans), width)
    attention_mask = torch.zeros(len(spans), width, dtype=torch.long, device=device)
    where = torch.full((length,), -1, dtype=torch.long, device=device)
    row_start = torch.full((len(lengths),), -1, dtype=torch.long, device=device)
    for row, group in enumerate(groups):  # a chosen or rejected segment is its group's last
        row_start[group[-1]] = row * width
    for n, span in enumerate(reversed(spans)):  # reversed: a shared prompt keeps its first sequence's index
        row = len(spans) - 1 - n
        input_ids[row, : len(span)] = ids[span]
        attention_mask[row, : len(span)] = 1
        where[span] = row * width + torch.arange(len(span), device=device)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
    return UnpackedRow(inputs, where, (len(spans), width), row_start)
