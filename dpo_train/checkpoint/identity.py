"""The run identity recorded in every checkpoint: what a resuming run must share with it, part by part."""

from __future__ import annotations

from typing import Any

import torch

from dpo_state.state import normalized
from dpo_train.checkpoint.parts import RunView
from dpo_train.config.sections import TrainConfig
from dpo_train.model.lora import lora_settings
from dpo_train.reference.choice import reference_mode
from dpo_train.step.loss import LossConfig

_GROUP_KEYS = ("betas", "eps", "weight_decay", "amsgrad", "maximize", "momentum", "dampening", "nesterov", "initial_lr")


_LATER_LOSS_KEYS = (
    "weights",
    "discopop_tau",
    "f_divergence_type",
    "f_alpha_divergence_coef",
    "alpha",
    "ld_alpha",
    "use_weighting",
)
"""Loss keys added after checkpoints recorded the objective: each is recorded only when it is not its default,
so that the identity of a run that leaves them alone is what it was before they existed."""


def _objective(config: TrainConfig, router_aux_coef: float) -> dict:
    """The loss settings, with the router coefficient as resolved from the model (and only when it is
    on, so that a dense model's identity is what it was before the coefficient existed), and the later
    keys only where they are set."""
    loss, default = config.loss, LossConfig()
    settings = {k: v for k, v in vars(loss).items() if k not in ("type", "router_aux_coef", *_LATER_LOSS_KEYS)}
    settings.update({k: getattr(loss, k) for k in _LATER_LOSS_KEYS if getattr(loss, k) != getattr(default, k)})
    if router_aux_coef:
        settings["router_aux_coef"] = router_aux_coef
    return {"type": loss.type, **settings}


_SYNC_KEYS = ("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")
"""TR-DPO's keys, added after checkpoints recorded the reference: recorded only when sync_ref_model is on, so
that a run without it has the identity it had before they existed."""


def _reference(config: TrainConfig, weights: str, sidecar_sha256: str | None) -> dict:
    """The reference's mode and weights (the initial policy's), and TR-DPO's settings when it moves."""
    settings = {"mode": reference_mode(config), "weights_fingerprint": weights, "sidecar_table": sidecar_sha256}
    if config.reference.sync_ref_model:
        settings.update({k: getattr(config.reference, k) for k in _SYNC_KEYS})
    return settings


def run_identity(
    run: RunView,
    policy: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    reference: tuple[str, str | None],
    router_aux_coef: float = 0.0,
    mlp_tile: int | None = None,
) -> dict:
    """The parts `dpo_state.state.identity_mismatches` compares: dataset, tokenizer, reference,
    objective, optimizer (its trainable parameters), model (LoRA settings), scheduler and layout
    (whose ELASTIC_KEYS may change in pairs batching). `reference`: the initial policy's weights fingerprint
    and the precomputed table's sha256 (None for a live reference). `mlp_tile`: the tile the policy's MLPs run
    with (`train.mlp_tile_tokens` resolved; None: whole)."""
    config, store, place, geometry = run.config, run.data, run.place, run.geometry
    weights, sidecar_sha256 = reference
    return normalized(
        {
            "dataset": {
                "fingerprint": store.fingerprint,
                "datasets": store.dataset_fingerprints,
                "num_pairs": store.num_pairs,
            },
            "tokenizer": {"fingerprint": store.tokenizer_fingerprint, "attestation": store.tokenizer_attestation},
            "reference": _reference(config, weights, sidecar_sha256),
            "objective": _objective(config, router_aux_coef),
            "optimizer": {
                "class": type(optimizer).__name__,
                "hyperparameters": [{k: g[k] for k in _GROUP_KEYS if k in g} for g in optimizer.param_groups],
                "parameters": [[name, list(p.shape)] for name, p in policy.named_parameters() if p.requires_grad],
            },
            "model": {"lora": lora_settings(config.model.lora) if config.model.lora else None},
            "scheduler": {
                "class": type(scheduler).__name__,
                "kind": config.optim.scheduler,
                "warmup_steps": config.optim.warmup_for(config.train.max_steps),
                "max_steps": config.train.max_steps if config.optim.scheduler != "constant" else None,
            },
            "layout": {
                "world_size": geometry.world_size,
                "strategy": config.distributed.strategy,
                "sequence_parallel": dict(zip(("ulysses", "context"), config.distributed.sequence_sizes)),
                "batching": geometry.batching,
                "layout": geometry.layout,  # separate | shared_prompt: how a pair is packed and attended
                "pairs_per_step": geometry.pairs_per_step,
                "max_tokens_per_microbatch": geometry.max_tokens_per_microbatch,
                "microbatches_per_step": geometry.microbatches_per_step,
                "num_workers": geometry.num_workers,
                "data_seed": geometry.seed,
                "weights": list(geometry.weights) if geometry.weights else None,
                "precision": place.precision,
                "device": place.device.type,  # cpu, cuda or npu: its generators and kernels are not another's
                "train_seed": config.train.seed,
                # recorded only when set, so that a run without it has the identity it had before it existed
                **({"logits_budget_mib": budget} if (budget := config.train.logits_budget_mib) is not None else {}),
                **({"mlp_tile_tokens": mlp_tile} if mlp_tile is not None else {}),
            },
        }
    )
