"""Vision pairs against TRL (issue 37 item 5): pairs/s of `dpo-train` in both layouts and of TRL 1.16 `DPOTrainer`,
the vision tower's share of a step's time, and how often each side encodes each image, on a small VLM per family.

Models: Qwen2.5-VL and Idefics3 (SmolVLM's class) built as `tests/vision/tiny_vlm.py` builds its fixtures (the
real SmolLM2 tokenizer with the family's special tokens and chat template, random weights from seed 0), larger
so that both the decoder and the tower do real work: a decoder of hidden 128 and 2 layers (SmolLM2's 49,152-token
vocabulary and the family's added tokens), a vision tower of hidden 128 and 2 layers. Qwen2.5-VL: 14 px patches
merged 2x2, images up to 224x224 px (up to 64 image tokens); Idefics3: 64 px crops of 8 px patches, pixel-shuffled
by 2 (16 tokens a crop), images resized to 128 px on the longest edge and split into up to 2x2 crops plus the
global one.

Data: `--pairs` generated pairs (a user prompt with 0, 1 or 2 images (10 %, 65 %, 25 %) from a pool of 12 real
PNG/JPEG files of 112 to 224 px, a question of 8-24 words; completions of 8-40 words), written as TRL's vision
rows (JSON lines naming the image files) and built with `dpo-data build --processor` (the library call).

Sides, each a fresh interpreter (`harness.call`), one after another per family: TRL, ours `separate`, ours
`shared_prompt`. All: the same pairs in the same order (our loader's; TRL's rows through a sequential sampler, its
images opened by PIL as TRL reads them), 8 pairs a step in one forward (TRL `per_device_train_batch_size` 8;
ours one micro-batch of up to `--budget` tokens), fp32 on CPU, sigmoid, beta 0.1, AdamW lr 1e-5 constant,
clipping 1.0, live reference, activation checkpointing (TRL's default; ours `train.activation_checkpointing`),
`--threads` torch threads (default 1: on a shared machine a thread's CPU seconds are its work, while 2 threads
spin-wait for each other whenever one is descheduled), the whole model trained, the vision tower included (TRL's
default; ours `model.train_vision_tower: true`). TRL otherwise runs its defaults for a VLM: the model given as its
path (TRL loads it and its reference itself: `sdpa` attention in the decoder and the tower), its collator
`DataCollatorForVisionPreference`, its fused log-prob head. Ours runs its defaults: `model.attention: auto` in the
decoder, eager attention in the tower.
`--frozen` adds ours with the tower frozen (our default) in both layouts; `--baseline DIR` adds ours as another
checkout has it (`base:` sides, DIR first on the path), run beside ours in the same run.

Measured per side, over steps 2.. (step 1, with its warm-up, parity guard and probe, is not timed): a step is the
wall time (and this process's CPU time, `time.process_time`, which other processes' load moves far less) between
two step ends (`Trainer.step` returning; TRL's `on_step_end`), so it includes the batch's preparation (the
processor's image work) on both sides; pairs/s = pairs / seconds summed over those steps (pairs/CPU-s likewise).
Hooks on the vision tower (`model.model.visual`, `model.model.vision_model`) of the policy and the reference time its
forward (pre-hook to hook) and its backward (from the gradient reaching the tower's output to the last tower
parameter's gradient accumulated) and count what it encodes (Qwen2.5-VL: images, `grid_thw` rows; Idefics3:
crops, its batch of `pixel_values` after the model drops TRL's all-zero padding crops). Encodings per image =
encodings in a model's forwards of a step / the images (crops) in the step's prompts, for the policy (forwards
with grad) and the reference (without). The step-1 loss of every side must be log 2 (policy = reference).

    nice -n 10 .venv/bin/python benchmarks/vision.py [--steps 3] [--pairs 32] [--repeats 1] [--frozen]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import harness
from trl_peer import HYPER, peer_args

sys.path.append(str(harness.ROOT))  # tests.vision.tiny_vlm (after PYTHONPATH: --baseline's checkout comes first)

ENV = {"TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
FAMILIES = ("qwen2_5_vl", "idefics3")
TEXT = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
TOWER = dict(hidden_size=128, intermediate_size=384, layers=2, heads=4)
POOL = [(224, 224), (224, 168), (168, 224), (112, 112), (196, 140), (140, 196)]  # (width, height), PNG and JPEG each
LOG2 = math.log(2)


# ---------------------------------------------------------------- models and data (parent)


def qwen25vl(out: Path) -> str:
    """OUT: a random Qwen2.5-VL of TEXT and TOWER with images up to 224 px, the tests' builder (once)."""
    from tests.vision import tiny_vlm

    if not (out / "config.json").is_file():
        tiny_vlm.qwen25vl_dir(out, 0, text=TEXT, tower=TOWER, edge=224)
    return str(out)


