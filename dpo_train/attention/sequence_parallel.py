"""Sequence parallelism: one packed row split by position over a group of ranks (Ulysses x context), pairs whole.

The mesh is world = dp x context x ulysses; global rank = (dp * C + c) * U + u. The U x C ranks of one
sequence-parallel group get the same micro-batch (the loader is asked for dp ranks only) and each
keeps the positions [k * s, (k + 1) * s) of the row, k = c * U + u, s = S / (U x C), where S is the row
length padded to a multiple of U x C with padding that belongs to no pair.

Inside attention (the function registered as ATTENTION):
- Ulysses: an all-to-all turns "all heads, my s positions" into "H / U heads, the U x s positions of my
  context chunk", and back after attention;
- context: keys and values of the whole row are all-gathered within the context group, and a mask
  keeps each query to earlier keys of its own segment (segments apart, causal across the cut).
Everything else in the model is position-wise, so it runs on the local positions only. Labels are
pre-shifted, so each target's log-prob needs one position's logits, on whichever rank holds it; per-pair
sums are completed with one sum over the group (`collectives.sum_same_loss`) before the objective,
which every rank of the group then computes identically. See docs/objective.md, "Sequence parallelism".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dpo_data.errors import DataError
from dpo_train.attention import segments
from dpo_train.attention.features import LayerAttention, call_attention
from dpo_train.attention.kernel import attend, expand_kv
from dpo_train.attention.masks import segment_mask
from dpo_train.attention.temperature import by_position, tuned
from dpo_train.errors import ConfigError, ModelError
from dpo_train.parallel import collectives

ATTENTION = "dpo_sequence_parallel"
"""The attention implementation name a sequence-parallel model runs with (registered with transformers)."""


@dataclass(frozen=True)
class SequenceMesh:
    """Where this rank sits in world = dp x context x ulysses, and its process groups (None when size 1)."""

    dp_rank: int
    dp_size: int
    ulysses: int = 1
    context: int = 1
    ulysses_rank: int = 0
    context_rank: int = 0
    ulysses_group: Any = None
    context_group: Any = None
    group: Any = None  # the U x C ranks that share one row

    @property
    def size(self) -> int:
        return self.ulysses * self.context

    @property
    def rank(self) -> int:
        """This rank's slice of the row, 0 .. U x C - 1."""
        return self.context_rank * self.ulysses + self.ulysses_rank

    @property
    def active(self) -> bool:
        return self.size > 1

    @property
    def counts_pairs(self) -> bool:
        """One rank of each group reports the group's pairs in step metrics and score tables: every rank
        of the group holds the same complete per-pair values, and a pair is counted once."""
        return self.rank == 0


def sequence_mesh(rank: int, world: int, ulysses: int = 1, context: int = 1) -> SequenceMesh:
    """This rank's mesh; with U x C > 1 it creates the process groups (every rank must call it)."""
    size = ulysses * context
    if world % size:
        raise ConfigError(
            f"distributed.sequence_parallel: ulysses {ulysses} x context {context} = {size} must divide the "
            f"world size {world}; launch a multiple of {size} processes or change ulysses/context"
        )
    dp_size = world // size
    if size == 1:
        return SequenceMesh(rank, world)
    dp, inner = divmod(rank, size)
    c, u = divmod(inner, ulysses)

    def at(d: int, cc: int, uu: int) -> int:
        return (d * context + cc) * ulysses + uu

    def groups(enumeration: list[list[int]]) -> Any:
        # every rank creates every group, in the same order (torch.distributed requires it)
        mine, _ = dist.new_subgroups_by_enumeration(enumeration)
        return mine

    u_group = groups([[at(d, cc, uu) for uu in range(ulysses)] for d in range(dp_size) for cc in range(context)])
    c_group = groups([[at(d, cc, uu) for cc in range(context)] for d in range(dp_size) for uu in range(ulysses)])
    group = groups([list(range(d * size, (d + 1) * size)) for d in range(dp_size)])
    return SequenceMesh(dp, dp_size, ulysses, context, u, c, u_group, c_group, group)


def run_mesh(config: Any, rank: int, world: int) -> SequenceMesh:
    """The mesh `distributed.sequence_parallel` asks for."""
    ulysses, context = config.distributed.sequence_sizes
    return sequence_mesh(rank, world, ulysses, context)


