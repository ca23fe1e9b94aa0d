"""The audit document (schemas/audit.schema.json), its text summary, and `--fail-on` bounds against it."""

from __future__ import annotations

import operator
import re
from typing import Any

import numpy as np

from dpo_data.audit.findings import AuditOptions, Findings
from dpo_data.audit.measures import measures, share
from dpo_data.audit.reference import MARGIN_QUANTILES
from dpo_data.dataset.store import PairStore
from dpo_data.errors import DataError

AUDIT_FORMAT_VERSION = 1
"""1: the first audit document (docs/audit.md)."""
AUDIT_SCHEMA = "audit"
LENGTH_BIAS = ("pairs_differing", "fraction_chosen_longer", "mean_log_ratio", "median_log_ratio", "cohens_d")
COUNTS = (
    "exact_duplicates",
    "conflicting_pairs",
    "near_duplicate_prompts",
    "near_duplicate_clusters",
    "contaminated_prompts",
)


def audit_document(
    store: PairStore, findings: Findings, options: AuditOptions, against: PairStore | None
) -> dict[str, Any]:
    """The whole audit: the measures over every pair, then per source (`sources`, by name)."""
    lengths = np.stack([store.prompt_len, store.chosen_len, store.rejected_len], axis=1).astype(np.int64)
    every = np.ones(store.num_pairs, bool)
    overall = measures(findings, lengths, every, against is not None)
    per_source = {
        name: measures(findings, lengths, store.source_id == k, against is not None)
        for k, name in enumerate(store.sources)
    }
    return {
        "format_version": AUDIT_FORMAT_VERSION,
        "kind": "dpo-data-audit",
        "datasets": _datasets(store),
        "against": _datasets(against) if against is not None else [],
        "options": {
            "threshold": options.threshold,
            "ngram": options.ngram,
            "last_k": options.last_k,
            "whitespace_measured": options.whitespace is not None,
        },
        **overall,
        "source_mix": {name: share(s["pairs"], store.num_pairs) for name, s in per_source.items()},
        "shared_tokens": findings.shared_tokens,
        "sources": per_source,
    }


def _datasets(store: PairStore) -> list[dict[str, Any]]:
    return [
        {"path": d, "fingerprint": f, "pairs": int(n)}
        for d, f, n in zip(store.dirs, store.dataset_fingerprints, store.dataset_sizes)
    ]


def format_audit(doc: dict[str, Any]) -> str:
    """The text summary: the overall measures, then a line per source."""
    bias, degenerate, multi = doc["length_bias"], doc["degenerate_pairs"], doc["multi_turn"]
    contaminated = doc["contaminated_prompts"]
    lines = [
        f"audit of {', '.join(d['path'] for d in doc['datasets'])}: {doc['pairs']} pairs",
        f"exact_duplicates        {doc['exact_duplicates']}",
        f"conflicting_pairs       {doc['conflicting_pairs']}",
        f"near_duplicate_prompts  {doc['near_duplicate_prompts']} in {doc['near_duplicate_clusters']} clusters "
        f"(Jaccard >= {doc['options']['threshold']} over {doc['options']['ngram']}-grams)",
        "contaminated_prompts    "
        + (
            "not measured (pass --against DIR)"
            if contaminated is None
            else f"{contaminated} (against {', '.join(d['path'] for d in doc['against'])})"
        ),
        f"length_bias             chosen longer in {_value(bias['fraction_chosen_longer'])} of "
        f"{bias['pairs_differing']} pairs of unequal lengths; log ratio mean {_value(bias['mean_log_ratio'])}, "
        f"median {_value(bias['median_log_ratio'])}; Cohen's d {_value(bias['cohens_d'])}",
        "degenerate_pairs        "
        + ", ".join(f"{k} {_value(v, 'not measured (pass --tokenizer DIR)')}" for k, v in degenerate.items()),
        f"multi_turn              {multi['pairs']} pairs ({multi['share']:.1%})",
        "lengths (tokens)        min    p10    p50    p90    p99    max    mean",
        *(
            f"  {name:<20} {q['min']:>6} {q['p10']:>6} {q['p50']:>6} {q['p90']:>6} {q['p99']:>6} {q['max']:>6} "
            f"{q['mean']:>7.1f}"
            for name, q in doc["lengths"].items()
        ),
        "sources                 pairs  share   dups  confl   near  contam  degen  chosen-longer",
        *(_source_line(name, s, doc["source_mix"][name]["share"]) for name, s in doc["sources"].items()),
    ]
    if "reference" in doc:
        lines += _reference_lines(doc["reference"])
    return "\n".join(lines)


