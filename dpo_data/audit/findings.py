"""What the audit finds of each pair: its duplicate, conflict, near-duplicate and contamination links, and its
degenerate kinds, in two passes over the shards (memory-mapped, a record batch at a time)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dpo_data.audit import affixes, minhash
from dpo_data.audit.hashing import combine, first_index_of, prefix_hashes, sequence_hashes
from dpo_data.audit.reading import IdBatch, id_batches
from dpo_data.dataset.manifest import read_manifest
from dpo_data.dataset.store import PairStore
from dpo_data.errors import DataError

DEGENERATE_KINDS = ("whitespace_equal", "prefix", "last_k_differ", "truncated")
"""The degenerate kinds, in the order reported (docs/audit.md)."""


@dataclass(frozen=True)
class AuditOptions:
    """How the audit compares pairs."""

    threshold: float = 0.8
    """Jaccard similarity of two prompts' token n-gram sets from which they are near-duplicates (0 < t <= 1)."""
    ngram: int = 3
    """Tokens per n-gram (shingle) of a prompt."""
    last_k: int = 3
    """last_k_differ: completions equal but for (at most) their last k tokens."""
    whitespace: np.ndarray | None = field(default=None, compare=False)
    """Per token id, whether it decodes to whitespace alone (from --tokenizer); None: whitespace_equal unmeasured."""

    def __post_init__(self):
        if not 0 < self.threshold <= 1:
            raise DataError(f"--threshold {self.threshold}: a Jaccard similarity in (0, 1], e.g. 0.8")
        if self.ngram < 1:
            raise DataError(f"--ngram {self.ngram}: at least 1 token per n-gram, e.g. 3")
        if self.last_k < 1:
            raise DataError(f"--last-k {self.last_k}: at least 1 token, e.g. 3")


@dataclass
class Findings:
    """Per pair (global store index), what was found; -1 where nothing."""

    duplicate_of: np.ndarray
    """The earliest pair equal to it (prompt, chosen, rejected, images), where that is not itself."""
    conflicts_with: np.ndarray
    """The earliest pair with its prompt (and images) and its chosen and rejected swapped."""
    first_of_prompt: np.ndarray
    """The earliest pair with its prompt (and images): itself for a prompt's first pair."""
    near_duplicate_of: np.ndarray
    """The first pair of its near-duplicate cluster, where its prompt is not that pair's."""
    contaminated_by: np.ndarray
    """A pair of the --against datasets whose prompt equals or nears its own (their global index there)."""
    degenerate: dict[str, np.ndarray | None]
    multi_turn: np.ndarray
    shared_tokens: dict[str, dict[str, int]]
    """Per source, the tokens all its prompts start (prompt_prefix) and end (prompt_suffix) with, and all its
    completions end with (completion_suffix)."""


@dataclass
class _Scan:
    """Pass one over a store: per-pair hashes, and per source id the tokens shared by all its prompts (at their
    front and back) and by all its completions (at their back)."""

    pair: np.ndarray
    swapped: np.ndarray
    prompt: np.ndarray
    images: np.ndarray
    shared: dict[str, dict[int, np.ndarray]] = field(default_factory=lambda: {"front": {}, "back": {}, "end": {}})


@dataclass(frozen=True)
class Shared:
    """Per source id, what its sequences share (none for a source of fewer than `affixes.MIN_PROMPTS` distinct
    prompts, whose own words could not be told from a template's)."""

    prompt_prefix: list[np.ndarray]
    prompt_suffix: list[np.ndarray]
    completion_suffix: list[np.ndarray]

    def header(self, source: int) -> np.ndarray:
        """The generation header multi-turn looks for: the prompts' shared suffix after the last end of turn in it
        (the completions' shared suffix: what ends an assistant turn), when of 2 tokens or more. After an end of
        turn, the header holds no text of the user's (all prompts ending with '?' would put it in the suffix)."""
        run, end = self.prompt_suffix[source], self.completion_suffix[source]
        for at in range(len(run) - len(end), -1, -1) if len(end) else ():
            if np.array_equal(run[at : at + len(end)], end):
                run = run[at + len(end) :]
                break
        return run if len(run) >= 2 else np.zeros(0, np.int64)

    def lengths(self, source: int) -> dict[str, int]:
        return {
            name: len(getattr(self, name)[source]) for name in ("prompt_prefix", "prompt_suffix", "completion_suffix")
        }


