"""TRL's names for this config: one table from TRL 1.16's DPOConfig (and its TrainingArguments, ModelConfig and
ScriptArguments) fields to this toolkit's keys, and the translation of a flat TRL YAML config through it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dpo_train.config import SECTIONS, _apply_override, load_config
from dpo_train.errors import ConfigError
from dpo_train.loss import F_DIVERGENCES, LOSSES
from dpo_train.strict_yaml import read_yaml_file

_UNSET = object()
"""A row's TRL default when the row has none to fill in (refused and accepted-only rows)."""


class Untranslatable(ConfigError):
    """One TRL field's value that has no translation here; the translator lists every one at once."""


@dataclass(frozen=True)
class Context:
    """What a converter reads besides its own value: the whole TRL mapping (TRL's defaults filled in for every
    mapped field), the processes the run will use, and the keys the user overrides with --set."""

    trl: dict
    world: int
    overridden: frozenset = frozenset()


@dataclass(frozen=True)
class Row:
    """One TRL field. `here`: the key(s) it sets ('' when it sets none); `note`: how the value converts, or
    why it is refused; `convert(value, ctx) -> {section.key: value}` (raises Untranslatable), absent for a
    field with no counterpart; `harmless`: values that change nothing here (accepted, setting no key);
    `default`: TRL's default, translated when the file omits the field (rows with `convert` only)."""

    here: str
    note: str
    convert: Callable[[Any, Context], dict] | None = None
    harmless: tuple = ()
    default: Any = _UNSET


def _to(key: str, cast: Callable = lambda v: v) -> Callable:
    """A converter setting one key to the value (cast)."""
    return lambda value, ctx: {key: cast(value)}


def _refuse(message: str) -> None:
    raise Untranslatable(message)


def _whole(name: str, value: Any, low: int = 0) -> int:
    """An integral number as an int, or the field refused by name."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < low:
        _refuse(f"{name} is {value!r}; here it must be a whole number >= {low}")
    return int(value)


def _max_steps(ctx: Context) -> int | None:
    steps = ctx.trl.get("max_steps", -1)
    return int(steps) if isinstance(steps, (int, float)) and steps > 0 else None


def _steps_or_ratio(name: str, value: Any, ctx: Context, key: str) -> int:
    """TrainingArguments reads a value in (0, 1) as a ratio of the run's steps (ceil(max_steps x ratio))."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1:
        steps = _max_steps(ctx)
        if steps is None:
            _refuse(
                f"{name} is {value}, a ratio of the run's steps, but max_steps is not set, so the step count is "
                f"known only when the run plans its epochs; give {name} as a number of steps ({key})"
            )
        return math.ceil(steps * value)
    return _whole(name, value)


def _pairs_per_step(value: Any, ctx: Context) -> dict:
    per_device = _whole("per_device_train_batch_size", ctx.trl.get("per_device_train_batch_size", 8), 1)
    accumulation = _whole("gradient_accumulation_steps", ctx.trl.get("gradient_accumulation_steps", 1), 1)
    return {"data.batching": "pairs", "data.pairs_per_step": per_device * accumulation * ctx.world}


def _epochs(value: Any, ctx: Context) -> dict:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value != int(value):
        _refuse(
            f"num_train_epochs is {value}; here train.epochs counts whole epochs: give a whole number, or set "
            "max_steps (the run then goes on through the epochs that takes)"
        )
    return {"train.epochs": _whole("num_train_epochs", value, 1)}


def _steps(value: Any, ctx: Context) -> dict:
    steps = _whole("max_steps", value, -1) if value != -1 else -1
    return {"train.max_steps": steps if steps > 0 else None}


SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
"""TRL's lr_scheduler_type -> optim.scheduler; transformers' others are refused by name."""


def _scheduler(value: Any, ctx: Context) -> dict:
    if value not in SCHEDULERS:
        _refuse(
            f"lr_scheduler_type is {value!r}; here: {', '.join(SCHEDULERS)} (optim.scheduler linear, cosine or "
            "constant after optim.warmup_steps); set one of them"
        )
    return {"optim.scheduler": SCHEDULERS[value]}


