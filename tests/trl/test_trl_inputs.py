"""Inputs as TRL users hold them: the UltraFeedback-binarized row shape, built with the real tokenizer."""

from __future__ import annotations

import json

import pytest

from dpo_data.dataset.manifest import read_manifest
from dpo_data.dataset.shards import open_shard
from dpo_data.errors import DataError
from dpo_data.prepare.build import BuildOptions, build
from dpo_data.prepare.rows import normalize_row
from tests.conftest import chat, write_jsonl

IDS = ("prompt_ids", "chosen_ids", "rejected_ids")


def ultrafeedback(i: int) -> dict:
    """A row as HuggingFaceH4/ultrafeedback_binarized holds it: a string prompt, whole conversations, extras."""
    question = f"What is {i} + {i}?"
    return {
        "prompt": question,
        "prompt_id": f"{i:064x}",
        "chosen": [{"role": "user", "content": question}, {"role": "assistant", "content": f"It is {2 * i}."}],
        "rejected": [{"role": "user", "content": question}, {"role": "assistant", "content": f"It is {2 * i + 1}."}],
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": f"It is {2 * i}."}],
        "score_chosen": 8.0,
        "score_rejected": 5.0,
    }


def pairs(out) -> list[dict]:
    m = read_manifest(out)
    return [{k: r[k] for k in IDS} for s in m["shards"] for r in open_shard(out / s["path"]).to_pylist()]


def test_ultrafeedback_rows_build_the_pairs_of_their_explicit_prompt_form(smollm2_dir, tmp_path):
    rows = [ultrafeedback(i) for i in range(6)]
    explicit = [chat(r["prompt"], r["chosen"][1]["content"], r["rejected"][1]["content"]) for r in rows]
    inputs = [str(write_jsonl(tmp_path / f"{name}.jsonl", data)) for name, data in (("uf", rows), ("ex", explicit))]
    result = build(inputs, str(smollm2_dir), tmp_path / "out", BuildOptions())
    assert (result.pairs, result.rejects_by_reason) == (12, {})
    built = pairs(tmp_path / "out")
    assert built[:6] == built[6:]
    ignored = [entry["ignored_columns"] for entry in read_manifest(tmp_path / "out")["inputs"]]
    assert ignored == [{"messages": 6, "prompt_id": 6, "score_chosen": 6, "score_rejected": 6}, {}]
    assert result.ignored_columns == ignored[0]


def test_a_prompt_that_is_not_the_conversations_prefix_is_a_recorded_reject(smollm2_dir, tmp_path):
    bad = ultrafeedback(1)
    bad["prompt"] = "What is 1 + 2?"
    data = write_jsonl(tmp_path / "uf.jsonl", [ultrafeedback(0), bad, ultrafeedback(2)])
    result = build([str(data)], str(smollm2_dir), tmp_path / "out", BuildOptions())
    assert (result.pairs, result.rejects_by_reason) == (2, {"prompt_not_prefix": 1})
    [record] = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert (record["file"], record["line"], record["reason"]) == (str(data), 2, "prompt_not_prefix")
    assert record["message"].startswith("field 'chosen' is a whole conversation but does not begin with")


def stack_exchange(i: int) -> dict:
    """A row as lvwerra/stack-exchange-paired holds it: TRL's fields under other names, plain text."""
    return {
        "qid": i,
        "question": f"Q: what is {i} + {i}?\nA:",
        "date": "2023/01/01",
        "response_j": f" {2 * i}.",
        "response_k": f" {2 * i + 1}.",
    }


SPEC = "prompt=question,chosen=response_j,rejected=response_k"
MAPPING = {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}


