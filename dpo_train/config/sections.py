"""The config's sections: one frozen dataclass per YAML section (`data` takes its loader keys from
`LoaderConfig`), and `TrainConfig`, the whole."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dpo_data.loading.config import BATCHING_MODES, LAYOUTS, MAX_WORKERS, LoaderConfig
from dpo_train.keys import INT64_MAX, WEIGHTS, key
from dpo_train.step.early_stopping import LOWER_IS_BETTER, RENAMED
from dpo_train.step.loss import LOSSES, LossConfig
from dpo_train.step.optim import SCHEDULES

CONFIG_SCHEMA = "train-config"
CONFIG_FORMAT_VERSION = 1

ATTENTIONS = ("auto", "segments", "flex", "varlen", "sdpa", "eager", "flash_attention_2", "unpacked")
"""model.attention's choices (ModelConfig.attention says what each is)."""
SEED = {"type": "integer", "minimum": 0, "maximum": INT64_MAX}
"""A seed's schema: 64 bits, as torch and numpy take them."""
LORA = {
    "r": {"type": "integer", "minimum": 1, "maximum": 65536, "description": "adapter rank"},
    "alpha": {
        "type": "number",
        "exclusiveMinimum": 0,
        "maximum": 1000000,
        "description": "updates are scaled by alpha / r",
    },
    "dropout": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
    "target_modules": {
        "oneOf": [
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            {"const": "all-linear"},
        ]
    },
}
"""model.lora's keys (a mapping handed to PEFT, not a section of its own)."""


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None
    """A local Hugging Face causal LM directory."""
    init: dict | None = key(
        None,
        additionalProperties=False,
        required=["config"],
        properties={"config": {"type": ["string", "object"]}, "seed": SEED},
    )
    """Random initialization instead of `path`: {config: FILE_OR_MAPPING, seed: 0} (for tests)."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to `path`."""
    attention: str = key("auto", enum=ATTENTIONS)
    """auto (flash_attention_2 on CUDA in bf16 when flash-attn is installed, the layout is separate and the
    model needs no chunked attention or sinks, else segments) | segments (attention once per packed
    segment, no row-by-row mask; every window, chunk, softcap and sink applied) | flex (FlexAttention: the row in
    one kernel call per layer, one block mask per layer kind; everything segments applies; compiled, on CUDA and
    the CPU; never auto's choice) | varlen (torch's variable-length FlashAttention over the row's segments, one
    call per layer; CUDA in bf16 or fp16, separate layout; windows, no chunks, softcaps or sinks) | sdpa (transformers'
    sdpa over the row with a mask per layer kind; no softcap, no sinks) | eager (the model's own
    attention with the same masks) | flash_attention_2 | unpacked (no packing: each sequence alone in a
    right-padded batch through the model's own sdpa or eager attention; exact for every model, it costs the
    padding; auto picks it, saying so, for a model with convolution, linear-attention or Mamba layers, or
    ALiBi). A path that cannot express the model's attention is refused by name (docs/train-config.md,
    "Supported architectures")."""
    lora: dict | None = key(
        None,
        additionalProperties=False,
        required=["r"],
        description="LoRA adapters through PEFT; null: full fine-tuning",
        properties=LORA,
    )
    """LoRA adapters through PEFT: {r: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, v_proj]}
    (alpha defaults to 2 r, dropout to 0, target_modules to all-linear). Only the adapters train; the
    live reference is the same model with its adapters disabled. null: full fine-tuning. On a vision-language
    model the adapters go on its language model only."""
    train_vision_tower: bool = key(
        False, description="vision-language models: false keeps the vision tower frozen; true trains it (not with lora)"
    )
    """Vision-language models (docs/vision.md): false keeps the vision tower (its image encoder) frozen, as it
    was loaded; true trains it with the language model (full fine-tuning only: not with model.lora)."""

    @property
    def processor(self) -> str | None:
        """Where a vision dataset's images are prepared from (the processor its manifest attests, and the model's
        config): `tokenizer` when given, else `path` (docs/vision.md)."""
        return self.tokenizer or self.path


@dataclass(frozen=True)
class ReferenceConfig:
    mode: str = key("live", enum=("live", "precomputed", "none"))
    """live (a frozen copy) | precomputed (a sidecar of reference log-probs) | none (reference-free losses)."""
    path: str | None = None
    """precomputed: the sidecar directory."""
    sync_ref_model: bool = key(
        False, description="TR-DPO (TRL's): the live reference moves toward the policy; docs/objective.md"
    )
    """TR-DPO (TRL's): after every `ref_model_sync_steps`-th optimizer step the live reference moves toward the
    policy, ref = (1 - ref_model_mixup_alpha) ref + ref_model_mixup_alpha policy. Needs reference.mode live,
    a loss that reads a reference, and full fine-tuning (no model.lora)."""
    ref_model_mixup_alpha: float = key(0.6, minimum=0, maximum=1, description="TR-DPO: the policy's share in each move")
    """TR-DPO: the policy's share in each move, in [0, 1] (TRL's default)."""
    ref_model_sync_steps: int = key(
        512, minimum=1, maximum=1_000_000_000, description="TR-DPO: optimizer steps between moves"
    )
    """TR-DPO: move after every this many optimizer steps, counted from 1 (TRL's default)."""


