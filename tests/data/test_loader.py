"""Loader pipelines: order, packing, the micro-batch contract, coverage and exact resume (workers 0 and 2)."""

from __future__ import annotations

import itertools
import json
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpo_data.dataset.store import PairIds, PairStore
from dpo_data.errors import DataError
from dpo_data.loading.config import LoaderConfig
from dpo_data.loading.loader import DPOLoader
from dpo_data.loading.microbatch import IGNORE_INDEX, MicroBatch, is_last, pack_microbatch
from dpo_data.loading.order import epoch_order, permutation
from dpo_data.loading.steps import PlannerState, StepPlanner
from tests.harness import run_process

PAIRS = dict(batching="pairs", pairs_per_step=16, max_tokens_per_microbatch=400)
TOKENS = dict(batching="tokens", microbatches_per_step=2, max_tokens_per_microbatch=400)


def key(batch: dict) -> tuple:
    """Everything a micro-batch carries, in comparable form."""
    return tuple((k, v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in sorted(batch.items()))


def stream(dataset, max_epochs=1, **config) -> list[tuple]:
    return [key(b) for b in DPOLoader([dataset], LoaderConfig(**config), max_epochs=max_epochs)]


def test_the_order_is_pinned_to_its_definition():
    # Raw PCG64 draws, not Generator.permutation: these values must never change under a numpy upgrade.
    assert permutation(8, seed=0, epoch=0, fingerprint="sha256:x").tolist() == [0, 4, 1, 5, 7, 3, 6, 2]
    assert permutation(8, seed=0, epoch=1, fingerprint="sha256:x").tolist() != permutation(8, 0, 0, "sha256:x").tolist()


def test_weights_repeat_or_leave_out_pairs_by_seed_and_epoch():
    order = epoch_order([4, 6], [2.0, 0.5], seed=3, epoch=0, fingerprint="f")
    counts = np.bincount(order, minlength=10)
    assert counts[:4].tolist() == [2, 2, 2, 2] and counts[4:].sum() == 3 and counts[4:].max() == 1
    again = epoch_order([4, 6], [2.0, 0.5], seed=3, epoch=0, fingerprint="f")
    assert order.tolist() == again.tolist()
    with pytest.raises(DataError, match="weights must be finite numbers >= 0"):
        epoch_order([4], [-1.0], 0, 0, "f")


@pytest.mark.parametrize("config", [PAIRS, TOKENS], ids=["pairs", "tokens"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_every_pair_once_per_epoch_over_all_ranks(sample_dataset, config, world_size):
    seen = []
    for rank in range(world_size):
        for batch in DPOLoader(
            [sample_dataset], LoaderConfig(**config, world_size=world_size, rank=rank), max_epochs=1
        ):
            seen += batch["pair_index"].tolist()
            assert batch["num_input_tokens"] <= config["max_tokens_per_microbatch"]
    assert sorted(seen) == list(range(342))


def test_pairs_mode_steps_do_not_depend_on_world_size_budget_or_workers(sample_dataset):
    def steps(**overrides):
        out = {}
        for rank in range(overrides.get("world_size", 1)):
            for b in DPOLoader([sample_dataset], LoaderConfig(**{**PAIRS, **overrides, "rank": rank}), max_epochs=1):
                out.setdefault(b["step"], set()).update(b["pair_index"].tolist())
        return out

    reference = steps()
    assert steps(world_size=4) == reference
    assert steps(max_tokens_per_microbatch=2000) == reference
    assert steps(num_workers=2) == reference


def test_a_pair_over_the_budget_is_an_error_naming_the_numbers(sample_dataset):
    with pytest.raises(DataError, match=r"pair \d+ has \d+ input tokens .* more than max_tokens_per_microbatch 100"):
        DPOLoader([sample_dataset], LoaderConfig(**{**TOKENS, "max_tokens_per_microbatch": 100}))


def test_tokens_mode_drains_the_buffer_without_replay(sample_dataset):
    batches = list(DPOLoader([sample_dataset], LoaderConfig(**TOKENS), max_epochs=1))
    indices = [i for b in batches for i in b["pair_index"].tolist()]
    assert len(indices) == len(set(indices)) == 342
    fill = [b["num_input_tokens"] / 400 for b in batches if b["num_pairs"]]
    assert np.mean(fill[:-4]) > 0.9  # packing works in the body of the epoch


def pair(index, prompt, chosen, rejected):
    arr = lambda xs: np.array(xs, dtype=np.int32)
    return PairIds(index, 0, arr(prompt), arr(chosen), arr(rejected))


def test_microbatch_labels_positions_and_segments():
    b = pack_microbatch([pair(7, [1, 2, 3], [4, 5], [6]), pair(9, [8], [9], [10, 11])])
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 1, 2, 3, 6, 8, 9, 8, 10, 11]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 0, 1, 2]]
    X = IGNORE_INDEX
    # The last prompt position predicts the first completion token; nothing predicts across segments.
    assert b["labels"].tolist() == [[X, X, 4, 5, X, X, X, 6, X, 9, X, 10, 11, X]]
    assert b["cu_seqlens"].tolist() == [0, 5, 9, 11, 14] and b["max_seqlen"] == 5
    assert b["segment_pair"].tolist() == [0, 0, 1, 1] and b["segment_role"].tolist() == [0, 1, 0, 1]
    assert b["pair_index"].tolist() == [7, 9]
    assert (b["num_pairs"], b["num_input_tokens"], b["num_supervised_tokens"], b["num_padding_tokens"]) == (2, 14, 6, 0)


