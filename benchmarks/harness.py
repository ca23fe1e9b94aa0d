"""What the benchmarks share: fresh-process children answering one `RESULT {json}` line, timing, memory, data."""

from __future__ import annotations

import importlib
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SAMPLE = ROOT / "examples" / "sample"
RESULT = "RESULT "
STDERR_TAIL = 4000  # characters of a failed child's stderr shown: its traceback, not its whole log

# -- fresh processes ------------------------------------------------------------------------------


class ChildFailed(SystemExit):
    """A child that exited non-zero or printed no RESULT line. A SystemExit: uncaught, it ends the benchmark
    with this message and the child's stderr tail, not with a traceback of the parent."""

    def __init__(self, label: str, returncode: int, stderr: str):
        why = f"exit {returncode}" if returncode else "exit 0 but no RESULT line"
        super().__init__(f"{label} failed ({why}):\n{stderr[-STDERR_TAIL:]}")
        self.returncode, self.stderr = returncode, stderr


def emit(value: Any) -> None:
    """A child's answer to its parent: one `RESULT {json}` line on stdout."""
    print(RESULT + json.dumps(value), flush=True)


def run_child(argv: list, env: dict | None = None, label: str | None = None) -> Any:
    """Run `python ARGV...` in a fresh interpreter (extra `env` over this one's) and return the value of its
    last `RESULT {json}` line; ChildFailed if it exits non-zero or prints none."""
    argv = [str(a) for a in argv]
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env={**os.environ, **(env or {})})
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode or not lines:
        raise ChildFailed(label or " ".join(argv), proc.returncode, proc.stderr)
    return json.loads(lines[-1][len(RESULT) :])


def call(function: Callable, *args: Any, env: dict | None = None, pythonpath: str | None = None) -> Any:
    """`function(*args)` in a fresh interpreter: a top-level function of a module in benchmarks/, its arguments
    and result JSON. `pythonpath` (another checkout) is imported from before the installed project."""
    module = Path(sys.modules[function.__module__].__file__).stem  # "__main__" is the benchmark run as a script
    env = dict(env or {})
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), os.environ.get("PYTHONPATH")) if p)
    label = f"{module}.{function.__name__}{tuple(args)}"
    return run_child([HERE / "harness.py", module, function.__name__, json.dumps(args)], env, label)


def _serve(module: str, function: str, args: str) -> None:
    """The child side of `call`: run as `python benchmarks/harness.py MODULE FUNCTION ARGS_JSON`, so that
    benchmarks/ is first on sys.path and MODULE imports as itself (not as __main__: its main() does not run)."""
    emit(getattr(importlib.import_module(module), function)(*json.loads(args)))


# -- timing and memory ----------------------------------------------------------------------------


