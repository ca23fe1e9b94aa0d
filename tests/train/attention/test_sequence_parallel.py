"""Sequence parallelism (Ulysses x context) on real gloo process groups with a tiny random model: rows split
inside chosen, on the chosen/rejected boundary, inside rejected and across three ranks give the
single-process per-pair log-probs and gradients; training and resume under a mesh match one process."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dpo_data.loading.microbatch import is_last
from dpo_train.logps.scoring import Scoring
from tests.harness import join_gloo, rank_worker, spawn, state_here, tiny_trainer, train_here
from tests.tiny import tiny_llama
from tests.train.checkpoint.test_checkpoint import config, metrics, train

MODEL = tiny_llama(vocab_size=512, num_attention_heads=4)
"""4 heads, 2 key/value heads: Ulysses 2 splits both; grouped-query attention is exercised."""
MESHES = [(2, 1), (1, 2), (2, 2), (1, 4)]  # (ulysses, context), built in this order on 4 ranks
TOL = 1e-5  # fp32: the same sums, added in another order


def _pair(index: int, prompt: int, chosen: int, rejected: int):
    rng = np.random.default_rng(index)
    ids = lambda n: rng.integers(1, MODEL["vocab_size"], n).astype(np.int32)  # noqa: E731 - three short draws
    return SimpleNamespace(index=index, source_id=0, prompt=ids(prompt), chosen=ids(chosen), rejected=ids(rejected))


# Each row, with where the cuts fall. Segment lengths are prompt + completion.
ROWS = {
    # segments 10 | 6: at 2 ranks the cut (8) is inside chosen; at 4 (cuts 4, 8, 12) inside both
    "inside chosen": [_pair(0, 3, 7, 3)],
    # segments 8 | 8: at 2 ranks the cut is exactly on the chosen/rejected boundary
    "on the boundary": [_pair(1, 4, 4, 4)],
    # segments 5 | 11: the cut (8) is inside rejected
    "inside rejected": [_pair(2, 2, 3, 9)],
    # segments 3 | 3 | 8 | 10 = 24; at 4 ranks (6 each) pair 4 spans ranks 1, 2 and 3
    "a pair across three ranks": [_pair(3, 2, 1, 1), _pair(4, 5, 3, 5)],
    # segments 6 | 4 | 3 | 2 = 15: a one-token completion ends the row, one padding token makes it 16
    "one-token final completion next to divisibility padding": [_pair(5, 3, 3, 1), _pair(6, 1, 2, 1)],
}


SHARED = ("a pair across three ranks", "one-token final completion next to divisibility padding")


def _model():
    from transformers import AutoConfig, AutoModelForCausalLM

    from dpo_train.attention import sequence_parallel

    sequence_parallel.register()
    spec = dict(MODEL)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _logps_and_gradients(model, batch, mesh=None, scoring: Scoring | None = None) -> dict:
    """Per-pair sums and the gradient of a fixed function of them (summed over the group's ranks)."""
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.parallel import collectives

    model.zero_grad(set_to_none=True)
    out = pair_logps(model, batch, scoring or Scoring(), mesh)
    weights = torch.arange(1, 2 * batch["num_pairs"] + 1, dtype=torch.float32).reshape(-1, 2) / 10
    (out.chosen * weights[:, 0] - out.rejected * weights[:, 1]).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if mesh is not None:  # each rank holds its positions' part of the gradient
        grads = {n: collectives.all_reduce(g, group=mesh.group) for n, g in grads.items()}
    return {
        "chosen": out.chosen.detach(),
        "rejected": out.rejected.detach(),
        "tokens": torch.stack([out.chosen_tokens, out.rejected_tokens]),
        **{f"grad/{n}": g for n, g in grads.items()},
    }


def _split_worker(rank: int, world: int, port: int, result: str) -> None:
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnf

    from dpo_data.errors import DataError
    from dpo_data.loading.microbatch import pack_microbatch, pack_shared_prompt
    from dpo_train.attention.choice import attention_for
    from dpo_train.attention.sequence_parallel import check_same_row, sequence_mesh
    from dpo_train.logps.head import COPIES
    from dpo_train.logps.pairs import row_inputs
    from dpo_train.parallel import collectives
    from dpo_train.parallel.device import placement

    join_gloo(rank, world, port)
    meshes = {(u, c): sequence_mesh(rank, world, u, c) for u, c in MESHES}
    model = _model()
    model.config._attn_implementation = attention_for("auto", placement("cpu", "fp32"), meshes[(2, 1)])
    out = {}
    for name, pairs in ROWS.items():
        batch = pack_microbatch(pairs)  # no loader padding: the split pads to U x C itself
        for (u, c), mesh in meshes.items():
            out[f"{name} U{u}C{c}"] = _logps_and_gradients(model, batch, mesh)
    for name in SHARED:  # [prompt][chosen][rejected]: completions see their prompt across the cuts
        for (u, c), mesh in meshes.items():
            out[f"shared {name} U{u}C{c}"] = _logps_and_gradients(model, pack_shared_prompt(ROWS[name]), mesh)
    chunks = Scoring(logits_budget=2 * COPIES * MODEL["vocab_size"] * 4)  # 2 of a rank's positions per chunk
    for name, pairs in ROWS.items():
        for (u, c), mesh in meshes.items():
            out[f"chunked {name} U{u}C{c}"] = _logps_and_gradients(model, pack_microbatch(pairs), mesh, chunks)
    exact = collectives.sum_same_loss
    # the mutant: a plain differentiable all-reduce, whose backward sums the gradient once per group rank
    collectives.sum_same_loss = lambda partial, group: dnf.all_reduce(partial, group=group)
    for (u, c), mesh in meshes.items():
        out[f"mutant U{u}C{c}"] = _logps_and_gradients(model, pack_microbatch(ROWS["on the boundary"]), mesh)
    collectives.sum_same_loss = exact
    rows = [pack_microbatch(pairs) for pairs in ROWS.values()]
    for name, batch in (("same rows", rows[0]), ("different rows", rows[rank % 2])):
        batch = {**batch, "step_pairs": 1, "microbatch": 0}
        try:
            check_same_row(batch, meshes[(2, 2)], step=0)
            out[name] = ""
        except DataError as e:
            out[name] = str(e)
    empty = pack_microbatch([], pad_to_multiple_of=8)  # a data-parallel rank without a pair, as the trainer runs it
    for (u, c), mesh in meshes.items():
        model.zero_grad(set_to_none=True)
        model(**row_inputs(empty, mesh)[0]).logits.sum().mul(0).backward()
        out[f"empty U{u}C{c}"] = max(float(p.grad.abs().max()) for p in model.parameters())
    if rank == 0:
        torch.save(out, result)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def single_process():
    """Per row: the per-pair sums and gradients of one process with the ordinary (sdpa) attention."""
    from dpo_data.loading.microbatch import pack_microbatch

    model = _model()
    return {name: _logps_and_gradients(model, pack_microbatch(pairs)) for name, pairs in ROWS.items()}


def _worst(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).double().norm() / a[k].double().norm().clamp(min=1e-30)) for k in a)


