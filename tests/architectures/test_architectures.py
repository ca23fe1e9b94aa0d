"""Every zoo architecture, on every attention path and layout, scores each pair as eager unpacked, or is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dpo_data.loading.microbatch import pack_microbatch, pack_shared_prompt
from dpo_train.attention.kernel import positions_visible
from dpo_train.config.sections import ModelConfig
from dpo_train.errors import ConfigError, ModelError
from dpo_train.logps.probe import eager_unpacked
from dpo_train.logps.scoring import Scoring
from tests import docs_blocks
from tests.architectures.zoo import (
    AUTO_FALLBACK,
    COLUMNS,
    PATH_REFUSED,
    REFUSED,
    SHARED_PROMPT_UNPACKED,
    UNPACKED,
    ZOO,
    features_of,
    flash_cell,
    model_spec,
    pairs,
    relative_error,
    render_table,
    router_loss_default,
)
from tests.harness import join_gloo, spawn

PATHS = ("auto", "segments", "sdpa", "eager", "unpacked")
LAYOUTS = {"separate": pack_microbatch, "shared_prompt": pack_shared_prompt}
TOLERANCE = 1e-5  # relative, per pair; fp32 paths agree to about 1e-7
DOCS = docs_blocks.DOCS / "train-config.md"


def _loaded(model_type: str, path: str, layout: str, mesh=None):
    """The model as `load_model` loads it, and whether its rows run unpacked."""
    from dpo_train.model.load import load_model
    from dpo_train.parallel.device import placement

    spec = ModelConfig(init={"config": model_spec(model_type), "seed": 0})
    return load_model(spec, path, placement("cpu", "fp32"), mesh, layout)


def _load(model_type: str, path: str, layout: str, mesh=None):
    return _loaded(model_type, path, layout, mesh)[0]


def path_results(model_type: str, device: str = "cpu") -> dict[str, str | float]:
    """(path, layout) -> the worst pair's relative error against eager unpacked, or the refusal's message
    (on `device`: scripts/device_check.py runs it on CUDA). A path that fails on the row, or auto off the truth,
    meets the start-up probe as a run would: auto then takes the path the probe checked, another is refused."""

    from dpo_train.logps.pairs import pair_logps
    from dpo_train.logps.probe import probe

    out, truth, batch_pairs = {}, None, pairs()
    for path in PATHS:
        for layout, pack in LAYOUTS.items():
            try:
                model, unpacked = _loaded(model_type, path, layout)
            except ConfigError as e:
                out[f"{path} {layout}"] = str(e)
                continue
            model.to(device).eval()  # as the probe and the reference score (Seed-OSS has residual dropout)
            truth = eager_unpacked(model, batch_pairs) if truth is None else truth
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in pack(batch_pairs, 16).items()}
            try:
                with torch.no_grad():
                    error = relative_error(pair_logps(model, batch, Scoring(unpacked=unpacked)), truth)
            except ModelError:
                error = float("inf")
            if error >= TOLERANCE:  # as at start-up: auto falls back to a checked path, another path is refused
                try:
                    unpacked = probe(model, layout, path, unpacked).unpacked
                except ConfigError as e:
                    out[f"{path} {layout}"] = str(e)
                    continue
                with torch.no_grad():
                    error = relative_error(pair_logps(model, batch, Scoring(unpacked=unpacked)), truth)
            out[f"{path} {layout}"] = error
    return out


def _expect(results: dict, model_type: str, refused_paths=()) -> None:
    for key, value in results.items():
        path, layout = key.split()[0], key.split()[-1]
        refused = PATH_REFUSED.get((model_type, path, layout)) or PATH_REFUSED.get((model_type, path))
        reason = REFUSED.get(model_type) or (refused if path in refused_paths else None)
        if model_type in UNPACKED and path not in ("auto", "unpacked"):  # every packing path, sequence parallel too
            reason = UNPACKED[model_type]
        if key.endswith("shared_prompt") and model_type in SHARED_PROMPT_UNPACKED and path not in ("auto", "unpacked"):
            reason = SHARED_PROMPT_UNPACKED[model_type]
        if model_type in AUTO_FALLBACK and path in ("ulysses", "context"):  # auto's fallback needs no group
            reason = AUTO_FALLBACK[model_type][2]
        if path == "unpacked":  # the model's own attention, sdpa or eager: exact for every model
            reason = None
        if reason:
            assert isinstance(value, str) and reason in value, f"{model_type} {key}: expected a refusal, got {value}"
        else:
            assert not isinstance(value, str), f"{model_type} {key} refused: {value}"
            assert value < TOLERANCE, f"{model_type} {key}: a pair's log-prob is off by {value:.2e} relative"


RESULTS: dict[str, dict] = {}  # model_type -> path_results, kept for the docs table


def results_of(model_type: str) -> dict:
    if model_type not in RESULTS:
        RESULTS[model_type] = path_results(model_type)
    return RESULTS[model_type]


@pytest.mark.parametrize("model_type", sorted(ZOO))
def test_every_path_and_layout_equals_eager_unpacked_or_is_refused(model_type):
    _expect(results_of(model_type), model_type, refused_paths=("segments", "sdpa", "eager"))


def test_the_zoo_has_the_windows_and_features_it_claims():
    """The check above proves something only if windows cut inside the segments and each feature is on."""
    from dpo_train.attention.features import model_attention

    shortest = min(min(len(p.prompt) + len(p.chosen), len(p.prompt) + len(p.rejected)) for p in pairs()[:1])
    assert shortest > 2 * ZOO["mistral"]["sliding_window"]
    needs = {name: model_attention(_load(name, "auto", "separate")).needs() for name in ZOO if name not in UNPACKED}
    assert "sliding window" in needs["gemma3_text"] and "sliding window" in needs["qwen2"]
    assert {"chunked attention", "temperature tuning"} <= set(needs["llama4_text"])
    assert {"attention logit softcapping", "sliding window"} <= set(needs["gemma2"])
    assert {"attention sinks", "sliding window"} <= set(needs["gpt_oss"])
    assert needs["llama"] == {}
    from dpo_train.attention.features import ATTENTION_KINDS, layer_kinds
    from dpo_train.attention.unpacked import alibi

    for name in UNPACKED:  # a hybrid has both kinds of layer (falcon_h1, zamba2: "hybrid" layers hold both)
        config = _load(name, "unpacked", "separate").config
        kinds = set(layer_kinds(config))
        if alibi(config):
            assert kinds == {"full_attention"}, name
        else:
            assert kinds - set(ATTENTION_KINDS) and (kinds & set(ATTENTION_KINDS) or "hybrid" in kinds), (name, kinds)


def test_a_dropped_window_is_caught(monkeypatch):
    """The broken variant: the segment attention ignoring each layer's window (as it did) fails the check."""
    from dpo_train.attention import features

    real = features.call_attention
    monkeypatch.setattr(
        "dpo_train.attention.segments.call_attention",
        lambda module, path, kwargs: (features.LayerAttention(), real(module, path, kwargs)[1]),
    )
    results = path_results("mistral")  # the path's numbers are off, so the start-up probe refuses it, by name
    assert all("packing would train on wrong numbers" in results[f"segments {layout}"] for layout in LAYOUTS)


