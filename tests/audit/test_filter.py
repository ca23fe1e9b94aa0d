"""`dpo-data filter`: the planted pairs dropped and recorded, the rest a dataset that verifies, trains, and is
the same bytes when filtered again."""

from __future__ import annotations

import json

import orjson
import pytest

from dpo_data.dataset.manifest import read_manifest
from dpo_state.schema import schema_problems
from tests.harness import data_cli, data_here, tiny_config, train_here, write_yaml

DROP = "exact_duplicates,conflicting_pairs,near_duplicate_prompts,contaminated_prompts,prefix"


@pytest.fixture(scope="module")
def filtered(planted, tmp_path_factory):
    out = tmp_path_factory.mktemp("filtered") / "data"
    done = data_cli("filter", planted.base, "--drop", DROP, "--against", planted.heldout, "--out", out)
    assert "kept 34 pairs, dropped 12" in done.stdout
    return out


def ledger(directory) -> list[dict]:
    return [orjson.loads(line) for line in (directory / "rejects.jsonl").read_bytes().splitlines()]


def test_the_filtered_dataset_verifies_and_records_its_lineage(filtered, planted):
    data_cli("verify", filtered, "--strict")
    m, parent = read_manifest(filtered), read_manifest(planted.base)
    assert m["lineage"]["parent"] == parent["fingerprint"] and m["lineage"]["ancestors"] == []
    assert m["lineage"]["dropped"] == {
        "exact_duplicates": 2,
        "conflicting_pairs": 2,
        "near_duplicate_prompts": 2,
        "contaminated_prompts": 2,
        "prefix": 4,
    }
    assert m["lineage"]["filter"]["against"] == [read_manifest(planted.heldout)["fingerprint"]]
    assert m["totals"]["pairs"] == 34 and m["totals"]["rows_read"] == parent["totals"]["rows_read"]
    assert all("forms" not in entry for entry in m["inputs"])


def test_every_dropped_pair_is_a_ledger_record_naming_its_kind_and_its_kept_pair(filtered, planted):
    records = [r for r in ledger(filtered) if "pair" in r]
    assert all(schema_problems("reject-record", r) == [] for r in records)
    by_pair = {r["pair"]: (r["reason"], r["of"]) for r in records}
    # base.jsonl rows: 24, 25 copy pairs 0, 1; 26 swaps pair 2 (both sides go); 27, 28 near pairs 3, 4
    assert by_pair[24] == ("exact_duplicates", 0) and by_pair[25] == ("exact_duplicates", 1)
    assert by_pair[2] == ("conflicting_pairs", 26) and by_pair[26] == ("conflicting_pairs", 2)
    assert by_pair[27] == ("near_duplicate_prompts", 3) and by_pair[28] == ("near_duplicate_prompts", 4)
    assert by_pair[5] == ("contaminated_prompts", 0) and by_pair[6] == ("contaminated_prompts", 1)
    assert sorted(p for p, (kind, _) in by_pair.items() if kind == "prefix") == [30, 31, 32, 33]
    lines = [r["line"] for r in ledger(filtered)]
    assert lines == sorted(lines)  # input order, as a build writes its rejects


def test_the_filtered_dataset_has_none_of_the_dropped_kinds_left(filtered, run_cli):
    doc = json.loads(data_here(run_cli, "audit", filtered, "--json").stdout)
    counts = (doc["exact_duplicates"], doc["conflicting_pairs"], doc["near_duplicate_prompts"])
    assert counts == (0, 0, 0) and doc["degenerate_pairs"]["prefix"] == 0


def test_filtering_twice_with_the_same_options_gives_the_same_bytes(filtered, planted, tmp_path):
    again = tmp_path / "again"
    data_cli("filter", planted.base, "--drop", DROP, "--against", planted.heldout, "--out", again)
    ours = {p.relative_to(filtered): p.read_bytes() for p in filtered.rglob("*") if p.is_file()}
    theirs = {p.relative_to(again): p.read_bytes() for p in again.rglob("*") if p.is_file()}
    assert ours == theirs


def test_keep_first_keeps_a_conflicts_first_side_and_the_options_enter_the_fingerprint(
    planted, filtered, run_cli, tmp_path
):
    out = tmp_path / "kept"
    data_here(run_cli, "filter", planted.base, "--drop", "conflicting_pairs", "--keep-first", "--out", out)
    records = [r for r in ledger(out) if "pair" in r]
    assert [(r["pair"], r["of"]) for r in records] == [(26, 2)]
    without = tmp_path / "both"
    data_here(run_cli, "filter", planted.base, "--drop", "conflicting_pairs", "--out", without)
    assert sorted(r["pair"] for r in ledger(without) if "pair" in r) == [2, 26]
    assert read_manifest(out)["fingerprint"] != read_manifest(without)["fingerprint"]


def test_a_filtered_dataset_of_truncated_prompts_keeps_its_counts_true(planted, run_cli, tmp_path):
    out = tmp_path / "short"
    data_here(run_cli, "filter", planted.long, "--drop", "truncated", "--out", out)
    m = read_manifest(out)
    assert (m["totals"]["pairs"], m["totals"]["truncated_prompts"], m["totals"]["truncated_prompt_tokens"]) == (1, 0, 0)
    assert m["lineage"]["truncation_estimated"] is True
    data_here(run_cli, "verify", out)


