"""Step 1's alone check: each sequence of step 1's micro-batches scored alone through the model as loaded."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from dpo_data.loading.microbatch import PackedRow, segment_sums, segments_to_pairs
from dpo_train.attention import unpacked
from dpo_train.attention.features import attention_as, text_config
from dpo_train.errors import ParityError
from dpo_train.logps.pairs import targets
from dpo_train.logps.probe import paths_for, scored_as
from dpo_train.logps.scoring import Scoring
from dpo_train.model.policy import changed_settings, dropout_as_loaded
from dpo_train.parallel import collectives
from dpo_train.reference.guard import TOLERANCE
from dpo_train.vision.families import tower_of

CAUSES = (
    "a rope or scale that depends on the sequence's length, a window or chunk, a layer that sees across "
    "packed segments, a config value the run changed, or a training forward that differs from evaluation"
)


@contextmanager
def as_loaded(model: Any, settings: bool = True) -> Iterator[None]:
    """Meanwhile, the model as a user loads it: evaluation mode, the attention transformers gives its class by
    default (`unpacked.default_attention`), and (with `settings`) every value `disable_dropout` zeroed as loaded."""
    training = model.training
    model.eval()
    try:
        with attention_as(text_config(model), unpacked.default_attention(model)):
            with dropout_as_loaded(model) if settings else nullcontext():
                yield
    finally:
        model.train(training)


def alone_logps(model: Any, batch: PackedRow, settings: bool = True) -> torch.Tensor:
    """[pairs, 2] summed completion log-probs (float64) of the micro-batch's pairs, each prompt + completion run
    alone: one sequence a forward, no padding, no position_ids, no mask, through the model as loaded
    (`as_loaded`); a length-dependent rope then takes that sequence's own length, as in a fresh model. The
    vocabulary head runs at the completion's positions only. Every rank runs as many forwards as the rank with
    the most sequences (FSDP2 all-gathers in each), padding with a one-token forward."""
    every = targets(batch)
    view = unpacked.unpack(batch)
    flat, _ = view.keep(every.position, every.segment)
    width = view.shape[1]
    row, column = flat // width, flat % width
    lengths = view.lengths[:, 0].tolist() if every.position.numel() else []
    picked = torch.zeros(len(flat), dtype=torch.float64)
    forwards = int(collectives.all_reduce(torch.tensor([len(lengths)]), "max")[0])
    ids = view.inputs["input_ids"]
    with torch.no_grad(), as_loaded(model, settings):
        for n in range(forwards):
            if n >= len(lengths):  # another rank still scores: join its collectives
                model(input_ids=ids[:1, :1], use_cache=False)
                continue
            mine = torch.nonzero(row == n)[:, 0]
            keep = torch.zeros(lengths[n], dtype=torch.bool, device=ids.device)
            keep[column[mine]] = True
            logits = model(input_ids=ids[n : n + 1, : lengths[n]], use_cache=False, logits_to_keep=keep).logits
            logits = logits.reshape(-1, logits.shape[-1]).float()
            if logits.shape[0] != int(keep.sum()):  # a model that ignored the mask: every position's logits
                logits = logits[keep]
            at = torch.cumsum(keep, 0)[column[mine]] - 1
            label = every.label[mine]
            picked[mine.cpu()] = (logits[at, label] - torch.logsumexp(logits[at], -1)).double().cpu()
    per_segment = segment_sums(picked, every.segment.cpu(), len(batch["segment_length"]))
    return segments_to_pairs(per_segment, {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()})


def alone_applies(config: Any, model: Any) -> bool:
    """Whether the run checks its first micro-batches alone: `train.alone_check`, for a text model (a
    vision-language row's sequences need its images)."""
    return bool(config.train.alone_check) and tower_of(model) is None


def precompute_check(model: Any, run: Any, scoring: Scoring) -> Any:
    """`score_pairs`' check of each rank's first micro-batch under --precompute-reference: its pairs' packed
    log-probs against each sequence run alone (`check_alone`; the precompute's model is whole on every rank),
    `scoring`: the run's, as the pairs were scored."""
    config = run.config
    facts = {
        "arch": type(model).__name__,
        "attention": text_config(model)._attn_implementation,
        "layout": config.data.layout,
        "rank": run.rank,
        "precision": run.place.precision,
        "where": "the reference precompute",
    }

    def check(batch: PackedRow, out: Any) -> None:
        check_alone(model, (out.chosen, out.rejected) if out is not None else (), batch, facts, False, scoring)

    return check


def check_alone(model: Any, got: tuple, batch: PackedRow, facts: dict, sharded: bool, scoring: Scoring) -> None:
    """Refuse (ParityError, exit 2, before the optimizer steps) a micro-batch whose pairs' log-probs `got`
    ((chosen, rejected), as the run's packed forward scored them) differ from each sequence run alone through
    the model as loaded (`alone_logps`) beyond the parity guard's `TOLERANCE`. A difference is diagnosed on the
    same micro-batch (`_diagnosis`) unless the model is sharded over ranks (FSDP2: every rank would have to
    run the same forwards). `facts`: arch, precision, rank, attention, layout, and `where` ("step 1" or
    "the reference precompute"); `scoring`: the run's (`Scoring`), with which a diagnosis scores the micro-batch
    again. An empty micro-batch (`num_pairs` 0) only joins the other ranks' forwards."""
    truth = alone_logps(model, batch)
    if not batch["num_pairs"]:  # an empty micro-batch only joined the other ranks' forwards
        return
    relative, absolute = TOLERANCE[facts["precision"]]
    have = torch.stack([g.detach().double().cpu() for g in got], 1)
    off = (have - truth).abs() - (absolute + relative * truth.abs())
    if not bool((off > 0).any()) and bool(torch.isfinite(have).all()):
        return
    slot, side = divmod(int(torch.nan_to_num(off, nan=float("inf")).argmax()), 2)
    found = "run on one process for a diagnosis" if sharded else _diagnosis(model, batch, truth, facts, scoring)
    attention = unpacked.default_attention(model)
    raise ParityError(
        f"{facts['where']}, micro-batch {batch.get('microbatch')} on rank {facts['rank']}: {facts['arch']} "
        f"(attention {facts['attention']}, data.layout {facts['layout']}, {facts['precision']}) scores pair "
        f"{int(batch['pair_index'][slot])}'s {('chosen', 'rejected')[side]} completion "
        f"{float(have[slot, side]):.6f} packed, but {float(truth[slot, side]):.6f} with its sequence run alone "
        f"through the model as loaded (evaluation mode, its config values as loaded, transformers' {attention} "
        "attention, one sequence a forward, no padding), beyond "
        f"{relative:.0e} relative + {absolute:.0e}. Nothing was stepped: the run would train on wrong numbers. "
        f'Likely causes: {CAUSES}. {found}. Report the model (docs/train-config.md, "Step 1\'s alone check"); '
        "train.alone_check: false trains anyway, at your own risk"
    )


def _diagnosis(model: Any, batch: PackedRow, truth: torch.Tensor, facts: dict, scoring: Scoring) -> str:
    """What differs, found on this micro-batch without autograd: the values the run zeroed, the training mode,
    or the packing; and the fix, only if one was checked here to give `truth`."""
    relative, absolute = TOLERANCE[facts["precision"]]
    close = lambda have: bool(((have - truth).abs() <= absolute + relative * truth.abs()).all())  # noqa: E731
    if changed_settings(model) and not close(alone_logps(model, batch, settings=False)):
        keys = sorted({key for _, key, _ in changed_settings(model)})
        return f"Found: the config values the run zeroed as dropout ({', '.join(keys)}) change the model itself"
    training = model.training
    try:
        model.eval()
        if close(scored_as(model, batch, None, scoring)):
            return (
                "Found: evaluation mode scores these pairs packed as alone, the training forward does not (it "
                "samples or behaves otherwise in training); no attention path fixes that"
            )
        exact = [name for name in paths_for(model) if _runs_close(model, batch, name, close, scoring)]
    finally:
        model.train(training)
    if exact:
        return f"Fix, checked on this micro-batch: model.attention {' or '.join(exact)}"
    tried = ", ".join(paths_for(model))
    return f"None of {tried} scores these pairs as alone: no path here trains it exactly"


def _runs_close(model: Any, batch: PackedRow, name: str, close: Any, scoring: Scoring) -> bool:
    try:
        return close(scored_as(model, batch, name, scoring))
    except Exception:  # noqa: BLE001 - a path that cannot run the model is only not suggested
        return False
