"""LoRA through PEFT end to end: adapters start at zero, only they train and are checkpointed, resume is
bitwise exact after SIGKILL, the identity covers the LoRA settings, DDP and FSDP2 agree with one process,
and final/ holds an adapter PEFT loads (plus a merged model on request)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import invoke, rank_worker, spawn, state_here, tiny_trainer, train_here
from tests.train.checkpoint.test_checkpoint import config, metrics, train

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def adapter(out):
    return load_file(out / "final" / "adapter_model.safetensors")


def lora_config(tmp_path, dataset, tokenizer, name, lora=LORA, **over):
    return config(tmp_path, dataset, tokenizer, name, model__lora=lora, **over)


@pytest.fixture(scope="module")
def single(small_dataset, smollm2_dir, tmp_path_factory):
    """One LoRA run of one process: 8 steps, a checkpoint per step, adapter and merged model exported. In this
    process (train_here): what the tests read of it does not depend on a process of its own, and an interpreter
    start would be most of its cost."""
    tmp = tmp_path_factory.mktemp("lora")
    path, out = lora_config(tmp, small_dataset, smollm2_dir, "single", train__export="both")
    train_here(invoke, path)
    return out


def test_the_first_step_is_log_2_and_the_adapters_learn(single):
    records = metrics(single)
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # B = 0: the policy is the reference
    assert records[0]["rewards/margins"] == 0.0
    assert records[-1]["rewards/margins"] > 0


def test_checkpoints_hold_the_adapters_and_their_optimizer_state_only(single):
    from dpo_state.dcp_io import read_dcp_metadata

    latest = single / "checkpoints" / "step-000008"
    state = json.loads((latest / "state.json").read_text())
    adapters = 2 * 2 * 2  # layers x (q_proj, v_proj) x (A, B)
    assert state["tensors"]["model"]["count"] == adapters
    assert state["identity"]["model"]["lora"] == {
        "r": 4,
        "alpha": 8.0,
        "dropout": 0.0,
        "target_modules": LORA["target_modules"],
    }
    names = [name for name, _ in state["identity"]["optimizer"]["parameters"]]
    assert len(names) == adapters and all(".lora_" in n for n in names)
    keys = list(read_dcp_metadata(latest / "dcp").state_dict_metadata)
    assert keys and all(".lora_" in k for k in keys), keys  # model tensors and optimizer moments alike


def test_only_adapters_get_gradients_and_optimizer_state(small_dataset, smollm2_dir, tmp_path):  # noqa: F811
    from dpo_data.loading.loader import DPOLoader

    path, _ = lora_config(tmp_path, small_dataset, smollm2_dir, "grads")
    trainer = tiny_trainer(path)
    cfg = trainer.config
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    batch = next(iter(DPOLoader(cfg.data.paths, cfg.data.loader_config(0, 1), pad_to_multiple_of=8)))
    trainer.microbatch(batch)
    with_grad = {n for n, p in trainer.policy.named_parameters() if p.grad is not None}
    assert with_grad and all(".lora_" in n for n in with_grad)
    trainer.step()
    with_state = {id(p) for p in trainer.optimizer.state}
    for name, p in trainer.policy.named_parameters():
        assert (id(p) in with_state) == (".lora_" in name), name
        if ".lora_" not in name:
            assert torch.equal(p, before[name]), name  # the base weights never move
    assert not all(torch.equal(p, before[n]) for n, p in trainer.policy.named_parameters() if "lora_B" in n)


def test_final_holds_an_adapter_peft_loads_and_a_merged_model(single, smollm2_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dpo_train.config.loading import load_config
    from dpo_train.model.policy import load_policy

    cfg = load_config(single.parent / "single.yaml")
    base = load_policy(cfg.model)
    tuned = PeftModel.from_pretrained(base, single / "final").eval()
    merged = AutoModelForCausalLM.from_pretrained(single / "final-merged").eval()
    plain = load_policy(cfg.model).eval()
    ids = torch.tensor([[1, 5, 9, 300, 4000, 7]])
    with torch.no_grad():
        a, b, c = tuned(input_ids=ids).logits, merged(input_ids=ids).logits, plain(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5)  # the merge is the adapter applied
    assert not torch.allclose(a, c, atol=1e-5)  # and the adapter changed the model
    assert (single / "final-merged" / "tokenizer.json").is_file() and (single / "final" / "tokenizer.json").is_file()


@pytest.fixture(scope="module")
def two_processes(small_dataset, smollm2_dir, tmp_path_factory):
    """One LoRA run per strategy on 2 processes, as `single` but for the world (adapter and merged model
    exported), computed on first use. Its 2 ranks are spawned (`rank_worker`), not launched: each run is a
    reference the tests compare to, not a launch they check."""
    runs = {}

    def get(strategy):
        if strategy not in runs:
            tmp = tmp_path_factory.mktemp(f"lora-{strategy}")
            path, runs[strategy] = lora_config(
                tmp, small_dataset, smollm2_dir, strategy, distributed__strategy=strategy, train__export="both"
            )
            spawn(rank_worker, 2, [(str(path), False)])
        return runs[strategy]

    return get


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_identical_under_lora(
    two_processes, small_dataset, smollm2_dir, tmp_path, run_cli
):
    """Two FSDP2 ranks of `dpo-train --nproc-per-node 2`, killed after step 5, resumed on 2 ranks: the run ends
    bitwise the uninterrupted FSDP2 run; one process is the dropout test's below (bitwise too, and with a random
    draw in every step). The resume's 2 ranks are spawned (`rank_worker`), as the dropout test resumes in this
    process: what is resumed is what the killed launch left on disk, and a launch's torchrun agent and
    interpreter starts are not what is checked (a launched resume: tests/train/test_trainer.py's moved run)."""
    k, full = 5, two_processes("fsdp")
    path, out = lora_config(tmp_path, small_dataset, smollm2_dir, "cut", train__export="both")  # FSDP2: config's
    assert train(path, nproc=2, env={"DPO_TRAIN_KILL": f"after-save:{k}"}, check=None).returncode != 0
    spawn(rank_worker, 2, [(str(path), False)], str(tmp_path / "stderr"))
    resumed = (tmp_path / "stderr.0").read_text()
    assert f"resumed from {out / 'checkpoints' / f'step-{k:06d}'}" in resumed
    assert metrics(out) == metrics(full)
    same = state_here(run_cli, "diff", full, out, "--values", code=None)
    assert same.exit_code == 0, same.stdout[-3000:]
    one, two = adapter(full), adapter(out)
    assert all(torch.equal(one[key], two[key]) for key in one)


@pytest.mark.slow
def test_sigkill_then_resume_restores_the_rng_that_lora_dropout_draws(small_dataset, smollm2_dir, tmp_path, run_cli):  # noqa: F811
    """One process, killed after step k, resumed: the run ends with the uninterrupted run's metrics and bitwise
    its model, optimizer state and adapter. LoRA dropout is the one random draw in a step (model dropout is off,
    the loader has its own seed): with dropout 0.5, a resume that did not restore the RNG states would draw
    other masks from step k + 1 on. (This is also world 1's bitwise resume under LoRA, which once ran apart
    with dropout 0 against `single` for two launches more, proving a subset of this.) Only the killed run has a
    process of its own, as the SIGKILL needs: the uninterrupted run and the resume run in this process
    (train_here), whose RNG was drawn from by every test before, so the resume's draws are the checkpoint's only
    if it restores them."""
    k, lora = 2, {**LORA, "dropout": 0.5}
    full_path, full = lora_config(tmp_path, small_dataset, smollm2_dir, "full", lora, train__max_steps=5)
    train_here(run_cli, full_path)
    path, out = lora_config(tmp_path, small_dataset, smollm2_dir, "cut", lora, train__max_steps=5)
    assert train(path, env={"DPO_TRAIN_KILL": f"after-save:{k}"}, check=None).returncode != 0
    torch.rand(7)  # a draw of this process's own: the resume starts from an RNG state no run had
    assert f"resumed from {out / 'checkpoints' / f'step-{k:06d}'}" in train_here(run_cli, path).stderr
    assert metrics(out) == metrics(full)
    same = state_here(run_cli, "diff", full, out, "--values", code=None)
    assert same.exit_code == 0, same.stdout[-3000:]  # model and optimizer state bitwise equal (atol 0)
    one, two = adapter(full), adapter(out)
    assert all(torch.equal(one[key], two[key]) for key in one)


def test_resume_with_other_lora_settings_is_refused(single, small_dataset, smollm2_dir, tmp_path, run_cli):  # noqa: F811
    """Refusals before training, in this process (train_here): they need no process of their own."""
    path, _ = lora_config(tmp_path, small_dataset, smollm2_dir, "other", lora={**LORA, "r": 8})
    proc = train_here(run_cli, path, "--set", f"train.output_dir={single}", code=2)
    assert "model.lora.r: checkpoint 4, this run 8" in proc.stderr
    full, _ = config(tmp_path, small_dataset, smollm2_dir, "nolora")
    proc = train_here(run_cli, full, "--set", f"train.output_dir={single}", code=2)
    assert "model.lora: checkpoint" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_the_adapters_like_one(strategy, single, two_processes):
    out = two_processes(strategy)
    for a, b in zip(metrics(single), metrics(out)):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
    one, two = adapter(single), adapter(out)
    assert one.keys() == two.keys() and max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-4


@pytest.mark.slow
def test_a_precomputed_reference_trains_lora_like_the_live_one(single, small_dataset, smollm2_dir, tmp_path, run_cli):  # noqa: F811
    sidecar = tmp_path / "sidecar"
    path, out = lora_config(
        tmp_path, small_dataset, smollm2_dir, "pre", reference__mode="precomputed", reference__path=str(sidecar)
    )
    # in this process, both: no process boundary in either, and an interpreter start would be most of the run
    train_here(run_cli, path, "--precompute-reference")
    train_here(run_cli, path)
    for a, b in zip(metrics(single), metrics(out)):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)


def test_export_settings_are_checked_and_the_dtype_is_applied(small_dataset, smollm2_dir, tmp_path, run_cli):  # noqa: F811
    path, _ = config(tmp_path, small_dataset, smollm2_dir, "e", train__export="merged")
    assert "train.export is merged, but model.lora is not set" in train_here(run_cli, path, code=2).stderr
    path, out = lora_config(  # one step, in this process: the export does not depend on how long it trained
        tmp_path,
        small_dataset,
        smollm2_dir,
        "m",
        train__export="merged",
        train__export_dtype="bf16",
        train__max_steps=1,
        train__save_every=0,
    )
    train_here(run_cli, path)
    weights = load_file(out / "final" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    assert not (out / "final" / "adapter_config.json").exists()
