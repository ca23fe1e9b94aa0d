"""Vision-language parity with TRL 1.16's DPOTrainer: the same rows (real PNG/JPEG files, conversational prompts with
image parts) and the same tiny model weights give the same token ids, the same pixels and the same step-1 log-probs.

What of TRL runs: a real `DPOTrainer` is constructed on CPU with the model directory's policy and reference
(`AutoModelForImageTextToText`, eager attention) and the processor object `tests.vision.tiny_vlm.load_processor`
gives (for Qwen2.5-VL the same processor without its video part: transformers 5.24's video processors need
torchvision, which is not installed); its `__init__` picks `DataCollatorForVisionPreference` for the vision rows and
patches its fused log-prob head onto both models. Each of our step's four rows (as TRL reads them: the JSON line with
its `images` opened by PIL) goes through `trainer.data_collator` (TRL's chat template, processor call, left/right
padding, flush-left) and `trainer._compute_loss` (TRL's padded forward of policy and reference and its sigmoid loss);
forward hooks read the per-token log-probs TRL's models return, which `_compute_loss` sums per row (that sum is the
only step taken here). Our side: `dpo-data build --processor` (the library call), `DPOLoader` with the processor,
and `vision_pair_logps` on the packed row, the trainer's scoring call.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from PIL import Image

from dpo_data import DPOLoader, LoaderConfig
from dpo_data.loading.microbatch import CHOSEN, IGNORE_INDEX, PROMPT, REJECTED
from dpo_data.loading.vision import FAMILIES
from dpo_train.attention import segments
from dpo_train.logps.pairs import PairLogps
from dpo_train.logps.scoring import Scoring
from dpo_train.reference.choice import ReferenceLogps
from dpo_train.step.loss import LossConfig, pair_losses
from dpo_train.vision.score import vision_pair_logps
from tests.vision.test_packed_vision import load
from tests.vision.tiny_vlm import idefics3_dir, load_processor, qwen25vl_dir

TOLERANCE = 1e-5  # relative, per pair's summed log-probs and for the loss
PAIRS = 4  # one step, one micro-batch, one TRL batch
MAKERS = {"qwen2_5_vl": qwen25vl_dir, "idefics3": idefics3_dir}


def trl_rows(data, order: list[int]) -> list[dict]:
    """The dataset's input rows `order` as TRL reads them: the JSON line, its image files opened by PIL."""
    source = data.parent / f"{data.name}-input" / "rows.jsonl"
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    return [{**rows[i], "images": [Image.open(source.parent / name) for name in rows[i]["images"]]} for i in order]


def trl_trainer(model_dir, reference_dir, rows: list[dict], output_dir):
    """TRL's DPOTrainer on CPU in fp32: the policy from `model_dir`, the reference from `reference_dir`."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation chatter from TrainingArguments / TRL, not under test
        args = DPOConfig(output_dir=str(output_dir), report_to=[], bf16=False, use_cpu=True, max_length=None)
        return DPOTrainer(
            model=load(model_dir, "eager"),
            ref_model=load(reference_dir, "eager"),
            args=args,
            processing_class=load_processor(model_dir),
            train_dataset=datasets.Dataset.from_list(rows),
        )


def trl_step(trainer, rows: list[dict]) -> dict:
    """TRL's collated batch of `rows`, its loss, and each row's summed completion log-probs (policy, reference)."""
    batch = trainer.data_collator([dict(r) for r in rows])  # the collator rewrites its examples' messages
    seen = []
    hooks = [
        m.register_forward_hook(lambda m, a, o: seen.append(o.log_probs)) for m in (trainer.model, trainer.ref_model)
    ]
    try:
        with torch.no_grad():
            loss = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    finally:
        for hook in hooks:
            hook.remove()
    policy, reference = (logps.double().sum(dim=1).view(2, -1).T for logps in seen)  # rows: chosen..., rejected...
    return {"batch": batch, "loss": float(loss), "policy": policy, "reference": reference}


def our_step(model_dir, data, layout: str) -> dict:
    """The loader's first micro-batch (one step of PAIRS pairs) of the built dataset."""
    config = LoaderConfig(pairs_per_step=PAIRS, max_tokens_per_microbatch=4096, layout=layout)
    batch = next(iter(DPOLoader([data], config, max_epochs=1, processor=model_dir)))
    assert batch["num_pairs"] == PAIRS
    return batch


