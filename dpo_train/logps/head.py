"""The vocabulary head in chunks: each target's log-prob from the final hidden states, never holding more than one
chunk of logits, in forward and in backward (which recomputes each chunk's logits instead of keeping them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dpo_train.attention.features import text_config, wrapped
from dpo_train.logps.compiled import Checked
from dpo_train.logps.recompute import autocast_state


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
        return self.capped(self.scaled(hidden))

    def scaled(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits before the softcap, in float32 at least."""
        z = F.linear(hidden, self.weight, self.bias)
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        if self.multiply is not None:
            z = z * self.multiply
        if self.divide is not None:
            z = z / self.divide
        return z

    def capped(self, z: torch.Tensor) -> torch.Tensor:
        """The softcap of `scaled` logits (none without one)."""
        return z if self.softcap is None else torch.tanh(z / self.softcap) * self.softcap

    def to_linear(self, z: torch.Tensor, grad_logits: torch.Tensor) -> torch.Tensor:
        """The chain rule of `logits` after the linear: the gradient at its output from the one at the logits
        (`z`: `scaled` of the same rows), computed in `grad_logits`' own memory, without a graph (a chunk's
        backward: one [rows, vocab] tensor alive besides `z` and the gradient)."""
        g = grad_logits
        if self.softcap is not None:
            g.mul_((z / self.softcap).tanh_().square_().neg_().add_(1))
        if self.divide is not None:
            g.div_(self.divide)
        if self.multiply is not None:
            g.mul_(self.multiply)
        return g