def find(store: PairStore, against: PairStore | None, options: AuditOptions, progress: bool = False) -> Findings:
    """Every finding over `store`, contamination against `against` (None: not measured)."""
    scan = _scan(store, progress, "audit: hashing pairs")
    index = np.arange(store.num_pairs)
    first_of_prompt = first_index_of(scan.prompt, scan.prompt)
    shared = _shared(store, scan, first_of_prompt == index)
    other, other_shared = None, None
    if against is not None:
        other = _scan(against, progress, "audit: hashing --against pairs")
        other_shared = _shared(
            against, other, first_index_of(other.prompt, other.prompt) == np.arange(len(other.prompt))
        )
    known = _known([shared] + ([other_shared] if other_shared else []))
    duplicate_of = first_index_of(scan.pair, scan.pair)
    distinct_sides = (scan.pair != scan.swapped).any(axis=1)
    conflicts_with = np.where(distinct_sides, first_index_of(scan.swapped, scan.pair), -1)
    second = _second_pass(store, scan, first_of_prompt == index, shared, known, options, progress)
    near = _near_duplicates(second.signature, np.nonzero(first_of_prompt == index)[0], first_of_prompt, options)
    contaminated = np.full(store.num_pairs, -1, np.int64)
    if against is not None:
        contaminated = _contamination(
            store, against, scan, other, other_shared, known, second.signature, first_of_prompt, options
        )
    second.degenerate["truncated"] = _truncated(store)
    return Findings(
        duplicate_of=np.where(duplicate_of == index, -1, duplicate_of),
        conflicts_with=conflicts_with,
        first_of_prompt=first_of_prompt,
        near_duplicate_of=near,
        contaminated_by=contaminated,
        degenerate=second.degenerate,
        multi_turn=second.multi_turn,
        shared_tokens={name: shared.lengths(k) for k, name in enumerate(store.sources)},
    )


def _scan(store: PairStore, progress: bool, stage: str) -> _Scan:
    n = store.num_pairs
    scan = _Scan(*(np.zeros((n, 2), np.uint64) for _ in range(4)))
    for batch in id_batches(store, stage, progress):
        rows = slice(batch.first, batch.first + batch.rows)
        hashes = {part: sequence_hashes(*batch.parts[part]) for part in batch.parts}
        if batch.images is not None:
            scan.images[rows] = sequence_hashes(*batch.images, salt=1)
        p = combine(hashes["prompt"], scan.images[rows])
        scan.prompt[rows] = p
        scan.pair[rows] = combine(p, hashes["chosen"], hashes["rejected"])
        scan.swapped[rows] = combine(p, hashes["rejected"], hashes["chosen"])
        _track(scan, batch, store.source_id[rows])
    return scan


def _track(scan: _Scan, batch: IdBatch, sources: np.ndarray) -> None:
    """Narrow each source's shared prompt prefix and suffix, and completion suffix, to the batch's pairs."""
    for source in np.unique(sources):
        rows = np.nonzero(sources == source)[0]
        key, whole = int(source), len(rows) == len(sources)
        prompt = batch.parts["prompt"] if whole else _rows(*batch.parts["prompt"], rows)
        for side, front in (("front", True), ("back", False)):
            scan.shared[side][key] = affixes.shared(scan.shared[side].get(key), *prompt, front=front)
        for part in ("chosen", "rejected"):
            picked = batch.parts[part] if whole else _rows(*batch.parts[part], rows)
            scan.shared["end"][key] = affixes.shared(scan.shared["end"].get(key), *picked, front=False)


