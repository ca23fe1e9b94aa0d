"""Vision-language pairs at world 2 train what world 1 trains: two gloo ranks (DDP and FSDP2) of the real Trainer and
the real loader, its images prepared by each family's processor, against one process on the same data and config.

The objective is a global pair-weighted one, so the parameters, both step gradients and both step losses after 2
steps must not depend on how the step's pairs (and so their images and Qwen2.5-VL's 3D positions) are split over
ranks. The runs are tests/train/test_invariance.py's (`_train_all`: one spawn of 2 ranks for every world-2 job,
world 1 in this process), with plain SGD at lr 1 and no clipping for the reason given there, and its tolerance.
A rank whose rows hold no image runs no vision tower nor connector: its gradients there are still reduced with the
other rank's (`dpo_train.model.policy.reached_by_every_rank`)."""

from __future__ import annotations

import pytest

from dpo_data.loading.microbatch import is_last
from tests.train.test_invariance import RTOL, _train_all, _worst

FAMILIES = ("idefics3", "qwen2_5_vl")
LAYOUTS = ("separate", "shared_prompt")
STRATEGIES = ("ddp", "fsdp")


TOLERANCE = 2 * RTOL
"""The text runs' tolerance, doubled: Qwen2.5-VL's separate layout measured 1.81e-6 of RTOL's 2e-6, all of it a
k_proj bias gradient of norm 1.5e-4 that nearly cancels (world 1 alone moves it as much; see BUDGETS), so another
CPU's rounding could cross RTOL. A pair's images on the wrong rank, or scaled, move it by 5.9e-3 or more."""

BUDGETS = {"idefics3": 184, "qwen2_5_vl": 104}
"""Each family's token budget: its longest pair padded to 8 (a micro-batch of about one pair in the separate layout,
two in shared_prompt), so that a step's four pairs spread over both ranks at world 2. World 1 runs the same config:
the same micro-batches, one rank. (Against one micro-batch a step, the micro-batching alone moves a Qwen2.5-VL
k_proj bias gradient, of norm 1.5e-4, by 1.75e-6 relative, measured, world 1 and 2 alike.)"""


def _config(model_dir, dataset, layout: str, strategy: str, budget: int) -> dict:
    """Two steps of four pairs (the loader's choice) in micro-batches of at most `budget` tokens."""
    data = {"path": str(dataset), "batching": "pairs", "pairs_per_step": 4, "max_tokens_per_microbatch": budget}
    return {
        "model": {"path": str(model_dir)},
        "data": {**data, "layout": layout},
        "optim": {"name": "sgd", "lr": 1.0, "max_grad_norm": 0.0},
        "train": {"output_dir": "unused", "max_steps": 2},
        "distributed": {"strategy": strategy, "device": "cpu"},
    }


def _images_per_step(config: dict, rank: int, world: int) -> list[int]:
    """The images (Qwen2.5-VL) or crops (Idefics3) rank `rank` of `world` reads in each of the first two steps."""
    from dpo_data.loading.loader import DPOLoader
    from dpo_train.config.loading import load_config

    cfg = load_config(config)
    loader = DPOLoader([cfg.data.path], cfg.data.loader_config(rank, world), processor=cfg.model.processor)
    found = [0, 0]
    for batch in loader:
        if batch["step"] == 1 and is_last(batch):
            found[1] += int(batch["segment_images"].sum())
            return found
        found[batch["step"]] += int(batch["segment_images"].sum())
    return found


@pytest.fixture(scope="module")
def trained(vlm_dirs, vision_datasets, tmp_path_factory) -> dict:
    """(family, layout, world, strategy) -> the saved tensors, for both families and layouts: world 1, and world 2
    under DDP and FSDP2, in micro-batches of the family's budget."""
    runs = {}
    for family in FAMILIES:
        model_dir, dataset = vlm_dirs[family], vision_datasets[family]
        for layout in LAYOUTS:
            for world, strategy in ((1, "ddp"), *((2, s) for s in STRATEGIES)):
                config = _config(model_dir, dataset, layout, strategy, BUDGETS[family])
                runs[f"{family} {layout} {world} {strategy}"] = (world, config, None, True, "exact")
    return _train_all(tmp_path_factory.mktemp("vision-world2"), runs)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_train_vision_pairs_as_one_process(family, trained, vlm_dirs, vision_datasets):
    config = _config(vlm_dirs[family], vision_datasets[family], "separate", "ddp", BUDGETS[family])
    seen = {rank: _images_per_step(config, rank, 2) for rank in (0, 1)}
    assert all(min(images) > 0 for images in seen.values()), seen  # each rank reads images in each step
    for layout in LAYOUTS:
        one = trained[f"{family} {layout} 1 ddp"]
        assert float(one["loss1"]) != float(one["loss0"])  # the first step moved the policy
        for strategy in STRATEGIES:
            worst = _worst(one, trained[f"{family} {layout} 2 {strategy}"])
            print(f"{family} {layout} world 2 {strategy}: worst relative difference {worst:.2e}")
            assert worst <= TOLERANCE, (layout, strategy, worst)


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_shards_a_vision_language_model_layer_by_layer(family, vlm_dirs):
    """FSDP2 units: each decoder layer of the language model (not the whole model in one unit, which every rank
    would gather at once), the vision tower and connector in the root's."""
    from dpo_train.parallel.sharding import _decoder_layers
    from tests.vision.test_packed_vision import load

    model = load(vlm_dirs[family], "sdpa")
    layers = list(_decoder_layers(model))
    assert layers and layers == list(model.get_decoder().layers)
    assert all(type(layer).__name__.endswith("DecoderLayer") for layer in layers)
