"""The start-up probe: a packed row of synthetic pairs must score as its sequences do unpacked, through eager."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from dpo_data.dataset.store import PairIds
from dpo_state.errors import ToolkitError
from dpo_train.attention import rope, segments, temperature
from dpo_train.attention.features import kind_attention, layer_kinds, model_config, text_config
from dpo_train.errors import ConfigError

TOLERANCE = 1e-5
"""Largest relative error of a pair's summed completion log-prob (fp32; the paths agree to about 1e-7)."""


def probe_pairs(model: Any) -> list[PairIds]:
    """Three pairs, one of them one token long each side, whose segments are longer than the smallest
    length threshold of the model (`thresholds`; capped at 48 tokens), so windows cut inside segments and
    across a shared prompt, and later segments sit past a row-position threshold. Token ids are drawn
    from the model's vocabulary with a fixed seed. Thresholds past the cap (Llama 4's real floor_scale,
    8192) are the step-1 parity guard's, on the run's own rows (dpo_train/reference/guard.py)."""
    span = min([*thresholds(model), 16])
    long = min(span + 4, 48)
    vocab = model.get_input_embeddings().num_embeddings
    rng = np.random.default_rng(0)
    media = _media_tokens(model)  # a vision-language model would look for the images of such a token

    def ids(k: int) -> np.ndarray:
        drawn = rng.integers(0, vocab, size=k)
        return np.where(np.isin(drawn, media), 0, drawn).astype(np.int32)

    shapes = [(long // 2 + 1, long, 3), (1, 1, 1), (3, long // 2, long)]
    return [PairIds(i, 0, ids(p), ids(c), ids(r)) for i, (p, c, r) in enumerate(shapes)]


def _media_tokens(model: Any) -> list[int]:
    """The token ids a vision-language model fills with image or video features (none for a text model)."""
    config = model_config(model)
    keys = ("image_token_id", "video_token_id", "image_token_index", "vision_start_token_id", "vision_end_token_id")
    return [int(v) for v in (getattr(config, k, None) for k in keys) if isinstance(v, int)]


def thresholds(model: Any) -> list[int]:
    """Every length at which the model's attention changes: windows, chunks, Llama 4's `floor_scale` (its
    NoPE layers' temperature), and rope scaling's original length (dynamic and long rope switch there)."""
    config = text_config(model)
    spans = [kind_attention(config, kind) for kind in set(layer_kinds(config))]
    sizes = [s for layer in spans for s in (layer.window, layer.chunk) if s]
    sizes += [int(m.floor_scale) for m in model.modules() if temperature.tuned(m)][:1]
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    original = rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None
    return [*sizes, *([int(original)] if original else [])]


@contextmanager
def eager_attention(model: Any) -> Iterator[None]:
    """Meanwhile, the model's decoder runs transformers' eager attention, or its sdpa where eager is known not
    to be the model (`dpo_train.attention.unpacked.eager_wrong`: Falcon with ALiBi); a vision-language model's
    tower keeps its own. A backward that recomputes checkpointed layers needs it too."""
    from dpo_train.attention.unpacked import eager_wrong

    config = text_config(model)
    saved, config._attn_implementation = config._attn_implementation, "sdpa" if eager_wrong(config) else "eager"
    try:
        yield
    finally:
        config._attn_implementation = saved


def eager_unpacked(model: Any, pairs: list[PairIds]) -> torch.Tensor:
    """[pairs, 2] completion log-prob sums, each (prompt + completion) run alone through the model's own
    eager attention (`eager_attention`) with no mask: what packing must reproduce."""
    device = next(model.parameters()).device
    sums = torch.zeros(len(pairs), 2, dtype=torch.float64)
    with eager_attention(model):
        for i, pair in enumerate(pairs):
            for j, completion in enumerate((pair.chosen, pair.rejected)):
                ids = torch.as_tensor(np.concatenate([pair.prompt, completion]), dtype=torch.long, device=device)
                logits = model(input_ids=ids[None], use_cache=False).logits[0].double()
                n = len(pair.prompt)
                picked = torch.log_softmax(logits[n - 1 : -1], -1).gather(1, ids[n:, None].long())
                sums[i, j] = picked.sum()
    return sums


def probe(model: Any, layout: str) -> float:
    """Refuse (ConfigError, exit 2) a model whose packed per-pair log-probs differ from unpacked eager,
    before step 1; returns the worst relative error. Runs without autograd in eval mode (a router's
    training jitter would differ between the two runs), in fp32 where the model is (on CPU, before it
    moves to its device). Under sequence parallelism or flash-attention (which need their group or
    CUDA) the packed side runs the segment attention: the probe then checks the model's layers, and
    the attention path itself is the zoo test's (tests/architectures/test_architectures.py). A model on the unpacked
    path (`dpo_train.attention.unpacked`) is probed on it: the row unpacked into a padded batch. A
    refusal names only the paths this probe found exact for the model; a model whose own code fails on
    the row is a ConfigError too, never a traceback."""
    from dpo_train.attention.unpacked import runs_unpacked

    config = text_config(model)  # a vision-language model: its decoder's (the probe's rows are text)
    saved, training = config._attn_implementation, model.training
    tried = checkable(saved)
    label = f"unpacked ({saved})" if runs_unpacked(model) else saved
    pairs = probe_pairs(model)
    rope.check_rotary(model)  # a rope's length thresholds, however long: the rotary module alone
    model.eval()
    try:
        truth = _named(model, "run unpacked through eager", lambda: eager_unpacked(model, pairs))
        run = lambda: _packed_error(model, tried, layout, pairs, truth)
        got, error = _named(model, f"run a packed row under attention {label}", run, layout, truth)
        worst = float(error.detach().max())  # the probe needs no graph; float() of one warns
        if worst <= TOLERANCE:
            return worst
        advice = _advice(model, tried, layout, pairs, truth)
    finally:
        config._attn_implementation = saved
        model.train(training)
    pair, side = divmod(int(error.argmax()), 2)
    raise ConfigError(
        f"{type(model).__name__} under attention {label} with data.layout {layout}: the start-up probe's "
        f"packed row gives pair {pair}'s {('chosen', 'rejected')[side]} log-prob {float(got[pair, side]):.6f}, run "
        f"unpacked through eager {float(truth[pair, side]):.6f} (relative error {worst:.1e} > {TOLERANCE:.0e}): "
        f"packing would train on wrong numbers; {advice}. Supported architectures: docs/train-config.md; "
        "train.probe_packing: false skips this check at your own risk"
    )


def checkable(attention: str | None) -> str:
    """The attention a start-up check runs in this one process: the run's own where it can (eager, sdpa, the
    segment attention), else the segment attention (sequence parallelism needs its group, flash-attention
    CUDA), registered."""
    segments.register()
    return attention if attention in ("eager", "sdpa", segments.ATTENTION) else segments.ATTENTION


def _named(model: Any, what: str, call: Any, layout: str | None = None, truth: torch.Tensor | None = None):
    """`call()`, with a failure of the model's own code (transformers raising inside a model that cannot
    run this way) turned into a ConfigError naming the model, what failed and what runs instead."""
    saved = text_config(model)._attn_implementation
    try:
        return call()
    except ToolkitError:
        raise
    except Exception as e:  # noqa: BLE001 - any model transformers builds: a named error, never a traceback
        said = " ".join(str(e).split())[:200]
        tried = text_config(model)._attn_implementation
        advice = _advice(model, tried, layout, probe_pairs(model), truth) if truth is not None else ""
        raise ConfigError(
            f"{type(model).__name__} cannot {what} ({type(e).__name__}: {said}); "
            f"{advice or 'it does not run as transformers models do'}. Supported architectures: docs/train-config.md"
        ) from None
    finally:
        text_config(model)._attn_implementation = saved


def _advice(model: Any, tried: str, layout: str, pairs: list[PairIds], truth: torch.Tensor) -> str:
    """What to run instead: the packed paths exact on this probe, else the unpacked path (the model's own
    attention over each sequence alone); a model already unpacked has nothing else to try."""
    from dpo_train.attention.unpacked import runs_unpacked

    if runs_unpacked(model):
        return "the unpacked path itself differs from the model run alone: report the model"
    exact = [name for name, path in _PATHS.items() if path != tried and _exact(model, path, layout, pairs, truth)]
    if exact:
        return f"use model.attention {' or '.join(exact)} (exact on this probe)"
    return "no packed path is exact for it: use model.attention unpacked (each sequence alone, padded)"


_PATHS = {"segments": segments.ATTENTION, "eager": "eager", "sdpa": "sdpa"}  # model.attention -> implementation


def _packed_error(model: Any, path: str, layout: str, pairs: list[PairIds], truth: torch.Tensor):
    """The packed row's [pairs, 2] log-probs under `path` and their relative errors against `truth`."""
    from dpo_data.loading.microbatch import pack_microbatch, pack_shared_prompt
    from dpo_train.attention.logps import pair_logps

    text_config(model)._attn_implementation = path
    pack = pack_shared_prompt if layout == "shared_prompt" else pack_microbatch
    device = next(model.parameters()).device
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in pack(pairs, pad_to_multiple_of=8).items()}
    with torch.no_grad():
        out = pair_logps(model, batch)
    got = torch.stack([out.chosen, out.rejected], dim=1).double().cpu()
    return got, (got - truth).abs() / truth.abs().clamp(min=1e-6)


def _exact(model: Any, path: str, layout: str, pairs: list[PairIds], truth: torch.Tensor) -> bool:
    """Whether the packed row is exact under `path` (a path that fails to run is not)."""
    try:
        return float(_packed_error(model, path, layout, pairs, truth)[1].max()) <= TOLERANCE
    except Exception:  # noqa: BLE001 - any failure of another path only means it is not suggested
        return False
