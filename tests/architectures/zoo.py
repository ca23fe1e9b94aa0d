"""The architecture zoo: tiny random configs of transformers' model classes, packed rows, the eager unpacked truth."""

from __future__ import annotations

import numpy as np
import torch

from dpo_data.dataset.store import PairIds
from tests.docs_blocks import markdown_table

WINDOW = 8  # smaller than the segments below, so every window and chunk hides keys
BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.3 * i for i in range(8)],
    "original_max_position_embeddings": 20,
}
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
ZOO = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
    "qwen3": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": dict(sliding_window=WINDOW, **MOE),
    "gemma": {},
    "gemma2": dict(
        sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0
    ),
    "gemma3_text": dict(sliding_window=WINDOW, query_pre_attn_scalar=24, sliding_window_pattern=2),
    "gpt_oss": dict(sliding_window=WINDOW, **MOE),
    "phi3": dict(sliding_window=WINDOW),
    "ministral": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "olmo3": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "starcoder2": dict(sliding_window=WINDOW),
    "exaone4": dict(sliding_window=WINDOW, sliding_window_pattern=2),
    "olmo2": {},
    "cohere2": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(attention_multiplier=0.3, logits_scaling=2.0),
    "llama4_text": dict(  # floor_scale 8192 in the real model: segments far past it in a row
        attention_chunk_size=WINDOW,
        no_rope_layers=[1, 0],
        num_local_experts=2,
        intermediate_size_mlp=128,
        attn_temperature_tuning=True,
        floor_scale=WINDOW,
        attn_scale=1.0,  # 0.1 in the real model: a stronger scale, so a wrong one shows in a random model
    ),
    "deepseek_v3": dict(
        head_dim=8,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
    ),
    "seed_oss": dict(attention_bias=True),  # residual_dropout 0.1 by default, by F.dropout (test_parity_guard)
    "apertus": dict(hidden_act="xielu"),  # 0-dim buffers (the activation's beta and eps)
    "glm4_moe": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        use_qk_norm=True,
    ),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, clip_qkv=1.0),
    "dots1": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        sliding_window=WINDOW,
        max_window_layers=1,
    ),
    "ernie4_5_moe": dict(
        moe_num_experts=4, moe_k=2, moe_num_shared_experts=1, moe_intermediate_size=32, moe_layer_start_index=1
    ),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, use_qk_norm=True),
    "gemma3n_text": dict(  # KV sharing across layers, AltUp, LAuReL, per-layer inputs, activation sparsity
        num_hidden_layers=4,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=97,
        laurel_rank=8,
        altup_num_inputs=2,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
    ),
    "exaone_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        num_shared_experts=1,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
    ),
    "ministral3": dict(  # Llama 4's query scaling from position_ids, past an original length of 8
        sliding_window=WINDOW,
        rope_parameters={
            "type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": WINDOW,
            "max_position_embeddings": 256,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale_all_dim": 1.0,
            "mscale": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    ),
    # config mutations: a window between the segments' and the row's length, a softcap key on a model whose
    # attention ignores it (so sdpa must not be refused for it), head_dim other than hidden / heads
    "mistral_w20": dict(model_type="mistral", sliding_window=20),
    "llama_softcap": dict(model_type="llama", attn_logit_softcapping=5.0),
    "llama_hd32": dict(model_type="llama", head_dim=32),
    # length-dependent rope: the frequencies follow the sequence's length; the zoo's sequences are 4 to 24
    # tokens, so a threshold of 20 puts one sequence past it beside shorter ones in the row (Phi-3-mini-128k,
    # Phi-3.5-mini and Phi-4-mini switch at 4096), a threshold of 200 none
    "phi3_longrope": dict(model_type="phi3", original_max_position_embeddings=20, rope_parameters=LONGROPE),
    "phi3_longrope_under": dict(
        model_type="phi3",
        original_max_position_embeddings=200,
        rope_parameters={**LONGROPE, "original_max_position_embeddings": 200},
    ),
    "llama_dynamic": dict(model_type="llama", max_position_embeddings=20, rope_parameters=DYNAMIC),
    "llama_dynamic_under": dict(model_type="llama", rope_parameters=DYNAMIC),
    # Phi-3.5-MoE: sparsemixer routing, whose router_jitter_noise (0.01) is a threshold in evaluation too
    "phimoe": dict(**MOE, input_jitter_noise=0.01),
    # layers that pass no keyword arguments to their attention (no segments): auto falls back to sdpa
    "stablelm": {},
    "nemotron": {},
    # outside transformers' attention registry (its own local / global attention): auto falls back
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2, num_heads=4, window_size=WINDOW),
    # more of transformers' decoders, as a user brings them: partial rotary, parallel blocks, learned
    # positions, multi-query heads, QK norms, shared experts
    "gpt_neox": dict(rotary_pct=0.5),
    "gptj": dict(rotary_dim=8, n_embd=64, n_layer=2, n_head=4),
    "codegen": dict(rotary_dim=8, n_embd=64, n_layer=2, n_head=4),
    "persimmon": {},
    "phi": {},
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, multi_query=True),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "cohere": {},
    "arcee": {},
    "smollm3": {},
    "helium": {},
    "olmo": {},
    "glm": {},
    "ernie4_5": {},
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=16),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        sliding_window=WINDOW,
        use_sliding_window=True,
        max_window_layers=1,
    ),
    # RWKV: recurrent, and no layer_types says so; only the probe sees that packing leaks
    "rwkv": dict(attention_hidden_size=64, context_length=256),
    "minimax": dict(  # lightning (linear) attention layers beside full ones, experts with router noise
        num_local_experts=4, num_experts_per_tok=2, block_size=8, layer_types=["full_attention", "linear_attention"]
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    # Mamba-style hybrids: one Mamba layer, one attention layer (the torch paths: no CUDA kernels on CPU)
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=8,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    ),
    "bamba": dict(attn_layer_indices=[1], **MAMBA2),
    "falcon_h1": dict(mamba_d_ssm=128, **MAMBA2),  # every layer runs attention and Mamba side by side
    "zamba2": dict(
        num_hidden_layers=4,
        layer_types=["mamba", "hybrid", "mamba", "hybrid"],  # hybrid: Mamba plus the shared attention block
        hybrid_layer_ids=[1, 3],
        mamba_d_state=8,
        mamba_headdim=16,
        n_mamba_heads=8,
        chunk_size=16,
        use_mamba_kernels=False,
    ),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1, **MAMBA2),
    "nemotron_h": dict(
        hybrid_override_pattern="M*", mamba_num_heads=8, mamba_head_dim=16, n_groups=1, ssm_state_size=8, chunk_size=16
    ),
    # ALiBi: the bias comes from the attention mask's running count, not from position_ids
    "falcon": dict(alibi=True, new_decoder_architecture=False, multi_query=False),
    "bloom": {},
    "mpt": dict(attn_config=dict(alibi=True)),
}
"""model_type -> what makes it itself: windows, chunks, softcaps, sinks (GPT-OSS has them by design),
scalings, experts, MLA, convolutions, linear attention."""