def test_a_path_that_cannot_express_a_feature_is_refused_by_name():
    from dpo_train.attention.choice import fit_model
    from dpo_train.attention.segments import ATTENTION

    with pytest.raises(ConfigError, match=r"model.attention sdpa: transformers refuses it .*use model.attention auto"):
        _load("gemma2", "sdpa", "separate")
    for model_type, feature in (("llama4_text", "chunked attention"), ("gpt_oss", "attention sinks")):
        model = _load(model_type, "segments", "separate")
        model.config._attn_implementation = "flash_attention_2"  # as on CUDA; fit_model reads the config only
        with pytest.raises(ConfigError, match=f"flash_attention_2 cannot express {feature} .*layer 0 of"):
            fit_model(model, "flash_attention_2", "separate")
        assert fit_model(model, "auto", "separate") == ATTENTION == model.config._attn_implementation


def test_an_attention_keyword_a_path_does_not_know_is_an_error():
    from dpo_train.attention.segments import row_segments, segment_attention
    from dpo_train.errors import ModelError

    batch = pack_microbatch(pairs())
    q = torch.zeros(1, 4, batch["input_ids"].shape[1], 16)
    with pytest.raises(ModelError, match="segments got keyword argument.s. dropout_rng"):
        segment_attention(None, q, q, q, None, row_segments=row_segments(batch), dropout_rng=1)


