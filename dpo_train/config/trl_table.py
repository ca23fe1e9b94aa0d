"""TRL's names for this config: one table from TRL 1.16's DPOConfig (and its TrainingArguments, ModelConfig,
ScriptArguments and DatasetMixtureConfig) fields to this toolkit's keys, each row naming its reader, its converter
and TRL's default, or why the field is refused; the "did you mean" hint the loader reads; the docs' table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpo_train.config.schema import interval
from dpo_train.config.trl_convert import (
    DTYPES,
    KEEP_ALL,
    OPTIMIZERS,
    SCHEDULERS,
    Context,
    accepted,
    attention,
    betas,
    build_option,
    data_seed,
    epochs,
    eval_every,
    init_kwargs,
    keep_last,
    log_every,
    lora,
    loss_type,
    max_prompt_length,
    model_path,
    output_dir,
    pairs_per_step,
    precision,
    push,
    read_elsewhere,
    reference,
    report_to,
    resume,
    run_name,
    save_every,
    seed,
    step_count,
    truncation,
    warmup_ratio,
    warmup_steps,
)
from dpo_train.config.trl_datasets import dataset, datasets, mixture, test_split
from dpo_train.config.trl_readers import (
    Reader,
    attention_name,
    boolean,
    checkpoint,
    choice,
    count,
    dataset_list,
    f_divergence,
    mapping,
    names,
    number,
    numbers,
    optional,
    text,
    within,
)

UNSET = object()
"""A row's TRL default when the row has none to fill in (refused and accepted-only rows)."""


@dataclass(frozen=True)
class Row:
    """One TRL field. `here`: the key(s) it sets ('' when it sets none); `note`: how the value converts, or
    why it is refused; `convert(value, ctx) -> {section.key: value}` (raises Untranslatable), absent for a
    field with no counterpart; `harmless`: values that change nothing here (accepted, setting no key);
    `default`: TRL's default, translated when the file omits the field (rows with `convert` only); `read`: the
    reader of its kind of value (every row with `convert` has one), applied before any converter sees it."""

    here: str
    note: str
    convert: Callable[[Any, Context], dict] | None = None
    harmless: tuple = ()
    default: Any = UNSET
    read: Reader | None = None


def to(key: str, note: str = "", *, default: Any, cast: Callable = lambda v: v, read: Reader | None = None) -> Row:
    """The row of a field that sets one key here to its value (through `cast`), its key named once: read by
    `read`, else by the key's own type, range or choices (`within`), null too where TRL's default is null."""
    if read is None:
        read = optional(within(key)) if default is None else within(key)
    return Row(key, note, lambda value, ctx: {key: cast(value)}, default=default, read=read)


def _most(path: str) -> float:
    """The largest value of key `path` (its range's upper end): a TRL count read as that key's is no larger."""
    return interval(path).high


def _build_time(option: str) -> str:
    return f"a build option here: `dpo-data build {option}` (the dataset is tokenized once, before training)"


_UNUSED = "changes nothing here"

