"""Log-probs of every pair of a dataset without gradients, packed: for reference sidecars and held-out eval."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dpo_data.dataset.store import PairStore
from dpo_data.errors import DataError
from dpo_data.loading.binpack import first_fit_decreasing
from dpo_data.loading.images import ImageSource
from dpo_data.loading.loader import pack_pairs
from dpo_data.progress import Stage
from dpo_train.attention.inputs import row_inputs
from dpo_train.logps.pairs import PairLogps, pair_logps
from dpo_train.logps.scoring import Scoring
from dpo_train.parallel import collectives
from dpo_train.reference.run_view import RunView


@dataclass
class Scores:
    """Per pair (by global pair index): summed completion log-probs and completion token counts; where asked
    for, LD-DPO's sums and WPO's weights (dpo_train/logps/pairs.py)."""

    chosen: np.ndarray
    rejected: np.ndarray
    chosen_tokens: np.ndarray
    rejected_tokens: np.ndarray
    ld: tuple[np.ndarray, np.ndarray] | None = None
    weights: np.ndarray | None = None

    @property
    def scored(self) -> tuple[np.ndarray, np.ndarray]:
        """The (chosen, rejected) log-probs the loss reads: the LD-DPO sums where asked for, else the sums."""
        return self.ld if self.ld is not None else (self.chosen, self.rejected)

    def as_logps(self) -> PairLogps:
        """These scores as a forward's log-probs, what the loss reads: float64 tensors, the counts as they are."""
        ld = None if self.ld is None else (_float64(self.ld[0]), _float64(self.ld[1]))
        weights = None if self.weights is None else torch.from_numpy(self.weights)
        counts = torch.from_numpy(self.chosen_tokens), torch.from_numpy(self.rejected_tokens)
        return PairLogps(_float64(self.chosen), _float64(self.rejected), *counts, ld=ld, weights=weights)


def _float64(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(values, dtype=np.float64))


def score_pairs(
    model: Any,
    scoring: Scoring,
    store: PairStore,
    run: RunView,
    max_tokens: int,
    weighting: bool = False,
    progress: str | None = None,
    pairs: np.ndarray | None = None,
    check: Any = None,
) -> Scores:
    """Forward every pair of `store` once, scored as the run's `scoring` says, packed in the run's `data.layout`
    into micro-batches of at most `max_tokens`, under the run's autocast and sequence mesh; also LD-DPO's sums
    where the run's loss sets `ld_alpha`, and with `weighting` WPO's weights (as `pair_logps` takes them).
    `progress`: the stage's name to show it under (`Stage`, on the caller's rank 0), None: silent. `pairs`: only
    these global indices are scored; the others' log-probs (and LD sums, weights) are NaN, their token counts 0.
    `check(batch, out)`: called on every rank's first micro-batch (`out` None for an empty one), as
    --precompute-reference checks them against each sequence run alone (`dpo_train.run.alone`).

    With a process group, data-parallel rank r scores bins r, r + W, ... and one all-reduce assembles the
    result (each pair is written by exactly one rank: under sequence parallelism, by the group's rank
    that counts pairs), so every rank returns the whole table.
    """
    layout, ld_alpha, mesh = run.config.data.layout, run.config.loss.ld_alpha, run.mesh
    pairs = np.arange(store.num_pairs) if pairs is None else np.asarray(pairs, dtype=np.int64)
    sizes = store.segment_tokens(pairs, layout)
    images = ImageSource(run.config.model.processor, store) if store.vision else None
    too_long = np.flatnonzero(sizes > max_tokens)
    if len(too_long):
        raise DataError(
            f"pair {int(pairs[too_long[0]])} has {int(sizes[too_long[0]])} input tokens (both segments), more "
            f"than the micro-batch budget {max_tokens}; raise data.max_tokens_per_microbatch, or rebuild "
            "the dataset with a lower --max-length; pairs are never skipped or cut"
        )
    bins = [pairs[b].tolist() for b in first_fit_decreasing(sizes, max_tokens)[0]]
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if mesh is not None:
        rank, world = mesh.dp_rank, mesh.dp_size
    writes = mesh is None or mesh.counts_pairs
    table = torch.zeros(7, store.num_pairs, dtype=torch.float64)  # sums, counts, LD sums, WPO weights
    unscored = np.ones(store.num_pairs, dtype=bool)
    unscored[pairs] = False
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rounds = -(-len(bins) // world)  # equal forwards on every rank: FSDP all-gathers in each one

    def score(members: list, first: bool) -> None:
        batch = pack_pairs(store, sorted(members), layout, 8, images)  # a vision store's with their images
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        with run.place.autocast():
            if not members:
                model(**row_inputs(batch, mesh, model, scoring.unpacked)[0])
                if first and check is not None:
                    check(batch, None)
                return
            out = pair_logps(model, batch, scoring, mesh, ld_alpha=ld_alpha, weighting=weighting)
            if first and check is not None:
                check(batch, out)
        if not writes:
            return
        index = batch["pair_index"].cpu().long()
        rows = [out.chosen, out.rejected, out.chosen_tokens, out.rejected_tokens, *(out.ld or ())]
        for row, values in enumerate(rows):
            table[row, index] = values.detach().double().cpu()
        if weighting:
            table[6, index] = out.weights.double().cpu()

    with torch.no_grad(), Stage(progress or "", rounds, enabled=progress is not None, unit="micro-batch") as stage:
        for k in range(rounds):
            j = k * world + rank
            score(bins[j] if j < len(bins) else [], k == 0)
            stage.advance()
    model.train(was_training)
    values = collectives.all_reduce(table).numpy()
    values[np.ix_([0, 1, 4, 5, 6], unscored)] = np.nan  # never computed: no value a loss could mistake for one
    return Scores(
        values[0].copy(),
        values[1].copy(),
        values[2].astype(np.int32),
        values[3].astype(np.int32),
        (values[4].copy(), values[5].copy()) if ld_alpha is not None else None,
        values[6].copy() if weighting else None,
    )