def _sp_models(rank: int, world: int):
    """((model type, mesh name, layout), the model in eval mode or its refusal, the mesh, the layout's packer,
    eager unpacked's log-probs) for every zoo architecture under Ulysses 2 and context 2, in this rank's group."""
    from dpo_train.attention.sequence_parallel import check_heads, sequence_mesh

    meshes = {"ulysses 2": sequence_mesh(rank, world, 2, 1), "context 2": sequence_mesh(rank, world, 1, 2)}
    for model_type in sorted(ZOO):
        truth = None
        for name, mesh in meshes.items():
            for layout, pack in LAYOUTS.items():
                key = (model_type, name, layout)
                try:
                    model = _load(model_type, "auto", layout, mesh)
                    check_heads(model.config, mesh.ulysses)  # as at start-up: Ulysses splits the heads
                except ConfigError as e:
                    yield key, str(e), mesh, pack, truth
                    continue
                model.eval()  # as the reference scores (Seed-OSS has residual dropout)
                truth = eager_unpacked(model, pairs()) if truth is None else truth
                yield key, model, mesh, pack, truth


def _sp_worker(rank: int, world: int, port: int, result: str) -> None:
    import torch.distributed as dist

    from dpo_train.logps.pairs import pair_logps
    from dpo_train.logps.probe import probe

    join_gloo(rank, world, port)
    out = {}
    for key, model, mesh, pack, truth in _sp_models(rank, world):
        if isinstance(model, str):
            out[" ".join(key)] = model
            continue
        try:
            with torch.no_grad():
                error = relative_error(pair_logps(model, pack(pairs()), Scoring(), mesh), truth)
            if error >= TOLERANCE:  # as at start-up: the probe refuses what packing gets wrong (RWKV)
                probe(model, key[2], "auto")
            out[" ".join(key)] = error
        except (ModelError, ConfigError) as e:  # layers that pass no shard or window, or a leak: refused by name
            out[" ".join(key)] = str(e)
    if rank == 0:
        torch.save(out, result)
    dist.barrier()
    dist.destroy_process_group()


BLOCKED_GRADIENTS = ("llama", "gemma2", "gpt_oss", "llama4_text")  # plain; softcap and windows; sinks; chunks