LOADER_KEYS = (
    "batching",
    "pairs_per_step",
    "max_tokens_per_microbatch",
    "microbatches_per_step",
    "num_workers",
    "seed",
    "weights",
    "layout",
)
"""The `data` keys that configure the loader: their types, defaults and docs are `LoaderConfig`'s own."""


_LOADER = LoaderConfig()
"""LoaderConfig's defaults: `DataConfig` takes its loader keys' defaults from here, never writing one twice."""


@dataclass(frozen=True)
class DataConfig:
    """The `data:` section: dataset directories, how their shards are checked before use, and the loader's
    keys (`LOADER_KEYS`, documented on `LoaderConfig`; tests/train/config/test_config.py checks the two agree)."""

    path: str | list[str] = key(
        "", oneOf=[{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]
    )
    """A dataset directory written by `dpo-data build`, or a list of them (a mixture, with `weights`)."""
    verify: str = key("full", enum=("full", "size"))
    """full (size and sha256 of every shard, the default) | size."""
    batching: str = key(_LOADER.batching, enum=BATCHING_MODES)
    # null is LoaderConfig's own (its tokens batching built in code); a config always gives a number
    pairs_per_step: int | None = key(_LOADER.pairs_per_step, type="integer", minimum=1, maximum=1_000_000)
    max_tokens_per_microbatch: int = key(_LOADER.max_tokens_per_microbatch, minimum=1, maximum=100_000_000)
    microbatches_per_step: int = key(_LOADER.microbatches_per_step, minimum=1, maximum=1_000_000)
    num_workers: int = key(_LOADER.num_workers, minimum=0, maximum=MAX_WORKERS)
    seed: int = key(_LOADER.seed, minimum=0, maximum=INT64_MAX)
    weights: list[float] | None = key(None, **WEIGHTS)
    layout: str = key(_LOADER.layout, enum=LAYOUTS)

    @property
    def paths(self) -> list[str]:
        """`path` as a list of dataset directories (one, or a mixture)."""
        return [self.path] if isinstance(self.path, str) else list(self.path)

    def loader_config(self, rank: int, world_size: int) -> LoaderConfig:
        """The loader config of one rank: these `data` keys plus where the rank sits."""
        values = {key: getattr(self, key) for key in LOADER_KEYS}
        values["weights"] = tuple(self.weights) if self.weights else None
        return LoaderConfig(**values, rank=rank, world_size=world_size)


@dataclass(frozen=True)
class OptimConfig:
    name: str = key("adamw", enum=("adamw", "sgd"))
    """adamw | sgd (plain SGD: its parameters follow the gradient linearly, which the invariance tests use)."""
    lr: float = key(1.0e-5, exclusiveMinimum=0, maximum=100)
    betas: list[float] = key(
        factory=lambda: [0.9, 0.999],
        items={"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        minItems=2,
        maxItems=2,
    )
    """adamw: the moment decay rates."""
    eps: float = key(1.0e-8, minimum=1e-30, maximum=1)
    """adamw: added to the root of the second moment."""
    weight_decay: float = key(0.0, minimum=0, maximum=10)
    max_grad_norm: float = key(1.0, minimum=0, maximum=1_000_000_000_000, description="0: no clipping")
    scheduler: str = key("constant", enum=tuple(SCHEDULES))
    """constant | linear | cosine."""
    warmup_steps: int = key(0, minimum=0, maximum=1_000_000_000)
    warmup_ratio: float | None = key(
        None,
        minimum=0,
        maximum=1,
        description="warm-up as a share of the run's steps: ceil(ratio x train.max_steps)",
    )
    """Warm-up as a share of the run's steps, as TRL's `warmup_ratio`: ceil(ratio x train.max_steps) steps, the
    total known once the loader has planned the epochs (`max_steps: null`); null: `warmup_steps`. Setting
    both is refused."""

    def warmup_for(self, total_steps: int | None) -> int:
        """The warm-up steps of a run of `total_steps` optimizer steps (transformers' rounding: up)."""
        if self.warmup_ratio is None or total_steps is None:
            return self.warmup_steps
        return math.ceil(total_steps * self.warmup_ratio)


@dataclass(frozen=True)
class TrainSection:
    output_dir: str = "runs/train"
    max_steps: int | None = key(10, minimum=1, maximum=1_000_000_000)
    """Optimizer steps to train; wins over `epochs` when set (as TRL's). null: train `epochs` whole epochs."""
    epochs: int = key(1, minimum=1, maximum=1_000_000)
    """Epochs of the data when `max_steps` is null; with `max_steps` set, the run goes past them (and says so)."""
    save_every: int = key(0, minimum=0, maximum=1_000_000_000)
    keep_last: int = key(3, minimum=1, maximum=1_000_000)
    log_every: int = key(1, minimum=1, maximum=1_000_000_000)
    seed: int = key(0, minimum=0, maximum=INT64_MAX)
    resume: str = key("auto", minLength=1)
    """auto (the newest committed checkpoint that verifies, else a fresh start) | never | PATH of a checkpoint."""
    resume_strict: bool = False
    """auto: fail on a committed checkpoint that does not verify, instead of reporting and skipping it."""
    read_back: bool = True
    """Read back what the run writes before it counts: this process's first checkpoint (every rank loads its share
    again and compares it bit for bit with the model, optimizer, loader and generator states it saved, before the
    commit) and the export (final/ loaded as a user loads it, bit for bit against the weights it was written
    from, before it is moved into place). A difference stops the run (exit 1) with nothing committed or exported
    (docs/checkpoints.md, "Read back")."""
    weights_from: str | None = None
    """Start a new run from a checkpoint's model weights alone (they also become the reference)."""
    precision: str = key("auto", enum=("auto", "fp32", "bf16"))
    """auto (bf16 autocast where the device supports it, fp32 on CPU) | fp32 | bf16."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward: less memory, about a third more compute."""
    logits_budget_mib: int | None = key(1024, minimum=1, maximum=1_048_576)
    """The memory the vocabulary head's logits may take in one forward and backward: past it, the head runs in
    chunks of scored positions, each chunk's logits recomputed in backward (dpo_train/logps/head.py); within
    it, the model's own head, unchanged. 1024 by default (docs/benchmarks.md, long pairs: never slower than the
    whole head on SmolLM2, 3 GiB lighter at 2k tokens); null: always the model's own head."""
    compiled_head: bool | str = key("auto", enum=("auto", True, False))
    """The chunked head's per-chunk arithmetic compiled by torch.compile: auto (on CUDA; eager on the CPU, where
    inductor's C++ build costs more than it saves) | true (any device) | false. Each process checks the compiled
    form's first chunk against the eager one and keeps the eager one, with a note, if it fails to build or
    differs (dpo_train/logps/compiled.py)."""
    mlp_tile_tokens: int | str | None = key("auto", minimum=1, maximum=1_048_576, pattern="^auto$")
    """Run each decoder layer's MLP over tiles of this many positions, each tile recomputed in backward, so that a
    long row holds one tile's MLP intermediates instead of the whole row's (dpo_train/logps/tiled_mlp.py). The
    same numbers (a start-up check refuses an MLP that mixes positions); with activation checkpointing no more
    compute where the MLP ends its layer, else one more MLP forward per step; a mixture of experts stays whole.
    auto (default): 4096 under activation checkpointing on the MLPs a start-up count finds free, else whole;
    null: whole. For long pairs (docs/train-config.md, "Long pairs")."""
    check_microbatches: bool = True
    """Check every micro-batch against the contract (docs/loader.md) before its forward: any loader may
    feed the trainer, and a malformed micro-batch would otherwise train on the wrong tokens silently."""
    probe_packing: bool = True
    """Before step 1, score a packed row of synthetic pairs and the same sequences unpacked through the
    model's eager attention; refuse the run (exit 2) if any pair differs by more than 1e-5 relative
    (docs/train-config.md, "Supported architectures"). A few ms on a tiny model, about three forwards of
    48 tokens on a large one, on CPU before the model moves to its device."""
    parity_guard: bool = True
    """During step 1, while the policy is still the reference (a live reference, LoRA adapters at zero), every
    micro-batch's per-pair log-probs from the policy's training forward must equal the reference's, which
    scores the same pairs packed in another order; a difference stops the run (exit 2) before the optimizer
    steps (docs/train-config.md, "Step 1's parity guard"). It costs nothing: both are computed anyway. The
    same switch checks, at a process's first step, that torch's clip_grad_norm_ returns the gradients' own norm
    (summed apart over every rank's part), and stops the run (exit 2) where it does not."""
    alone_check: bool = True
    """At step 1, every micro-batch's pairs are scored again one sequence at a time, unpacked
    and unpadded, through the model as loaded (evaluation mode, its config values as loaded, transformers' eager
    attention); each pair's packed log-probs must equal those, or the run stops (exit 2) before the optimizer
    steps, naming the pair, both values and a fix checked on that micro-batch (docs/train-config.md, "Step 1's
    alone check"). It sees what policy and reference share (a length-dependent rope, a config value the run
    changed), which the parity guard cannot. Costs about one more reference forward of the first step's pairs.
    Also checks the first micro-batches of --precompute-reference."""
    on_nonfinite: str = key("stop", enum=("stop", "skip_step"))
    """A step whose loss, log-probs or gradient norm is NaN or infinite on any rank: stop (every rank exits 1
    before the optimizer step; nothing is committed or exported) | skip_step (log it, count it, and leave
    the optimizer and scheduler as they were)."""
    export: str = key("adapter", enum=("adapter", "merged", "both"))
    """With model.lora, what OUTPUT/final/ holds: adapter (a PEFT adapter directory) | merged (a plain HF
    model with the adapters merged in) | both (the adapter in final/, the merged model in final-merged/).
    Without model.lora, final/ is always the whole model."""
    export_dtype: str = key("model", enum=("fp32", "bf16", "model"))
    """The dtype of the exported weights: model (the model's own dtype as loaded: its config's dtype,
    fp32 without one) | fp32 | bf16; a tensor from_pretrained keeps in fp32 at that dtype (a MoE router) stays
    fp32. Training keeps fp32 master weights whatever this says."""
    report_to: list = key(factory=list, items={"enum": ["tensorboard", "wandb"]}, uniqueItems=True)
    """Where the step metrics also go, besides OUTPUT/metrics.jsonl, written by rank 0: tensorboard (event
    files under OUTPUT/tensorboard/; needs the `report` extra) and/or wandb (a W&B run, set up by the WANDB_*
    environment variables; needs the `wandb` extra)."""


@dataclass(frozen=True)
class DistributedConfig:
    strategy: str = key("fsdp", enum=("fsdp", "ddp"))
    """fsdp (FSDP2 fully_shard) | ddp."""
    device: str = key("auto", enum=("auto", "cpu", "cuda", "npu"))
    """auto (cuda, else npu through torch-npu when installed, else cpu) | cpu | cuda | npu."""
    sequence_parallel: dict | None = key(
        None,
        additionalProperties=False,
        properties={
            "ulysses": {"type": "integer", "minimum": 1, "maximum": 65536},
            "context": {"type": "integer", "minimum": 1, "maximum": 65536},
        },
    )
    """Split each packed row over ulysses x context ranks: {ulysses: U, context: C} (each defaults to 1).
    The world is dp x C x U; each group of U x C ranks shares one row, pairs stay whole (docs/objective.md)."""

    @property
    def sequence_sizes(self) -> tuple[int, int]:
        """(ulysses, context)."""
        sp = self.sequence_parallel or {}
        return int(sp.get("ulysses", 1)), int(sp.get("context", 1))


@dataclass(frozen=True)
class EvalConfig:
    path: str | None = None
    """A built held-out dataset: preference accuracy before training and after (OUTPUT/eval.jsonl)."""
    every: int = key(0, minimum=0, maximum=1_000_000_000)
    """Also evaluate every N optimizer steps (0: only before and after)."""
    early_stopping_metric: str | None = key(
        None,
        enum=(None, *LOWER_IS_BETTER, *RENAMED),
        description="margin: an earlier release's name, refused by the rules with what it became",
    )
    """Stop the run when this eval.jsonl metric (loss, nll, accuracy, rewards/margins, logratio_margin,
    logp_accuracy) has not improved for `early_stopping_patience` evaluations (dpo_train/step/early_stopping.py);
    null: never. `margin`, an earlier release's name, is refused with what it became."""
    early_stopping_patience: int = key(3, minimum=1, maximum=1_000_000_000)
    """Evaluations in a row without a gain that end the run (HF's `early_stopping_patience`)."""
    early_stopping_threshold: float = key(0.0, minimum=0, maximum=1_000_000)
    """A gain is more than this (HF's `early_stopping_threshold`), in the metric's units."""


LOSS_TYPES = {"enum": list(LOSSES), "description": "the names of LOSSES in dpo_train/step/loss.py; docs/objective.md"}
"""loss.type's names (the schema's $defs/loss_type)."""

SECTIONS = {
    "model": ModelConfig,
    "reference": ReferenceConfig,
    "data": DataConfig,
    "loss": LossConfig,
    "optim": OptimConfig,
    "train": TrainSection,
    "distributed": DistributedConfig,
    "eval": EvalConfig,
}


@dataclass(frozen=True)
class TrainConfig:
    """The whole config, one typed section per top-level key."""

    model: ModelConfig = field(default_factory=ModelConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainSection = field(default_factory=TrainSection)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def resolved(self) -> dict[str, Any]:
        """Every setting, defaults included: what is written to OUTPUT/config.resolved.yaml."""
        return {"format_version": CONFIG_FORMAT_VERSION, **{name: asdict(getattr(self, name)) for name in SECTIONS}}