def test_one_token_segment_is_not_padding():
    # A padding segment of one token beside genuine short segments: identity comes from segment_role,
    # never from position_ids == 0.
    b = pack_microbatch([pair(0, [5], [6], [7])], pad_to_multiple_of=5)
    assert b["segment_length"].tolist() == [2, 2, 1]
    assert b["segment_role"].tolist() == [0, 1, -1] and b["segment_pair"].tolist() == [0, 0, -1]
    assert b["labels"].tolist()[0][4] == IGNORE_INDEX and b["num_padding_tokens"] == 1
    assert b["num_input_tokens"] == 4 and b["num_supervised_tokens"] == 2


def resume_matches(dataset, config, k, max_epochs=2):
    full = stream(dataset, max_epochs, **config)
    loader = DPOLoader([dataset], LoaderConfig(**config), max_epochs=max_epochs)
    it = iter(loader)
    head = [key(next(it)) for _ in range(k)]
    state = loader.state_dict()
    fresh = DPOLoader([dataset], LoaderConfig(**config), max_epochs=max_epochs)
    fresh.load_state_dict(state)
    assert head + [key(b) for b in fresh] == full
    return len(full)


@pytest.mark.parametrize("config", [PAIRS, TOKENS], ids=["pairs", "tokens"])
@pytest.mark.parametrize("where", ["start", "mid_drain", "epoch_end", "after_last"])
def test_resume_at_the_edges(sample_dataset, config, where):
    per_epoch = len(stream(sample_dataset, 1, **config))
    # Each epoch has its own order, so the two epochs may pack into different numbers of micro-batches.
    both = len(stream(sample_dataset, 2, **config))
    # mid_drain: inside the epoch's last steps, where tokens mode empties its buffer
    k = {"start": 0, "mid_drain": per_epoch - 1, "epoch_end": per_epoch, "after_last": both}[where]
    assert resume_matches(sample_dataset, config, k) == both > per_epoch


@given(k=st.integers(min_value=0, max_value=60), tokens=st.booleans(), rank=st.integers(0, 1))
@settings(max_examples=12, deadline=None)
def test_resume_anywhere_gives_the_uninterrupted_stream(sample_dataset, k, tokens, rank):
    resume_matches(sample_dataset, {**(TOKENS if tokens else PAIRS), "world_size": 2, "rank": rank}, k)


