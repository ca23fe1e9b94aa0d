"""OUTPUT/final/: the policy as a plain HF directory, or its PEFT adapter and/or the merged model; card and hashes."""

from __future__ import annotations

import copy
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from dpo_state.disk import disk_errno, disk_fix, disk_reason
from dpo_state.export_record import CARD_FILE, write_export_record
from dpo_state.faults import flip_exported, train_kill_point
from dpo_state.files import fsync_dir, read_json, write_json_atomic
from dpo_train.config.sections import ModelConfig, TrainConfig
from dpo_train.errors import ExportError
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
    its (attested) processor, which holds the tokenizer; its model card and, last, its export.json. An export that
    does not load back (`train.read_back`) is an `ExportError` on every rank, so that they can keep the weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    failure = ""
    if rank == 0:
        try:
            _save_all(policy, state, config, out, processor or tokenizer, facts)
        except ExportError as e:
            failure = str(e)
    failures = collectives.gather_failures(failure)
    if failures:
        raise ExportError(failures[0])


def _save_all(policy: Any, state: dict, config: TrainConfig, out: Path, tokenizer: Any, facts: RunFacts) -> None:
    lora, kind = config.model.lora, config.train.export
    if not lora or kind in ("adapter", "both"):  # the whole policy, or its PEFT adapter
        _save(policy, state, out / "final", tokenizer, config, facts)
    if lora and kind in ("merged", "both"):
        merged = _merged(config, state)
        target = out / ("final" if kind == "merged" else "final-merged")
        _save(merged, merged.state_dict(), target, tokenizer, config, facts)


def _merged(config: TrainConfig, state: dict) -> Any:
    """The adapters merged into a fresh base model (loaded on this rank only, on the CPU)."""
    from dpo_train.model.lora import merged_model
    from dpo_train.model.policy import load_policy

    # eager: nothing runs a forward here, and every architecture loads with it (Gemma2 has no sdpa)
    return merged_model(load_policy(config.model, "eager"), config.model.lora, state)


def export_state(model: Any, state: dict, dtype: torch.dtype) -> dict:
    """`state` with each floating tensor in the dtype `from_pretrained(..., dtype=dtype)` gives it, as transformers
    saves a model loaded that way: `dtype`, but float32 where the model's class keeps a tensor in float32 (its
    `_keep_in_fp32_modules_strict`, e.g. DeepSeek-V3's router bias, or a layer built in float32, e.g. Hunyuan's
    router), which casting would round."""
    loaded = _loaded_dtypes(model, dtype)
    return {k: v.to(loaded.get(k, dtype)) if torch.is_floating_point(v) else v for k, v in state.items()}


def _loaded_dtypes(model: Any, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype of each tensor where `from_pretrained` does not give it `dtype`, by transformers' own rules: the
    model's dtype plan (its patterns searched in the key), else the dtype the class builds it in at `dtype` (an
    empty model on the meta device). A PEFT adapter's tensors are not the base class's: none."""
    if hasattr(model, "peft_config"):
        return {}
    with torch.device("meta"):
        empty = _model_class(model)._from_config(copy.deepcopy(model.config), dtype=dtype)  # (it sets its dtype)
    plan = [(re.compile(p.replace("*", ".*")), kept) for p, kept in empty._get_dtype_plan(dtype).items()]
    built = {k: v.dtype for k, v in empty.state_dict().items()}
    loaded = {k: next((kept for p, kept in plan if p.search(k)), built[k]) for k in built}
    return {k: d for k, d in loaded.items() if d != dtype and d.is_floating_point}


def _model_class(model: Any) -> type:
    """The model's own class: FSDP2 puts a subclass of it and FSDPModule in its place."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    return next(c for c in type(model).__mro__ if issubclass(c, PreTrainedModel) and not issubclass(c, FSDPModule))


def _save(model: Any, state: dict, target: Path, tokenizer: Any, config: TrainConfig, facts: RunFacts) -> None:
    """Write `target` whole or not at all: into a staging directory beside it, renamed into place last.
    `tokenizer`: the run's tokenizer, or a vision-language run's processor (`_save_processor`)."""
    for leftover in target.parent.glob(f"{target.name}.incomplete-*"):  # an export killed half-way
        shutil.rmtree(leftover)
    staging = target.with_name(f"{target.name}.incomplete-{uuid.uuid4().hex[:12]}")
    try:
        _write_staged(model, state, staging, tokenizer, config, facts, target)
        train_kill_point(f"in-export:{target.name}")
        _into_place(staging, target)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-written stays (a read-only disk keeps it)
        if isinstance(e, Exception) and (code := disk_errno(e)) is not None:
            raise ExportError(_disk_fault(target, staging, e, code)) from None
        raise


def _disk_fault(target: Path, staging: Path, e: Exception, code: int) -> str:
    """An export the disk stopped (full, read-only, over quota): the fault, what is left, the fix."""
    left = f"{staging} is left (the next export removes it)" if staging.exists() else "nothing half-written is left"
    return (
        f"{target.name}/ was not written: {disk_reason(e, code)}, writing {staging}; {left}. "
        f"Fix: {disk_fix(code, target.parent)}"
    )


def _write_staged(
    model: Any, state: dict, staging: Path, tokenizer: Any, config: TrainConfig, facts: RunFacts, target: Path
) -> None:
    """Everything the export holds, into `staging`: weights (read back), tokenizer or processor, card, record."""
    dtype = export_dtype(config)
    peft = hasattr(model, "peft_config")
    written = export_state(model, state, dtype)
    write_weights(model, staging, written, dtype)
    flip_exported(staging)
    if config.train.read_back:
        _check_reloads(model, staging, written, dtype, target)
    if hasattr(tokenizer, "image_processor"):
        _save_processor(tokenizer, staging)
    elif tokenizer is not None:
        tokenizer.save_pretrained(staging)
    _describe(staging, config, facts, peft)


def write_weights(model: Any, staging: Path, written: dict, dtype: torch.dtype) -> None:
    """`model`'s files with `written` (its state dict in the export dtype) as its weights, into `staging`."""
    with dropout_as_loaded(model):  # the config as loaded, not with training's dropout off
        model.save_pretrained(staging, state_dict=dict(written))  # (it empties the dict it is given)
        if not hasattr(model, "peft_config"):  # a whole model: config.json names the dtype its weights are in
            model.config.dtype = dtype  # (save_pretrained wrote the dtype of the fp32 master weights)
            model.config.save_pretrained(staging)


def _check_reloads(model: Any, staging: Path, written: dict, dtype: torch.dtype, target: Path) -> None:
    """The export loaded back as a user loads it must hold what it was written from; else nothing is moved into
    place (train.read_back)."""
    import transformers

    from dpo_train.export.reload import reload_difference

    problems = reload_difference(model, staging, written, dtype)
    if not problems:
        return
    shutil.rmtree(staging, ignore_errors=True)
    name = type(model).__name__ if hasattr(model, "peft_config") else _model_class(model).__name__
    raise ExportError(
        f"{target.name}/ was not written: the export does not load back as the weights it was written from "
        f"({name}, transformers {transformers.__version__}):\n  - " + "\n  - ".join(problems) + "\nLikely causes: "
        "transformers' save or load of this architecture, or a filesystem that does not return what was written. "
        "Fix: a transformers release within dpo-toolkit's range, and report it with the output of `dpo-state env`; "
        "train.read_back: false writes the export without this check"
    )


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
    try:
        os.rename(staging, target)
    except OSError:
        if old is not None:  # the earlier export goes back in place
            os.rename(old, target)
        raise
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old)