def test_the_filtered_dataset_trains_a_step_and_the_run_identity_holds_its_lineage(
    filtered, smollm2_dir, run_cli, tmp_path
):
    """The checkpoint's identity records the dataset fingerprint, which covers the lineage."""
    config = tiny_config(filtered, smollm2_dir, tmp_path / "run", max_steps=1, save_every=1)
    train_here(run_cli, write_yaml(tmp_path / "c.yaml", config))
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-000001" / "state.json").read_text())
    assert state["identity"]["dataset"]["fingerprint"] == read_manifest(filtered)["fingerprint"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--drop", "duplicates"], "error: --drop duplicates: allowed kinds: exact_duplicates, conflicting_pairs"),
        (["--drop", "contaminated_prompts"], "error: --drop contaminated_prompts needs --against DIR"),
        (["--drop", "whitespace_equal"], "error: --drop whitespace_equal needs --tokenizer DIR"),
    ],
)
def test_a_kind_that_cannot_be_dropped_is_one_usage_error(planted, run_cli, tmp_path, args, named):
    result = data_here(run_cli, "filter", planted.base, *args, "--out", tmp_path / "x", code=2)
    assert result.stderr.startswith(named) and not (tmp_path / "x").exists()


def test_dropping_every_pair_commits_nothing(smollm2_dir, tmp_path):
    """Two pairs, each the other swapped: both sides of the conflict go, and no empty dataset is written."""
    from dpo_data.prepare.build import BuildOptions, build
    from tests.conftest import chat, write_jsonl

    rows = write_jsonl(tmp_path / "rows.jsonl", [chat("2 + 2?", "4", "5"), chat("2 + 2?", "5", "4")])
    build([str(rows)], str(smollm2_dir), tmp_path / "data", BuildOptions())
    done = data_cli("filter", tmp_path / "data", "--drop", "conflicting_pairs", "--out", tmp_path / "x", code=1)
    assert done.stderr.strip().endswith(
        "error: the filter dropped every pair: nothing would be left to train on; nothing was committed"
    )
    assert not (tmp_path / "x").exists()


def test_a_vision_dataset_filters_with_its_images(vision_datasets, run_cli, tmp_path):
    out = tmp_path / "vision"
    data_here(run_cli, "filter", vision_datasets["idefics3"], "--drop", "exact_duplicates", "--out", out)
    m = read_manifest(out)
    assert m["totals"]["pairs"] == 6 and m["images"]["count"] == 10 - 1 and "processor" in m  # a copy of one image
    data_here(run_cli, "verify", out)


def test_verify_holds_the_lineage_against_the_ledger(filtered, tmp_path):
    """A manifest whose lineage claims other drops than its ledger records (fingerprint recomputed to match) is
    named by verify."""
    import shutil

    from dpo_data.dataset.manifest import manifest_fingerprint
    from dpo_data.dataset.verify import verify_dataset

    edited = tmp_path / "edited"
    shutil.copytree(filtered, edited)
    m = json.loads((edited / "manifest.json").read_text())
    m["lineage"]["dropped"]["prefix"] = 3
    m["fingerprint"] = manifest_fingerprint(m)
    (edited / "manifest.json").write_text(json.dumps(m))
    assert any(f.startswith("lineage.dropped: manifest says") for f in verify_dataset(edited))


def test_the_lineage_is_part_of_the_fingerprint(planted, run_cli, tmp_path):
    """Two filters that keep the same pairs with other options are two datasets: a run's identity tells them
    apart."""
    for name, threshold in (("a", "0.8"), ("b", "0.9")):
        data_here(
            run_cli,
            "filter",
            planted.base,
            "--drop",
            "exact_duplicates",
            "--threshold",
            threshold,
            "--out",
            tmp_path / name,
        )
    a, b = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    assert a["shards"] == b["shards"] and a["fingerprint"] != b["fingerprint"]


def test_inspect_names_what_a_filtered_dataset_came_from(filtered, planted, run_cli):
    parent = read_manifest(planted.base)["fingerprint"]
    assert f"filtered     from {parent} (dropped conflicting_pairs 2, contaminated_prompts 2" in (
        data_here(run_cli, "inspect", filtered).stdout
    )
    assert json.loads(data_here(run_cli, "inspect", filtered, "--json").stdout)["lineage"]["parent"] == parent


def test_a_damaged_parent_is_refused_by_name_not_filtered(planted, tmp_path):
    """A shard whose bytes are not the attested ones, or a rejects line naming no input, stops the filter with one
    error line (exit 2) before anything is written: its output would attest what the parent no longer is."""
    import shutil

    parent = tmp_path / "parent"
    shutil.copytree(planted.base, parent)
    shard = next((parent / "shards").iterdir())
    data = bytearray(shard.read_bytes())
    data[-200] ^= 1
    shard.write_bytes(bytes(data))
    done = data_cli("filter", parent, "--drop", "exact_duplicates", "--out", tmp_path / "x", code=2)
    assert done.stderr.startswith(f"error: dataset {parent}: {shard.relative_to(parent)}: sha256")
    assert "Traceback" not in done.stderr and not (tmp_path / "x").exists()
    shutil.copy(planted.base / shard.relative_to(parent), shard)
    (parent / "rejects.jsonl").write_text('{"file": "elsewhere.jsonl", "line": 1, "source": "s", "reason": "x"}\n')
    done = data_cli("filter", parent, "--drop", "exact_duplicates", "--out", tmp_path / "x", code=2)
    assert "rejects.jsonl line 1: file 'elsewhere.jsonl' is not an input of the dataset" in done.stderr
