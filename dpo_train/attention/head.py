"""The vocabulary head in chunks: each target's log-prob from the final hidden states, never holding more than one
chunk of logits, in forward and in backward (which recomputes each chunk's logits instead of keeping them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Head:
    """A causal LM's head as its forward applies it: logits = softcap(linear(hidden) * multiply / divide)."""

    weight: torch.Tensor
    """[vocab, hidden]: the output embedding (the input embedding itself when tied)."""
    bias: torch.Tensor | None = None
    multiply: float | None = None
    """Cohere's `logit_scale`: logits multiplied by it."""
    divide: float | None = None
    """Granite's `logits_scaling`: logits divided by it."""
    softcap: float | None = None
    """Gemma 2/3's `final_logit_softcapping`: cap * tanh(logits / cap), after the scaling."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of `hidden` [rows, hidden], in float32 at least (as `pair_logps` promotes them)."""
        z = self.scaled(hidden)
        return z if self.softcap is None else torch.tanh(z / self.softcap) * self.softcap

    def scaled(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits before the softcap, in float32 at least."""
        z = F.linear(hidden, self.weight, self.bias)
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        if self.multiply is not None:
            z = z * self.multiply
        if self.divide is not None:
            z = z / self.divide
        return z

    def to_linear(self, z: torch.Tensor, grad_logits: torch.Tensor) -> torch.Tensor:
        """The chain rule of `logits` after the linear: the gradient at its output from the one at the logits
        (`z`: `scaled` of the same rows)."""
        g = grad_logits
        if self.softcap is not None:
            g = g * (1 - torch.tanh(z / self.softcap) ** 2)
        if self.divide is not None:
            g = g / self.divide
        if self.multiply is not None:
            g = g * self.multiply
        return g


def head_of(model: Any) -> Head | None:
    """The head `model`'s own forward applies, or None where it is not one the toolkit knows how to chunk
    faithfully (an output embedding that is not a plain `nn.Linear`, such as LoRA on `lm_head`)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(out) is not torch.nn.Linear:
        return None
    config = model.config
    scale = getattr(model, "logit_scale", None)  # Cohere keeps it on the model, from config.logit_scale
    return Head(
        out.weight,
        out.bias,
        multiply=float(scale) if scale is not None else None,
        divide=getattr(config, "logits_scaling", None),
        softcap=getattr(config, "final_logit_softcapping", None),
    )


def chunk_spans(rows: int, chunk: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of `rows` rows, `chunk` rows each (the last may be shorter)."""
    return [(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]


def target_logps(
    hidden: torch.Tensor, head: Head, labels: torch.Tensor, chunk: int, spans: Any = chunk_spans
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label) per row [rows], with gradient to `hidden` and the head's parameters; log sum_v p(v)^2 per
    row [rows], without gradient, WPO's term), computed `chunk` rows of logits at a time. `spans`: how the rows
    are cut (the tests pass a wrong cut to show the exactness check sees it)."""
    return _ChunkedLogps.apply(hidden, head.weight, head.bias, labels, head, chunk, spans)


class _ChunkedLogps(torch.autograd.Function):
    """Forward: each chunk's logits, its targets' log-probs and log sum p^2, then the logits are dropped.
    Backward: each chunk's logits again, d log p(label) / d logits = onehot(label) - softmax, through the
    head's scaling and softcap, into the hidden states, the weight and the bias."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, head, chunk, spans):
        rows = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        picked = torch.empty(rows, dtype=dtype, device=hidden.device)
        square = torch.empty(rows, dtype=dtype, device=hidden.device)
        cuts = spans(rows, chunk)
        with torch.no_grad():
            for start, stop in cuts:
                logits = head.logits(hidden[start:stop])
                log_z = torch.logsumexp(logits, dim=-1)
                picked[start:stop] = logits.gather(1, labels[start:stop, None]).squeeze(1) - log_z
                square[start:stop] = torch.logsumexp(2 * logits, dim=-1) - 2 * log_z
        ctx.save_for_backward(hidden, labels)
        ctx.head, ctx.cuts = head, cuts
        ctx.autocast = _autocast_state(hidden.device.type)
        ctx.mark_non_differentiable(square)
        return picked, square

    @staticmethod
    def backward(ctx, grad_picked, _grad_square):
        hidden, labels = ctx.saved_tensors
        head = ctx.head
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        accumulate = torch.promote_types(head.weight.dtype, torch.float32)  # summed over chunks: not in bf16
        grad_weight = torch.zeros_like(head.weight, dtype=accumulate) if needs_weight else None
        grad_bias = torch.zeros_like(head.bias, dtype=accumulate) if needs_bias else None
        with torch.autocast(hidden.device.type, **ctx.autocast), torch.no_grad():
            for start, stop in ctx.cuts:
                h, grad = hidden[start:stop], grad_picked[start:stop, None]
                z = head.scaled(h)
                logits = z if head.softcap is None else torch.tanh(z / head.softcap) * head.softcap
                g = -torch.softmax(logits, dim=-1) * grad.to(logits.dtype)
                g.scatter_add_(1, labels[start:stop, None], grad.to(g.dtype))
                g = head.to_linear(z, g)
                if needs_hidden:
                    grad_hidden[start:stop] = (g.to(head.weight.dtype) @ head.weight).to(hidden.dtype)
                if needs_weight:
                    grad_weight += g.T.to(grad_weight.dtype) @ h.to(grad_weight.dtype)
                if needs_bias:
                    grad_bias += g.sum(0).to(grad_bias.dtype)
        grad_weight = grad_weight.to(head.weight.dtype) if needs_weight else None
        grad_bias = grad_bias.to(head.bias.dtype) if needs_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _autocast_state(device_type: str) -> dict:
    """The autocast the forward ran under, so that backward recomputes the chunks' logits alike."""
    if not torch.is_autocast_enabled(device_type):
        return {"enabled": False}
    return {"enabled": True, "dtype": torch.get_autocast_dtype(device_type)}
