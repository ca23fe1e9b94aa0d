"""The training loop: exact step-mean objective over packed micro-batches, DDP or FSDP2, metrics per step."""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Any

import orjson
import torch
import torch.distributed as dist
import yaml

from dpo_data.loader import DPOLoader
from dpo_data.schedule import LoaderConfig
from dpo_train.config import ConfigError, TrainConfig
from dpo_data.microbatch import pair_sums
from dpo_train.logps import pair_logps
from dpo_train.loss import pair_losses
from dpo_train.model import frozen_copy, load_policy
from dpo_train.objective import microbatch_loss

# Per-pair sums over a step, all-reduced at its end; metrics are their ratios (pair-weighted, never a
# mean of means). Row 0 holds all pairs, row 1 + s the pairs of source s: a pair counts once.
_SUMS = ("loss", "chosen_reward", "rejected_reward", "correct", "margin", "chosen_logp", "rejected_logp",
         "pairs", "input_tokens", "supervised_tokens", "capacity")


def train(config: TrainConfig) -> Path:
    """Train until `train.max_steps` (or the data's epochs end); return the output directory."""
    _refuse_unbuilt(config)
    rank, world = _init_distributed()
    out = Path(config.train.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.resolved.yaml").write_text(yaml.safe_dump(config.resolved(), sort_keys=False))
    torch.manual_seed(config.train.seed)
    policy = load_policy(config.model)
    reference = frozen_copy(policy) if config.loss.needs_reference and config.reference.mode == "live" else None
    model = _wrap(policy, config.distributed.strategy, world)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
    loader = DPOLoader(_paths(config), _loader_config(config, rank, world), max_epochs=config.train.epochs,
                       pad_to_multiple_of=8)
    metrics_file = open(out / "metrics.jsonl", "ab") if rank == 0 else None
    sources = loader.stream.store.sources
    sums, step, started = torch.zeros(1 + len(sources), len(_SUMS), dtype=torch.float64), 0, time.perf_counter()
    try:
        for batch in loader:
            last = batch["microbatch"] + 1 == batch["microbatches_in_step"]
            with _no_sync(model, config.distributed.strategy, world, sync=last):
                _microbatch(model, reference, batch, config, sums)
            if not last:
                continue
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), config.optim.max_grad_norm or float("inf"))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if world > 1:
                dist.all_reduce(sums)
            record = _metrics(sums, sources, float(grad_norm), scheduler.get_last_lr()[0], step,
                              time.perf_counter() - started)
            if metrics_file is not None and step % config.train.log_every == 0:
                metrics_file.write(orjson.dumps(record) + b"\n")
                metrics_file.flush()
            sums.zero_()
            step, started = step + 1, time.perf_counter()
            if step >= config.train.max_steps:
                break
    finally:
        if metrics_file is not None:
            metrics_file.close()
    _export(policy, config, out, rank, world)
    return out


def _refuse_unbuilt(config: TrainConfig) -> None:
    """Settings whose machinery has not landed fail loudly instead of being ignored."""
    if config.train.save_every:
        raise ConfigError(f"train.save_every is {config.train.save_every}; checkpoints are not built yet "
                          "(the checkpoint-state issue): set it to 0")
    if config.train.resume not in ("auto", "never"):
        raise ConfigError(f"train.resume is {config.train.resume!r}; resuming from a path needs checkpoints, "
                          "not built yet: use auto or never")
    if config.reference.mode == "precomputed":
        raise ConfigError("reference.mode precomputed is not built yet: use live (or none with loss.type simpo)")
    if config.loss.needs_reference and config.reference.mode == "none":
        raise ConfigError(f"loss.type {config.loss.type} needs a reference; set reference.mode: live, or use simpo")


