"""Raw preference rows -> attested Arrow shards -> micro-batches. Imports `dpo_state` only, never `dpo_train`.

The public API, for trainers that reuse the data pipeline alone (docs/loader.md, docs/data-build.md):

    from dpo_data import DPOLoader, LoaderConfig, pair_sums

Names are imported on first use, so `import dpo_data` stays cheap (torch loads only with the loader).
Three subpackages hold the rest: `prepare` (input files -> rows -> tokens, the build), `dataset` (the
on-disk contract: shards, manifest, verification, the pair store) and `loading` (order -> bin packing
-> steps -> micro-batches -> the loader). Anything not listed here is internal and may change.
"""

from __future__ import annotations

from dpo_state.lazy import lazy_exports

__version__ = "0.1.0"

_PUBLIC = {
    # loading: the loader, its config, the micro-batch contract
    "DPOLoader": "dpo_data.loading.loader",
    "LoaderConfig": "dpo_data.loading.config",
    "PlannerState": "dpo_data.loading.steps",
    "MicroBatch": "dpo_data.loading.microbatch",
    "is_last": "dpo_data.loading.microbatch",
    "pack_microbatch": "dpo_data.loading.microbatch",
    "pack_shared_prompt": "dpo_data.loading.microbatch",
    "pair_sums": "dpo_data.loading.microbatch",
    "IGNORE_INDEX": "dpo_data.loading.microbatch",
    "CHOSEN": "dpo_data.loading.microbatch",
    "REJECTED": "dpo_data.loading.microbatch",
    "PROMPT": "dpo_data.loading.microbatch",
    "PADDING": "dpo_data.loading.microbatch",
    "contract_problems": "dpo_data.loading.contract",
    "plan_document": "dpo_data.loading.preview",
    "format_plan": "dpo_data.loading.preview",
    # dataset: the on-disk contract
    "PairStore": "dpo_data.dataset.store",
    "read_manifest": "dpo_data.dataset.manifest",
    "inspect_dataset": "dpo_data.dataset.verify",
    "format_inspection": "dpo_data.dataset.verify",
    "verify_dataset": "dpo_data.dataset.verify",
    "unlisted_files": "dpo_data.dataset.verify",
    # prepare: building a dataset
    "build": "dpo_data.prepare.build",
    "BuildOptions": "dpo_data.prepare.build",
    "BuildResult": "dpo_data.prepare.build",
    # errors
    "DataError": "dpo_data.errors",
}

__all__ = ["__version__", *_PUBLIC]


__getattr__, __dir__ = lazy_exports("dpo_data", globals(), _PUBLIC)