def head_of(model: Any) -> Head | None:
    """The head `model`'s own forward applies, or None where it is not one the toolkit knows how to chunk
    faithfully (an output embedding that is not a plain `nn.Linear`, such as LoRA on `lm_head`). The scales are
    read from the decoder's config as each family's forward applies them (`check_head` compares the result with
    the model's own head before a run uses it)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(out) is not torch.nn.Linear:
        return None
    config = text_config(model)
    multiply, divide = [], []
    scale = getattr(model, "logit_scale", None)  # Cohere keeps it on the model, from config.logit_scale
    multiply.append(scale)
    multiply.append(getattr(config, "output_multiplier", None))  # Muse Glimmer, before its softcap
    multiply.append(getattr(config, "lm_head_multiplier", None))  # Falcon-H1 (muP)
    scaling = getattr(config, "logits_scaling", None)  # Granite divides the logits by it
    if config.model_type == "hyperclovax":  # which multiplies them by it
        multiply.append(scaling)
    elif config.model_type != "minicpm3":  # which divides the hidden states before lm_head: `HeadInput` gets them so
        divide.append(scaling)
    return Head(
        out.weight,
        out.bias,
        multiply=_product(multiply),
        divide=_product(divide),
        softcap=getattr(config, "final_logit_softcapping", None),
    )


def _product(factors: list) -> float | None:
    """The product of the factors that are set (None when none is)."""
    found = [float(f) for f in factors if f is not None]
    return math.prod(found) if found else None


def chunk_spans(rows: int, chunk: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of `rows` rows, `chunk` rows each (the last may be shorter)."""
    return [(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]


def target_logps(
    hidden: torch.Tensor,
    head: Head,
    labels: torch.Tensor,
    chunk: int,
    squares: bool = True,
    spans: Any = chunk_spans,
    compiled: bool | str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(label) per row [rows], with gradient to `hidden` and the head's parameters; with `squares`, log
    sum_v p(v)^2 per row [rows], without gradient, WPO's term, else None), computed `chunk` rows of logits at a
    time. `spans`: how the rows are cut (the tests pass a wrong cut to show the exactness check sees it);
    `compiled`: train.compiled_head, where the chunk bodies run compiled (`compiled.compiles_on`)."""
    args = (hidden, head.weight, head.bias, labels, head, chunk, squares, spans, compiled)
    picked, square = _ChunkedLogps.apply(*args)
    return picked, square if squares else None


class _ChunkedLogps(torch.autograd.Function):
    """Forward: each chunk's logits, its targets' log-probs and log sum p^2, then the logits are dropped.
    Backward: each chunk's logits again, d log p(label) / d logits = onehot(label) - softmax, through the
    head's scaling and softcap, into the hidden states, the weight and the bias."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, head, chunk, squares, spans, compiled):
        rows = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        picked = torch.empty(rows, dtype=dtype, device=hidden.device)
        square = torch.empty(rows if squares else 0, dtype=dtype, device=hidden.device)
        cuts = spans(rows, chunk)
        parts = (head.multiply, head.divide, head.softcap)
        with torch.no_grad():
            for start, stop in cuts:
                got = CHUNK_LOGPS(compiled, hidden[start:stop], labels[start:stop], weight, bias, *parts, squares)
                picked[start:stop] = got[0]
                if squares:
                    square[start:stop] = got[1]
        ctx.save_for_backward(hidden, labels)
        ctx.head, ctx.cuts, ctx.compiled = head, cuts, compiled
        ctx.autocast = autocast_state(hidden.device.type)
        ctx.mark_non_differentiable(square)
        return picked, square

    @staticmethod
    def backward(ctx, grad_picked, _grad_square):
        hidden, labels = ctx.saved_tensors
        head = ctx.head
        parts = (head.multiply, head.divide, head.softcap)
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        accumulate = torch.promote_types(head.weight.dtype, torch.float32)  # summed over chunks: not in bf16
        grad_weight = torch.zeros_like(head.weight, dtype=accumulate) if needs_weight else None
        grad_bias = torch.zeros_like(head.bias, dtype=accumulate) if needs_bias else None
        with torch.autocast(hidden.device.type, **ctx.autocast), torch.no_grad():
            for start, stop in ctx.cuts:
                h = hidden[start:stop]
                g_picked = grad_picked[start:stop]
                (g,) = CHUNK_GRAD(ctx.compiled, h, labels[start:stop], g_picked, head.weight, head.bias, *parts)
                if needs_hidden:
                    grad_hidden[start:stop] = (g.to(head.weight.dtype) @ head.weight).to(hidden.dtype)
                if needs_weight:
                    grad_weight += g.T.to(grad_weight.dtype) @ h.to(grad_weight.dtype)
                if needs_bias:
                    grad_bias += g.sum(0).to(grad_bias.dtype)
        grad_weight = grad_weight.to(head.weight.dtype) if needs_weight else None
        grad_bias = grad_bias.to(head.bias.dtype) if needs_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def chunk_logps(hidden, labels, weight, bias, multiply, divide, softcap, squares) -> tuple[torch.Tensor, ...]:
    """One chunk's forward: (log p(label) per row, log sum_v p(v)^2 per row, empty without `squares`). At most
    two [rows, vocab] tensors alive: the logits, and log-sum-exp's own."""
    logits = Head(weight, bias, multiply, divide, softcap).logits(hidden)
    log_z = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, labels[:, None]).squeeze(1) - log_z
    if not squares:
        return picked, logits.new_empty(0)
    # log sum_v p(v)^2 = logsumexp(2 z) - 2 log Z, the doubled logits made in their own memory (not needed again)
    return picked, torch.logsumexp(logits.mul_(2), dim=-1) - 2 * log_z


def chunk_grad(hidden, labels, grad, weight, bias, multiply, divide, softcap) -> tuple[torch.Tensor]:
    """One chunk's backward up to the projection: (the gradient at the linear's output [rows, vocab],) of
    sum grad * log p(label), from the chunk's logits recomputed: d log p(label) / d logits = onehot - softmax,
    made in the softmax's memory (the logits and it: two [rows, vocab] tensors alive; a softcap's three)."""
    head = Head(weight, bias, multiply, divide, softcap)
    z = head.scaled(hidden)
    grad = grad[:, None].to(z.dtype)
    g = torch.softmax(head.capped(z), dim=-1).mul_(-grad).scatter_add_(1, labels[:, None], grad)
    return (head.to_linear(z, g),)


CHUNK_LOGPS = Checked(chunk_logps, "vocabulary head (forward)")
CHUNK_GRAD = Checked(chunk_grad, "vocabulary head (backward)")
"""The chunk bodies as the chunked head runs them: compiled on CUDA by default, each checked against its eager
form on its first chunk (`compiled.Checked`; train.compiled_head)."""


COPIES = 5
"""How many [rows, vocab] float32 tensors the whole head keeps alive through backward (logits, their float32
copy, log-softmax and its gradient's temporaries, measured on SmolLM2): a chunk takes the budget over this."""


def chunk_rows(model: Any, rows: int, budget: int | None) -> int | None:
    """Rows per chunk for `rows` scored positions of `model` whose whole head's logits may take `budget` bytes
    (`Scoring.logits_budget`), or None when they stay within it (or there is none): then the model's own head
    runs, exactly today's path and speed."""
    if budget is None:
        return None
    vocab = causal_lm(model).get_output_embeddings().weight.shape[0]
    per_row = COPIES * vocab * 4
    return None if rows * per_row <= budget else max(1, budget // per_row)


def causal_lm(model: Any) -> Any:
    """The causal LM under a DDP wrapper (FSDP2 and PEFT models answer for themselves)."""
    return next(c for c in (*wrapped(model), model) if hasattr(c, "get_output_embeddings"))


class HeadInput:
    """While open, the model's output embedding does not project: it keeps its input (the final hidden states at
    the kept positions, with their autograd graph) and returns one zero logit per position, so that the model's
    forward runs whole and cheap; `target_logps` then projects those hidden states in chunks."""

    def __init__(self, model: Any):
        self.model = causal_lm(model)
        self.module = self.model.get_output_embeddings()
        self.hidden: torch.Tensor | None = None

    def __enter__(self) -> HeadInput:
        def keep(hidden: torch.Tensor) -> torch.Tensor:
            self.hidden = hidden
            return hidden.new_zeros(*hidden.shape[:-1], 1)

        self.module.forward = keep
        return self

    def __exit__(self, *exc) -> None:
        del self.module.forward  # the class's own forward again

    @property
    def head(self) -> Head:
        found = head_of(self.model)
        assert found is not None, "a logits budget is only set for models whose head head_of reads (check_head)"
        return found
