"""The chunked vocabulary head (issue 35, step 1): each target's log-prob and WPO's log sum p^2, and the gradients
of the hidden states, weight and bias, equal the whole head's within 1e-6 relative in fp32, at every chunk size,
for every head transform the zoo's models apply, read from the models themselves; a cut off by one is seen."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from dpo_train.logps.head import Head, HeadInput, chunk_spans, head_of, target_logps
from dpo_train.logps.scoring import Scoring
from dpo_train.model.policy import init_config
from tests.architectures.zoo import BASE, ZOO, model_spec
from tests.harness import LiveTensors

ROWS, HIDDEN, VOCAB = 37, 16, 101
TOLERANCE = 1e-6
HEADS = {
    "plain": {},
    "bias": {"bias": True},
    "multiply": {"multiply": 0.0625},  # Cohere's logit_scale
    "divide": {"divide": 2.5},  # Granite's logits_scaling
    "softcap": {"softcap": 3.0, "multiply": 1.7},  # Gemma 2's final_logit_softcapping
}


def _relative(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got.double() - truth.double()).abs().max() / truth.double().abs().max().clamp(min=1e-30))


def _head(kind: str, seed: int = 0) -> Head:
    g = torch.Generator().manual_seed(seed)
    options = dict(HEADS[kind])
    bias = torch.randn(VOCAB, generator=g).requires_grad_() if options.pop("bias", False) else None
    return Head(torch.randn(VOCAB, HIDDEN, generator=g).requires_grad_(), bias, **options)


def _whole(hidden: torch.Tensor, head: Head, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's head: every row's logits at once, through autograd."""
    logits = head.logits(hidden)
    log_z = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, labels[:, None]).squeeze(1) - log_z
    return picked, (torch.logsumexp(2 * logits, dim=-1) - 2 * log_z).detach()


def _errors(head: Head, chunk: int, spans=chunk_spans, compiled: bool | str = "auto") -> dict[str, float]:
    """Relative errors of the chunked head against the whole one: log-probs, log sum p^2, and the gradients of
    a loss that weighs each row differently (so a row counted twice or never shows); `compiled`:
    train.compiled_head."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(ROWS, HIDDEN, generator=g).requires_grad_()
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    weights = torch.rand(ROWS, generator=g) + 0.5
    params = [hidden, head.weight, *([head.bias] if head.bias is not None else [])]
    out = {}
    results = []
    for compute in (
        lambda: _whole(hidden, head, labels),
        lambda: target_logps(hidden, head, labels, chunk, spans=spans, compiled=compiled),
    ):
        picked, square = compute()
        grads = torch.autograd.grad((picked * weights).sum(), params)
        results.append((picked.detach(), square, grads))
    (truth, truth_sq, truth_grads), (got, got_sq, got_grads) = results
    out["logps"], out["square"] = _relative(got, truth), _relative(got_sq, truth_sq)
    for name, a, b in zip(("hidden", "weight", "bias"), got_grads, truth_grads):
        out[f"grad {name}"] = _relative(a, b)
    return out


@pytest.mark.parametrize("kind", sorted(HEADS))
@pytest.mark.parametrize("chunk", [1, 5, ROWS - 1, ROWS, 64])
def test_every_chunk_size_gives_the_whole_heads_logps_and_gradients(kind, chunk):
    errors = _errors(_head(kind), chunk)
    assert max(errors.values()) <= TOLERANCE, errors


def _peak_copies(head: Head, rows: int) -> float:
    """The peak of live tensor bytes while one chunk of `rows` positions runs forward and backward, in [rows, vocab]
    float32 copies (the profiler's record of every CPU allocation; what was alive before is not counted)."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(rows, head.weight.shape[1], generator=g).requires_grad_()
    labels = torch.randint(0, head.weight.shape[0], (rows,), generator=g)
    with LiveTensors() as meter:
        picked, _ = target_logps(hidden, head, labels, rows)
        picked.sum().backward()
    return meter.peak_mib * (1 << 20) / (rows * head.weight.shape[0] * 4)


@pytest.mark.parametrize("softcap, copies", [(None, 2), (3.0, 3)])
def test_a_chunk_holds_two_copies_of_its_logits_three_with_a_softcap(softcap, copies):
    """The chunk bodies make what they can in place: the forward holds the logits and log-sum-exp's own, the
    backward the logits and the softmax (a softcap's derivative one more). A chunk of 512 positions over 4,096
    tokens (8 MiB a copy); the rest of the step (a hidden-state gradient, the weight's) is under 0.1 of a copy."""
    g = torch.Generator().manual_seed(3)
    head = Head(torch.randn(4096, 8, generator=g).requires_grad_(), softcap=softcap)
    got = _peak_copies(head, 512)
    assert copies <= got < copies + 0.25, got


def _overlapping(rows: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk + 1, rows)) for start in range(0, rows, chunk)]