def _warmup(name: str) -> Callable:
    def convert(value: Any, ctx: Context) -> dict:
        steps = _steps_or_ratio(name, value, ctx, "optim.warmup_steps")
        if steps and ctx.trl.get("lr_scheduler_type", "linear") == "constant":
            _refuse(
                f"{name} is {value}, but lr_scheduler_type is constant, which in transformers takes no warm-up "
                "(it ignores the warm-up steps); set lr_scheduler_type: constant_with_warmup to warm up, or drop "
                f"{name}"
            )
        if not steps and name == "warmup_steps" and ctx.trl.get("warmup_ratio"):
            return {}  # transformers 4.x: warmup_steps 0 leaves the warm-up to warmup_ratio
        return {"optim.warmup_steps": steps}

    return convert


OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw": "adamw", "sgd": "sgd"}
"""TRL's optim -> optim.name (transformers' fused AdamW is AdamW's math)."""


def _optimizer(value: Any, ctx: Context) -> dict:
    if value not in OPTIMIZERS:
        _refuse(f"optim is {value!r}; here: {', '.join(OPTIMIZERS)} (optim.name adamw or sgd); set one of them")
    return {"optim.name": OPTIMIZERS[value]}


def _betas(value: Any, ctx: Context) -> dict:
    return {"optim.betas": [ctx.trl.get("adam_beta1", 0.9), ctx.trl.get("adam_beta2", 0.999)]}


def _seed(value: Any, ctx: Context) -> dict:
    seed = {"train.seed": value}
    return seed if ctx.trl.get("data_seed") is not None else {**seed, "data.seed": value}


def _data_seed(value: Any, ctx: Context) -> dict:
    return {} if value is None else {"data.seed": value}


def _log_every(value: Any, ctx: Context) -> dict:
    return {"train.log_every": _steps_or_ratio("logging_steps", value, ctx, "train.log_every")}


def _strategy(name: str, allowed: tuple, fix: str) -> Callable:
    def convert(value: Any, ctx: Context) -> dict:
        if value not in allowed:
            _refuse(f"{name} is {value!r}; here: {', '.join(allowed)}; {fix}")
        return {}

    return convert


def _save_every(value: Any, ctx: Context) -> dict:
    if ctx.trl.get("save_strategy", "steps") == "no":
        return {"train.save_every": 0}
    return {"train.save_every": _steps_or_ratio("save_steps", value, ctx, "train.save_every")}


KEEP_ALL = 1_000_000
"""train.keep_last's largest value (schemas/train-config.schema.json): TRL's save_total_limit None keeps all."""


def _keep_last(value: Any, ctx: Context) -> dict:
    return {"train.keep_last": KEEP_ALL if value is None else _whole("save_total_limit", value, 1)}


def _precision(value: Any, ctx: Context) -> dict:
    if ctx.trl.get("fp16"):
        _refuse("fp16 is true; this toolkit has no fp16 (no loss scaling): set bf16: true (train.precision: bf16)")
    bf16 = ctx.trl.get("bf16")
    return {"train.precision": "auto" if bf16 is None else "bf16" if bf16 else "fp32"}


def _report_to(value: Any, ctx: Context) -> dict:
    sinks = [] if value in (None, "none") else [value] if isinstance(value, str) else list(value)
    sinks = [sink for sink in sinks if sink != "none"]
    other = [sink for sink in sinks if sink != "tensorboard"]
    if other:
        _refuse(
            f"report_to names {', '.join(map(str, other))}; here only tensorboard (train.report_to: [tensorboard]) "
            "besides OUTPUT/metrics.jsonl, which is always written; drop the others"
        )
    return {"train.report_to": sinks}


def _eval_every(value: Any, ctx: Context) -> dict:
    if value == "no":
        return {}
    if value != "steps":
        _refuse(f"eval_strategy is {value!r}; here: no, steps (eval.every); set one of them")
    steps = ctx.trl.get("eval_steps") or ctx.trl.get("logging_steps", 10)
    return {"eval.every": _steps_or_ratio("eval_steps", steps, ctx, "eval.every")}


def _output_dir(value: Any, ctx: Context) -> dict:
    return {"train.output_dir": "trainer_output" if value is None else str(value)}


def _resume(value: Any, ctx: Context) -> dict:
    if value in (None, False):
        return {}
    if not isinstance(value, str):
        _refuse(f"resume_from_checkpoint is {value!r}; give the path of a checkpoint of this toolkit (train.resume)")
    return {"train.resume": value}


