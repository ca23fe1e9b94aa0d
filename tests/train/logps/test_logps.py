"""Packed per-pair log-probs equal those of separate unpacked forwards (tiny random Llama, sdpa, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpo_data.dataset.store import PairIds
from dpo_data.loading.microbatch import pack_microbatch, pair_sums
from dpo_train.logps.pairs import pair_logps
from dpo_train.logps.scoring import Scoring
from tests.tiny import tiny_llama_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    spec = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    return tiny_llama_model(**spec, attn_implementation="sdpa").eval()


def random_pairs(n, seed=0):
    rng = np.random.default_rng(seed)
    ids = lambda k: rng.integers(0, 97, size=k).astype(np.int32)
    # Lengths include a one-token prompt and one-token completions.
    shapes = [(1, 1, 3), (7, 4, 1), (12, 9, 6), (3, 2, 2)][:n]
    return [PairIds(i, 0, ids(p), ids(c), ids(r)) for i, (p, c, r) in enumerate(shapes)]


def unpacked_logp(model, prompt, completion) -> float:
    ids = torch.tensor(np.concatenate([prompt, completion]), dtype=torch.long)[None]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
    n = len(prompt)
    return float(sum(logprobs[n - 1 + k, int(t)] for k, t in enumerate(completion)))


def test_packed_pair_logps_equal_separate_forwards(model):
    pairs = random_pairs(4)
    batch = pack_microbatch(pairs, pad_to_multiple_of=16)
    with torch.no_grad():
        out = pair_logps(model, batch, Scoring())
    expected_c = [unpacked_logp(model, p.prompt, p.chosen) for p in pairs]
    expected_r = [unpacked_logp(model, p.prompt, p.rejected) for p in pairs]
    torch.testing.assert_close(out.chosen, torch.tensor(expected_c), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.rejected, torch.tensor(expected_r), rtol=1e-5, atol=1e-5)
    assert out.chosen_tokens.tolist() == [len(p.chosen) for p in pairs]
    assert out.rejected_tokens.tolist() == [len(p.rejected) for p in pairs]


def test_pair_sums_ignore_padding_and_route_by_role():
    pairs = random_pairs(2)
    batch = pack_microbatch(pairs, pad_to_multiple_of=64)
    ones = torch.ones(batch["input_ids"].shape[1])
    sums = pair_sums(ones, batch)  # tokens per segment, padding excluded
    assert sums.tolist() == [[2.0, 4.0], [11.0, 8.0]]


def test_shared_prompt_layout_gives_the_separate_logps(model, monkeypatch):
    """[prompt][chosen][rejected] with the row's own mask (rejected sees the prompt, never chosen;
    positions continue the prompt) scores every pair as the separate layout does, one-token prompt and
    completions included; a mask that lets rejected see chosen is caught."""
    import dpo_train.attention.masks as masks_module
    from dpo_data.loading.microbatch import pack_shared_prompt

    pairs = random_pairs(4)
    with torch.no_grad():
        separate = pair_logps(model, pack_microbatch(pairs, pad_to_multiple_of=16), Scoring())
        shared_batch = pack_shared_prompt(pairs, pad_to_multiple_of=16)
        shared = pair_logps(model, shared_batch, Scoring())
    for name in ("chosen", "rejected"):
        torch.testing.assert_close(getattr(shared, name), getattr(separate, name), rtol=1e-5, atol=1e-5)
    assert shared.chosen_tokens.tolist() == separate.chosen_tokens.tolist()
    assert shared.rejected_tokens.tolist() == separate.rejected_tokens.tolist()
    assert shared_batch["input_ids"].shape[1] < pack_microbatch(pairs)["input_ids"].shape[1]

    def leaky(batch, queries=None, extra=0, layer=None):  # a pair's segments all see each other causally
        pair = torch.cat([batch["segment_pair"].long(), torch.tensor([-2])])
        segment = torch.repeat_interleave(torch.arange(len(batch["segment_length"])), batch["segment_length"].long())
        keys = torch.arange(len(segment))
        return (pair[segment][:, None] == pair[segment][None, :]) & (keys[None, :] <= keys[:, None])

    monkeypatch.setattr(masks_module, "segment_mask", leaky)
    with torch.no_grad():
        wrong = pair_logps(model, shared_batch, Scoring())
    assert (wrong.rejected - separate.rejected).abs().max() > 1e-3


@pytest.mark.parametrize("layout", ["separate", "shared_prompt"])
def test_segment_attention_gives_the_masked_sdpa_logps_and_gradients(model, layout, monkeypatch):
    """sdpa once per segment (no row-by-row mask) equals one sdpa over the row with its mask: per-pair
    log-probs and the gradient, one-token prompt and completions and a padding tail included. Aligning a
    completion's causal mask to its start instead of its end (it would not see its own prompt's last
    tokens) is caught."""
    import dpo_train.attention.segments as seg
    from dpo_data.loading.microbatch import pack_shared_prompt
    from dpo_train.attention.choice import attention_for
    from dpo_train.parallel.device import placement

    pairs = random_pairs(4)
    pack = pack_microbatch if layout == "separate" else pack_shared_prompt
    batch = pack(pairs, pad_to_multiple_of=16)
    assert batch["segment_pair"][-1] < 0  # a padding tail, a segment of its own

    def run():
        model.zero_grad()
        out = pair_logps(model, batch, Scoring())
        (out.chosen.sum() - 2 * out.rejected.sum()).backward()
        return out, torch.cat([p.grad.flatten() for p in model.parameters()])

    sdpa, sdpa_grad = run()
    assert attention_for("auto", placement("cpu", "fp32"), layout=layout) == seg.ATTENTION
    monkeypatch.setattr(model.config, "_attn_implementation", seg.ATTENTION)
    segments, segments_grad = run()
    for name in ("chosen", "rejected"):
        torch.testing.assert_close(getattr(segments, name), getattr(sdpa, name), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(segments_grad, sdpa_grad, rtol=1e-4, atol=1e-6)
    if layout == "shared_prompt":
        top_left = lambda q, k, layer: torch.ones(len(q), len(k), dtype=torch.bool).tril()  # not end-aligned
        monkeypatch.setattr(seg, "positions_visible", top_left)
        wrong, _ = run()
        assert (wrong.rejected - sdpa.rejected).abs().max() > 1e-3
    with pytest.raises(Exception, match="without the row's segments"):
        model(input_ids=batch["input_ids"], use_cache=False)


def unpacked_per_token(model, prompt, completion) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token) and log sum_v p(v)^2 at each completion token, in order, from the pair's own forward."""
    ids = torch.tensor(np.concatenate([prompt, completion]), dtype=torch.long)[None]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
    rows = logprobs[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    return rows[torch.arange(len(completion)), torch.as_tensor(completion).long()], torch.logsumexp(2 * rows, -1)


def test_ld_sums_and_wpo_weights_are_each_pairs_own_whatever_the_packing(model):
    """LD-DPO's sums (the first min(|c|, |r|) tokens of each completion fully, the rest times ld_alpha) and WPO's
    weights are those of each pair's own unpacked forward, packed several to a row or one per row, in the
    separate or the shared-prompt layout (whose completions' first targets come last in `targets`); one-token
    completions included."""
    pairs, ld_alpha = random_pairs(4), 0.3
    expected_ld, expected_weight = [], []
    for p in pairs:
        chosen, rejected = (
            unpacked_per_token(model, p.prompt, p.chosen),
            unpacked_per_token(model, p.prompt, p.rejected),
        )
        shared = min(len(p.chosen), len(p.rejected))
        sums = [float(logp[:shared].sum() + ld_alpha * logp[shared:].sum()) for logp, _ in (chosen, rejected)]
        expected_ld.append(sums)
        means = [float((logp - sq).mean()) for logp, sq in (chosen, rejected)]
        expected_weight.append(np.exp(means[0]) * np.exp(means[1]))
    expected_ld, expected_weight = torch.tensor(expected_ld), torch.tensor(expected_weight, dtype=torch.float32)
    assert all(len(p.chosen) != len(p.rejected) for p in pairs[:3])  # LD cuts a tail off each of these

    from dpo_data.loading.microbatch import pack_shared_prompt

    packings = {
        "separate, one row": [pack_microbatch(pairs, pad_to_multiple_of=16)],
        "shared_prompt, one row": [pack_shared_prompt(pairs, pad_to_multiple_of=16)],
        "separate, a row each": [pack_microbatch([p], pad_to_multiple_of=8) for p in pairs],
        "shared_prompt, a row each": [pack_shared_prompt([p]) for p in pairs],
    }
    for name, batches in packings.items():
        with torch.no_grad():
            outs = [pair_logps(model, batch, Scoring(), ld_alpha=ld_alpha, weighting=True) for batch in batches]
        ld = torch.cat([torch.stack(out.ld, dim=1) for out in outs])
        weights = torch.cat([out.weights for out in outs])
        torch.testing.assert_close(ld, expected_ld, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(weights, expected_weight, rtol=1e-5, atol=1e-7, msg=name)
        assert outs[0].scored[0] is outs[0].ld[0]  # the loss reads the LD sums


def test_ld_alpha_one_is_the_plain_sums_and_null_computes_nothing(model):
    """ld_alpha 1.0 is the plain sums bit for bit; the LD sums carry the gradient and the WPO weights none."""
    batch = pack_microbatch(random_pairs(4), pad_to_multiple_of=16)
    plain, one = pair_logps(model, batch, Scoring()), pair_logps(model, batch, Scoring(), ld_alpha=1.0, weighting=True)
    assert one.ld[0].requires_grad and one.ld[1].requires_grad and not one.weights.requires_grad
    assert plain.ld is None and plain.weights is None and plain.scored == (plain.chosen, plain.rejected)
    torch.testing.assert_close(torch.stack(one.ld), torch.stack([plain.chosen, plain.rejected]), rtol=0, atol=0)


def _ld_and_wpo(model, batch, mesh=None) -> dict:
    """LD sums (ld_alpha 0.3), WPO weights and the gradient of a fixed function of the LD sums (summed over the
    group's ranks, each holding its positions' part)."""
    from dpo_train.parallel import collectives

    model.zero_grad(set_to_none=True)
    out = pair_logps(model, batch, Scoring(), mesh, ld_alpha=0.3, weighting=True)
    (0.7 * out.ld[0] - 1.3 * out.ld[1]).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if mesh is not None:
        grads = {n: collectives.all_reduce(g, group=mesh.group) for n, g in grads.items()}
    return {"ld": torch.stack(out.ld).detach(), "weights": out.weights, **{f"grad/{n}": g for n, g in grads.items()}}


PER_TOKEN_MESHES = [(2, 1), (1, 2)]  # (ulysses, context) on 2 ranks


def _per_token_split_worker(rank: int, world: int, port: int, result: str) -> None:
    import torch.distributed as dist

    from dpo_data.loading.microbatch import pack_microbatch, pack_shared_prompt
    from dpo_train.attention.choice import attention_for
    from dpo_train.attention.sequence_parallel import sequence_mesh
    from dpo_train.parallel.device import placement
    from tests.harness import join_gloo
    from tests.train.attention.test_sequence_parallel import ROWS, _model

    join_gloo(rank, world, port)
    meshes = {(u, c): sequence_mesh(rank, world, u, c) for u, c in PER_TOKEN_MESHES}
    model = _model()
    model.config._attn_implementation = attention_for("auto", placement("cpu", "fp32"), meshes[(2, 1)])
    out = {}
    for name, pairs in ROWS.items():
        for layout, pack in (("separate", pack_microbatch), ("shared_prompt", pack_shared_prompt)):
            for (u, c), mesh in meshes.items():
                out[f"{name} {layout} U{u}C{c}"] = _ld_and_wpo(model, pack(pairs), mesh)
    if rank == 0:
        torch.save(out, result)
    dist.barrier()
    dist.destroy_process_group()


def test_ld_sums_and_wpo_weights_under_sequence_parallelism_are_one_process(tmp_path):
    """2-rank gloo meshes (Ulysses 2, context 2), rows cut inside chosen, on the boundary, inside rejected and
    with a pair across ranks, both layouts: LD sums, WPO weights and the LD sums' gradient equal one process
    (each rank weighs its own targets by their index in the whole completion)."""
    from dpo_data.loading.microbatch import pack_microbatch, pack_shared_prompt
    from tests.harness import spawn
    from tests.train.attention.test_sequence_parallel import ROWS, _model, _worst

    single = _model()
    result = tmp_path / "per-token.pt"
    spawn(_per_token_split_worker, 2, str(result))
    got = torch.load(result, weights_only=True)
    for name, pairs in ROWS.items():
        for layout, pack in (("separate", pack_microbatch), ("shared_prompt", pack_shared_prompt)):
            expected = _ld_and_wpo(single, pack(pairs))
            for u, c in PER_TOKEN_MESHES:
                worst = _worst(expected, got[f"{name} {layout} U{u}C{c}"])
                assert worst < 1e-5, (name, layout, u, c, worst)


def _old_head_slicing(monkeypatch):
    """transformers before `slice_logits_to_keep` (5.17 and older): the head indexes
    `hidden_states[:, logits_to_keep, :]`, which a 2-D boolean mask makes an IndexError."""
    from transformers import modeling_utils
    from transformers.models.llama import modeling_llama

    def sliced(hidden, keep):
        return hidden[:, slice(-keep, None) if isinstance(keep, int) else keep, :]

    monkeypatch.delattr(modeling_utils, "slice_logits_to_keep")
    monkeypatch.setattr(modeling_llama, "slice_logits_to_keep", sliced)


@pytest.mark.parametrize("unpack", [False, True], ids=["packed", "unpacked"])
def test_heads_that_index_hidden_states_by_the_mask_give_the_same_logps(model, monkeypatch, unpack):
    """A packed row keeps a 1-D mask, which every release's head takes; an unpacked batch on a release
    without `slice_logits_to_keep` keeps the columns any row keeps. Either way the log-probs are today's
    (before, both raised IndexError under 5.17's heads: the mask was always 2-D)."""
    scoring = Scoring(unpacked=unpack)
    batch = pack_microbatch(random_pairs(4), pad_to_multiple_of=16)
    with torch.no_grad():
        today = pair_logps(model, batch, scoring)
        _old_head_slicing(monkeypatch)
        old = pair_logps(model, batch, scoring)
    torch.testing.assert_close(old.chosen, today.chosen, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(old.rejected, today.rejected, rtol=1e-6, atol=1e-6)


def test_a_long_segments_sum_is_its_exact_sum_rounded_once():
    """2^20 float32 log-probs near -10.8 (a 1M-token segment beside a one-token one): the sum is the float64
    sum rounded to float32 once. A float32 running sum drifts by whole nats here (and on CUDA, where
    `index_add` adds in the order its atomics land, by different amounts in the policy's and the reference's
    pass: 3.6 nats apart at 64k tokens on an H200)."""
    from dpo_data.loading.microbatch import segment_sums

    g = torch.Generator().manual_seed(0)
    values = (-10.8 + torch.rand(1 << 20, generator=g)).float()
    segment = torch.cat([torch.zeros(1 << 20, dtype=torch.long), torch.ones(1, dtype=torch.long)])
    values = torch.cat([values, torch.tensor([-2.5])])
    got = segment_sums(values, segment, 2)
    exact = values[:-1].double().sum().float()
    assert got.dtype == torch.float32
    assert got.tolist() == [exact.item(), -2.5]
    drifting = torch.zeros(2).index_add(0, segment, values)  # the float32 accumulation this replaced
    assert abs(drifting[0].item() - exact.item()) > 1.0
