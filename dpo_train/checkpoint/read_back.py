"""A save read back before it is committed: what each rank wrote loads bitwise equal to what the run holds."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dpo_state.bitwise import bitwise_difference
from dpo_state.dcp_io import DCP_DIR, reading_tensors, safe_reader
from dpo_state.state import rank_files, read_rank_state
from dpo_train.checkpoint.parts import Checkpointable, RunView, dcp_tensors

GROUP_BYTES = 512 * 2**20
"""About how much of a rank's tensors is read back at once, beside the run's own (a sharded tensor counts its
1/world share): the check holds one group, never a second copy of the model and optimizer."""


def read_back(parts: Checkpointable, run: RunView, directory: Path) -> str:
    """What this rank's share of the checkpoint in `directory` holds that the run does not ("" when nothing):
    its DCP tensors loaded again, group by group, and compared bit for bit with the model, optimizer (and moving
    reference) tensors they were saved from; then its loader state and generator files. Every rank must call it
    (each DCP load is collective); the run must not have moved since the save."""
    import torch.distributed.checkpoint as dcp

    found = ""
    for group in _groups(_leaves(dcp_tensors(parts, parts.model.state_dict())), run.world):
        target = _nested({key: torch.empty_like(live) for key, live in group})
        with reading_tensors(directory / DCP_DIR):
            dcp.load(target, storage_reader=safe_reader(directory / DCP_DIR), no_dist=run.world == 1)
        found = found or next(filter(None, (_difference(key, live, _at(target, key)) for key, live in group)), "")
    return found or _files_difference(parts, run.rank, directory)


def _leaves(tree: dict, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """Every tensor of a nested state dict with its key path, in the dict's order (the same on every rank)."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaves(value, (*path, key))
        else:
            out.append(((*path, key), value))
    return out


def _groups(leaves: list, world: int) -> list[list]:
    """Consecutive leaves of about GROUP_BYTES each, sized from global shapes so that every rank forms the same
    groups (each group is one collective load)."""
    from torch.distributed.tensor import DTensor

    groups, size = [[]], 0
    for key, tensor in leaves:
        share = tensor.numel() * tensor.element_size() // (world if isinstance(tensor, DTensor) else 1)
        if groups[-1] and size + share > GROUP_BYTES:
            groups, size = [*groups, []], 0
        groups[-1].append((key, tensor))
        size += share
    return [group for group in groups if group]


def _nested(flat: dict[tuple[str, ...], torch.Tensor]) -> dict:
    tree: dict = {}
    for path, tensor in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = tensor
    return tree


def _at(tree: dict, path: tuple[str, ...]) -> torch.Tensor:
    for part in path:
        tree = tree[part]
    return tree


def _files_difference(parts: Checkpointable, rank: int, directory: Path) -> str:
    """This rank's loader state and generator states, read back from its own files."""
    from safetensors.torch import load_file

    state_name, rng_name = rank_files(rank)
    loader = json.loads(json.dumps(parts.loader.state_dict()))
    if read_rank_state(directory / state_name)["loader"] != loader:
        return f"{state_name} does not read back the loader state that was saved"
    saved, back = parts.rng.state_dict(), load_file(str(directory / rng_name))
    if saved.keys() != back.keys() or any(not torch.equal(saved[k], back[k]) for k in saved):
        return f"{rng_name} does not read back the generator states that were saved"
    return ""


def _difference(key: tuple[str, ...], live: torch.Tensor, loaded: torch.Tensor) -> str:
    return bitwise_difference(".".join(key), _local(live), _local(loaded))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard, a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
