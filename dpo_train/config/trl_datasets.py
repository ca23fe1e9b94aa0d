"""TRL's dataset fields (dataset_name, the alignment-handbook's dataset_mixture, TRL's `datasets:` list) -> the
inputs of the `dpo-data build` command the translation prints, or data.path where the name is a built dataset."""

from __future__ import annotations

from pathlib import Path

from dpo_data.prepare.hub import HUB_PREFIX, build_input, is_hub_id
from dpo_train.config.trl_convert import Context
from dpo_train.config.trl_readers import is_text, refuse, shown, text


def dataset(value: str | None, ctx: Context) -> dict:
    if value is None:
        return {}
    if (Path(value) / "manifest.json").is_file():  # already a dataset built by dpo-data build
        return {"data.path": value}
    return {"build.inputs": [build_input(value, ctx.trl["dataset_train_split"])]}


def mixture(value: dict, ctx: Context) -> dict:
    """The alignment-handbook's dataset_mixture: each dataset's split becomes one input of the build."""
    if value is None:
        return {}
    entries = value.get("datasets")
    if not isinstance(entries, list) or not all(isinstance(d, dict) and is_text(d.get("id")) for d in entries):
        refuse(
            f"dataset_mixture is {shown(value)}; the handbook's form is {{datasets: [{{id: OWNER/NAME, split: "
            "train, weight: 1.0}, ...]}}: give each dataset an id"
        )
    if ctx.trl.get("dataset_name") is not None:  # TRL trains the mixture then; one source here, named
        refuse(
            f"dataset_name is {shown(ctx.trl['dataset_name'])} beside dataset_mixture: TRL trains the mixture and "
            "ignores dataset_name; give one of them (drop dataset_name to build the mixture)"
        )
    named = [d for d in entries if d.get("config") not in (None, "default")]  # the default is what is read
    configs = [f"{d['id']} config {shown(d['config'])}" for d in named]
    if configs:
        refuse(
            f"dataset_mixture names {', '.join(configs)}: the build reads files, not Hub configurations, and would "
            "read the default one; build that configuration's files (hf://datasets/NAME/CONFIG_DIR/GLOB) as an "
            "input instead, and drop config"
        )
    shares = [f"{d['id']} weight {d['weight']}" for d in entries if d.get("weight", 1.0) != 1.0]
    if shares:
        refuse(
            f"dataset_mixture takes a share of {', '.join(shares)}; here each input is built whole: build a file "
            "of the rows to keep, or several datasets mixed by data.weights; set weight: 1.0"
        )
    inputs = [build_input(d["id"], d.get("split") or "train") for d in entries]
    held_out = value.get("test_split_size")
    note = (
        {
            "note.dataset_mixture": f"dataset_mixture holds out test_split_size {held_out} rows as the handbook's "
            "eval set; here a held-out set is a dataset of its own: build those rows apart (eval.path)"
        }
        if held_out
        else {}
    )
    return {"build.inputs": inputs, **note}


DATASET_FIELDS = ("path", "name", "data_dir", "data_files", "split", "columns", "fraction")
"""TRL 1.16's DatasetConfig: one entry of `datasets:` (DatasetMixtureConfig), as `trl dpo` reads them."""
FILE_BUILDERS = ("json", "parquet")
"""load_dataset's builders whose `data_files` the build reads as they are (JSON lines or JSON, Parquet)."""


def datasets(value: list | None, ctx: Context) -> dict:
    """TRL's `datasets:` (what `trl dpo` trains when given, before dataset_name): each entry's files an input of
    the build, a Hub dataset's split as `dataset_name`'s is."""
    if not value:
        return {}
    if ctx.trl.get("dataset_name") is not None:  # TRL loads `datasets` then; one source here, named
        refuse(
            f"dataset_name is {shown(ctx.trl['dataset_name'])} beside datasets: TRL trains datasets and ignores "
            "dataset_name; give one of them (drop dataset_name to build datasets)"
        )
    if ctx.trl.get("dataset_mixture") is not None:
        refuse(
            "datasets and dataset_mixture both name the training data (TRL's list, the alignment-handbook's "
            "mixture); give one of them"
        )
    return {"build.inputs": [item for i, entry in enumerate(value) for item in _entry_inputs(f"datasets[{i}]", entry)]}


def _entry_inputs(where: str, entry: dict) -> list[str]:
    """One DatasetConfig's inputs of the build: its files (`data_files`, under a local `path` or a Hub dataset's)
    or its split; what would change the rows the build reads is refused by name."""
    unknown = [key for key in entry if key not in DATASET_FIELDS]
    if unknown:
        refuse(f"{where} has {', '.join(map(str, unknown))}: TRL's DatasetConfig has {', '.join(DATASET_FIELDS)}")
    _refuse_narrowing(where, entry)
    split = entry.get("split") or "train"
    files = entry.get("data_files")
    if files is None:
        return [build_input(entry["path"], text(f"{where}.split", split))]
    files = files.get(split) if isinstance(files, dict) else files  # load_dataset's {split: files}
    files = [files] if isinstance(files, str) else files
    if not isinstance(files, list) or not files or not all(is_text(f) for f in files):
        refuse(
            f"{where}.data_files is {shown(entry['data_files'])}; give a file, a list of files, or {{{split}: "
            "FILES}} for the split"
        )
    return [_entry_file(where, entry["path"], file) for file in files]


def _refuse_narrowing(where: str, entry: dict) -> None:
    """A configuration, a data_dir, a column selection or a share: the build would read other rows or columns."""
    if entry.get("name") not in (None, "default"):
        refuse(
            f"{where} names config {shown(entry['name'])}: the build reads files, not Hub configurations, and "
            "would read the default one; give that configuration's files as data_files instead, and drop name"
        )
    fixes = {
        "data_dir": "give its files as data_files (data_dir/FILE)",
        "columns": "the build reads the preference columns itself (docs/data-build.md): drop columns",
        "fraction": "each input is built whole: build a file of the rows to keep, or mix datasets by data.weights",
    }
    for key, fix in fixes.items():
        if entry.get(key) is not None:
            refuse(f"{where}.{key} is {shown(entry[key])}; here {fix}")


def _entry_file(where: str, path: str, file: str) -> str:
    """A data file as the build reads it: as given under a file builder (json, parquet), inside a local
    directory, or in a Hub dataset (hf://datasets/NAME/FILE)."""
    if path in FILE_BUILDERS:
        return file
    if Path(path).expanduser().is_dir():
        return str(Path(path) / file)
    if "/" in path and is_hub_id(path):  # a name without an owner beside data_files is load_dataset's builder (csv)
        return f"{HUB_PREFIX}{path}/{file}"
    refuse(
        f"{where}.path is {path!r} with data_files: the build reads JSON lines, JSON and Parquet files; give path: "
        "json or parquet (the files as they are), a local directory, or a Hub dataset's OWNER/NAME"
    )


def test_split(value: float | None, ctx: Context) -> dict:
    """DatasetMixtureConfig's test_split_size: TRL holds those rows out; here a held-out set is built apart."""
    if value is None:
        return {}
    return {
        "note.test_split_size": f"test_split_size {value} holds rows of datasets out as TRL's eval set; here the "
        "build keeps every row for training, and a held-out set is a dataset of its own: build those rows apart "
        "(eval.path)"
    }
