"""TRL's names for this config: one table from TRL 1.16's DPOConfig (and its TrainingArguments, ModelConfig
and ScriptArguments) fields to this toolkit's keys, what each converts to or why it is refused, and the
"did you mean" hint both the loader and the translation read."""

from __future__ import annotations

import contextlib
import math
import re
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpo_data.prepare.hub import HUB_PREFIX
from dpo_train.errors import ConfigError
from dpo_train.step.loss import F_DIVERGENCES, LOSSES, Interval

UNSET = object()
"""A row's TRL default when the row has none to fill in (refused and accepted-only rows)."""


class Untranslatable(ConfigError):
    """One TRL field's value that has no translation here; the translator lists every one at once."""


Reader = Callable[[str, Any], Any]
"""(TRL field, its value in the file) -> the value as TRL's parser reads it, or Untranslatable naming the field,
the value, what is allowed and the fix."""


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


def refuse(message: str) -> None:
    raise Untranslatable(message)


# -- readers: one per kind of value, each as TRL's parser reads it (a value given as text goes through the
# field's type, as argparse does with the defaults TrlParser sets from the YAML) --------------------------------

TRUE = ("yes", "true", "t", "y", "1")
FALSE = ("no", "false", "f", "n", "0")
"""transformers' `string_to_bool` (hf_argparser.py), TRL's reading of a boolean given as text: these, in any case."""


def shown(value: Any) -> str:
    """A value as an error quotes it: its repr, cut at 60 characters (a field may hold a whole mapping)."""
    return f"{value!r:.60}"


def boolean(name: str, value: Any) -> bool:
    """A boolean: true or false, or text (an integer's digits too) that TRL's string_to_bool reads."""
    if isinstance(value, bool):
        return value
    text = str(value).lower() if isinstance(value, (str, int)) else None
    if text in TRUE or text in FALSE:
        return text in TRUE
    refuse(
        f"{name} is {shown(value)}; TRL reads a boolean here: true or false, or (its parser's string_to_bool) "
        f"yes/no, true/false, t/f, y/n, 1/0 in any case, quoted or not; set {name}: true or {name}: false"
    )


def _numeric(value: Any) -> int | float | None:
    """A YAML number, or text that int() or float() reads (TRL's parser reads a quoted '1e-5' so); None for
    anything else: a boolean, null, a list, a mapping."""
    if isinstance(value, str):
        for parse in (int, float):
            with contextlib.suppress(ValueError):
                return parse(value)
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _span(bounds: Interval) -> str:
    """'in [0, 1]', '> 0', '>= 0' or '' (any finite number)."""
    if bounds.high < math.inf:
        return f"in {bounds}"
    if bounds.low > -math.inf:
        return f"{'>' if bounds.open_low else '>='} {bounds.low:g}"
    return ""


def _number(low: float = -math.inf, high: float = math.inf, *, open_low=False, open_high=False, fix="") -> Reader:
    """A number (TRL's float), finite and inside its bounds; `fix` says what to set instead."""
    bounds = Interval(low, high, open_high=open_high, open_low=open_low)

    def read(name: str, value: Any) -> int | float:
        number = _numeric(value)
        if number is None or (isinstance(number, float) and not math.isfinite(number)) or number not in bounds:
            refuse(
                f"{name} is {shown(value)}; here it must be a finite number {_span(bounds)}".rstrip()
                + f"; {fix or f'set {name} to one'}"
            )
        return number

    return read


def _count(low: int) -> Reader:
    """A whole number >= low (TRL's int; 2.0 is 2)."""

    def read(name: str, value: Any) -> int:
        number = _numeric(value)
        if number is None or (isinstance(number, float) and not number.is_integer()) or number < low:
            refuse(f"{name} is {shown(value)}; here it must be a whole number >= {low}; set {name} to one")
        return int(number)

    return read


def _choice(choices: Iterable[str], explain: str = "") -> Reader:
    """One name of `choices` (TRL's enums and strategies); `explain` says what they become here."""
    choices = tuple(choices)

    def read(name: str, value: Any) -> str:
        if isinstance(value, str) and value in choices:
            return value
        bare = " (YAML reads a bare yes/no/on/off as a boolean: quote the name)" if isinstance(value, bool) else ""
        explained = f" ({explain})" if explain else ""
        refuse(f"{name} is {shown(value)}{bare}; here: {', '.join(choices)}{explained}; set one of them")

    return read


def _text_in(value: Any) -> bool:
    """Text that can be a name or a path: a string, not empty."""
    return isinstance(value, str) and value != ""


def _names(name: str, value: Any) -> str | list[str]:
    """One name or a list of names (TRL's list[str] fields, which take a single string too), as given."""
    if _text_in(value) or (isinstance(value, list) and all(_text_in(item) for item in value)):
        return value
    refuse(f"{name} is {shown(value)}; give a name or a list of names ({name}: [a, b]), each as text")


