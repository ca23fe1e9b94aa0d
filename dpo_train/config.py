"""The training config: YAML -> typed sections, `--set key=value` overrides, unknown keys named with a fix."""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dpo_data.loading.config import LoaderConfig
from dpo_state.schema import load_schema, schema_problems
from dpo_train.errors import ConfigError
from dpo_train.loss import F_DIVERGENCES, LOSSES, LossConfig, loss_type
from dpo_train.strict_yaml import non_finite, parse_yaml, read_yaml_file

CONFIG_SCHEMA = "train-config"
CONFIG_FORMAT_VERSION = 1
INT64 = (-(2**63), 2**63 - 1)
"""Every integer of a config fits here (orjson writes the run identity; torch and numpy take 64-bit seeds)."""


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None
    """A local Hugging Face causal LM directory."""
    init: dict | None = None
    """Random initialization instead of `path`: {config: FILE_OR_MAPPING, seed: 0} (for tests)."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to `path`."""
    attention: str = "auto"
    """auto (flash_attention_2 on CUDA in bf16 when flash-attn is installed, the layout is separate and the
    model needs no chunked attention or sinks, else segments) | segments (attention once per packed
    segment, no row-by-row mask; every window, chunk, softcap and sink applied) | sdpa (transformers'
    sdpa over the row with a mask per layer kind; no softcap, no sinks) | eager (the model's own
    attention with the same masks) | flash_attention_2 | unpacked (no packing: each sequence alone in a
    right-padded batch through the model's own sdpa or eager attention; exact for every model, it costs the
    padding; auto picks it, saying so, for a model with convolution, linear-attention or Mamba layers, or
    ALiBi). A path that cannot express the model's attention is refused by name (docs/train-config.md,
    "Supported architectures")."""
    lora: dict | None = None
    """LoRA adapters through PEFT: {r: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, v_proj]}
    (alpha defaults to 2 r, dropout to 0, target_modules to all-linear). Only the adapters train; the
    live reference is the same model with its adapters disabled. null: full fine-tuning."""


