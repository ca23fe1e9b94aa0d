"""The chunked vocabulary head (issue 35, step 1): each target's log-prob and WPO's log sum p^2, and the gradients
of the hidden states, weight and bias, equal the whole head's within 1e-6 relative in fp32, at every chunk size,
for every head transform the zoo's models apply, read from the models themselves; a cut off by one is seen."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dpo_train.attention.head import Head, chunk_spans, head_of, target_logps
from dpo_train.model.policy import init_config
from tests.architectures.zoo import model_spec

ROWS, HIDDEN, VOCAB = 37, 16, 101
TOLERANCE = 1e-6
HEADS = {
    "plain": {},
    "bias": {"bias": True},
    "multiply": {"multiply": 0.0625},  # Cohere's logit_scale
    "divide": {"divide": 2.5},  # Granite's logits_scaling
    "softcap": {"softcap": 3.0, "multiply": 1.7},  # Gemma 2's final_logit_softcapping
}


def _relative(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got.double() - truth.double()).abs().max() / truth.double().abs().max().clamp(min=1e-30))


def _head(kind: str, seed: int = 0) -> Head:
    g = torch.Generator().manual_seed(seed)
    options = dict(HEADS[kind])
    bias = torch.randn(VOCAB, generator=g).requires_grad_() if options.pop("bias", False) else None
    return Head(torch.randn(VOCAB, HIDDEN, generator=g).requires_grad_(), bias, **options)


def _whole(hidden: torch.Tensor, head: Head, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's head: every row's logits at once, through autograd."""
    logits = head.logits(hidden)
    log_z = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, labels[:, None]).squeeze(1) - log_z
    return picked, (torch.logsumexp(2 * logits, dim=-1) - 2 * log_z).detach()


def _errors(head: Head, chunk: int, spans=chunk_spans) -> dict[str, float]:
    """Relative errors of the chunked head against the whole one: log-probs, log sum p^2, and the gradients of
    a loss that weighs each row differently (so a row counted twice or never shows)."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(ROWS, HIDDEN, generator=g).requires_grad_()
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    weights = torch.rand(ROWS, generator=g) + 0.5
    params = [hidden, head.weight, *([head.bias] if head.bias is not None else [])]
    out = {}
    results = []
    for compute in (lambda: _whole(hidden, head, labels), lambda: target_logps(hidden, head, labels, chunk, spans)):
        picked, square = compute()
        grads = torch.autograd.grad((picked * weights).sum(), params)
        results.append((picked.detach(), square, grads))
    (truth, truth_sq, truth_grads), (got, got_sq, got_grads) = results
    out["logps"], out["square"] = _relative(got, truth), _relative(got_sq, truth_sq)
    for name, a, b in zip(("hidden", "weight", "bias"), got_grads, truth_grads):
        out[f"grad {name}"] = _relative(a, b)
    return out


@pytest.mark.parametrize("kind", sorted(HEADS))
@pytest.mark.parametrize("chunk", [1, 5, ROWS - 1, ROWS, 64])
def test_every_chunk_size_gives_the_whole_heads_logps_and_gradients(kind, chunk):
    errors = _errors(_head(kind), chunk)
    assert max(errors.values()) <= TOLERANCE, errors


def _overlapping(rows: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk + 1, rows)) for start in range(0, rows, chunk)]


def _gapped(rows: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, max(start, min(start + chunk, rows) - 1)) for start in range(0, rows, chunk)]


@pytest.mark.parametrize("cut", [_overlapping, _gapped], ids=["one-row-overlap", "one-row-gap"])
def test_a_chunk_boundary_off_by_one_is_seen(cut):
    """The check above can fail: a row scored in two chunks doubles its gradient; a row in none is never
    scored."""
    errors = _errors(_head("bias"), 5, spans=cut)
    assert max(errors.values()) > 1e-3, errors


# each head transform the zoo's models apply: none (tied and untied), Gemma 2's softcap, Granite's scaling,
# Cohere 2's logit scale
MODELS = {
    "llama": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": False},
    "gemma2": {},
    "granite": {},
    "cohere2": {"logit_scale": 0.25},
}


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_the_models_own_head_is_read_and_chunked_exactly(model_type):
    """From the model's final hidden states, the chunked head gives the log-probs of the model's own forward
    (its own logits, whatever it applies after the projection) and the same gradients for every parameter."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        init_config({**model_spec(model_type), **MODELS[model_type]}), attn_implementation="eager"
    ).eval()
    head = head_of(model)
    assert head is not None
    ids = torch.randint(3, 97, (1, 29))
    labels = ids[0, 1:]

    def whole() -> torch.Tensor:
        logits = model(input_ids=ids).logits[0, :-1].float()
        return logits.log_softmax(-1).gather(1, labels[:, None]).squeeze(1)

    def chunked() -> torch.Tensor:
        hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]
        return target_logps(hidden, head_of(model), labels, 6)[0]

    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for compute in (whole, chunked):
        picked = compute()
        grads = torch.autograd.grad(picked.sum(), params, allow_unused=True)
        results.append((picked.detach(), grads))
    (truth, truth_grads), (got, got_grads) = results
    assert _relative(got, truth) <= TOLERANCE
    worst = max(_relative(a, b) for a, b in zip(got_grads, truth_grads) if b is not None)
    assert worst <= TOLERANCE, worst


def test_a_head_that_is_not_a_plain_linear_is_not_chunked():
    """LoRA on lm_head (or any custom head) is not read: the caller keeps the model's own head."""
    model = AutoModelForCausalLM.from_config(init_config(model_spec("llama")))
    model.lm_head = torch.nn.Sequential(model.lm_head)
    assert head_of(model) is None
