"""The model card of an export (final/README.md): the Hub's front matter, then what made the run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpo_state.commit import COMMIT_FILE
from dpo_state.export_record import CARD_ROWS
from dpo_state.files import read_json
from dpo_state.layout import step_dir
from dpo_state.run_logs import EVAL_LOG, by_step, read_log
from dpo_train.config.sections import ModelConfig, TrainConfig

_EVAL_ROWS = ("accuracy", "loss", "margin", "logp_accuracy", "nll")
"""The held-out metrics the card compares before and after training (those an eval record has)."""


@dataclass(frozen=True)
class RunFacts:
    """What the card says of a run beyond its config: the identity its checkpoints record
    (`dpo_train.checkpoint.identity`), its lineage, the step it ended at, the pairs of each source and its output
    directory (where eval.jsonl is)."""

    identity: dict
    lineage: dict
    step: int
    source_pairs: dict[str, int]
    out: Path


def run_facts(identity: dict, lineage: dict, step: int, store: Any, out: Path) -> RunFacts:
    """The facts of a run at its export: `store` is its training PairStore."""
    import numpy as np

    counts = np.bincount(store.source_id, minlength=len(store.sources))
    return RunFacts(identity, lineage, step, {s: int(n) for s, n in zip(store.sources, counts)}, out)


def base_model(model: ModelConfig) -> str | None:
    """The base model's portable name, never a local path: the Hub name its config.json records as
    `_name_or_path` when that is one, else model.path's directory name; None for a random init."""
    if not model.path:
        return None
    recorded = read_json(Path(model.path) / "config.json").get("_name_or_path")
    if isinstance(recorded, str) and recorded and not recorded.startswith(("/", ".", "~")) and "\\" not in recorded:
        return recorded
    return Path(model.path).resolve().name


def loss_types(config: TrainConfig) -> list[str]:
    kind = config.loss.type
    return list(kind) if isinstance(kind, list) else [kind]


def card_text(config: TrainConfig, facts: RunFacts, library: str, merged: bool) -> str:
    """The whole README.md: YAML front matter (huggingface_hub's ModelCardData renders it as the Hub
    reads it), then the sections."""
    from huggingface_hub import ModelCardData

    lora = facts.identity["model"]["lora"]
    data = ModelCardData(
        base_model=base_model(config.model),
        datasets=list(facts.source_pairs),
        library_name=library,
        pipeline_tag="text-generation",
        tags=list(dict.fromkeys(["dpo-toolkit", "dpo", *loss_types(config), *(["lora"] if lora else [])])),
    )
    sections = [
        _title(config, facts, library, merged),
        _objective(facts),
        _hyperparameters(config, facts),
        _data(facts),
        _tokenizer(facts),
        _lineage(facts),
        _evaluation(config, facts),
        _code(),
    ]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(s for s in sections if s) + "\n"


def _title(config: TrainConfig, facts: RunFacts, library: str, merged: bool) -> str:
    base = base_model(config.model)
    of = f"`{base}`" if base else f"a randomly initialized {_model_type(config)} model"
    what = "A LoRA adapter (PEFT) for" if library == "peft" else "A fine-tune of"
    how = " with its LoRA adapter merged in" if merged else ""
    return (
        f"# {base or 'Model'} DPO ({', '.join(loss_types(config))})\n\n"
        f"{what} {of}{how}, trained by dpo-toolkit on preference pairs for {facts.step} optimizer steps."
    )


def _model_type(config: TrainConfig) -> str:
    spec = (config.model.init or {}).get("config")
    return spec.get("model_type", "causal LM") if isinstance(spec, dict) else "causal LM"


def _table(rows: list[tuple[str, Any]]) -> str:
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {_cell(v)} |" for k, v in rows)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return ", ".join(map(_cell, value))
    return "null" if value is None else str(value)