def _reference(value: Any, ctx: Context) -> dict:
    if not value:
        return {}
    output_dir = ctx.trl.get("output_dir") or "trainer_output"
    return {"reference.mode": "precomputed", "reference.path": f"{output_dir}-reference"}


def _loss_type(value: Any, ctx: Context) -> dict:
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, list) else [value]
    unknown = [name for name in names if name not in LOSSES]
    if unknown:
        _refuse(
            f"loss_type names {', '.join(map(repr, unknown))}; here (TRL 1.16's names, docs/objective.md): "
            f"{', '.join(LOSSES)}; use one of them"
        )
    smoothing = ctx.trl.get("label_smoothing", 0.0)
    if "sigmoid" in names and smoothing:
        _refuse(
            f"loss_type lists sigmoid and label_smoothing is {smoothing}: TRL 1.16's sigmoid reads no "
            "label_smoothing (it trains plain DPO), and here sigmoid applies it (conservative DPO); set "
            "label_smoothing: 0 for TRL's behaviour, or write the loss section by hand for conservative DPO"
        )
    return {"loss.type": names[0] if len(names) == 1 else names}


def _f_divergence(value: Any, ctx: Context) -> dict:
    name = str(value).removeprefix("FDivergenceType.").lower()  # TRL's enum, as older configs print it
    if name not in F_DIVERGENCES:
        _refuse(f"f_divergence_type is {value!r}; here: {', '.join(F_DIVERGENCES)}; set one of them")
    return {"loss.f_divergence_type": name}


ATTENTION = ("flash_attention_2", "sdpa", "eager")
"""attn_implementation values model.attention takes as they are."""


def _attention(value: Any, ctx: Context) -> dict:
    if value is None:
        return {}
    if value not in ATTENTION:
        _refuse(f"attn_implementation is {value!r}; here (model.attention): {', '.join(ATTENTION)} or auto")
    return {"model.attention": value}


def _init_kwargs(value: Any, ctx: Context) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        _refuse(f"model_init_kwargs is {value!r:.60}; give a mapping (or drop it)")
    other = sorted(set(value) - {"attn_implementation", "dtype", "torch_dtype"})
    dtype = value.get("dtype", value.get("torch_dtype", "float32"))
    if other or dtype not in ("float32", None):
        _refuse(
            f"model_init_kwargs has {', '.join(other + ([f'dtype {dtype}'] if dtype not in ('float32', None) else []))}"
            ", which this toolkit does not take: weights load and train in fp32 (bf16: true gives bf16 compute, "
            "train.export_dtype the exported dtype); only attn_implementation maps (model.attention)"
        )
    return _attention(value.get("attn_implementation"), ctx)


def _lora(value: Any, ctx: Context) -> dict:
    if not value:
        return {}
    targets = ctx.trl.get("lora_target_modules")
    if targets is None:
        _refuse(
            "use_peft is true and lora_target_modules is not set: PEFT then picks modules per architecture "
            "([q_proj, v_proj] for Llama); name them (lora_target_modules: [q_proj, v_proj], or all-linear)"
        )
    lora = {key: ctx.trl.get(f"lora_{key}", default) for key, default in (("r", 16), ("alpha", 32), ("dropout", 0.05))}
    return {"model.lora": {**lora, "target_modules": targets}}


def _model_path(value: Any, ctx: Context) -> dict:
    return {} if value is None else {"model.path": str(value)}


def _dataset(value: Any, ctx: Context) -> dict:
    if value is None or "data.path" in ctx.overridden:
        return {}
    if (Path(str(value)) / "manifest.json").is_file():  # already a dataset built by dpo-data build
        return {"data.path": str(value)}
    _refuse(
        f"dataset_name is {value!r}; here data.path is a dataset built by dpo-data build (tokenized, attested): "
        f"build it (dpo-data build RAW_FILES --tokenizer MODEL_DIR --out DIR; a Hub dataset's split as "
        f"hf://datasets/{value}/GLOB) and pass --set data.path=DIR"
    )


def _read_elsewhere(value: Any, ctx: Context) -> dict:
    """A field another field's converter reads (its value lands there): it sets nothing itself."""
    return {}


def _build_time(option: str) -> str:
    return f"a build option here: `dpo-data build {option}` (the dataset is tokenized once, before training)"


_UNUSED = "changes nothing here"

