"""Every rank of a run on the same code, releases, config and run directory: ranks that differ are refused."""

from __future__ import annotations

import os
import re

import pytest

from tests.harness import join_gloo, spawn, tiny_config, write_yaml


def _fake_release(root, name: str, version: str) -> None:
    """A distribution's metadata of another release first on sys.path (importlib.metadata reads it; imports do not)."""
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _ranks(rank: int, world: int, port: int, root: str, case: str) -> None:
    import dataclasses
    import sys

    import torch.distributed as dist

    from dpo_state.errors import DependencyError
    from dpo_state.installed import code_fingerprint, environment
    from dpo_train.config.sections import TrainConfig
    from dpo_train.errors import ConfigError
    from dpo_train.run import agreement

    join_gloo(rank, world, port)
    real, ours = environment()["torch"], code_fingerprint()  # rank 0's, before rank 1 changes its own
    config = TrainConfig()
    if case == "same":
        agreement.check_ranks_agree(config, world)
    elif case == "config":  # rank 1 read an older copy of the file: another lr and beta
        if rank == 1:
            config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=2e-5))
            config = dataclasses.replace(config, loss=dataclasses.replace(config.loss, beta=0.5))
        with pytest.raises(ConfigError) as refused:
            agreement.check_ranks_agree(config, world)
        message = str(refused.value)
        assert "the 2 ranks of this run were given different configs:\n" in message
        assert f"  - loss.beta: {TrainConfig().loss.beta} on rank 0; 0.5 on rank 1\n" in message
        assert f"  - optim.lr: {TrainConfig().optim.lr} on rank 0; 2e-05 on rank 1\n" in message
        assert message.count("\n  - ") == 2, message  # only what differs
    else:
        if rank == 1 and case == "release":
            sys.path.insert(0, root)
        if rank == 1 and case == "code":
            agreement.code_fingerprint = lambda: "sha256:another-checkout"
        with pytest.raises(DependencyError) as refused:
            agreement.check_ranks_agree(config, world)
        message = str(refused.value)
        assert "the 2 ranks of this run do not run the same code and libraries" in message
        line = {
            "release": f"  - torch: {real} on rank 0; 2.99.0 on rank 1\n",
            "code": f"  - dpo-toolkit code: {ours} on rank 0; sha256:another-checkout on rank 1\n",
        }[case]
        assert line in message and message.count("\n  - ") == 1, message  # only what differs
    dist.destroy_process_group()


@pytest.mark.parametrize("case", ["same", "release", "code", "config"])
def test_ranks_on_other_code_or_releases_are_refused_on_every_rank(tmp_path, case):
    _fake_release(tmp_path, "torch", "2.99.0")
    spawn(_ranks, 2, str(tmp_path), case)


def test_two_nodes_with_different_environments_are_refused(small_dataset, smollm2_dir, tmp_path):
    """Node 1 has another torch (its metadata first on PYTHONPATH): both launchers stop at start, naming it."""
    from tests.train.test_trainer import two_nodes

    site = tmp_path / "node1-site"
    _fake_release(site, "torch", "2.99.0")
    config = write_yaml(tmp_path / "c.yaml", tiny_config(small_dataset, smollm2_dir, tmp_path / "run", max_steps=1))
    pythonpath = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    results = two_nodes(config, node_env={1: {"PYTHONPATH": pythonpath}})
    assert all(code != 0 for code, _ in results), results
    both = "".join(err for _, err in results)
    # the rendezvous, not --node-rank, numbers the ranks: node 1's may be rank 0
    assert "do not run the same code and libraries" in both and "2.99.0 on rank" in both
    assert re.search(r"torch: \S+ on rank \d; \S+ on rank \d", both)
    assert all("Traceback" not in err for _, err in results)


def _directories(rank: int, world: int, port: int, root: str, case: str) -> None:
    from pathlib import Path

    import torch.distributed as dist

    from dpo_train.errors import ConfigError
    from dpo_train.run.directory import check_shared

    join_gloo(rank, world, port)
    out = Path(root) / ("run" if case == "shared" or rank == 0 else f"node{rank}-run")
    out.mkdir(exist_ok=True)
    if case == "shared":
        check_shared(out, rank, world)
    else:
        with pytest.raises(ConfigError) as refused:
            check_shared(out, rank, world)
        message = str(refused.value)
        assert "train.output_dir is not one directory for every rank: rank 1 (" in message, message
        assert f"{Path(root) / 'node1-run'}) cannot see the file rank 0 wrote into " in message
        assert f"{Path(root) / 'run'} within 5 s" in message
    dist.barrier()
    assert list(out.iterdir()) == []  # the marker is gone
    dist.destroy_process_group()


@pytest.mark.parametrize("case", ["shared", "apart"])
def test_ranks_that_do_not_see_one_run_directory_are_refused(tmp_path, case):
    """A directory local to each machine would leave checkpoints that no run can resume: refused at start."""
    spawn(_directories, 2, str(tmp_path), case)


def test_two_nodes_with_a_relative_output_dir_in_other_working_directories_are_refused(
    small_dataset, smollm2_dir, tmp_path
):
    """`train.output_dir: run` from two working directories is two directories: both launchers stop at start."""
    from tests.train.test_trainer import two_nodes

    config = write_yaml(tmp_path / "c.yaml", tiny_config(small_dataset, smollm2_dir, "run", max_steps=1))
    homes = {r: tmp_path / f"node{r}" for r in (0, 1)}
    for home in homes.values():
        home.mkdir()
    results = two_nodes(config, node_cwd=homes)
    assert all(code == 2 for code, _ in results), results
    both = "".join(err for _, err in results)
    assert "train.output_dir is not one directory for every rank: rank " in both
    assert "Fix: an absolute output_dir on a filesystem every machine mounts at the same path" in both
    assert all("Traceback" not in err for _, err in results)
    assert not any((home / "run" / "checkpoints").exists() for home in homes.values())  # nothing trained
