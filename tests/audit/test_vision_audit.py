"""A vision dataset's pair identity holds its images: the same text with other images is not a duplicate."""

from __future__ import annotations

import numpy as np

from dpo_data.audit import audit, findings


def test_pairs_differing_only_in_their_images_are_not_duplicates(vision_datasets, monkeypatch):
    """tests.vision.datasets writes each of 4 rows twice, the second time with its images in reverse order: the
    rows with no image or one are exact duplicates (2), those with two images differ by their pixels alone."""
    data = vision_datasets["idefics3"]
    doc = audit([data])
    assert (doc["pairs"], doc["exact_duplicates"], doc["conflicting_pairs"]) == (8, 2, 0)
    real = findings.sequence_hashes
    monkeypatch.setattr(  # images ignored: every second row is then a duplicate of its first
        findings, "sequence_hashes", lambda o, v, salt=0: np.zeros((len(o) - 1, 2), np.uint64) if salt else real(o, v)
    )
    assert audit([data])["exact_duplicates"] == 4
