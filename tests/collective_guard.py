"""Run `dpo-train` with every torch.distributed collective wrapped: the project may issue one only through
`dpo_train.parallel.collectives`, with tensors on that module's device; collectives issued inside torch (DDP,
FSDP2, DCP) place their own. Used by tests/train/parallel/test_devices.py under torchrun; it writes what it saw to
$COLLECTIVE_GUARD_OUT/rank-R.json and fails the rank on the first violation.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

_WRAPPED = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_gather_single",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
)
_TORCH = str(Path(torch.__file__).parent)
_HELPER = str(Path(__file__).parents[1] / "dpo_train" / "parallel" / "collectives.py")
seen: Counter = Counter()


def _tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if torch.is_tensor(value):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if torch.is_tensor(v))


def _guarded(name, real):
    def call(*args, **kwargs):
        caller = sys._getframe(1)
        where = caller.f_code.co_filename
        if where.startswith(_TORCH):
            seen[f"torch:{name}"] += 1
            return real(*args, **kwargs)
        if where != _HELPER:
            raise AssertionError(
                f"dist.{name} called directly from {where}:{caller.f_lineno}; use dpo_train.parallel.collectives"
            )
        from dpo_train.parallel import collectives

        expected = collectives.device()
        for tensor in _tensors(args, kwargs):
            if tensor.device != expected:
                raise AssertionError(f"dist.{name} got a tensor on {tensor.device}; the backend reduces on {expected}")
        origin = sys._getframe(2)
        seen[f"{name}<-{Path(origin.f_code.co_filename).stem}.{origin.f_code.co_name}"] += 1
        return real(*args, **kwargs)

    return call


def _write() -> None:
    out = Path(os.environ["COLLECTIVE_GUARD_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(dict(seen)))


if __name__ == "__main__":
    for name in _WRAPPED:
        if hasattr(dist, name):  # all_gather_single and reduce_scatter_single arrived in torch 2.13
            setattr(dist, name, _guarded(name, getattr(dist, name)))
    atexit.register(_write)
    real_exit = os._exit  # a failing rank leaves through os._exit, which skips atexit

    def _exit(code):
        _write()
        real_exit(code)

    os._exit = _exit
    from dpo_cli.train import main

    main(sys.argv[1:])
