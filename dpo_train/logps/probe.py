"""The start-up probe: a packed row of synthetic pairs must score as its sequences do unpacked, through eager."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dpo_data.dataset.store import PairIds
from dpo_data.loading.microbatch import PackedRow, pack_microbatch, pack_shared_prompt
from dpo_data.progress import say
from dpo_state.errors import ToolkitError
from dpo_train.attention import rope, segments, sequence_parallel, temperature, unpacked
from dpo_train.attention.choice import checkable, expresses
from dpo_train.attention.features import (
    attention_as,
    computes_router_loss,
    kind_attention,
    layer_kinds,
    model_config,
    text_config,
)
from dpo_train.attention.unpacked import eager_attention
from dpo_train.errors import ConfigError, ModelError
from dpo_train.logps.pairs import pair_logps
from dpo_train.logps.scoring import Scoring

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


@dataclass(frozen=True)
class Probed:
    """What the start-up probe found: the worst relative error of the path that passed, and whether the model's
    rows run unpacked from now on (as loaded, or auto's fallback to the unpacked path: `Scoring.unpacked`)."""

    error: float
    unpacked: bool


def probe(model: Any, layout: str, requested: str | None = None, unpacked_rows: bool = False) -> Probed:
    """Refuse (ConfigError, exit 2) a model whose packed per-pair log-probs differ from unpacked eager,
    before step 1; returns the worst relative error and whether its rows run unpacked (`unpacked_rows`: they did
    as loaded, `load_model`'s answer). Runs without autograd in eval mode (a router's
    training jitter would differ between the two runs), in fp32 where the model is (on CPU, before it
    moves to its device). Under sequence parallelism or flash-attention (which need their group or
    CUDA) the packed side runs the segment attention: the probe then checks the model's layers, and
    the attention path itself is the zoo test's (tests/architectures/test_architectures.py). A model on the unpacked
    path (`dpo_train.attention.unpacked`, `unpacked_rows`) is probed on it: the row unpacked into a padded batch.

    Where the run's path fails or differs, the other paths are tried on the same row (segments, sdpa, eager,
    then unpacked). Under `requested` auto the model then takes the first exact one, saying so once (StableLM's
    layers pass no segments to their attention; sdpa and eager are exact for it); otherwise the refusal names
    only the paths found exact here, or says that none is. A model whose own code fails on the row is a
    ConfigError too, never a traceback."""
    config = text_config(model)  # a vision-language model: its decoder's (the probe's rows are text)
    saved, training = config._attn_implementation, model.training
    tried = checkable(saved)
    label = f"unpacked ({saved})" if unpacked_rows else saved
    pairs = probe_pairs(model)
    rope.check_rotary(model)  # a rope's length thresholds, however long: the rotary module alone
    model.eval()
    try:
        truth = _named(model, "run unpacked through eager", lambda: eager_unpacked(model, pairs))
        got = error = failure = None
        try:
            got, error = _packed_error(model, tried, layout, pairs, truth, Scoring(unpacked=unpacked_rows))
        except ModelError as e:  # the model's layers cannot take the path (StableLM passes no segments)
            failure = str(e).split(";")[0]
        except ToolkitError:
            raise
        except Exception as e:  # noqa: BLE001 - any model transformers builds: a named error, never a traceback
            failure = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        worst = float(error.detach().max()) if error is not None else float("inf")
        if worst <= TOLERANCE:
            return Probed(worst, unpacked_rows)
        exact = [] if unpacked_rows else _exact_paths(model, tried, layout, pairs, truth)
        if requested == "auto" and exact and saved != sequence_parallel.ATTENTION:
            saved = _switch(model, exact[0], f"{failure or f'off by {worst:.1e} relative'} under {label}")
            return Probed(0.0, exact[0] == unpacked.ATTENTION)
    finally:
        config._attn_implementation = saved
        model.train(training)
    advice = _advice(exact, unpacked_rows)
    if failure is not None:
        raise ConfigError(
            f"{type(model).__name__} cannot run a packed row under attention {label} with data.layout {layout} "
            f"({failure}); {advice}. Supported architectures: docs/train-config.md"
        )
    pair, side = divmod(int(error.argmax()), 2)
    raise ConfigError(
        f"{type(model).__name__} under attention {label} with data.layout {layout}: the start-up probe's "
        f"packed row gives pair {pair}'s {('chosen', 'rejected')[side]} log-prob {float(got[pair, side]):.6f}, run "
        f"unpacked through eager {float(truth[pair, side]):.6f} (relative error {worst:.1e} > {TOLERANCE:.0e}): "
        f"packing would train on wrong numbers; {advice}. Supported architectures: docs/train-config.md; "
        "train.probe_packing: false skips this check at your own risk"
    )


def _switch(model: Any, name: str, why: str) -> str:
    """The implementation name of the path `name` (auto's fallback), which the model then runs; says so once (the
    unpacked path is then the caller's `Probed.unpacked`)."""
    implementation = _PATHS.get(name, "sdpa")
    if name == unpacked.ATTENTION:
        implementation = unpacked.default_attention(model)
    if os.environ.get("RANK", "0") == "0":
        say(
            f"note: {type(model).__name__}: model.attention auto takes {name}: the run's path could not score the "
            f"start-up probe's packed row ({why}), {name} scored it as each sequence alone (docs/train-config.md)"
        )
    return implementation


def _advice(exact: list[str], unpacked_rows: bool) -> str:
    """What to run instead: the paths exact on this probe (each tried on its row), or plainly none."""
    if unpacked_rows:
        return "the unpacked path itself differs from the model run alone: report the model"
    if exact:
        return f"use model.attention {' or '.join(exact)} (exact on this probe)"
    return "no path of this toolkit (segments, sdpa, eager, unpacked) is exact for it on this probe: report the model"


def _named(model: Any, what: str, call: Any):
    """`call()`, with a failure of the model's own code (transformers raising inside a model that cannot
    run this way) turned into a ConfigError naming the model and what failed."""
    saved = text_config(model)._attn_implementation
    try:
        return call()
    except ToolkitError:
        raise
    except Exception as e:  # noqa: BLE001 - any model transformers builds: a named error, never a traceback
        said = " ".join(str(e).split())[:200]
        raise ConfigError(
            f"{type(model).__name__} cannot {what} ({type(e).__name__}: {said}); it does not run as transformers "
            "models do. Supported architectures: docs/train-config.md"
        ) from None
    finally:
        text_config(model)._attn_implementation = saved


_PATHS = {"segments": segments.ATTENTION, "sdpa": "sdpa", "eager": "eager"}  # model.attention -> implementation


def _exact_paths(model: Any, tried: str, layout: str, pairs: list[PairIds], truth: torch.Tensor) -> list[str]:
    """The paths other than `tried` that score the probe's row exactly and express every feature of the model's
    attention (`dpo_train.attention.choice.EXPRESSES`), in auto's order of preference: segments, sdpa, eager,
    unpacked (unpacked first where the model's default router loss rules out sdpa and eager)."""
    batch = _row(model, layout, pairs)
    found = [name for name in paths_for(model) if _PATHS.get(name) != tried and _exact(model, name, batch, truth)]
    config = text_config(model)
    if getattr(config, "router_aux_loss_coef", 0) and hasattr(config, "output_router_logits"):
        if computes_router_loss(model) and unpacked.ATTENTION in found:  # sdpa and eager refuse the router loss
            found = [unpacked.ATTENTION] + [name for name in found if name != unpacked.ATTENTION]
    return found


def paths_for(model: Any) -> list[str]:
    """The model.attention values one process can try on a row of `model`: those of `_PATHS` whose implementation
    expresses every feature of its attention, and unpacked (not for a vision-language model: its images)."""
    found = [name for name, path in _PATHS.items() if expresses(model, path)]
    return found if hasattr(model_config(model), "vision_config") else [*found, "unpacked"]


def scored_as(model: Any, batch: PackedRow, name: str | None, scoring: Scoring) -> torch.Tensor:
    """[pairs, 2] log-probs (float64, CPU) of a packed `batch` under model.attention `name` (segments, sdpa, eager,
    unpacked; None: the model's own path, as `scoring` says), scored as `scoring` says otherwise (its head, its
    tiles), without autograd; the model's path is as before afterwards."""
    path = None if name is None else unpacked.default_attention(model) if name == "unpacked" else _PATHS[name]
    if name is not None:
        scoring = dataclasses.replace(scoring, unpacked=name == unpacked.ATTENTION)
    with attention_as(text_config(model), path), torch.no_grad():
        out = pair_logps(model, batch, scoring)
    return torch.stack([out.chosen, out.rejected], dim=1).double().cpu()


def _row(model: Any, layout: str, pairs: list[PairIds]) -> PackedRow:
    """The probe's pairs packed in `layout`, on the model's device."""
    pack = pack_shared_prompt if layout == "shared_prompt" else pack_microbatch
    device = next(model.parameters()).device
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in pack(pairs, pad_to_multiple_of=8).items()}


def _packed_error(
    model: Any, path: str, layout: str, pairs: list[PairIds], truth: torch.Tensor, scoring: Scoring
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed row's [pairs, 2] log-probs under the implementation `path` and their relative errors."""
    text_config(model)._attn_implementation = path
    got = scored_as(model, _row(model, layout, pairs), None, scoring)
    return got, (got - truth).abs() / truth.abs().clamp(min=1e-6)


def _exact(model: Any, name: str, batch: PackedRow, truth: torch.Tensor) -> bool:
    """Whether `batch` scores exactly under model.attention `name` (a path that fails to run is not)."""
    try:
        got = scored_as(model, batch, name, Scoring())  # the probe's: packed unless `name` says otherwise, no budget
        return float(((got - truth).abs() / truth.abs().clamp(min=1e-6)).max()) <= TOLERANCE
    except Exception:  # noqa: BLE001 - any failure of another path only means it is not suggested
        return False
