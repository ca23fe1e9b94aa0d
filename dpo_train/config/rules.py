"""The config's rules: every setting that contradicts another, or the loss type's own facts, named with its fix."""

from __future__ import annotations

import math

from dpo_train.config.schema import interval
from dpo_train.config.sections import (
    EvalConfig,
    ReferenceConfig,
    TrainConfig,
)
from dpo_train.errors import ConfigError
from dpo_train.step.loss import F_DIVERGENCES, LOSSES, LossConfig, loss_type


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
    dpo_train/step/loss.py's `LOSSES`. `load_config` checks with for_run=False, so that tools and tests can load
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
    alpha, allowed = loss.ld_alpha, interval("loss.ld_alpha")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha not in allowed):
        problems.append(
            f"loss.ld_alpha is {alpha!r}; allowed: null (plain sums) or a number in {allowed} (TRL's ld_alpha); "
            "set it so"
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
    from dpo_train.step.early_stopping import LOWER_IS_BETTER, RENAMED

    e, defaults = config.eval, EvalConfig()
    if e.every and not e.path:  # the run would start, evaluate nothing and say nothing
        return [
            f"eval.every is {e.every}, but eval.path is null, so there is nothing to evaluate; set eval.path to a "
            "held-out dataset built by `dpo-data build`, or drop eval.every"
        ]
    if e.early_stopping_metric is None:
        keys = ("early_stopping_patience", "early_stopping_threshold")
        return [
            f"eval.{key} is {getattr(e, key)}, but eval.early_stopping_metric is null, so nothing reads it; drop it "
            f"(default {getattr(defaults, key)}), or set eval.early_stopping_metric"
            for key in keys
            if getattr(e, key) != getattr(defaults, key)
        ]
    problems = []
    metric = e.early_stopping_metric
    if metric in RENAMED:
        problems.append(f"eval.early_stopping_metric is {metric!r}: {RENAMED[metric]}")
    elif e.early_stopping_metric not in LOWER_IS_BETTER:
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
    """The schema's ranges (read from it), for a config built in code (load_config has checked them already)."""
    problems = []
    if not isinstance(ref.sync_ref_model, bool):
        problems.append(
            f"reference.sync_ref_model is {ref.sync_ref_model!r}; allowed: true or false; set it to one of them"
        )
    alpha, shares = ref.ref_model_mixup_alpha, interval("reference.ref_model_mixup_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha not in shares:
        problems.append(
            f"reference.ref_model_mixup_alpha is {alpha!r}; allowed: a number in {shares} (the policy's share in "
            "each move); set it so"
        )
    steps, counts = ref.ref_model_sync_steps, interval("reference.ref_model_sync_steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps not in counts:
        problems.append(
            f"reference.ref_model_sync_steps is {steps!r}; allowed: an integer in [{counts.low:_}, {counts.high:_}] "
            "(optimizer steps between moves); set it so"
        )
    return problems


def _train_rules(config: TrainConfig) -> list[str]:
    """train.weights_from starts afresh (no resume PATH); train.export chooses among LoRA exports only; a vision
    tower trains in full fine-tuning only."""
    problems = []
    if config.train.weights_from and config.train.resume not in ("auto", "never"):
        problems.append(
            "train.weights_from starts a new run from a checkpoint's weights; it cannot be combined "
            f"with train.resume: {config.train.resume}; drop one of the two"
        )
    if config.model.train_vision_tower and config.model.lora:
        problems.append(
            "model.train_vision_tower is true, but model.lora is set: LoRA adapts the language model only and "
            "freezes every base weight, the vision tower's too; drop model.lora (full fine-tuning) or set "
            "model.train_vision_tower: false"
        )
    if config.train.export != "adapter" and not config.model.lora:
        problems.append(
            f"train.export is {config.train.export}, but model.lora is not set: without adapters final/ is "
            "always the whole model; drop train.export, or set model.lora"
        )
    return problems


def _optim_rules(config: TrainConfig) -> list[str]:
    """The warm-up is said one way: a number of steps or a share of them."""
    optim = config.optim
    if optim.warmup_ratio is not None and optim.warmup_steps:
        return [
            f"optim.warmup_steps is {optim.warmup_steps} and optim.warmup_ratio is {optim.warmup_ratio}: the warm-up "
            "is a number of steps or a share of them; drop one of the two"
        ]
    return []


def _data_rules(config: TrainConfig) -> list[str]:
    """A run has a dataset to train on."""
    if config.data.path:
        return []
    return ["data.path is empty; set it to a dataset directory written by `dpo-data build` (or a list of them)"]


_RULES = (
    _loss_rules,
    _reference_rules,
    _sync_rules,
    _per_token_rules,
    _optim_rules,
    _train_rules,
    _eval_rules,
)
"""What any loaded config must satisfy."""
_RUN_RULES = (_data_rules,)
"""What a run needs beyond that: `check_config(config)` (for_run=True) checks these too; `load_config` not."""
