"""A rank's host memory: PyTorch's CPU allocator asked to back tensors of 2 MiB or more with huge pages."""

from __future__ import annotations

import os

HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
"""PyTorch's own switch (c10's CPU allocator, since 2.2): tensors of 2 MiB or more are aligned to 2 MiB and
advised MADV_HUGEPAGE, so that a kernel whose transparent huge pages are `madvise` backs them with 2 MiB pages."""


def use_huge_pages() -> None:
    """Turn PyTorch's huge pages on for this process unless the variable says otherwise already
    (`THP_MEM_ALLOC_ENABLE=0` keeps 4 KiB pages). Why: on a CPU, glibc's heap keeps what a step's freed
    activations leave in pieces, and a long pair's step peaks far above its live tensors; with huge pages a
    SmolLM2 step at 2k-token pairs peaks 2 GiB lower at the same speed (docs/benchmarks.md, "Host memory").
    c10 reads the variable once, at the process's first tensor of 2 MiB or more: so this runs before the model
    loads, in every run's setup."""
    os.environ.setdefault(HUGE_PAGES, "1")