@dataclass(frozen=True)
class ReferenceConfig:
    mode: str = "live"
    """live (a frozen copy) | precomputed (a sidecar of reference log-probs) | none (reference-free losses)."""
    path: str | None = None
    """precomputed: the sidecar directory."""
    sync_ref_model: bool = False
    """TR-DPO (TRL's): after every `ref_model_sync_steps`-th optimizer step the live reference moves toward the
    policy, ref = (1 - ref_model_mixup_alpha) ref + ref_model_mixup_alpha policy. Needs reference.mode live,
    a loss that reads a reference, and full fine-tuning (no model.lora)."""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO: the policy's share in each move, in [0, 1] (TRL's default)."""
    ref_model_sync_steps: int = 512
    """TR-DPO: move after every this many optimizer steps, counted from 1 (TRL's default)."""


LOADER_KEYS = (
    "batching",
    "pairs_per_step",
    "max_tokens_per_microbatch",
    "microbatches_per_step",
    "num_workers",
    "seed",
    "weights",
    "layout",
)
"""The `data` keys that configure the loader: their types, defaults and docs are `LoaderConfig`'s own."""


_LOADER = LoaderConfig()
"""LoaderConfig's defaults: `DataConfig` takes its loader keys' defaults from here, never writing one twice."""


@dataclass(frozen=True)
class DataConfig:
    """The `data:` section: dataset directories, how their shards are checked before use, and the loader's
    keys (`LOADER_KEYS`, documented on `LoaderConfig`; tests/test_config.py checks the two agree)."""

    path: str | list[str] = ""
    """A dataset directory written by `dpo-data build`, or a list of them (a mixture, with `weights`)."""
    verify: str = "full"
    """full (size and sha256 of every shard, the default) | size."""
    batching: str = _LOADER.batching
    pairs_per_step: int | None = _LOADER.pairs_per_step
    max_tokens_per_microbatch: int = _LOADER.max_tokens_per_microbatch
    microbatches_per_step: int = _LOADER.microbatches_per_step
    num_workers: int = _LOADER.num_workers
    seed: int = _LOADER.seed
    weights: list[float] | None = None
    layout: str = _LOADER.layout

    @property
    def paths(self) -> list[str]:
        """`path` as a list of dataset directories (one, or a mixture)."""
        return [self.path] if isinstance(self.path, str) else list(self.path)

    def loader_config(self, rank: int, world_size: int) -> LoaderConfig:
        """The loader config of one rank: these `data` keys plus where the rank sits."""
        values = {key: getattr(self, key) for key in LOADER_KEYS}
        values["weights"] = tuple(self.weights) if self.weights else None
        return LoaderConfig(**values, rank=rank, world_size=world_size)


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"
    """adamw | sgd (plain SGD: its parameters follow the gradient linearly, which the invariance tests use)."""
    lr: float = 1.0e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """adamw: the moment decay rates."""
    eps: float = 1.0e-8
    """adamw: added to the root of the second moment."""
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    scheduler: str = "constant"
    """constant | linear | cosine."""
    warmup_steps: int = 0


@dataclass(frozen=True)
class TrainSection:
    output_dir: str = "runs/train"
    max_steps: int | None = 10
    """Optimizer steps to train; wins over `epochs` when set (as TRL's). null: train `epochs` whole epochs."""
    epochs: int = 1
    """Epochs of the data when `max_steps` is null; with `max_steps` set, the run goes past them (and says so)."""
    save_every: int = 0
    keep_last: int = 3
    log_every: int = 1
    seed: int = 0
    resume: str = "auto"
    """auto (the newest committed checkpoint that verifies, else a fresh start) | never | PATH of a checkpoint."""
    resume_strict: bool = False
    """auto: fail on a committed checkpoint that does not verify, instead of reporting and skipping it."""
    weights_from: str | None = None
    """Start a new run from a checkpoint's model weights alone (they also become the reference)."""
    precision: str = "auto"
    """auto (bf16 autocast where the device supports it, fp32 on CPU) | fp32 | bf16."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward: less memory, about a third more compute."""
    check_microbatches: bool = True
    """Check every micro-batch against the contract (docs/loader.md) before its forward: any loader may
    feed the trainer, and a malformed micro-batch would otherwise train on the wrong tokens silently."""
    probe_packing: bool = True
    """Before step 1, score a packed row of synthetic pairs and the same sequences unpacked through the
    model's eager attention; refuse the run (exit 2) if any pair differs by more than 1e-5 relative
    (docs/train-config.md, "Supported architectures"). A few ms on a tiny model, about three forwards of
    48 tokens on a large one, on CPU before the model moves to its device."""
    parity_guard: bool = True
    """During step 1, while the policy is still the reference (a live reference, LoRA adapters at zero), every
    micro-batch's per-pair log-probs from the policy's training forward must equal the reference's, which
    scores the same pairs packed in another order; a difference stops the run (exit 2) before the optimizer
    steps (docs/train-config.md, "Step 1's parity guard"). It costs nothing: both are computed anyway."""
    on_nonfinite: str = "stop"
    """A step whose loss, log-probs or gradient norm is NaN or infinite on any rank: stop (every rank exits 1
    before the optimizer step; nothing is committed or exported) | skip_step (log it, count it, and leave
    the optimizer and scheduler as they were)."""
    export: str = "adapter"
    """With model.lora, what OUTPUT/final/ holds: adapter (a PEFT adapter directory) | merged (a plain HF
    model with the adapters merged in) | both (the adapter in final/, the merged model in final-merged/).
    Without model.lora, final/ is always the whole model."""
    export_dtype: str = "model"
    """The dtype of the exported weights: model (the model's own dtype as loaded: its config's dtype,
    fp32 without one) | fp32 | bf16. Training keeps fp32 master weights whatever this says."""
    report_to: list = field(default_factory=list)
    """Where the step metrics also go, besides OUTPUT/metrics.jsonl, written by rank 0: tensorboard (event
    files under OUTPUT/tensorboard/; needs the `report` extra) and/or wandb (a W&B run, set up by the WANDB_*
    environment variables; needs the `wandb` extra)."""


@dataclass(frozen=True)
class DistributedConfig:
    strategy: str = "fsdp"
    """fsdp (FSDP2 fully_shard) | ddp."""
    device: str = "auto"
    """auto (cuda, else npu through torch-npu when installed, else cpu) | cpu | cuda | npu."""
    sequence_parallel: dict | None = None
    """Split each packed row over ulysses x context ranks: {ulysses: U, context: C} (each defaults to 1).
    The world is dp x C x U; each group of U x C ranks shares one row, pairs stay whole (docs/objective.md)."""

    @property
    def sequence_sizes(self) -> tuple[int, int]:
        """(ulysses, context)."""
        sp = self.sequence_parallel or {}
        return int(sp.get("ulysses", 1)), int(sp.get("context", 1))


@dataclass(frozen=True)
class EvalConfig:
    path: str | None = None
    """A built held-out dataset: preference accuracy before training and after (OUTPUT/eval.jsonl)."""
    every: int = 0
    """Also evaluate every N optimizer steps (0: only before and after)."""
    early_stopping_metric: str | None = None
    """Stop the run when this eval.jsonl metric (loss, nll, accuracy, margin, logp_accuracy) has not improved
    for `early_stopping_patience` evaluations (dpo_train/early_stopping.py); null: never."""
    early_stopping_patience: int = 3
    """Evaluations in a row without a gain that end the run (HF's `early_stopping_patience`)."""
    early_stopping_threshold: float = 0.0
    """A gain is more than this (HF's `early_stopping_threshold`), in the metric's units."""


SECTIONS = {
    "model": ModelConfig,
    "reference": ReferenceConfig,
    "data": DataConfig,
    "loss": LossConfig,
    "optim": OptimConfig,
    "train": TrainSection,
    "distributed": DistributedConfig,
    "eval": EvalConfig,
}


@dataclass(frozen=True)
class TrainConfig:
    """The whole config, one typed section per top-level key."""

    model: ModelConfig = field(default_factory=ModelConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainSection = field(default_factory=TrainSection)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def resolved(self) -> dict[str, Any]:
        """Every setting, defaults included: what is written to OUTPUT/config.resolved.yaml."""
        return {"format_version": CONFIG_FORMAT_VERSION, **{name: asdict(getattr(self, name)) for name in SECTIONS}}


def load_config(source: str | Path | dict, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML file (or a mapping), apply `key.sub=value` overrides (values parsed as YAML), check
    for unknown keys, validate against schemas/train-config.schema.json, build typed sections, and check
    them together (`check_config` with for_run=False: a config without data.path loads)."""
    raw = _read(source)
    for item in overrides:
        _apply_override(raw, item)
    version = raw.pop("format_version", CONFIG_FORMAT_VERSION)
    if version != CONFIG_FORMAT_VERSION:
        raise ConfigError(
            f"format_version is {version!r}; this dpo-train reads config format_version "
            f"{CONFIG_FORMAT_VERSION}: drop the key, or use the version the config was written for"
        )
    _check_keys(raw)
    bad = non_finite(raw)
    if bad:
        raise ConfigError(
            f"{', '.join(bad)}: not a finite number (NaN or infinity); every number in a config "
            "must be finite and inside the key's range (docs/train-config.md)"
        )
    schema = load_schema(CONFIG_SCHEMA)
    raw, problems = _integers(schema, raw, "")
    if problems:
        raise ConfigError(
            "the config has integers beyond 64 bits; write each inside the range:\n  - " + "\n  - ".join(problems)
        )
    problems = schema_problems(CONFIG_SCHEMA, {"format_version": CONFIG_FORMAT_VERSION, **raw})
    if problems:
        raise ConfigError(
            "the config does not match schemas/train-config.schema.json:\n  - "
            + "\n  - ".join(_with_range(schema, p) for p in problems)
        )
    config = TrainConfig(**{name: cls(**raw.get(name, {})) for name, cls in SECTIONS.items()})
    check_config(config, for_run=False)
    return config


def check_config(config: TrainConfig, for_run: bool = True) -> None:
    """Refuse a config whose settings cannot work, every problem named in one error (`config_problems`,
    `for_run` as there: the run setup calls it plainly, `load_config` with for_run=False)."""
    problems = config_problems(config, for_run)
    if problems:
        raise ConfigError(
            problems[0] if len(problems) == 1 else "the config's settings conflict:\n  - " + "\n  - ".join(problems)
        )


def config_problems(config: TrainConfig, for_run: bool = True) -> list[str]:
    """Every rule the config breaks, each a line naming the key, the value, what is allowed and the fix.

    The config's rules live in two places: a key's own type, choices and range in
    schemas/train-config.schema.json (checked by `load_config` on what the user wrote), and here whatever
    needs the typed config: keys that contradict each other, and the loss type's own facts from
    dpo_train/loss.py's `LOSSES`. `load_config` checks with for_run=False, so that tools and tests can load
    a partial config; the run setup (training, precompute, evaluation) with for_run=True, which adds
    `_RUN_RULES`: what only a run needs (a dataset to train on)."""
    rules = _RULES + (_RUN_RULES if for_run else ())
    return [problem for rule in rules for problem in rule(config)]


def _loss_rules(config: TrainConfig) -> list[str]:
    """loss.type names types of the registry (one, or a list naming each once), and the other loss keys
    agree with them: the weights, label_smoothing's range, the keys only some types read, the f-divergence,
    and the NLL on chosen completions said one way."""
    problems = _loss_type_problems(config.loss)
    if problems:
        return problems
    rules = (
        _weight_problems,
        _smoothing_problems,
        _option_problems,
        _divergence_problems,
        _nll_problems,
        _per_token_problems,
        _sorted_problems,
    )
    return [problem for rule in rules for problem in rule(config.loss)]


def _sorted_problems(loss: LossConfig) -> list[str]:
    """The sorted types (AOT) sort the summed log-ratios, as TRL 1.16 does, and take no pair weight: a sorted
    term holds two pairs, whose WPO weights differ (TRL refuses use_weighting with them too)."""
    sorting = [name for name in loss.types if LOSSES[name].sorted]
    if not sorting:
        return []
    problems = []
    if loss.average_log_prob is True:
        problems.append(
            f"loss.average_log_prob is true, but loss.type lists {sorting[0]}, which sorts the summed "
            "log-ratios over the step as TRL 1.16 does; set loss.average_log_prob: false"
        )
    if loss.use_weighting is True:
        problems.append(
            f"loss.use_weighting is true, but loss.type lists {sorting[0]}: each of its sorted terms pairs two "
            "pairs' log-ratios, and no one pair's WPO weight scales it (TRL 1.16 refuses this too); set "
            "loss.use_weighting: false"
        )
    return problems


def _loss_type_problems(loss: LossConfig) -> list[str]:
    """Each name is the registry's (a list's names by their place, loss.type[i]), and none comes twice."""
    try:
        names = loss.types
    except ConfigError as error:  # an empty list
        return [str(error)]
    problems = []
    for i, name in enumerate(names):
        try:
            loss_type(name, "loss.type" if isinstance(loss.type, str) else f"loss.type[{i}]")
        except ConfigError as error:
            problems.append(str(error))
    twice = list(dict.fromkeys(name for i, name in enumerate(names) if name in names[:i]))
    if twice:
        problems.append(
            f"loss.type {loss.type_text} names {', '.join(map(str, twice))} more than once; list each type "
            "once (its weight in loss.weights says how much it counts)"
        )
    return problems


def _weight_problems(loss: LossConfig) -> list[str]:
    """loss.weights only with a list of types, one finite weight >= 0 per type, not all 0."""
    weights = loss.weights
    if weights is None:
        return []
    if isinstance(loss.type, str):
        return [
            f"loss.weights is {weights}, but loss.type is the one type {loss.type}; weights combine a list of "
            f"types: drop loss.weights, or write loss.type as a list ([{loss.type}, ...])"
        ]
    if len(weights) != len(loss.types):
        return [
            f"loss.weights has {len(weights)} weights for the {len(loss.types)} types of loss.type "
            f"{loss.type_text}; give one weight per type, in its order (or drop loss.weights: 1.0 each)"
        ]
    bad = [w for w in weights if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf]
    if bad:
        return [f"loss.weights is {weights}; each weight is a finite number >= 0, and {bad} are not; fix them"]
    if not any(weights):
        return [
            f"loss.weights is {weights}: every weight is 0, so the objective is 0 and nothing trains; "
            "give a type a weight above 0"
        ]
    return []


def _smoothing_problems(loss: LossConfig) -> list[str]:
    """loss.label_smoothing lies in the range of every listed type that takes it, and is 0 if none does."""
    smoothing = loss.label_smoothing
    ranges = {name: LOSSES[name].label_smoothing for name in loss.types if LOSSES[name].label_smoothing}
    if not ranges and smoothing:
        takers = ", ".join(name for name, other in LOSSES.items() if other.label_smoothing)
        return [
            f"loss.label_smoothing is {smoothing}, but {loss.type_text} has none; set it to 0, or use a "
            f"loss.type that takes it ({takers})"
        ]
    outside = {name: allowed for name, allowed in ranges.items() if smoothing not in allowed}
    if outside and smoothing >= 0.5:  # one reason for every type: what label smoothing is
        allowed = ", ".join(f"{name} allows {interval}" for name, interval in outside.items())
        return [
            f"loss.label_smoothing is {smoothing}; {allowed}: it is the chance that a pair's labels are flipped, "
            "so at 0.5 chosen and rejected weigh the same and the gradient vanishes at parity (the policy still "
            "the reference), and above 0.5 every preference is flipped; set it below 0.5 (robust DPO's paper "
            "suggests 0.1)"
        ]
    return [
        f"loss.label_smoothing is {smoothing}; {name} allows {allowed}; set it inside that range"
        for name, allowed in outside.items()
    ]


def _option_problems(loss: LossConfig) -> list[str]:
    """A key only some types read (their `LossType.options`) keeps its default unless a listed type reads it:
    a value that changes nothing is refused, never dropped."""
    defaults, problems = LossConfig(), []
    for option in dict.fromkeys(option for kind in LOSSES.values() for option in kind.options):
        readers = [name for name, kind in LOSSES.items() if option in kind.options]
        value, default = getattr(loss, option), getattr(defaults, option)
        if value != default and not set(readers) & set(loss.types):
            listing = f"list {readers[0]}" if len(readers) == 1 else f"list one of them ({', '.join(readers)})"
            problems.append(
                f"loss.{option} is {value}, but loss.type {loss.type_text} does not read it (only "
                f"{', '.join(readers)} {'reads' if len(readers) == 1 else 'read'} it); drop it (default "
                f"{default}), or {listing} in loss.type"
            )
    return problems


def _divergence_problems(loss: LossConfig) -> list[str]:
    """A non-default f-divergence only with types that read scores (TRL's rule; sft reads no log-ratio and
    passes), and at least one of them; its alpha only with alpha_divergence."""
    divergence, problems = loss.f_divergence_type, []
    if divergence not in F_DIVERGENCES:
        problems.append(
            f"loss.f_divergence_type is {divergence!r}; allowed: {', '.join(F_DIVERGENCES)}; set it to one of them"
        )
    elif divergence != "reverse_kl":
        takers = ", ".join(name for name, kind in LOSSES.items() if kind.f_divergence)
        refusing = [name for name in loss.types if not (LOSSES[name].f_divergence or LOSSES[name].nll_term)]
        if refusing:
            problems.append(
                f"loss.f_divergence_type is {divergence}, but {', '.join(refusing)} reads the log-ratios "
                "themselves and has no f-divergence form (TRL 1.16 refuses it too); set loss.f_divergence_type: "
                f"reverse_kl, or use types that take it ({takers})"
            )
        elif not any(LOSSES[name].f_divergence for name in loss.types):
            problems.append(
                f"loss.f_divergence_type is {divergence}, but loss.type {loss.type_text} reads no log-ratio, so "
                f"it would change nothing; set loss.f_divergence_type: reverse_kl, or list a type that takes it "
                f"({takers})"
            )
    coef, default = loss.f_alpha_divergence_coef, LossConfig().f_alpha_divergence_coef
    if coef != default and divergence != "alpha_divergence":
        problems.append(
            f"loss.f_alpha_divergence_coef is {coef}, but loss.f_divergence_type is {divergence}: only "
            f"alpha_divergence reads it; drop it (default {default}), or set loss.f_divergence_type: alpha_divergence"
        )
    return problems


def _nll_problems(loss: LossConfig) -> list[str]:
    """The NLL on chosen completions is said one way: a listed NLL type (sft) with its weight, or nll_weight;
    and said at all where a listed method's objective includes it (CPO's BC term, ORPO's SFT term)."""
    listed = [name for name in loss.types if LOSSES[name].nll_term]
    if listed and loss.nll_weight:
        return [
            f"loss.type lists {listed[0]}, the NLL on chosen completions (weighted by its loss.weights entry), "
            f"and loss.nll_weight is {loss.nll_weight}, the same term; say it one way: set loss.nll_weight: 0, "
            f"or drop {listed[0]} from loss.type"
        ]
    wanting = [name for name in loss.types if LOSSES[name].with_nll]
    if wanting and not listed and not loss.nll_weight:
        return [
            f"loss.type {loss.type_text}: {wanting[0]}'s objective adds the NLL on chosen completions (TRL's "
            "cpo_alpha, 1.0 by default, for cpo; weight 1 for orpo), and no key weighs it; say its weight: "
            f"loss.nll_weight: 1.0, or list sft in loss.type with its weight in loss.weights (0 to leave it out)"
        ]
    return []


def _per_token_problems(loss: LossConfig) -> list[str]:
    """ld_alpha null or in [0, 1], use_weighting a bool, and WPO's weights never meet sft: TRL weights its SFT
    term per pair, and ours is the step's NLL per chosen token, which no pair's weight can scale exactly."""
    problems = []
    alpha = loss.ld_alpha
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1):
        problems.append(
            f"loss.ld_alpha is {alpha!r}; allowed: null (plain sums) or a number in [0, 1] (TRL's ld_alpha); set it so"
        )
    if not isinstance(loss.use_weighting, bool):
        problems.append(f"loss.use_weighting is {loss.use_weighting!r}; allowed: true or false; set it to one of them")
    listed = [name for name in loss.types if LOSSES[name].nll_term]
    if loss.use_weighting is True and listed:
        problems.append(
            f"loss.use_weighting is true and loss.type lists {listed[0]}: TRL multiplies its SFT term by each "
            "pair's WPO weight, and here it is the step's NLL per chosen token, which no pair's weight scales; "
            f"drop {listed[0]} from loss.type (loss.nll_weight gives the same term, unweighted), or set "
            "loss.use_weighting: false"
        )
    return problems


def _per_token_rules(config: TrainConfig) -> list[str]:
    """ld_alpha only where the reference's LD sums exist: a sidecar holds plain sums."""
    loss = config.loss
    unknown = bool(_loss_type_problems(loss))  # _loss_rules names it
    if loss.ld_alpha is None or config.reference.mode != "precomputed" or unknown or not loss.needs_reference:
        return []
    return [
        f"loss.ld_alpha is {loss.ld_alpha}, but reference.mode is precomputed: a sidecar holds the reference's "
        "plain summed log-probs, not LD-DPO's; set reference.mode: live (the reference then gets the same "
        "weighting), or loss.ld_alpha: null"
    ]


def _reference_rules(config: TrainConfig) -> list[str]:
    """A precomputed reference names its sidecar; reference.mode none only with a reference-free loss."""
    problems = []
    if config.reference.mode == "precomputed" and not config.reference.path:
        problems.append(
            "reference.mode is precomputed but reference.path is empty; set it to the sidecar "
            "directory and create it with `dpo-train CONFIG --precompute-reference`"
        )
    known = not _loss_type_problems(config.loss)  # an unknown type is _loss_rules' to name
    if known and config.loss.needs_reference and config.reference.mode == "none":
        free = ", ".join(name for name, other in LOSSES.items() if not other.needs_reference)
        problems.append(
            f"loss.type {config.loss.type_text} needs a reference; set reference.mode: live or precomputed, "
            f"or use a reference-free loss.type ({free})"
        )
    return problems


def _eval_rules(config: TrainConfig) -> list[str]:
    """Early stopping watches a metric the evaluations write, evaluated during training; its other keys
    only with it."""
    from dpo_train.early_stopping import LOWER_IS_BETTER

    e, defaults = config.eval, EvalConfig()
    if e.early_stopping_metric is None:
        keys = ("early_stopping_patience", "early_stopping_threshold")
        return [
            f"eval.{key} is {getattr(e, key)}, but eval.early_stopping_metric is null, so nothing reads it; drop it "
            f"(default {getattr(defaults, key)}), or set eval.early_stopping_metric"
            for key in keys
            if getattr(e, key) != getattr(defaults, key)
        ]
    problems = []
    if e.early_stopping_metric not in LOWER_IS_BETTER:
        problems.append(
            f"eval.early_stopping_metric is {e.early_stopping_metric!r}; allowed: {', '.join(LOWER_IS_BETTER)}; "
            "set it to one of them"
        )
    if not e.path or not e.every:
        problems.append(
            f"eval.early_stopping_metric is {e.early_stopping_metric}, but the run does not evaluate during "
            f"training (eval.path {e.path!r}, eval.every {e.every}); set eval.path to a held-out dataset and "
            "eval.every to the steps between evaluations"
        )
    return problems


def _sync_rules(config: TrainConfig) -> list[str]:
    """TR-DPO's keys: a bool, alpha in [0, 1], sync steps >= 1; the mixup keys only with sync_ref_model (they
    would change nothing), and sync_ref_model only where a separate live copy of the reference exists."""
    ref = config.reference
    problems = _sync_value_problems(ref)
    if not isinstance(ref.sync_ref_model, bool):  # named above; whether it is on is unknown
        return problems
    if not ref.sync_ref_model:
        defaults = ReferenceConfig()
        problems += [
            f"reference.{key} is {getattr(ref, key)}, but reference.sync_ref_model is false: only TR-DPO reads it; "
            f"drop it (default {getattr(defaults, key)}), or set reference.sync_ref_model: true"
            for key in ("ref_model_mixup_alpha", "ref_model_sync_steps")
            if getattr(ref, key) != getattr(defaults, key)
        ]
        return problems
    keep = "or set reference.sync_ref_model: false"
    if ref.mode == "precomputed":
        problems.append(
            "reference.sync_ref_model is true, but reference.mode is precomputed: the sidecar holds the log-probs "
            "of a fixed reference, which TR-DPO's moves would make stale (TRL 1.16 refuses it too); set "
            f"reference.mode: live, {keep}"
        )
    free = not _loss_type_problems(config.loss) and not config.loss.needs_reference  # an unknown type: _loss_rules
    if ref.mode == "none" or free:
        why = "reference.mode is none" if ref.mode == "none" else f"loss.type {config.loss.type_text} is reference-free"
        problems.append(
            f"reference.sync_ref_model is true, but {why}: there is no reference to move; use a loss.type that "
            f"reads a reference with reference.mode: live, {keep}"
        )
    if config.model.lora:
        problems.append(
            "reference.sync_ref_model is true, but model.lora is set: the LoRA reference is the policy with its "
            "adapters disabled, so there is no separate copy to move (TRL 1.16 refuses PEFT with it too); drop "
            f"model.lora (full fine-tuning), {keep}"
        )
    return problems


def _sync_value_problems(ref: ReferenceConfig) -> list[str]:
    """The schema's ranges, for a config built in code (load_config has checked them already)."""
    problems = []
    if not isinstance(ref.sync_ref_model, bool):
        problems.append(
            f"reference.sync_ref_model is {ref.sync_ref_model!r}; allowed: true or false; set it to one of them"
        )
    alpha = ref.ref_model_mixup_alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        problems.append(
            f"reference.ref_model_mixup_alpha is {alpha!r}; allowed: a number in [0, 1] (the policy's share in "
            "each move); set it so"
        )
    steps = ref.ref_model_sync_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 1_000_000_000:
        problems.append(
            f"reference.ref_model_sync_steps is {steps!r}; allowed: an integer in [1, 1_000_000_000] (optimizer "
            "steps between moves); set it so"
        )
    return problems


def _train_rules(config: TrainConfig) -> list[str]:
    """train.weights_from starts afresh (no resume PATH); train.export chooses among LoRA exports only."""
    problems = []
    if config.train.weights_from and config.train.resume not in ("auto", "never"):
        problems.append(
            "train.weights_from starts a new run from a checkpoint's weights; it cannot be combined "
            f"with train.resume: {config.train.resume}; drop one of the two"
        )
    if config.train.export != "adapter" and not config.model.lora:
        problems.append(
            f"train.export is {config.train.export}, but model.lora is not set: without adapters final/ is "
            "always the whole model; drop train.export, or set model.lora"
        )
    return problems


def _data_rules(config: TrainConfig) -> list[str]:
    """A run has a dataset to train on."""
    if config.data.path:
        return []
    return ["data.path is empty; set it to a dataset directory written by `dpo-data build` (or a list of them)"]


_RULES = (_loss_rules, _reference_rules, _sync_rules, _per_token_rules, _train_rules, _eval_rules)
"""What any loaded config must satisfy."""
_RUN_RULES = (_data_rules,)
"""What a run needs beyond that: `check_config(config)` (for_run=True) checks these too; `load_config` not."""


def _read(source: str | Path | dict) -> dict:
    if isinstance(source, dict):
        return {k: dict(v) if isinstance(v, dict) else v for k, v in source.items()}
    path = Path(source)
    raw = read_yaml_file(path) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def _apply_override(raw: dict, item: str) -> None:
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: write section.key=value, e.g. --set optim.lr=2e-5")
    section, name = parts
    target = raw.setdefault(section, {})
    if not isinstance(target, dict):
        raise ConfigError(f"--set {item!r}: {section} is not a section")
    target[name] = parse_yaml(value, f"--set {item!r}: the value")


def _check_keys(raw: dict) -> None:
    problems = []
    for section, value in raw.items():
        if section not in SECTIONS:
            problems.append(f"unknown section {section!r}{_suggest(section, SECTIONS)}")
            continue
        if not isinstance(value, dict):
            problems.append(f"section {section!r} must be a mapping, got {value!r:.60}")
            continue
        known = [f.name for f in fields(SECTIONS[section])]
        for key in value:
            if key not in known:
                problems.append(f"unknown key {section}.{key}{_suggest(key, known)}; known keys: {', '.join(known)}")
    if problems:
        raise ConfigError(
            "the config has unknown keys or sections that are not mappings:\n  - " + "\n  - ".join(problems)
        )


def _integers(node: dict, value: Any, path: str) -> tuple[Any, list[str]]:
    """`value` with each integral float of an integer key made an int (YAML reads 1e6 as a float), and a
    line for each integer beyond 64 bits where the schema sets no range (a free mapping such as
    model.init.config): the run identity is written by orjson, which takes 64 bits."""
    if isinstance(value, dict):
        pairs = [
            (k, _integers(_child(node, "properties", k), v, f"{path}.{k}" if path else str(k)))
            for k, v in value.items()
        ]
        return {k: v for k, (v, _) in pairs}, [p for _, (_, problems) in pairs for p in problems]
    if isinstance(value, list):
        items = [_integers(_child(node, "items"), v, f"{path}[{i}]") for i, v in enumerate(value)]
        return [v for v, _ in items], [p for _, problems in items for p in problems]
    integer = "integer" in _types(node)
    if integer and isinstance(value, float) and value.is_integer() and INT64[0] <= value <= INT64[1]:
        return int(value), []
    unbounded = not any(key in node for key in _BOUNDS)  # a bounded key's range is the schema's to report
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1] and unbounded:
        return value, [f"{path} is {value}; an integer in a config must lie in [{INT64[0]:_}, {INT64[1]:_}]"]
    return value, []