def our_sequences(batch: dict, family: str) -> list[dict]:
    """Per pair of a packed row: its prompt + chosen and prompt + rejected ids, its completions' token counts and
    the image inputs its sequences carry (the prompt segment's in the shared layout, else each completion's)."""
    images = FAMILIES[family].split_row(batch)
    cu, ids = batch["cu_seqlens"].tolist(), batch["input_ids"][0]
    pairs = [{} for _ in range(batch["num_pairs"])]
    for s, (slot, role) in enumerate(zip(batch["segment_pair"].tolist(), batch["segment_role"].tolist())):
        if slot >= 0:
            pairs[slot][role] = (ids[cu[s] : cu[s + 1]].tolist(), images[s], int(batch["segment_length"][s]))
    out = []
    for pair in pairs:
        prompt = pair[PROMPT][0] if PROMPT in pair else []
        found = {}
        for name, role in (("chosen", CHOSEN), ("rejected", REJECTED)):
            found[name] = prompt + pair[role][0]
            found[f"{name}_images"] = pair[PROMPT][1] if PROMPT in pair else pair[role][1]
        out.append(found)
    labels, first = batch["labels"][0], batch.get("segment_first_label")
    for s, (slot, role) in enumerate(zip(batch["segment_pair"].tolist(), batch["segment_role"].tolist())):
        if role in (CHOSEN, REJECTED):  # the completion tokens scored: the labels (a shared prompt's first apart)
            scored = int((labels[cu[s] : cu[s + 1]] != IGNORE_INDEX).sum())
            scored += 0 if first is None else int(first[s] != IGNORE_INDEX)
            out[slot][f"{'chosen' if role == CHOSEN else 'rejected'}_tokens"] = scored
    return out


def trl_sequences(batch: dict, rows: list[dict], family: str) -> list[dict]:
    """Per row of TRL's batch (chosen rows, then rejected rows): its unpadded ids and its prompt's image inputs."""
    n, mask = len(rows), batch["attention_mask"].bool()
    counts = [len(r["images"]) for r in rows] * 2
    if family == "qwen2_5_vl":
        grids = batch["image_grid_thw"].split(counts)
        pixels = batch["pixel_values"].split([int(g.prod(-1).sum()) for g in grids])
        images = [{"pixel_values": p, "image_grid_thw": g} if k else {} for p, g, k in zip(pixels, grids, counts)]
    else:  # Idefics3: [rows, crops, C, H, W], each row's crops padded to the batch's most
        images = [{"pixel_values": batch["pixel_values"][r], "pixel_attention_mask": batch["pixel_attention_mask"][r]}
                  if k else {} for r, k in enumerate(counts)]  # fmt: skip
    out = []
    for i in range(n):
        found = {}
        for name, r in (("chosen", i), ("rejected", n + i)):
            found[name] = batch["input_ids"][r][mask[r]].tolist()
            found[f"{name}_images"] = images[r]
            found[f"{name}_tokens"] = int(batch["completion_mask"][r].sum())
        out.append(found)
    return out


def image_mismatches(ours: dict, theirs: dict) -> list[str]:
    """The image inputs' keys where one pair's sequence differs from TRL's: bitwise, TRL's batch padding excepted
    (Idefics3 pads every row to the batch's most crops with all-zero crops, masked out)."""
    if set(ours) != set(theirs):
        return [f"keys {sorted(ours)} != {sorted(theirs)}"]
    bad = []
    for key, mine in ours.items():
        other = theirs[key]
        if "pixel_attention_mask" in ours:  # Idefics3: [crops, ...] here, TRL's padded to the batch's most crops
            crops = mine.shape[0]
            if other[crops:].any():
                bad.append(f"{key}: TRL's crops past our {crops} are not padding")
            other = other[:crops]
        if mine.shape != other.shape or mine.dtype != other.dtype or not torch.equal(mine, other):
            bad.append(key)
    return bad


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp(min=1e-6)).max())


@pytest.fixture(scope="module", params=sorted(MAKERS))
def setup(request, vlm_dirs, vision_datasets, tmp_path_factory):
    """(family, model dir, reference dir (other random weights), the built dataset, our step-1 batch per layout)."""
    family = request.param
    model_dir, data = vlm_dirs[family], vision_datasets[family]
    reference_dir = MAKERS[family](tmp_path_factory.mktemp(f"{family}-reference"), seed=1)
    batches = {layout: our_step(model_dir, data, layout) for layout in ("separate", "shared_prompt")}
    order = batches["separate"]["pair_index"].tolist()
    assert batches["shared_prompt"]["pair_index"].tolist() == order
    rows = trl_rows(data, order)
    trainer = trl_trainer(model_dir, reference_dir, rows, tmp_path_factory.mktemp(f"{family}-trl"))
    return family, model_dir, reference_dir, data, batches, rows, trainer


