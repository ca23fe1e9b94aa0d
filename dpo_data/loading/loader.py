"""torchdata StatefulDataLoader over packed micro-batches, with versioned, geometry-checked, exact resume."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from dpo_data.dataset.store import PairStore
from dpo_data.errors import DataError
from dpo_data.loading.config import LoaderConfig
from dpo_data.loading.microbatch import MicroBatch, PackedRow, is_last, pack_microbatch, pack_shared_prompt
from dpo_data.loading.steps import PlannerState, StepPlan, StepPlanner
from dpo_state.schema import schema_problems
from dpo_state.state import ELASTIC_KEYS

LOADER_STATE_VERSION = 2
"""2: the version key is spelled `format_version`, as in every other document."""


WORKER_PRELOAD = ("torch", __name__)
"""What the workers' fork server imports once, so that each worker, forked from it, starts with torch and the
stream's module loaded instead of importing them itself (seconds a worker; workers start again at every `iter()`,
each epoch and each resume). The server is a fresh interpreter, without the rank's gloo threads."""
VISION_PRELOAD = ("transformers", "dpo_data.loading.images")
"""What the fork server also imports when the data holds images: the processor's library, once."""


def _worker_context(vision: bool = False) -> Any:
    """The fork-server context the workers start from, preloading WORKER_PRELOAD (and VISION_PRELOAD for vision
    data; it takes effect when the process's fork server starts: the first workers)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(WORKER_PRELOAD) + (list(VISION_PRELOAD) if vision else []))
    return context


class MicrobatchStream(IterableDataset):
    """This rank's micro-batches, epoch after epoch from `start` (until `max_epochs`, if set).

    The position lives on the iterator (`iter(stream)`), never on the dataset object, so a restored
    position cannot leak into a later iteration. With DataLoader workers, micro-batch k of the rank's
    stream is built by worker k % num_workers; every worker plans the same steps from lengths alone.
    A vision store's micro-batches carry their images (`images`: `dpo_data.loading.images.ImageSource`).
    """

    def __init__(
        self,
        dirs: list[str | Path],
        config: LoaderConfig,
        max_epochs: int | None = None,
        start: PlannerState | None = None,
        pad_to_multiple_of: int | None = None,
        processor: str | Path | None = None,
    ):
        self.store = PairStore(dirs)
        self.images = _image_source(self.store, processor)
        self.config = config
        self.max_epochs = max_epochs
        self.pad_to_multiple_of = pad_to_multiple_of
        self.start = (start or PlannerState()).copy()
        self.schedule = StepPlanner(
            self.store.segment_tokens(np.arange(self.store.num_pairs), config.layout),
            self.store.dataset_sizes,
            self.store.fingerprint,
            config,
        )

    def geometry(self) -> dict[str, Any]:
        g = self.config.geometry(self.store.fingerprint)
        g.update(
            max_epochs=self.max_epochs, pad_to_multiple_of=self.pad_to_multiple_of, lookahead=self.schedule.lookahead
        )
        return g

    def __iter__(self) -> StreamIterator:
        return StreamIterator(self)


class StreamIterator:
    """Iterator with `state_dict` / `load_state_dict` (torchdata's Stateful protocol). The state is the
    schedule state at the start of the current step plus how far into the step this rank has come."""

    def __init__(self, stream: MicrobatchStream):
        self.stream = stream
        info = get_worker_info()
        self.worker, self.num_workers = (info.id, info.num_workers) if info else (0, 1)
        self._reset(stream.start.copy(), microbatch=0, seq=0)

    def _reset(self, state: PlannerState, microbatch: int, seq: int) -> None:
        self.state, self.microbatch, self.seq = state, microbatch, seq
        self.plan: StepPlan | None = None
        self.after: PlannerState | None = None

    def __iter__(self) -> Iterator[MicroBatch]:
        return self

    def __next__(self) -> MicroBatch:
        while True:
            if self.stream.max_epochs is not None and self.state.epoch >= self.stream.max_epochs:
                raise StopIteration
            if self.plan is None:
                self.plan, self.after = self.stream.schedule.next_step(self.state)
                if self.plan is None:  # epoch over: the next one starts fresh
                    self._reset(self.after, 0, 0)
                    continue
            mine = self.plan.ranks[self.stream.config.rank]
            if self.microbatch >= len(mine):
                self._reset(self.after, 0, self.seq)
                continue
            k, self.microbatch, self.seq = self.microbatch, self.microbatch + 1, self.seq + 1
            if (self.seq - 1) % self.num_workers == self.worker:
                return self._build(self.plan, mine, k)

    def _build(self, plan: StepPlan, mine: list[list[int]], k: int) -> MicroBatch:
        try:
            batch = pack_pairs(
                self.stream.store,
                mine[k],
                self.stream.config.layout,
                self.stream.pad_to_multiple_of,
                self.stream.images,
            )
        except DataError as e:  # a worker's error reaches the rank as a message, not as its traceback
            return {FAILED: str(e)}
        store = self.stream.store
        step_pairs = [i for rank in plan.ranks for mb in rank for i in mb]
        return MicroBatch(
            **batch,
            epoch=plan.epoch,
            step=plan.step,
            microbatch=k,
            microbatches_in_step=len(mine),
            step_pairs=len(step_pairs),
            step_chosen_tokens=int(store.chosen_len[step_pairs].sum()),
        )

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.state.to_dict(), "microbatch": self.microbatch, "seq": self.seq}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reset(PlannerState.from_dict(state["schedule"]), int(state["microbatch"]), int(state["seq"]))


FAILED = "data_error"
"""The key of the one item a stream yields when it cannot build a micro-batch: the DataError's message, which
`DPOLoader` raises on the rank (from a worker, the error itself would arrive wrapped in its traceback)."""


def pack_pairs(
    store: PairStore, indices: list[int], layout: str, pad_to_multiple_of: int | None, images: Any = None
) -> PackedRow:
    """The packed micro-batch of pairs `indices` of `store` in `layout`: text pairs by `pack_microbatch` or
    `pack_shared_prompt`, a vision store's with their images by `images` (an `ImageSource`)."""
    if images is not None:
        return images.pack(store, indices, layout, pad_to_multiple_of)
    pack = pack_shared_prompt if layout == "shared_prompt" else pack_microbatch
    return pack([store.pair(i) for i in indices], pad_to_multiple_of)


def _image_source(store: PairStore, processor: str | Path | None) -> Any:
    """The ImageSource of a vision store (`processor`: the model directory holding the processor its datasets
    attest), None for text data; a vision store without a processor is refused by name."""
    if not store.vision:
        return None
    if processor is None:
        raise DataError(
            f"datasets {', '.join(store.dirs)} hold images; the loader prepares them with the processor they were "
            "built with: pass DPOLoader(..., processor=MODEL_DIR) (dpo-train: model.path, the vision-language "
            "model's directory)"
        )
    from dpo_data.loading.images import ImageSource

    return ImageSource(processor, store)


class DPOLoader:
    """The loader a trainer uses: a `StatefulDataLoader` (batch_size=None: items are micro-batches)
    plus a versioned state that records its geometry and is copied on save and on restore.

    `load_state_dict` resumes exactly when the geometry matches; in `pairs` mode a state saved at a
    step boundary also resumes under another world size, rank, token budget or worker count, at the
    same step. Any other difference raises one error listing every difference.
    """

    def __init__(
        self,
        dirs: list[str | Path],
        config: LoaderConfig,
        max_epochs: int | None = None,
        pad_to_multiple_of: int | None = None,
        start: PlannerState | None = None,
        processor: str | Path | None = None,
    ):
        self.dirs, self.config, self.max_epochs, self.pad, self.processor = (
            [str(d) for d in dirs],
            config,
            max_epochs,
            pad_to_multiple_of,
            processor,
        )
        self.stream = MicrobatchStream(self.dirs, config, max_epochs, start, pad_to_multiple_of, processor)
        self.loader = self._make_loader(self.stream)
        self._next = {"epoch": self.stream.start.epoch, "step": self.stream.start.step, "microbatch": 0}

    def _make_loader(self, stream: MicrobatchStream):
        import torch
        from torchdata.stateful_dataloader import StatefulDataLoader

        # A generator of its own: without one, each `iter()` draws its workers' base seed from torch's global
        # generator, so a resumed run (whose first `iter()` comes after the checkpoint's RNG states were
        # restored) would draw LoRA dropout masks one number off the uninterrupted run's. The stream itself
        # draws nothing random (its order has its own seed), so the workers' seeds change no batch.
        generator = torch.Generator().manual_seed(self.config.seed)
        # Workers come from a fork server, not a fork of the rank: a rank runs gloo's threads, and a fork taken
        # while one of them holds a lock of the interpreter deadlocks the child in CPython's after-fork
        # clean-up (seen: a worker stuck in _PyThreadState_DeleteExcept). The stream pickles as its paths.
        context = _worker_context(stream.images is not None) if self.config.num_workers else None
        with warnings.catch_warnings():  # torchdata 0.11 calls the deprecated torch.set_vital on every construction
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return StatefulDataLoader(
                stream,
                batch_size=None,
                num_workers=self.config.num_workers,
                persistent_workers=False,
                in_order=True,
                generator=generator,
                multiprocessing_context=context,
            )

    def __iter__(self) -> Iterator[MicroBatch]:
        for batch in self.loader:
            if FAILED in batch:
                raise DataError(batch[FAILED])
            last = is_last(batch)
            self._next = {
                "epoch": batch["epoch"],
                "step": batch["step"] + last,
                "microbatch": 0 if last else batch["microbatch"] + 1,
            }
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(
            {
                "format_version": LOADER_STATE_VERSION,
                "geometry": self.stream.geometry(),
                "position": self._next,
                "dataloader": self.loader.state_dict(),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = copy.deepcopy(state)  # never alias the caller's copy
        found = state.get("format_version") if isinstance(state, dict) else None
        if found != LOADER_STATE_VERSION:
            raise DataError(
                f"loader state format_version {found!r}; this dpo-data reads format_version "
                f"{LOADER_STATE_VERSION}. Fix: resume with the version that saved it"
            )
        problems = schema_problems("loader-state", state)
        if problems:
            raise DataError(
                "the loader state does not match schemas/loader-state.schema.json:\n  - " + "\n  - ".join(problems)
            )
        saved, current = state["geometry"], self.stream.geometry()
        differ = {
            k: (saved.get(k), current.get(k))
            for k in sorted(set(saved) | set(current))
            if saved.get(k) != current.get(k)
        }
        if not differ:
            self.loader.load_state_dict(state["dataloader"])
            self._next = state["position"]
            return
        elastic = [key for key in ELASTIC_KEYS if key in current]  # the keys a loader geometry has
        if current["batching"] == "pairs" and set(differ) <= set(elastic):
            self._elastic_resume(state["position"], differ)
            return
        listing = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in differ.items())
        allowed = " (pairs mode resumes across " + ", ".join(elastic) + " at step boundaries)"
        raise DataError(
            f"the loader state was saved with another geometry: {listing}. Resume with the saved "
            f"settings{allowed if current['batching'] == 'pairs' else ''}, or start a fresh run"
        )

    def _elastic_resume(self, position: dict[str, int], differ: dict) -> None:
        if position["microbatch"] != 0:
            raise DataError(
                f"the loader state was saved inside step {position['step']} (micro-batch "
                f"{position['microbatch']}); changing {', '.join(differ)} needs a state saved at a step boundary"
            )
        start = PlannerState(epoch=position["epoch"], step=position["step"])
        self.stream = MicrobatchStream(self.dirs, self.config, self.max_epochs, start, self.pad, self.processor)
        self.loader = self._make_loader(self.stream)
        self._next = dict(position)
