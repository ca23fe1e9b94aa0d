"""Building and loading: input files, rows, chat templates, tokenization, shards, parts, verification, the loader."""
