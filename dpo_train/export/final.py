"""OUTPUT/final/: the policy as a plain HF directory, or its PEFT adapter and/or the merged model; card and hashes."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from dpo_state.export_record import CARD_FILE, write_export_record
from dpo_state.faults import train_kill_point
from dpo_state.files import fsync_dir, read_json, write_json_atomic
from dpo_train.config.sections import ModelConfig, TrainConfig
from dpo_train.export.model_card import RunFacts, base_model, card_text
from dpo_train.model.policy import dropout_as_loaded
from dpo_train.parallel import collectives

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(config: TrainConfig) -> torch.dtype:
    """train.export_dtype resolved: `model` is the dtype the model's own config names (fp32 without one)."""
    if config.train.export_dtype != "model":
        return _DTYPES[config.train.export_dtype]
    return _NAMED.get(_declared_dtype(config.model) or "float32", torch.float32)


def _declared_dtype(model: ModelConfig) -> str | None:
    if model.path:
        declared = read_json(Path(model.path) / "config.json")
        return declared.get("dtype") or declared.get("torch_dtype")
    spec = (model.init or {}).get("config")
    return (spec.get("dtype") or spec.get("torch_dtype")) if isinstance(spec, dict) else None


def export(
    policy: Any, config: TrainConfig, tokenizer: Any, out: Path, rank: int, facts: RunFacts, processor: Any = None
) -> None:
    """Write OUTPUT/final (and final-merged with `train.export: both`) on rank 0, after gathering FSDP
    shards on every rank; with the run's (attested) tokenizer beside each model, or for a vision-language run
    its (attested) processor, which holds the tokenizer; its model card and, last, its export.json."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        lora, kind = config.model.lora, config.train.export
        if not lora or kind in ("adapter", "both"):  # the whole policy, or its PEFT adapter
            _save(policy, state, out / "final", processor or tokenizer, config, facts)
        if lora and kind in ("merged", "both"):
            merged = _merged(config, state)
            target = out / ("final" if kind == "merged" else "final-merged")
            _save(merged, merged.state_dict(), target, processor or tokenizer, config, facts)
    collectives.barrier()


def _merged(config: TrainConfig, state: dict) -> Any:
    """The adapters merged into a fresh base model (loaded on this rank only, on the CPU)."""
    from dpo_train.model.lora import merged_model
    from dpo_train.model.policy import load_policy

    # eager: nothing runs a forward here, and every architecture loads with it (Gemma2 has no sdpa)
    return merged_model(load_policy(config.model, "eager"), config.model.lora, state)


def _cast(state: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in state.items()}


def _save(model: Any, state: dict, target: Path, tokenizer: Any, config: TrainConfig, facts: RunFacts) -> None:
    """Write `target` whole or not at all: into a staging directory beside it, renamed into place last.
    `tokenizer`: the run's tokenizer, or a vision-language run's processor (`_save_processor`)."""
    for leftover in target.parent.glob(f"{target.name}.incomplete-*"):  # an export killed half-way
        shutil.rmtree(leftover)
    staging = target.with_name(f"{target.name}.incomplete-{uuid.uuid4().hex[:12]}")
    dtype = export_dtype(config)
    peft = hasattr(model, "peft_config")
    with dropout_as_loaded(model):  # the config as loaded, not with training's dropout off
        model.save_pretrained(staging, state_dict=_cast(state, dtype))
        if not peft:  # a whole model: config.json names the dtype its weights are in
            model.config.dtype = dtype  # (save_pretrained wrote the dtype of the fp32 master weights)
            model.config.save_pretrained(staging)
    if hasattr(tokenizer, "image_processor"):
        _save_processor(tokenizer, staging)
    elif tokenizer is not None:
        tokenizer.save_pretrained(staging)
    _describe(staging, config, facts, peft)
    train_kill_point(f"in-export:{target.name}")
    _into_place(staging, target)


def _save_processor(processor: Any, staging: Path) -> None:
    """The processor's files (its image settings, its tokenizer, its chat template), so that `final/` is a
    `dpo-data build --processor` and a next run's model directory whose processor attests as the data did. Its
    chat template is the one the data was rendered with: its tokenizer's (`dpo_data.processor.rendering_tokenizer`,
    a dataset's --chat-template included)."""
    saved = processor.chat_template
    processor.chat_template = processor.tokenizer.chat_template
    try:
        processor.save_pretrained(staging)
    finally:
        processor.chat_template = saved


def _describe(staging: Path, config: TrainConfig, facts: RunFacts, peft: bool) -> None:
    """The model card, the adapter's base model by its portable name, normal file modes and, last, the
    export record hashing all of it."""
    merged = not peft and bool(config.model.lora)
    (staging / CARD_FILE).write_text(card_text(config, facts, "peft" if peft else "transformers", merged))
    if peft:  # PEFT records the base model as loaded: an absolute path on this machine
        adapter = {**read_json(staging / "adapter_config.json"), "base_model_name_or_path": base_model(config.model)}
        write_json_atomic(staging / "adapter_config.json", adapter)
    _normal_modes(staging)
    write_export_record(staging, facts.step, facts.lineage["run_id"])


def _normal_modes(directory: Path) -> None:
    """Give every file the mode a new file gets under this umask (0644 under the usual 022): safetensors
    writes its files 0600, which keeps a shared or uploaded model from being read by anyone else."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


def _into_place(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`; an older `target` (a rerun of a finished run) goes aside first and
    is deleted after, so `target` is always one whole export."""
    old = target.with_name(f"{target.name}.replaced-{uuid.uuid4().hex[:12]}") if target.exists() else None
    if old is not None:
        os.rename(target, old)
    os.rename(staging, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old)