def _sp_blocked_worker(rank: int, world: int, port: int, result: str) -> None:
    """Every architecture under Ulysses 2 and context 2 with each rank's [queries, row] mask made a block of 3
    query rows at a time (MASK_LIMIT 0), against eager unpacked; and, for BLOCKED_GRADIENTS, each rank's
    gradient through the blocks (each recomputed in backward) against its gradient through the whole mask."""
    import torch.distributed as dist

    from dpo_train.attention import segments
    from dpo_train.attention.sequence_parallel import SequenceShard
    from dpo_train.logps.pairs import pair_logps

    join_gloo(rank, world, port)
    calls, block = [], SequenceShard._block
    SequenceShard._block = lambda self, *a: calls.append(a[0].shape[-2]) or block(self, *a)
    weights = torch.tensor([[1.0, -0.5], [0.3, 0.2], [-1.0, 0.7]])

    def gradient(model, mesh) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        out = pair_logps(model, pack_microbatch(pairs()), Scoring(), mesh)
        (torch.stack([out.chosen, out.rejected], 1) * weights).sum().backward()
        return torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
        )

    out = {}
    for (model_type, name, layout), model, mesh, pack, truth in _sp_models(rank, world):
        if isinstance(model, str) or model_type in AUTO_FALLBACK:
            continue  # refused as in _sp_worker (auto's fallbacks too: their layers take no shard): nothing to block
        limit, block_rows = segments.MASK_LIMIT, segments.BLOCK_ROWS
        segments.MASK_LIMIT, segments.BLOCK_ROWS = 0, 3
        try:
            with torch.no_grad():
                out[f"{model_type} {name} {layout}"] = relative_error(
                    pair_logps(model, pack(pairs()), Scoring(), mesh), truth
                )
            if model_type in BLOCKED_GRADIENTS and layout == "separate":
                blocked = gradient(model, mesh)
                segments.MASK_LIMIT = limit
                whole = gradient(model, mesh)
                out[f"{model_type} {name} gradient"] = float((blocked - whole).norm() / whole.norm())
        finally:
            segments.MASK_LIMIT, segments.BLOCK_ROWS = limit, block_rows
    out["block rows"] = sorted(set(calls))
    if rank == 0:
        torch.save(out, result)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_sequence_parallel_long_rows_attend_in_blocks_of_query_rows(tmp_path):
    """Past MASK_LIMIT a rank never holds its whole [queries, row] mask: blocks of query rows, each with its own
    mask, recomputed in backward. Every architecture Ulysses and context parallelism run scores each pair as
    eager unpacked in blocks of 3 rows, and the gradients through the blocks are the whole mask's."""
    spawn(_sp_blocked_worker, 2, str(tmp_path / "out.pt"))
    results = torch.load(tmp_path / "out.pt", weights_only=True)
    rows = results.pop("block rows")
    assert rows and max(rows) == 3, rows  # blocks of 3 query rows (a last one shorter) were attended
    gradients = {k: v for k, v in results.items() if k.endswith("gradient")}
    assert len(gradients) == 2 * len(BLOCKED_GRADIENTS), gradients
    assert all(v < 1e-5 for v in gradients.values()), gradients
    scored = {k: v for k, v in results.items() if not k.endswith("gradient")}
    assert len(scored) > 2 * len(ZOO), "too few architectures ran sequence-parallel"
    assert all(v < TOLERANCE for v in scored.values()), {k: v for k, v in scored.items() if v >= TOLERANCE}


def table_rows(sequence_parallel: dict) -> dict:
    """The docs table's rows from this module's results (run here when not yet run)."""
    rows = {}
    for model_type in ZOO:
        model = _load(model_type, "unpacked" if model_type in UNPACKED else "auto", "separate")
        results = results_of(model_type)
        features = [features_of(model), *AUTO_FALLBACK.get(model_type, ("", ""))[1:2]]
        row = {"class": type(model).__name__, "features": "; ".join(f for f in features if f)}
        row["flash"] = flash_cell(model, model_type in REFUSED, model_type in UNPACKED, AUTO_FALLBACK.get(model_type))
        row["router"] = model_type not in UNPACKED and router_loss_default(model)
        unpacked_auto = model_type in UNPACKED or AUTO_FALLBACK.get(model_type, ("",))[0] == "unpacked"
        row["ran_unpacked"] = {"unpacked", "auto"} if unpacked_auto else {"unpacked"}
        for column in COLUMNS:
            source = sequence_parallel if column in ("ulysses 2", "context 2") else results
            prefix = f"{model_type} {column} " if source is sequence_parallel else f"{column} "
            row[column] = [v for k, v in source.items() if k.startswith(prefix)]
        rows[model_type] = row
    return rows


