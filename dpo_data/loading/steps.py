"""Which pairs form each step and micro-batch on every rank: a pure function of the loader config and a small state."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpo_data.errors import DataError
from dpo_data.loading.binpack import fill_shares, first_fit_decreasing, share
from dpo_data.loading.config import LoaderConfig
from dpo_data.loading.order import check_weights, epoch_order


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
class PlannerState:
    """Where the step planner stands: small, plain integers, copied on every save and restore."""

    epoch: int = 0
    step: int = 0  # steps done in this epoch
    cursor: int = 0  # tokens mode: pairs of the epoch order taken into the buffer
    buffer: list[int] = field(default_factory=list)  # tokens mode: buffered global pair indices, in order

    def copy(self) -> PlannerState:
        return PlannerState(self.epoch, self.step, self.cursor, list(self.buffer))

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "cursor": self.cursor, "buffer": list(self.buffer)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> PlannerState:
        return PlannerState(int(d["epoch"]), int(d["step"]), int(d["cursor"]), [int(i) for i in d["buffer"]])


class StepPlanner:
    """Plans steps from a `PlannerState` using only pair lengths: every rank and worker computes the
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

    def steps_in(self, epochs: int) -> int:
        """How many steps the first `epochs` epochs hold, planned from lengths exactly as the loader runs them."""
        total = 0
        for epoch in range(epochs):
            plan, state = self.next_step(PlannerState(epoch=epoch))
            while plan is not None:
                total += 1
                plan, state = self.next_step(state)
        return total

    def pairs_in(self, steps: int) -> np.ndarray:
        """The global pair indices the first `steps` steps read on any rank, sorted and unique (epochs in turn,
        as the loader runs them): what a reference precomputed for those steps holds (docs/reference.md)."""
        seen: set[int] = set()
        state, taken, ended = PlannerState(), 0, False
        while taken < steps:
            plan, state = self.next_step(state)
            if plan is None:
                if ended:  # two ends in a row: an epoch with no pair at all, nothing more will come
                    break
                ended = True
                continue
            seen.update(i for rank in plan.ranks for microbatch in rank for i in microbatch)
            taken, ended = taken + 1, False
        return np.array(sorted(seen), dtype=np.int64)

    def next_step(self, state: PlannerState) -> tuple[StepPlan | None, PlannerState]:
        """The plan of the step at `state` and the state after it; (None, next epoch's start) when the
        epoch is over."""
        if self.config.batching == "pairs":
            return self._pairs_step(state)
        return self._tokens_step(state)

    # -- pairs mode ----------------------------------------------------------------------------

    def _pairs_step(self, state: PlannerState) -> tuple[StepPlan | None, PlannerState]:
        c = self.config
        order = self.order(state.epoch)
        start = state.step * c.pairs_per_step
        if start >= len(order):
            return None, PlannerState(epoch=state.epoch + 1)
        pairs = order[start : start + c.pairs_per_step]
        # Share the step's pairs out to ranks by tokens first, then pack each share: every rank does about
        # the same work (a rank's share of whole micro-batches left the busiest 1.2-1.3x the mean).
        tokens = self.pair_tokens[pairs]
        ranks = []
        for positions in share(tokens, c.world_size):
            bins, _ = first_fit_decreasing(tokens[positions], c.max_tokens_per_microbatch)
            ranks.append([pairs[positions][b].tolist() for b in bins])
        # Every rank runs as many micro-batches as the busiest one (collectives must line up);
        # the others get empty micro-batches, which contribute nothing.
        most = max(1, max(len(r) for r in ranks))
        ranks = [r + [[] for _ in range(most - len(r))] for r in ranks]
        return StepPlan(state.epoch, state.step, ranks), PlannerState(state.epoch, state.step + 1)

    # -- tokens mode ---------------------------------------------------------------------------

    def _tokens_step(self, state: PlannerState) -> tuple[StepPlan | None, PlannerState]:
        c = self.config
        order = self.order(state.epoch)
        buffer, cursor = list(state.buffer), state.cursor
        take = min(len(order) - cursor, max(0, self.lookahead - len(buffer)))
        buffer += order[cursor : cursor + take].tolist()
        cursor += take
        if not buffer:
            return None, PlannerState(epoch=state.epoch + 1)
        candidates = np.asarray(buffer, dtype=np.int64)
        shares, left = fill_shares(
            self.pair_tokens[candidates], c.max_tokens_per_microbatch, c.world_size, c.microbatches_per_step
        )
        ranks = [
            [candidates[b].tolist() for b in bins] + [[] for _ in range(c.microbatches_per_step - len(bins))]
            for bins in shares
        ]
        next_state = PlannerState(state.epoch, state.step + 1, cursor, candidates[left].tolist())
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
