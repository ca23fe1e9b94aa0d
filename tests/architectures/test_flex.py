"""model.attention flex scores and differentiates each pair as eager attention does unpacked, or is refused."""

from __future__ import annotations

import pytest
import torch

from dpo_train.attention import flex
from dpo_train.errors import ConfigError, ModelError
from dpo_train.logps.pairs import pair_logps
from dpo_train.logps.probe import eager_unpacked, probe
from dpo_train.logps.scoring import Scoring
from tests.architectures.test_architectures import LAYOUTS, _load
from tests.architectures.zoo import (
    AUTO_FALLBACK,
    SHARED_PROMPT_UNPACKED,
    UNPACKED,
    ZOO,
    model_spec,
    pairs,
    relative_error,
)
from tests.harness import train_cli, write_yaml

TOLERANCE = 1e-5  # relative, per pair and for the gradient's norm; fp32 flex agrees to about 3e-7
WEIGHTS = torch.tensor([[1.0, -0.5], [0.3, 0.2], [-1.0, 0.7]], dtype=torch.float64)
SERVED = sorted(set(ZOO) - set(UNPACKED) - set(AUTO_FALLBACK))
"""The zoo architectures the segment path serves (the others run unpacked, or take sdpa: their layers pass no
segments), so flex too."""
GRADIENTS = [
    "llama",  # plain, grouped-query heads (every zoo entry has 4 query and 2 key/value heads)
    "mistral",  # sliding window on every layer
    "qwen2",  # a sliding layer beside a full one
    "qwen3",
    "gemma2",  # softcap and windows
    "gemma2_softcap",  # a softcap that bites: the zoo's 5.0 barely touches a random model's small scores
    "llama4_text",  # chunks and temperature tuning
    "gpt_oss",  # sinks and windows
    "phi3",
    "cohere",
    "deepseek_v3",  # MLA: value heads of their own width
]
"""The representative architectures whose gradients are checked too (the rest: log-probs)."""
VARIANTS = {"gemma2_softcap": ("gemma2", {"attn_logit_softcapping": 0.05})}
"""Config mutations of this module's own: name -> (zoo entry, what changes)."""


@pytest.fixture(autouse=True)
def uncompiled(monkeypatch):
    """flex's unfused math: the same block masks and mods, without a compile (seconds to minutes) per test;
    `test_one_compiled_kernel_serves_many_rows` runs the compiled kernel."""
    monkeypatch.setenv(flex.COMPILE_ENV, "0")