def _text(name: str, value: Any) -> str:
    """A path or a name (TRL's str)."""
    if _text_in(value):
        return value
    refuse(f"{name} is {shown(value)}; give it as text (a path or a name), quoted where YAML reads it otherwise")


def _mapping(name: str, value: Any) -> dict:
    """A mapping of names to values (TRL's dict fields)."""
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return value
    refuse(f"{name} is {shown(value)}; give a mapping of names to values ({name}: {{key: value}}), or drop it")


def _numbers(name: str, value: Any) -> list:
    """A list of numbers >= 0 (TRL's list[float]), each read as `_number` reads one."""
    if not isinstance(value, list):
        refuse(f"{name} is {shown(value)}; give a list of numbers >= 0 ({name}: [1.0, 0.5])")
    return [_number(0)(f"{name}[{index}]", item) for index, item in enumerate(value)]


def _optional(read: Reader) -> Reader:
    """The field may also be null (TRL's `X | None`)."""
    return lambda name, value: None if value is None else read(name, value)


def _checkpoint(name: str, value: Any) -> str | None:
    """resume_from_checkpoint: a path; null or false resume nothing given (Trainer.train's meaning)."""
    return None if value is None or value is False else _text(name, value)


def _f_divergence(name: str, value: Any) -> str:
    """TRL's f_divergence_type, also as older configs print its enum ('FDivergenceType.JS_DIVERGENCE')."""
    if isinstance(value, str):
        value = value.removeprefix("FDivergenceType.").lower()
    return _choice(F_DIVERGENCES)(name, value)


# -- converters: a field's value (as read) -> the keys it sets here ---------------------------------------------


def _to(key: str, cast: Callable = lambda v: v) -> Callable:
    """A converter setting one key to the value (cast)."""
    return lambda value, ctx: {key: cast(value)}


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


def _pairs_per_step(value: Any, ctx: Context) -> dict:
    pairs = ctx.trl["per_device_train_batch_size"] * ctx.trl["gradient_accumulation_steps"] * ctx.world
    return {"data.batching": "pairs", "data.pairs_per_step": pairs}


def _epochs(value: float, ctx: Context) -> dict:
    if value != int(value):
        refuse(
            f"num_train_epochs is {value}; here train.epochs counts whole epochs: give a whole number, or set "
            "max_steps (the run then goes on through the epochs that takes)"
        )
    return {"train.epochs": int(value)}


def _steps(value: int, ctx: Context) -> dict:
    return {"train.max_steps": value if value > 0 else None}


SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
"""TRL's lr_scheduler_type -> optim.scheduler; transformers' others are refused by name."""


def _warmup_steps(value: float, ctx: Context) -> dict:
    if not value and ctx.trl.get("warmup_ratio"):
        return {}  # transformers 4.x: warmup_steps 0 leaves the warm-up to warmup_ratio
    if 0 < value < 1:
        return _warm_up("warmup_steps", value, ctx, ratio=True)
    return _warm_up("warmup_steps", _steps_or_ratio("warmup_steps", value, ctx, "optim.warmup_steps"), ctx)


def _warmup_ratio(value: float, ctx: Context) -> dict:
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


def _betas(value: Any, ctx: Context) -> dict:
    return {"optim.betas": [ctx.trl["adam_beta1"], ctx.trl["adam_beta2"]]}


def _seed(value: int, ctx: Context) -> dict:
    seed = {"train.seed": value}
    return seed if ctx.trl.get("data_seed") is not None else {**seed, "data.seed": value}


def _data_seed(value: int | None, ctx: Context) -> dict:
    return {} if value is None else {"data.seed": value}


def _log_every(value: float, ctx: Context) -> dict:
    return {"train.log_every": _steps_or_ratio("logging_steps", value, ctx, "train.log_every")}


def _save_every(value: float, ctx: Context) -> dict:
    if ctx.trl["save_strategy"] == "no":
        return {"train.save_every": 0}
    return {"train.save_every": _steps_or_ratio("save_steps", value, ctx, "train.save_every")}


KEEP_ALL = 1_000_000
"""train.keep_last's largest value (schemas/train-config.schema.json): TRL's save_total_limit None keeps all."""


def _keep_last(value: int | None, ctx: Context) -> dict:
    return {"train.keep_last": KEEP_ALL if value is None else value}


DTYPES = ("auto", "bfloat16", "float16", "float32")
"""TRL's ModelConfig dtype (torch_dtype before transformers 4.56): the dtype the weights load in."""


def _precision(value: Any, ctx: Context) -> dict:
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


SINKS = ("tensorboard", "wandb")
"""train.report_to's sinks: the report_to names that keep their meaning here."""


def _report_to(value: str | list[str] | None, ctx: Context) -> dict:
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


def _eval_every(value: str, ctx: Context) -> dict:
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


def _output_dir(value: str | None, ctx: Context) -> dict:
    return {"train.output_dir": "trainer_output" if value is None else value}