RESUME_CHILD = """
import json, sys
from dpo_data.loading.loader import DPOLoader
from dpo_data import LoaderConfig
from tests.data.test_loader import key
dataset, jobs = sys.argv[1], json.loads(sys.argv[2])
out = []
for config, state_path in jobs:  # each resume from its own state file, in a loader of its own
    loader = DPOLoader([dataset], LoaderConfig(**config), max_epochs=2)
    loader.load_state_dict(json.load(open(state_path)))
    out.append([repr(key(b)) for b in loader])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_resume_with_two_workers_in_a_fresh_process(sample_dataset, tmp_path):
    """Pairs and tokens mode over 2 epochs with 2 workers: the state saved after the first batch, a third in and
    just into the second epoch, as a run saves it and goes on, then restored by loaders with 2 workers in another
    process, gives the rest of the uninterrupted stream. Starting workers costs seconds per loader: one loader per
    mode runs the whole stream, saving on the way, and one process restores all six states (each into a loader
    of its own, from its file alone)."""
    jobs, expected = [], []
    for mode, base in (("pairs", PAIRS), ("tokens", TOKENS)):
        config = {**base, "num_workers": 2, "world_size": 2, "rank": 1}
        total = len(stream(sample_dataset, 2, **{**config, "num_workers": 0}))  # only where to save
        cuts = (1, total // 3, total // 2 + 1)
        loader = DPOLoader([sample_dataset], LoaderConfig(**config), max_epochs=2)
        full = []
        for batch in loader:
            full.append(repr(key(batch)))
            if len(full) in cuts:
                state_path = tmp_path / f"state-{mode}-{len(full)}.json"
                state_path.write_text(json.dumps(loader.state_dict()))
                jobs.append((config, str(state_path)))
                expected.append((mode, len(full), full))
        del loader
        assert len(full) == total
    assert len(jobs) == 6
    out = run_process([sys.executable, "-c", RESUME_CHILD, sample_dataset, json.dumps(jobs)], timeout=300)
    rests = json.loads(out.stdout)
    for (mode, k, full), rest in zip(expected, rests, strict=True):
        assert full[:k] + rest == full, (mode, k)
        assert len(rest) == len(full) - k, (mode, k)


def test_restoring_the_same_state_twice_gives_identical_streams_and_never_aliases_it(sample_dataset):
    loader = DPOLoader([sample_dataset], LoaderConfig(**TOKENS), max_epochs=1)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    snapshot = json.dumps(state, sort_keys=True)
    streams = []
    for _ in range(2):
        fresh = DPOLoader([sample_dataset], LoaderConfig(**TOKENS), max_epochs=1)
        fresh.load_state_dict(state)
        streams.append([key(b) for b in fresh])
    assert streams[0] == streams[1] and json.dumps(state, sort_keys=True) == snapshot


def test_restore_does_not_skip_by_iteration(sample_dataset, monkeypatch):
    loader = DPOLoader([sample_dataset], LoaderConfig(**PAIRS), max_epochs=1)
    it = iter(loader)
    for _ in range(30):
        next(it)
    state = loader.state_dict()
    import dpo_data.loading.loader as module

    built = []
    real = module.pack_microbatch
    monkeypatch.setattr(module, "pack_microbatch", lambda *a, **k: built.append(1) or real(*a, **k))
    fresh = DPOLoader([sample_dataset], LoaderConfig(**PAIRS), max_epochs=1)
    fresh.load_state_dict(state)
    next(iter(fresh))
    assert len(built) == 1  # only the micro-batch asked for was built


def test_another_geometry_is_refused_with_every_difference(sample_dataset):
    loader = DPOLoader([sample_dataset], LoaderConfig(**TOKENS), max_epochs=1)
    state = loader.state_dict()
    other = DPOLoader([sample_dataset], LoaderConfig(**{**TOKENS, "seed": 1, "world_size": 2}), max_epochs=1)
    with pytest.raises(DataError, match=r"seed: saved 0, now 1; world_size: saved 1, now 2"):
        other.load_state_dict(state)


def test_pairs_mode_resumes_on_another_world_size_budget_and_workers_at_the_same_step(sample_dataset):
    config = LoaderConfig(**PAIRS)
    loader = DPOLoader([sample_dataset], config, max_epochs=1)
    it = iter(loader)
    batch = next(it)
    while not is_last(batch) or batch["step"] < 4:
        batch = next(it)
    state = loader.state_dict()
    rest = {}
    for rank in range(3):
        # another world size, another budget, and workers on one rank: the same steps follow
        other = {
            **PAIRS,
            "world_size": 3,
            "rank": rank,
            "max_tokens_per_microbatch": 600,
            "num_workers": 2 * (rank == 0),
        }
        resumed = DPOLoader([sample_dataset], LoaderConfig(**other), max_epochs=1)
        resumed.load_state_dict(state)
        for b in resumed:
            rest.setdefault(b["step"], set()).update(b["pair_index"].tolist())
    expected = {}
    for b in DPOLoader([sample_dataset], config, max_epochs=1):
        if b["step"] >= 5:
            expected.setdefault(b["step"], set()).update(b["pair_index"].tolist())
    assert rest == expected


def test_mixtures_keep_sources_and_reject_foreign_tokenizers(sample_dataset, tmp_path):
    store = PairStore([sample_dataset, sample_dataset])
    assert store.num_pairs == 684 and store.sources == PairStore([sample_dataset]).sources
    assert store.pair(342 + 5).chosen.tolist() == store.pair(5).chosen.tolist()
    schedule = StepPlanner(
        store.segment_tokens(np.arange(684)),
        store.dataset_sizes,
        store.fingerprint,
        LoaderConfig(**PAIRS, weights=(1.0, 0.0)),
    )
    state, seen = PlannerState(), []
    while True:
        plan, state = schedule.next_step(state)
        if plan is None:
            break
        seen += [i for r in plan.ranks for mb in r for i in mb]
    assert sorted(seen) == list(range(342))


def test_plan_shows_exactly_what_the_loader_yields(sample_dataset, run_cli):
    from dpo_cli.data import main as dpo_data
    from dpo_state.schema import schema_problems

    r = run_cli(
        dpo_data,
        "plan",
        sample_dataset,
        "--batching",
        "tokens",
        "--world-size",
        2,
        "--max-tokens-per-microbatch",
        400,
        "--microbatches-per-step",
        2,
        "--json",
    )
    doc = json.loads(r.output)
    assert schema_problems("plan", doc) == []
    for rank in range(2):
        planned = [mb["pairs"] for s in doc["steps"] for mb in s["ranks"][rank]["microbatches"]]
        loader = DPOLoader([sample_dataset], LoaderConfig(**TOKENS, world_size=2, rank=rank), max_epochs=1)
        assert [b["pair_index"].tolist() for b in loader] == planned
    assert doc["totals"]["pairs"] == 342 and 0.9 < doc["packing_efficiency"] <= 1.0
    text = run_cli(dpo_data, "plan", sample_dataset, "--batching", "pairs", "--world-size", 2).output
    assert "packing efficiency" in text and "micro-batch fill" in text


def test_loader_state_matches_its_schema(sample_dataset):
    from dpo_state.schema import schema_problems

    loader = DPOLoader([sample_dataset], LoaderConfig(**TOKENS, num_workers=2), max_epochs=1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert schema_problems("loader-state", json.loads(json.dumps(state))) == []


@pytest.mark.slow
def test_the_plain_pytorch_example_trains_without_dpo_train(sample_dataset):
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "plain_torch_loop.py"
    out = run_process([sys.executable, script, sample_dataset, "--steps", "2"])
    assert "step 0: loss 0.6931 over 8 pairs" in out.stdout  # policy == reference at step 0
    assert "dpo_train" not in out.stderr


@pytest.mark.parametrize(
    "config", [dict(PAIRS, pairs_per_step=7, max_tokens_per_microbatch=250), TOKENS], ids=["pairs", "tokens"]
)
def test_every_rank_runs_the_same_number_of_microbatches_each_step(sample_dataset, config):
    counts = []
    for rank in range(3):
        per_step = {}
        for b in DPOLoader([sample_dataset], LoaderConfig(**config, world_size=3, rank=rank), max_epochs=1):
            per_step[b["step"]] = per_step.get(b["step"], 0) + 1
            assert b["microbatches_in_step"] >= 1
        counts.append(per_step)
    assert counts[0] == counts[1] == counts[2]  # collectives line up; short ranks get empty micro-batches


@pytest.mark.parametrize("layout", ["separate", "shared_prompt"])
def test_the_loader_yields_the_keys_microbatch_defines(sample_dataset, layout):
    """`MicroBatch` is the one definition of a micro-batch's keys: each text micro-batch holds every required key
    and no key it does not define, a separate row none of the optional ones (those are the shared-prompt layout's
    and the images': over vision rows too, tests/vision/test_vision_loader.py), so the two cannot drift apart."""
    required, optional = MicroBatch.__required_keys__, MicroBatch.__optional_keys__
    loader = DPOLoader([sample_dataset], LoaderConfig(**PAIRS, layout=layout), max_epochs=1, pad_to_multiple_of=8)
    for batch in itertools.islice(loader, 3):
        keys = set(batch)
        assert keys - required <= optional, f"the loader yields keys MicroBatch lacks: {keys - required - optional}"
        assert required <= keys, f"the loader yields no {required - keys}, which MicroBatch requires"
        assert bool(keys - required) == (layout == "shared_prompt")  # a separate row holds no optional key


def test_shared_prompt_layout_stores_the_prompt_once_and_says_what_attends_to_it():
    from dpo_data.loading.microbatch import pack_shared_prompt

    b = pack_shared_prompt([pair(3, [1, 2, 3], [4, 5], [6])])
    X = IGNORE_INDEX
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3]]  # both completions continue the prompt
    assert b["segment_role"].tolist() == [2, 0, 1] and b["segment_context"].tolist() == [-1, 0, 0]
    assert b["labels"].tolist() == [[X, X, X, 5, X, X]]
    assert b["segment_first_label"].tolist() == [X, 4, 6]  # predicted from the last prompt position (2)
    assert (b["num_input_tokens"], b["num_supervised_tokens"]) == (6, 3)


def test_shared_prompt_budgets_count_the_prompt_once(sample_dataset):
    shared = list(DPOLoader([sample_dataset], LoaderConfig(**TOKENS, layout="shared_prompt"), max_epochs=1))
    separate = list(DPOLoader([sample_dataset], LoaderConfig(**TOKENS), max_epochs=1))
    assert sorted(i for b in shared for i in b["pair_index"].tolist()) == list(range(342))
    assert all(b["num_input_tokens"] <= 400 for b in shared)
    assert len(shared) < len(separate)  # more pairs fit once prompts are not repeated