def _rows(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sequences `rows` alone, as their own offsets and values (gathered without a loop)."""
    lengths = offsets[rows + 1] - offsets[rows]
    new = np.concatenate([[0], np.cumsum(lengths)])
    at = np.repeat(offsets[rows] - new[:-1], lengths) + np.arange(int(new[-1]))
    return new, values[at]


def _shared(store: PairStore, scan: _Scan, distinct: np.ndarray) -> Shared:
    """Each source's shared runs, where it has enough distinct prompts (`distinct`: a prompt's first pair)."""
    none = np.zeros(0, np.int64)
    runs = {"front": [], "back": [], "end": []}
    prompts = np.bincount(store.source_id[distinct], minlength=len(store.sources))
    for k in range(len(store.sources)):
        enough = prompts[k] >= affixes.MIN_PROMPTS
        for side in runs:
            runs[side].append(scan.shared[side].get(k, none) if enough else none)
    return Shared(runs["front"], runs["back"], runs["end"])


def _known(shared: list[Shared]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every source's prompt prefix and suffix, of both stores: a prompt is cut by the longest it starts (ends)
    with, so a prompt and its copy in the --against datasets are compared on the same tokens."""

    def runs(name):
        found = {tuple(run.tolist()): run for s in shared for run in getattr(s, name) if len(run)}
        return list(found.values())

    return runs("prompt_prefix"), runs("prompt_suffix")


@dataclass
class _Second:
    multi_turn: np.ndarray
    degenerate: dict[str, np.ndarray | None]
    signature: np.ndarray


def _second_pass(
    store: PairStore,
    scan: _Scan,
    distinct: np.ndarray,
    shared: Shared,
    known: tuple[list[np.ndarray], list[np.ndarray]],
    options: AuditOptions,
    progress: bool,
    stage: str | None = "audit: MinHash of prompts, degenerate pairs",
) -> _Second:
    """Multi-turn prompts (their source's generation header occurring earlier), the degenerate kinds measured on
    ids, and the MinHash signature of each distinct prompt (rows where `distinct`), in pair order."""
    n = store.num_pairs
    out = _Second(np.zeros(n, bool), {k: np.zeros(n, bool) for k in DEGENERATE_KINDS}, np.zeros(0))
    if options.whitespace is None:
        out.degenerate["whitespace_equal"] = None
    parts = []
    for batch in id_batches(store, stage, progress):
        rows = slice(batch.first, batch.first + batch.rows)
        offsets, values = batch.parts["prompt"]
        sources = store.source_id[rows]
        found = np.zeros(batch.rows, bool)
        for source in np.unique(sources):
            found |= affixes.occurs_before_end(offsets, values, shared.header(int(source))) & (sources == source)
        out.multi_turn[rows] = found
        ending = np.array([len(run) for run in shared.completion_suffix], np.int64)[sources]
        for kind, flags in _degenerate(batch, ending, options).items():
            out.degenerate[kind][rows] = flags
        chosen = np.nonzero(distinct[rows])[0]
        if len(chosen):
            parts.append(_batch_signatures(offsets, values, chosen, scan.images[rows, 0], known, options))
    out.signature = np.concatenate(parts) if parts else np.zeros((0, minhash.NUM_PERM), np.uint16)
    return out


def _degenerate(batch: IdBatch, ending: np.ndarray, options: AuditOptions) -> dict[str, np.ndarray]:
    """A batch's pairs of each kind measured on ids, each completion less its source's shared ending (the
    template's end of turn or EOS, which every completion carries): one completion a prefix of the other; equal but
    for at most the last k tokens of the longer; equal without the tokens that decode to whitespace alone."""
    (co, cv), (ro, rv) = batch.parts["chosen"], batch.parts["rejected"]
    lc, lr = np.diff(co) - ending, np.diff(ro) - ending
    shorter = np.minimum(lc, lr)
    prefix = (lc != lr) & (prefix_hashes(co, cv, shorter) == prefix_hashes(ro, rv, shorter)).all(axis=1)
    keep = np.maximum(lc, lr) - options.last_k
    inside = (keep >= 1) & (keep <= shorter)
    keep = np.clip(keep, 0, shorter)
    last_k = inside & (prefix_hashes(co, cv, keep) == prefix_hashes(ro, rv, keep)).all(axis=1)
    found = {"prefix": prefix, "last_k_differ": last_k}
    if options.whitespace is not None:
        ours, theirs = _without(co, cv, options.whitespace), _without(ro, rv, options.whitespace)
        found["whitespace_equal"] = (ours == theirs).all(axis=1)
    return found


