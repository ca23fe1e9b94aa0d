"""The model card of an export (final/README.md): the Hub's front matter, then what made the run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpo_state.commit import COMMIT_FILE
from dpo_state.export_record import CARD_ROWS
from dpo_state.layout import step_dir
from dpo_state.run_logs import EVAL_LOG, by_step, current_eval, read_log
from dpo_train.config.sections import ModelConfig, TrainConfig
from dpo_train.export.hub_metadata import base_licence, dataset_names, hub_model_id

_EVAL_ROWS = ("accuracy", "loss", "rewards/margins", "logp_accuracy", "nll")
"""The held-out metrics the card compares before and after training (those an eval record has); rewards/margins is
TRL's, beta-scaled, as a reader of TRL's logs reads it."""
_SHARES = {"accuracy", "logp_accuracy"}
"""Held-out metrics that are shares of pairs: shown as percentages."""
_USAGE_REPO = "YOUR-NAME/YOUR-MODEL"
"""The repo id in the card's usage snippet: the export does not know where it will be pushed."""


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
    """The base model's portable name, never a local path: its Hub id where one is known
    (`hub_metadata.hub_model_id`), else model.path's directory name; None for a random init."""
    if not model.path:
        return None
    return hub_model_id(model) or Path(model.path).resolve().name


def loss_types(config: TrainConfig) -> list[str]:
    kind = config.loss.type
    return list(kind) if isinstance(kind, list) else [kind]


def card_text(config: TrainConfig, facts: RunFacts, library: str, merged: bool) -> str:
    """The whole README.md: YAML front matter (huggingface_hub's ModelCardData renders it as the Hub
    reads it), then the sections."""
    from huggingface_hub import ModelCardData

    lora = facts.identity["model"]["lora"]
    vision = _is_vision(config)
    data = ModelCardData(
        base_model=hub_model_id(config.model),  # a Hub id or nothing: the Hub links it
        datasets=dataset_names(config.data.paths),
        **base_licence(config.model),
        library_name=library,
        pipeline_tag="image-text-to-text" if vision else "text-generation",
        tags=list(dict.fromkeys(["dpo-toolkit", "dpo", *loss_types(config), *(["lora"] if lora else [])])),
    )
    sections = [
        _title(config, facts, library, merged),
        _vision_usage(config, library) if vision else _usage(config, facts, library),
        _objective(facts),
        _hyperparameters(config, facts),
        _data(facts),
        _tokenizer(facts),
        _lineage(facts),
        _evaluation(config, facts),
        _code(config),
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
    records = by_step([current_eval(r) for r in read_log(log).records])  # a resumed run's older lines too
    if not records:
        return None
    first, last = records[0], records[-1]
    head = f"| held-out ({last['pairs']} pairs) | step {first['step']} (before) | step {last['step']} (after) |\n"
    head += "|---|---|---|\n"
    rows = [f"| {k} | {_metric(k, first.get(k))} | {_metric(k, last.get(k))} |" for k in _EVAL_ROWS if k in last]
    return "## Held-out evaluation\n\n" + head + "\n".join(rows)


def _metric(name: str, value: Any) -> str:
    """A held-out metric as people read it: a share of pairs as a percentage to 0.1, anything else (losses,
    margins) to 4 significant digits, trailing zeros kept (0.6931, 5.400)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"  # a field an older eval record lacks
    if name in _SHARES:
        return f"{value:.1%}"
    return f"{value:#.4g}".rstrip(".")  # `#` keeps trailing zeros, and a dot after 1235: dropped


def _usage(config: TrainConfig, facts: RunFacts, library: str) -> str:
    """How to load the pushed repo with transformers and generate, through the chat template when the run's
    tokenizer has one (a plain-text run prompts with text)."""
    chat = facts.identity["tokenizer"]["attestation"]["components"].get("chat_template") is not None
    prompt = (
        'messages = [{"role": "user", "content": "What is the capital of France?"}]\n'
        "inputs = tokenizer.apply_chat_template(\n"
        '    messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"\n'
        ")\n"
        if chat
        else 'inputs = tokenizer("The capital of France is", return_tensors="pt")\n'
    )
    code = (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'repo = "{_USAGE_REPO}"  # the repo `dpo-state push` sent this folder to, or the folder\'s path\n'
        "tokenizer = AutoTokenizer.from_pretrained(repo)\n"
        "model = AutoModelForCausalLM.from_pretrained(repo)\n"
        f"{prompt}"
        "output = model.generate(**inputs, max_new_tokens=64)\n"
        'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))'
    )
    return f"## Usage\n\n```python\n{code}\n```" + (_adapter_note(config) if library == "peft" else "")


def _is_vision(config: TrainConfig) -> bool:
    from dpo_train.model.policy import is_vision_model

    return bool(config.model.path) and is_vision_model(config.model.path)


def _vision_usage(config: TrainConfig, library: str) -> str:
    """How to load a vision-language export (its processor is saved beside the model, final/) and ask about an
    image through the processor's chat template."""
    code = (
        "from PIL import Image\n"
        "from transformers import AutoModelForImageTextToText, AutoProcessor\n\n"
        f'repo = "{_USAGE_REPO}"  # the repo `dpo-state push` sent this folder to, or the folder\'s path\n'
        "processor = AutoProcessor.from_pretrained(repo)\n"
        "model = AutoModelForImageTextToText.from_pretrained(repo)\n"
        'messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]\n'
        "text = processor.apply_chat_template(messages, add_generation_prompt=True)\n"
        'inputs = processor(text=text, images=[Image.open("picture.png")], return_tensors="pt")\n'
        "output = model.generate(**inputs, max_new_tokens=64)\n"
        'print(processor.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))'
    )
    return f"## Usage\n\n```python\n{code}\n```" + (_adapter_note(config) if library == "peft" else "")


def _adapter_note(config: TrainConfig) -> str:
    base = hub_model_id(config.model)
    if base:
        return f"\n\nAn adapter: transformers loads it with `peft` installed, over its base model `{base}`."
    return (
        f"\n\nAn adapter: transformers loads it with `peft` installed, over its base model, which has no Hub id: "
        f"set `base_model_name_or_path` in adapter_config.json (now `{base_model(config.model)}`) to the base's "
        "Hub id or local path first."
    )


def _code(config: TrainConfig) -> str:
    """The toolkit's version and the releases the export ran on (a resume under others says so on stderr and
    in its checkpoints' `environment`)."""
    from dpo_data import __version__
    from dpo_train.model.lora import run_environment

    rows = "\n".join(f"| {name} | {release} |" for name, release in run_environment(config.model.lora).items())
    return f"## Code\n\nTrained with dpo-toolkit {__version__}, on:\n\n| library | release |\n|---|---|\n{rows}"