@pytest.mark.slow
def test_sequence_parallel_equals_eager_unpacked_for_every_architecture(tmp_path):
    """Ulysses 2 and context 2 (two gloo processes, every architecture inside them); then the docs'
    supported-architectures table must be what this module measured (regenerate it with
    `python -m tests.architectures.test_architectures`)."""
    spawn(_sp_worker, 2, str(tmp_path / "out.pt"))
    results = torch.load(tmp_path / "out.pt", weights_only=True)
    for model_type in ZOO:
        mine = {k.split(" ", 1)[1]: v for k, v in results.items() if k.startswith(model_type + " ")}
        _expect(mine, model_type, refused_paths=("ulysses",))
    assert docs_blocks.read_block(DOCS, "architectures") == render_table(table_rows(results)), (
        "regenerate: python -m tests.architectures.test_architectures"
    )


if __name__ == "__main__":  # regenerate the docs table from a fresh run of every check above
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spawn(_sp_worker, 2, str(Path(tmp) / "out.pt"))
        rows = table_rows(torch.load(Path(tmp) / "out.pt", weights_only=True))
        docs_blocks.write_block(DOCS, "architectures", render_table(rows))
    print(f"wrote the supported-architectures table into {DOCS}")


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss", "llama4_text"])
def test_gradients_through_softcap_sinks_and_chunks_equal_eager_unpacked(model_type):
    """The eager math our paths use for softcap and sinks (and the chunk masks) is differentiated as the
    model's own eager attention is: the gradient of a fixed function of the pair log-probs agrees."""
    from dpo_train.logps.pairs import pair_logps

    model, batch_pairs = _load(model_type, "segments", "shared_prompt"), pairs()
    weights = torch.tensor([[1.0, -0.5], [0.3, 0.2], [-1.0, 0.7]], dtype=torch.float64)

    def gradient(objective) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        objective().backward()
        return torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
        )

    def packed():
        out = pair_logps(model, pack_shared_prompt(batch_pairs), Scoring())
        return (torch.stack([out.chosen, out.rejected], 1).double() * weights).sum()

    def unpacked():  # the probe's truth, differentiated
        return (eager_unpacked(model, batch_pairs) * weights).sum()

    ours, truth = gradient(packed), gradient(unpacked)
    assert float((ours - truth.float()).norm() / truth.norm()) < 1e-4


def _long_segments(monkeypatch) -> list:
    """Every segment "long" (MASK_LIMIT 0) and blocks of 3 query rows (BLOCK_ROWS: cutting inside windows and
    chunks); returns the list each block's query row count is appended to."""
    from dpo_train.attention import segments

    monkeypatch.setattr(segments, "MASK_LIMIT", 0)
    monkeypatch.setattr(segments, "BLOCK_ROWS", 3)
    blocks, block = [], segments._block
    monkeypatch.setattr(segments, "_block", lambda *a: blocks.append(a) or block(*a))
    return blocks


@pytest.mark.parametrize(
    "layout, model_type",
    [
        (layout, model_type)
        for layout in sorted(LAYOUTS)
        for model_type in sorted(set(ZOO) - set(UNPACKED) - set(AUTO_FALLBACK))  # those cannot take segments
        if not (layout == "shared_prompt" and model_type in SHARED_PROMPT_UNPACKED)  # unpacked there
    ],
)
def test_long_segments_run_without_their_square_mask_and_equal_eager_unpacked(model_type, layout, monkeypatch):
    """Past MASK_LIMIT (0 here: every segment) a shared-prompt completion of a plain layer runs as one causal
    sequence with its prompt, and a windowed or chunked segment's mask is made a block of query rows at a
    time; a full-causal model makes no mask at all, a windowed or chunked one no whole mask. Either way each
    pair's log-probs are eager unpacked's."""
    from dpo_train.attention import segments
    from dpo_train.logps.pairs import pair_logps

    blocks = _long_segments(monkeypatch)
    made = []
    monkeypatch.setattr(segments, "positions_visible", lambda *a: made.append(a) or positions_visible(*a))
    model, batch_pairs = _load(model_type, "segments", layout).eval(), pairs()
    with torch.no_grad():
        got = pair_logps(model, LAYOUTS[layout](batch_pairs, 16), Scoring())
    assert relative_error(got, eager_unpacked(model, batch_pairs)) < TOLERANCE
    rows = [(len(queries), layer) for queries, _, layer in made]
    if features_of(model) == "full causal" and layout == "shared_prompt":
        assert rows == [], f"{model_type}: masks of {rows} query rows"
    if any(layer.restricts_keys for _, layer in rows):  # a windowed or chunked layer: blocks of 3 rows
        assert blocks and all(n <= 3 for n, layer in rows if layer.restricts_keys), f"{model_type}: {rows}"
    if _eager(model):  # soft-capped or sink layers, windowed or not: their square scores in blocks of 3 rows too
        assert any(_eager_block(b) and not b[5].restricts_keys for b in blocks), f"{model_type}: no full block"
        assert all(n <= 3 for n, _ in rows), f"{model_type}: {rows}"


