"""Trainer options in process: activation checkpointing keeps the gradient, bf16 autocast trains, devices resolve."""

from __future__ import annotations

import pytest
import torch

from dpo_data.dataset.store import PairStore
from dpo_data.loading.microbatch import pack_microbatch
from tests.harness import TINY_LLAMA, tiny_trainer

MODEL = TINY_LLAMA


def _config(dataset, **train) -> dict:
    """TINY_LLAMA on `dataset` with the config's defaults; `train` adds to the train section."""
    return {
        "model": {"init": {"config": MODEL, "seed": 0}},
        "data": {"path": str(dataset)},
        "train": {"output_dir": "unused", **train},
        "distributed": {"device": "cpu"},
    }


def _one_step(trainer, store):
    pairs = [store.pair(i) for i in range(4)]
    batch = pack_microbatch(pairs, pad_to_multiple_of=8)
    batch.update(
        microbatch=0, microbatches_in_step=1, step_pairs=4, step_chosen_tokens=sum(len(p.chosen) for p in pairs)
    )
    trainer.microbatch(batch)
    grads = {n: p.grad.clone() for n, p in trainer.policy.named_parameters()}
    return grads, trainer.step()


def test_activation_checkpointing_recomputes_the_same_gradient(sample_dataset):
    store = PairStore([str(sample_dataset)])
    plain, _ = _one_step(tiny_trainer(_config(sample_dataset)), store)
    checkpointed_trainer = tiny_trainer(_config(sample_dataset, activation_checkpointing=True))
    policy = checkpointed_trainer.policy
    assert getattr(policy, "is_activation_checkpointing", None) or policy.is_gradient_checkpointing
    checkpointed, _ = _one_step(checkpointed_trainer, store)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-6, atol=1e-9)


def test_bf16_autocast_trains_close_to_fp32_with_fp32_master_weights(sample_dataset):
    store = PairStore([str(sample_dataset)])
    fp32 = tiny_trainer(_config(sample_dataset, precision="fp32"))
    bf16 = tiny_trainer(_config(sample_dataset, precision="bf16"))
    assert bf16.place.precision == "bf16" and fp32.place.precision == "fp32"
    grads32, rec32 = _one_step(fp32, store)
    grads16, rec16 = _one_step(bf16, store)
    assert all(p.dtype == torch.float32 for p in bf16.policy.parameters())  # master weights stay fp32
    assert rec16["loss"] == pytest.approx(rec32["loss"], abs=1e-3)
    assert rec16["logps/chosen"] == pytest.approx(rec32["logps/chosen"], rel=1e-2)
    g32, g16 = grads32["lm_head.weight"], grads16["lm_head.weight"]
    assert float((g16 - g32).norm() / g32.norm()) < 0.1


def test_cpu_precision_auto_is_fp32_and_missing_devices_are_named():
    from dpo_train.errors import ConfigError
    from dpo_train.parallel.device import placement

    assert placement("cpu", "auto").precision == "fp32" and placement("cpu", "auto").backend == "gloo"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="distributed.device is cuda but torch sees no CUDA device"):
            placement("cuda", "auto")
        assert placement("auto", "auto").device.type in ("cpu", "npu")


def test_attention_is_per_segment_on_cpu_and_flash_attention_needs_cuda_bf16():
    from dpo_train.attention.choice import attention_for
    from dpo_train.attention.segments import ATTENTION
    from dpo_train.errors import ConfigError
    from dpo_train.parallel.device import placement

    cpu = placement("cpu", "fp32")
    assert attention_for("auto", cpu) == ATTENTION == attention_for("segments", cpu)
    assert attention_for("sdpa", cpu) == "sdpa" and attention_for("eager", cpu) == "eager"
    with pytest.raises(ConfigError, match="flash_attention_2 needs distributed.device cuda"):
        attention_for("flash_attention_2", cpu)