def _resume(value: str | None, ctx: Context) -> dict:
    return {} if value is None else {"train.resume": value}


def _reference(value: bool, ctx: Context) -> dict:
    if not value:
        return {}
    output_dir = ctx.trl.get("output_dir") or "trainer_output"
    return {"reference.mode": "precomputed", "reference.path": f"{output_dir}-reference"}


def _loss_type(value: str | list[str], ctx: Context) -> dict:
    names = [value] if isinstance(value, str) else value
    unknown = [name for name in names if name not in LOSSES]
    if unknown:
        refuse(
            f"loss_type names {', '.join(map(repr, unknown))}; here (TRL 1.16's names, docs/objective.md): "
            f"{', '.join(LOSSES)}; use one of them"
        )
    smoothing = ctx.trl["label_smoothing"]
    if "sigmoid" in names and smoothing:
        refuse(
            f"loss_type lists sigmoid and label_smoothing is {smoothing}: TRL 1.16's sigmoid reads no "
            "label_smoothing (it trains plain DPO), and here sigmoid applies it (conservative DPO); set "
            "label_smoothing: 0 for TRL's behaviour, or write the loss section by hand for conservative DPO"
        )
    return {"loss.type": names[0] if len(names) == 1 else names}


ATTENTION = ("flash_attention_2", "sdpa", "eager")
"""attn_implementation values model.attention takes as they are."""

_attention_name = _optional(_choice(ATTENTION, "model.attention; null: auto"))


def _attention(value: str | None, ctx: Context) -> dict:
    return {} if value is None else {"model.attention": value}


def _init_kwargs(value: dict | None, ctx: Context) -> dict:
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
    return _attention(_attention_name("model_init_kwargs.attn_implementation", value.get("attn_implementation")), ctx)


def _lora(value: bool, ctx: Context) -> dict:
    if not value:
        return {}
    targets = ctx.trl["lora_target_modules"]
    if targets is None:
        refuse(
            "use_peft is true and lora_target_modules is not set: PEFT then picks modules per architecture "
            "([q_proj, v_proj] for Llama); name them (lora_target_modules: [q_proj, v_proj], or all-linear)"
        )
    lora = {key: ctx.trl[f"lora_{key}"] for key in ("r", "alpha", "dropout")}
    return {"model.lora": {**lora, "target_modules": targets}}


def _model_path(value: str | None, ctx: Context) -> dict:
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


def _dataset(value: str | None, ctx: Context) -> dict:
    if value is None:
        return {}
    if (Path(value) / "manifest.json").is_file():  # already a dataset built by dpo-data build
        return {"data.path": value}
    return {"build.inputs": [build_input(value, ctx.trl["dataset_train_split"])]}


def _mixture(value: dict, ctx: Context) -> dict:
    """The alignment-handbook's dataset_mixture: each dataset's split becomes one input of the build."""
    if value is None:
        return {}
    datasets = value.get("datasets")
    if not isinstance(datasets, list) or not all(isinstance(d, dict) and _text_in(d.get("id")) for d in datasets):
        refuse(
            f"dataset_mixture is {shown(value)}; the handbook's form is {{datasets: [{{id: OWNER/NAME, split: "
            "train, weight: 1.0}, ...]}}: give each dataset an id"
        )
    if ctx.trl.get("dataset_name") is not None:  # TRL trains the mixture then; one source here, named
        refuse(
            f"dataset_name is {shown(ctx.trl['dataset_name'])} beside dataset_mixture: TRL trains the mixture and "
            "ignores dataset_name; give one of them (drop dataset_name to build the mixture)"
        )
    named = [d for d in datasets if d.get("config") not in (None, "default")]  # the default is what is read
    configs = [f"{d['id']} config {shown(d['config'])}" for d in named]
    if configs:
        refuse(
            f"dataset_mixture names {', '.join(configs)}: the build reads files, not Hub configurations, and would "
            "read the default one; build that configuration's files (hf://datasets/NAME/CONFIG_DIR/GLOB) as an "
            "input instead, and drop config"
        )
    shares = [f"{d['id']} weight {d['weight']}" for d in datasets if d.get("weight", 1.0) != 1.0]
    if shares:
        refuse(
            f"dataset_mixture takes a share of {', '.join(shares)}; here each input is built whole: build a file "
            "of the rows to keep, or several datasets mixed by data.weights; set weight: 1.0"
        )
    inputs = [build_input(d["id"], d.get("split") or "train") for d in datasets]
    held_out = value.get("test_split_size")
    note = (
        {
            "note.dataset_mixture": f"dataset_mixture holds out test_split_size {held_out} rows as the handbook's "
            "eval set; here a held-out set is a dataset of its own: build those rows apart (eval.path)"
        }
        if held_out
        else {}
    )
    return {"build.inputs": inputs, **note}