def test_split_rows_give_the_single_process_logps_and_gradients(single_process, tmp_path):
    """Every cut and every mesh: per-pair sums, token counts and gradients equal one process, through the
    model's own head and through the chunked one (issue 35: each rank projects its positions); a reduction
    that counts a pair once per group rank (a plain differentiable all-reduce) is caught; the shared-prompt
    layout split the same way scores pairs as the separate layout does in one process; a padding-only
    row runs through every mesh and adds nothing; ranks holding different rows are named."""
    result = tmp_path / "split.pt"
    spawn(_split_worker, 4, str(result))
    got = torch.load(result, weights_only=True)
    for name, expected in single_process.items():
        for u, c in MESHES:
            actual = got[f"{name} U{u}C{c}"]
            assert torch.equal(actual["tokens"], expected["tokens"]), (name, u, c)
            assert _worst(expected, actual) < TOL, (name, u, c, _worst(expected, actual))
    for name in SHARED:  # the shared-prompt layout under every mesh scores pairs as one separate process
        for u, c in MESHES:
            actual = got[f"shared {name} U{u}C{c}"]
            assert torch.equal(actual["tokens"], single_process[name]["tokens"]), (name, u, c)
            assert _worst(single_process[name], actual) < TOL, (name, u, c, _worst(single_process[name], actual))
    for name, expected in single_process.items():  # each rank's positions through the chunked head
        for u, c in MESHES:
            actual = got[f"chunked {name} U{u}C{c}"]
            assert torch.equal(actual["tokens"], expected["tokens"]), (name, u, c)
            assert _worst(expected, actual) < TOL, (name, u, c, _worst(expected, actual))
    for u, c in MESHES:  # the gradient counted U x C times
        assert _worst(single_process["on the boundary"], got[f"mutant U{u}C{c}"]) > 0.5
    assert all(got[f"empty U{u}C{c}"] == 0.0 for u, c in MESHES)  # it joined every collective, added nothing
    assert got["same rows"] == ""
    assert "ranks of sequence-parallel group 0 hold different rows" in got["different rows"]


