"""JSON Schemas of every persisted document; importable as `dpo_schemas` so they ship with the package."""