def _gapped(rows: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, max(start, min(start + chunk, rows) - 1)) for start in range(0, rows, chunk)]


@pytest.mark.parametrize("cut", [_overlapping, _gapped], ids=["one-row-overlap", "one-row-gap"])
def test_a_chunk_boundary_off_by_one_is_seen(cut):
    """The check above can fail: a row scored in two chunks doubles its gradient; a row in none is never
    scored."""
    errors = _errors(_head("bias"), 5, spans=cut)
    # a row in no chunk keeps torch.empty's bytes: its error may be NaN, which is seen too (max() would skip it)
    assert not all(error <= 1e-3 for error in errors.values()), errors


# each head transform a family applies: none (tied and untied), Gemma 2's softcap, Granite's division, Cohere 2's
# logit scale, Falcon-H1's multiplier, HyperCLOVA X's multiplication by what Granite divides by, and MiniCPM3's
# division of the hidden states before the projection (so none after it)
MODELS = {
    "llama": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": False},
    "gemma2": {},
    "granite": {},
    "cohere2": {"logit_scale": 0.25},
    "falcon_h1": {"lm_head_multiplier": 0.41},
    "hyperclovax": {"logits_scaling": 2.5},
    "minicpm3": {  # multi-head latent attention: as many key-value heads as heads
        "num_key_value_heads": 4,
        "dim_model_base": 16,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    },  # logits_scaling: hidden_size / dim_model_base = 4
}


def _spec(model_type: str) -> dict:
    """The zoo's spec of the family, or the zoo's base sizes for a family the zoo does not hold."""
    spec = model_spec(model_type) if model_type in ZOO else {"model_type": model_type, **BASE}
    return {**spec, **MODELS[model_type]}


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_the_models_own_head_is_read_and_chunked_exactly(model_type):
    """From the model's final hidden states, the chunked head gives the log-probs of the model's own forward
    (its own logits, whatever it applies after the projection) and the same gradients for every parameter."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(init_config(_spec(model_type)), attn_implementation="eager").eval()
    head = head_of(model)
    assert head is not None
    ids = torch.randint(3, 97, (1, 29))
    labels = ids[0, 1:]

    def whole() -> torch.Tensor:
        logits = model(input_ids=ids).logits[0, :-1].float()
        return logits.log_softmax(-1).gather(1, labels[:, None]).squeeze(1)

    def chunked() -> torch.Tensor:
        with HeadInput(model) as kept:  # what the model's forward hands its lm_head
            model(input_ids=ids)
        return target_logps(kept.hidden[0, :-1], head_of(model), labels, 6)[0]

    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for compute in (whole, chunked):
        picked = compute()
        grads = torch.autograd.grad(picked.sum(), params, allow_unused=True)
        results.append((picked.detach(), grads))
    (truth, truth_grads), (got, got_grads) = results
    assert _relative(got, truth) <= TOLERANCE
    worst = max(_relative(a, b) for a, b in zip(got_grads, truth_grads) if b is not None)
    assert worst <= TOLERANCE, worst


def test_a_head_that_is_not_a_plain_linear_is_not_chunked():
    """LoRA on lm_head (or any custom head) is not read: the caller keeps the model's own head."""
    model = AutoModelForCausalLM.from_config(init_config(model_spec("llama")))
    model.lm_head = torch.nn.Sequential(model.lm_head)
    assert head_of(model) is None