RTOL = 2e-6  # the invariance suite's tolerance (tests/train/test_invariance.py)
LAYOUTS = {  # name -> (world, ulysses, context, strategy)
    "dp1 x U2": (2, 2, 1, "fsdp"),
    "dp1 x C2": (2, 1, 2, "ddp"),
    "dp2 x U2": (4, 2, 1, "fsdp"),
    "U2 x C2": (4, 2, 2, "ddp"),
}


def _train_config(dataset: str, ulysses: int = 1, context: int = 1, strategy: str = "ddp") -> dict:
    return {
        "model": {"init": {"config": {**MODEL, "vocab_size": 49152}, "seed": 0}},
        "data": {"path": dataset, "batching": "pairs", "pairs_per_step": 4, "max_tokens_per_microbatch": 256},
        "optim": {"name": "sgd", "lr": 1.0},
        "train": {"output_dir": "unused", "max_steps": 2},
        "distributed": {
            "strategy": strategy,
            "device": "cpu",
            "sequence_parallel": {"ulysses": ulysses, "context": context},
        },
    }


def _train_worker(rank: int, world: int, port: int, jobs: list) -> None:
    """One rank running each (config, result, mutant) job in turn in one process group: two SGD steps of the
    real Trainer fed by the real loader (asked for data-parallel ranks). One spawn per world size, since
    starting processes costs more than the tiny model's steps; world 1 runs in this process, without a group."""
    import torch.distributed as dist

    if world > 1:
        join_gloo(rank, world, port)
    for job in jobs:
        _train_job(rank, world, *job)
        if world > 1:
            dist.barrier()
    if world > 1:
        dist.destroy_process_group()


def _train_job(rank: int, world: int, config: dict, result: str, mutant: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from dpo_data.loading.loader import DPOLoader
    from dpo_train.attention.sequence_parallel import run_mesh
    from dpo_train.config.loading import load_config
    from dpo_train.parallel import collectives

    exact = collectives.sum_same_loss
    if mutant:  # each rank's partial sums counted as if they were the group's: a pair once per group rank
        import torch.distributed.nn.functional as dnf

        collectives.sum_same_loss = lambda partial, group: dnf.all_reduce(partial, group=group)
    cfg = load_config(config)
    mesh = run_mesh(cfg, rank, world)
    loader = DPOLoader([cfg.data.path], cfg.data.loader_config(mesh.dp_rank, mesh.dp_size), pad_to_multiple_of=8)
    trainer = tiny_trainer(cfg, rank=rank, world=world, store=loader.stream.store, mesh=mesh)
    records = []
    for batch in loader:
        trainer.microbatch(batch)
        if is_last(batch):
            records.append(trainer.step())
            if len(records) == 2:
                break
    collectives.sum_same_loss = exact
    state = get_model_state_dict(trainer.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"params": dict(state), "records": json.dumps(records)}, result)


def _trained_all(tmp_path, runs: dict) -> dict:
    """name -> (world, config, mutant) to name -> (parameters, step records); one spawn per world size above 1."""
    results = {name: tmp_path / f"{name}.pt" for name in runs}
    for world in sorted({run[0] for run in runs.values()}):
        jobs = [(config, str(results[name]), mutant) for name, (w, config, mutant) in runs.items() if w == world]
        if world == 1:
            _train_worker(0, 1, 0, jobs)
        else:
            spawn(_train_worker, world, jobs)
    loaded = {name: torch.load(path, weights_only=True) for name, path in results.items()}
    return {name: (got["params"], json.loads(got["records"])) for name, got in loaded.items()}


