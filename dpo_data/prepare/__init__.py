"""Building a dataset: input files -> rows -> chat template -> token ids -> shards and manifest (`dpo-data build`)."""
