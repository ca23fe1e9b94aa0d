"""The training loop: exact step-mean objective over packed micro-batches, DDP or FSDP2, metrics per step."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dpo_data import DataError, MicroBatch, contract_problems, is_last
from dpo_data.progress import Stage, say
from dpo_state.faults import step_fault
from dpo_train.attention import check_same_row, row_inputs
from dpo_train.checkpoint import (
    Checkpointable,
    Checkpoints,
    ModelAndOptimizer,
    ReferenceWeights,
    RNGState,
    TrainState,
    run_identity,
)
from dpo_train.config import TrainConfig
from dpo_train.errors import ExportError, GradNormError, NonFiniteError
from dpo_train.evaluation import Evaluator
from dpo_train.export import export, run_facts
from dpo_train.logps import pair_logps
from dpo_train.model import apply_lora, embedding_rows, reached_by_every_rank
from dpo_train.parallel import all_reduce, no_sync, wrap
from dpo_train.reference import build_reference
from dpo_train.run import (
    Progress,
    Run,
    RunLog,
    alone_applies,
    check_alone,
    load_initial_policy,
    stage,
    training_run,
)
from dpo_train.step import (
    CLIP,
    EarlyStopping,
    SortScores,
    add_pairs,
    agree,
    build_optimizer,
    build_schedule,
    early_stopping_watch,
    gradient_norm,
    local_nonfinite,
    microbatch_loss,
    new_sums,
    norm_mismatch,
    pair_losses,
    router_aux_coef,
    sorted_types,
    step_partners,
    step_record,
    step_sources,
    unmoved_rng,
)


class Trainer:
    """One rank's policy, reference, optimizer and step accumulator; fed micro-batches by any loader.

    `microbatch(batch)` runs forward and backward (no gradient sync until the step's last micro-batch);
    `step()` clips, steps the optimizer and scheduler and returns the step's metrics over all ranks.
    """

    def __init__(self, run: Run):
        """`run`: what setup resolved (`run.setup`); the trainer reads it and never changes it."""
        config, place, rank, world, store = run.config, run.place, run.rank, run.world, run.data
        self.run, self.config, self.place, self.rank, self.world, self.store = run, config, place, rank, world, store
        self.mesh, self.sources = run.mesh, store.sources
        torch.manual_seed(config.train.seed)
        # the initial policy: the reference's weights, as --precompute-reference builds them
        policy, self.weights, self.scoring = load_initial_policy(
            config, place, self.mesh, config.train.activation_checkpointing, run.shown
        )
        arch = type(policy).__name__
        self.router_aux_coef = router_aux_coef(
            config.loss.router_aux_coef,
            policy,
            policy.config._attn_implementation,
            self.mesh.active,
            self.scoring.unpacked,
        )
        if config.model.lora:
            policy = apply_lora(policy, config.model.lora)
        policy.to(place.device)
        with stage("reference", run.shown):
            self.reference = build_reference(run, policy, self.weights, self.scoring)  # scored as the policy
            table = self.reference.table
            if table is not None and table.steps is not None and run.loader is not None:
                # a sidecar of planned steps only: every pair this run's steps read must be in it, before any step
                steps = config.train.max_steps
                table.check_covers(run.loader.stream.schedule.pairs_in(steps), steps)
        self.policy, self.model = policy, wrap(policy, config.distributed.strategy, world, place)
        self.optimizer = build_optimizer(policy.parameters(), config.optim)
        self.scheduler = build_schedule(self.optimizer, config.optim, config.train.max_steps)
        self.vocab_rows = embedding_rows(policy)
        self.state = TrainState(early_stopping=early_stopping_watch(config.eval))
        self.skipped_steps = 0
        self._check_norm = config.train.parity_guard  # at this process's first step (a resumed run's too)
        # step 1: each sequence alone, as loaded (a vision-language row's sequences need its images: not run). Never
        # a resumed process's first step: its LoRA adapters are no longer zero, and LoRA's dropout (model.lora
        # dropout, kept on) then makes its training forward differ from the model in evaluation, as it should
        self._check_alone = alone_applies(config, policy)
        self._step_pairs: set[int] = set()
        self.sorted, self._held = bool(sorted_types(config.loss)), []
        self.sums, self._started = new_sums(len(self.sources)), time.perf_counter()
        self.facts = {  # what step 1's parity guard names
            "arch": arch,
            "attention": policy.config.get_text_config()._attn_implementation,  # a VLM's decoder's
            "layout": config.data.layout,
            "rank": rank,
        }

    def _check_token_ids(self, batch: MicroBatch) -> None:
        """A token id the model cannot embed (a damaged shard read with data.verify: size) is a named
        DataError, not an IndexError deep inside the embedding."""
        ids = batch["input_ids"]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_rows):
            row = ids[0]
            bad = int(torch.nonzero((row < 0) | (row >= self.vocab_rows))[0])
            segment = int(torch.searchsorted(batch["cu_seqlens"].long(), bad, right=True)) - 1
            slot = int(batch["segment_pair"][segment])
            index = int(batch["pair_index"][slot]) if slot >= 0 else -1
            where = "dataset {}, {}".format(*self.store.locate(index)) + f" (pair {index})" if slot >= 0 else "padding"
            raise DataError(
                f"token id {int(row[bad])} in {where} is outside the model's {self.vocab_rows} "
                "embedding rows: the shard is damaged; run dpo-data verify on the dataset"
            )

    @property
    def step_number(self) -> int:
        """The step in progress as messages name it: counted from 1, as the progress line, the parity guard and
        the checkpoint directories count (metrics.jsonl's `step` counts the steps done before it)."""
        return self.state.step + 1

    def checkpointable(self, loader) -> Checkpointable:
        """The Stateful parts a checkpoint saves and restores (the checkpointer never sees the trainer)."""
        return Checkpointable(
            ModelAndOptimizer(self.model, self.optimizer),
            self.scheduler,
            loader,
            RNGState(self.place.device.type),
            self.state,
            ReferenceWeights(self.reference.initial) if self.reference.moves else None,
        )

    def identity(self) -> dict:
        """What a checkpoint of this run records and a resume must share (`checkpoint.identity`)."""
        reference = self.weights, self.reference.sidecar_sha256
        parts = self.run, self.policy, self.optimizer, self.scheduler, reference, self.router_aux_coef
        return run_identity(*parts, mlp_tile=self.scoring.mlp_tile)

    def microbatch(self, batch: MicroBatch) -> None:
        """Check one micro-batch against the contract (`train.check_microbatches`), then forward/backward
        it; the gradient syncs on the step's last micro-batch only."""
        if self.config.train.check_microbatches:
            problems = contract_problems(batch)
            if problems:
                raise DataError(
                    f"micro-batch {batch.get('microbatch')} of step {self.step_number} on rank {self.rank} "
                    "breaks the micro-batch contract (docs/loader.md):\n  - " + "\n  - ".join(problems)
                )
        self._step_pairs.add(batch["step_pairs"])
        self._check_token_ids(batch)
        if self.mesh.active:
            check_same_row(batch, self.mesh, self.step_number)
        if not self.sorted:
            self._forward_backward(batch)
            return
        # AOT pairs the step's sorted log-ratios: every micro-batch is scored before the first backward
        self._held.append(batch)
        if is_last(batch):
            held, self._held = self._held, []
            for each, partners in zip(held, self._step_partners(held), strict=True):
                self._forward_backward(each, partners)

    def _step_partners(self, held: list[MicroBatch]) -> list[dict]:
        """The pass without gradient over the step's micro-batches, then their partners in its sorts."""
        with torch.no_grad(), unmoved_rng(self.place.device), self.place.autocast():
            scores = [self._sort_scores(self._on_device(batch)) for batch in held]
        return step_partners(scores, self.config.loss, self.mesh)

    def _sort_scores(self, batch: MicroBatch) -> SortScores | None:
        if batch["num_pairs"] == 0:  # the same collectives as the step's own forward, no pair
            self._join(batch)
            return None
        reference = self.reference.logps(batch, self.state.step)  # a sorted type needs one: never None
        policy = pair_logps(self.model, batch, self.scoring, self.mesh, ld_alpha=self.config.loss.ld_alpha)
        return SortScores(batch["pair_index"], *policy.scored, *reference.scored)

    def _join(self, batch: MicroBatch):
        """A micro-batch without pairs: the reference's and the policy's forwards over its padding row, so that
        this rank joins every collective the others' forwards issue; the policy's output."""
        inputs = row_inputs(batch, self.mesh, self.model, self.scoring.unpacked)[0]
        self.reference.join(inputs, self.world)
        return self.model(**inputs)

    def _on_device(self, batch: MicroBatch) -> MicroBatch:
        return {k: v.to(self.place.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _forward_backward(self, batch: MicroBatch, partners: dict | None = None) -> None:
        """One micro-batch's forward and backward; `partners`: its pairs' in the step's sorts (AOT)."""
        batch = self._on_device(batch)
        sync = is_last(batch)
        with no_sync(self.model, self.config.distributed.strategy, self.world, sync=sync), self.place.autocast():
            if batch["num_pairs"] == 0:  # join the collectives (FSDP2 all-gathers) in order, contribute nothing
                joined = self._join(batch)
                self._alone(batch, None)  # before the backward, as a rank with pairs runs it: collectives in order
                (joined.logits.sum().mul(0) + reached_by_every_rank(self.policy)).backward()
                return
            # the reference first: under LoRA it is the policy's own modules, run without autograd
            reference = self.reference.logps(batch, self.state.step)
            loss = self.config.loss
            aux = bool(self.router_aux_coef)
            policy = pair_logps(self.model, batch, self.scoring, self.mesh, aux, loss.ld_alpha, loss.use_weighting)
            self.reference.check_initial(policy, reference, batch, self.state.step, self.facts)
            self._alone(batch, policy)
            terms = pair_losses(policy, reference, loss, partners)
            total = microbatch_loss(
                terms.losses,
                batch["step_pairs"],
                -policy.chosen.sum(),
                batch["step_chosen_tokens"],
                self.config.loss.sft_weight,
                policy.aux_loss,
                self.router_aux_coef,
            )
            (total + reached_by_every_rank(self.policy)).backward()
        add_pairs(self.sums, batch, terms, policy, self.config.data.max_tokens_per_microbatch)

    def _alone(self, batch: MicroBatch, policy: Any) -> None:
        """At step 1, the policy's packed log-probs of each micro-batch against its sequences run alone through the
        model as loaded (`dpo_train.run.alone`, train.alone_check)."""
        if not self._check_alone or self.state.step:
            return
        facts = {**self.facts, "precision": self.place.precision, "where": "step 1"}
        sharded = self.config.distributed.strategy == "fsdp" and self.world > 1
        got = (policy.chosen, policy.rejected) if policy is not None else ()
        check_alone(self.policy, got, batch, facts, sharded, self.scoring)

    def _check_clip_norm(self, reported: float, independent: float) -> None:
        """The first step's norm from clip_grad_norm_ against the gradients' own, checked once: a library that
        computes it wrong clips by it and logs it at every step (torch 2.9.1 under FSDP2 gave each rank another
        norm, docs/dependencies.md). Every rank votes, so that all stop together when any is wrong."""
        self._check_norm = False
        dtypes = {p.grad.dtype for p in self.policy.parameters() if p.grad is not None}
        mismatch = norm_mismatch(reported, independent, dtypes)
        if not all_reduce(torch.tensor([float(mismatch is not None)]), "max"):
            return
        self.optimizer.zero_grad(set_to_none=True)
        raise GradNormError(
            f"step {self.step_number} (this process's first): "
            f"{mismatch or f'another rank found {CLIP} wrong (on this rank it returned {reported:.6g}, right)'}, with "
            f"torch {torch.__version__} and distributed.strategy {self.config.distributed.strategy} on {self.world} "
            "rank(s). Nothing was stepped: optim.max_grad_norm would clip by the wrong norm and metrics.jsonl would "
            "log it. Fix: a torch within dpo-toolkit's range (docs/dependencies.md), and report it; "
            "train.parity_guard: false skips this check"
        )

    def step(self) -> dict:
        """Finish the optimizer step: clip the step gradient, reduce the metrics, and update, unless the
        loss, a log-prob or the gradient norm is not finite on any rank (`train.on_nonfinite`)."""
        max_norm = self.config.optim.max_grad_norm or float("inf")
        self._check_alone = False  # step 1 only
        independent = gradient_norm(self.policy.parameters()) if self._check_norm else None
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm))
        if independent is not None:
            self._check_clip_norm(grad_norm, independent)
        mine = local_nonfinite(self.sums, grad_norm)
        step_pairs, self._step_pairs = self._step_pairs, set()
        bad_ranks, fewest, most = agree(bool(mine), max(step_pairs, default=0), self.rank, self.world)
        if len(step_pairs) > 1 or fewest != most:
            self.optimizer.zero_grad(set_to_none=True)
            raise DataError(
                f"step {self.step_number}: the micro-batches disagree on step_pairs (this rank saw "
                f"{sorted(step_pairs)}, the ranks {fewest} to {most}); every micro-batch of a step, on "
                "every rank, must carry the step's total pair count (docs/loader.md)"
            )
        # every rank of a sequence-parallel group holds the same pairs: one of them reports them
        self.sums = all_reduce(self.sums if self.mesh.counts_pairs else torch.zeros_like(self.sums))
        if bad_ranks and self.config.train.on_nonfinite == "stop":
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(
                f"step {self.step_number}: {', '.join(mine) if mine else 'a metric'} not finite on rank(s) "
                f"{', '.join(map(str, bad_ranks))} (this is rank {self.rank}); the step's pairs come from sources "
                f"{', '.join(step_sources(self.sums, self.sources)) or '(none)'}. Nothing was stepped, committed or "
                "exported: the newest checkpoint is the last good state. Fix: lower optim.lr or loss.beta, check "
                "those sources, or set train.on_nonfinite: skip_step"
            )
        if not bad_ranks:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.reference.sync(self.policy, self.state.step + 1)  # TR-DPO; a skipped step counts (train-config.md)
        record = step_record(
            self.sums,
            self.sources,
            grad_norm,
            self.scheduler.get_last_lr()[0],
            self.state.step,
            time.perf_counter() - self._started,
            self.world,
            self.config.loss.sft_weight,
            self.router_aux_coef,
        )
        if bad_ranks:  # skip_step: logged and counted; optimizer and scheduler did not move
            self.skipped_steps += 1
            record.update(skipped=True, nonfinite_ranks=bad_ranks)
        record["skipped_steps"] = self.skipped_steps
        for key in self.state.consumed:
            self.state.consumed[key] += record[key]
        self.sums.zero_()
        self.state.step, self._started = self.state.step + 1, time.perf_counter()
        return record


def train(config: TrainConfig, progress: bool = True) -> Path:
    """Train until `train.max_steps` (or the data's epochs end); return the output directory."""
    with training_run(config, progress) as run:
        return _run(run)


def _run(run: Run) -> Path:
    config, rank, loader, out = run.config, run.rank, run.loader, run.out
    trainer = Trainer(run)
    run.check_model(trainer.policy)
    checkpoints = Checkpoints(run, trainer.checkpointable(loader), trainer.identity())
    # the held-out baseline is scored now, before a resume loads a moved (TR-DPO) reference into `initial`
    evaluator = Evaluator(run, trainer.reference.initial, trainer.scoring) if run.held_out else None
    _resume(checkpoints, run)
    fault, epochs_note = step_fault(rank), _epochs_note(config, rank)
    with (
        RunLog(run, checkpoints.resumed_at) as log,
        Progress(config.train.max_steps, enabled=run.shown, start=trainer.state.step) as bar,
    ):
        watch = trainer.state.early_stopping
        if evaluator and checkpoints.resumed_at is None:
            _evaluate(evaluator, trainer, log, watch)
        if _stopped(watch) and rank == 0:  # resumed from the checkpoint where it stopped
            say(watch.reason())
        bar.begin()
        for batch in loader if trainer.state.step < config.train.max_steps and not _stopped(watch) else ():
            fault(trainer.state.step)
            epochs_note(batch["epoch"])
            trainer.microbatch(batch)
            if not is_last(batch):
                continue
            record = trainer.step()
            log.step(record)
            bar.update(record)
            if evaluator and config.eval.every and trainer.state.step % config.eval.every == 0:
                stopped = _evaluate(evaluator, trainer, log, watch)
                if stopped and rank == 0:
                    say(watch.reason())
            done = trainer.state.step >= config.train.max_steps or _stopped(watch)
            checkpoints.after_step(done)
            if done:
                break
        checkpoints.finish()  # the data ran out before max_steps: keep the last step
        if evaluator and (not config.eval.every or trainer.state.step % config.eval.every):
            log.evaluation(evaluator.run(trainer.model, step=trainer.state.step))
    facts = run_facts(checkpoints.identity, checkpoints.lineage, trainer.state.step, run.data, out)
    try:
        with Stage(f"export {out / 'final'}", enabled=run.shown):
            export(trainer.policy, config, run.tokenizer, out, rank, facts, run.processor())
    except ExportError as e:  # the trained weights must not be lost with the export: a checkpoint keeps them
        raise ExportError(f"{e}. {checkpoints.keep_trained()}") from None
    return out


def _resume(checkpoints: Checkpoints, run: Run) -> None:
    """Restore the checkpoint to resume from, if any, as a start-up stage; then say where the run stands."""
    if checkpoints.resume_from is None:
        return
    with stage("resume", run.shown, checkpoint=checkpoints.resume_from):
        checkpoints.resume()
    if run.rank == 0:
        say(f"resumed from {checkpoints.resume_from} at step {checkpoints.resumed_at}")


def _evaluate(evaluator: Evaluator, trainer: Trainer, log: RunLog, watch: EarlyStopping | None) -> bool:
    """Evaluate the policy now, log it, and count it in the early-stopping watch: True when it says stop.
    Every rank holds the same record (the scores are all-reduced), so every rank decides the same."""
    record = evaluator.run(trainer.model, step=trainer.state.step)
    log.evaluation(record)
    return bool(watch and watch.update(record))


def _stopped(watch: EarlyStopping | None) -> bool:
    return bool(watch and watch.stopped)


def _epochs_note(config: TrainConfig, rank: int) -> Callable[[int], None]:
    """Say once, when a run set by max_steps goes past train.epochs of the data, that max_steps decides."""
    said = rank != 0

    def note(epoch: int) -> None:
        nonlocal said
        if not said and epoch >= config.train.epochs:
            said = True
            say(
                f"note: train.max_steps {config.train.max_steps} goes on into epoch {epoch + 1} of the data, "
                f"past train.epochs {config.train.epochs}: max_steps decides when set (max_steps: null trains "
                "train.epochs epochs; docs/train-config.md)"
            )

    return note