def test_columns_read_the_row_fields_from_other_names_and_enter_the_fingerprint(smollm2_dir, tmp_path, run_cli):
    from dpo_cli.data import main as dpo_data
    from dpo_data.dataset.manifest import dataset_fingerprint

    rows = [stack_exchange(i) for i in range(5)]
    mapped = write_jsonl(tmp_path / "se.jsonl", rows)
    renamed = write_jsonl(tmp_path / "trl.jsonl", [{f: r[c] for f, c in MAPPING.items()} for r in rows])
    r = run_cli(dpo_data, "build", mapped, "--tokenizer", smollm2_dir, "--out", tmp_path / "a", "--columns", SPEC)
    assert r.exit_code == 0, r.output
    assert "\nignored columns (no row field reads them; see --columns): date (5 rows), qid (5 rows)\n" in r.output
    build([str(renamed)], str(smollm2_dir), tmp_path / "b", BuildOptions(source="se"))
    assert pairs(tmp_path / "a") == pairs(tmp_path / "b") and len(pairs(tmp_path / "a")) == 5
    a, b = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    assert a["producer"]["options"]["columns"] == MAPPING and "columns" not in b["producer"]["options"]
    assert (a["inputs"][0]["ignored_columns"], b["inputs"][0]["ignored_columns"]) == ({"date": 5, "qid": 5}, {})
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    assert a["fingerprint"] == dataset_fingerprint(a["tokenizer"]["fingerprint"], a["sources"], a["shards"], MAPPING)
    assert a["fingerprint"] != b["fingerprint"]


BAD_SPECS = [
    (
        "prompt=question,answer=response_j",
        "--columns maps unknown field 'answer' (from column 'response_j'); the fields",
    ),
    ("prompt=question,prompt=title", "--columns names field 'prompt' twice (prompt=question and prompt=title)"),
    ("chosen=response,rejected=response", "--columns maps column 'response' to both 'chosen' and 'rejected'"),
    ("prompt:question", "--columns item 'prompt:question' is not FIELD=COLUMN"),
    ("chosen=", "--columns item 'chosen=' reads 'chosen' from no column, but every row needs 'chosen' and 'rejected'"),
    ("=question", "--columns item '=question' is not FIELD=COLUMN"),
]


@pytest.mark.parametrize("spec, message", BAD_SPECS, ids=[s for s, _ in BAD_SPECS])
def test_a_bad_columns_spec_is_a_named_error(spec, message):
    with pytest.raises(DataError) as info:
        BuildOptions(columns=spec)
    assert str(info.value).startswith(message)


def test_a_bad_columns_spec_exits_2_on_the_command_line(smollm2_dir, tmp_path, run_cli):
    from dpo_cli.data import main as dpo_data

    data = write_jsonl(tmp_path / "se.jsonl", [stack_exchange(0)])
    r = run_cli(dpo_data, "build", data, "--tokenizer", smollm2_dir, "--out", tmp_path / "o", "--columns", "q=question")
    assert r.exit_code == 2 and "error: --columns maps unknown field 'q' (from column 'question')" in r.output
    assert not (tmp_path / "o").exists()