def check_heads(model_config: Any, ulysses: int) -> None:
    """Ulysses hands each rank H / U query heads and K / U key/value heads: both must divide (the decoder's
    heads: a vision-language model's text config)."""
    if hasattr(model_config, "get_text_config"):
        model_config = model_config.get_text_config()
    heads = int(model_config.num_attention_heads)
    kv_heads = getattr(model_config, "num_key_value_heads", None) or getattr(model_config, "num_kv_heads", None)
    kv_heads = int(1 if getattr(model_config, "multi_query", False) else kv_heads or heads)  # GPTBigCode: MQA
    if heads % ulysses or kv_heads % ulysses:
        raise ConfigError(
            f"distributed.sequence_parallel.ulysses {ulysses} must divide the model's attention heads "
            f"({heads}) and key/value heads ({kv_heads}); use a ulysses that divides both, or context "
            "parallelism (sequence_parallel.context), which has no head constraint"
        )


@dataclass
class SequenceShard:
    """One row's split: this rank keeps positions [start, stop) of the row padded to a multiple of U x C.
    `mask(layer, dtype)` [1, 1, S / C, S] says which keys each query of this rank's context chunk may
    attend to under that layer's window and chunk."""

    mesh: SequenceMesh
    start: int
    stop: int
    batch: dict
    queries: torch.Tensor
    extra: int
    _masks: dict = field(default_factory=dict)

    @property
    def positions(self) -> torch.Tensor:
        """[stop - start] this rank's tokens' positions in their own sequences (row padding from 0)."""
        positions = self.batch["position_ids"][0]
        padding = torch.arange(self.extra, dtype=positions.dtype, device=positions.device)
        return torch.cat([positions, padding])[self.start : self.stop]

    def mask(self, layer: LayerAttention, dtype: torch.dtype) -> torch.Tensor:
        """The layer's mask as 0 / -inf in `dtype`, made once per row and layer kind and shared by every
        layer of that kind: given a boolean mask, sdpa makes (and keeps for backward) such a copy in every layer."""
        key = (layer.window, layer.chunk, dtype)
        if key not in self._masks:
            self._masks[key] = self._additive(self.queries, layer, dtype)
        return self._masks[key]

    def attend(self, query, key, value, layer, scaling, sinks, dropout) -> torch.Tensor:
        """Attention of this rank's queries [B, H, Q, D] over the whole row's keys. A mask of more than
        `segments.MASK_LIMIT` elements ([Q, S]: this rank's share of a long row, every key) is never made whole:
        the queries go in blocks of `segments.BLOCK_ROWS` rows, each block's mask made for it and, with its
        attention, recomputed in backward (a checkpoint), so that one block's [rows, S] lives at a time."""
        rows = query.shape[-2]
        if rows * key.shape[-2] <= segments.MASK_LIMIT:
            return attend(query, key, value, self.mask(layer, query.dtype), layer, scaling, sinks, dropout)

        def block(first: int) -> tuple:
            return query[..., first : first + segments.BLOCK_ROWS, :], key, value, first, layer, scaling, sinks, dropout

        # the query may need no gradient while the keys do (LoRA on v_proj only): grad mode, not requires_grad
        return segments.in_row_blocks(rows, block, self._block, torch.is_grad_enabled())

    def _block(self, query, key, value, first, layer, scaling, sinks, dropout) -> torch.Tensor:
        """The queries from row `first` on, with their own rows of the mask."""
        mask = self._additive(self.queries[first : first + query.shape[-2]], layer, query.dtype)
        return attend(query, key, value, mask, layer, scaling, sinks, dropout)

    def _additive(self, queries: torch.Tensor, layer: LayerAttention, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, len(queries), S] of 0 (visible) and dtype's lowest (hidden)."""
        visible = segment_mask(self.batch, queries, self.extra, layer)[None, None]
        zero = torch.zeros((), dtype=dtype, device=visible.device)
        return torch.where(visible, zero, torch.finfo(dtype).min)


def split_row(batch: dict, mesh: SequenceMesh) -> tuple[dict, SequenceShard]:
    """This rank's model inputs (input_ids and position_ids of its positions) and its shard.

    The row is padded to a multiple of U x C with tokens of their own segment (id 0, never a pair's);
    every existing segment, a one-token one included, keeps its identity and positions.
    """
    ids, positions = batch["input_ids"][0], batch["position_ids"][0]
    length = int(ids.shape[0])
    extra = -length % mesh.size
    if extra:
        ids = torch.cat([ids, ids.new_zeros(extra)])
        positions = torch.cat([positions, torch.arange(extra, dtype=positions.dtype, device=positions.device)])
    padded = length + extra
    s = padded // mesh.size
    start = mesh.rank * s
    chunk = padded // mesh.context
    queries = torch.arange(mesh.context_rank * chunk, (mesh.context_rank + 1) * chunk, device=ids.device)
    inputs = {"input_ids": ids[None, start : start + s], "position_ids": positions[None, start : start + s]}
    return inputs, SequenceShard(mesh, start, start + s, batch, queries, extra)


