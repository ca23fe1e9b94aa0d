"""The on-disk dataset contract both halves share: Arrow shards, the manifest, verification, the pair store."""