def test_a_mapped_column_no_row_has_is_a_named_error_and_nothing_is_committed(smollm2_dir, tmp_path):
    rows = [{"question": f"Q{i}", "response_j": " a", "response_l": " b"} for i in range(3)]  # a mistyped name
    data = write_jsonl(tmp_path / "se.jsonl", rows)
    with pytest.raises(DataError) as info:
        build([str(data)], str(smollm2_dir), tmp_path / "o", BuildOptions(columns=SPEC))
    assert str(info.value) == (
        f"--columns maps rejected=response_k, but no row of input {data} has a column 'response_k'; its rows have: "
        "question, response_j, response_l. Fix: map rejected from one of these columns"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.lock", "se.jsonl"]  # no dataset, no staging left


def test_a_row_without_a_mapped_column_is_rejected_naming_it(smollm2_dir, tmp_path):
    rows = [stack_exchange(0), {k: v for k, v in stack_exchange(1).items() if k != "response_j"}]
    result = build(
        [str(write_jsonl(tmp_path / "se.jsonl", rows))], str(smollm2_dir), tmp_path / "o", BuildOptions(columns=SPEC)
    )
    assert (result.pairs, result.rejects_by_reason) == (1, {"missing_field": 1})
    [record] = [json.loads(line) for line in (tmp_path / "o" / "rejects.jsonl").read_text().splitlines()]
    assert record["message"] == "column 'response_j' is missing; --columns maps it to 'chosen', which every row needs"


def test_a_field_column_that_a_mapping_replaces_is_ignored_and_the_mapped_ones_are_read():
    from dpo_data.prepare.columns import ignored_columns

    counts = {"prompt": 3, "question": 3, "chosen": 3, "rejected": 2, "id": 1, "score": 3}
    assert ignored_columns(counts, {"prompt": "question"}) == {"prompt": 3, "score": 3}
    assert ignored_columns(counts, {"prompt": "prompt"}) == {"question": 3, "score": 3}
    assert ignored_columns(counts, None) == {"question": 3, "score": 3}


def hh(i: int, answer: str) -> str:
    """A conversation as Anthropic/hh-rlhf holds it: one text, turns after blank lines."""
    return f"\n\nHuman: What is {i} + {i}?\n\nAssistant: {i}?\n\nHuman: Add them.\n\nAssistant:{answer}"


def test_hh_rlhf_rows_build_with_their_implicit_prompt_and_record_the_form(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    rows = [{"chosen": hh(i, f" {2 * i}."), "rejected": hh(i, f" Maybe {2 * i + 1}.")} for i in range(4)]
    rows += [
        {"chosen": "\n\nHuman: hi\n\nAssistant: a", "rejected": "\n\nHuman: ho\n\nAssistant: a"},
        {"chosen": hh(9, " 18."), "rejected": hh(9, " 18.")},
    ]
    data = write_jsonl(tmp_path / "helpful-base.jsonl", rows)
    result = build([str(data)], str(smollm2_dir), tmp_path / "out", BuildOptions())
    assert (result.pairs, result.rejects_by_reason) == (4, {"identical_completions": 1, "no_implicit_prompt": 1})
    [entry] = read_manifest(tmp_path / "out")["inputs"]
    assert (entry["forms"], entry["ignored_columns"]) == ({"implicit-text": 4}, {})
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    first = pairs(tmp_path / "out")[0]
    assert first["prompt_ids"] == tok(hh(0, ""))["input_ids"]
    assert first["chosen_ids"] == tok(" 0.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_a_string_prompt_beside_conversations_with_a_system_message_reads_as_trls_maybe_extract_prompt():
    from trl.data_utils import maybe_extract_prompt

    system = {"role": "system", "content": "Answer in one word."}
    row = ultrafeedback(3)
    row["chosen"], row["rejected"] = [system, *row["chosen"]], [system, *row["rejected"]]
    pair = normalize_row(row)
    theirs = maybe_extract_prompt({k: row[k] for k in ("prompt", "chosen", "rejected")})
    assert (pair.prompt, pair.chosen, pair.rejected) == (theirs["prompt"], theirs["chosen"], theirs["rejected"])
    assert pair.prompt == [system, {"role": "user", "content": "What is 3 + 3?"}]


def test_columns_prompt_with_no_column_drops_a_conflicting_prompt_column(smollm2_dir, tmp_path, run_cli):
    """A prompt column that is not the conversations' first turn: read as it is, every row is a reject; `prompt=`
    drops it, so the conversations' shared prefix is the prompt, without rewriting the file."""
    from dpo_cli.data import main as dpo_data

    rows = [{**ultrafeedback(i), "prompt": f"Question {i}"} for i in range(3)]
    data = write_jsonl(tmp_path / "uf.jsonl", rows)
    as_is = build([str(data)], str(smollm2_dir), tmp_path / "as-is", BuildOptions())
    assert (as_is.pairs, as_is.rejects_by_reason) == (0, {"prompt_not_prefix": 3})
    r = run_cli(dpo_data, "build", data, "--tokenizer", smollm2_dir, "--out", tmp_path / "out", "--columns", "prompt=")
    assert r.exit_code == 0, r.output
    assert "\npairs by row form (docs/data-build.md, row formats): implicit-chat 3\n" in r.output
    m = read_manifest(tmp_path / "out")
    assert m["producer"]["options"]["columns"] == {"prompt": ""}
    assert (m["totals"]["pairs"], m["inputs"][0]["forms"]) == (3, {"implicit-chat": 3})
    assert m["inputs"][0]["ignored_columns"] == {
        "messages": 3,
        "prompt": 3,
        "prompt_id": 3,
        "score_chosen": 3,
        "score_rejected": 3,
    }
    implicit = [{k: r[k] for k in ("chosen", "rejected")} for r in rows]
    build([str(write_jsonl(tmp_path / "uf2.jsonl", implicit))], str(smollm2_dir), tmp_path / "ref", BuildOptions())
    assert pairs(tmp_path / "out") == pairs(tmp_path / "ref")


def test_build_help_says_how_to_drop_a_column(run_cli):
    from dpo_cli.data import main as dpo_data

    r = run_cli(dpo_data, "build", "--help")
    assert r.exit_code == 0 and "FIELD= with no column drops a column: prompt= reads no prompt" in " ".join(
        r.output.split()
    )


def test_hugging_face_save_to_disk_directories_and_arrow_files_are_inputs(smollm2_dir, tmp_path):
    """Read with pyarrow alone: a `save_to_disk` split (its Arrow files in state.json's order), one of those
    files (the stream format of the `datasets` cache) and an IPC file-format .arrow build the jsonl's pairs."""
    import datasets
    import pyarrow as pa

    rows = [ultrafeedback(i) for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "train_prefs"), num_shards=2)
    first = tmp_path / "train_prefs" / "data-00000-of-00002.arrow"
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_file(tmp_path / "file.arrow", table.schema) as writer:
        writer.write_table(table)
    inputs = [tmp_path / "train_prefs", first, tmp_path / "file.arrow", write_jsonl(tmp_path / "uf.jsonl", rows)]
    result = build(list(map(str, inputs)), str(smollm2_dir), tmp_path / "out", BuildOptions())
    assert (result.pairs, result.rejects_by_reason) == (4 + 2 + 4 + 4, {})
    built = pairs(tmp_path / "out")
    assert built[:4] == built[6:10] == built[10:] and built[4:6] == built[:2]
    m = read_manifest(tmp_path / "out")
    assert [(e["format"], e["default_source"], e["rows_read"]) for e in m["inputs"]] == [
        ("hf-dataset", "train_prefs", 4),
        ("arrow", "data-00000-of-00002", 2),
        ("arrow", "file", 4),
        ("jsonl", "uf", 4),
    ]
    assert m["inputs"][0]["ignored_columns"] == {"messages": 4, "prompt_id": 4, "score_chosen": 4, "score_rejected": 4}


def test_a_dataset_dict_directory_names_its_splits(smollm2_dir, tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([ultrafeedback(0)])}).save_to_disk(str(tmp_path / "uf"))
    with pytest.raises(DataError) as info:
        build([str(tmp_path / "uf")], str(smollm2_dir), tmp_path / "out", BuildOptions())
    assert str(info.value) == (
        f"input file {tmp_path / 'uf'}: a DatasetDict of splits (train); pass one split's directory, "
        f"e.g. {tmp_path / 'uf' / 'train'}"
    )


def test_a_hub_dataset_is_an_input_from_the_hub_cache_offline(smollm2_dir, tmp_path):
    """`hf://datasets/OWNER/NAME/GLOB` through huggingface_hub, in a process of its own with HF_HUB_OFFLINE=1 over a
    hand-made cache (refs/main and a snapshot, as a download leaves them): the matching split files build, in
    sorted order, the manifest names the snapshot's commit, and a repo or a GLOB it cannot find is named."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.harness import data_cli

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "datasets--HuggingFaceH4--ultrafeedback_binarized"
    snapshot = repo / "snapshots" / commit / "data"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for k in range(2):
        rows = [ultrafeedback(4 * k + i) for i in range(4)]
        pq.write_table(pa.Table.from_pylist(rows), snapshot / f"train_prefs-0000{k}-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist([ultrafeedback(9)]), snapshot / "test_prefs-00000-of-00001.parquet")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    spec = "hf://datasets/HuggingFaceH4/ultrafeedback_binarized/data/train_prefs-*.parquet"
    data_cli("build", spec, "--tokenizer", smollm2_dir, "--out", tmp_path / "out", env=env)
    m = read_manifest(tmp_path / "out")
    assert m["totals"]["pairs"] == 8 and [e["default_source"] for e in m["inputs"]] == [
        "train_prefs-00000-of-00002",
        "train_prefs-00001-of-00002",
    ]
    assert all(f"snapshots/{commit}/data/" in e["path"] for e in m["inputs"])
    missing = data_cli(
        "build",
        spec.replace("ultrafeedback", "nothere"),
        "--tokenizer",
        smollm2_dir,
        "--out",
        tmp_path / "o2",
        env=env,
        code=2,
    ).stderr
    assert "cannot get dataset HuggingFaceH4/nothere_binarized from the Hugging Face Hub" in missing
    glob = data_cli(
        "build",
        spec.replace("train_prefs", "valid"),
        "--tokenizer",
        smollm2_dir,
        "--out",
        tmp_path / "o3",
        env=env,
        code=2,
    ).stderr
    assert "no file of dataset HuggingFaceH4/ultrafeedback_binarized matches 'data/valid-*.parquet'" in glob
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