def _microbatch(model, reference, batch: dict, config: TrainConfig, sums: torch.Tensor) -> None:
    """Forward/backward one micro-batch and add its pairs to the step sums (row 0 all, row 1 + s source s)."""
    if batch["num_pairs"] == 0:  # join the collectives, contribute nothing
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits.sum().mul(0).backward()
        return
    policy = pair_logps(model, batch)
    ref = None
    if reference is not None:
        with torch.no_grad():
            ref = pair_logps(reference, batch)
    terms = pair_losses(config.loss, policy.chosen, policy.rejected, ref.chosen if ref else None,
                        ref.rejected if ref else None, policy.chosen_tokens, policy.rejected_tokens)
    microbatch_loss(terms.losses, batch["step_pairs"], -policy.chosen.sum(), batch["step_chosen_tokens"],
                    config.loss.nll_weight).backward()
    margin = terms.chosen_rewards - terms.rejected_rewards
    input_tokens = pair_sums(torch.ones(batch["input_ids"].shape[1]), batch).sum(1)
    per_pair = torch.stack([
        terms.losses.detach(), terms.chosen_rewards, terms.rejected_rewards, (margin > 0).float(), margin,
        policy.chosen.detach(), policy.rejected.detach(), torch.ones_like(margin), input_tokens,
        policy.chosen_tokens + policy.rejected_tokens, torch.zeros_like(margin),
    ], dim=1).double()
    sums[0] += per_pair.sum(0)
    sums[0, -1] += config.data.max_tokens_per_microbatch  # capacity of a micro-batch holding pairs
    sums.index_add_(0, 1 + batch["pair_source"].long(), per_pair)


def _metrics(sums: torch.Tensor, sources: list[str], grad_norm: float, lr: float, step: int, seconds: float) -> dict:
    s = dict(zip(_SUMS, sums[0].tolist()))
    pairs = max(s["pairs"], 1.0)
    return {
        "step": step, "loss": s["loss"] / pairs, "rewards/chosen": s["chosen_reward"] / pairs,
        "rewards/rejected": s["rejected_reward"] / pairs, "rewards/accuracies": s["correct"] / pairs,
        "rewards/margins": s["margin"] / pairs, "logps/chosen": s["chosen_logp"] / pairs,
        "logps/rejected": s["rejected_logp"] / pairs, "grad_norm": grad_norm, "lr": lr, "pairs": int(s["pairs"]),
        "input_tokens": int(s["input_tokens"]), "supervised_tokens": int(s["supervised_tokens"]),
        "packing_efficiency": s["input_tokens"] / s["capacity"] if s["capacity"] else 0.0,
        "pairs/s": s["pairs"] / seconds, "tokens/s": s["input_tokens"] / seconds,
        "sources": {name: _source_metrics(dict(zip(_SUMS, row)))
                    for name, row in zip(sources, sums[1:].tolist()) if row[_SUMS.index("pairs")]},
    }


def _source_metrics(s: dict) -> dict:
    """Per-source metrics: a pair counts once, in its own source."""
    return {"pairs": int(s["pairs"]), "loss": s["loss"] / s["pairs"], "accuracy": s["correct"] / s["pairs"],
            "margin": s["margin"] / s["pairs"], "input_tokens": int(s["input_tokens"]),
            "supervised_tokens": int(s["supervised_tokens"])}


def _init_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _wrap(policy, strategy: str, world: int):
    if world == 1:
        return policy
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(policy)
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(getattr(policy, "model", policy), "layers", []):
        fully_shard(layer)
    fully_shard(policy)
    return policy


def _no_sync(model, strategy: str, world: int, sync: bool):
    """Gradient accumulation without a gradient sync on every micro-batch."""
    if world == 1 or sync:
        if world > 1 and strategy == "fsdp":
            model.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if strategy == "ddp":
        return model.no_sync()
    model.set_requires_gradient_sync(False)
    return contextlib.nullcontext()


def _schedule(config: TrainConfig):
    warmup, total, kind = config.optim.warmup_steps, config.train.max_steps, config.optim.scheduler

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[kind]

    return factor


def _paths(config: TrainConfig) -> list[str]:
    return [config.data.path] if isinstance(config.data.path, str) else list(config.data.path)


def _loader_config(config: TrainConfig, rank: int, world: int) -> LoaderConfig:
    d = config.data
    return LoaderConfig(batching=d.batching, pairs_per_step=d.pairs_per_step, max_tokens_per_microbatch=d.max_tokens_per_microbatch,
                        microbatches_per_step=d.microbatches_per_step, world_size=world, rank=rank,
                        num_workers=d.num_workers, seed=d.seed, weights=tuple(d.weights) if d.weights else None)


def _export(policy, config: TrainConfig, out: Path, rank: int, world: int) -> None:
    """Save the final policy as a plain HF directory (rank 0), gathering FSDP shards first."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        policy.save_pretrained(out / "final", state_dict=state)
        tokenizer_dir = config.model.tokenizer or config.model.path
        if tokenizer_dir:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out / "final")
    if world > 1:
        dist.barrier()
