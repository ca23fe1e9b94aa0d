"""FlexAttention over a packed row: one block mask per micro-batch and layer kind, one kernel call per layer."""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from dpo_data.progress import say
from dpo_train.attention.features import LayerAttention, call_attention
from dpo_train.attention.segments import RowSegments, require_segments
from dpo_train.attention.temperature import by_position, tuned
from dpo_train.errors import ModelError

ATTENTION = "dpo_flex"
"""The transformers attention implementation name (`model.attention: flex`)."""
BLOCK = 128
"""FlexAttention's block of query rows and of keys (its default): a row is padded to a bucket of whole blocks."""
COMPILE_ENV = "DPO_FLEX_COMPILE"
"""0: never compile, run flex's unfused math everywhere (the same block mask and mods; for tests and debugging)."""
MASK_ELEMENTS = 2**22
"""Query rows x keys of the mask evaluated at once while a block mask is built: memory stays linear in the row."""
RECOMPILE_LIMIT = 64
"""torch.compile's guard-failure budget per function, raised to this: each bucket, dtype and layer kind is one
compiled kernel (dynamo's default of 8 would silently fall back to the unfused math past it)."""

_COMPILED: set[tuple] = set()  # the kernels this process compiled (`compiles`)
_CPU_NOTED: list[bool] = []  # whether the CPU training note was said
_DROPPED: dict[str, str] = {}  # device type -> why its compiled kernel failed (the unfused math runs there)


@dataclass(frozen=True)
class Tokens:
    """Per token of a bucketed row: its segment, the segment it also sees (its context, -1 for none), its
    position in its own sequence. The bucket's padding tokens are one segment each: they see only themselves."""

    segment: torch.Tensor
    context: torch.Tensor
    position: torch.Tensor


def bucket(length: int) -> int:
    """The padded length a row of `length` tokens runs at: the next power of two, at least one BLOCK. Few
    buckets, so few compiled kernels; the padding's blocks are masked off but its own (each token sees itself)."""
    return max(BLOCK, 1 << (max(length, 1) - 1).bit_length())


def tokens(rows: RowSegments, length: int, device: torch.device) -> Tokens:
    """The row's per-token tensors padded to `length` (made once per row and device, kept on `rows`)."""
    key = ("flex tokens", length, device)
    if key not in rows._masks:
        sizes = torch.tensor([stop - start for start, stop in rows.bounds], dtype=torch.long)
        segment = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
        context = torch.repeat_interleave(torch.tensor(rows.context, dtype=torch.long), sizes)
        pad = length - len(segment)
        segment = torch.cat([segment, len(sizes) + torch.arange(pad)])
        context = torch.cat([context, torch.full((pad,), -1, dtype=torch.long)])
        position = torch.cat([rows.positions(device).cpu().long(), torch.zeros(pad, dtype=torch.long)])
        rows._masks[key] = Tokens(segment.to(device), context.to(device), position.to(device))
    return rows._masks[key]