UNPACKED = {
    "lfm2": "'conv' layer",
    "qwen3_next": "'linear_attention' layer",
    "minimax": "'linear_attention' layer",
    "jamba": "'linear_attention' layer",  # transformers calls Jamba's Mamba layers so
    "bamba": "'linear_attention' layer",
    "falcon_h1": "'hybrid' layer",
    "zamba2": "'linear_attention' layer",
    "granitemoehybrid": "'linear_attention' layer",
    "nemotron_h": "'linear_attention' layer",
    "falcon": "ALiBi",
    "bloom": "ALiBi",
    "mpt": "ALiBi",
}
"""model_type -> why packing cannot serve it: auto runs it unpacked, the packed paths refuse it naming this,
and so does sequence parallelism."""
SHARED_PROMPT_UNPACKED = {
    "phi3_longrope": "depends on each sequence's length",
    "phi3_longrope_under": "depends on each sequence's length",
    "llama_dynamic": "depends on each sequence's length",
    "llama_dynamic_under": "depends on each sequence's length",
}
"""model_type -> why the shared-prompt layout cannot pack it: auto runs it unpacked there, the packed paths
refuse it."""
AUTO_FALLBACK = {
    "stablelm": ("sdpa", "its layers pass no keywords to their attention", "without its sequence shard"),
    "nemotron": ("sdpa", "its layers pass no keywords to their attention", "without its sequence shard"),
    "gpt_neo": ("unpacked", "outside transformers' attention registry", "trains unpacked"),
    "qwen2_moe": ("unpacked", "its sliding layers pass no window", "passed no sliding_window"),
    "rwkv": ("unpacked", "its recurrent state crosses segments", "packing would train on wrong numbers"),
}
"""model_type -> (the path auto takes after the start-up probe, why the segment path cannot run it, what the
sequence-parallel columns' refusal says: auto's fallback runs in one process's row)."""
REFUSED: dict[str, str] = {}
"""model_type -> the reason every path refuses it (none left: the unpacked path serves every model)."""
UNSET = {"falcon": ("head_dim", "num_key_value_heads")}
"""BASE keys a config class refuses (FalconConfig's head_dim is derived; its kv heads are num_kv_heads)."""
# (model_type, path) or (model_type, path, layout) -> the reason that path alone refuses it (in that layout)
PATH_REFUSED = {
    ("gemma2", "sdpa"): "transformers refuses it",
    ("gpt_oss", "sdpa"): "transformers refuses it",
    ("llama4_text", "sdpa"): "cannot express temperature tuning",  # transformers scales by row index
    ("llama4_text", "eager"): "cannot express temperature tuning",
    ("stablelm", "segments"): "without the row's segments",
    ("nemotron", "segments"): "without the row's segments",
    ("qwen2_moe", "segments"): "passed no sliding_window",
    ("gpt_neo", "segments"): "attention registry",
    ("gpt_neo", "sdpa"): "transformers refuses it",
    ("gpt_neo", "eager", "shared_prompt"): "packing would train on wrong numbers",  # its local attention's mask
    ("rwkv", "segments"): "packing would train on wrong numbers",
    ("rwkv", "sdpa"): "transformers refuses it",
    ("rwkv", "eager"): "packing would train on wrong numbers",
    ("gpt_bigcode", "ulysses"): "must divide the model's attention heads",  # one key/value head (multi-query)
}