TABLE: dict[str, Row] = {
    # DPOConfig's own fields (TRL 1.16), in its order
    "model_init_kwargs": Row(
        "model.attention",
        "only `attn_implementation` (and dtype float32) maps; weights train in fp32",
        _init_kwargs,
        default=None,
    ),
    "trust_remote_code": Row("", "transformers' own model classes only", harmless=(False,)),
    "router_aux_loss_coef": Row(
        "loss.router_aux_coef", "null: the model config's", _to("loss.router_aux_coef"), default=None
    ),
    "disable_dropout": Row(
        "", "dropout is always off here (policy and reference score a pair alike)", harmless=(True,)
    ),
    "dataset_num_proc": Row("", _build_time("--num-proc N"), harmless=(None,)),
    "max_length": Row(
        "", _build_time("--max-length N") + "; TRL's default 1024 truncates, the build rejects or cuts the prompt"
    ),
    "truncation_mode": Row(
        "", _build_time("--overlength reject|truncate-prompt") + "; a completion is never truncated here"
    ),
    "padding_free": Row("", "packing is always on here", harmless=(False, True)),
    "pad_to_multiple_of": Row("", "packed rows are not padded", harmless=("auto", None)),
    "precompute_ref_log_probs": Row(
        "reference.mode, reference.path",
        "true: precomputed, sidecar OUTPUT_DIR-reference; create it with `dpo-train CONFIG --precompute-reference`",
        _reference,
        default=False,
    ),
    "precompute_ref_batch_size": Row(
        "", "the sidecar is scored in the run's micro-batches; " + _UNUSED, harmless=(None,)
    ),
    "loss_type": Row("loss.type", "one name or a list, TRL's names", _loss_type, default=["sigmoid"]),
    "loss_weights": Row("loss.weights", "", _to("loss.weights"), default=None),
    "ld_alpha": Row("loss.ld_alpha", "", _to("loss.ld_alpha"), default=None),
    "f_divergence_type": Row("loss.f_divergence_type", "TRL's enum values", _f_divergence, default="reverse_kl"),
    "f_alpha_divergence_coef": Row(
        "loss.f_alpha_divergence_coef", "", _to("loss.f_alpha_divergence_coef"), default=0.5
    ),
    "label_smoothing": Row(
        "loss.label_smoothing",
        "refused > 0 with sigmoid, which TRL 1.16 does not smooth",
        _to("loss.label_smoothing"),
        default=0.0,
    ),
    "beta": Row("loss.beta", "", _to("loss.beta"), default=0.1),
    "use_weighting": Row("loss.use_weighting", "", _to("loss.use_weighting"), default=False),
    "discopop_tau": Row("loss.discopop_tau", "", _to("loss.discopop_tau"), default=0.05),
    "activation_offloading": Row("", "no CPU offload of activations here", harmless=(False,)),
    "sync_ref_model": Row(
        "reference.sync_ref_model", "TR-DPO (docs/objective.md)", _to("reference.sync_ref_model"), default=False
    ),
    "ref_model_mixup_alpha": Row(
        "reference.ref_model_mixup_alpha", "", _to("reference.ref_model_mixup_alpha"), default=0.6
    ),
    "ref_model_sync_steps": Row(
        "reference.ref_model_sync_steps", "", _to("reference.ref_model_sync_steps"), default=512
    ),
    "pad_token": Row("", "packed rows have no padding (TRL deprecates it)", harmless=(None,)),
    # TrainingArguments fields TRL users set
    "output_dir": Row("train.output_dir", "null: trainer_output, as transformers", _output_dir, default=None),
    "per_device_train_batch_size": Row(
        "data.pairs_per_step",
        "pairs of the whole optimizer step: per_device_train_batch_size x gradient_accumulation_steps x processes "
        "(--nproc-per-node); micro-batches are packed by data.max_tokens_per_microbatch",
        _pairs_per_step,
        default=8,
    ),
    "gradient_accumulation_steps": Row("data.pairs_per_step", "a factor of it (above)", _pairs_per_step, default=1),
    "num_train_epochs": Row("train.epochs", "whole epochs only", _epochs, default=3.0),
    "max_steps": Row("train.max_steps", "-1: null (train.epochs decides)", _steps, default=-1),
    "learning_rate": Row("optim.lr", "TRL's default 1e-6", _to("optim.lr"), default=1e-6),
    "lr_scheduler_type": Row(
        "optim.scheduler",
        "linear, cosine, constant (no warm-up), constant_with_warmup; others refused",
        _scheduler,
        default="linear",
    ),
    "lr_scheduler_kwargs": Row("", "the schedulers here take no arguments", harmless=(None, {})),
    "warmup_steps": Row(
        "optim.warmup_steps",
        "a value in (0, 1) is a ratio: ceil(max_steps x ratio), refused without max_steps; the ramp here starts "
        "at lr / (N + 1), not 0",
        _warmup("warmup_steps"),
        default=0,
    ),
    "warmup_ratio": Row(
        "optim.warmup_steps",
        "transformers 4.x: ceil(max_steps x ratio), refused without max_steps",
        _warmup("warmup_ratio"),
    ),
    "optim": Row(
        "optim.name",
        "adamw_torch, adamw_torch_fused: adamw; sgd; others refused",
        _optimizer,
        default="adamw_torch_fused",
    ),
    "optim_args": Row("", "the optimizers here take no extra arguments", harmless=(None,)),
    "weight_decay": Row(
        "optim.weight_decay",
        "applied to every parameter here (transformers skips biases and norms)",
        _to("optim.weight_decay"),
        default=0.0,
    ),
    "adam_beta1": Row("optim.betas[0]", "", _betas, default=0.9),
    "adam_beta2": Row("optim.betas[1]", "", _betas, default=0.999),
    "adam_epsilon": Row("optim.eps", "", _to("optim.eps"), default=1e-8),
    "max_grad_norm": Row("optim.max_grad_norm", "0: no clipping", _to("optim.max_grad_norm"), default=1.0),
    "seed": Row("train.seed, data.seed", "data.seed from data_seed when that is set", _seed, default=42),
    "data_seed": Row("data.seed", "", _data_seed, default=None),
    "logging_strategy": Row(
        "",
        "steps only (train.log_every)",
        _strategy("logging_strategy", ("steps",), "metrics.jsonl logs every train.log_every steps"),
        default="steps",
    ),
    "logging_steps": Row("train.log_every", "a value in (0, 1): a ratio of max_steps", _log_every, default=10),
    "logging_first_step": Row("", "", harmless=(False,)),
    "save_strategy": Row(
        "train.save_every",
        "steps, or no: save_every 0",
        _strategy("save_strategy", ("steps", "no"), "checkpoints are taken every train.save_every steps"),
        default="steps",
    ),
    "save_steps": Row("train.save_every", "a value in (0, 1): a ratio of max_steps", _save_every, default=500),
    "save_total_limit": Row("train.keep_last", f"null: keep every checkpoint ({KEEP_ALL:_})", _keep_last, default=None),
    "save_only_model": Row("", "a checkpoint here always holds what exact resume needs", harmless=(False,)),
    "resume_from_checkpoint": Row(
        "train.resume",
        "a checkpoint of this toolkit (docs/checkpoints.md), not a TRL checkpoint-N; null: auto",
        _resume,
        default=None,
    ),
    "bf16": Row("train.precision", "true: bf16; false: fp32; null (TRL's default): auto", _precision, default=None),
    "fp16": Row("train.precision", "true refused: no fp16 here", _precision, default=False),
    "gradient_checkpointing": Row(
        "train.activation_checkpointing", "TRL's default true", _to("train.activation_checkpointing"), default=True
    ),
    "gradient_checkpointing_kwargs": Row(
        "", "always non-reentrant here", harmless=(None, {}, {"use_reentrant": False})
    ),
    "report_to": Row("train.report_to", "none or tensorboard; others refused", _report_to, default="none"),
    "eval_strategy": Row(
        "eval.every",
        "steps: eval_steps (else logging_steps); needs eval.path, a built dataset",
        _eval_every,
        default="no",
    ),
    "eval_steps": Row("eval.every", "with eval_strategy steps (above)", _read_elsewhere, default=None),
    "per_device_eval_batch_size": Row("", "evaluation is packed like training; " + _UNUSED, harmless=(8,)),
    "dataloader_num_workers": Row("data.num_workers", "", _to("data.num_workers"), default=0),
    "dataloader_drop_last": Row("", "no pair is dropped here (the last step may be short)", harmless=(False,)),
    "use_cpu": Row(
        "distributed.device", "true: cpu", lambda v, ctx: {"distributed.device": "cpu"} if v else {}, default=False
    ),
    "run_name": Row("", "the run is named by train.output_dir; " + _UNUSED, harmless=(None,)),
    "use_liger_kernel": Row("", "no Liger kernels here", harmless=(False,)),
    # older TRL names
    "rpo_alpha": Row(
        "loss.nll_weight",
        "TRL before 1.16 (1.16: loss_type [sigmoid, sft], loss_weights [1, a])",
        lambda v, ctx: {} if v is None else {"loss.nll_weight": v},
    ),
    "max_prompt_length": Row("", _build_time("--max-length N") + " (prompt and completion together)"),
    "max_completion_length": Row("", _build_time("--max-length N") + " (a completion is never truncated here)"),
    # TRL's ModelConfig and ScriptArguments (the YAML of `trl dpo`)
    "model_name_or_path": Row(
        "model.path", "a local model directory (dpo-train is offline)", _model_path, default=None
    ),
    "model_revision": Row("", "offline: download that revision, point model_name_or_path at it", harmless=("main",)),
    "dtype": Row("", "weights train in fp32 here; bf16: true for bf16 compute", harmless=("float32",)),
    "attn_implementation": Row(
        "model.attention", "flash_attention_2, sdpa, eager; null: auto", _attention, default=None
    ),
    "use_peft": Row("model.lora", "true: {r, alpha, dropout, target_modules} from lora_*", _lora, default=False),
    "lora_r": Row("model.lora.r", "with use_peft", _read_elsewhere, default=16),
    "lora_alpha": Row("model.lora.alpha", "with use_peft", _read_elsewhere, default=32),
    "lora_dropout": Row("model.lora.dropout", "with use_peft", _read_elsewhere, default=0.05),
    "lora_target_modules": Row(
        "model.lora.target_modules", "with use_peft; required then", _read_elsewhere, default=None
    ),
    "lora_target_parameters": Row("", "LoRA on linear modules only", harmless=(None,)),
    "lora_modules_to_save": Row("", "no extra trained modules with LoRA here", harmless=(None,)),
    "lora_task_type": Row("", "causal LMs only", harmless=("CAUSAL_LM",)),
    "use_rslora": Row("", "plain LoRA scaling only", harmless=(False,)),
    "use_dora": Row("", "no DoRA here", harmless=(False,)),
    "load_in_8bit": Row("", "no quantized training here", harmless=(False,)),
    "load_in_4bit": Row("", "no quantized training here", harmless=(False,)),
    "bnb_4bit_quant_type": Row("", "no quantized training here", harmless=("nf4",)),
    "use_bnb_nested_quant": Row("", "no quantized training here", harmless=(False,)),
    "bnb_4bit_quant_storage": Row("", "no quantized training here", harmless=(None,)),
    "dataset_name": Row(
        "data.path", "a dataset built by `dpo-data build` (else refused with the command)", _dataset, default=None
    ),
    "dataset_config": Row("", "the build reads files, not Hub configs", harmless=(None,)),
    "dataset_train_split": Row(
        "", "a built dataset is one split: build each, eval.path for held-out", harmless=("train",)
    ),
    "dataset_test_split": Row(
        "", "a built dataset is one split: build each, eval.path for held-out", harmless=("test",)
    ),
    "dataset_streaming": Row("", "built datasets are memory-mapped", harmless=(False,)),
    "ignore_bias_buffers": Row("", _UNUSED, harmless=(False,)),
}
"""Every TRL name this toolkit knows: what it maps to, or why it is refused. The only place TRL names live;
docs/train-config.md's table is `markdown_table()` (tests/test_trl_config.py checks both)."""


