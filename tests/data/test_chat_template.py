"""`dpo-data build --chat-template FILE`: recorded and attested, refused when not prefix-stable, and trained on
with the run's tokenizer taking the dataset's template (nothing else about the tokenizer may differ)."""

from __future__ import annotations

import re

import orjson
import pytest

from dpo_cli.data import main as data_main
from dpo_data.dataset.manifest import read_manifest
from dpo_data.dataset.store import PairStore
from dpo_data.errors import DataError
from dpo_state.attestation import tokenizer_attestation
from dpo_state.digest import file_digest, sha256_json
from tests.conftest import chat, write_jsonl
from tests.harness import tiny_config, train_here, write_yaml

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""SmolLM2's template without its default system message: prefix-stable, and different ids on rows without one."""

THINKS_ON_BANG = CHATML.replace(
    "{{ '<|im_start|>assistant\\n' }}",
    "{{ '<|im_start|>assistant\\n' }}{% if messages[-1]['content'].endswith('!') %}{{ '<think>\\n' }}{% endif %}",
)
"""Opens a think block in the generation prompt when the last user message ends with '!', which the rendered
completion never has: not prefix-stable on exactly those rows."""

ROWS = [
    chat(f"What is {i} times 3{'!' if i in (3, 7) else '?'}", f"It is {3 * i}.", f"It is {3 * i + 1}.")
    for i in range(12)
]
"""Rows 4 and 8 (1-based lines) end their prompt with '!'."""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat_template")
    (tmp / "chatml.jinja").write_text(CHATML)
    (tmp / "thinks.jinja").write_text(THINKS_ON_BANG)
    return tmp, write_jsonl(tmp / "pairs.jsonl", ROWS)


def _build(run_cli, rows, smollm2_dir, out, *args, code=0):
    result = run_cli(data_main, "build", rows, "--tokenizer", smollm2_dir, "--out", out, *args)
    assert result.exit_code == code, result.output
    return result


