"""The audit's counts on datasets with planted findings: each exact, and each test fails on a broken variant."""

from __future__ import annotations

import numpy as np
import pytest

from dpo_data.audit import AuditOptions, audit, findings
from dpo_data.audit.whitespace import whitespace_ids
from dpo_data.dataset.store import PairStore


@pytest.fixture(scope="module")
def measured(planted, smollm2_dir):
    whitespace = whitespace_ids(PairStore(planted.dirs), smollm2_dir)
    return audit(planted.dirs, [planted.heldout], AuditOptions(whitespace=whitespace))


def test_every_planted_finding_is_counted_exactly(measured, planted):
    e = planted.expected
    got = {k: measured[k] for k in ("pairs", "exact_duplicates", "conflicting_pairs", "contaminated_prompts")}
    assert got == {
        "pairs": e.pairs,
        "exact_duplicates": e.exact_duplicates,
        "conflicting_pairs": e.conflicting_pairs,
        "contaminated_prompts": e.contaminated_prompts,
    }
    assert (measured["near_duplicate_prompts"], measured["near_duplicate_clusters"]) == (2, 2)
    kinds = measured["degenerate_pairs"]
    assert (kinds["prefix"], kinds["last_k_differ"], kinds["whitespace_equal"], kinds["truncated"]) == (
        e.prefix,
        e.last_k_differ,
        e.whitespace_equal,
        e.truncated,
    )
    assert kinds["any"] == e.prefix + e.last_k_differ + e.whitespace_equal + e.truncated  # planted apart
    assert measured["multi_turn"]["pairs"] == e.multi_turn


def test_findings_are_reported_per_source(measured, planted):
    base, degenerate = measured["sources"]["base"], measured["sources"]["degenerate"]
    assert (base["pairs"], base["exact_duplicates"], base["conflicting_pairs"]) == (30, 2, 2)
    assert base["degenerate_pairs"]["any"] == 0 and degenerate["degenerate_pairs"]["any"] == 12
    assert measured["sources"]["long"]["degenerate_pairs"]["truncated"] == 2
    longer, differing = planted.expected.base_chosen_longer
    assert base["length_bias"]["pairs_differing"] == differing
    assert base["length_bias"]["fraction_chosen_longer"] == pytest.approx(longer / differing, abs=1e-6)
    assert measured["source_mix"]["base"] == {"pairs": 30, "share": pytest.approx(30 / 49, abs=1e-6)}


def test_length_bias_is_the_closed_form():
    """chosen (4, 6, 8) against rejected (2, 6, 4): longer in 2 of the 2 differing pairs; ln ratios ln 2, 0, ln 2;
    Cohen's d = (6 - 4) / sqrt((8/3 + 8/3) / 2)."""
    from dpo_data.audit.measures import length_bias

    got = length_bias(np.array([4, 6, 8]), np.array([2, 6, 4]))
    assert got["fraction_chosen_longer"] == 1.0 and got["pairs_differing"] == 2
    assert got["mean_log_ratio"] == pytest.approx(2 * np.log(2) / 3, abs=1e-6)
    assert got["median_log_ratio"] == pytest.approx(np.log(2), abs=1e-6)
    assert got["cohens_d"] == pytest.approx(2 / np.sqrt(8 / 3), abs=1e-6)


def test_a_pair_identity_without_the_rejected_ids_over_counts_duplicates(planted, monkeypatch):
    """The decoy (pair 7's prompt and chosen, another rejected) is no duplicate: a hash that drops the rejected
    ids counts it."""
    real = findings.combine
    monkeypatch.setattr(findings, "combine", lambda *parts: real(*parts[:2]) if len(parts) == 3 else real(*parts))
    assert audit(planted.dirs)["exact_duplicates"] == planted.expected.exact_duplicates + 1


def test_a_swapped_pair_must_be_seen_as_a_conflict(planted, monkeypatch):
    real = findings.combine
    monkeypatch.setattr(findings, "combine", lambda *parts: real(parts[0], *sorted(parts[1:], key=lambda p: p[0, 0])))
    assert audit(planted.dirs)["conflicting_pairs"] == 0  # orientation lost: the planted conflict goes unseen


def test_near_duplicates_are_found_at_the_threshold_and_not_above_their_similarity(planted):
    """The planted near-duplicates differ in one word of 42 (about 0.87 Jaccard over 3-grams): found at 0.8, not
    at 0.97; unrelated prompts (about 0) are found at neither."""
    assert audit(planted.dirs, options=AuditOptions(threshold=0.97))["near_duplicate_prompts"] == 0
    assert audit(planted.dirs, options=AuditOptions(threshold=0.5))["near_duplicate_prompts"] == 2


def test_without_against_contamination_is_not_measured(planted):
    doc = audit(planted.dirs)
    assert doc["contaminated_prompts"] is None and doc["sources"]["base"]["contaminated_prompts"] is None
    assert doc["degenerate_pairs"]["whitespace_equal"] is None  # no --tokenizer: not measured, not 0


def test_completions_are_compared_without_their_shared_end_of_turn(planted, monkeypatch):
    """A chat completion ends with the template's end of turn: a prefix on the text is no prefix of the ids
    until that ending is set aside."""
    monkeypatch.setattr(findings.affixes, "MIN_PROMPTS", 10**9)  # no shared tokens found
    kinds = audit(planted.dirs)["degenerate_pairs"]
    assert kinds["prefix"] == 0


def test_a_multi_turn_prompt_is_seen_after_the_users_own_text(planted, monkeypatch):
    """Every planted prompt ends with '?' and the generation header: the header is what follows the end of turn,
    not the whole shared suffix (which no earlier turn of the user's repeats)."""
    monkeypatch.setattr(findings.Shared, "header", lambda self, k: self.prompt_suffix[k])
    assert audit(planted.dirs)["multi_turn"]["pairs"] == 0


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("threshold", 0.0, "--threshold 0.0: a Jaccard similarity in"),
        ("ngram", 0, "--ngram 0"),
        ("last_k", 0, "--last-k 0"),
    ],
)
def test_an_option_out_of_range_is_named(option, value, named):
    from dpo_data.errors import DataError

    with pytest.raises(DataError, match=named):
        AuditOptions(**{option: value})
