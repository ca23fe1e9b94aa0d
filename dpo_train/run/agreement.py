"""Every rank of a run on the same code, library releases and config, checked once the process group is joined."""

from __future__ import annotations

import json
from typing import Any

from dpo_state.errors import DependencyError
from dpo_state.installed import code_fingerprint
from dpo_train.config.sections import TrainConfig
from dpo_train.errors import ConfigError
from dpo_train.model.lora import run_environment
from dpo_train.parallel import collectives

SHOWN_RANKS = 8
"""Ranks named per value in the refusal; the rest are counted."""
SHOWN_KEYS = 12
"""Config keys named in the refusal; the rest are counted."""


def check_ranks_agree(config: TrainConfig, world: int) -> None:
    """Refuse a run whose ranks import different dpo-toolkit source or different releases of Python, torch,
    torchdata, transformers (PEFT with LoRA), or were given different configs: two nodes with their own checkout,
    environment or config file would compute their shares of each step with different code or settings, and no
    check downstream compares them (a checkpoint records rank 0's). One all-gather."""
    if world == 1:
        return
    mine = {
        "environment": {"dpo-toolkit code": code_fingerprint(), **run_environment(config.model.lora)},
        "config": _leaves(config.resolved()),
    }
    every = collectives.gather_objects(mine)
    lines = _differing([ranks["environment"] for ranks in every])
    if lines:
        raise DependencyError(
            f"the {world} ranks of this run do not run the same code and libraries:\n{lines}\nFix: install one "
            "dpo-toolkit checkout and the same libraries on every node (`dpo-state env` on each shows them)"
        )
    lines = _differing([ranks["config"] for ranks in every], SHOWN_KEYS)
    if lines:
        raise ConfigError(
            f"the {world} ranks of this run were given different configs:\n{lines}\nFix: start every node with "
            "the same config file and the same --set overrides"
        )


def _leaves(value: Any, path: str = "") -> dict[str, str]:
    """Every leaf of a resolved config by its dotted key, as JSON text (comparable, and shown as written)."""
    if isinstance(value, dict) and value:
        return {k: v for key, item in value.items() for k, v in _leaves(item, f"{path}.{key}" if path else key).items()}
    return {path: json.dumps(value, sort_keys=True)}


def _differing(every: list[dict[str, str]], shown: int | None = None) -> str:
    """One line per name whose value differs between ranks (the first `shown`, then a count), or ""."""
    names = sorted({name for ranks in every for name in ranks})
    differ = [name for name in names if len({ranks.get(name) for ranks in every}) > 1]
    lines = [f"  - {name}: {_by_value(every, name)}" for name in differ[:shown]]
    if shown is not None and len(differ) > shown:
        lines.append(f"  - and {len(differ) - shown} more keys")
    return "\n".join(lines)


def _by_value(every: list[dict], name: str) -> str:
    """`2.13.0 on ranks 0, 1; 2.14.1 on rank 2`: each value with the ranks that have it."""
    groups: dict[str, list[int]] = {}
    for rank, ranks in enumerate(every):
        groups.setdefault(ranks.get(name, "<absent>"), []).append(rank)
    return "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in groups.items())


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:SHOWN_RANKS]))
    more = f" and {len(ranks) - SHOWN_RANKS} more" if len(ranks) > SHOWN_RANKS else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"