def _reference_lines(ref: dict) -> list[str]:
    """The reference's margins (chosen minus rejected log-prob), per source, and the pairs it most prefers
    reversed."""

    def stats(m: dict) -> str:
        if not m["pairs"]:
            return "no pair scored"
        return (
            f"{m['pairs']} pairs, mean {m['mean']:.3f}, p10 {m['p10']:.3f}, p50 {m['p50']:.3f}, p90 {m['p90']:.3f}; "
            f"rejected preferred in {m['fraction_negative']:.1%}"
        )

    lines = [f"reference margins        {stats(ref['margins'])} ({ref['sidecar']})"]
    lines += [f"  {name:<20} {stats(m)}" for name, m in ref["sources"].items()]
    if ref["reversed"]:
        lines.append(
            "most reversed (pair: margin, source)  "
            + ", ".join(f"{r['pair']}: {r['margin']:.3f} {r['source']}" for r in ref["reversed"])
        )
    return lines


def _source_line(name: str, s: dict, fraction: float) -> str:
    contaminated = "-" if s["contaminated_prompts"] is None else s["contaminated_prompts"]
    return (
        f"  {name:<20} {s['pairs']:>7} {fraction:>6.1%} {s['exact_duplicates']:>6} {s['conflicting_pairs']:>6} "
        f"{s['near_duplicate_prompts']:>6} {contaminated:>7} {s['degenerate_pairs']['any']:>6}  "
        f"{_value(s['length_bias']['fraction_chosen_longer'])}"
    )


def _value(x: Any, missing: str = "n/a") -> str:
    return missing if x is None else str(x)


_OPERATORS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_BOUND = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(>=|<=|>|<)\s*([-+0-9.eE]+)\s*$")


def bound_names() -> list[str]:
    """The names `--fail-on` accepts: each number of the measures, dotted into its objects."""
    from dpo_data.audit.findings import DEGENERATE_KINDS
    from dpo_data.audit.measures import QUANTILES

    quantiles = ["min", *(f"p{q}" for q in QUANTILES), "max", "mean"]
    return [
        "pairs",
        *COUNTS,
        *(f"length_bias.{k}" for k in LENGTH_BIAS),
        *(f"degenerate_pairs.{k}" for k in (*DEGENERATE_KINDS, "any")),
        *(f"lengths.{part}.{q}" for part in ("prompt", "chosen", "rejected", "pair") for q in quantiles),
        "multi_turn.pairs",
        "multi_turn.share",
        *(f"reference.margins.{k}" for k in ("mean", *(f"p{q}" for q in MARGIN_QUANTILES), "fraction_negative")),
    ]


def _allowed() -> str:
    """The names, short: the lengths' as one pattern."""
    names = [n for n in bound_names() if not n.startswith(("lengths.", "reference."))]
    return (
        ", ".join(names) + ", lengths.{prompt,chosen,rejected,pair}.{min,p10,p25,p50,p75,p90,p99,max,mean}, "
        "reference.margins.{mean,p1,p10,p50,p90,p99,fraction_negative} (with --reference)"
    )


def parse_bounds(text: str) -> list[tuple[str, str, float]]:
    """`NAME>VALUE[,...]` -> [(name, operator, value)]; a malformed bound or an unknown name is a `DataError`
    naming the allowed ones."""
    bounds, names = [], bound_names()
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _BOUND.match(item)
        if match is None or match[1] not in names:
            what = "unknown measure" if match else "not NAME>VALUE (or >=, <, <=)"
            raise DataError(
                f"--fail-on {item!r}: {what}; allowed names: {_allowed()}; e.g. --fail-on "
                "exact_duplicates>0,length_bias.fraction_chosen_longer>0.6"
            )
        try:
            value = float(match[3])
        except ValueError:
            raise DataError(f"--fail-on {item!r}: {match[3]!r} is not a number") from None
        bounds.append((match[1], match[2], value))
    return bounds


def passed_bounds(doc: dict[str, Any], bounds: list[tuple[str, str, float]]) -> list[str]:
    """The bounds the document's measures pass, each as 'name = value (bound: name>value)'. A measure that was
    not measured (None) passes no bound but is named: a gate must not pass on what it did not see."""
    failed = []
    for name, op, value in bounds:
        got: Any = doc
        for key in name.split("."):
            got = got.get(key) if isinstance(got, dict) else None
        if got is None:
            failed.append(f"{name} was not measured (bound: {name}{op}{value:g}); see docs/audit.md")
        elif _OPERATORS[op](got, value):
            failed.append(f"{name} = {got} (bound: {name}{op}{value:g})")
    return failed