def hint(name: str) -> str | None:
    """What an unknown config key that is a TRL name means here, for the "did you mean" of load_config."""
    row = TABLE.get(name)
    if row is None:
        return None
    if row.here:
        return f"{name} is TRL's name; here it is {row.here}; `dpo-train --from-trl` translates a TRL config"
    return f"{name} is TRL's name; this toolkit has no counterpart: {row.note}"


def translate(trl: dict, world: int = 1, overrides: list[str] = ()) -> tuple[dict, list[str]]:
    """A flat TRL config -> (this toolkit's config as sections, notes for the user); every field that does
    not translate is named in one ConfigError. TRL's default is translated for each mapped field the file
    omits, so the config trains as TRL would; `overrides` (--set) apply last."""
    overridden = frozenset(item.partition("=")[0].strip() for item in overrides)
    filled = {name: row.default for name, row in TABLE.items() if row.convert and row.default is not _UNSET}
    ctx = Context({**filled, **trl}, world, overridden)
    keys, problems, unused = {}, [], []
    for name in [*trl, *(name for name in filled if name not in trl)]:  # the file's order, then TRL's defaults
        value = ctx.trl[name]
        try:
            for key, out in _translate_one(name, value, ctx, unused).items():
                if key in keys and keys[key][0] != out:
                    problems.append(
                        f"{name} sets {key} to {out!r}, and {keys[key][1]} to {keys[key][0]!r}; make them agree"
                    )
                keys[key] = (out, name)
        except Untranslatable as error:
            problems.append(str(error))
    problems = list(dict.fromkeys(problems))  # bf16 and fp16 share one converter
    if problems:
        raise ConfigError(
            'the TRL config does not translate (docs/train-config.md, "From TRL"):\n  - ' + "\n  - ".join(problems)
        )
    sections: dict = {}
    for key, (value, _) in keys.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = value
    for item in overrides:
        _apply_override(sections, item)
    load_config(sections)  # the translation is a config this toolkit accepts, or its problems are named
    return {"format_version": 1, **{s: sections[s] for s in SECTIONS if s in sections}}, _notes(sections, unused)