# -- through pair_logps: the model's own forward, its hidden states kept, the head in chunks ----------------------

PATH_MODELS = {  # (model_type, attention path): plain, softcap, scaling, logit scale, and the unpacked path
    "llama": "segments",
    "gemma2": "eager",
    "granite": "segments",
    "cohere2": "segments",
    "qwen3": "unpacked",
}


def _loaded(model_type: str, path: str, layout: str) -> tuple:
    """The model as loaded for `path`, in eval mode, and its `Scoring` (unpacked where it loaded so)."""
    from dpo_train.config.sections import ModelConfig
    from dpo_train.model.load import load_model
    from dpo_train.parallel.device import placement

    spec = ModelConfig(init={"config": model_spec(model_type), "seed": 0})
    model, unpacked = load_model(spec, path, placement("cpu", "fp32"), None, layout)
    return model.eval(), Scoring(unpacked=unpacked)


def _scored(model, batch: dict, scoring: Scoring, budget: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """pair_logps' outputs (sums, LD sums, WPO weights) and every parameter's gradient of a mixed objective, with
    the logits budget `budget`."""
    from dpo_train.logps.pairs import pair_logps

    model.zero_grad(set_to_none=True)
    scoring = dataclasses.replace(scoring, logits_budget=budget)
    out = pair_logps(model, batch, scoring, ld_alpha=0.4, weighting=True)
    (out.chosen.sum() - 0.7 * out.rejected.sum() + 0.3 * out.ld[0].sum()).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return [out.chosen, out.rejected, out.ld[0], out.ld[1], out.weights], grads


@pytest.mark.parametrize("layout", ["separate", "shared_prompt"])
@pytest.mark.parametrize("model_type", sorted(PATH_MODELS))
def test_pair_logps_through_the_chunked_head_equal_the_models_own_head(model_type, layout):
    """A budget of 7 positions' logits (chunks of 7) against no budget: the same per-pair sums, LD-DPO sums,
    WPO weights and gradients of every parameter, within 1e-6 relative, on both layouts and the unpacked path."""
    from dpo_data.loading.microbatch import pack_microbatch, pack_shared_prompt
    from dpo_train.logps.head import COPIES, chunk_rows
    from tests.architectures.zoo import pairs

    model, scoring = _loaded(model_type, PATH_MODELS[model_type], layout)
    assert scoring.unpacked == (PATH_MODELS[model_type] == "unpacked")
    batch = (pack_shared_prompt if layout == "shared_prompt" else pack_microbatch)(pairs(), 16)
    budget = 7 * COPIES * model.config.vocab_size * 4
    whole, whole_grads = _scored(model, batch, scoring, None)
    chunked, chunked_grads = _scored(model, batch, scoring, budget)
    assert chunk_rows(model, 100, budget) == 7 and chunk_rows(model, 7, budget) is None  # engaged only past it
    assert max(_relative(a, b) for a, b in zip(chunked, whole)) <= TOLERANCE
    assert len(chunked_grads) == len(whole_grads) > 0
    assert max(_relative(a, b) for a, b in zip(chunked_grads, whole_grads)) <= TOLERANCE


def test_lora_policy_and_its_adapters_off_reference_through_the_chunked_head_equal_the_models_own():
    """LoRA on the attention (the head stays a plain Linear): the policy's sums and every adapter's gradient, and
    the reference's sums with the adapters off (`AdaptersDisabled`, the head found through PEFT's wrappers, scored
    with the policy's `Scoring`), equal the whole head's within 1e-6 relative; the adapters moved off zero so that
    they count."""
    from dpo_data.loading.microbatch import pack_microbatch
    from dpo_train.logps.head import COPIES, chunk_rows
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.model.lora import apply_lora
    from dpo_train.reference.live import AdaptersDisabled
    from tests.architectures.zoo import pairs

    loaded, scoring = _loaded("llama", "segments", "separate")
    model = apply_lora(loaded, {"r": 4, "target_modules": ["q_proj", "v_proj"]})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    batch = pack_microbatch(pairs(), 16)
    budget = 7 * COPIES * model.config.vocab_size * 4
    whole, whole_grads = _scored(model, batch, scoring, None)
    chunked, chunked_grads = _scored(model, batch, scoring, budget)
    assert chunk_rows(model, 100, budget) == 7  # the head is found through PEFT's wrappers
    assert len(chunked_grads) == len(whole_grads) > 0  # the adapters' gradients (the base is frozen)
    assert max(_relative(a, b) for a, b in zip(chunked, whole)) <= TOLERANCE
    assert max(_relative(a, b) for a, b in zip(chunked_grads, whole_grads)) <= TOLERANCE
    references = []
    for b in (None, budget):  # the policy's scoring, the reference's too
        with torch.no_grad():
            out = pair_logps(AdaptersDisabled(model), batch, dataclasses.replace(scoring, logits_budget=b))
        references.append(torch.stack([out.chosen, out.rejected]))
    assert chunk_rows(AdaptersDisabled(model), 100, budget) == 7  # so the reference above did score in chunks
    assert _relative(references[1], references[0]) <= TOLERANCE
    assert _relative(references[0][0], whole[0]) > 1e-3  # adapters off is another model than the policy


def test_the_head_check_refuses_a_head_it_cannot_stand_in_for(capsys):
    """A model that changes its logits after the projection in a way `head_of` does not read, or whose head is
    not a plain Linear, keeps its own head: `check_head` names why, and the run's note says so."""
    from dpo_train.logps.head_check import check_head, note

    model = AutoModelForCausalLM.from_config(init_config(model_spec("llama"))).eval()
    assert check_head(model, Scoring()) is None
    own = type(model).forward

    def shifted(self, *args, **kwargs):  # an unknown transform: the last logit raised
        out = own(self, *args, **kwargs)
        out.logits[..., -1] += 3.0
        return out

    model.forward = shifted.__get__(model)
    assert "differs from the chunked one" in check_head(model, Scoring())

    def nan(self, *args, **kwargs):  # a model whose own logits are NaN somewhere: never "equal"
        out = own(self, *args, **kwargs)
        out.logits[..., 0, -1] = float("nan")
        return out

    model.forward = nan.__get__(model)
    assert "differs from the chunked one by nan" in check_head(model, Scoring())
    del model.forward
    model.lm_head = torch.nn.Sequential(model.lm_head)
    why = check_head(model, Scoring())
    assert why == "its output embedding is a Sequential, not a plain Linear"
    note(model, why)
    assert "the chunked vocabulary head is off for this model" in capsys.readouterr().err


def test_a_run_through_the_chunked_head_trains_what_the_models_own_head_trains(small_dataset, smollm2_dir, tmp_path):
    """`train.logits_budget_mib: 16` on a tiny model with SmolLM2's vocabulary (a micro-batch's whole head
    takes about 1 MB a position, so it runs in chunks of 17 positions) against `null`, two SGD steps: the same
    losses, log-probs and gradient norms step after step, within 1e-6 relative, and the same weights after
    them within 1e-5
    (SGD: an update is the gradient's; Adam's normalization would magnify rounding in near-zero gradients)."""
    import orjson
    from safetensors.torch import load_file

    from dpo_train.config.loading import load_config
    from dpo_train.config.sections import ModelConfig
    from dpo_train.model.policy import load_policy
    from dpo_train.trainer import train
    from tests.harness import TINY_LLAMA, tiny_config

    logs, finals, identities = {}, {}, {}
    initial = load_policy(ModelConfig(init={"config": TINY_LLAMA, "seed": 0})).state_dict()
    for name, budget in (("own", None), ("chunked", 16)):
        config = tiny_config(
            small_dataset, smollm2_dir, tmp_path / name, max_steps=2, save_every=2, logits_budget_mib=budget
        )
        config["optim"] = {"name": "sgd", "lr": 1.0}
        out = train(load_config(config), progress=False)
        logs[name] = [orjson.loads(line) for line in (out / "metrics.jsonl").read_bytes().splitlines()]
        finals[name] = load_file(str(out / "final" / "model.safetensors"))
        (checkpoint,) = sorted((out / "checkpoints").glob("step-*"))[-1:]
        identities[name] = orjson.loads((checkpoint / "state.json").read_bytes())["identity"]
    for own, chunked in zip(logs["own"], logs["chunked"], strict=True):
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
            assert chunked[key] == pytest.approx(own[key], rel=TOLERANCE, abs=1e-9), (own["step"], key)
    assert finals["own"].keys() == finals["chunked"].keys()
    moved = [k for k, v in finals["own"].items() if (v - initial[k]).abs().max() > 1e-4]
    assert moved, "SGD moved no weight: the comparison would prove nothing"
    # relative to each weight's scale (an update's own digits are lost below float32's rounding of the weight),
    # and 1e-5: step 2's gradients are taken at weights step 1 already moved apart by rounding (lr 1.0)
    assert max(_relative(finals["chunked"][k], v) for k, v in finals["own"].items()) <= 10 * TOLERANCE
    # the budget is in the identity only when set: a resume across it is elastic (below), not refused
    assert "logits_budget_mib" not in identities["own"]["layout"]
    assert identities["chunked"]["layout"]["logits_budget_mib"] == 16


def test_the_live_reference_scores_with_the_policys_scoring(small_dataset, smollm2_dir, tmp_path):
    """train.logits_budget_mib reaches the live reference as the policy's own `Scoring` (issue 58: the budget was
    marked on the policy and copied by hand onto the reference, and an FSDP2 reference once lost it): one object,
    nothing copied; the checkpoint identity's tile is the same object's."""
    from tests.harness import tiny_config, tiny_trainer

    trainer = tiny_trainer(tiny_config(small_dataset, smollm2_dir, tmp_path / "run", logits_budget_mib=16))
    assert trainer.scoring.logits_budget == 16 * 2**20 and not trainer.scoring.unpacked
    assert trainer.reference.mode == "live" and trainer.reference.scoring is trainer.scoring
    assert trainer.identity()["layout"].get("mlp_tile_tokens") == trainer.scoring.mlp_tile


@pytest.mark.parametrize("batching", ["pairs", "tokens"])
def test_a_budget_change_on_resume_is_elastic_in_either_batching(batching):
    """Only the rounding changes, never a step's pairs: another budget (or none) resumes with a warning in both
    batchings, where another precision stays refused."""
    from dpo_state.state import identity_mismatches

    def identity(**layout) -> dict:
        return {"layout": {"batching": batching, "world_size": 1, "precision": "fp32", **layout}}

    mismatches, elastic = identity_mismatches(identity(), identity(logits_budget_mib=64))
    assert (mismatches, elastic) == ([], ["layout.logits_budget_mib: checkpoint <absent>, this run 64"])
    mismatches, elastic = identity_mismatches(identity(logits_budget_mib=64), identity(logits_budget_mib=8))
    assert (mismatches, elastic) == ([], ["layout.logits_budget_mib: checkpoint 64, this run 8"])
    mismatches, _ = identity_mismatches(
        identity(logits_budget_mib=64), identity(logits_budget_mib=64, precision="bf16")
    )
    assert mismatches == ["layout.precision: checkpoint fp32, this run bf16"]
