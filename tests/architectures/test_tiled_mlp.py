"""train.mlp_tile_tokens: every zoo architecture's MLPs run over tiles of the sequence give its own numbers."""

from __future__ import annotations

import copy

import pytest
import torch

from dpo_data.loading.microbatch import pack_microbatch
from dpo_train.config.sections import ModelConfig
from dpo_train.errors import ConfigError
from dpo_train.logps.pairs import pair_logps
from dpo_train.logps.scoring import Scoring
from dpo_train.logps.tiled_mlp import Tiled, mlps, tile_mlps, tiles_of
from tests.architectures.zoo import ZOO, model_spec, pairs


def _loaded(model_type: str) -> tuple:
    """The zoo model as a run trains it: training mode, dropout off (Seed-OSS's MLP applies its own); and the
    `Scoring` of its rows (unpacked where auto takes that path)."""
    from dpo_train.logps.probe import probe
    from dpo_train.model.load import load_model
    from dpo_train.model.policy import prepare_for_training
    from dpo_train.parallel.device import placement

    spec = ModelConfig(init={"config": model_spec(model_type), "seed": 0})
    model, unpacked = load_model(spec, "auto", placement("cpu", "fp32"), None, "separate")
    unpacked = probe(model, "separate", "auto", unpacked).unpacked  # auto's path, as the run takes it (StableLM's)
    prepare_for_training(model)
    return model, Scoring(unpacked=unpacked)


def _load(model_type: str):
    return _loaded(model_type)[0]


def tile_of(model) -> int | None:
    """The tile a checkpoint records for `model`'s MLPs (`Scoring.mlp_tile` of its tiles; None: whole)."""
    return Scoring(tiles=tiles_of(model)).mlp_tile


def _logps_and_gradient(model, scoring: Scoring) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = pair_logps(model, pack_microbatch(pairs()), scoring)
    logps = torch.stack([out.chosen, out.rejected], 1)
    (logps * torch.tensor([[1.0, -0.5], [0.3, 0.2], [-1.0, 0.7]], dtype=logps.dtype)).sum().backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return logps.detach(), torch.cat([g.flatten() for g in grads])


@pytest.mark.parametrize("model_type", sorted(ZOO))
def test_tiled_mlps_give_the_models_own_logps_and_gradients(model_type):
    """Tiles of 2 positions (every MLP call of the packed row is cut), with activation checkpointing around each
    layer as a long-pair run has it: the per-pair log-probs and the parameters' gradient are the whole MLP's
    within 1e-10 relative, in float64, so that only a change of the function could differ (in float32 the
    tiles' weight gradients, summed in another order, differ by rounding: up to 1.6e-6 here). A mixture of
    experts is left whole (and its grouped matmul takes no float64: those models compare in float32, 1e-6 and
    1e-5, their dense layers tiled)."""
    model, scoring = _loaded(model_type)
    moe = any(name.endswith("experts") for name, _ in model.named_modules())
    model, (logps_tolerance, grad_tolerance) = (model, (1e-6, 1e-5)) if moe else (model.double(), (1e-10, 1e-10))
    tiled = copy.deepcopy(model)
    names = tile_mlps(tiled, 2)
    assert tile_of(tiled) == (2 if names else None)
    assert not any(isinstance(m, Tiled) for m in model.modules()), "the original stays whole"
    if getattr(tiled, "supports_gradient_checkpointing", False):
        tiled.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    (whole, whole_grad), (got, got_grad) = _logps_and_gradient(model, scoring), _logps_and_gradient(tiled, scoring)
    assert float(((got - whole).abs() / whole.abs()).max()) <= logps_tolerance
    assert float((got_grad - whole_grad).norm() / whole_grad.norm()) <= grad_tolerance
    for name, module in tiled.named_modules():
        if any(n.endswith("experts") for n, _ in module.named_modules()) and name.endswith("mlp"):
            assert not isinstance(module, Tiled), f"{name}: a mixture of experts was tiled"


