"""The config room: the YAML config's typed sections, loading (`--set`, unknown keys named, schema), the rules
between settings, strict YAML, and TRL's names and the translation of a TRL config through them."""
