"""Packed vision-language rows score each pair as its sequences run alone through the model's own eager attention."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dpo_train.attention import segments
from dpo_train.errors import ConfigError
from dpo_train.logps.scoring import Scoring
from dpo_train.vision.families import FAMILIES, NOT_YET, UNKNOWN, family_of
from dpo_train.vision.rows import pack_vision
from dpo_train.vision.score import vision_pair_logps
from dpo_train.vision.truth import eager_unpacked_vision
from tests import docs_blocks
from tests.docs_blocks import markdown_table
from tests.harness import join_gloo, spawn
from tests.vision.pairs import vision_pairs
from tests.vision.tiny_vlm import load_processor

TOLERANCE = 1e-5  # relative, per pair and per gradient tensor; the paths agree to about 1e-7
LAYOUTS = ("separate", "shared_prompt")
PATHS = {"segments": segments.ATTENTION, "sdpa": "sdpa", "eager": "eager"}
TOWER = {"qwen2_5_vl": "visual", "idefics3": "vision_model"}  # the vision tower, under model.model


def load(path, attention: str):
    """The VLM with `attention` in its decoder and eager attention in its vision tower, in fp32."""
    from transformers import AutoModelForImageTextToText

    segments.register()
    implementation = {"text_config": attention, "vision_config": "eager", "": "eager"}
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation=implementation)


@dataclasses.dataclass
class Case:
    """One family's check: its model directory and pairs, the eager unpacked truth [pairs, 2], and what the checks
    below measured (for the docs table)."""

    name: str
    path: Path
    pairs: list
    truth: torch.Tensor
    classes: tuple[str, str]  # the model class, the image processor class (and whether it splits images)
    logps: dict = dataclasses.field(default_factory=dict)  # (layout, attention) -> worst pair's relative error
    encodings: dict = dataclasses.field(default_factory=dict)  # layout -> vision encodings per image (or crop)
    gradients: dict = dataclasses.field(default_factory=dict)  # layout -> worst parameter's relative error


CASES: dict[str, Case] = {}  # family -> its case, shared by the fixture and the docs table


def case_of(name: str, path: Path, images: list[bytes]) -> Case:
    if name not in CASES:
        processor = load_processor(path)
        model = load(path, "eager").eval()
        pairs = vision_pairs(processor, images, name)
        image_processor = processor.image_processor
        splitting = " (image splitting on)" if getattr(image_processor, "do_image_splitting", False) else ""
        classes = (f"`{type(model).__name__}`", f"`{type(image_processor).__name__}`{splitting}")
        CASES[name] = Case(name, path, pairs, eager_unpacked_vision(model, pairs), classes)
    return CASES[name]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, vlm_dirs, images) -> Case:
    return case_of(request.param, vlm_dirs[request.param], images)


def relative_error(out, truth: torch.Tensor) -> float:
    got = torch.stack([out.chosen, out.rejected], dim=1).double().detach()
    return float(((got - truth).abs() / truth.abs().clamp(min=1e-6)).max())


class EncodedImages:
    """Counts the images (Qwen2.5-VL) or crops (Idefics3) the vision tower encodes, by a forward hook."""

    def __init__(self, model, name: str):
        self.count = 0
        tower = getattr(model.model, TOWER[name])
        self.handle = tower.register_forward_pre_hook(self.seen, with_kwargs=True)

    def seen(self, module, args, kwargs):
        if "grid_thw" in kwargs:
            self.count += int(kwargs["grid_thw"].shape[0])
        else:
            self.count += int((kwargs.get("pixel_values", args[0] if args else None)).shape[0])


def check_logps(case: Case, layout: str, path_name: str) -> None:
    """The packed row's per-pair log-probs equal the truth; the tower encodes each image once per pair in the
    shared prompt, twice (once per completion's segment) in the separate layout. Recorded in `case`."""
    model = load(case.path, PATHS[path_name]).eval()
    batch = pack_vision(case.pairs, model.config, layout, pad_to_multiple_of=16)
    encoded = EncodedImages(model, case.name)
    with torch.no_grad():
        out = vision_pair_logps(model, batch, Scoring())
    case.logps[layout, path_name] = error = relative_error(out, case.truth)
    assert error < TOLERANCE, f"{case.name} {layout} {path_name}: a pair's log-prob is off by {error:.1e} relative"
    images = sum(FAMILIES[case.name].images_of(pair.images) for pair in case.pairs if pair.images)
    case.encodings[layout] = encoded.count / images
    assert encoded.count == images * (1 if layout == "shared_prompt" else 2)
    assert int(batch["segment_images"].sum()) == encoded.count


@pytest.mark.parametrize("path_name", sorted(PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_row_equals_each_sequence_run_alone(family, layout, path_name):
    check_logps(family, layout, path_name)


def check_gradients(case: Case, layout: str) -> None:
    """The LoRA-free policy's gradients (language model and vision tower) from the packed row equal those of
    the sequences run alone, for a loss weighing every pair's chosen and rejected sums differently. The worst
    parameter's relative error is recorded in `case`."""
    weights = torch.linspace(0.5, 2.0, 2 * len(case.pairs), dtype=torch.float64).view(len(case.pairs), 2)
    packed, alone = load(case.path, segments.ATTENTION).eval(), load(case.path, "eager").eval()
    out = vision_pair_logps(packed, pack_vision(case.pairs, packed.config, layout, pad_to_multiple_of=16), Scoring())
    (torch.stack([out.chosen, out.rejected], dim=1).double() * weights).sum().backward()
    (eager_unpacked_vision(alone, case.pairs, grad=True) * weights).sum().backward()
    errors = gradient_errors(packed, alone)
    case.gradients[layout] = worst = max(errors.values())
    assert worst < TOLERANCE, f"{max(errors, key=errors.get)}: gradient off by {worst:.1e} relative"
    language = [k for k in errors if "language_model" in k or "text_model" in k]
    assert len(errors) > 10 and language and any(TOWER[case.name] in k for k in errors)


def gradient_errors(got, truth) -> dict[str, float]:
    """Each parameter's relative gradient error, `got`'s against `truth`'s (two models after their backward). A
    tensor whose gradient is zero in exact arithmetic (a key bias: softmax ignores a shift shared by every key)
    holds rounding noise: its error is measured against a millionth of the model's largest gradient."""
    truth = dict(truth.named_parameters())
    floor = 1e-6 * max(float(p.grad.abs().max()) for p in truth.values() if p.grad is not None)
    errors = {}
    for key, parameter in got.named_parameters():
        want = truth[key].grad
        if want is None:
            assert parameter.grad is None or not parameter.grad.any(), key
            continue
        errors[key] = float((parameter.grad - want).abs().max()) / max(float(want.abs().max()), floor)
    return errors


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_equal_each_sequence_run_alone(family, layout):
    check_gradients(family, layout)


def test_tiled_mlps_give_the_whole_mlps_logps_and_gradients(family):
    """train.mlp_tile_tokens on a vision-language model tiles its vision tower's MLPs too (the tower trained, as
    with model.train_vision_tower: its tiles' backward runs), in tiles of 2 positions: the packed row's log-probs
    and every parameter's gradient equal the whole MLPs' (fp32: the tiles sum the weights' gradients in another
    order)."""
    from dpo_train.logps.tiled_mlp import tile_mlps

    weights = torch.linspace(0.5, 2.0, 2 * len(family.pairs), dtype=torch.float64).view(len(family.pairs), 2)
    runs = []
    for tile in (None, 2):
        model = load(family.path, segments.ATTENTION).eval()
        tiled = tile_mlps(model, tile)
        out = vision_pair_logps(
            model, pack_vision(family.pairs, model.config, "separate", pad_to_multiple_of=16), Scoring()
        )
        logps = torch.stack([out.chosen, out.rejected], dim=1).double()
        (logps * weights).sum().backward()
        runs.append((model, tiled, logps.detach()))
    (whole_model, _, whole), (tiled_model, tiled, got) = runs
    assert any(TOWER[family.name] in name for name in tiled)
    assert any("language_model" in name or "text_model" in name for name in tiled)
    assert float(((got - whole).abs() / whole.abs()).max()) < TOLERANCE
    errors = gradient_errors(tiled_model, whole_model)
    assert max(errors.values()) < TOLERANCE, max(errors, key=errors.get)
    assert any(TOWER[family.name] in k for k in errors)


def test_auto_tiles_the_decoders_mlps_and_leaves_the_towers_whole(family):
    """train.mlp_tile_tokens: auto on a checkpointed vision-language model: its count's text row reaches the
    decoder's MLPs, tiled, and not the tower's, left whole (a count set by hand tiles both, as above)."""
    from dpo_train.logps.tiled_mlp import Tiled, apply_setting, mlps
    from dpo_train.model.policy import prepare_for_training

    model = load(family.path, segments.ATTENTION)
    prepare_for_training(model, activation_checkpointing=True)
    said = apply_setting(model, "auto", checkpointed=True)
    tiled = {name for name, module in mlps(model) if isinstance(module, Tiled)}
    tower = {name for name, _ in mlps(model) if TOWER[family.name] in name}
    assert tiled and tower and tiled == {name for name, _ in mlps(model)} - tower
    assert f"{len(tiled)} MLPs run in tiles" in said and f"{len(tower)} left whole" in said, said


def test_the_sharded_reference_runs_the_mlps_the_policy_tiles(vlm_dirs):
    """Under FSDP2 the live reference is built apart from the policy (from the meta device, sharded): it tiles the
    MLPs the policy's `auto` tiled and leaves the tower's whole, as the policy does (a count over the whole copy
    tiled the tower too)."""
    spawn(_sharded_reference, 2, str(vlm_dirs["qwen2_5_vl"]))


def _sharded_reference(rank: int, world: int, port: int, path: str) -> None:
    from dpo_train.logps.tiled_mlp import Tiled, apply_setting, tiles_of
    from dpo_train.model.policy import prepare_for_training
    from dpo_train.reference.live import frozen_reference

    join_gloo(rank, world, port)
    policy = load(path, segments.ATTENTION)
    prepare_for_training(policy, activation_checkpointing=True)
    apply_setting(policy, "auto", checkpointed=True)
    reference = frozen_reference(policy, "fsdp", world, tiles_of(policy))  # the policy's Scoring.tiles

    def tiles(model) -> dict[str, int]:
        return {name: type(m).TILE for name, m in model.named_modules() if isinstance(m, Tiled)}

    assert tiles(policy) and tiles(reference) == tiles(policy)
    assert not any(TOWER["qwen2_5_vl"] in name for name in tiles(reference))


# -- the docs table: docs/vision.md's supported families are what the checks above measured ---------------------

DOCS = docs_blocks.DOCS / "vision.md"
BLOCK = "vision-families"
FACTOR = 3  # a measured error may differ from the docs' by this factor (other machines round differently)


def measured(case: Case) -> Case:
    """`case` with every check above run (those this session has not run yet run now)."""
    for layout in LAYOUTS:
        for path_name in sorted(PATHS):
            if (layout, path_name) not in case.logps:
                check_logps(case, layout, path_name)
        if layout not in case.gradients:
            check_gradients(case, layout)
    return case


def family_row(case: Case) -> list[str]:
    layouts = [layout for layout in LAYOUTS if any(key[0] == layout for key in case.logps)]
    attentions = sorted({PATHS[path_name] for _, path_name in case.logps})
    return [
        f"{NAMES.get(case.name, case.name)} (`{case.name}`)",
        *case.classes,
        ", ".join(f"`{a}`" for a in attentions),
        ", ".join(f"`{layout}`" for layout in layouts),
        f"{max(case.logps.values()):.1e}",
        f"{max(case.gradients.values()):.1e}",
        ", ".join(f"`{layout}` {case.encodings[layout]:g}" for layout in layouts),
    ]


NAMES = {"qwen2_5_vl": "Qwen2.5-VL", "idefics3": "Idefics3 / SmolVLM"}
HEAD = [
    "family",
    "model class",
    "image processor",
    "decoder attention",
    "layouts",
    "log-probs: worst relative error",
    "gradients: worst relative error",
    "vision encodings per image",
]


def refused_rows() -> list[list[str]]:
    """Every family `families.NOT_YET` names, refused by `family_of` (run here) with its reason."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as CLASSES

    rows = []
    for model_type in sorted(NOT_YET):
        with pytest.raises(ConfigError) as refusal:
            family_of(AutoConfig.for_model(model_type))
        assert NOT_YET[model_type] in str(refusal.value), refusal.value
        rows.append([f"`{model_type}`", f"`{CLASSES[model_type]}`", NOT_YET[model_type]])
    return rows


def others_refused(other: str = "llava_next") -> str:
    """What the loader and the vision scoring say to a VLM model type neither supported nor in NOT_YET (`other`)."""
    from transformers import AutoConfig

    from dpo_data.errors import DataError
    from dpo_data.loading.vision import vision_family

    assert other not in FAMILIES and other not in NOT_YET
    said = []
    for refuse, error in ((vision_family, DataError), (family_of, ConfigError)):
        with pytest.raises(error) as refusal:
            refuse(AutoConfig.for_model(other))
        said.append(str(refusal.value).replace(other, "M"))
    assert UNKNOWN in said[1]
    loader, scoring = said
    who = f"by the loader (`{loader}`) and by the scoring (`{scoring}`)"
    return f"Any other model type M is refused where images meet it: {who}."


def render_table(cases: list[Case]) -> str:
    """The supported families as measured, then the refused ones as the code refuses them."""
    supported = markdown_table(HEAD, [family_row(measured(case)) for case in cases])
    refused = markdown_table(["refused model type", "model class", "why"], refused_rows())
    return (
        f"{supported}\n\nRefused by name (`dpo_train/vision/families.py`: a `ConfigError` naming the model type, "
        f"why, and the supported ones, when the model is loaded):\n\n{refused}\n\n{others_refused()}"
    )


def test_the_docs_table_is_what_this_module_measured(vlm_dirs, images):
    """docs/vision.md's table of families is this module's checks (regenerate it with
    `python -m tests.vision.test_packed_vision`)."""
    cases = [case_of(name, vlm_dirs[name], images) for name in sorted(FAMILIES)]
    differences = docs_blocks.differences(docs_blocks.read_block(DOCS, BLOCK), render_table(cases), FACTOR)
    assert not differences, "\n".join(["regenerate: python -m tests.vision.test_packed_vision", *differences])


def test_the_docs_check_fails_on_an_edit_or_another_result(vlm_dirs, images, monkeypatch):
    """The check above catches a hand edit of the docs, a family whose result changed, and a refusal list that
    changed; it tolerates a measured error that rounds differently."""
    cases = [measured(case_of(name, vlm_dirs[name], images)) for name in sorted(FAMILIES)]
    docs = render_table(cases)  # as regenerated from this run
    check = lambda written, made: docs_blocks.differences(written, render_table(made), FACTOR)
    assert check(docs, cases) == []
    assert check(docs.replace("| `llava` |", "| `llava_next` |"), cases)  # a hand edit
    assert check(docs.replace("`dpo_segments`, `eager`, `sdpa`", "`dpo_segments`, `sdpa`", 1), cases)
    worse = dataclasses.replace(cases[0], logps={**cases[0].logps, ("separate", "sdpa"): 1e-3})
    (said,) = check(docs, [worse, *cases[1:]])
    assert said == f"the docs say {max(cases[0].logps.values()):.1e}, this run measured 1.0e-03"
    twice = dataclasses.replace(cases[1], encodings={**cases[1].encodings, "shared_prompt": 2.0})
    assert check(docs, [cases[0], twice])
    fewer = [dataclasses.replace(c, logps={k: v for k, v in c.logps.items() if k[1] != "sdpa"}) for c in cases]
    with monkeypatch.context() as patch:  # an attention no longer checked leaves the table
        patch.delitem(PATHS, "sdpa")
        assert check(docs, fewer)
    rounding = dataclasses.replace(cases[0], gradients={k: v * 2 for k, v in cases[0].gradients.items()})
    assert check(docs, [rounding, *cases[1:]]) == []
    monkeypatch.setitem(NOT_YET, "paligemma", "PaliGemma is not yet checked")
    assert check(docs, cases)


if __name__ == "__main__":  # regenerate the docs table from a fresh run of every check above
    import tempfile

    from tests.vision.conftest import FAMILIES as MAKERS
    from tests.vision.tiny_vlm import sample_images

    with tempfile.TemporaryDirectory() as tmp:
        dirs = {name: MAKERS[name](Path(tmp) / name) for name in sorted(FAMILIES)}
        docs_blocks.write_block(DOCS, BLOCK, render_table([case_of(n, d, sample_images()) for n, d in dirs.items()]))
    print(f"wrote the vision-language families table into {DOCS}")
