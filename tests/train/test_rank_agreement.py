"""Every rank of a run on the same code and releases: two nodes with different environments are refused at start."""

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
    import sys

    import torch.distributed as dist

    from dpo_state.errors import DependencyError
    from dpo_state.installed import code_fingerprint, environment
    from dpo_train.run import agreement

    join_gloo(rank, world, port)
    real, ours = environment()["torch"], code_fingerprint()  # rank 0's, before rank 1 changes its own
    if case == "same":
        agreement.check_ranks_agree(None, world)
    else:
        if rank == 1 and case == "release":
            sys.path.insert(0, root)
        if rank == 1 and case == "code":
            agreement.code_fingerprint = lambda: "sha256:another-checkout"
        with pytest.raises(DependencyError) as refused:
            agreement.check_ranks_agree(None, world)
        message = str(refused.value)
        assert "the 2 ranks of this run do not run the same code and libraries" in message
        line = {
            "release": f"  - torch: {real} on rank 0; 2.99.0 on rank 1\n",
            "code": f"  - dpo-toolkit code: {ours} on rank 0; sha256:another-checkout on rank 1\n",
        }[case]
        assert line in message and message.count("\n  - ") == 1, message  # only what differs
    dist.destroy_process_group()


@pytest.mark.parametrize("case", ["same", "release", "code"])
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