def model_spec(name: str) -> dict:
    """`model.init.config` for dpo_train.config.sections.ModelConfig (a mutation's entry names its model_type)."""
    spec = {"model_type": name, **BASE, **ZOO[name]}
    return {k: v for k, v in spec.items() if k not in UNSET.get(name, ())}


def train_config(tmp_path, dataset, tokenizer_dir, model_type, model=None, **train):
    """A one-step DDP run's config file of zoo entry `model_type` (with `model` over its spec) on `dataset`, with
    SmolLM2's vocabulary so the real tokenizer's ids embed; `train` adds to the train section."""
    from tests.harness import write_yaml

    spec = {**model_spec(model_type), "vocab_size": 49152, **(model or {})}
    config = {
        "model": {"init": {"config": spec, "seed": 0}, "tokenizer": str(tokenizer_dir)},
        "data": {"path": str(dataset), "batching": "pairs", "pairs_per_step": 4},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "resume": "never", **train},
        "distributed": {"strategy": "ddp"},
    }
    return write_yaml(tmp_path / "config.yaml", config)


def pairs() -> list[PairIds]:
    """Three pairs whose prompts and completions are longer than WINDOW (and one short one), so
    windows and chunks cut inside a segment, and across the prompt of a shared-prompt completion."""
    rng = np.random.default_rng(0)
    ids = lambda k: rng.integers(3, 97, size=k).astype(np.int32)
    shapes = [(11, 13, 6), (3, 2, 1), (6, 10, 12)]
    return [PairIds(i, 0, ids(p), ids(c), ids(r)) for i, (p, c, r) in enumerate(shapes)]


def relative_error(out, truth: torch.Tensor) -> float:
    """The worst pair's relative error (per pair: a mean would hide one wrong pair)."""
    got = torch.stack([out.chosen, out.rejected], dim=1).double().detach().cpu()
    return float(((got - truth).abs() / truth.abs().clamp(min=1e-6)).max())


COLUMNS = ("auto", "segments", "sdpa", "eager", "unpacked", "ulysses 2", "context 2")


