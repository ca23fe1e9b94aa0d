"""The compiled chunked head (issue 35, item 3): its chunk bodies compile whole, equal the eager ones, and a
compiled form that fails to build or computes something else is dropped on its first chunk, so the head's
numbers never rest on the compiler. The inductor build on CUDA is checked by scripts/device_check.sh."""

from __future__ import annotations

import pytest
import torch

from dpo_train.config.loading import load_config
from dpo_train.errors import ConfigError
from dpo_train.logps import compiled, head
from dpo_train.logps.compiled import Checked
from dpo_train.logps.scoring import Scoring
from tests.train.logps.test_head import _errors, _head


@pytest.fixture
def compiling(monkeypatch):
    """`use(compile_fn)` installs fresh chunk bodies compiled by it (the tests pass train.compiled_head: true)."""

    def use(compile_fn):
        forward = Checked(head.chunk_logps, "head (forward)", compile_fn)
        backward = Checked(head.chunk_grad, "head (backward)", compile_fn)
        monkeypatch.setattr(head, "CHUNK_LOGPS", forward)
        monkeypatch.setattr(head, "CHUNK_GRAD", backward)
        return forward, backward

    return use


def _traced(fn):
    """torch.compile's tracing and autograd-free graph, without inductor's C++ build (seconds, not a minute)."""
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("kind", ["bias", "softcap"])
def test_the_chunk_bodies_compile_as_one_graph_and_equal_the_whole_head(compiling, kind):
    forward, backward = compiling(_traced)
    errors = _errors(_head(kind), 5, compiled=True)
    assert all(error <= 1e-6 for error in errors.values()), errors
    # compiled (fullgraph: one graph, no break) and kept
    assert forward.state == backward.state == {"cpu": "checked"}, (forward.why, backward.why)


def test_a_miscompiled_chunk_is_dropped_on_its_first_use_and_the_eager_one_runs(compiling, capsys):
    calls = []

    def miscompile(fn):  # what a wrong fused kernel would do: every log-prob off by 1e-3
        def wrong(*args):
            calls.append(fn.__name__)
            out = fn(*args)
            return (out[0] + 1e-3, *out[1:])

        return wrong

    forward, backward = compiling(miscompile)
    for _ in range(2):  # the second pass runs the eager forms alone
        errors = _errors(_head("softcap"), 5, compiled=True)
        assert all(error <= 1e-6 for error in errors.values()), errors
    assert forward.state == backward.state == {"cpu": "eager"}
    assert calls == ["chunk_logps", "chunk_grad"], calls  # each compiled form ran once: on its first chunk
    assert "differs from the eager one by" in forward.why["cpu"]
    notes = [line for line in capsys.readouterr().err.splitlines() if "the compiled head" in line]
    assert len(notes) == 2 and "the eager one runs (train.compiled_head)" in notes[0], notes


def test_a_miscompile_of_the_second_shape_is_caught_too(compiling):
    """37 rows in chunks of 5: 7 chunks of 5 rows and a last of 2, the shape torch.compile builds a second
    (dynamic) graph for; a kernel wrong only there is dropped like one wrong from the start."""

    def wrong_when_short(fn):
        def run(*args):
            out = fn(*args)
            return (out[0] + 1e-3, *out[1:]) if args[0].shape[0] != 5 else out

        return run

    forward, backward = compiling(wrong_when_short)
    errors = _errors(_head("softcap"), 5, compiled=True)
    assert all(error <= 1e-6 for error in errors.values()), errors
    assert forward.state == backward.state == {"cpu": "eager"}, (forward.why, backward.why)


def test_a_later_build_that_fails_falls_back_to_eager(compiling, capsys):
    """The first two shapes check out; a third (another chunk size) fails to build: the eager form runs."""
    shapes = []

    def fails_on_a_third_shape(fn):
        def run(*args):
            if args[0].shape[0] not in shapes:
                shapes.append(args[0].shape[0])
            if len(shapes) > 2:
                raise RuntimeError("recompile failed")
            return fn(*args)

        return run

    forward, _ = compiling(fails_on_a_third_shape)
    _errors(_head("bias"), 5, compiled=True)
    assert forward.state == {"cpu": "checked"}
    errors = _errors(_head("bias"), 4, compiled=True)
    assert all(error <= 1e-6 for error in errors.values()), errors
    assert forward.why["cpu"] == "torch.compile failed: RuntimeError: recompile failed"


def test_a_compiler_that_fails_leaves_the_eager_head(compiling, capsys):
    def broken(fn):
        def build(*args):
            raise RuntimeError("no C++ compiler here\nmore lines")

        return build

    forward, _ = compiling(broken)
    errors = _errors(_head("bias"), 5, compiled=True)
    assert all(error <= 1e-6 for error in errors.values()), errors
    assert forward.why["cpu"] == "torch.compile failed: RuntimeError: no C++ compiler here"
    assert "torch.compile failed: RuntimeError: no C++ compiler here" in capsys.readouterr().err


def test_auto_compiles_on_cuda_only_true_everywhere_false_never():
    for mode, cpu, cuda in (("auto", False, True), (True, True, True), (False, False, False)):
        assert (compiled.compiles_on(mode, "cpu"), compiled.compiles_on(mode, "cuda")) == (cpu, cuda), mode


def test_the_compiled_mode_is_the_scorings_not_the_process():
    """Two scorings in one process keep their own train.compiled_head (no process-wide mode): the chunked head
    compiles for the one that says so, and the eager body runs for the other."""
    calls = []
    checked = Checked(head.chunk_logps, "head (forward)", lambda fn: lambda *a: calls.append(1) or fn(*a))
    args = (torch.randn(3, 4), torch.tensor([0, 1, 2]), torch.randn(5, 4), None, None, None, None, False)
    checked(Scoring().compiled_head, *args)  # auto: eager on the CPU
    assert calls == [] and checked.state == {}
    checked(Scoring(compiled_head=True).compiled_head, *args)
    assert calls == [1] and checked.state == {"cpu": "checked"}


def test_train_compiled_head_is_auto_true_or_false_and_names_other_values(tmp_path):
    source = {"data": {"path": str(tmp_path)}, "model": {"path": str(tmp_path)}}
    assert load_config(source, []).train.compiled_head == "auto"
    assert load_config(source, ["train.compiled_head=false"]).train.compiled_head is False
    assert load_config(source, ["train.compiled_head=on"]).train.compiled_head is True  # YAML's on is true
    for bad in ("fast", "1"):
        with pytest.raises(ConfigError) as info:
            load_config(source, [f"train.compiled_head={bad}"])
        assert "train/compiled_head" in str(info.value) and bad in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="one of auto, true, false"):
        Scoring(compiled_head=1)
