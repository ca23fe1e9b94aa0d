"""TRL's converters: a TRL field's value, as its reader read it, -> the keys it sets here (`section.key`), or the
`build.`, `push.`, `note.` and `unused.` entries the translation prints; each refuses what has no translation."""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpo_data.prepare.hub import cached_snapshot, hub_cache, is_hub_id
from dpo_train.config.schema import choices, interval
from dpo_train.config.trl_readers import attention_name, refuse, shown
from dpo_train.step.loss import LOSSES


@dataclass(frozen=True)
class Context:
    """What a converter reads besides its own value: the whole TRL mapping as TRL's parser reads it (each field
    through its row's reader, TRL's defaults filled in for every mapped field), the processes the run will use,
    and the keys the user overrides with --set."""

    trl: dict
    world: int
    overridden: frozenset = frozenset()
    given: frozenset = frozenset()
    """The fields the file itself sets (the others hold TRL's defaults)."""


def _max_steps(ctx: Context) -> int | None:
    steps = ctx.trl.get("max_steps", -1)
    return steps if steps > 0 else None


def _ratio_of_steps(name: str, ratio: float, ctx: Context, key: str) -> int:
    """TrainingArguments' ratio of the run's steps: ceil(max_steps x ratio)."""
    steps = _max_steps(ctx)
    if steps is None:
        refuse(
            f"{name} is {ratio}, a ratio of the run's steps, but max_steps is not set, so the step count is "
            f"known only when the run plans its epochs; give {name} as a number of steps ({key})"
        )
    return math.ceil(steps * ratio)


def _steps_or_ratio(name: str, value: float, ctx: Context, key: str) -> int:
    """TrainingArguments reads a value in (0, 1) as a ratio of the run's steps, any other as whole steps."""
    if 0 < value < 1:
        return _ratio_of_steps(name, value, ctx, key)
    if value != int(value):
        refuse(
            f"{name} is {value}; a value in (0, 1) is a ratio of the run's steps, any other a whole number of "
            f"steps ({key}); set one of them"
        )
    return int(value)


def pairs_per_step(value: Any, ctx: Context) -> dict:
    pairs = ctx.trl["per_device_train_batch_size"] * ctx.trl["gradient_accumulation_steps"] * ctx.world
    return {"data.batching": "pairs", "data.pairs_per_step": pairs}


def epochs(value: float, ctx: Context) -> dict:
    if value != int(value):
        refuse(
            f"num_train_epochs is {value}; here train.epochs counts whole epochs: give a whole number, or set "
            "max_steps (the run then goes on through the epochs that takes)"
        )
    return {"train.epochs": int(value)}


def step_count(value: int, ctx: Context) -> dict:
    return {"train.max_steps": value if value > 0 else None}


SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
"""TRL's lr_scheduler_type -> optim.scheduler; transformers' others are refused by name."""


def warmup_steps(value: float, ctx: Context) -> dict:
    if not value and ctx.trl.get("warmup_ratio"):
        return {}  # transformers 4.x: warmup_steps 0 leaves the warm-up to warmup_ratio
    if 0 < value < 1:
        return _warm_up("warmup_steps", value, ctx, ratio=True)
    return _warm_up("warmup_steps", _steps_or_ratio("warmup_steps", value, ctx, "optim.warmup_steps"), ctx)


def warmup_ratio(value: float, ctx: Context) -> dict:
    return _warm_up("warmup_ratio", value, ctx, ratio=True) if value else {"optim.warmup_steps": 0}


def _warm_up(name: str, value: float, ctx: Context, ratio: bool = False) -> dict:
    """Whole steps, or a ratio: with max_steps its steps (ceil, as transformers); without, optim.warmup_ratio,
    which the run turns into steps once the loader has planned the epochs (the same ceil)."""
    if value and ctx.trl["lr_scheduler_type"] == "constant":
        refuse(
            f"{name} is {value}, but lr_scheduler_type is constant, which in transformers takes no warm-up "
            "(it ignores the warm-up steps); set lr_scheduler_type: constant_with_warmup to warm up, or drop "
            f"{name}"
        )
    if not ratio:
        return {"optim.warmup_steps": value}
    steps = _max_steps(ctx)
    return {"optim.warmup_ratio": value} if steps is None else {"optim.warmup_steps": math.ceil(steps * value)}


OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw": "adamw", "sgd": "sgd"}
"""TRL's optim -> optim.name (transformers' fused AdamW is AdamW's math)."""


def betas(value: Any, ctx: Context) -> dict:
    return {"optim.betas": [ctx.trl["adam_beta1"], ctx.trl["adam_beta2"]]}


def seed(value: int, ctx: Context) -> dict:
    seeds = {"train.seed": value}
    return seeds if ctx.trl.get("data_seed") is not None else {**seeds, "data.seed": value}


def data_seed(value: int | None, ctx: Context) -> dict:
    return {} if value is None else {"data.seed": value}


def log_every(value: float, ctx: Context) -> dict:
    return {"train.log_every": _steps_or_ratio("logging_steps", value, ctx, "train.log_every")}