def seconds(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call of fn."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], Any], repeat: int = 5) -> float:
    """The median wall seconds of `repeat` calls of fn."""
    return statistics.median(seconds(fn) for _ in range(repeat))


def peak_rss_mib() -> float:
    """This process's lifetime peak RSS (ru_maxrss, KiB on Linux) in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_bytes() -> int:
    """This process's RSS now (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """The highest RSS (bytes) seen while `on`, sampled every `interval` seconds on a daemon thread."""

    def __init__(self, interval: float, on: bool = False):
        self.interval, self.on, self.peak = interval, on, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.is_set():
            if self.on:
                self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def stop(self) -> int:
        """End the sampling; the peak seen."""
        self._done.set()
        self._thread.join()
        return self.peak


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- datasets -------------------------------------------------------------------------------------


def sample_inputs() -> list[str]:
    """The files of examples/sample/ (not heldout/, not its README): 342 short pairs."""
    return sorted(str(p) for p in SAMPLE.iterdir() if p.is_file() and not p.name.endswith(".md"))


def build_dataset(inputs: Iterable, tokenizer_dir: str | Path, out: Path, **options: Any):
    """`dpo_data.prepare.build.build` of `inputs` into `out` (BuildOptions from `options`); exits naming the
    refusal if the build refuses."""
    from dpo_data.prepare.build import BuildOptions, build

    result = build([str(p) for p in inputs], str(tokenizer_dir), Path(out), BuildOptions(**options))
    if result.error is not None or result.manifest is None:
        raise SystemExit(f"build of {out} refused: {result.error}")
    return result


def smollm2_and_sample(work: Path) -> tuple[str, str]:
    """The bundled SmolLM2-135M-Instruct, and the sample built with its tokenizer into WORK/train (once)."""
    from dpo_train.model.bundled import materialize_smollm2

    model, data = str(materialize_smollm2()), Path(work) / "train"
    if not (data / "manifest.json").is_file():
        build_dataset(sample_inputs(), model, data)
    return model, str(data)


def cpu_trainer(config: Any, store: Any, out: Path | None = None) -> Any:
    """The real `Trainer` of one process on the CPU in fp32 over `store`, driven by the benchmark's own loop (no
    process group, no run directory unless `out`)."""
    from dpo_train.parallel.device import placement
    from dpo_train.run.setup import local_run
    from dpo_train.trainer import Trainer

    return Trainer(local_run(config, placement("cpu", "fp32"), store, out=out))


def timed_steps(trainer: Any, loader: Any, steps: int) -> tuple[list[float], list[dict]]:
    """Feed `loader`'s micro-batches to `trainer` for 1 + `steps` optimizer steps: each step's wall seconds
    (the first one, with its warm-up, included) and every micro-batch fed."""
    from dpo_data import is_last

    times, batches, started = [], [], time.perf_counter()
    for batch in loader:
        batches.append(batch)
        trainer.microbatch(batch)
        if is_last(batch):
            trainer.step()
            times.append(time.perf_counter() - started)
            started = time.perf_counter()
            if len(times) > steps:
                break
    return times, batches


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """One JSON object per line, UTF-8."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# -- the tiny model -------------------------------------------------------------------------------


def tiny_llama(**changes: Any) -> dict:
    """tests/tiny.py's tiny random Llama spec with `changes`: the one the tests build theirs from."""
    return _tiny().tiny_llama(**changes)


def tiny_llama_model(**changes: Any) -> Any:
    """tests/tiny.py's random `LlamaForCausalLM` of `tiny_llama(**changes)`; the caller seeds torch."""
    return _tiny().tiny_llama_model(**changes)


def _tiny() -> Any:
    """tests/tiny.py loaded from this checkout by its path: a --baseline checkout first on PYTHONPATH (whose tests/
    may predate it) does not shadow it, and nothing else of tests/ is imported."""
    import importlib.util

    if "dpo_tiny_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("dpo_tiny_model", ROOT / "tests" / "tiny.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["dpo_tiny_model"] = module
        spec.loader.exec_module(module)
    return sys.modules["dpo_tiny_model"]


# -- generated conversational pairs ---------------------------------------------------------------

_WORDS = """
the of and to in is that for it as with was on be by this are or from at an have not which but
all they one can more has were their there been if would will when what so about out up into
them some could other time only new these two may then do first any my now such like our over
also its after most made many before must through back years where much your way well down
should because each just those people how too little state good very make world still own see
men work long get here between both life being under never day same another know while last
might us great old year off come since against go came right used take three system data model
value error file process result memory network server client request response token sequence
batch gradient loss learning rate optimizer checkpoint dataset record field column index table
query cache thread worker queue lock buffer stream packet latency throughput bandwidth storage
disk volume cluster node region budget invoice customer order payment account balance report
chapter section paragraph sentence summary argument evidence claim theory experiment sample
measure average median variance estimate interval probability function variable constant loop
branch compile debug deploy release version patch feature option setting parameter default
river mountain forest valley ocean island desert city village bridge road garden kitchen window
coffee breakfast dinner recipe flour sugar butter salt pepper onion garlic tomato cheese bread
history culture language music painting theatre museum library novel poem author reader editor
doctor patient symptom treatment dose hospital clinic nurse health exercise sleep weather storm
quickly carefully roughly exactly probably usually rarely clearly simply directly easily gently
important different possible available similar common specific general simple difficult large
small recent early late local global public private correct wrong strong weak bright dark warm
explain describe compare consider suggest include provide require allow ensure improve reduce
increase change check verify update create delete remove replace convert translate calculate
""".split()
_RARE = [
    "café",
    "naïve",
    "façade",
    "Zürich",
    "São",
    "Paulo",
    "résumé",
    "jalapeño",
    "Ångström",
    "–",
    "€",
    "£",
    "μs",
    "°C",
    "×",
    "≈",
    "François",
    "Kraków",
    "Dvořák",
]
_NAMES = [
    "Alice",
    "Bob",
    "Chen",
    "Dana",
    "Emeka",
    "Farah",
    "Goran",
    "Hiro",
    "Ines",
    "Jonas",
    "Python",
    "Rust",
    "Linux",
    "PostgreSQL",
    "Kubernetes",
    "Paris",
    "Tokyo",
    "Nairobi",
    "Lima",
    "Oslo",
    "Monday",
    "March",
]
_SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise technical assistant. Answer in at most three sentences.",
    "You are a friendly tutor for high-school students; explain each step and avoid jargon.",
    "You answer questions about cooking. Use metric units and give exact quantities.",
    "You are a careful code reviewer. Point out bugs first, then style issues.",
    "Reply in plain English. If you are not sure, say so and explain what would settle it.",
]
_OPENERS = [
    "Can you",
    "Could you",
    "Please",
    "How do I",
    "Why does",
    "What is the best way to",
    "Is it true that",
    "I need to",
    "Help me",
    "Explain how to",
    "Compare",
    "Write a short note that",
]