def _translate_one(name: str, value: Any, ctx: Context, unused: list[str]) -> dict:
    row = TABLE.get(name)
    if row is None:
        return _unknown(name, value, unused)
    if row.convert is not None:
        return row.convert(value, ctx)
    if value in row.harmless and type(value) is type(row.harmless[row.harmless.index(value)]):
        unused.append(name)
        return {}
    _refuse(f"{name} is {value!r:.60}; this toolkit has no counterpart: {row.note}; drop it")


def _unknown(name: str, value: Any, unused: list[str]) -> dict:
    """A field outside the table: a TrainingArguments field at its default changes nothing; any other value,
    and any other name, is refused by name."""
    from transformers import TrainingArguments  # only a TRL config needs it

    defaults = {f.name: f.default for f in fields(TrainingArguments) if f.init}
    if name in defaults and value == defaults[name]:
        unused.append(name)
        return {}
    if name in defaults:
        _refuse(f"{name} is {value!r:.60}: a transformers TrainingArguments field with no counterpart here; drop it")
    import difflib

    close = difflib.get_close_matches(name, list(TABLE) + list(defaults), n=1)
    _refuse(
        f"{name} is not a field of TRL 1.16's DPOConfig, TrainingArguments, ModelConfig or ScriptArguments"
        + (f" (did you mean {close[0]!r}?)" if close else "")
    )