TABLE: dict[str, Row] = {
    # DPOConfig's own fields (TRL 1.16), in its order
    "model_init_kwargs": Row(
        "model.attention",
        "only `attn_implementation` (and dtype float32) maps; weights train in fp32",
        init_kwargs,
        default=None,
        read=optional(mapping),
    ),
    "trust_remote_code": Row("", "transformers' own model classes only", harmless=(False,), read=boolean),
    "router_aux_loss_coef": to(
        "loss.router_aux_coef",
        "null: the model config's",
        default=None,
    ),
    "disable_dropout": Row(
        "", "dropout is always off here (policy and reference score a pair alike)", harmless=(True,), read=boolean
    ),
    "dataset_num_proc": Row(
        "dpo-data build --num-proc",
        _build_time("--num-proc N"),
        build_option("--num-proc"),
        default=None,
        read=optional(count(1)),
    ),
    "max_length": Row(
        "dpo-data build --max-length",
        _build_time("--max-length N")
        + "; a pair longer is rejected by the build (or its prompt cut, --overlength truncate-prompt) where TRL cuts "
        "the completion's end; null: no bound",
        build_option("--max-length"),
        default=1024,
        read=optional(count(2)),
    ),
    "truncation_mode": Row(
        "dpo-data build --overlength",
        _build_time("--overlength")
        + ": keep_start, the build's default reject (a completion is never cut here); keep_end: truncate-prompt",
        truncation,
        default="keep_start",
        read=choice(("keep_start", "keep_end"), "dpo-data build --overlength reject or truncate-prompt"),
    ),
    "padding_free": Row("", "packing is always on here", harmless=(False, True), read=boolean),
    "pad_to_multiple_of": Row("", "packed rows are not padded", harmless=("auto", None)),
    "precompute_ref_log_probs": Row(
        "reference.mode, reference.path",
        "true: precomputed, sidecar OUTPUT_DIR-reference; create it with `dpo-train CONFIG --precompute-reference`",
        reference,
        default=False,
        read=boolean,
    ),
    "precompute_ref_batch_size": Row(
        "", "the sidecar is scored in the run's micro-batches; " + _UNUSED, harmless=(None,)
    ),
    "loss_type": Row("loss.type", "one name or a list, TRL's names", loss_type, default=["sigmoid"], read=names),
    "loss_weights": to("loss.weights", default=None, read=optional(numbers)),
    "ld_alpha": to("loss.ld_alpha", default=None),
    "f_divergence_type": to(
        "loss.f_divergence_type",
        "TRL's enum values",
        default="reverse_kl",
        read=f_divergence,
    ),
    "f_alpha_divergence_coef": to("loss.f_alpha_divergence_coef", default=0.5),
    "label_smoothing": to(
        "loss.label_smoothing",
        "refused > 0 with sigmoid, which TRL 1.16 does not smooth; below 0.5 (docs/objective.md)",
        default=0.0,
    ),
    "beta": to("loss.beta", default=0.1),
    "use_weighting": to("loss.use_weighting", default=False),
    "discopop_tau": to("loss.discopop_tau", default=0.05),
    "activation_offloading": Row("", "no CPU offload of activations here", harmless=(False,), read=boolean),
    "sync_ref_model": to(
        "reference.sync_ref_model",
        "TR-DPO (docs/objective.md)",
        default=False,
    ),
    "ref_model_mixup_alpha": to("reference.ref_model_mixup_alpha", default=0.6),
    "ref_model_sync_steps": to("reference.ref_model_sync_steps", default=512),
    "pad_token": Row("", "packed rows have no padding (TRL deprecates it)", harmless=(None,)),
    # TrainingArguments fields TRL users set
    "output_dir": Row(
        "train.output_dir", "null: trainer_output, as transformers", output_dir, default=None, read=optional(text)
    ),
    "per_device_train_batch_size": Row(
        "data.pairs_per_step",
        "pairs of the whole optimizer step: per_device_train_batch_size x gradient_accumulation_steps x processes "
        "(--nproc-per-node); micro-batches are packed by data.max_tokens_per_microbatch",
        pairs_per_step,
        default=8,
        read=count(1),
    ),
    "gradient_accumulation_steps": Row(
        "data.pairs_per_step", "a factor of it (above)", pairs_per_step, default=1, read=count(1)
    ),
    "num_train_epochs": Row(
        "train.epochs", "whole epochs only", epochs, default=3.0, read=number(0, _most("train.epochs"), open_low=True)
    ),
    "max_steps": Row(
        "train.max_steps",
        "-1: null (train.epochs decides)",
        step_count,
        default=-1,
        read=count(-1, _most("train.max_steps")),
    ),
    "learning_rate": to("optim.lr", "TRL's default 1e-6", default=1e-6),
    "lr_scheduler_type": to(
        "optim.scheduler",
        "linear, cosine, constant (no warm-up), constant_with_warmup; others refused",
        cast=SCHEDULERS.get,
        default="linear",
        read=choice(SCHEDULERS, "optim.scheduler linear, cosine or constant after optim.warmup_steps"),
    ),
    "lr_scheduler_kwargs": Row("", "the schedulers here take no arguments", harmless=(None, {})),
    "warmup_steps": Row(
        "optim.warmup_steps, optim.warmup_ratio",
        "a value in (0, 1) is a ratio: ceil(max_steps x ratio), without max_steps optim.warmup_ratio; the ramp "
        "here starts at lr / (N + 1), not 0",
        warmup_steps,
        default=0,
        read=number(0),
    ),
    "warmup_ratio": Row(
        "optim.warmup_steps, optim.warmup_ratio",
        "transformers 4.x: a ratio in [0, 1], ceil(max_steps x ratio); without max_steps optim.warmup_ratio, the "
        "same ceil of the steps the loader plans for the epochs",
        warmup_ratio,
        read=within(
            "optim.warmup_ratio",
            fix="warmup_ratio is a share of the run's steps; give a number of steps as warmup_steps",
        ),
    ),
    "optim": to(
        "optim.name",
        "adamw_torch, adamw_torch_fused: adamw; sgd; others refused",
        cast=OPTIMIZERS.get,
        default="adamw_torch_fused",
        read=choice(OPTIMIZERS, "optim.name adamw or sgd"),
    ),
    "optim_args": Row("", "the optimizers here take no extra arguments", harmless=(None,)),
    "weight_decay": to(
        "optim.weight_decay",
        "applied to every parameter here (transformers skips biases and norms)",
        default=0.0,
    ),
    "adam_beta1": Row("optim.betas[0]", "", betas, default=0.9, read=within("optim.betas[]")),
    "adam_beta2": Row("optim.betas[1]", "", betas, default=0.999, read=within("optim.betas[]")),
    "adam_epsilon": to("optim.eps", default=1e-8),
    "max_grad_norm": to("optim.max_grad_norm", "0: no clipping", default=1.0),
    "seed": Row(
        "train.seed, data.seed",
        "data.seed from data_seed when that is set",
        seed,
        default=42,
        read=within("train.seed"),
    ),
    "data_seed": Row("data.seed", "", data_seed, default=None, read=optional(within("data.seed"))),
    "logging_strategy": Row(
        "",
        "steps only (train.log_every)",
        read_elsewhere,
        default="steps",
        read=choice(("steps",), "metrics.jsonl logs every train.log_every steps"),
    ),
    "logging_steps": Row(
        "train.log_every",
        "a value in (0, 1): a ratio of max_steps",
        log_every,
        default=10,
        read=number(0, _most("train.log_every"), open_low=True),
    ),
    "logging_first_step": Row("", "", harmless=(False,), read=boolean),
    "save_strategy": Row(
        "train.save_every",
        "steps, or no: save_every 0",
        read_elsewhere,
        default="steps",
        read=choice(("steps", "no"), "checkpoints are taken every train.save_every steps"),
    ),
    "save_steps": Row(
        "train.save_every",
        "a value in (0, 1): a ratio of max_steps",
        save_every,
        default=500,
        read=number(0, _most("train.save_every"), open_low=True),
    ),
    "save_total_limit": Row(
        "train.keep_last",
        f"null: keep every checkpoint ({KEEP_ALL:_})",
        keep_last,
        default=None,
        read=optional(within("train.keep_last")),
    ),
    "save_only_model": Row(
        "", "a checkpoint here always holds what exact resume needs", harmless=(False,), read=boolean
    ),
    "resume_from_checkpoint": Row(
        "train.resume",
        "a checkpoint of this toolkit (docs/checkpoints.md), not a TRL checkpoint-N; null: auto",
        resume,
        default=None,
        read=checkpoint,
    ),
    "bf16": Row(
        "train.precision",
        "true: bf16; false: fp32; null (TRL's default): auto",
        precision,
        default=None,
        read=optional(boolean),
    ),
    "fp16": Row("train.precision", "true refused: no fp16 here", precision, default=False, read=boolean),
    "gradient_checkpointing": to(
        "train.activation_checkpointing",
        "TRL's default true",
        default=True,
    ),
    "gradient_checkpointing_kwargs": Row(
        "", "always non-reentrant here", harmless=(None, {}, {"use_reentrant": False})
    ),
    "report_to": Row(
        "train.report_to",
        "none, tensorboard, wandb; others refused",
        report_to,
        default="none",
        read=optional(names),
    ),
    "eval_strategy": Row(
        "eval.every",
        "steps: eval_steps (else logging_steps), with --set eval.path=DIR (a built held-out dataset); without "
        "one, a note says the run evaluates nothing",
        eval_every,
        default="no",
        read=choice(("no", "steps"), "eval.every"),
    ),
    "eval_steps": Row(
        "eval.every",
        "with eval_strategy steps (above)",
        read_elsewhere,
        default=None,
        read=optional(number(0, _most("eval.every"), open_low=True)),
    ),
    "per_device_eval_batch_size": Row(
        "",
        "evaluation is packed like training; " + _UNUSED,
        accepted("per_device_eval_batch_size"),
        default=8,
        read=count(1),
    ),
    "do_eval": Row(
        "", "evaluation follows eval_strategy and eval.path; " + _UNUSED, harmless=(False, True), read=boolean
    ),
    "log_level": Row(
        "",
        "this toolkit's own messages (--quiet silences progress); " + _UNUSED,
        harmless=("passive", "debug", "info", "warning", "error", "critical"),
    ),
    "push_to_hub": Row(
        "dpo-state push",
        "true: the `dpo-state push OUTPUT_DIR/final REPO_ID` command printed, to run after training",
        push,
        default=False,
        read=boolean,
    ),
    "hub_model_id": Row(
        "dpo-state push",
        "REPO_ID (null: output_dir's name, as TRL)",
        read_elsewhere,
        default=None,
        read=optional(text),
    ),
    "hub_private_repo": Row("dpo-state push --private", "", read_elsewhere, default=None, read=optional(boolean)),
    "dataloader_num_workers": to("data.num_workers", default=0),
    "dataloader_drop_last": Row(
        "", "no pair is dropped here (the last step may be short)", harmless=(False,), read=boolean
    ),
    "use_cpu": Row(
        "distributed.device",
        "true: cpu",
        lambda v, ctx: {"distributed.device": "cpu"} if v else {},
        default=False,
        read=boolean,
    ),
    "run_name": Row(
        "",
        "names the run only: accepted with a note (here train.output_dir names the run, WANDB_NAME a W&B run)",
        run_name,
        default=None,
        read=optional(text),
    ),
    "use_liger_kernel": Row("", "no Liger kernels here", harmless=(False,), read=boolean),
    # older TRL names
    "rpo_alpha": Row(
        "loss.nll_weight",
        "TRL before 1.16 (1.16: loss_type [sigmoid, sft], loss_weights [1, a])",
        lambda v, ctx: {} if v is None else {"loss.nll_weight": v},
        read=optional(within("loss.nll_weight")),
    ),
    "max_prompt_length": Row(
        "dpo-data build --overlength",
        _build_time("--overlength truncate-prompt")
        + ": a prompt is cut (oldest tokens first) only as far as --max-length (prompt and completion) needs",
        max_prompt_length,
        read=optional(count(1)),
    ),
    "max_completion_length": Row("", _build_time("--max-length N") + " (a completion is never truncated here)"),
    # TRL's ModelConfig and ScriptArguments (the YAML of `trl dpo`)
    "model_name_or_path": Row(
        "model.path",
        "a local model directory, or a Hub id found offline in the local Hugging Face cache (else refused)",
        model_path,
        default=None,
        read=optional(text),
    ),
    "model_revision": Row("", "offline: download that revision, point model_name_or_path at it", harmless=("main",)),
    "dtype": Row(
        "train.precision",
        "bfloat16: bf16 (bf16 compute over fp32 master weights); float32, auto: as bf16 says; float16 refused",
        precision,
        default="float32",
        read=optional(choice(DTYPES)),
    ),
    "torch_dtype": Row("train.precision", "dtype's older name (above)", precision, read=optional(choice(DTYPES))),
    "attn_implementation": Row(
        "model.attention", "flash_attention_2, sdpa, eager; null: auto", attention, default=None, read=attention_name
    ),
    "use_peft": Row(
        "model.lora", "true: {r, alpha, dropout, target_modules} from lora_*", lora, default=False, read=boolean
    ),
    "lora_r": Row("model.lora.r", "with use_peft", read_elsewhere, default=16, read=within("model.lora.r")),
    "lora_alpha": Row("model.lora.alpha", "with use_peft", read_elsewhere, default=32, read=within("model.lora.alpha")),
    "lora_dropout": Row(
        "model.lora.dropout", "with use_peft", read_elsewhere, default=0.05, read=within("model.lora.dropout")
    ),
    "lora_target_modules": Row(
        "model.lora.target_modules",
        "with use_peft; required then",
        read_elsewhere,
        default=None,
        read=optional(names),
    ),
    "lora_target_parameters": Row("", "LoRA on linear modules only", harmless=(None,)),
    "lora_modules_to_save": Row("", "no extra trained modules with LoRA here", harmless=(None,)),
    "lora_task_type": Row("", "causal LMs only", harmless=("CAUSAL_LM",)),
    "use_rslora": Row("", "plain LoRA scaling only", harmless=(False,), read=boolean),
    "use_dora": Row("", "no DoRA here", harmless=(False,), read=boolean),
    "load_in_8bit": Row("", "no quantized training here", harmless=(False,), read=boolean),
    "load_in_4bit": Row("", "no quantized training here", harmless=(False,), read=boolean),
    "bnb_4bit_quant_type": Row("", "no quantized training here", harmless=("nf4",)),
    "use_bnb_nested_quant": Row("", "no quantized training here", harmless=(False,), read=boolean),
    "bnb_4bit_quant_storage": Row("", "no quantized training here", harmless=(None,)),
    "dataset_name": Row(
        "data.path",
        "a dataset built by `dpo-data build`; else the input of the printed build command (a local path as it "
        "is, a Hub dataset as hf://datasets/NAME/GLOB) and refused until --set data.path=DIR",
        dataset,
        default=None,
        read=optional(text),
    ),
    "dataset_mixture": Row(
        "dpo-data build",
        "the alignment-handbook's: each dataset's split an input of the printed build command (weight 1.0 only, config "
        "default or none; refused beside dataset_name, which TRL then ignores)",
        mixture,
        read=optional(mapping),
    ),
    "datasets": Row(
        "dpo-data build",
        "TRL's DatasetMixtureConfig list (`trl dpo` trains it when given): each entry's split, or its data_files "
        "(under path json or parquet, a local directory or a Hub dataset), an input of the printed build command "
        "(name default or none; data_dir, columns and fraction refused; refused beside dataset_name, which TRL then "
        "ignores, and beside dataset_mixture)",
        datasets,
        read=optional(dataset_list),
    ),
    "streaming": Row("", "built datasets are memory-mapped (DatasetMixtureConfig's)", harmless=(False,), read=boolean),
    "test_split_size": Row(
        "",
        "DatasetMixtureConfig's: accepted with a note; here every built row trains, and a held-out set is built "
        "apart (eval.path)",
        test_split,
        read=optional(number(0, open_low=True)),
    ),
    "dataset_config": Row("", "the build reads files, not Hub configs", harmless=(None,)),
    "dataset_train_split": Row(
        "dpo-data build",
        "the split whose files the printed build command reads (hf://datasets/NAME/GLOB)",
        read_elsewhere,
        default="train",
        read=text,
    ),
    "dataset_test_split": Row(
        "", "a built dataset is one split: build each, eval.path for held-out", harmless=("test",)
    ),
    "dataset_streaming": Row("", "built datasets are memory-mapped", harmless=(False,), read=boolean),
    "ignore_bias_buffers": Row("", _UNUSED, harmless=(False,), read=boolean),
}
"""Every TRL name this toolkit knows: what it maps to, or why it is refused. The only place TRL names live;
docs/train-config.md's table is `markdown_table()` (tests/trl/test_trl_config.py checks both)."""


def hint(name: str) -> str | None:
    """What an unknown config key that is a TRL name means here, for the "did you mean" of load_config."""
    row = TABLE.get(name)
    if row is None:
        return None
    if row.here:
        return f"{name} is TRL's name; here it is {row.here}; `dpo-train --from-trl` translates a TRL config"
    return f"{name} is TRL's name; this toolkit has no counterpart: {row.note}"


def markdown_table() -> str:
    """docs/train-config.md's mapping table, from TABLE."""
    lines = ["| TRL field | TRL default (when omitted) | here | notes |", "|---|---|---|---|"]
    for name, row in TABLE.items():
        default = "" if row.default is UNSET else f"`{row.default!r}`"
        here = f"`{row.here}`" if row.here else f"none: accepted at {_values(row.harmless)}" if row.harmless else "none"
        lines.append(f"| `{name}` | {default} | {here} | {row.note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _values(values: tuple) -> str:
    return " or ".join(f"`{value!r}`" for value in values)


if __name__ == "__main__":
    print(markdown_table(), end="")
