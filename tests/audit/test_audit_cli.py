"""`dpo-data audit` as a user runs it: the JSON document against its schema, --fail-on gates, named errors."""

from __future__ import annotations

import json

from dpo_data.audit import AUDIT_FORMAT_VERSION
from dpo_state.schema import load_schema, schema_problems
from tests.harness import data_cli, data_here


def test_audit_json_is_one_schema_valid_document_with_the_planted_counts(planted, smollm2_dir):
    done = data_cli(
        "audit", planted.base, planted.long, "--against", planted.heldout, "--tokenizer", smollm2_dir, "--json"
    )
    doc = json.loads(done.stdout)
    assert schema_problems("audit", doc) == []
    assert (
        doc["format_version"] == AUDIT_FORMAT_VERSION == load_schema("audit")["properties"]["format_version"]["const"]
    )
    assert schema_problems("audit", {**doc, "extra": 1}) and schema_problems(  # the schema holds the shape
        "audit", {**doc, "sources": {"base": {**doc["sources"]["base"], "source_mix": {}}}}
    )
    assert (doc["exact_duplicates"], doc["conflicting_pairs"], doc["contaminated_prompts"]) == (2, 2, 2)
    assert doc["degenerate_pairs"]["whitespace_equal"] == 4 and doc["options"]["whitespace_measured"]
    assert "audit: hashing pairs" in done.stderr  # the progress line


def test_fail_on_exits_1_naming_each_bound_passed(planted, run_cli):
    bounds = "exact_duplicates>1,length_bias.fraction_chosen_longer>0.99,degenerate_pairs.truncated>=2"
    result = data_here(run_cli, "audit", planted.base, planted.long, "--fail-on", bounds, code=1)
    assert "fail-on: exact_duplicates = 2 (bound: exact_duplicates>1)" in result.stderr
    assert "fail-on: degenerate_pairs.truncated = 2 (bound: degenerate_pairs.truncated>=2)" in result.stderr
    assert "fraction_chosen_longer" not in result.stderr
    data_here(run_cli, "audit", planted.base, "--fail-on", "exact_duplicates>2,conflicting_pairs<1")


def test_fail_on_an_unmeasured_measure_fails_rather_than_passes(planted, run_cli):
    result = data_here(run_cli, "audit", planted.base, "--fail-on", "contaminated_prompts>0", code=1)
    assert "contaminated_prompts was not measured" in result.stderr


def test_a_malformed_bound_is_one_usage_error_naming_the_allowed_names(planted):
    done = data_cli("audit", planted.base, "--fail-on", "duplicates>0", code=2)
    assert done.stderr.startswith("error: --fail-on 'duplicates>0': unknown measure; allowed names: pairs, ")
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_directory_that_is_no_dataset_is_named(tmp_path, run_cli):
    result = data_here(run_cli, "audit", tmp_path, code=2)
    assert result.stderr.startswith(f"error: {tmp_path}: not a committed dataset")


def test_a_tokenizer_other_than_the_datasets_is_refused(planted, smollm2_dir, run_cli, tmp_path):
    """--tokenizer must be the one the data was built with: another chat template is another attestation."""
    import shutil

    other = tmp_path / "tok"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(smollm2_dir / name, other / name)
    (other / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    result = data_here(run_cli, "audit", planted.base, "--tokenizer", other, code=2)
    assert result.stderr.startswith(f"error: --tokenizer {other} has fingerprint v2:")
    assert "differing parts: chat_template" in result.stderr