def test_the_zoo_has_tiled_and_untiled_mlps():
    """The parametrization above is not vacuous: dense MLPs are tiled, mixtures of experts are not."""
    counts = {t: len(mlps(_load(t))) for t in ("llama", "gemma2", "phi3", "qwen3_moe", "mixtral")}
    assert counts["llama"] > 0 and counts["gemma2"] > 0 and counts["phi3"] > 0
    assert counts["qwen3_moe"] == 0 and counts["mixtral"] == 0


def test_the_forward_keeps_only_the_mlps_input():
    """With grad, the tiled MLP's forward saves none of its intermediates for the backward (each tile's are
    recomputed there, one tile at a time): only its input; whole, it saves gate, up and their product for every
    position. Counted with a saved-tensors hook around the MLP's forward."""
    model = _load("llama")
    mlp = model.model.layers[0].mlp
    hidden = torch.randn(1, 256, mlp.gate_proj.in_features, requires_grad=True)

    def saved_bytes() -> int:
        sizes: list[int] = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = mlp(hidden)
        out.sum().backward()
        return sum(sizes)

    whole = saved_bytes()
    tile_mlps(model, 16)
    tiled = saved_bytes()
    inputs = hidden.numel() * 4
    intermediate = hidden.shape[1] * mlp.gate_proj.out_features * 4  # one [positions, intermediate] float32
    assert whole >= inputs + 2 * intermediate
    assert tiled == inputs


MLP_LAST = ("llama", "qwen2", "phi3", "cohere2", "starcoder2")
"""Layers the MLP ends (its output only added to the residual)."""
NORM_AFTER = ("gemma2", "olmo2", "exaone4")
"""Layers with a norm after the MLP, which saves the MLP's output for its own backward."""


@pytest.mark.parametrize("model_type", MLP_LAST + NORM_AFTER)
def test_under_activation_checkpointing_tiles_cost_no_mlp_forward_where_the_mlp_ends_the_layer(model_type):
    """Positions through the MLP's own forward in one forward and backward of the zoo's packed row, with each layer
    checkpointed, tiled against whole. Where the MLP ends the layer, the layer's recompute stops at the MLP's saved
    input and the tiles' backward is the one recompute: as many positions as whole (forward and recompute). Where
    a norm follows the MLP, that norm needs the MLP's output, so the recompute runs it: one forward more (1.5x)."""
    model, scoring = _loaded(model_type)
    (_, first), *_ = mlps(model)
    cls, counted = type(first), []
    own = cls.forward

    def counting(self, x, *args, **kwargs):
        counted.append(x.shape[-2])
        return own(self, x, *args, **kwargs)

    positions = {}
    for name, tile in (("whole", None), ("tiled", 2)):
        copied = copy.deepcopy(model)
        tile_mlps(copied, tile)
        copied.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        counted.clear()
        cls.forward = counting
        try:
            _logps_and_gradient(copied, scoring)
        finally:
            cls.forward = own
        positions[name] = sum(counted)
    assert positions["whole"] > 0
    expected = positions["whole"] * (1 if model_type in MLP_LAST else 1.5)
    assert positions["tiled"] == expected, positions