def _notes(sections: dict, unused: list[str]) -> list[str]:
    """What the user still has to do before the translated config trains, and what was accepted unused."""
    notes = []
    if not sections.get("data", {}).get("path"):
        notes.append(
            "data.path is empty: build the dataset (dpo-data build ...) and set data.path (--set data.path=DIR)"
        )
    if not sections.get("model", {}).get("path"):
        notes.append(
            "model.path is empty: set it to a local model directory (model_name_or_path, or --set model.path=DIR)"
        )
    if sections.get("reference", {}).get("mode") == "precomputed":
        notes.append(
            f"reference.path is {sections['reference']['path']}: create the sidecar first with "
            "`dpo-train CONFIG --precompute-reference`"
        )
    if unused:
        notes.append(f"accepted, changing nothing here: {', '.join(unused)}")
    return notes


def read_trl(path: str | Path) -> dict:
    """A TRL YAML config (flat fields, as TrlParser reads them), read strictly as every config is."""
    raw = read_yaml_file(Path(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"TRL config {path} must hold a mapping of fields, got {type(raw).__name__}")
    return raw


def markdown_table() -> str:
    """docs/train-config.md's mapping table, from TABLE."""
    lines = ["| TRL field | TRL default (when omitted) | here | notes |", "|---|---|---|---|"]
    for name, row in TABLE.items():
        default = "" if row.default is _UNSET else f"`{row.default!r}`"
        here = f"`{row.here}`" if row.here else f"none: accepted at {_values(row.harmless)}" if row.harmless else "none"
        lines.append(f"| `{name}` | {default} | {here} | {row.note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _values(values: tuple) -> str:
    return " or ".join(f"`{value!r}`" for value in values)


if __name__ == "__main__":
    print(markdown_table(), end="")