def idefics3(out: Path) -> str:
    """OUT: a random Idefics3 of TEXT and TOWER with images up to 128 px in 64 px crops, the tests' builder (once)."""
    from tests.vision import tiny_vlm

    if not (out / "config.json").is_file():
        tiny_vlm.idefics3_dir(out, 0, text=TEXT, tower=TOWER, edge=128)
    return str(out)


MAKERS = {"qwen2_5_vl": qwen25vl, "idefics3": idefics3}


def write_rows(folder: Path, pairs: int, seed: int) -> Path:
    """FOLDER/rows.jsonl: `pairs` TRL vision rows naming image files of FOLDER (a pool of 12, PNG and JPEG)."""
    from tests.vision.tiny_vlm import image_bytes

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i, size in enumerate(POOL * 2):
        fmt = "PNG" if i < len(POOL) else "JPEG"
        names.append(f"image-{i}.{fmt.lower()}")
        (folder / names[-1]).write_bytes(image_bytes(i, size, fmt))
    rng, rows = random.Random(seed), []
    for i in range(pairs):
        picks = rng.sample(names, rng.choices([0, 1, 2], weights=[10, 65, 25])[0])
        question = harness._text(rng, rng.randint(8, 24), opener=True)
        chosen, rejected = (harness._text(rng, rng.randint(8, 40)) for _ in range(2))
        content = [{"type": "image"} for _ in picks] + [{"type": "text", "text": question}]
        rows.append(
            {
                "id": f"v{i}",
                "images": picks,
                "prompt": [{"role": "user", "content": content}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    harness.write_jsonl(folder / "rows.jsonl", rows)
    return folder / "rows.jsonl"


def build(model: str, rows: Path, out: Path) -> str:
    """`rows` built with `model`'s processor into OUT (once)."""
    from dpo_data.prepare.build import BuildOptions, build

    if not (out / "manifest.json").is_file():
        result = build([str(rows)], None, out, BuildOptions(), processor_dir=model)
        if result.error is not None or result.manifest is None:
            raise SystemExit(f"build of {out} refused: {result.error}")
    return str(out)


def units(model: str, rows: Path) -> list[int]:
    """Per row of `rows`: what the tower encodes for its prompt's images once (Qwen2.5-VL: images; Idefics3: crops,
    as its processor splits each image)."""
    from PIL import Image

    from tests.vision.tiny_vlm import load_processor

    processor = load_processor(Path(model))
    crops = getattr(processor.image_processor, "do_image_splitting", None) is not None
    found = []
    for row in (json.loads(x) for x in rows.read_text().splitlines()):
        images = [Image.open(rows.parent / name) for name in row["images"]]
        if crops and images:
            found.append(int(processor.image_processor(images=[images])["pixel_values"].shape[1]))
        else:
            found.append(len(images))
    return found


# ---------------------------------------------------------------- the tower's clock (child)


def now() -> tuple[float, float]:
    """(wall, CPU) seconds: perf_counter, and this process's CPU time over all its threads (on a busy machine,
    the time this process ran, which other processes' load moves far less than the wall time)."""
    return time.perf_counter(), time.process_time()


class TowerClock:
    """The vision tower's forward and backward spans (`now()` pairs) and encodings, through hooks that are plain
    closures, so that a deep copy of the model (our live reference) reports here too."""

    def __init__(self):
        self.forwards: list[tuple] = []  # (start, end, grad enabled, encoded)
        self.backwards: list[tuple] = []  # (start, end)
        self._open: list | None = None  # [gradient reached the output, last parameter gradient accumulated]
        self._started: dict[int, tuple] = {}
        self._accumulating: set[int] = set()

    def attach(self, model) -> None:
        import torch

        from dpo_train.vision.families import tower_of

        _, tower = tower_of(model)

        def pre(module, args, kwargs):
            self.close()
            if "grid_thw" in kwargs:
                count = int(kwargs["grid_thw"].shape[0])
            else:
                count = int(kwargs.get("pixel_values", args[0] if args else None).shape[0])
            self._started[id(module)] = (now(), torch.is_grad_enabled(), count)

        def post(module, args, kwargs, output):
            start, grad, count = self._started.pop(id(module))
            self.forwards.append((start, now(), grad, count))
            values = output.values() if hasattr(output, "values") else output if isinstance(output, tuple) else [output]
            for value in values:
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    value.register_hook(reached)
            if grad and id(module) not in self._accumulating:
                self._accumulating.add(id(module))
                for p in module.parameters():
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(accumulated)

        def reached(grad):
            if self._open is None:
                self._open = [now(), now()]

        def accumulated(param):
            if self._open is not None:
                self._open[1] = now()

        tower.register_forward_pre_hook(pre, with_kwargs=True)
        tower.register_forward_hook(post, with_kwargs=True)

    def close(self) -> None:
        """End the backward span in progress (at the next forward, or at a step's end)."""
        if self._open is not None:
            self.backwards.append(tuple(self._open))
            self._open = None

    def report(self, stamps: list) -> list[dict]:
        """Per step (between consecutive `stamps`, step ends; the first step has no start and is left out): the
        tower's forward and backward seconds (wall and CPU) and its encodings in the policy's and the reference's
        forwards."""
        self.close()
        steps = []
        for begin, end in zip(stamps, stamps[1:]):
            inside = [f for f in self.forwards if begin[0] < f[0][0] <= end[0]]
            backs = [b for b in self.backwards if begin[0] < b[0][0] <= end[0]]
            steps.append(
                {
                    "seconds": end[0] - begin[0],
                    "cpu_seconds": end[1] - begin[1],
                    "forward_s": sum(f[1][0] - f[0][0] for f in inside),
                    "forward_cpu_s": sum(f[1][1] - f[0][1] for f in inside),
                    "backward_s": sum(b[1][0] - b[0][0] for b in backs),
                    "backward_cpu_s": sum(b[1][1] - b[0][1] for b in backs),
                    "policy_encoded": sum(f[3] for f in inside if f[2]),
                    "reference_encoded": sum(f[3] for f in inside if not f[2]),
                }
            )
        return steps


# ---------------------------------------------------------------- one side (child)


def run(side: str, model: str, data: str, rows: str, steps: int, budget: int, work: str) -> dict:
    """One side in this fresh process: `trl`, or `ours:LAYOUT:TOWER` (TOWER `trained` or `frozen`); 1 + `steps`
    steps of 8 pairs. Its step ends, losses, pairs in order, and the tower's clock per timed step."""
    out = Path(work) / side.replace(":", "-")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    clock = TowerClock()
    if side == "trl":
        got = _run_trl(model, data, rows, 1 + steps, budget, out, clock)
    else:
        _, layout, tower = side.split(":")
        got = _run_ours(model, data, 1 + steps, budget, out, layout, tower == "trained", clock)
    got["tower"] = clock.report(got["stamps"])
    return got


def _run_ours(model, data, steps, budget, out, layout, train_tower, clock) -> dict:
    from transformers import AutoModelForImageTextToText

    from dpo_train.config.loading import load_config
    from dpo_train.trainer import Trainer, train

    config = {
        "model": {"path": model, "train_vision_tower": train_tower},
        "reference": {"mode": "live"},
        "data": {"path": data, "pairs_per_step": 8, "max_tokens_per_microbatch": budget, "layout": layout},
        "loss": {"type": "sigmoid", "beta": HYPER["beta"]},
        "optim": {"lr": HYPER["lr"], "scheduler": "constant", "max_grad_norm": 1.0},
        "train": {"output_dir": str(out), "max_steps": steps, "precision": "fp32", "activation_checkpointing": True},
        "distributed": {"device": "cpu"},
    }
    loaded = AutoModelForImageTextToText.from_pretrained.__func__
    microbatch, step = Trainer.microbatch, Trainer.step
    order, stamps, microbatches = [], [], []

    def from_pretrained(cls, *args, **kwargs):  # the policy (the live reference is its deep copy)
        found = loaded(cls, *args, **kwargs)
        clock.attach(found)
        return found

    def fed(self, batch):
        order.extend(batch["pair_index"].tolist())
        microbatches.append(int(batch["input_ids"].shape[1]))
        return microbatch(self, batch)

    def stepped(self):
        record = step(self)
        clock.close()
        stamps.append(now())
        return record

    AutoModelForImageTextToText.from_pretrained = classmethod(from_pretrained)
    Trainer.microbatch, Trainer.step = fed, stepped
    train(load_config(config), progress=False)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    if any(r["microbatches"] != 1 for r in records):
        raise SystemExit(f"a step took {[r['microbatches'] for r in records]} micro-batches: raise --budget")
    return {"stamps": stamps, "losses": [r["loss"] for r in records], "order": order, "row_tokens": microbatches}


def _order(model: str, data: str, steps: int, budget: int) -> list[int]:
    """Our loader's pairs of the first `steps` steps (the same in both layouts: pairs mode orders by seed alone)."""
    from dpo_data import DPOLoader, LoaderConfig

    config = LoaderConfig(pairs_per_step=8, max_tokens_per_microbatch=budget)
    order: list[int] = []
    for batch in DPOLoader([data], config, max_epochs=1, processor=model):
        order += batch["pair_index"].tolist()
        if len(order) >= 8 * steps:
            break
    return order


def _run_trl(model, data, rows, steps, budget, out, clock) -> dict:
    import warnings

    import datasets
    from PIL import Image
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback
    from trl import DPOTrainer

    from dpo_data.dataset.store import PairStore
    from tests.vision.tiny_vlm import load_processor

    order, source = _order(model, data, steps, budget), Path(rows)
    lines = source.read_text().splitlines()
    if PairStore([data]).num_pairs != len(lines):
        raise SystemExit(f"{data}: the build kept {PairStore([data]).num_pairs} of {len(lines)} rows")
    raw = [json.loads(lines[i]) for i in order]  # every row built: pair i is line i
    trl_rows = [{**r, "images": [Image.open(source.parent / name) for name in r["images"]]} for r in raw]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TrainingArguments' and TRL's deprecation chatter
        args = peer_args(Path(out), 8, 1, steps)  # the step's 8 pairs in one micro-batch
        trainer = DPOTrainer(
            model=model,  # TRL loads the policy and its live reference itself
            args=args,
            processing_class=load_processor(Path(model)),  # Qwen2.5-VL's without its video part (no torchvision)
            train_dataset=datasets.Dataset.from_list(trl_rows),
        )
    trainer._get_train_sampler = lambda *a, **k: SequentialSampler(trainer.train_dataset)
    for m in (trainer.model, trainer.ref_model):
        clock.attach(m)
    stamps: list = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            clock.close()
            stamps.append(now())

    trainer.add_callback(Clock())
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
    return {"stamps": stamps, "losses": [e["loss"] for e in logs], "order": order}


# ---------------------------------------------------------------- parent


def measure(family, side, model, data, rows, units_of, args, work) -> dict:
    """`run` in a fresh interpreter (a `base:` side: with --baseline's checkout first on the path), summarised over
    its timed steps (wall and CPU seconds)."""
    started = time.perf_counter()
    env = {**ENV, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    base = side.startswith("base:")
    child = side.replace("base:", "ours:", 1)
    arguments = (child, model, data, str(rows), args.steps, args.budget, str(work))
    got = harness.call(run, *arguments, env=env, pythonpath=args.baseline if base else None)
    tower = got["tower"]
    timed_pairs = [got["order"][8 * (k + 1) : 8 * (k + 2)] for k in range(len(tower))]
    images = sum(units_of[i] for pairs in timed_pairs for i in pairs)
    total = {clock: sum(t[clock] for t in tower) for clock in ("seconds", "cpu_seconds")}
    found = {"family": family, "side": side, "pairs/s": 8 * len(tower) / total["seconds"]}
    found["pairs/cpu_s"] = 8 * len(tower) / total["cpu_seconds"]
    for part in ("forward", "backward"):
        found[f"tower_{part}_share"] = sum(t[f"{part}_s"] for t in tower) / total["seconds"]
        found[f"tower_{part}_cpu_share"] = sum(t[f"{part}_cpu_s"] for t in tower) / total["cpu_seconds"]
    return {
        **found,
        "policy_encodings_per_image": sum(t["policy_encoded"] for t in tower) / images,
        "reference_encodings_per_image": sum(t["reference_encoded"] for t in tower) / images,
        "images_per_step": images / len(tower),
        "step1_loss": got["losses"][0],
        "losses": got["losses"],
        "order": got["order"][: 8 * (1 + args.steps)],
        "row_tokens": got.get("row_tokens"),
        "tower": tower,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def line(got: dict, trl: dict | None) -> str:
    ratio = f"{got['pairs/s'] / trl['pairs/s']:5.2f}x" if trl else "     -"
    cpu_ratio = f"{got['pairs/cpu_s'] / trl['pairs/cpu_s']:5.2f}x" if trl else "     -"
    share = got["tower_forward_share"] + got["tower_backward_share"]
    cpu_share = got["tower_forward_cpu_share"] + got["tower_backward_cpu_share"]
    steps = " ".join(f"{t['seconds']:.1f}/{t['cpu_seconds']:.1f}" for t in got["tower"])
    return (
        f"{got['family']:10} {got['side']:26} {got['pairs/s']:6.3f} pairs/s {ratio} TRL, "
        f"{got['pairs/cpu_s']:6.3f} pairs/CPU-s {cpu_ratio} TRL; tower {100 * share:4.1f} % of wall "
        f"(fwd {100 * got['tower_forward_share']:4.1f}, bwd {100 * got['tower_backward_share']:4.1f}), "
        f"{100 * cpu_share:4.1f} % of CPU (fwd {100 * got['tower_forward_cpu_share']:4.1f}, bwd "
        f"{100 * got['tower_backward_cpu_share']:4.1f}); encodings/image policy "
        f"{got['policy_encodings_per_image']:.2f} reference {got['reference_encodings_per_image']:.2f}; "
        f"step-1 loss {got['step1_loss']:.6f}; "
        f"s/step wall/CPU {steps}  [{got['wall_s']} s]"
    )


def steps_of(order: list[int]) -> list[list[int]]:
    """The pairs of each step (a step's pairs in any order: the layouts sort a step's pairs differently)."""
    return [sorted(order[k : k + 8]) for k in range(0, len(order), 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--steps", type=int, default=3, help="timed steps of 8 pairs, after the first")
    parser.add_argument("--pairs", type=int, default=32, help="pairs in the dataset (at least 8 x (1 + steps))")
    parser.add_argument("--budget", type=int, default=8192, help="our micro-batch budget: a step in one row")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every side, one after another")
    parser.add_argument("--frozen", action="store_true", help="also ours with the tower frozen (our default)")
    parser.add_argument("--baseline", default=None, help="another checkout: its ours sides too, as base:LAYOUT")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per side (1: its CPU seconds are its work, no spinning)"
    )
    parser.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    if args.pairs < 8 * (1 + args.steps):
        parser.error(f"--pairs {args.pairs} < 8 x (1 + --steps {args.steps})")
    work = Path(args.work or tempfile.mkdtemp(prefix="dpo-vision-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    sides = ["trl"]
    for layout in ("separate", "shared_prompt"):  # a layout's variants one after another: alike loads
        sides += [f"ours:{layout}:trained"] + [f"base:{layout}:trained"] * bool(args.baseline)
        sides += [f"ours:{layout}:frozen"] * args.frozen
    rows = write_rows(work / "rows", args.pairs, seed=0)
    results = []
    for family in args.families:
        model = MAKERS[family](work / family)
        data = build(model, rows, work / f"{family}-data")
        units_of = units(model, rows)
        for _ in range(args.repeats):
            trl = None
            for side in sides:
                got = measure(family, side, model, data, rows, units_of, args, work)
                trl = got if side == "trl" else trl
                results.append(got)
                print(line(got, trl), flush=True)
    orders = {json.dumps(steps_of(r["order"])) for r in results if r["family"] == results[0]["family"]}
    losses = [abs(r["step1_loss"] - LOG2) for r in results]
    summary = {
        "same order on every side": len(orders) == 1,
        "step-1 max |loss - log 2|": max(losses),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))
    print("JSON " + json.dumps({"results": results, "summary": summary}))
    if len(orders) != 1:
        raise SystemExit("the sides trained different pairs")
    if max(losses) > 1e-4:
        raise SystemExit(f"a step-1 loss is not log 2: {[r['step1_loss'] for r in results]}")


if __name__ == "__main__":
    main()