def visible(row: Tokens, layer: LayerAttention) -> Callable:
    """The mask_mod: a key is visible when it is in the query's segment or in its context segment, not after it,
    within the layer's window and chunk, all in the positions of the unpacked sequences: what
    `dpo_train.attention.kernel.positions_visible` gives the segment path over a segment's keys."""
    segment, context, position = row.segment, row.context, row.position
    window, chunk = layer.window, layer.chunk

    def mask_mod(b: Any, h: Any, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        seen = ((segment[kv] == segment[q]) | (segment[kv] == context[q])) & (position[kv] <= position[q])
        if window is not None:
            seen = seen & (position[q] - position[kv] < window)
        if chunk is not None:
            seen = seen & (position[q] // chunk == position[kv] // chunk)
        return seen

    return mask_mod


def block_mask(rows: RowSegments, layer: LayerAttention, length: int, device: torch.device) -> BlockMask:
    """The row's BlockMask for every layer of `layer`'s kind (made once per row, kind and device, kept on `rows`):
    blocks no query of which sees a key of are skipped, blocks all of whose keys are seen run without the mask."""
    key = ("flex", layer.window, layer.chunk, length, device)
    if key not in rows._masks:
        rows._masks[key] = _from_mask_mod(visible(tokens(rows, length, device), layer), length, device)
    return rows._masks[key]


def _from_mask_mod(mask_mod: Callable, length: int, device: torch.device) -> BlockMask:
    """A BlockMask from `mask_mod` evaluated a band of query rows at a time (create_block_mask evaluates the whole
    [length, length] at once, several int64 tensors of that size: 2 GiB each at 16k tokens)."""
    blocks, keys = length // BLOCK, torch.arange(length, device=device)
    rows = max(BLOCK, MASK_ELEMENTS // length // BLOCK * BLOCK)
    partial, full = [], []
    for start in range(0, length, rows):
        queries = torch.arange(start, min(start + rows, length), device=device)
        seen = mask_mod(None, None, queries[:, None], keys[None, :]).view(-1, BLOCK, blocks, BLOCK)
        some, every = seen.any(dim=3).any(dim=1), seen.all(dim=3).all(dim=1)
        partial.append(some & ~every)
        full.append(every)
    return BlockMask.from_kv_blocks(
        *_ordered(torch.cat(partial)), *_ordered(torch.cat(full)), BLOCK_SIZE=BLOCK, mask_mod=mask_mod
    )


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[query blocks, key blocks] booleans -> (count per query block, key block indices, the marked first), each
    with batch and head dimensions of 1: BlockMask's form."""
    dense = dense.to(torch.int32)[None, None]
    order = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1).to(torch.int32), order.to(torch.int32).contiguous()


@functools.cache
def _softcap(softcap: float, device: torch.device) -> Callable:
    """The score_mod of a soft-capped layer, softcap * tanh(score / softcap), one per value and device (a kernel
    is kept per function: a new one per call would compile again). The cap is a captured tensor, not a float:
    dynamo would turn a second float value into a symbol, which flex's backward cannot trace."""
    cap = torch.tensor(softcap, dtype=torch.float32, device=device)

    def score_mod(score: torch.Tensor, b: Any, h: Any, q: Any, kv: Any) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return score_mod


def flex_segment_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    row_segments: RowSegments | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The row's attention in one FlexAttention call: the block mask of the layer's kind (`block_mask`), its
    softcap as a score_mod, grouped-query heads as they are, sinks from the log-sum-exp (`_with_sinks`), Llama 4's
    temperature tuning on the queries first. q, k, v are padded to the row's bucket and the output cut back.
    [B, H, S, D] in, [B, S, H, D] out."""
    require_segments(module, row_segments, "flex")
    layer, sinks = call_attention(module, "flex", kwargs)
    if dropout:
        raise ModelError(
            f"model.attention flex cannot apply attention dropout ({dropout} from {type(module).__name__}): "
            "FlexAttention has no dropout; training switches dropout off, so this is a forward in training mode "
            "with it on: use model.attention segments, which applies it"
        )
    if tuned(module):
        query = by_position(module, query, row_segments.positions(query.device))
    length = query.shape[2]
    padded = bucket(length)
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, padded - length)) for t in (query, key, value))
    mask = block_mask(row_segments, layer, padded, query.device)
    out, lse = _kernel(q, k, v, mask, layer, scaling, sinks is not None)
    out = out[:, :, :length]
    if sinks is not None:
        out = _with_sinks(out, lse[:, :, :length], sinks)
    return out.transpose(1, 2).contiguous(), None


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Sinks exactly: a sink logit s per head joins the softmax's denominator and is dropped after it, which
    scales the output by sum exp(scores) / (sum exp(scores) + exp(s)) = sigmoid(lse - s)."""
    scale = torch.sigmoid(lse.float() - sinks.float().reshape(1, -1, 1))
    return (out.float() * scale[..., None]).to(out.dtype)


def _kernel(q, k, v, mask: BlockMask, layer: LayerAttention, scaling, lse: bool) -> tuple[torch.Tensor, Any]:
    """(output, log-sum-exp or None) of one flex call: compiled where torch has a fused kernel for it, else the
    unfused math flex runs uncompiled (`_compiles`)."""
    options = {
        "score_mod": _softcap(layer.softcap, q.device) if layer.softcap is not None else None,
        "block_mask": mask,
        "scale": scaling,
        "enable_gqa": q.shape[1] != k.shape[1],
        "return_aux": AuxRequest(lse=True) if lse else None,
    }
    grad = any(t.requires_grad for t in (q, k, v))
    _raise_recompile_limit()
    result = None
    if _compiles(q.device, grad, lse):
        _count(q, k, v, layer, grad)
        try:
            result = _compiled()(q, k, v, **options)
        except torch.OutOfMemoryError:
            raise  # the unfused math would need more
        except Exception as e:  # noqa: BLE001 - a kernel torch cannot build for this call: the unfused math stands in
            _drop(q.device, e)
    if result is None:
        with _unfused(q.device, grad):
            result = flex_attention(q, k, v, **options)
    return (result[0], result[1].lse) if lse else (result, None)


def _compiles(device: torch.device, grad: bool, lse: bool) -> bool:
    """Whether this call takes the compiled kernel: on CUDA always; on the CPU torch 2.13 compiles inference only,
    without the log-sum-exp (so not a sink layer); never with DPO_FLEX_COMPILE=0."""
    if os.environ.get(COMPILE_ENV, "1") == "0" or device.type in _DROPPED:
        return False
    return device.type != "cpu" or not (grad or lse)


def _drop(device: torch.device, error: Exception) -> None:
    """A compile or compiled call that failed: the unfused math runs on this device type from now on (slower, the
    same numbers), said once on rank 0."""
    _DROPPED[device.type] = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
    if os.environ.get("RANK", "0") == "0":
        say(
            f"note: model.attention flex could not compile its kernel on {device.type} ({_DROPPED[device.type]}); "
            "its unfused math runs from now on, slower, with the same numbers"
        )


@functools.cache
def _compiled() -> Callable:
    """flex_attention compiled once for the process, static shapes: one kernel per bucket, dtype and layer kind."""
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _raise_recompile_limit() -> None:
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)


def _count(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerAttention, grad: bool) -> None:
    """Count the compiled kernels this process builds, saying each one on rank 0 (the first call of each takes
    seconds to minutes, so a slow step is explained where it happens)."""
    signature = (q.device.type, tuple(q.shape), tuple(k.shape), v.shape[-1], q.dtype, layer, grad)
    if signature in _COMPILED:
        return
    _COMPILED.add(signature)
    if os.environ.get("RANK", "0") == "0":
        kind = f"window {layer.window}" if layer.window else f"chunk {layer.chunk}" if layer.chunk else "full causal"
        say(
            f"note: model.attention flex compiles its kernel for rows of {q.shape[2]} tokens ({kind}, "
            f"{str(q.dtype).removeprefix('torch.')}, {'with' if grad else 'without'} gradients): "
            f"kernel {len(_COMPILED)} of this process"
        )


def compiles() -> int:
    """How many compiled kernels this process has built (each bucket, dtype, layer kind and gradient mode)."""
    return len(_COMPILED)


@contextmanager
def _unfused(device: torch.device, grad: bool) -> Iterator[None]:
    """Meanwhile flex runs uncompiled, quietly (its warning says to compile: `_compiles` decided not to). torch
    2.13 refuses CPU inputs that require gradients, because its fused CPU kernel has no backward; its unfused math
    differentiates on any device (tests/architectures/test_flex.py checks the gradients against the model's own
    eager attention), so for a CPU training call that refusal is lifted, the other checks kept."""
    module = importlib.import_module("torch.nn.attention.flex_attention")
    check = getattr(module, "_validate_device", None)  # a private check: a torch without it refuses nothing
    lift = device.type == "cpu" and grad and check is not None
    if lift:
        module._validate_device = lambda q, k, v: check(q.detach(), k.detach(), v.detach())
        _note_cpu_training()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
            yield
    finally:
        module._validate_device = check


def _note_cpu_training() -> None:
    """Say once (rank 0) that CPU training runs flex's unfused math: slower than model.attention segments."""
    if _CPU_NOTED or os.environ.get("RANK", "0") != "0":
        return
    _CPU_NOTED.append(True)
    say(
        "note: model.attention flex on the CPU: torch 2.13 compiles FlexAttention for inference only, so the training "
        "forward and backward run its unfused math, which holds each layer's [heads, row, row] scores; "
        "model.attention segments (auto's choice on the CPU) is faster there"
    )


def register() -> None:
    """Make ATTENTION a transformers attention implementation (idempotent). It has no mask function, so
    transformers builds no mask for it: the row's segments come as a keyword argument, as for the segment path."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, flex_segment_attention)
