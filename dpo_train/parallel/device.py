"""Where a rank runs: cpu (gloo), cuda (nccl) or npu (hccl via torch-npu), and its compute precision."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dpo_train.errors import ConfigError

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class Placement:
    """A rank's device, its process-group backend and the dtype matmuls run in."""

    device: torch.device
    backend: str
    precision: str  # fp32 | bf16

    def autocast(self):
        """bf16 autocast (weights, gradients and optimizer state stay fp32); nothing in fp32."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


def _npu_available() -> bool:
    # torch-npu is imported only when installed; importing it registers the "npu" device with torch.
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401 - importing it registers the "npu" device with torch

    return bool(torch.npu.is_available())


def _resolve_device(kind: str) -> str:
    """auto -> cuda if available, else npu if torch-npu is installed and sees a device, else cpu."""
    if kind == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "npu" if _npu_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("distributed.device is cuda but torch sees no CUDA device; use auto or cpu")
    if kind == "npu" and not _npu_available():
        raise ConfigError("distributed.device is npu but torch-npu is not installed or sees no device; use auto or cpu")
    return kind


def placement(device_kind: str, precision: str) -> Placement:
    """This rank's placement: LOCAL_RANK picks the accelerator; `precision: auto` is bf16 where the
    device supports it (cuda with bf16, npu) and fp32 on CPU."""
    kind = _resolve_device(device_kind)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(kind, local) if kind != "cpu" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    elif kind == "npu":
        torch.npu.set_device(device)
    if precision == "auto":
        precision = "bf16" if kind == "npu" or (kind == "cuda" and torch.cuda.is_bf16_supported()) else "fp32"
    return Placement(device, _BACKENDS[kind], precision)


def init_distributed(place: Placement) -> tuple[int, int]:
    """(rank, world size): joins the process group torchrun describes (WORLD_SIZE > 1) on the placement's
    backend, or (0, 1) for a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(place.backend)
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