@pytest.mark.parametrize("layout", ["separate", "shared_prompt"])
def test_ids_and_pixels_are_what_trls_collator_feeds_its_model(setup, layout):
    """Each pair's prompt + chosen and prompt + rejected ids equal TRL's unpadded batch rows, its completions' token
    counts TRL's completion mask, and its images' pixel values and grids (Qwen2.5-VL) or crops and crop masks
    (Idefics3) equal TRL's bitwise."""
    family, _, _, _, batches, rows, trainer = setup
    theirs = trl_sequences(trainer.data_collator([dict(r) for r in rows]), rows, family)
    ours = our_sequences(batches[layout], family)
    assert sum(bool(p["chosen_images"]) for p in ours) >= 2  # the step holds pairs with images
    for k, (mine, other) in enumerate(zip(ours, theirs)):
        for name in ("chosen", "rejected"):
            assert mine[name] == other[name], f"pair {k} {name}: ids differ"
            assert image_mismatches(mine[f"{name}_images"], other[f"{name}_images"]) == [], f"pair {k} {name}"
            assert mine[f"{name}_tokens"] == other[f"{name}_tokens"], f"pair {k} {name}: completion length"


@pytest.mark.parametrize("layout", ["separate", "shared_prompt"])
def test_step_one_logps_and_loss_equal_trls(setup, layout):
    """Per pair, the policy's and the reference's summed chosen and rejected log-probs of our packed row equal TRL's
    padded batch within 1e-5 relative, and the sigmoid loss over the step equals TRL's `_compute_loss` (the
    reference has other random weights than the policy, so the loss is not log 2)."""
    family, model_dir, reference_dir, _, batches, rows, trainer = setup
    trl = trl_step(trainer, rows)
    batch = batches[layout]
    scores = {}
    for name, path in (("policy", model_dir), ("reference", reference_dir)):
        with torch.no_grad():
            out = vision_pair_logps(load(path, segments.ATTENTION).eval(), batch, Scoring())
        scores[name] = torch.stack([out.chosen, out.rejected], dim=1).double()
        assert relative(scores[name], trl[name]) < TOLERANCE, f"{name}: {scores[name]} != TRL's {trl[name]}"
    counts = torch.ones(PAIRS, dtype=torch.long)  # the sigmoid loss reads no token counts
    policy, reference = PairLogps(*scores["policy"].T, counts, counts), ReferenceLogps(*scores["reference"].T)
    terms = pair_losses(policy, reference, LossConfig())
    assert abs(float(terms.losses.mean()) - trl["loss"]) <= TOLERANCE * trl["loss"]
    assert abs(trl["loss"] - 0.6931471805599453) > 1e-3  # a loss the reference's weights move


def test_one_pair_given_other_images_is_caught(setup):
    """The broken variant: TRL given one pair's images turned half a turn (the same sizes, so the same ids, other
    pixels). Its pixels no longer equal ours for that pair only, and that pair's log-probs move past the tolerance."""
    family, model_dir, _, _, batches, rows, trainer = setup
    k = next(i for i, r in enumerate(rows) if r["images"])
    turned = [Image.Image.transpose(p, Image.Transpose.ROTATE_180) for p in rows[k]["images"]]
    broken = [dict(r, images=turned) if i == k else r for i, r in enumerate(rows)]
    theirs = trl_sequences(trainer.data_collator([dict(r) for r in broken]), broken, family)
    ours = our_sequences(batches["separate"], family)
    assert [a["chosen"] for a in ours] == [b["chosen"] for b in theirs]
    pairs = zip(ours, theirs)
    assert [i for i, (a, b) in enumerate(pairs) if image_mismatches(a["chosen_images"], b["chosen_images"])] == [k]
    with torch.no_grad():
        out = vision_pair_logps(load(model_dir, segments.ATTENTION).eval(), batches["separate"], Scoring())
    policy = torch.stack([out.chosen, out.rejected], dim=1).double()
    trl = trl_step(trainer, broken)["policy"]
    assert relative(policy[k], trl[k]) > 10 * TOLERANCE
    assert relative(policy[torch.arange(PAIRS) != k], trl[torch.arange(PAIRS) != k]) < TOLERANCE