@pytest.mark.parametrize("checkpointed", [True, False])
def test_lora_adapters_on_a_tiled_mlp_get_the_whole_mlps_gradients(checkpointed):
    """LoRA on the MLP's projections of a tiled model (tiled at load, adapters after, as a run does): the tiles'
    backward hands the adapters' gradients to the graph and none to the frozen base weights; float64, adapters
    made non-zero so that they change the numbers. Without activation checkpointing the first layer's MLP input
    needs no gradient (nothing before it trains): its tiles' backward reads the input it kept itself."""
    from dpo_train.model.lora import apply_lora

    lora = {"r": 4, "alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]}
    runs = []
    for tile in (None, 2):
        model = _load("llama").double()
        tile_mlps(model, tile)
        model = apply_lora(model, lora)
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        logps, grad = _logps_and_gradient(model, Scoring())
        trained = [n for n, p in model.named_parameters() if p.grad is not None]
        runs.append((logps, grad, trained))
    (whole, whole_grad, whole_trained), (got, got_grad, got_trained) = runs
    assert got_trained == whole_trained and all(".lora_" in n for n in got_trained)
    assert any("mlp" in n for n in got_trained)
    assert float(((got - whole).abs() / whole.abs()).max()) <= 1e-10
    assert float((got_grad - whole_grad).norm() / whole_grad.norm()) <= 1e-10


def test_the_tiles_backward_recomputes_under_the_forwards_autocast():
    """A bf16 autocast forward, its backward called outside the autocast (as a CUDA backward runs, on the engine's
    own threads): the tiles recomputed in backward run their projections in bf16 as the forward did, so that the
    recomputed tile is the forward's (recomputed in fp32 it would not be)."""
    model = _load("llama")
    tile_mlps(model, 2)
    gate = model.model.layers[0].mlp.gate_proj
    dtypes: list[torch.dtype] = []
    hook = gate.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = pair_logps(model, pack_microbatch(pairs()), Scoring())
        forward = len(dtypes)
        (out.chosen.sum() - out.rejected.sum()).backward()
    finally:
        hook.remove()
    assert forward > 0 and len(dtypes) > forward, "the backward recomputed the tiles"
    assert set(dtypes) == {torch.bfloat16}, dtypes


def test_an_mlp_that_mixes_positions_is_refused_by_name():
    """A module named `mlp` whose output at a position reads other positions (a running sum here) cannot be
    tiled: the start-up check finds the difference and names the module, before any step."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    class RunningSumMLP(LlamaMLP):
        def forward(self, x):
            return super().forward(x.cumsum(-2))

    model = _load("llama")
    model.model.layers[1].mlp.__class__ = RunningSumMLP
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp \(RunningSumMLP\) mixes positions.*null"):
        tile_mlps(model, 4)


def test_the_run_says_what_it_tiled():
    from dpo_train.logps.tiled_mlp import tile_note

    model = _load("llama")
    assert tile_note(model, tile_mlps(model, 8), 8) == (
        "note: LlamaForCausalLM: 2 MLPs run in tiles of 8 positions (train.mlp_tile_tokens)"
    )
    moe = _load("mixtral")
    assert "has nothing to tile" in tile_note(moe, tile_mlps(moe, 8), 8)


def test_null_leaves_every_mlp_whole_and_a_copy_stays_tiled():
    model = _load("qwen2")
    assert tile_mlps(model, None) == [] and tile_of(model) is None
    tile_mlps(model, 8)
    copied = copy.deepcopy(model)  # the live reference is a copy of the policy
    assert tile_of(copied) == 8
    assert set(copied.state_dict()) == set(_load("qwen2").state_dict()), "parameter names unchanged"


def test_train_mlp_tile_tokens_is_auto_a_positive_count_or_null(tmp_path):
    from dpo_train.config.loading import load_config

    source = {"data": {"path": str(tmp_path)}, "model": {"path": str(tmp_path)}}
    assert load_config(source, []).train.mlp_tile_tokens == "auto"
    assert load_config(source, ["train.mlp_tile_tokens=1024"]).train.mlp_tile_tokens == 1024
    assert load_config(source, ["train.mlp_tile_tokens=null"]).train.mlp_tile_tokens is None
    for bad in ("0", "-4", "many", "1.5", "true", "Auto"):
        with pytest.raises(ConfigError) as info:
            load_config(source, [f"train.mlp_tile_tokens={bad}"])
        assert "train/mlp_tile_tokens" in str(info.value), str(info.value)


@pytest.mark.parametrize("model_type", MLP_LAST + NORM_AFTER)
def test_auto_tiles_the_mlps_whose_tiles_checkpointing_makes_free(model_type):
    """`auto` counts, on the model itself, how often each MLP runs in a checkpointed forward and backward when
    tiled: it tiles (at AUTO) the MLPs that run no more often than whole, the ones the test above finds free, and
    leaves the others, and every MLP without checkpointing, as they were; the count keeps no gradient, leaves
    every parameter's requires_grad and draws nothing from the RNG."""
    from dpo_train.logps.tiled_mlp import AUTO, apply_setting

    model = _load(model_type)
    assert apply_setting(model, "auto", checkpointed=False) is None and tile_of(model) is None
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.model.embed_tokens.requires_grad_(False)  # as under LoRA: one the count must give back frozen
    model.model.layers[0].register_forward_pre_hook(_draw)  # as a router's jitter would
    trainable, rng = [p.requires_grad for p in model.parameters()], torch.get_rng_state()
    said = apply_setting(model, "auto", checkpointed=True)
    tiled = [name for name, module in mlps(model) if isinstance(module, Tiled)]
    if model_type in MLP_LAST:
        assert tiled == [name for name, _ in mlps(model)] and len(tiled) == 2 and tile_of(model) == AUTO
        assert said.endswith(f"2 MLPs run in tiles of {AUTO} positions (train.mlp_tile_tokens: auto)"), said
    else:
        assert tiled == [] and tile_of(model) is None
        assert "its 2 MLPs run whole (train.mlp_tile_tokens: auto)" in said, said
    assert [p.requires_grad for p in model.parameters()] == trainable
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_auto_leaves_a_model_the_count_cannot_run_as_it_was():
    """A model whose forward fails on the count's row trains whole, as before auto, with a note naming the error:
    auto only saves memory, so it never stops a run the model would otherwise make."""
    from dpo_train.logps.tiled_mlp import apply_setting

    model = _load("qwen2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainable = [p.requires_grad for p in model.parameters()]
    model.model.layers[1].register_forward_pre_hook(_fail)
    said = apply_setting(model, "auto", checkpointed=True)
    assert "its MLPs run whole (train.mlp_tile_tokens: auto could not count them: RuntimeError: no row" in said
    assert tile_of(model) is None and not any(isinstance(m, Tiled) for m in model.modules())
    assert [p.requires_grad for p in model.parameters()] == trainable


def _fail(*_) -> None:
    raise RuntimeError("no row like this one")


def _draw(*_) -> None:
    """A forward pre-hook drawing from the RNG."""
    torch.rand(1)


def test_auto_leaves_an_mlp_that_mixes_positions_whole_where_a_count_refuses_it():
    from dpo_train.logps.tiled_mlp import apply_setting

    model = _load("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    first = model.model.layers[0].mlp

    class MixingMLP(type(first)):
        def forward(self, x):
            return super().forward(x.cumsum(-2))

    first.__class__ = MixingMLP
    said = apply_setting(model, "auto", checkpointed=True)
    assert not isinstance(first, Tiled) and isinstance(model.model.layers[1].mlp, Tiled)
    assert "1 MLPs run in tiles" in said and "1 left whole" in said, said


def test_a_tiled_run_trains_what_the_whole_mlp_trains(small_dataset, smollm2_dir, tmp_path, monkeypatch):
    """dpo-train with `train.mlp_tile_tokens: 16` and activation checkpointing (the tiny model's micro-batches
    of up to 400 tokens cut in tiles of 16) against the whole MLP, two steps: the same losses, log-probs and
    gradient norms within 1e-6 relative; the tile is in the checkpoint's identity only when set."""
    import orjson

    from dpo_train.config.loading import load_config
    from dpo_train.logps import tiled_mlp
    from dpo_train.trainer import train
    from tests.harness import tiny_config

    logs, identities, tiles = {}, {}, []
    backward = tiled_mlp._Tiles.backward  # counted: the tiles' backward ran
    monkeypatch.setattr(tiled_mlp._Tiles, "backward", staticmethod(lambda *a: tiles.append(1) or backward(*a)))
    for name, tile in (("whole", None), ("tiled", 16)):
        config = tiny_config(
            small_dataset,
            smollm2_dir,
            tmp_path / name,
            max_steps=2,
            save_every=2,
            activation_checkpointing=True,
            mlp_tile_tokens=tile,
        )
        before = len(tiles)
        out = train(load_config(config), progress=False)
        assert (len(tiles) > before) == (tile is not None), "the tiled run cut its MLPs, the whole one did not"
        logs[name] = [orjson.loads(line) for line in (out / "metrics.jsonl").read_bytes().splitlines()]
        (saved,) = sorted((out / "checkpoints").glob("step-*"))[-1:]
        identities[name] = orjson.loads((saved / "state.json").read_bytes())["identity"]
    for whole, tiled in zip(logs["whole"], logs["tiled"], strict=True):
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
            assert tiled[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-9), (whole["step"], key)
    assert "mlp_tile_tokens" not in identities["whole"]["layout"]
    assert identities["tiled"]["layout"]["mlp_tile_tokens"] == 16


@pytest.mark.parametrize("checkpointing", [True, False])
def test_auto_records_the_tile_the_policy_runs_in_the_identity(small_dataset, smollm2_dir, tmp_path, checkpointing):
    """The default, auto: a checkpointed run's identity holds the tile its Llama MLPs run with, an uncheckpointed
    run's none (its MLPs whole), as if it had said null."""
    from dpo_train.logps.tiled_mlp import AUTO
    from tests.harness import tiny_config, tiny_trainer

    config = tiny_config(small_dataset, smollm2_dir, tmp_path, activation_checkpointing=checkpointing)
    assert "mlp_tile_tokens" not in config["train"]
    layout = tiny_trainer(config).identity()["layout"]
    assert layout.get("mlp_tile_tokens", "absent") == (AUTO if checkpointing else "absent")


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_precomputed_reference_tiles_the_mlps_its_run_tiles(
    small_dataset, smollm2_dir, tmp_path, monkeypatch, checkpointing
):
    """--precompute-reference builds the run's own initial policy, activation checkpointing included, so `auto`
    tiles the MLPs the training run tiles and the reference's rows run through the same tiles."""
    from dpo_train.config.loading import load_config
    from dpo_train.logps.tiled_mlp import AUTO
    from dpo_train.precompute import precompute_reference
    from dpo_train.run import initial_policy
    from tests.train.reference.test_sidecar_guards import _precomputed_config

    tiles, apply = [], initial_policy.apply_setting

    def applied(model, *args):
        said = apply(model, *args)
        tiles.append(tile_of(model))
        return said

    monkeypatch.setattr(initial_policy, "apply_setting", applied)
    path, _ = _precomputed_config(
        tmp_path, small_dataset, smollm2_dir, train={"activation_checkpointing": checkpointing}
    )
    precompute_reference(load_config(path), progress=False)
    assert tiles == [AUTO if checkpointing else None]


@pytest.mark.parametrize("batching", ["pairs", "tokens"])
def test_a_tile_change_on_resume_is_elastic_in_either_batching(batching):
    """Like the logits budget, the tile only changes rounding: another tile (or none) resumes with a warning."""
    from dpo_state.state import identity_mismatches

    def identity(**layout) -> dict:
        return {"layout": {"batching": batching, "world_size": 1, "precision": "fp32", **layout}}

    mismatches, elastic = identity_mismatches(identity(), identity(mlp_tile_tokens=64))
    assert (mismatches, elastic) == ([], ["layout.mlp_tile_tokens: checkpoint <absent>, this run 64"])
    mismatches, elastic = identity_mismatches(identity(mlp_tile_tokens=64), identity())
    assert (mismatches, elastic) == ([], ["layout.mlp_tile_tokens: checkpoint 64, this run <absent>"])