def _truth(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager unpacked's [pairs, 2] log-probs and the gradient of the weighted sum of them."""
    model.zero_grad(set_to_none=True)
    truth = eager_unpacked(model, pairs())
    (truth * WEIGHTS).sum().backward()
    return truth.detach(), _gradient(model)


def _packed(model, layout: str) -> tuple[float, torch.Tensor]:
    """flex's packed log-probs in `layout` (the worst pair's relative error is taken by the caller) and the
    gradient of the same weighted sum."""
    model.zero_grad(set_to_none=True)
    out = pair_logps(model, LAYOUTS[layout](pairs(), 16), Scoring())
    (torch.stack([out.chosen, out.rejected], 1).double() * WEIGHTS).sum().backward()
    return out, _gradient(model)


def _gradient(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


def _layouts(model_type: str) -> list[str]:
    """The layouts flex packs the model in (a rope by sequence length cannot share a prompt: refused by name)."""
    return ["separate"] if model_type in SHARED_PROMPT_UNPACKED else sorted(LAYOUTS)


def _flex_model(name: str):
    """Zoo entry (or VARIANTS entry) `name` on model.attention flex, in evaluation mode as the probe and the
    reference score."""
    from dpo_train.config.sections import ModelConfig
    from dpo_train.model.load import load_model
    from dpo_train.parallel.device import placement

    model_type, changes = VARIANTS.get(name, (name, {}))
    spec = ModelConfig(init={"config": {**model_spec(model_type), **changes}, "seed": 0})
    model = load_model(spec, "flex", placement("cpu", "fp32"), None, "separate")[0].eval()
    assert model.config._attn_implementation == flex.ATTENTION
    return model


@pytest.mark.parametrize("model_type", GRADIENTS)
def test_flex_log_probs_and_gradients_equal_eager_unpacked(model_type):
    model = _flex_model(model_type)
    truth, truth_gradient = _truth(model)
    for layout in _layouts(model_type):
        out, gradient = _packed(model, layout)
        assert relative_error(out, truth) < TOLERANCE, f"{model_type} {layout}: log-probs"
        error = float((gradient - truth_gradient).norm() / truth_gradient.norm())
        assert error < TOLERANCE, f"{model_type} {layout}: the gradient is off by {error:.1e} relative"


@pytest.mark.parametrize("model_type", sorted(set(SERVED) - set(GRADIENTS)))
def test_flex_log_probs_equal_eager_unpacked_on_every_architecture_the_segment_path_serves(model_type):
    model = _flex_model(model_type)
    truth = eager_unpacked(model, pairs())
    for layout in _layouts(model_type):
        with torch.no_grad():
            assert relative_error(pair_logps(model, LAYOUTS[layout](pairs(), 16), Scoring()), truth) < TOLERANCE, layout


VISIBLE = flex.visible  # the right mask_mod, which each broken variant below changes


def _one_token_late(row, layer):
    """Each segment's first token counted in the segment before it (a boundary off by one)."""
    return VISIBLE(flex.Tokens(torch.roll(row.segment, 1), row.context, row.position), layer)


def _previous_segment(row, layer):
    """A query also sees the segment before its own (the block mask one segment off)."""
    right = VISIBLE(row, layer)
    return lambda b, h, q, kv: right(b, h, q, kv) | (row.segment[kv] == row.segment[q] - 1)


def _other_completion(row, layer):
    """A shared-prompt completion also sees the other completion of its pair (every segment of its context)."""
    right = VISIBLE(row, layer)
    same_prompt = lambda q, kv: (row.context[kv] == row.context[q]) & (row.context[q] >= 0)
    return lambda b, h, q, kv: right(b, h, q, kv) | (same_prompt(q, kv) & (row.position[kv] <= row.position[q]))


def _window_off_by_one(row, layer):
    """The window one key wider: p - q <= window."""
    wide = flex.LayerAttention(window=layer.window + 1, chunk=layer.chunk) if layer.window else layer
    return VISIBLE(row, wide)


BROKEN = {  # variant -> (mask_mod maker, model, layout)
    "one token late": (_one_token_late, "llama", "separate"),
    "one segment off": (_previous_segment, "llama", "separate"),
    "the other completion visible": (_other_completion, "llama", "shared_prompt"),
    "a window off by one": (_window_off_by_one, "mistral", "separate"),
}


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_a_broken_block_mask_fails_the_exactness_check_and_the_probe(variant, monkeypatch):
    """The checks above prove something only if they fail on a mask that is wrong in the ways one can get it wrong;
    the start-up probe refuses it as well, by name."""
    broken, model_type, layout = BROKEN[variant]
    model = _flex_model(model_type)
    truth = eager_unpacked(model, pairs())
    with torch.no_grad():
        assert relative_error(pair_logps(model, LAYOUTS[layout](pairs(), 16), Scoring()), truth) < TOLERANCE
    monkeypatch.setattr(flex, "visible", broken)
    with torch.no_grad():
        error = relative_error(pair_logps(model, LAYOUTS[layout](pairs(), 16), Scoring()), truth)
    assert error > 1e-3, f"{variant}: off by only {error:.1e}"
    with pytest.raises(ConfigError, match="under attention dpo_flex .*packing would train on wrong numbers"):
        probe(model, layout, "flex")


def test_one_block_mask_per_micro_batch_and_layer_kind(monkeypatch):
    """Built once from the row's segments for every layer of a kind (a sliding and a full kind here), not per
    layer; the padding to the bucket is masked off, and the blocks equal torch's own create_block_mask's."""
    from torch.nn.attention.flex_attention import create_block_mask

    made = []
    real = flex._from_mask_mod
    monkeypatch.setattr(flex, "_from_mask_mod", lambda *a: made.append(a) or real(*a))
    model = _load("ministral", "flex", "separate").eval()  # 2 layers: sliding, full
    with torch.no_grad():
        pair_logps(model, LAYOUTS["shared_prompt"](pairs(), 16), Scoring())
    assert len(made) == 2 and [length for _, length, _ in made] == [128, 128]
    for mask_mod, length, device in made:
        ours, torch_own = real(mask_mod, length, device), create_block_mask(mask_mod, None, None, length, length)
        assert torch.equal(ours.to_dense(), torch_own.to_dense())
        assert torch.equal(ours.full_kv_num_blocks, torch_own.full_kv_num_blocks)
    assert [flex.bucket(n) for n in (1, 128, 129, 1000, 1025)] == [128, 128, 256, 1024, 2048]


def test_flex_is_refused_by_name_where_it_cannot_run():
    """Under sequence parallelism (which brings its own attention), on a device FlexAttention has no kernel
    for, with attention dropout on, for layers that pass no segments, and for a model packing cannot serve (in
    a layout): named errors, never a wrong number."""
    from types import SimpleNamespace

    from dpo_train.attention.choice import attention_for

    with pytest.raises(ConfigError, match="model.attention flex cannot run under distributed.sequence_parallel"):
        attention_for("flex", None, SimpleNamespace(active=True))
    npu = SimpleNamespace(device=torch.device("meta"), precision="bf16")
    with pytest.raises(ConfigError, match="model.attention flex runs on CUDA and the CPU, not on .*meta"):
        attention_for("flex", npu)
    model = _flex_model("llama")
    attention = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 5, 16)
    with pytest.raises(ModelError, match="model.attention flex cannot apply attention dropout .0.1 from"):
        flex.flex_segment_attention(attention, q, q, q, None, dropout=0.1, row_segments=object())
    with pytest.raises(ModelError, match="called without the row's segments.*model.attention flex cannot run"):
        flex.flex_segment_attention(attention, q, q, q, None)
    with pytest.raises(ConfigError, match="StableLmForCausalLM cannot run a packed row under attention dpo_flex"):
        probe(_load("stablelm", "flex", "separate"), "separate", "flex")
    with pytest.raises(ConfigError, match="'conv' layer.*model.attention flex packs"):
        _load("lfm2", "flex", "separate")
    with pytest.raises(ConfigError, match="depends on each sequence's length.*model.attention flex packs"):
        _load("phi3_longrope", "flex", "shared_prompt")


@pytest.mark.slow
def test_one_compiled_kernel_serves_many_rows(monkeypatch):
    """The compiled kernel (CPU: inference, as torch 2.13 compiles it there) scores each pair exactly, and rows
    of other lengths and layouts in the same bucket reuse it: one compile, counted."""
    monkeypatch.delenv(flex.COMPILE_ENV)
    model = _flex_model("llama")
    truth = eager_unpacked(model, pairs())
    before = flex.compiles()
    with torch.no_grad():
        for layout in LAYOUTS:
            for pad in (8, 16):
                assert relative_error(pair_logps(model, LAYOUTS[layout](pairs(), pad), Scoring()), truth) < TOLERANCE
    assert flex.compiles() - before == 1


def test_a_kernel_that_fails_to_compile_leaves_the_unfused_math_with_a_note(monkeypatch, capsys):
    """A compile torch cannot do for a call (a backend without flex, a shape its kernels refuse) costs speed, never
    the run: the unfused math scores the row, and rank 0 says why once."""

    def refusing(*args, **kwargs):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.delenv(flex.COMPILE_ENV)
    monkeypatch.setattr(flex, "_DROPPED", {})
    monkeypatch.setattr(flex, "_COMPILED", set())
    monkeypatch.setattr(flex, "_compiled", lambda: refusing)
    model = _flex_model("llama")
    truth = eager_unpacked(model, pairs())
    with torch.no_grad():
        assert relative_error(pair_logps(model, LAYOUTS["separate"](pairs(), 16), Scoring()), truth) < TOLERANCE
    said = capsys.readouterr().err
    assert said.count("could not compile its kernel on cpu (RuntimeError: no kernel for this shape)") == 1, said


def _run(tmp_path, dataset, tokenizer_dir, **sections) -> None:
    """A one-step two-process run of the zoo's Llama on model.attention flex (SmolLM2's vocabulary, so the real
    tokenizer's ids embed): the start-up probe, step 1's parity guard and its alone check all run, and a pair
    that scores otherwise than alone stops the run (exit 2)."""
    spec = {**model_spec("llama"), "vocab_size": 49152}
    config = {
        "model": {"init": {"config": spec, "seed": 0}, "tokenizer": str(tokenizer_dir), "attention": "flex"},
        "data": {"path": str(dataset), "batching": "pairs", "pairs_per_step": 4},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "resume": "never"},
        "distributed": {"strategy": "ddp"},
    }
    for section, values in sections.items():
        config[section].update(values)
    train_cli(write_yaml(tmp_path / "config.yaml", config), nproc=2, env={flex.COMPILE_ENV: "0"})


@pytest.mark.slow
def test_two_ddp_ranks_train_on_flex_with_the_checks_on(tmp_path, small_dataset, smollm2_dir):
    _run(tmp_path, small_dataset, smollm2_dir)


@pytest.mark.slow
def test_two_fsdp2_ranks_train_lora_adapters_on_flex_with_a_shared_prompt(tmp_path, small_dataset, smollm2_dir):
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    sections = {"model": {"lora": lora}, "distributed": {"strategy": "fsdp"}, "data": {"layout": "shared_prompt"}}
    _run(tmp_path, small_dataset, smollm2_dir, **sections)
