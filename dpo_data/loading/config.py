"""`LoaderConfig`: how pairs become micro-batches (batching mode, budgets, world, workers, seed, mixture, layout)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dpo_data.errors import DataError

BATCHING_MODES = ("pairs", "tokens")
LAYOUTS = ("separate", "shared_prompt")


@dataclass(frozen=True)
class LoaderConfig:
    """How pairs become micro-batches. The names are the trainer config's `data` keys."""

    batching: str = "pairs"
    """'pairs': a step is a fixed number of pairs; 'tokens': micro-batches filled to the token budget."""
    max_tokens_per_microbatch: int = 1024
    """Token capacity of one micro-batch (input tokens of both segments of every pair in it)."""
    pairs_per_step: int | None = 8
    """pairs mode: pairs per optimizer step, over all ranks."""
    microbatches_per_step: int = 1
    """tokens mode: micro-batches per rank per optimizer step."""
    world_size: int = 1
    rank: int = 0
    num_workers: int = 0
    seed: int = 0
    weights: tuple[float, ...] | None = None
    """Per-dataset sampling factors for mixtures (1 = each pair once per epoch); None = all 1."""
    lookahead_pairs: int | None = None
    """tokens mode: pairs buffered ahead for packing; None = twice a step's expected pairs, at least 64."""
    layout: str = "separate"
    """'separate': [prompt + chosen][prompt + rejected]; 'shared_prompt': [prompt][chosen][rejected], the
    prompt once (for trainers whose attention supports it; budgets then count the prompt once)."""

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise DataError(f"layout is {self.layout!r}; allowed: {', '.join(LAYOUTS)}")
        if self.batching not in BATCHING_MODES:
            raise DataError(f"batching is {self.batching!r}; allowed: {', '.join(BATCHING_MODES)}")
        for name in ("max_tokens_per_microbatch", "microbatches_per_step", "world_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise DataError(f"{name} is {getattr(self, name)!r}; it must be an integer >= 1")
        if self.batching == "pairs" and (not isinstance(self.pairs_per_step, int) or self.pairs_per_step < 1):
            raise DataError(f"pairs_per_step is {self.pairs_per_step!r}; pairs batching needs an integer >= 1")
        if not 0 <= self.rank < self.world_size:
            raise DataError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.num_workers < 0:
            raise DataError(f"num_workers is {self.num_workers}; it must be >= 0")

    def geometry(self, fingerprint: str) -> dict[str, Any]:
        """What a saved loader state must match to be resumed exactly."""
        g = asdict(self)
        g["weights"] = list(self.weights) if self.weights is not None else None
        g["fingerprint"] = fingerprint
        return g