@pytest.mark.slow
def test_training_under_every_mesh_equals_one_process(sample_dataset, tmp_path):
    """dp1xU2, dp1xC2, dp2xU2 and U2xC2 train the same weights as one process after 2 steps (live
    reference, FSDP2 and DDP), with the same pair counts and losses, and so does dp1xC2 with each layer
    checkpointed and its MLP in tiles; counting a pair once per group rank fails."""
    dataset = str(sample_dataset)
    runs = {"base": (1, _train_config(dataset), False)}
    runs |= {
        name: (world, _train_config(dataset, u, c, strategy), False)
        for name, (world, u, c, strategy) in LAYOUTS.items()
    }
    runs["mutant"] = (2, _train_config(dataset, 2, 1, "fsdp"), True)
    tiled = _train_config(dataset, 1, 2, "ddp")  # each rank's half of a row in tiles of 4 (every MLP call cut)
    tiled["train"] |= {"activation_checkpointing": True, "mlp_tile_tokens": 4}
    runs["dp1 x C2, MLP in tiles"] = (2, tiled, False)
    trained = _trained_all(tmp_path, runs)
    base_params, base_records = trained.pop("base")

    def worst(params: dict) -> float:
        return max(
            float((base_params[k] - params[k]).double().norm() / base_params[k].double().norm()) for k in base_params
        )

    mutant, _ = trained.pop("mutant")
    for name, (params, records) in trained.items():
        world = LAYOUTS[name.split(",")[0]][0]
        assert worst(params) < RTOL, (name, worst(params))
        for a, b in zip(base_records, records, strict=True):
            assert (b["pairs"], b["input_tokens"], b["world_size"]) == (a["pairs"], a["input_tokens"], world), name
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), name
    assert worst(mutant) > 100 * RTOL


@pytest.mark.slow
def test_sigkill_and_resume_under_ulysses_is_bitwise_and_another_ulysses_is_elastic(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """Through the CLI on 2 processes with ulysses 2: SIGKILL after committing step 3, resume, and the run
    ends bitwise equal to an uninterrupted one; the step-3 checkpoint resumed with ulysses 1 on one
    process is reported elastic and trains the same pairs. 5 steps, not the checkpoint suite's 8: two steps
    after the resume carry the restored optimizer, scheduler and loader on (epoch boundaries and later kills
    are tests/train/checkpoint/test_checkpoint.py's), and each step is a checkpoint save on every rank.
    The uninterrupted run's 2 ranks are spawned (`rank_worker`: dpo-train's rank code, no torchrun launch): it
    is only the reference; the killed run and the resume are real `dpo-train --nproc-per-node 2` launches."""
    steps = {"train__max_steps": 5}
    sp = {"distributed__sequence_parallel": {"ulysses": 2}, **steps}
    full_path, full = config(tmp_path, small_dataset, smollm2_dir, "full", **sp)
    spawn(rank_worker, 2, [(str(full_path), False)])
    path, out = config(tmp_path, small_dataset, smollm2_dir, "cut", **sp)
    assert train(path, nproc=2, env={"DPO_TRAIN_KILL": "after-save:3"}, check=None).returncode != 0
    shutil.copytree(out, tmp_path / "elastic")
    resumed = train(path, nproc=2)
    assert f"resumed from {out / 'checkpoints' / 'step-000003'}" in resumed.stderr
    assert metrics(out) == metrics(full) and {r["world_size"] for r in metrics(out)} == {2}
    assert [r["step"] for r in metrics(full)] == [0, 1, 2, 3, 4]
    same = state_here(run_cli, "diff", full, out, "--values", code=None)
    assert same.exit_code == 0, same.stdout[-3000:]
    inspected = json.loads(state_here(run_cli, "inspect", out, "--json").stdout)
    assert inspected["identity"]["layout"]["sequence_parallel"] == {"ulysses": 2, "context": 1}

    elastic_path, elastic = config(tmp_path, small_dataset, smollm2_dir, "elastic", **steps)
    moved = train_here(run_cli, elastic_path)  # one process: this one (no process boundary in a resume)
    assert "elastic resume (layout.sequence_parallel.ulysses: checkpoint 2, this run 1)" in moved.stderr
    for a, b in zip(metrics(full), metrics(elastic), strict=True):
        assert (a["step"], a["pairs"], a["input_tokens"]) == (b["step"], b["pairs"], b["input_tokens"])
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)