def check_same_row(batch: dict, mesh: SequenceMesh, step: int) -> None:
    """Every rank of a group must hold the same row, labels and segments; a cheap signature (sizes and
    position-weighted sums) is compared with one max all-reduce of (signature, -signature)."""
    ids, labels = batch["input_ids"][0].long().cpu(), batch["labels"][0].long().cpu()
    weight = torch.arange(1, ids.shape[0] + 1, dtype=torch.int64)
    lengths = batch["segment_length"].long().cpu()
    signature = torch.stack(
        [
            torch.tensor(ids.shape[0]),
            (ids * weight).sum(),
            (labels * weight).sum(),
            batch["position_ids"][0].long().cpu().sum(),
            (lengths * torch.arange(1, len(lengths) + 1)).sum(),
            (batch["segment_role"].long().cpu() * torch.arange(1, len(lengths) + 1)).sum(),
            batch["pair_index"].long().cpu().sum(),
            torch.tensor(int(batch["step_pairs"])),
        ]
    )
    lo, hi = collectives.spread(signature, group=mesh.group)
    if not torch.equal(lo, hi):
        raise DataError(
            f"step {step}, micro-batch {batch.get('microbatch')}: the ranks of sequence-parallel group "
            f"{mesh.dp_rank} hold different rows (input ids, labels or segments); every rank of a group "
            "must get the same micro-batch: ask the loader for data-parallel ranks only "
            "(LoaderConfig rank = dp rank, world_size = dp size; docs/objective.md)"
        )


def sequence_parallel_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sequence_shard: SequenceShard | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the whole row for this rank's positions, with the layer's window, chunk, softcap
    and sinks (a rank holding H / U heads under Ulysses takes those heads' sinks); [B, H, s, D] in,
    [B, s, H, D] out."""
    if sequence_shard is None:
        raise ModelError(
            f"{type(module).__name__} was called without its sequence shard: its layers do not pass the model's "
            "keyword arguments on to their attention, so distributed.sequence_parallel cannot run this model; "
            "remove distributed.sequence_parallel (model.attention auto then takes a path its probe checked)"
        )
    layer, sinks = call_attention(module, "sequence parallel", kwargs)
    if tuned(module):  # before the exchange: the query is this rank's positions, scaled by their local index
        query = by_position(module, query, sequence_shard.positions)
    mesh = sequence_shard.mesh
    if mesh.ulysses > 1:
        query, key, value = (_heads_to_sequence(x, mesh) for x in (query, key, value))
        if sinks is not None:
            sinks = sinks.chunk(mesh.ulysses)[mesh.ulysses_rank]
    if mesh.context > 1:
        key, value = (_gather_sequence(x, mesh) for x in (key, value))
    key, value = expand_kv(query, key, value)
    out = sequence_shard.attend(query, key, value, layer, scaling, sinks, dropout)
    if mesh.ulysses > 1:
        out = _sequence_to_heads(out, mesh)
    return out.transpose(1, 2).contiguous(), None


def _heads_to_sequence(x: torch.Tensor, mesh: SequenceMesh) -> torch.Tensor:
    """[B, H, s, D] (all heads, my positions) -> [B, H / U, U s, D] (my heads, my context chunk)."""
    b, h, s, d = x.shape
    u = mesh.ulysses
    got = collectives.exchange(x.reshape(b, u, h // u, s, d).transpose(0, 1), mesh.ulysses_group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * s, d)


def _sequence_to_heads(x: torch.Tensor, mesh: SequenceMesh) -> torch.Tensor:
    """The inverse of `_heads_to_sequence`."""
    b, h, n, d = x.shape
    u = mesh.ulysses
    got = collectives.exchange(x.reshape(b, h, u, n // u, d).permute(2, 0, 1, 3, 4), mesh.ulysses_group)
    return got.transpose(0, 1).reshape(b, u * h, n // u, d)


def _gather_sequence(x: torch.Tensor, mesh: SequenceMesh) -> torch.Tensor:
    """[B, h, S / C, D] -> [B, h, S, D]: every context rank's chunk, in order."""
    return collectives.gather_chunks(x.permute(2, 0, 1, 3), mesh.context_group).permute(1, 2, 0, 3)


def register() -> None:
    """Make ATTENTION a transformers attention implementation (idempotent). It is not a mask
    implementation, so transformers builds no mask for it: the shard carries its own."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, sequence_parallel_attention)