def save_every(value: float, ctx: Context) -> dict:
    if ctx.trl["save_strategy"] == "no":
        return {"train.save_every": 0}
    return {"train.save_every": _steps_or_ratio("save_steps", value, ctx, "train.save_every")}


KEEP_ALL = int(interval("train.keep_last").high)
"""train.keep_last's largest value (its key's range): TRL's save_total_limit None keeps all."""


def keep_last(value: int | None, ctx: Context) -> dict:
    return {"train.keep_last": KEEP_ALL if value is None else value}


DTYPES = ("auto", "bfloat16", "float16", "float32")
"""TRL's ModelConfig dtype (torch_dtype before transformers 4.56): the dtype the weights load in."""


def precision(value: Any, ctx: Context) -> dict:
    """bf16, fp16 and the model's dtype say one thing here: train.precision (bf16 autocast over fp32 master
    weights, where TRL's dtype bfloat16 would hold the weights themselves in bf16)."""
    dtype_name, dtype = _dtype(ctx)
    if ctx.trl["fp16"] or dtype == "float16":
        what = "fp16 is true" if ctx.trl["fp16"] else f"{dtype_name} is float16"
        refuse(f"{what}; this toolkit has no fp16 (no loss scaling): set bf16: true (train.precision: bf16)")
    bf16 = ctx.trl["bf16"]
    if dtype == "bfloat16" and bf16 is False:
        refuse(
            f"{dtype_name} is bfloat16 and bf16 is false; here bf16 is one setting, train.precision (bf16 compute "
            f"over fp32 master weights): set bf16: true, or {dtype_name}: float32 for fp32"
        )
    bf16 = True if bf16 is None and dtype == "bfloat16" else bf16
    return {"train.precision": "auto" if bf16 is None else "bf16" if bf16 else "fp32"}


def _dtype(ctx: Context) -> tuple[str, str | None]:
    """(the field that names the model's dtype, its value): torch_dtype when the file sets it, else dtype."""
    dtype, torch_dtype = ctx.trl["dtype"], ctx.trl.get("torch_dtype")
    if torch_dtype is not None and dtype not in (None, "float32", torch_dtype):
        refuse(f"torch_dtype is {torch_dtype!r} and dtype is {dtype!r}: torch_dtype is dtype's older name; keep one")
    return ("torch_dtype", torch_dtype) if torch_dtype is not None else ("dtype", dtype)


SINKS = choices("train.report_to[]")
"""train.report_to's sinks (its key's choices): the report_to names that keep their meaning here."""


def report_to(value: str | list[str] | None, ctx: Context) -> dict:
    sinks = [] if value in (None, "none") else [value] if isinstance(value, str) else list(value)
    sinks = [sink for sink in sinks if sink != "none"]
    other = [sink for sink in sinks if sink not in SINKS]
    if other:
        everything = " (transformers' 'all': every integration installed; name them)" if "all" in other else ""
        refuse(
            f"report_to names {', '.join(other)}{everything}; here: {', '.join(SINKS)} (train.report_to), "
            "besides OUTPUT/metrics.jsonl, which is always written; keep those, drop the others"
        )
    return {"train.report_to": sinks}


def eval_every(value: str, ctx: Context) -> dict:
    """Every N steps on eval.path; TRL evaluates the dataset's test split, which has no counterpart until a
    held-out set is built: without --set eval.path the translation says so instead of an eval.every that
    evaluates nothing."""
    if value == "no":
        return {}
    steps = _steps_or_ratio("eval_steps", ctx.trl["eval_steps"] or ctx.trl["logging_steps"], ctx, "eval.every")
    if "eval.path" in ctx.overridden:
        return {"eval.every": steps}
    return {
        "note.eval_strategy": f"eval_strategy is steps (every {steps} steps), but there is no held-out set here "
        "yet, so the run evaluates nothing: build one (dpo-data build HELD_OUT_FILES ... --out DIR) and translate "
        f"again with --set eval.path=DIR, which evaluates every {steps} steps"
    }


def output_dir(value: str | None, ctx: Context) -> dict:
    return {"train.output_dir": "trainer_output" if value is None else value}


def resume(value: str | None, ctx: Context) -> dict:
    return {} if value is None else {"train.resume": value}


def reference(value: bool, ctx: Context) -> dict:
    if not value:
        return {}
    out = ctx.trl.get("output_dir") or "trainer_output"
    return {"reference.mode": "precomputed", "reference.path": f"{out}-reference"}


def loss_type(value: str | list[str], ctx: Context) -> dict:
    listed = [value] if isinstance(value, str) else value
    unknown = [name for name in listed if name not in LOSSES]
    if unknown:
        refuse(
            f"loss_type names {', '.join(map(repr, unknown))}; here (TRL 1.16's names, docs/objective.md): "
            f"{', '.join(LOSSES)}; use one of them"
        )
    smoothing = ctx.trl["label_smoothing"]
    if "sigmoid" in listed and smoothing:
        refuse(
            f"loss_type lists sigmoid and label_smoothing is {smoothing}: TRL 1.16's sigmoid reads no "
            "label_smoothing (it trains plain DPO), and here sigmoid applies it (conservative DPO); set "
            "label_smoothing: 0 for TRL's behaviour, or write the loss section by hand for conservative DPO"
        )
    return {"loss.type": listed[0] if len(listed) == 1 else listed}