def _without(offsets: np.ndarray, values: np.ndarray, whitespace: np.ndarray) -> np.ndarray:
    """`sequence_hashes` of each sequence less its tokens that decode to whitespace alone."""
    span = values[offsets[0] : offsets[-1]]
    kept = ~whitespace[np.minimum(span, len(whitespace) - 1)] | (span >= len(whitespace))
    counts = np.zeros(len(span) + 1, np.int64)
    np.cumsum(kept, out=counts[1:])
    return sequence_hashes(counts[offsets - offsets[0]], span[kept])


def _truncated(store: PairStore) -> np.ndarray:
    """Pairs whose prompt + longer completion is exactly --max-length of a build with --overlength
    truncate-prompt: where the build leaves a truncated pair (a pair that fit exactly is counted too)."""
    out = np.zeros(store.num_pairs, bool)
    for k, directory in enumerate(store.dirs):
        options = read_manifest(directory)["producer"]["options"]
        if options["overlength"] != "truncate-prompt" or options["max_length"] is None:
            continue
        rows = slice(int(store.dataset_offsets[k]), int(store.dataset_offsets[k + 1]))
        longer = np.maximum(store.chosen_len[rows], store.rejected_len[rows])
        out[rows] = store.prompt_len[rows].astype(np.int64) + longer == options["max_length"]
    return out


def _batch_signatures(offsets, values, chosen, images, known, options) -> np.ndarray:
    """The signatures of prompts `chosen` of a batch, each less the longest known prefix and suffix it has."""
    picked = _rows(offsets, values, chosen)
    starts, ends = picked[0][:-1], picked[0][1:]
    starts = np.minimum(starts + affixes.cut_lengths(*picked, known[0], front=True), ends)
    ends = np.maximum(ends - affixes.cut_lengths(*picked, known[1], front=False), starts)
    hashes, counts = minhash.shingles(picked[1], starts, ends, options.ngram, images[chosen])
    return minhash.signatures(hashes, counts)


def _near_duplicates(
    signature: np.ndarray, nodes: np.ndarray, first_of_prompt: np.ndarray, options: AuditOptions
) -> np.ndarray:
    """Per pair, its cluster's first pair where its own prompt is another (a near-duplicate); -1 elsewhere.
    `nodes`: each distinct prompt's first pair, in order; clusters are the components of the similar edges."""
    edges = minhash.similar(signature, minhash.candidate_edges(signature), options.threshold)
    root = nodes[minhash.components(len(nodes), edges)]
    per_prompt = np.full(len(first_of_prompt), -1, np.int64)
    per_prompt[nodes] = root
    cluster = per_prompt[first_of_prompt]
    return np.where(cluster != first_of_prompt, cluster, -1)


def _contamination(store, against, scan, other, other_shared, known, signature, first_of_prompt, options):
    """Per pair, a pair of `against` whose prompt equals its own (exactly) or nears it (estimated Jaccard at least
    the threshold), the earliest such; -1 for none."""
    exact = first_index_of(scan.prompt, other.prompt)
    theirs_first = first_index_of(other.prompt, other.prompt)
    distinct = theirs_first == np.arange(against.num_pairs)
    theirs = np.nonzero(distinct)[0]
    their_signature = _second_pass(against, other, distinct, other_shared, known, options, False, None).signature
    ours = np.nonzero(first_of_prompt == np.arange(store.num_pairs))[0]
    joint = np.concatenate([signature, their_signature])
    edges = minhash.similar(joint, minhash.candidate_edges(joint), options.threshold)
    cross = edges[(edges[:, 0] < len(ours)) & (edges[:, 1] >= len(ours))]
    none = np.iinfo(np.int64).max
    near = np.full(len(ours), none, np.int64)
    np.minimum.at(near, cross[:, 0], theirs[cross[:, 1] - len(ours)])
    per_prompt = np.full(store.num_pairs, -1, np.int64)
    per_prompt[ours] = np.where(near == none, -1, near)
    return np.where(exact >= 0, exact, per_prompt[first_of_prompt])