DATASET_FIELDS = ("path", "name", "data_dir", "data_files", "split", "columns", "fraction")
"""TRL 1.16's DatasetConfig: one entry of `datasets:` (DatasetMixtureConfig), as `trl dpo` reads them."""
FILE_BUILDERS = ("json", "parquet")
"""load_dataset's builders whose `data_files` the build reads as they are (JSON lines or JSON, Parquet)."""


def _dataset_list(name: str, value: Any) -> list:
    """TRL's `datasets:`: a list of DatasetConfig mappings, each with a path."""
    if isinstance(value, list) and all(isinstance(d, dict) and _text_in(d.get("path")) for d in value):
        return value
    refuse(
        f"{name} is {shown(value)}; TRL's form is a list of {{path: OWNER/NAME or a local path, split: train}} "
        "(or {path: json, data_files: FILE}): give each entry a path"
    )


def _datasets(value: list | None, ctx: Context) -> dict:
    """TRL's `datasets:` (what `trl dpo` trains when given, before dataset_name): each entry's files an input of
    the build, a Hub dataset's split as `dataset_name`'s is."""
    if not value:
        return {}
    if ctx.trl.get("dataset_name") is not None:  # TRL loads `datasets` then; one source here, named
        refuse(
            f"dataset_name is {shown(ctx.trl['dataset_name'])} beside datasets: TRL trains datasets and ignores "
            "dataset_name; give one of them (drop dataset_name to build datasets)"
        )
    if ctx.trl.get("dataset_mixture") is not None:
        refuse(
            "datasets and dataset_mixture both name the training data (TRL's list, the alignment-handbook's "
            "mixture); give one of them"
        )
    return {"build.inputs": [item for i, entry in enumerate(value) for item in _entry_inputs(f"datasets[{i}]", entry)]}


def _entry_inputs(where: str, entry: dict) -> list[str]:
    """One DatasetConfig's inputs of the build: its files (`data_files`, under a local `path` or a Hub dataset's)
    or its split; what would change the rows the build reads is refused by name."""
    unknown = [key for key in entry if key not in DATASET_FIELDS]
    if unknown:
        refuse(f"{where} has {', '.join(map(str, unknown))}: TRL's DatasetConfig has {', '.join(DATASET_FIELDS)}")
    _refuse_narrowing(where, entry)
    split = entry.get("split") or "train"
    files = entry.get("data_files")
    if files is None:
        return [build_input(entry["path"], _text(f"{where}.split", split))]
    files = files.get(split) if isinstance(files, dict) else files  # load_dataset's {split: files}
    files = [files] if isinstance(files, str) else files
    if not isinstance(files, list) or not files or not all(_text_in(f) for f in files):
        refuse(
            f"{where}.data_files is {shown(entry['data_files'])}; give a file, a list of files, or {{{split}: "
            "FILES}} for the split"
        )
    return [_entry_file(where, entry["path"], file) for file in files]


def _refuse_narrowing(where: str, entry: dict) -> None:
    """A configuration, a data_dir, a column selection or a share: the build would read other rows or columns."""
    if entry.get("name") not in (None, "default"):
        refuse(
            f"{where} names config {shown(entry['name'])}: the build reads files, not Hub configurations, and "
            "would read the default one; give that configuration's files as data_files instead, and drop name"
        )
    fixes = {
        "data_dir": "give its files as data_files (data_dir/FILE)",
        "columns": "the build reads the preference columns itself (docs/data-build.md): drop columns",
        "fraction": "each input is built whole: build a file of the rows to keep, or mix datasets by data.weights",
    }
    for key, fix in fixes.items():
        if entry.get(key) is not None:
            refuse(f"{where}.{key} is {shown(entry[key])}; here {fix}")


def _entry_file(where: str, path: str, file: str) -> str:
    """A data file as the build reads it: as given under a file builder (json, parquet), inside a local
    directory, or in a Hub dataset (hf://datasets/NAME/FILE)."""
    if path in FILE_BUILDERS:
        return file
    if Path(path).expanduser().is_dir():
        return str(Path(path) / file)
    if "/" in path and is_hub_id(path):  # a name without an owner beside data_files is load_dataset's builder (csv)
        return f"{HUB_PREFIX}{path}/{file}"
    refuse(
        f"{where}.path is {path!r} with data_files: the build reads JSON lines, JSON and Parquet files; give path: "
        "json or parquet (the files as they are), a local directory, or a Hub dataset's OWNER/NAME"
    )


def _test_split(value: float | None, ctx: Context) -> dict:
    """DatasetMixtureConfig's test_split_size: TRL holds those rows out; here a held-out set is built apart."""
    if value is None:
        return {}
    return {
        "note.test_split_size": f"test_split_size {value} holds rows of datasets out as TRL's eval set; here the "
        "build keeps every row for training, and a held-out set is a dataset of its own: build those rows apart "
        "(eval.path)"
    }


