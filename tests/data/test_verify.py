"""`dpo-data verify` and `inspect`: a truncated shard, a flipped byte, a tampered manifest, a foreign tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from dpo_cli.data import main as dpo_data
from tests.conftest import chat, write_jsonl


@pytest.fixture(scope="module")
def dataset(smollm2_dir, tmp_path_factory):
    from click.testing import CliRunner

    d = tmp_path_factory.mktemp("verify")
    rows = [chat(f"What is {i} x 3?", f"{i} x 3 = {3 * i}.", f"{i} x 3 = {3 * i + 3}.") for i in range(40)]
    write_jsonl(d / "rows.jsonl", rows + [b"not json"])
    out = d / "ds"
    r = CliRunner().invoke(
        dpo_data,
        ["build", str(d / "rows.jsonl"), "--tokenizer", str(smollm2_dir), "--out", str(out), "--pairs-per-shard", "16"],
    )
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture
def copy(dataset, tmp_path):
    target = tmp_path / "ds"
    shutil.copytree(dataset, target)
    return target


def test_an_intact_dataset_verifies_with_its_tokenizer(dataset, smollm2_dir, run_cli):
    r = run_cli(dpo_data, "verify", dataset, "--tokenizer", smollm2_dir)
    assert r.exit_code == 0 and "OK" in r.output and "tokenizer attested" in r.output


def test_a_truncated_shard_fails_verify_naming_it(copy, run_cli):
    shard = copy / "shards" / "shard-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:-64])
    r = run_cli(dpo_data, "verify", copy)
    assert r.exit_code == 1
    assert "shards/shard-00001.arrow: " in r.output and "(truncated or appended to)" in r.output
    assert "not a readable Arrow IPC file" in r.output  # the file format's footer catches the cut too


def test_a_single_flipped_byte_fails_verify(copy, run_cli):
    shard = copy / "shards" / "shard-00000.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the id buffers: Arrow itself would read this back silently
    shard.write_bytes(bytes(data))
    r = run_cli(dpo_data, "verify", copy)
    assert r.exit_code == 1
    assert "shards/shard-00000.arrow: sha256 differs from the manifest" in r.output


def test_every_failure_is_named_not_just_the_first(copy, run_cli):
    (copy / "shards" / "shard-00002.arrow").unlink()
    (copy / "rejects.jsonl").write_text("")
    r = run_cli(dpo_data, "verify", copy)
    assert r.exit_code == 1
    assert "shards/shard-00002.arrow: missing" in r.output and "rejects.jsonl: 0 bytes" in r.output


def test_a_tampered_manifest_fails_on_its_fingerprint(copy, run_cli):
    path = copy / "manifest.json"
    m = json.loads(path.read_text())
    m["sources"][0]["name"] = "renamed"
    path.write_text(json.dumps(m))
    r = run_cli(dpo_data, "verify", copy)
    assert r.exit_code == 1 and "does not match its content" in r.output


def test_an_unknown_format_version_is_named(copy, run_cli):
    path = copy / "manifest.json"
    m = json.loads(path.read_text())
    m["format_version"] = 99
    path.write_text(json.dumps(m))
    r = run_cli(dpo_data, "verify", copy)
    assert r.exit_code == 1 and "has format_version 99; this version of dpo-toolkit reads 3" in r.output


@pytest.mark.parametrize("version", [1, 2])
def test_a_dataset_of_an_earlier_version_is_told_to_rebuild(copy, run_cli, version):
    """Version 1 spelled file digests as bare hex; version 2 numbered sources across the whole dataset (its shards
    have no `sources`). Each is refused by its version, with the fix, wherever it is read."""
    path = copy / "manifest.json"
    m = json.loads(path.read_text())
    m["format_version"] = version
    for shard in m["shards"]:
        del shard["sources"]
    if version == 1:
        for entry in (*m["shards"], *m["inputs"], m["rejects"]):
            entry["sha256"] = entry["sha256"].removeprefix("sha256:")
    path.write_text(json.dumps(m))
    for command in ("verify", "inspect"):
        r = run_cli(dpo_data, command, copy)
        assert (
            r.exit_code in (1, 2) and f"has format_version {version}; this version of dpo-toolkit reads 3" in r.output
        )
        assert "Fix: rebuild the dataset" in r.output and "Traceback" not in r.output


def test_a_foreign_tokenizer_fails_verify_naming_what_differs(dataset, smollm2_dir, tmp_path, run_cli):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    r = run_cli(dpo_data, "verify", dataset, "--tokenizer", tmp_path)
    assert r.exit_code == 1 and "differing parts: chat_template" in r.output


def test_inspect_reports_pairs_sources_lengths_and_rejects(dataset, run_cli):
    r = run_cli(dpo_data, "inspect", dataset, "--json")
    info = json.loads(r.output)
    assert (info["pairs"], info["rows_read"], info["rejected"]) == (40, 41, 1)
    assert info["rejects_by_reason"] == {"invalid_json": 1}
    assert info["sources"] == [{"id": 0, "name": "rows", "pairs": 40}]
    assert info["tokenizer_fingerprint"].startswith("v2:") and info["lengths"]["segment"]["p50"] > 0
    text = run_cli(dpo_data, "inspect", dataset).output
    assert "40 kept of 41 rows read (1 rejected)" in text and "invalid_json" in text


def test_inspect_and_verify_refuse_an_uncommitted_directory(tmp_path, run_cli):
    (tmp_path / "rejects.jsonl").write_text("")
    r = run_cli(dpo_data, "inspect", tmp_path)
    assert r.exit_code == 2 and "not a committed dataset, manifest.json is missing" in r.output
    assert run_cli(dpo_data, "verify", tmp_path).exit_code == 1


def _refingerprint(m: dict) -> None:
    from dpo_data.dataset.manifest import dataset_fingerprint

    columns = m["producer"]["options"].get("columns")
    m["fingerprint"] = dataset_fingerprint(m["tokenizer"]["fingerprint"], m["sources"], m["shards"], columns)


def test_shards_swapped_with_their_records_are_caught_by_their_spans(copy, run_cli):
    """Shards 0 and 1 trade places, files and manifest records alike (sizes, sha256, fingerprint all made to agree):
    only the rows they hold give it away, rows 16..31 in span 0."""
    path = copy / "manifest.json"
    m = json.loads(path.read_text())
    a, b = m["shards"][0], m["shards"][1]
    (copy / a["path"]).rename(copy / "swap")
    (copy / b["path"]).rename(copy / a["path"])
    (copy / "swap").rename(copy / b["path"])
    for key in ("rows", "bytes", "sha256"):
        a[key], b[key] = b[key], a[key]
    b["first_pair_index"] = a["rows"]
    _refingerprint(m)
    path.write_text(json.dumps(m))
    r = run_cli(dpo_data, "verify", copy)
    assert r.exit_code == 1 and "(2 problems)" in r.output
    assert "shards/shard-00000.arrow: row_index is not increasing within its span, rows 0 to 15" in r.output
    assert "shards/shard-00001.arrow: row_index is not increasing within its span, rows 16 to 31" in r.output


def test_a_shard_source_list_that_misnames_its_ids_is_caught(copy, run_cli):
    """A shard's `sources` renamed (and the manifest's sources with it, fingerprint recomputed): the pairs per source
    no longer match what the shards' ids name."""
    path = copy / "manifest.json"
    m = json.loads(path.read_text())
    m["shards"][0]["sources"] = ["other"]
    m["sources"].append({"id": 1, "name": "other", "pairs": 1})
    m["sources"][0]["pairs"] -= 1
    m["sources"][0], m["sources"][1] = m["sources"][1], m["sources"][0]
    m["sources"][0]["id"], m["sources"][1]["id"] = 0, 1
    _refingerprint(m)
    path.write_text(json.dumps(m))
    r = run_cli(dpo_data, "verify", copy)
    assert r.exit_code == 1
    assert "sources: other has 1 pairs in the manifest, 16 in the shards" in r.output
