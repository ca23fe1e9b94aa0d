"""Every architecture of the zoo exports to a directory that loads back as the weights it was written from."""

from __future__ import annotations

import pytest
import torch

from tests.architectures.zoo import ZOO, model_spec


@pytest.mark.parametrize("model_type", sorted(ZOO))
def test_every_architecture_exports_weights_that_load_back_exactly(model_type, tmp_path):
    """Each weight moved off its initial value (ties kept), written as `dpo-train` writes final/ in fp32 and in
    bf16, then loaded as a user loads it: the export's read-back finds nothing (train.read_back)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dpo_train.export.final import export_state, write_weights
    from dpo_train.export.reload import reload_difference

    spec = model_spec(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    for dtype in (torch.float32, torch.bfloat16):
        written = export_state(model, model.state_dict(), dtype)
        staging = tmp_path / str(dtype)
        write_weights(model, staging, written, dtype)
        assert reload_difference(model, staging, written, dtype) == [], (model_type, dtype)


@pytest.mark.parametrize(
    ("model_type", "kept"),
    [
        ("deepseek_v3", ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")),
        ("hunyuan_v1_moe", ("mlp.gate.wg.weight",)),
    ],
    ids=["a strict float32 router", "a router built in float32"],
)
def test_a_bf16_export_keeps_what_transformers_keeps_in_float32(model_type, kept, tmp_path):
    """Where `from_pretrained(dtype=bf16)` keeps a tensor in float32, the export writes it in float32 (the trained
    value), not rounded to bf16; every other floating tensor is bf16. Before: all bf16, and the read-back refused."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from dpo_train.export.final import export_state, write_weights

    spec = model_spec(model_type)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec))
    write_weights(model, tmp_path, export_state(model, model.state_dict(), torch.bfloat16), torch.bfloat16)
    saved = {k: v.dtype for k, v in load_file(tmp_path / "model.safetensors").items() if v.is_floating_point()}
    assert {k for k, d in saved.items() if d == torch.float32} == {k for k in saved if k.endswith(kept)} != set()
    assert {d for k, d in saved.items() if not k.endswith(kept)} == {torch.bfloat16}