def _run_name(value: str | None, ctx: Context) -> dict:
    """run_name names TRL's run in its loggers only; here train.output_dir names the run, WANDB_NAME a W&B run."""
    if value is None:
        return {}
    return {
        "note.run_name": f"run_name {shown(value)} names the run in TRL's loggers only; here train.output_dir names "
        f"the run, and a W&B run (train.report_to: [wandb]) takes WANDB_NAME: `WANDB_NAME={shlex.quote(value)} "
        "dpo-train CONFIG`; nothing else changes"
    }


def _build_option(option: str) -> Callable[[Any, Context], dict]:
    """A build-time field: an option of the `dpo-data build` command the translation prints."""
    return lambda value, ctx: {} if value is None else {f"build.{option}": value}


def _truncation(value: str, ctx: Context) -> dict:
    return {"build.--overlength": "truncate-prompt"} if value == "keep_end" else {}


def _max_prompt_length(value: int | None, ctx: Context) -> dict:
    if value is None:
        return {}
    return {
        "build.--overlength": "truncate-prompt",
        "note.max_prompt_length": f"max_prompt_length is {value}: here a prompt is cut (its oldest tokens first) "
        "only as far as the build's --max-length needs, not to a length of its own",
    }


def _push(value: bool, ctx: Context) -> dict:
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


def _accepted(name: str) -> Callable[[Any, Context], dict]:
    """A field read and checked, whose value changes nothing here: listed as accepted when the file sets it."""
    return lambda value, ctx: {f"unused.{name}": value} if name in ctx.given else {}


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
"""A Hugging Face repo id, NAME or OWNER/NAME: what transformers and datasets read a name as when no local path of
that name exists."""

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv")
"""Names that are files, never a Hub id."""


def is_hub_id(value: str) -> bool:
    """A name that can only be a Hub repo id when no such local path exists (not /abs, ./rel, ../x, x.jsonl)."""
    return HUB_ID.fullmatch(value) is not None and ".." not in value and not value.endswith(DATA_SUFFIXES)


def hub_cache() -> str:
    """Where huggingface_hub keeps its cache (HF_HUB_CACHE), for messages."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def cached_snapshot(repo_id: str, repo_type: str, needs: str = "") -> str | None:
    """The directory of `repo_id`'s snapshot in the local Hugging Face cache (its main revision), found without
    the network, holding `needs`; None when the cache has none."""
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(repo_id, repo_type=repo_type, local_files_only=True)
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError, HFValidationError, OSError: all "not in the cache"
        return None
    return local if not needs or (Path(local) / needs).is_file() else None


def build_input(name: str, split: str) -> str:
    """What `dpo-data build` reads for a TRL dataset name: a local path as it is, a Hub dataset's split as
    hf://datasets/NAME/GLOB, the GLOB matching that split's files in the local cache, else the layout the Hub's
    push_to_hub writes (data/SPLIT-*)."""
    if Path(name).expanduser().exists() or not is_hub_id(name):
        return name
    return f"{HUB_PREFIX}{name}/{_split_glob(name, split)}"


def _split_glob(name: str, split: str) -> str:
    """The GLOB of `split`'s files (SPLIT-*.EXT, or the one file) in one folder of the cached snapshot; without
    a snapshot, or with the split's files spread out, data/SPLIT-*."""
    local = cached_snapshot(name, "dataset")
    files = [path for path in sorted(Path(local).rglob(f"{split}[-.]*")) if path.is_file()] if local else []
    kinds = {(path.parent.relative_to(local).as_posix(), path.suffix) for path in files}
    if len(kinds) != 1:
        return f"data/{split}-*"
    if len(files) == 1:
        return files[0].relative_to(local).as_posix()
    folder, suffix = kinds.pop()
    return f"{'' if folder == '.' else folder + '/'}{split}-*{suffix}"


