"""TRL 1.16 `DPOTrainer` set up as the peer of `dpo-train` in the training benchmarks: same pairs, order and ids."""

from __future__ import annotations

from pathlib import Path

PAIRS_PER_STEP = 8
HYPER = {"beta": 0.1, "lr": 1.0e-5}  # both trainers: sigmoid loss, AdamW at a constant lr, clipping at 1.0


def trl_trainer(
    model: str,
    pairs: list,
    work: Path,
    micro: int,
    steps: int,
    precomputed: bool,
    pairs_per_step: int = PAIRS_PER_STEP,
    device: str = "cpu",
    speed: dict | None = None,
):
    """A `DPOTrainer` on `pairs` (records with `prompt`, `chosen`, `rejected` id arrays) in this order, through
    a sequential sampler: `micro` pairs per micro-batch, `pairs_per_step` per optimizer step, fp32 on `device`, no
    warm-up, weight decay or truncation (`max_length=None`: TRL's default 1024 would cut long pairs, other
    work). With `precomputed`, TRL's own reference pass runs here, so callers do not time it. `speed`: the
    settings a throughput run varies (`peer_args`'s bf16, padding_free, gradient_checkpointing, and
    `attn_implementation` of the policy, which TRL's reference copies); none: TRL's defaults, fp32."""
    import datasets
    import torch
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOTrainer

    rows = [
        {"prompt_ids": p.prompt.tolist(), "chosen_ids": p.chosen.tolist(), "rejected_ids": p.rejected.tolist()}
        for p in pairs
    ]
    ids = datasets.Dataset.from_list(rows)
    speed = dict(speed or {})
    attention = {"attn_implementation": speed.pop("attn_implementation")} if "attn_implementation" in speed else {}
    args = peer_args(work / "trl", micro, pairs_per_step // micro, steps, device, **speed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **attention)
    trainer = DPOTrainer(
        model=policy,
        args=args,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}]),
    )
    trainer._get_train_sampler = lambda *a, **k: SequentialSampler(trainer.train_dataset)
    if precomputed:
        trainer.precompute_ref_logps = True
        ids = trainer._precompute_ref_logps(ids, "train", micro)
    trainer.train_dataset = ids
    return trainer


def peer_args(out: Path, micro: int, accumulation: int, steps: int, device: str = "cpu", bf16: bool = False, **speed):
    """TRL's `DPOConfig` as the peer runs it: HYPER's sigmoid loss, AdamW at a constant lr, clipping at 1.0, fp32
    (`bf16`: its bf16 autocast) on `device` (`cpu`, or `cuda`: accelerate's default device), no warm-up, weight
    decay, truncation (`max_length=None`), saving, workers or progress bar; `speed`: more DPOConfig fields
    (padding_free, gradient_checkpointing)."""
    from trl import DPOConfig

    return DPOConfig(
        output_dir=str(out),
        report_to=[],
        use_cpu=device == "cpu",
        bf16=bf16,
        seed=0,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        learning_rate=HYPER["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=HYPER["beta"],
        loss_type=["sigmoid"],
        max_length=None,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        **speed,
    )


def train_timed(trainer) -> tuple[list[float], list[dict]]:
    """Train `trainer`; the wall-clock time at each optimizer step's end, and its logged steps (the summary
    entry left out)."""
    import time

    from transformers import TrainerCallback

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    trainer.add_callback(Clock())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    return stamps, logs
