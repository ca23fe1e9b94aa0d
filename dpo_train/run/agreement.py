"""Every rank of a run on the same code and library releases, checked once the process group is joined."""

from __future__ import annotations

from dpo_state.errors import DependencyError
from dpo_state.installed import code_fingerprint
from dpo_train.model.lora import run_environment
from dpo_train.parallel import collectives

SHOWN_RANKS = 8
"""Ranks named per value in the refusal; the rest are counted."""


def check_ranks_agree(lora: dict | None, world: int) -> None:
    """Refuse a run whose ranks import different dpo-toolkit source or different releases of Python, torch,
    torchdata, transformers (PEFT with LoRA): two nodes with their own checkout or environment would compute
    their shares of each step with different code, and no check downstream compares code. One all-gather."""
    if world == 1:
        return
    every = collectives.gather_objects({"dpo-toolkit code": code_fingerprint(), **run_environment(lora)})
    names = sorted({name for ranks in every for name in ranks})
    differ = [name for name in names if len({ranks.get(name) for ranks in every}) > 1]
    if not differ:
        return
    lines = "\n".join(f"  - {name}: {_by_value(every, name)}" for name in differ)
    raise DependencyError(
        f"the {world} ranks of this run do not run the same code and libraries:\n{lines}\nFix: install one "
        "dpo-toolkit checkout and the same libraries on every node (`dpo-state env` on each shows them)"
    )


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