def test_mesh_and_head_errors_name_the_sizes_and_the_fix(small_dataset, smollm2_dir, tmp_path):
    """A mesh that does not divide the world, Ulysses that does not divide the heads, and an attention
    that cannot run split are config errors before training (exit 2, named, no traceback)."""
    from dpo_train.attention.choice import attention_for
    from dpo_train.attention.sequence_parallel import check_heads, sequence_mesh
    from dpo_train.errors import ConfigError
    from dpo_train.parallel.device import placement

    with pytest.raises(ConfigError, match=r"ulysses 2 x context 2 = 4 must divide the world size 6"):
        sequence_mesh(0, 6, 2, 2)
    with pytest.raises(ConfigError, match=r"attention heads \(9\) and key/value heads \(3\)"):
        check_heads(SimpleNamespace(num_attention_heads=9, num_key_value_heads=3), 2)
    check_heads(SimpleNamespace(num_attention_heads=9, num_key_value_heads=3), 3)
    from dpo_train.config.loading import load_config

    for bad, named in (({"ulyses": 2}, "ulyses"), ({"ulysses": 0}, "ulysses")):
        with pytest.raises(ConfigError, match=named):
            load_config({"distributed": {"sequence_parallel": bad}})
    assert load_config({"distributed": {"sequence_parallel": {"context": 2}}}).distributed.sequence_sizes == (1, 2)
    mesh = SimpleNamespace(active=True)
    with pytest.raises(ConfigError, match="eager cannot run under distributed.sequence_parallel"):
        attention_for("eager", placement("cpu", "fp32"), mesh)

    one_kv_head = {"init": {"config": {**MODEL, "vocab_size": 49152, "num_key_value_heads": 1}, "seed": 0}}
    path, _ = config(
        tmp_path,
        small_dataset,
        smollm2_dir,
        "heads",
        model__init=one_kv_head["init"],
        distributed__sequence_parallel={"ulysses": 2},
    )
    failed = train(path, nproc=2, check=2)  # the failed rank's code, as in one process
    assert "attention heads (4) and key/value heads (1)" in failed.stderr
    assert "Traceback (most recent call last)" not in failed.stderr


@pytest.mark.slow
def test_precompute_and_eval_under_ulysses_and_context_equal_one_process(small_dataset, smollm2_dir, tmp_path, run_cli):
    """The precomputed reference sidecar and the held-out evaluation (before and after one step) under
    U2 x C1 and U1 x C2 on 2 processes equal one process's: each pair scored once, by its group. The one
    process is this one (train_here). Of the four 2-process runs, U2's --precompute-reference is a launched
    `dpo-train --nproc-per-node 2` (the one launch of that flag on ranks in the suite); the other three (U2's
    training run, C2's --precompute-reference and training run) are one spawn of 2 ranks (`rank_worker`:
    dpo-train's rank code in turn, without a torchrun agent and interpreter starts per run)."""
    from safetensors.numpy import load_file

    def setup(name: str, sp: dict | None) -> tuple:
        sidecar = tmp_path / f"{name}-sidecar"
        over = {"reference__path": str(sidecar), "eval__path": str(small_dataset), "train__max_steps": 1}
        path, out = config(tmp_path, small_dataset, smollm2_dir, name, distributed__sequence_parallel=sp, **over)
        return path, out, sidecar

    def results(out, sidecar) -> tuple:
        records = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
        return load_file(str(sidecar / "logps.safetensors")), records

    one_path, *one = setup("one", None)
    for args in (["--precompute-reference"], []):  # then a live reference: the sidecar is only compared
        train_here(run_cli, one_path, *args)
    base_table, base_eval = results(*one)
    meshes = {name: setup(name, sp) for name, sp in (("ulysses", {"ulysses": 2}), ("context", {"context": 2}))}
    train(meshes["ulysses"][0], "--precompute-reference", nproc=2)
    jobs = [(meshes["ulysses"][0], False), (meshes["context"][0], True), (meshes["context"][0], False)]
    spawn(rank_worker, 2, [(str(path), precompute) for path, precompute in jobs])
    for name, (_, *run) in meshes.items():
        table, records = results(*run)
        assert table.keys() == base_table.keys()
        for key in base_table:
            np.testing.assert_allclose(table[key], base_table[key], rtol=1e-5, atol=1e-4, err_msg=f"{name} {key}")
        assert [r["step"] for r in records] == [0, 1] and [r["pairs"] for r in records] == [24, 24]
        for a, b in zip(base_eval, records, strict=True):
            assert b["accuracy"] == a["accuracy"], name
            assert b["logratio_margin"] == pytest.approx(a["logratio_margin"], abs=1e-5), name
            assert b["rewards/margins"] == pytest.approx(a["rewards/margins"], abs=1e-5), name
