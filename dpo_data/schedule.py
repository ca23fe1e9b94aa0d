"""Which pairs form each step and micro-batch, on every rank: a pure function of the loader config and state."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dpo_data.errors import DataError
from dpo_data.order import check_weights, epoch_order
from dpo_data.packing import deal, first_fit_decreasing

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


@dataclass
class StepPlan:
    """One optimizer step: per rank, its micro-batches, each a list of global pair indices."""

    epoch: int
    step: int
    ranks: list[list[list[int]]]

    @property
    def num_pairs(self) -> int:
        return sum(len(mb) for rank in self.ranks for mb in rank)


@dataclass
class ScheduleState:
    """Where the schedule stands: small, plain integers, copied on every save and restore."""

    epoch: int = 0
    step: int = 0  # steps done in this epoch
    cursor: int = 0  # tokens mode: pairs of the epoch order taken into the buffer
    buffer: list[int] = field(default_factory=list)  # tokens mode: buffered global pair indices, in order

    def copy(self) -> "ScheduleState":
        return ScheduleState(self.epoch, self.step, self.cursor, list(self.buffer))

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "cursor": self.cursor, "buffer": list(self.buffer)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "ScheduleState":
        return ScheduleState(int(d["epoch"]), int(d["step"]), int(d["cursor"]), [int(i) for i in d["buffer"]])


class Schedule:
    """Plans steps from a `ScheduleState` using only pair lengths: every rank and worker computes the
    same global plan and keeps its own share."""

    def __init__(self, pair_tokens: np.ndarray, sizes: list[int], fingerprint: str, config: LoaderConfig):
        self.pair_tokens, self.sizes, self.fingerprint, self.config = pair_tokens, sizes, fingerprint, config
        self.weights = list(config.weights) if config.weights is not None else [1.0] * len(sizes)
        check_weights(self.weights, sizes)
        self._check_budget()
        self._orders: dict[int, np.ndarray] = {}
        self.lookahead = config.lookahead_pairs or self._default_lookahead()

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(self.sizes, self.weights, self.config.seed, epoch, self.fingerprint)}
        return self._orders[epoch]

    def next_step(self, state: ScheduleState) -> tuple[StepPlan | None, ScheduleState]:
        """The plan of the step at `state` and the state after it; (None, next epoch's start) when the
        epoch is over."""
        if self.config.batching == "pairs":
            return self._pairs_step(state)
        return self._tokens_step(state)

    # -- pairs mode ----------------------------------------------------------------------------

    def _pairs_step(self, state: ScheduleState) -> tuple[StepPlan | None, ScheduleState]:
        c = self.config
        order = self.order(state.epoch)
        start = state.step * c.pairs_per_step
        if start >= len(order):
            return None, ScheduleState(epoch=state.epoch + 1)
        pairs = order[start:start + c.pairs_per_step]
        # Pack the whole step at once, then deal the micro-batches out: only the step's last bins are
        # partly full, instead of one per rank.
        bins, _ = first_fit_decreasing(self.pair_tokens[pairs], c.max_tokens_per_microbatch)
        ranks = [[pairs[b].tolist() for b in rank_bins] for rank_bins in deal(bins, self.pair_tokens[pairs], c.world_size)]
        # Every rank runs as many micro-batches as the busiest one (collectives must line up);
        # the others get empty micro-batches, which contribute nothing.
        most = max(1, max(len(r) for r in ranks))
        ranks = [r + [[] for _ in range(most - len(r))] for r in ranks]
        return StepPlan(state.epoch, state.step, ranks), ScheduleState(state.epoch, state.step + 1)

    # -- tokens mode ---------------------------------------------------------------------------

    def _tokens_step(self, state: ScheduleState) -> tuple[StepPlan | None, ScheduleState]:
        c = self.config
        order = self.order(state.epoch)
        buffer, cursor = list(state.buffer), state.cursor
        take = min(len(order) - cursor, max(0, self.lookahead - len(buffer)))
        buffer += order[cursor:cursor + take].tolist()
        cursor += take
        if not buffer:
            return None, ScheduleState(epoch=state.epoch + 1)
        slots = c.world_size * c.microbatches_per_step
        candidates = np.asarray(buffer, dtype=np.int64)
        bins, left = first_fit_decreasing(self.pair_tokens[candidates], c.max_tokens_per_microbatch, slots)
        bins += [[] for _ in range(slots - len(bins))]
        # Bin j goes to rank j % world_size: FFD fills early bins most, so ranks get even shares.
        ranks = [[candidates[bins[j]].tolist() for j in range(r, slots, c.world_size)] for r in range(c.world_size)]
        next_state = ScheduleState(state.epoch, state.step + 1, cursor, candidates[left].tolist())
        return StepPlan(state.epoch, state.step, ranks), next_state

    def _default_lookahead(self) -> int:
        c = self.config
        mean = float(self.pair_tokens.mean()) if len(self.pair_tokens) else 1.0
        per_step = c.world_size * c.microbatches_per_step * c.max_tokens_per_microbatch / max(mean, 1.0)
        return max(64, int(math.ceil(2 * per_step)))

    def _check_budget(self) -> None:
        if len(self.pair_tokens) == 0:
            return
        worst = int(np.argmax(self.pair_tokens))
        if self.pair_tokens[worst] > self.config.max_tokens_per_microbatch:
            over = int((self.pair_tokens > self.config.max_tokens_per_microbatch).sum())
            raise DataError(
                f"pair {worst} has {int(self.pair_tokens[worst])} input tokens (both segments), more than "
                f"max_tokens_per_microbatch {self.config.max_tokens_per_microbatch}; {over} pairs do not fit. "
                f"Raise max_tokens_per_microbatch to at least {int(self.pair_tokens[worst])}, or rebuild the "
                "dataset with a lower --max-length; pairs are never skipped or cut by the loader"
            )
