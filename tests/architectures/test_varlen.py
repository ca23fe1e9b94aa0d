"""model.attention varlen: refused by name where it cannot run (a CPU run, fp32, the shared-prompt layout, chunks,
softcaps, sinks), and on CPU its glue (segment boundaries, windows, grouped heads, Llama 4's query scale) checked
exact against eager unpacked through a stand-in for the CUDA kernel that computes what torch documents it computes.
The kernel itself runs only on CUDA: scripts/device_check.py checks it there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dpo_train.attention import varlen
from dpo_train.errors import ConfigError, ModelError
from dpo_train.logps.pairs import pair_logps
from dpo_train.logps.probe import eager_unpacked
from dpo_train.logps.scoring import Scoring
from tests.architectures.test_architectures import LAYOUTS
from tests.architectures.zoo import model_spec, pairs, relative_error

TOLERANCE = 1e-5


def documented_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn as its documentation states it, on any device: [T, H, D] tensors;
    sequence i is rows cu[i]:cu[i + 1]; window_size (left, right), -1 unbounded, (W, 0) causal with W keys to the
    left of the query's own."""
    assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and int(cu_q[-1]) == q.shape[0]
    left, right = window_size
    outputs = []
    for start, stop in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        assert stop - start <= max_q
        qs, ks, vs = (x[start:stop].transpose(0, 1) for x in (q, k, v))
        i = torch.arange(stop - start)
        offset = i[:, None] - i[None, :]  # query index - key index
        visible = (offset >= (-right if right >= 0 else -(1 << 30))) & (offset <= (left if left >= 0 else 1 << 30))
        outputs.append(F.scaled_dot_product_attention(qs, ks, vs, visible, scale=scale, enable_gqa=enable_gqa))
    return torch.cat([o.transpose(0, 1) for o in outputs])


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", documented_varlen)


VARIANTS = {"llama4_unchunked": ("llama4_text", {"attention_chunk_size": None})}
"""Llama 4 with its NoPE layers' temperature tuning and no chunks (which varlen refuses)."""


def _varlen_model(name: str):
    """A zoo model loaded for the segment path, then switched to varlen: on CPU `load_model` refuses varlen."""
    from dpo_train.config.sections import ModelConfig
    from dpo_train.model.load import load_model
    from dpo_train.parallel.device import placement

    model_type, changes = VARIANTS.get(name, (name, {}))
    spec = ModelConfig(init={"config": {**model_spec(model_type), **changes}, "seed": 0})
    model = load_model(spec, "segments", placement("cpu", "fp32"), None, "separate")[0].eval()
    varlen.register()
    model.config._attn_implementation = varlen.ATTENTION
    return model


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "phi3", "llama4_unchunked"])
def test_varlen_scores_each_pair_as_eager_unpacked(kernel, model_type):
    """Plain (grouped-query heads: every zoo entry has 4 query and 2 key/value heads), a window on every layer,
    a window beside full layers, Llama 4's NoPE query scale."""
    model = _varlen_model(model_type)
    truth = eager_unpacked(model, pairs())
    with torch.no_grad():
        out = pair_logps(model, LAYOUTS["separate"](pairs(), 16), Scoring())
    assert relative_error(out, truth) < TOLERANCE


def _separate_error(model) -> float:
    """The worst pair's relative error of the separate layout's packed log-probs against eager unpacked."""
    return relative_error(
        pair_logps(model, LAYOUTS["separate"](pairs(), 16), Scoring()), eager_unpacked(model, pairs())
    )


def test_a_window_one_key_wide_of_transformers_is_caught(kernel, monkeypatch):
    """The broken variant: the window passed as W keys to the left (W + 1 in all), transformers' is W in all."""

    def wide(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), **kw):
        left, right = window_size
        return documented_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(left + (left >= 0), right), **kw)

    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", wide)
    model = _varlen_model("mistral")
    with torch.no_grad():
        assert _separate_error(model) > 1e-3


def test_segments_one_boundary_off_are_caught(kernel, monkeypatch):
    """The broken variant: each sequence starting one token late (its first token read as the previous one's)."""
    right = varlen.cu_seqlens

    def late(segments, device):
        cu, longest = right(segments, device)
        cu[1:-1] += 1
        return cu, longest + 1

    monkeypatch.setattr(varlen, "cu_seqlens", late)
    model = _varlen_model("llama")
    with torch.no_grad():
        assert _separate_error(model) > 1e-3


@pytest.mark.parametrize(
    "model_type, feature",
    [("llama4_text", "chunked attention"), ("gemma2", "attention logit softcapping"), ("gpt_oss", "attention sinks")],
)
def test_what_the_kernel_cannot_express_is_refused_by_name(kernel, model_type, feature):
    model = _varlen_model(model_type)
    with pytest.raises(ModelError, match=f"varlen cannot express {feature}"):
        pair_logps(model, LAYOUTS["separate"](pairs(), 16), Scoring())


def test_the_shared_prompt_layout_is_refused(kernel):
    model = _varlen_model("llama")
    with pytest.raises(ModelError, match="separate layout"):
        pair_logps(model, LAYOUTS["shared_prompt"](pairs(), 16), Scoring())


@pytest.mark.parametrize(
    "device, precision, layout, words",
    [
        ("cpu", "fp32", "separate", "CUDA kernel"),
        ("cuda", "fp32", "separate", "bf16 or fp16"),
        ("cuda", "bf16", "shared_prompt", "shared_prompt"),
    ],
)
def test_a_placement_varlen_cannot_run_on_is_refused_before_loading(device, precision, layout, words):
    from dpo_train.attention.choice import attention_for

    place = type("Place", (), {"device": torch.device(device), "precision": precision})()
    with pytest.raises(ConfigError, match=f"model.attention varlen cannot run.*{words}"):
        attention_for("varlen", place, None, layout)