def features_of(model) -> str:
    """The attention features a model's layers need, in words, for the table."""
    from dpo_train.attention import rope
    from dpo_train.attention.features import model_attention, text_config
    from dpo_train.attention.unpacked import alibi

    config = text_config(model)
    found = list(model_attention(model).needs())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer = next((m for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "is_causal")), None)
    if layer is not None and abs(float(layer.scaling) - head_dim**-0.5) > 1e-9:
        found.append("scaling")
    if alibi(config):
        found.append("ALiBi")
    if hasattr(config, "output_router_logits"):
        found.append("experts, router loss" if router_loss_default(model) else "experts (no router loss)")
    found += [f"'{kind}' layers" for kind in dict.fromkeys(k for _, k in model_attention(model).mixers)]
    if rope.thresholds(config):
        parameters = config.rope_parameters
        found.append(f"{parameters.get('rope_type', parameters.get('type'))} rope from {rope.thresholds(config)[0]}")
    return ", ".join(found) or "full causal"


def router_loss_default(model) -> bool:
    """Whether the model returns a router load-balancing loss with a nonzero default coefficient: then
    `loss.router_aux_coef` is on unless set, and the paths that cannot compute it exactly refuse it."""
    from dpo_train.attention.features import computes_router_loss, text_config

    coefficient = float(getattr(text_config(model), "router_aux_loss_coef", 0.0) or 0.0)
    return bool(coefficient) and computes_router_loss(model)


ROUTER_REFUSED = ("sdpa", "eager", "ulysses 2", "context 2")
"""The columns where the default router loss is refused by name (exact with loss.router_aux_coef: 0)."""


def cell(value, unpacked: bool = False) -> str:
    """A path's outcome over both layouts: exact (within the test's tolerance; "(unpacked)" where the path
    ran the model unpacked), or why it was refused."""
    if isinstance(value, str):
        if "transformers refuses it" in value:
            return "refused: transformers has no sdpa for it"
        if "trains unpacked" in value:
            return "refused: unpacked only"
        if "a sequence mixer" in value:
            return "refused: state crosses segments"
        if "ALiBi" in value:
            return "refused: ALiBi bias spans the row"
        if "without its sequence shard" in value or "without the row's segments" in value:
            return "refused: its layers pass no keywords to attention"
        if "attention registry" in value:
            return "refused: outside the attention registry"
        if "packing would train on wrong numbers" in value:
            return "refused: off on the probe's row"
        if "must divide the model's attention heads" in value:
            return "refused: one key/value head"
        if "passed no sliding_window" in value:
            return "refused: its layers pass no window"
        if "depends on each sequence's length" in value:
            return "refused: a shared prompt's rope by length"
        return "refused: " + value.split(";")[0]
    return "exact (unpacked)" if unpacked else "exact"


def render_table(rows: dict) -> str:
    """rows: model_type -> {"class", "features", "ran_unpacked" (the columns that ran unpacked), column: [value
    per layout]}; a Markdown table."""
    head = ["architecture", "attention features", *(f"`{c}`" for c in COLUMNS), "flash_attention_2"]
    lines = []
    for model_type, row in sorted(rows.items()):
        cells = []
        for column in COLUMNS:
            outcomes = {cell(v, column in row["ran_unpacked"]) for v in row[column]}
            if row.get("router") and column in ROUTER_REFUSED:
                outcomes = {f"{o} with loss.router_aux_coef: 0" if o.startswith("exact") else o for o in outcomes}
            cells.append(" / ".join(sorted(outcomes)))
        lines.append([f"{row['class']} (`{model_type}`)", row["features"], *cells, row["flash"]])
    return markdown_table(head, lines)


def flash_cell(model, refused: bool, unpacked: bool = False, fallback: tuple | None = None) -> str:
    """flash-attention-2 by capability (it needs CUDA: not run here)."""
    from dpo_train.attention.choice import EXPRESSES
    from dpo_train.attention.features import model_attention

    if fallback:
        return f"refused (auto: {fallback[0]}): {fallback[1]}"
    if refused:
        return "refused: state crosses segments"
    if unpacked:
        return "refused (auto: unpacked): packs"
    missing = [f for f in model_attention(model).needs() if f not in EXPRESSES["flash_attention_2"]]
    return f"refused (auto: segments): no {', '.join(missing)}" if missing else "expressible"