def _objective(facts: RunFacts) -> str:
    objective = dict(facts.identity["objective"])
    rows = [("loss types", objective.pop("type")), ("reference", facts.identity["reference"]["mode"])]
    rows += sorted(objective.items())  # beta, weights, label_smoothing, nll_weight, ... as the run resolved them
    return "## Objective\n\n" + _table(rows)


def _hyperparameters(config: TrainConfig, facts: RunFacts) -> str:
    layout, optim, lora = facts.identity["layout"], config.optim, facts.identity["model"]["lora"]
    rows = [
        ("optimizer", f"{facts.identity['optimizer']['class']} (optim.name {optim.name})"),
        ("learning rate", optim.lr),
        ("scheduler", f"{optim.scheduler}, {optim.warmup_for(config.train.max_steps)} warmup steps"),
        ("weight decay", optim.weight_decay),
        ("max grad norm", optim.max_grad_norm),
        ("steps trained", facts.step),
        ("batching", layout["batching"]),
        ("pairs per step", layout["pairs_per_step"]),
        ("max tokens per micro-batch", layout["max_tokens_per_microbatch"]),
        ("precision", layout["precision"]),
        ("world size", layout["world_size"]),
        ("strategy", layout["strategy"]),
        ("export dtype", config.train.export_dtype),
        ("seed", layout["train_seed"]),
    ]
    if lora:
        rows.append(("LoRA", ", ".join(f"{k}={_cell(v)}" for k, v in lora.items())))
    return "## Hyperparameters\n\n" + _table(rows)


def _data(facts: RunFacts) -> str:
    dataset = facts.identity["dataset"]
    sources = "\n".join(f"| {name} | {pairs} |" for name, pairs in facts.source_pairs.items())
    return (
        f"## Data\n\nDataset fingerprint `{dataset['fingerprint']}`, {dataset['num_pairs']} pairs"
        f" ({len(dataset['datasets'])} dataset{'s' if len(dataset['datasets']) > 1 else ''}).\n\n"
        f"| source | pairs |\n|---|---|\n{sources}"
    )


def _tokenizer(facts: RunFacts) -> str:
    return (
        f"## Tokenizer\n\nAttestation fingerprint `{facts.identity['tokenizer']['fingerprint']}` "
        "(dpo-toolkit's docs/attestation.md): the tokenizer in this directory is the one every dataset of the run "
        "was built with."
    )


def _lineage(facts: RunFacts) -> str:
    checkpoint = step_dir(facts.out, facts.step)
    # the export descends from the checkpoint of its own step when one was saved, else from the last one
    parent = checkpoint.name if (checkpoint / COMMIT_FILE).is_file() else facts.lineage.get("parent") or "none"
    rows = [
        (CARD_ROWS["run_id"], facts.lineage["run_id"]),
        (CARD_ROWS["step"], facts.step),
        ("parent checkpoint", parent),
    ]
    if facts.lineage.get("resumed_from"):  # a path on the machine that trained: its name only
        rows.append(("resumed from", Path(facts.lineage["resumed_from"]).name))
    return "## Lineage\n\n" + _table(rows)


def _evaluation(config: TrainConfig, facts: RunFacts) -> str | None:
    """Held-out metrics before (the first eval record) and after (the last); None without eval.path."""
    log = facts.out / EVAL_LOG
    if not config.eval.path or not log.is_file():
        return None
    records = by_step(read_log(log).records)
    if not records:
        return None
    first, last = records[0], records[-1]
    head = f"| held-out ({last['pairs']} pairs) | step {first['step']} (before) | step {last['step']} (after) |\n"
    head += "|---|---|---|\n"
    rows = [f"| {k} | {_cell(first.get(k))} | {_cell(last.get(k))} |" for k in _EVAL_ROWS if k in last]
    return "## Held-out evaluation\n\n" + head + "\n".join(rows)


def _code() -> str:
    from dpo_data import __version__

    return f"## Code\n\nTrained with dpo-toolkit {__version__}."
