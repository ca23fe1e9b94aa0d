"""The shared test harness holds its promises: a hung spawn fails the test instead of stalling CI."""

from __future__ import annotations

import time

import pytest

from tests.harness import spawn


def _hangs(rank: int, world: int, port: int) -> None:
    time.sleep(120)


def _raises(rank: int, world: int, port: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")


def test_a_hung_spawn_fails_the_test_within_its_timeout():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"2 spawned ranks of _hangs did not finish within 3 s"):
        spawn(_hangs, 2, timeout_s=3)
    assert time.monotonic() - start < 60  # the hung ranks were killed, not waited for


def test_a_failing_rank_fails_the_test_with_its_error():
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        spawn(_raises, 2)
