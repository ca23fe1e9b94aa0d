"""What a run asks of torch and transformers through its process environment, set before its model loads."""

from __future__ import annotations

import os

HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
"""PyTorch's own switch (c10's CPU allocator, since 2.2): tensors of 2 MiB or more are aligned to 2 MiB and
advised MADV_HUGEPAGE, so that a kernel whose transparent huge pages are `madvise` backs them with 2 MiB pages."""
HUB_KERNELS = "USE_HUB_KERNELS"
"""transformers' switch (5.x) for layers it swaps for kernels fetched from the Hub when a model loads."""


def set_run_environment() -> None:
    """Both switches, each unless the user has set it (their value wins):
    - huge pages on (`THP_MEM_ALLOC_ENABLE=1`): on a CPU, glibc's heap keeps what a step's freed activations
      leave in pieces, and a long pair's step peaks far above its live tensors; with huge pages a SmolLM2 step
      at 2k-token pairs peaks 2 GiB lower at the same speed (docs/benchmarks.md, "Host memory"). c10 reads the
      variable once, at the process's first tensor of 2 MiB or more: so this runs before the model loads.
    - hub kernels off (`USE_HUB_KERNELS=NO`): the model runs its own PyTorch code, the code the probe, the
      parity guard and the architecture zoo check; with them on, a Llama on CUDA fetches a rotary kernel from
      the Hub as it loads, unchecked, and fails offline. transformers reads it as the model loads."""
    os.environ.setdefault(HUGE_PAGES, "1")
    os.environ.setdefault(HUB_KERNELS, "NO")