@pytest.fixture(scope="module")
def built(files, smollm2_dir):
    """The rows built with chatml.jinja and with SmolLM2's own template."""
    from click.testing import CliRunner

    tmp, rows = files
    for name, extra in (("override", ["--chat-template", tmp / "chatml.jinja"]), ("stock", [])):
        args = ["build", rows, "--tokenizer", smollm2_dir, "--out", tmp / name, *extra]
        result = CliRunner().invoke(data_main, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    return tmp / "override", tmp / "stock"


def test_an_override_template_builds_and_is_recorded_in_the_manifest_and_attestation(
    built, files, tokenizer, smollm2_dir, run_cli
):
    """The manifest records the file's name, sha256 and text; the attestation hashes that text as the
    template; the prompt ids are the override's rendering (no default system message), the completions the
    same as with the stock template; a build without the option records no chat_template at all."""
    override, stock = built
    template = files[0] / "chatml.jinja"
    m, s = read_manifest(override), read_manifest(stock)
    assert m["producer"]["options"]["chat_template"] == {
        "file": "chatml.jinja",
        "sha256": file_digest(template),
        "text": CHATML,
    }
    assert "chat_template" not in s["producer"]["options"]
    assert m["tokenizer"]["components"]["chat_template"] == sha256_json(CHATML)
    assert s["tokenizer"]["components"]["chat_template"] == sha256_json(tokenizer.chat_template)
    assert m["fingerprint"] != s["fingerprint"]

    got, stock_pair = PairStore([override]).pair(0), PairStore([stock]).pair(0)
    expected = "<|im_start|>user\nWhat is 0 times 3?<|im_end|>\n<|im_start|>assistant\n"
    assert got.prompt.tolist() == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert stock_pair.prompt.tolist() != got.prompt.tolist()
    assert tokenizer.decode(stock_pair.prompt).startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert got.chosen.tolist() == stock_pair.chosen.tolist()  # both render 'It is 0.<|im_end|>\n'

    # dpo-data verify --tokenizer applies the dataset's template as dpo-train does
    verified = run_cli(data_main, "verify", override, "--tokenizer", smollm2_dir)
    assert verified.exit_code == 0, verified.output


def test_a_recorded_template_edited_in_the_manifest_is_refused(built, tmp_path):
    """The text dpo-train would apply must be the one the attestation hashed: an edit is a contradiction."""
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(built[0], copy)
    manifest = orjson.loads((copy / "manifest.json").read_bytes())
    manifest["producer"]["options"]["chat_template"]["text"] = CHATML.replace("assistant", "bot")
    (copy / "manifest.json").write_bytes(orjson.dumps(manifest))
    with pytest.raises(DataError) as e:
        read_manifest(copy)
    message = str(e.value)
    assert "producer.options.chat_template.text is not the chat template the tokenizer attestation hashed" in message
    assert "producer.options.chat_template.sha256 is not the digest of its text" in message


def test_an_override_that_is_not_prefix_stable_refuses_the_build_and_commits_nothing(
    files, tokenizer, smollm2_dir, tmp_path, run_cli
):
    """With --chat-template, the two rows the template breaks fail the build (exit 1), naming the count and
    the first row; nothing is committed. The same template as a tokenizer's own keeps the per-row rule: the
    build commits the 10 other rows and rejects those two."""
    tmp, rows = files
    out = tmp_path / "refused"
    result = _build(run_cli, rows, smollm2_dir, out, "--chat-template", tmp / "thinks.jinja", code=1)
    assert (
        f"error: --chat-template {tmp / 'thinks.jinja'} is not prefix-stable on the data: 2 rows were rejected as "
        f"template_not_prefix_stable, the first at {rows} line 4 (the chat template renders the prompt "
        "differently alone than before the chosen completion"
    ) in result.stderr
    assert not out.exists()
    (staging,) = tmp_path.glob("refused.incomplete-*")
    assert not (staging / "manifest.json").exists()
    assert [r["line"] for r in map(orjson.loads, (staging / "rejects.jsonl").read_bytes().splitlines())] == [4, 8]

    own = tmp_path / "own-template"
    tokenizer.save_pretrained(own)
    (own / "chat_template.jinja").write_text(THINKS_ON_BANG)
    _build(run_cli, rows, own, tmp_path / "per-row")
    m = read_manifest(tmp_path / "per-row")
    assert m["totals"]["pairs"] == 10 and m["rejects"]["by_reason"] == {"template_not_prefix_stable": 2}


def test_a_part_holding_a_row_the_override_breaks_is_refused_at_once(files, smollm2_dir, tmp_path, run_cli):
    """With --part, the whole build would be refused anyway: the part that holds lines 4 and 8 (spans 1 and 3 of
    spans of 2 rows) refuses itself, naming the first, and commits nothing; the other part commits."""
    tmp, rows = files
    args = ["--chat-template", tmp / "thinks.jinja", "--pairs-per-shard", "2"]
    refused = _build(run_cli, rows, smollm2_dir, tmp_path / "p1", *args, "--part", "1/2", code=1)
    assert "is not prefix-stable on the data: 2 rows were rejected" in refused.stderr
    assert f"the first at {rows} line 4" in refused.stderr and not (tmp_path / "p1").exists()
    _build(run_cli, rows, smollm2_dir, tmp_path / "p0", *args, "--part", "0/2")  # even spans: lines 1-2, 5-6, 9-10


@pytest.mark.parametrize(
    "content, says",
    [
        (b"{% for message in messages %}{{ message }", "not a valid Jinja template (unexpected '}' line 1)"),
        (b"  \n", "the file is empty"),
        (b"\xff\xfe{{ messages }}", "not UTF-8 text (byte 0)"),
        (None, "cannot read it (No such file or directory)"),
    ],
)
def test_a_template_file_that_cannot_be_used_is_a_named_error(files, smollm2_dir, tmp_path, run_cli, content, says):
    path = tmp_path / "template.jinja"
    if content is not None:
        path.write_bytes(content)
    result = _build(run_cli, files[1], smollm2_dir, tmp_path / "out", "--chat-template", path, code=2)
    assert result.stderr == (
        f"error: --chat-template {path}: {says}; pass a chat template file (Jinja text, as in a tokenizer's "
        "chat_template.jinja)\n"
    )
    assert not list(tmp_path.glob("out*"))


def _run(tmp_path, dataset, tokenizer_dir, name, **sections):
    config = tiny_config(dataset, tokenizer_dir, tmp_path / name, max_steps=2)
    for key, value in sections.items():
        config.setdefault(key, {}).update(value)
    return write_yaml(tmp_path / f"{name}.yaml", config), tmp_path / name


def test_a_run_on_an_override_built_dataset_trains_and_exports_the_template(
    built, smollm2_dir, tokenizer, tmp_path, run_cli
):
    """model.tokenizer is the stock SmolLM2 directory: the run takes the dataset's template (saying so once,
    though data.path and eval.path both record it), trains, and final/ carries the template it trained with."""
    from transformers import AutoTokenizer

    override = built[0]
    path, out = _run(tmp_path, override, smollm2_dir, "run", eval={"path": str(override)})
    result = train_here(run_cli, path)
    note = f"note: data.path {override} was built with --chat-template chatml.jinja"
    assert result.stderr.count(note) == 1 and result.stderr.count("note: eval.path") == 0
    exported = AutoTokenizer.from_pretrained(out / "final")
    assert exported.chat_template == CHATML
    assert tokenizer_attestation(exported)["fingerprint"] == read_manifest(override)["tokenizer"]["fingerprint"]
    assert (out / "final" / "chat_template.jinja").read_text() == CHATML


def _differing(stderr: str) -> list[str]:
    found = re.search(r"differing parts: ([a-z_, ]+)\)", stderr)
    assert found, stderr
    return found.group(1).split(", ")


def test_a_run_tokenizer_that_differs_in_anything_else_is_still_refused(built, tokenizer, tmp_path, run_cli):
    """The template is the only part taken from the dataset: a tokenizer with one more added token is refused,
    and the template is not among the differing parts."""
    other = tmp_path / "other-tokenizer"
    tokenizer.save_pretrained(other)
    from transformers import AutoTokenizer

    grown = AutoTokenizer.from_pretrained(other)
    grown.add_tokens(["<|extra|>"])
    grown.save_pretrained(other)
    path, _ = _run(tmp_path, built[0], other, "refused")
    result = train_here(run_cli, path, code=2)
    assert "error: the run's tokenizer is not the one its data was built with" in result.stderr
    assert _differing(result.stderr) == ["added_tokens", "backend"]


def test_an_override_dataset_beside_one_without_is_refused(built, smollm2_dir, tmp_path, run_cli):
    """Their templates differ, so their tokenizer fingerprints do: as eval.path, or in one data.path list, the
    message names the differing part and where each template came from."""
    override, stock = built
    path, _ = _run(tmp_path, override, smollm2_dir, "eval", eval={"path": str(stock)})
    result = train_here(run_cli, path, code=2)
    assert _differing(result.stderr) == ["chat_template"]
    assert (
        f"eval.path: its tokenizer's own chat template, data.path: --chat-template chatml.jinja "
        f"({read_manifest(override)['producer']['options']['chat_template']['sha256'][:19]}...). Fix: build both "
        "with the same tokenizer and the same --chat-template (or none)"
    ) in result.stderr

    path, _ = _run(tmp_path, override, smollm2_dir, "mixed", data={"path": [str(override), str(stock)]})
    result = train_here(run_cli, path, code=2)
    assert "error: datasets built with different tokenizers cannot be mixed" in result.stderr
    assert f"{stock}: v2:" in result.stderr and "with its tokenizer's own chat template;" in result.stderr
    assert "differing parts: chat_template); rebuild them with one tokenizer and one --chat-template" in result.stderr


# -- hostile templates (issue 33): a reject per row or one named error, never a traceback nor a leftover ----------

HOSTILE = (
    "{%- set c = messages[0]['content'] -%}"
    "{%- if c == 'loops' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{%- elif c == 'range' %}{% for i in range(10**12) %}{% endfor %}"
    "{%- elif c == 'recursion' %}{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}"
    "{%- elif c == 'huge' %}{% for i in range(100000) %}{{ c * 1000 }}{% endfor %}"
    "{%- elif c == 'multiply' %}{{ c * 10**10 }}"
    "{%- elif c == 'memory' %}{{ c|center(10**11) }}"
    "{%- endif %}" + CHATML
)
"""Each prompt asks for another hostile rendering: hours of loops, an OverflowError, a recursion without end, a
400-million-character text (more than the Rust tokenizer takes), a 60 GB string, a 100 GB allocation."""
BUDGET_REJECTS = {
    "loops": ("template_budget", "it took over 1 s of CPU time"),
    "range": ("template_error", "OverflowError: Range too big"),
    "recursion": ("template_budget", "it recursed too deep"),
    "huge": ("template_budget", "its rendering passed 17825792 characters"),
    "multiply": ("template_budget", "str * int would make a value of 80000000000 characters or items"),
    "memory": ("template_budget", "it needed more memory than a rendering may take"),
}


def _no_leftovers(result, out):
    assert "Traceback" not in result.stderr, result.stderr
    assert not list(out.parent.glob(f"{out.name}.incomplete-*"))


def test_a_hostile_template_rejects_each_row_it_cannot_render_within_the_budget(smollm2_dir, tmp_path):
    """In worker processes (--num-proc 2): each hostile row is rejected with its reason and what it asked for,
    within about a second for the loops; the one row it renders is kept."""
    from tests.harness import data_cli

    rows = [chat(prompt, f"{prompt}, yes.", f"{prompt}, no.") for prompt in [*BUDGET_REJECTS, "fine"]]
    (tmp_path / "hostile.jinja").write_text(HOSTILE)
    out = tmp_path / "out"
    args = ("--tokenizer", smollm2_dir, "--out", out, "--chat-template", tmp_path / "hostile.jinja", "--num-proc", 2)
    result = data_cli("build", write_jsonl(tmp_path / "rows.jsonl", rows), *args, timeout=120)
    _no_leftovers(result, out)
    records = [orjson.loads(line) for line in (out / "rejects.jsonl").read_bytes().splitlines()]
    assert [r["line"] for r in records] == list(range(1, len(BUDGET_REJECTS) + 1))
    for record, (reason, says) in zip(records, BUDGET_REJECTS.values()):
        assert record["reason"] == reason and says in record["message"], record
    assert read_manifest(out)["totals"]["pairs"] == 1


def test_a_template_that_renders_no_row_is_one_named_error_and_leaves_nothing(smollm2_dir, tmp_path, run_cli):
    """In-process (today a RecursionError traceback): nothing about it can hang or abort."""
    rows = write_jsonl(tmp_path / "rows.jsonl", [chat("recursion", f"{i}.", f"{i + 1}.") for i in range(3)])
    (tmp_path / "hostile.jinja").write_text(HOSTILE)
    out = tmp_path / "out"
    result = _build(run_cli, rows, smollm2_dir, out, "--chat-template", tmp_path / "hostile.jinja", code=2)
    _no_leftovers(result, out)
    assert result.stderr.splitlines()[-1] == (
        f"error: --chat-template {tmp_path / 'hostile.jinja'} cannot render the data: all 3 rows that reached it "
        f"failed, the first at {rows} line 1 (the chat template is over its budget on this row: it recursed too deep "
        "(a macro that calls itself without end?)); fix the template so that it renders these conversations "
        "(docs/data-build.md)"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "template, says",
    [
        (
            "{% include '/etc/passwd' %}" + CHATML,
            "line 1 includes another template, but a chat template must be self-contained (no loader is "
            "configured): put that template's text in this file",
        ),
        (
            "{% if false %}{{ 'x' * 10**10 }}{% endif %}" + CHATML,
            "line 1: a constant expression is over budget (str * int would make a value of 10000000000 characters "
            "or items, over the 17825792 allowed); see the rendering budget in docs/data-build.md and fix the "
            "template",
        ),
    ],
    ids=["include", "constant"],
)
def test_a_template_that_fails_the_up_front_checks_is_refused_before_the_build(
    files, smollm2_dir, tmp_path, template, says
):
    """An include has nothing to load (today a TypeError per row); a constant expression is computed by the
    compiler even where it is never reached (today 10 GB, before the first row)."""
    from tests.harness import data_cli

    (tmp_path / "t.jinja").write_text(template)
    out = tmp_path / "out"
    result = data_cli(
        "build",
        files[1],
        "--tokenizer",
        smollm2_dir,
        "--out",
        out,
        "--chat-template",
        tmp_path / "t.jinja",
        code=2,
        timeout=120,
    )
    _no_leftovers(result, out)
    assert result.stderr == f"error: --chat-template {tmp_path / 't.jinja'}: {says}\n"
    assert not out.exists()


def test_an_override_failing_on_its_first_rows_stops_the_build_there(tokenizer):
    """In each worker: the eighth row the override fails on, with none rendered, is a DataError (a template over
    its time budget on every row would otherwise cost a second a row); without an override, they are rejects."""
    import copy

    from dpo_data.prepare.rows import normalize_row
    from dpo_data.prepare.template import FAIL_FAST_ROWS
    from dpo_data.prepare.tokenize import PairEncoder, TokenizeOptions

    clone = copy.deepcopy(tokenizer)
    clone.chat_template = "{% for i in range(10**12) %}{% endfor %}" + CHATML
    pairs = [normalize_row(chat(f"q{i}", "a", "b")) for i in range(FAIL_FAST_ROWS)]
    results = PairEncoder(clone, TokenizeOptions()).encode_many(pairs)
    assert {r.reason for r in results} == {"template_error"}
    with pytest.raises(DataError, match=r"^--chat-template t\.jinja cannot render the data: the first 8 rows that "):
        PairEncoder(clone, TokenizeOptions(), override="t.jinja").encode_many(pairs)
