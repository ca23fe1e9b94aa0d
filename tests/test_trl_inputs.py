"""Inputs as TRL users hold them: the UltraFeedback-binarized row shape, built with the real tokenizer."""

from __future__ import annotations

import json

from dpo_data.dataset.manifest import read_manifest
from dpo_data.dataset.shards import open_shard
from dpo_data.prepare.build import BuildOptions, build
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


def test_a_prompt_that_is_not_the_conversations_prefix_is_a_recorded_reject(smollm2_dir, tmp_path):
    bad = ultrafeedback(1)
    bad["prompt"] = "What is 1 + 2?"
    data = write_jsonl(tmp_path / "uf.jsonl", [ultrafeedback(0), bad, ultrafeedback(2)])
    result = build([str(data)], str(smollm2_dir), tmp_path / "out", BuildOptions())
    assert (result.pairs, result.rejects_by_reason) == (2, {"prompt_not_prefix": 1})
    [record] = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert (record["file"], record["line"], record["reason"]) == (str(data), 2, "prompt_not_prefix")
    assert record["message"].startswith("field 'chosen' is a whole conversation but does not begin with")