def _eager(model) -> bool:
    """Whether some layer takes the eager math (softcap or sinks): the zoo's soft-capped and sink models."""
    return any(word in features_of(model) for word in ("softcapping", "sinks"))


def _eager_block(block: tuple) -> bool:
    """A `segments._block` call's arguments (q, k, v, own, keys, layer, scaling, sinks, dropout): eager math?"""
    return block[5].softcap is not None or block[7] is not None


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_long_eager_segments_are_recomputed_a_block_at_a_time(model_type, monkeypatch):
    """A soft-capped or sink layer's scores are as square as a mask: past MASK_LIMIT its blocks of query rows run
    under a checkpoint, so that no block's scores are kept for backward, which makes each block again."""
    from dpo_train.logps.pairs import pair_logps

    blocks = _long_segments(monkeypatch)
    model = _load(model_type, "segments", "shared_prompt")
    out = pair_logps(model, pack_shared_prompt(pairs()), Scoring())
    forward = sum(map(_eager_block, blocks))
    (out.chosen.sum() - out.rejected.sum()).backward()
    again = sum(map(_eager_block, blocks)) - forward
    assert forward > 0 and all(len(b[3]) <= 3 for b in blocks), forward
    assert again == forward, f"backward remade {again} of the {forward} eager blocks"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "llama4_text", "gemma2", "gpt_oss"])
def test_gradients_of_long_segments_equal_eager_unpacked(model_type, monkeypatch):
    """The causal form's gradients (the prompt's query rows recomputed, their outputs dropped) and the blocked
    masks' and of the eager blocks (recomputed in backward) are eager unpacked's, on plain, windowed, chunked,
    soft-capped and sink models."""
    _long_segments(monkeypatch)
    test_gradients_through_softcap_sinks_and_chunks_equal_eager_unpacked(model_type)


def test_a_window_longer_than_every_segment_stays_maskless_past_the_limit(monkeypatch):
    """A windowed layer that hides no key of a segment keeps sdpa's maskless kernel, long or not: the blocks
    are for windows that cut, never a masked detour for one that does not."""
    from dpo_train.attention import segments
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.model.load import load_model
    from dpo_train.parallel.device import placement

    blocks = _long_segments(monkeypatch)
    made = []
    monkeypatch.setattr(segments, "positions_visible", lambda *a: made.append(a) or positions_visible(*a))
    spec = ModelConfig(init={"config": {**model_spec("mistral"), "sliding_window": 200}, "seed": 0})
    model, batch_pairs = load_model(spec, "segments", placement("cpu", "fp32"), None, "separate")[0].eval(), pairs()
    with torch.no_grad():
        got = pair_logps(model, pack_microbatch(batch_pairs, 16), Scoring())
    assert relative_error(got, eager_unpacked(model, batch_pairs)) < TOLERANCE
    assert blocks == [] and made == []
