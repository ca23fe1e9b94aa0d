"""One source for each config key: the committed schema is the one the sections generate, and what reads a key's
range (the rules, the TRL readers) reads it from there."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dpo_train.config import schema
from dpo_train.config.sections import SECTIONS, OptimConfig, ReferenceConfig, TrainSection
from dpo_train.keys import key


def test_the_committed_schema_is_the_one_the_sections_generate():
    """Change a key's default, range or choices in dpo_train/config/sections.py and rewrite the file:
    `python -m dpo_train.config.schema --write`."""
    assert schema.COMMITTED.read_text() == schema.dumps(schema.generate()), (
        "run python -m dpo_train.config.schema --write"
    )


@dataclass(frozen=True)
class _Range(ReferenceConfig):
    ref_model_sync_steps: int = key(512, minimum=1, maximum=10)


@dataclass(frozen=True)
class _Choices(OptimConfig):
    scheduler: str = key("constant", enum=("constant", "linear"))


@dataclass(frozen=True)
class _Default(TrainSection):
    keep_last: int = key(4, minimum=1, maximum=1_000_000)


@pytest.mark.parametrize(
    ("section", "changed", "path", "word", "value"),
    [
        ("reference", _Range, "reference.ref_model_sync_steps", "maximum", 10),
        ("optim", _Choices, "optim.scheduler", "enum", ["constant", "linear"]),
        ("train", _Default, "train.keep_last", "default", 4),
    ],
)
def test_a_range_choice_or_default_changed_in_a_section_without_the_file_is_seen(
    monkeypatch, tmp_path, section, changed, path, word, value
):
    monkeypatch.setitem(SECTIONS, section, changed)
    generated = schema.generate.__wrapped__()  # uncached: the sections as changed
    monkeypatch.setattr(schema, "generate", lambda: generated)
    assert schema.node(path)[word] == value
    assert schema.dumps(generated) != schema.COMMITTED.read_text()
    assert schema.main([]) == 1  # --check names the stale file
    copy = tmp_path / "train-config.schema.json"
    monkeypatch.setattr(schema, "COMMITTED", copy)
    assert schema.main(["--write"]) == 0 and schema.main([]) == 0


def test_a_key_states_its_type_from_its_annotation_and_its_bounds_from_its_field():
    assert schema.node("train.max_steps") == {
        "type": ["integer", "null"],
        "minimum": 1,
        "maximum": 1_000_000_000,
        "default": 10,
    }
    assert schema.node("optim.betas[]") == {"type": "number", "minimum": 0, "exclusiveMaximum": 1}
    assert str(schema.interval("loss.label_smoothing")) == "[0, 1)"
    assert schema.choices("train.report_to[]") == ("tensorboard", "wandb")


def test_the_rules_read_their_ranges_from_the_schema(monkeypatch):
    """config_problems re-checks a range for a config built in code: the schema's, not a copy."""
    from dpo_train.config import rules
    from dpo_train.config.sections import TrainConfig
    from dpo_train.step.loss import Interval

    config = TrainConfig(reference=ReferenceConfig(ref_model_sync_steps=20, sync_ref_model=True))
    assert not [p for p in rules.config_problems(config, for_run=False) if "ref_model_sync_steps" in p]
    narrower = {"reference.ref_model_sync_steps": Interval(1, 10)}
    monkeypatch.setattr(rules, "interval", lambda path: narrower.get(path) or schema.interval(path))
    assert [p for p in rules.config_problems(config, for_run=False) if "ref_model_sync_steps" in p] == [
        "reference.ref_model_sync_steps is 20; allowed: an integer in [1, 10] (optimizer steps between moves); "
        "set it so"
    ]


def _single_key(here: str) -> bool:
    return bool(here) and "," not in here and "[" not in here and "." in here and " " not in here


NOT_THE_VALUE = {"per_device_train_batch_size", "gradient_accumulation_steps", "save_strategy", "eval_strategy"}
"""TRL fields that set a key without being its value: factors of data.pairs_per_step, strategy names."""


def test_every_trl_reader_of_a_keys_value_takes_that_keys_range():
    """A TRL field that becomes a key's value is read inside that key's range (the schema's), so a value the
    config would refuse is refused naming the TRL field."""
    from dpo_train.config.trl_readers import Untranslatable
    from dpo_train.config.trl_table import TABLE

    checked = []
    for name, row in TABLE.items():
        if not _single_key(row.here) or row.read is None or name in NOT_THE_VALUE:
            continue
        found = schema.node(row.here)
        top = found.get("maximum", found.get("exclusiveMaximum"))
        if top is None:
            continue
        if "maximum" in found:
            assert row.read(name, top) == top, name
        beyond = top + 1 if "integer" in found.get("type", ()) else (top * 2 or 1)
        for value in (beyond, top) if "exclusiveMaximum" in found else (beyond,):
            with pytest.raises(Untranslatable, match=f"{name} is "):
                row.read(name, value)
        checked.append(name)
    assert {"beta", "learning_rate", "ld_alpha", "ref_model_sync_steps", "lora_r", "save_total_limit"} <= set(checked)
