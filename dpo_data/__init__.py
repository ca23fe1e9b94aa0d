"""Raw preference rows -> attested Arrow shards -> micro-batches. Imports `dpo_state` only, never `dpo_train`."""

__version__ = "0.1.0"