def attention(value: str | None, ctx: Context) -> dict:
    return {} if value is None else {"model.attention": value}


def init_kwargs(value: dict | None, ctx: Context) -> dict:
    if value is None:
        return {}
    other = sorted(set(value) - {"attn_implementation", "dtype", "torch_dtype"})
    dtype = value.get("dtype", value.get("torch_dtype", "float32"))
    if other or dtype not in ("float32", None):
        refuse(
            f"model_init_kwargs has {', '.join(other + ([f'dtype {dtype}'] if dtype not in ('float32', None) else []))}"
            ", which this toolkit does not take: weights load and train in fp32 (bf16: true gives bf16 compute, "
            "train.export_dtype the exported dtype); only attn_implementation maps (model.attention)"
        )
    return attention(attention_name("model_init_kwargs.attn_implementation", value.get("attn_implementation")), ctx)


def lora(value: bool, ctx: Context) -> dict:
    if not value:
        return {}
    targets = ctx.trl["lora_target_modules"]
    if targets is None:
        refuse(
            "use_peft is true and lora_target_modules is not set: PEFT then picks modules per architecture "
            "([q_proj, v_proj] for Llama); name them (lora_target_modules: [q_proj, v_proj], or all-linear)"
        )
    adapter = {key: ctx.trl[f"lora_{key}"] for key in ("r", "alpha", "dropout")}
    return {"model.lora": {**adapter, "target_modules": targets}}


def model_path(value: str | None, ctx: Context) -> dict:
    """A local directory as it is; a Hub id (what transformers reads when no such directory exists) from the local
    Hugging Face cache, offline, or refused now rather than when the run loads it."""
    if value is None or "model.path" in ctx.overridden:
        return {}
    if Path(value).expanduser().is_dir() or not is_hub_id(value):
        return {"model.path": value}
    local = cached_snapshot(value, "model", "config.json")
    if local is None:
        refuse(
            f"model_name_or_path is {value!r}: no such local directory, and a Hub model id that is not in the "
            f"local Hugging Face cache ({hub_cache()}); dpo-train never downloads: fetch it first "
            f"(`hf download {value}`) or give a local model directory (--set model.path=DIR)"
        )
    return {
        "model.path": local,
        "note.model_name_or_path": f"model_name_or_path {value} is a Hub id: model.path is its copy in the local "
        f"Hugging Face cache, {local}",
    }


def run_name(value: str | None, ctx: Context) -> dict:
    """run_name names TRL's run in its loggers only; here train.output_dir names the run, WANDB_NAME a W&B run."""
    if value is None:
        return {}
    return {
        "note.run_name": f"run_name {shown(value)} names the run in TRL's loggers only; here train.output_dir names "
        f"the run, and a W&B run (train.report_to: [wandb]) takes WANDB_NAME: `WANDB_NAME={shlex.quote(value)} "
        "dpo-train CONFIG`; nothing else changes"
    }


def build_option(option: str) -> Callable[[Any, Context], dict]:
    """A build-time field: an option of the `dpo-data build` command the translation prints."""
    return lambda value, ctx: {} if value is None else {f"build.{option}": value}


def truncation(value: str, ctx: Context) -> dict:
    return {"build.--overlength": "truncate-prompt"} if value == "keep_end" else {}


def max_prompt_length(value: int | None, ctx: Context) -> dict:
    if value is None:
        return {}
    return {
        "build.--overlength": "truncate-prompt",
        "note.max_prompt_length": f"max_prompt_length is {value}: here a prompt is cut (its oldest tokens first) "
        "only as far as the build's --max-length needs, not to a length of its own",
    }


def push(value: bool, ctx: Context) -> dict:
    """push_to_hub: the `dpo-state push` command to run once the run has exported OUTPUT/final."""
    repo = ctx.trl["hub_model_id"]
    if not value and repo:
        return {"note.hub_model_id": f"hub_model_id is {repo} but push_to_hub is false: nothing is pushed"}
    if not value:
        return {"unused.push_to_hub": value} if "push_to_hub" in ctx.given else {}
    name = repo or Path(ctx.trl["output_dir"] or "trainer_output").name  # TRL's repo name without hub_model_id
    return {
        "push.repo": name if "/" in name else f"NAMESPACE/{name}",
        "push.--private": bool(ctx.trl["hub_private_repo"]),
    }


def accepted(name: str) -> Callable[[Any, Context], dict]:
    """A field read and checked, whose value changes nothing here: listed as accepted when the file sets it."""
    return lambda value, ctx: {f"unused.{name}": value} if name in ctx.given else {}


def read_elsewhere(value: Any, ctx: Context) -> dict:
    """A field that sets nothing itself: another field's converter reads it, or its reader's check is all of it."""
    return {}
