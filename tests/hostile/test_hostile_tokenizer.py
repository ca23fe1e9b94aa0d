"""Hostile tokenizers: a run's tokenizer must be its dataset's, and its model must embed every token id of the data."""

from __future__ import annotations

from tests.harness import tiny_config, train_here, write_yaml
from tests.tiny import tiny_llama


def _config(sample_dataset, smollm2_dir, out):
    return write_yaml(out.parent / "c.yaml", tiny_config(sample_dataset, smollm2_dir, out, max_steps=3, save_every=1))


def test_a_run_tokenizer_that_differs_from_the_datasets_is_refused(sample_dataset, smollm2_dir, tmp_path, run_cli):
    """One added token is enough: before, this trained (exit 0) and exported the wrong tokenizer."""
    from transformers import AutoTokenizer

    other = tmp_path / "tokenizer-plus-one"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.add_tokens(["<an-added-token>"])
    tokenizer.save_pretrained(other)
    out = tmp_path / "fresh"
    proc = train_here(run_cli, _config(sample_dataset, smollm2_dir, out), "--set", f"model.tokenizer={other}", code=2)
    assert "the run's tokenizer is not the one its data was built with" in proc.stderr
    assert "differing parts:" in proc.stderr and "added_tokens" in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "final").exists()


def test_a_model_that_cannot_embed_every_token_id_is_refused(sample_dataset, smollm2_dir, tmp_path, run_cli):
    small = tiny_llama(vocab_size=1000)
    config = _config(sample_dataset, smollm2_dir, tmp_path / "fresh")
    proc = train_here(run_cli, config, "--set", f"model.init={{config: {small}, seed: 0}}", code=2)
    assert "but the model embeds only 1000 ids" in proc.stderr and "Traceback" not in proc.stderr


def test_the_manifest_records_the_largest_token_id(sample_dataset):
    import numpy as np

    from dpo_data import PairStore, read_manifest

    store = PairStore([sample_dataset])
    largest = max(
        int(max(p.prompt.max(), p.chosen.max(), p.rejected.max())) for p in map(store.pair, range(store.num_pairs))
    )
    assert read_manifest(sample_dataset)["totals"]["max_token_id"] == largest == store.max_token_id
    assert np.int64(largest) < 49152