def _child(node: dict, kind: str, key: Any = None) -> dict:
    """The schema node of a mapping's key or of a list's items; {} where the schema leaves them free."""
    child = node.get(kind, {})
    return child.get(key, {}) if kind == "properties" else child


def _types(node: dict) -> list[str]:
    types = node.get("type", [])
    return [types] if isinstance(types, str) else types


def _with_range(schema: dict, problem: str) -> str:
    """A schema problem of a bound (minimum, maximum), also naming the key's whole range."""
    path, _, message = problem.partition(": ")
    node = schema
    for part in path.split("/"):
        node = node.get("items", {}) if part.isdigit() else node.get("properties", {}).get(part, {})
    if not ("minimum" in message or "maximum" in message) or not any(key in node for key in _BOUNDS):
        return problem
    return f'{problem}; allowed: {_allowed(node)} (docs/train-config.md, "Bounds")'


_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def _allowed(node: dict) -> str:
    """The range a schema node states, as an interval: 'an integer in [1, 1_000_000]', 'a number in (0, 100]'."""
    low = _end(node, "minimum", "[") or _end(node, "exclusiveMinimum", "(") or "(-inf"
    high = _end(node, "maximum", "]") or _end(node, "exclusiveMaximum", ")") or "inf)"
    return f"{'an integer' if 'integer' in _types(node) else 'a number'} in {low}, {high}"


def _end(node: dict, key: str, bracket: str) -> str | None:
    """One end of the interval; integers with _ between thousands, as YAML also reads them."""
    if key not in node:
        return None
    value = node[key]
    text = f"{value:_}" if isinstance(value, int) else repr(value)
    return bracket + text if bracket in "[(" else text + bracket


def _suggest(name: str, choices) -> str:
    from dpo_train.trl_config import hint  # imports this module: TRL's names live there alone

    trl = hint(name)
    if trl:
        return f" ({trl})"
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