def _read_elsewhere(value: Any, ctx: Context) -> dict:
    """A field that sets nothing itself: another field's converter reads it, or its reader's check is all of it."""
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
        read=_optional(_mapping),
    ),
    "trust_remote_code": Row("", "transformers' own model classes only", harmless=(False,), read=boolean),
    "router_aux_loss_coef": Row(
        "loss.router_aux_coef",
        "null: the model config's",
        _to("loss.router_aux_coef"),
        default=None,
        read=_optional(_number(0)),
    ),
    "disable_dropout": Row(
        "", "dropout is always off here (policy and reference score a pair alike)", harmless=(True,), read=boolean
    ),
    "dataset_num_proc": Row(
        "dpo-data build --num-proc",
        _build_time("--num-proc N"),
        _build_option("--num-proc"),
        default=None,
        read=_optional(_count(1)),
    ),
    "max_length": Row(
        "dpo-data build --max-length",
        _build_time("--max-length N")
        + "; a pair longer is rejected by the build (or its prompt cut, --overlength truncate-prompt) where TRL cuts "
        "the completion's end; null: no bound",
        _build_option("--max-length"),
        default=1024,
        read=_optional(_count(2)),
    ),
    "truncation_mode": Row(
        "dpo-data build --overlength",
        _build_time("--overlength")
        + ": keep_start, the build's default reject (a completion is never cut here); keep_end: truncate-prompt",
        _truncation,
        default="keep_start",
        read=_choice(("keep_start", "keep_end"), "dpo-data build --overlength reject or truncate-prompt"),
    ),
    "padding_free": Row("", "packing is always on here", harmless=(False, True), read=boolean),
    "pad_to_multiple_of": Row("", "packed rows are not padded", harmless=("auto", None)),
    "precompute_ref_log_probs": Row(
        "reference.mode, reference.path",
        "true: precomputed, sidecar OUTPUT_DIR-reference; create it with `dpo-train CONFIG --precompute-reference`",
        _reference,
        default=False,
        read=boolean,
    ),
    "precompute_ref_batch_size": Row(
        "", "the sidecar is scored in the run's micro-batches; " + _UNUSED, harmless=(None,)
    ),
    "loss_type": Row("loss.type", "one name or a list, TRL's names", _loss_type, default=["sigmoid"], read=_names),
    "loss_weights": Row("loss.weights", "", _to("loss.weights"), default=None, read=_optional(_numbers)),
    "ld_alpha": Row("loss.ld_alpha", "", _to("loss.ld_alpha"), default=None, read=_optional(_number(0, 1))),
    "f_divergence_type": Row(
        "loss.f_divergence_type",
        "TRL's enum values",
        _to("loss.f_divergence_type"),
        default="reverse_kl",
        read=_f_divergence,
    ),
    "f_alpha_divergence_coef": Row(
        "loss.f_alpha_divergence_coef", "", _to("loss.f_alpha_divergence_coef"), default=0.5, read=_number()
    ),
    "label_smoothing": Row(
        "loss.label_smoothing",
        "refused > 0 with sigmoid, which TRL 1.16 does not smooth; below 0.5 (docs/objective.md)",
        _to("loss.label_smoothing"),
        default=0.0,
        read=_number(0),
    ),
    "beta": Row("loss.beta", "", _to("loss.beta"), default=0.1, read=_number(0, open_low=True)),
    "use_weighting": Row("loss.use_weighting", "", _to("loss.use_weighting"), default=False, read=boolean),
    "discopop_tau": Row(
        "loss.discopop_tau", "", _to("loss.discopop_tau"), default=0.05, read=_number(0, open_low=True)
    ),
    "activation_offloading": Row("", "no CPU offload of activations here", harmless=(False,), read=boolean),
    "sync_ref_model": Row(
        "reference.sync_ref_model",
        "TR-DPO (docs/objective.md)",
        _to("reference.sync_ref_model"),
        default=False,
        read=boolean,
    ),
    "ref_model_mixup_alpha": Row(
        "reference.ref_model_mixup_alpha", "", _to("reference.ref_model_mixup_alpha"), default=0.6, read=_number(0, 1)
    ),
    "ref_model_sync_steps": Row(
        "reference.ref_model_sync_steps", "", _to("reference.ref_model_sync_steps"), default=512, read=_count(1)
    ),
    "pad_token": Row("", "packed rows have no padding (TRL deprecates it)", harmless=(None,)),
    # TrainingArguments fields TRL users set
    "output_dir": Row(
        "train.output_dir", "null: trainer_output, as transformers", _output_dir, default=None, read=_optional(_text)
    ),
    "per_device_train_batch_size": Row(
        "data.pairs_per_step",
        "pairs of the whole optimizer step: per_device_train_batch_size x gradient_accumulation_steps x processes "
        "(--nproc-per-node); micro-batches are packed by data.max_tokens_per_microbatch",
        _pairs_per_step,
        default=8,
        read=_count(1),
    ),
    "gradient_accumulation_steps": Row(
        "data.pairs_per_step", "a factor of it (above)", _pairs_per_step, default=1, read=_count(1)
    ),
    "num_train_epochs": Row("train.epochs", "whole epochs only", _epochs, default=3.0, read=_number(0, open_low=True)),
    "max_steps": Row("train.max_steps", "-1: null (train.epochs decides)", _steps, default=-1, read=_count(-1)),
    "learning_rate": Row(
        "optim.lr", "TRL's default 1e-6", _to("optim.lr"), default=1e-6, read=_number(0, open_low=True)
    ),
    "lr_scheduler_type": Row(
        "optim.scheduler",
        "linear, cosine, constant (no warm-up), constant_with_warmup; others refused",
        _to("optim.scheduler", SCHEDULERS.get),
        default="linear",
        read=_choice(SCHEDULERS, "optim.scheduler linear, cosine or constant after optim.warmup_steps"),
    ),
    "lr_scheduler_kwargs": Row("", "the schedulers here take no arguments", harmless=(None, {})),
    "warmup_steps": Row(
        "optim.warmup_steps, optim.warmup_ratio",
        "a value in (0, 1) is a ratio: ceil(max_steps x ratio), without max_steps optim.warmup_ratio; the ramp "
        "here starts at lr / (N + 1), not 0",
        _warmup_steps,
        default=0,
        read=_number(0),
    ),
    "warmup_ratio": Row(
        "optim.warmup_steps, optim.warmup_ratio",
        "transformers 4.x: a ratio in [0, 1], ceil(max_steps x ratio); without max_steps optim.warmup_ratio, the "
        "same ceil of the steps the loader plans for the epochs",
        _warmup_ratio,
        read=_number(0, 1, fix="warmup_ratio is a share of the run's steps; give a number of steps as warmup_steps"),
    ),
    "optim": Row(
        "optim.name",
        "adamw_torch, adamw_torch_fused: adamw; sgd; others refused",
        _to("optim.name", OPTIMIZERS.get),
        default="adamw_torch_fused",
        read=_choice(OPTIMIZERS, "optim.name adamw or sgd"),
    ),
    "optim_args": Row("", "the optimizers here take no extra arguments", harmless=(None,)),
    "weight_decay": Row(
        "optim.weight_decay",
        "applied to every parameter here (transformers skips biases and norms)",
        _to("optim.weight_decay"),
        default=0.0,
        read=_number(0),
    ),
    "adam_beta1": Row("optim.betas[0]", "", _betas, default=0.9, read=_number(0, 1, open_high=True)),
    "adam_beta2": Row("optim.betas[1]", "", _betas, default=0.999, read=_number(0, 1, open_high=True)),
    "adam_epsilon": Row("optim.eps", "", _to("optim.eps"), default=1e-8, read=_number(0, open_low=True)),
    "max_grad_norm": Row(
        "optim.max_grad_norm", "0: no clipping", _to("optim.max_grad_norm"), default=1.0, read=_number(0)
    ),
    "seed": Row(
        "train.seed, data.seed", "data.seed from data_seed when that is set", _seed, default=42, read=_count(0)
    ),
    "data_seed": Row("data.seed", "", _data_seed, default=None, read=_optional(_count(0))),
    "logging_strategy": Row(
        "",
        "steps only (train.log_every)",
        _read_elsewhere,
        default="steps",
        read=_choice(("steps",), "metrics.jsonl logs every train.log_every steps"),
    ),
    "logging_steps": Row(
        "train.log_every",
        "a value in (0, 1): a ratio of max_steps",
        _log_every,
        default=10,
        read=_number(0, open_low=True),
    ),
    "logging_first_step": Row("", "", harmless=(False,), read=boolean),
    "save_strategy": Row(
        "train.save_every",
        "steps, or no: save_every 0",
        _read_elsewhere,
        default="steps",
        read=_choice(("steps", "no"), "checkpoints are taken every train.save_every steps"),
    ),
    "save_steps": Row(
        "train.save_every",
        "a value in (0, 1): a ratio of max_steps",
        _save_every,
        default=500,
        read=_number(0, open_low=True),
    ),
    "save_total_limit": Row(
        "train.keep_last",
        f"null: keep every checkpoint ({KEEP_ALL:_})",
        _keep_last,
        default=None,
        read=_optional(_count(1)),
    ),
    "save_only_model": Row(
        "", "a checkpoint here always holds what exact resume needs", harmless=(False,), read=boolean
    ),
    "resume_from_checkpoint": Row(
        "train.resume",
        "a checkpoint of this toolkit (docs/checkpoints.md), not a TRL checkpoint-N; null: auto",
        _resume,
        default=None,
        read=_checkpoint,
    ),
    "bf16": Row(
        "train.precision",
        "true: bf16; false: fp32; null (TRL's default): auto",
        _precision,
        default=None,
        read=_optional(boolean),
    ),
    "fp16": Row("train.precision", "true refused: no fp16 here", _precision, default=False, read=boolean),
    "gradient_checkpointing": Row(
        "train.activation_checkpointing",
        "TRL's default true",
        _to("train.activation_checkpointing"),
        default=True,
        read=boolean,
    ),
    "gradient_checkpointing_kwargs": Row(
        "", "always non-reentrant here", harmless=(None, {}, {"use_reentrant": False})
    ),
    "report_to": Row(
        "train.report_to",
        "none, tensorboard, wandb; others refused",
        _report_to,
        default="none",
        read=_optional(_names),
    ),
    "eval_strategy": Row(
        "eval.every",
        "steps: eval_steps (else logging_steps), with --set eval.path=DIR (a built held-out dataset); without "
        "one, a note says the run evaluates nothing",
        _eval_every,
        default="no",
        read=_choice(("no", "steps"), "eval.every"),
    ),
    "eval_steps": Row(
        "eval.every",
        "with eval_strategy steps (above)",
        _read_elsewhere,
        default=None,
        read=_optional(_number(0, open_low=True)),
    ),
    "per_device_eval_batch_size": Row(
        "",
        "evaluation is packed like training; " + _UNUSED,
        _accepted("per_device_eval_batch_size"),
        default=8,
        read=_count(1),
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
        _push,
        default=False,
        read=boolean,
    ),
    "hub_model_id": Row(
        "dpo-state push",
        "REPO_ID (null: output_dir's name, as TRL)",
        _read_elsewhere,
        default=None,
        read=_optional(_text),
    ),
    "hub_private_repo": Row("dpo-state push --private", "", _read_elsewhere, default=None, read=_optional(boolean)),
    "dataloader_num_workers": Row("data.num_workers", "", _to("data.num_workers"), default=0, read=_count(0)),
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
        _run_name,
        default=None,
        read=_optional(_text),
    ),
    "use_liger_kernel": Row("", "no Liger kernels here", harmless=(False,), read=boolean),
    # older TRL names
    "rpo_alpha": Row(
        "loss.nll_weight",
        "TRL before 1.16 (1.16: loss_type [sigmoid, sft], loss_weights [1, a])",
        lambda v, ctx: {} if v is None else {"loss.nll_weight": v},
        read=_optional(_number(0)),
    ),
    "max_prompt_length": Row(
        "dpo-data build --overlength",
        _build_time("--overlength truncate-prompt")
        + ": a prompt is cut (oldest tokens first) only as far as --max-length (prompt and completion) needs",
        _max_prompt_length,
        read=_optional(_count(1)),
    ),
    "max_completion_length": Row("", _build_time("--max-length N") + " (a completion is never truncated here)"),
    # TRL's ModelConfig and ScriptArguments (the YAML of `trl dpo`)
    "model_name_or_path": Row(
        "model.path",
        "a local model directory, or a Hub id found offline in the local Hugging Face cache (else refused)",
        _model_path,
        default=None,
        read=_optional(_text),
    ),
    "model_revision": Row("", "offline: download that revision, point model_name_or_path at it", harmless=("main",)),
    "dtype": Row(
        "train.precision",
        "bfloat16: bf16 (bf16 compute over fp32 master weights); float32, auto: as bf16 says; float16 refused",
        _precision,
        default="float32",
        read=_optional(_choice(DTYPES)),
    ),
    "torch_dtype": Row("train.precision", "dtype's older name (above)", _precision, read=_optional(_choice(DTYPES))),
    "attn_implementation": Row(
        "model.attention", "flash_attention_2, sdpa, eager; null: auto", _attention, default=None, read=_attention_name
    ),
    "use_peft": Row(
        "model.lora", "true: {r, alpha, dropout, target_modules} from lora_*", _lora, default=False, read=boolean
    ),
    "lora_r": Row("model.lora.r", "with use_peft", _read_elsewhere, default=16, read=_count(1)),
    "lora_alpha": Row("model.lora.alpha", "with use_peft", _read_elsewhere, default=32, read=_number(0, open_low=True)),
    "lora_dropout": Row(
        "model.lora.dropout", "with use_peft", _read_elsewhere, default=0.05, read=_number(0, 1, open_high=True)
    ),
    "lora_target_modules": Row(
        "model.lora.target_modules",
        "with use_peft; required then",
        _read_elsewhere,
        default=None,
        read=_optional(_names),
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
        _dataset,
        default=None,
        read=_optional(_text),
    ),
    "dataset_mixture": Row(
        "dpo-data build",
        "the alignment-handbook's: each dataset's split an input of the printed build command (weight 1.0 only, config "
        "default or none; refused beside dataset_name, which TRL then ignores)",
        _mixture,
        read=_optional(_mapping),
    ),
    "datasets": Row(
        "dpo-data build",
        "TRL's DatasetMixtureConfig list (`trl dpo` trains it when given): each entry's split, or its data_files "
        "(under path json or parquet, a local directory or a Hub dataset), an input of the printed build command "
        "(name default or none; data_dir, columns and fraction refused; refused beside dataset_name, which TRL then "
        "ignores, and beside dataset_mixture)",
        _datasets,
        read=_optional(_dataset_list),
    ),
    "streaming": Row("", "built datasets are memory-mapped (DatasetMixtureConfig's)", harmless=(False,), read=boolean),
    "test_split_size": Row(
        "",
        "DatasetMixtureConfig's: accepted with a note; here every built row trains, and a held-out set is built "
        "apart (eval.path)",
        _test_split,
        read=_optional(_number(0, open_low=True)),
    ),
    "dataset_config": Row("", "the build reads files, not Hub configs", harmless=(None,)),
    "dataset_train_split": Row(
        "dpo-data build",
        "the split whose files the printed build command reads (hf://datasets/NAME/GLOB)",
        _read_elsewhere,
        default="train",
        read=_text,
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