def _token(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.80:
        return rng.choice(_WORDS)
    if r < 0.86:
        return rng.choice(_NAMES)
    if r < 0.94:
        kind = rng.randrange(6)
        if kind == 0:
            return str(rng.randrange(1, 100))
        if kind == 1:
            return f"{rng.uniform(0, 1000):.{rng.randrange(1, 4)}f}"
        if kind == 2:
            return f"{rng.randrange(1, 99)},{rng.randrange(0, 999):03d}"
        if kind == 3:
            return f"{rng.randrange(1, 100)}%"
        if kind == 4:
            return str(rng.randrange(1900, 2030))
        return f"{rng.randrange(1, 500)}{rng.choice(['kg', 'ms', 'GB', 'km', 'mL', 'px'])}"
    if r < 0.97:
        return rng.choice(_RARE)
    return rng.choice(["(", '"', "'"]) + rng.choice(_WORDS) + rng.choice([")", '"', "'"])


def _text(rng: random.Random, n_words: int, opener: bool = False) -> str:
    """About n_words words in sentences, with punctuation, the odd list, code span or paragraph break."""
    out: list[str] = []
    words = 0
    first = True
    while words < n_words:
        length = min(n_words - words, rng.randrange(4, 18))
        if first and opener:
            head = rng.choice(_OPENERS).split()
            sent = head + [_token(rng) for _ in range(max(1, length - len(head)))]
        else:
            sent = [_token(rng) for _ in range(length)]
            sent[0] = sent[0][:1].upper() + sent[0][1:]
        if len(sent) > 6 and rng.random() < 0.35:
            k = rng.randrange(2, len(sent) - 2)
            sent[k] += rng.choice([",", ",", ";", ":", " -"])
        if rng.random() < 0.06:
            sent.append(f"`{rng.choice(_WORDS)}_{rng.randrange(10)} = {rng.randrange(1000)}`")
        end = "?" if first and opener else rng.choice([".", ".", ".", ".", "!", "?", "..."])
        text = " ".join(sent) + end
        if out and rng.random() < 0.12:
            text = "\n\n" + text
        elif out and rng.random() < 0.08:
            text = "\n- " + text
        out.append(text)
        words += len(sent)
        first = False
    return " ".join(out).replace(" \n", "\n")


def make_row(rng: random.Random) -> dict:
    """One conversational explicit-prompt pair: prompt ~30-120 words (some with a system message and an
    earlier exchange or two), chosen and rejected ~20-100 words each."""
    prompt_words = rng.randint(30, 120)
    messages = []
    if rng.random() < 0.3:
        system = rng.choice(_SYSTEMS)
        messages.append({"role": "system", "content": system})
        prompt_words = max(15, prompt_words - len(system.split()))
    turns = rng.choices([0, 1, 2], weights=[60, 28, 12])[0]
    if turns:
        # history: user / assistant exchanges, then the final user message
        shares = [rng.random() + 0.5 for _ in range(2 * turns + 1)]
        total = sum(shares)
        sizes = [max(5, round(prompt_words * s / total)) for s in shares]
        for t in range(turns):
            messages.append({"role": "user", "content": _text(rng, sizes[2 * t], opener=True)})
            messages.append({"role": "assistant", "content": _text(rng, sizes[2 * t + 1])})
        messages.append({"role": "user", "content": _text(rng, sizes[-1], opener=True)})
    else:
        messages.append({"role": "user", "content": _text(rng, prompt_words, opener=True)})
    chosen = _text(rng, rng.randint(20, 100))
    rejected = _text(rng, rng.randint(20, 100))
    while rejected == chosen:
        rejected = _text(rng, rng.randint(20, 100))
    return {
        "prompt": messages,
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def write_rows(path: Path, n: int, seed: int) -> None:
    """n rows of `make_row` from `seed`, as JSON lines (orjson's compact bytes: what build_throughput times)."""
    import orjson

    rng = random.Random(seed)
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(orjson.dumps(make_row(rng)) + b"\n")


if __name__ == "__main__":
    _serve(*sys.argv[1:])
