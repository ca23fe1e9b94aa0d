"""Reading and writing torch.distributed.checkpoint (DCP) directories: the one place DCP's quirks are handled."""

from __future__ import annotations

import contextlib
import warnings

DCP_DIR = "dcp"
"""A checkpoint's DCP directory (model and optimizer tensors)."""
DCP_METADATA = f"{DCP_DIR}/.metadata"
"""DCP's index of the tensors, written last by DCP; a pickle."""


@contextlib.contextmanager
def quiet_single_process_dcp():
    """DCP warns that an uninitialized process group means a single-process save or load: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        yield
