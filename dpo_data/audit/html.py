"""`dpo-data audit --html OUT`: one page with the audit's tables and its distributions drawn, in the style of
`dpo-state report` (charts inlined, nothing fetched); matplotlib is the optional extra `report`."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

import numpy as np

from dpo_data.dataset.store import PairStore
from dpo_data.errors import DataError

PNG_META = {"Software": None}  # no version string: a page drawn again differs only when the data does
CHARTED_SOURCES = 12
"""Sources drawn on a chart, the most pairs first; the table lists them all."""


def write_audit_html(doc: dict[str, Any], out: str | Path) -> Path:
    """Draw the audit `doc` (of the datasets it names) into the page `out`; return its path."""
    plt = pyplot()
    store = PairStore([d["path"] for d in doc["datasets"]])
    charts = {"lengths": _lengths(plt, store), "length bias": _bias(plt, store, doc)}
    if "reference" in doc:
        charts["reference margins"] = _margins(plt, store, doc)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_page(doc, charts))
    return out


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise DataError(
            "dpo-data audit --html draws with matplotlib, which is not installed; install it with "
            "`pip install 'dpo-toolkit[report]'`, or use dpo-data audit --json"
        ) from None
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def _png(plt, figure) -> str:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, metadata=PNG_META)
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def _lengths(plt, store: PairStore) -> str:
    parts = {
        "prompt": store.prompt_len,
        "chosen": store.chosen_len,
        "rejected": store.rejected_len,
        "pair (prompt + chosen + rejected)": store.prompt_len.astype(np.int64) + store.chosen_len + store.rejected_len,
    }
    figure, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    for ax, (name, values) in zip(axes, parts.items()):
        ax.hist(values, bins=50)
        ax.set_title(f"{name} tokens", fontsize=10)
        ax.set_ylabel("pairs", fontsize=8)
        ax.grid(alpha=0.3)
    return _png(plt, figure)


def _charted(store: PairStore) -> list[int]:
    counts = np.bincount(store.source_id, minlength=len(store.sources))
    return sorted(range(len(store.sources)), key=lambda k: (-counts[k], store.sources[k]))[:CHARTED_SOURCES]


def _bias(plt, store: PairStore, doc: dict) -> str:
    ratio = np.log(np.maximum(store.chosen_len, 1) / np.maximum(store.rejected_len, 1))
    figure, axes = plt.subplots(1, 2, figsize=(16, 3.2))
    axes[0].hist(
        [ratio[store.source_id == k] for k in _charted(store)],
        bins=40,
        stacked=True,
        label=[store.sources[k][:40] for k in _charted(store)],
    )
    axes[0].axvline(0, color="grey", linestyle=":")
    axes[0].set_title("ln(chosen tokens / rejected tokens), stacked by source", fontsize=10)
    axes[0].legend(fontsize=7)
    names = list(doc["sources"])
    shares = [doc["sources"][n]["length_bias"]["fraction_chosen_longer"] for n in names]
    axes[1].barh([n[:40] for n in names], [0 if s is None else s for s in shares])
    axes[1].axvline(0.5, color="grey", linestyle=":")
    axes[1].set_xlim(0, 1)
    axes[1].set_title("fraction chosen longer (of pairs of unequal lengths), per source", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
    return _png(plt, figure)


def _margins(plt, store: PairStore, doc: dict) -> str:
    margins = _margin_values(store, doc["reference"]["sidecar"])  # drawn whole: read again from the sidecar
    figure, ax = plt.subplots(figsize=(16, 3.2))
    charted = _charted(store)
    ax.hist(
        [margins[(store.source_id == k) & ~np.isnan(margins)] for k in charted],
        bins=50,
        histtype="step",
        label=[store.sources[k][:40] for k in charted],
    )
    ax.axvline(0, color="grey", linestyle=":")
    ax.set_title(
        "reference margin: chosen minus rejected log-prob (left of 0: the reference prefers rejected)", fontsize=10
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _png(plt, figure)


def _margin_values(store: PairStore, sidecar: str) -> np.ndarray:
    from dpo_data.audit.reference import reference_table

    chosen, rejected, _ = reference_table(store, Path(sidecar))
    return chosen - rejected


def _page(doc: dict, charts: dict[str, str]) -> str:
    names = ", ".join(html.escape(d["path"]) for d in doc["datasets"])
    images = "".join(
        f"<h2>{html.escape(name)}</h2><img alt='{html.escape(name)}' src='data:image/png;base64,{data}'>"
        for name, data in charts.items()
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>dpo-data audit {names}</title>"
        "<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse}"
        "th,td{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:13px}img{width:100%}</style>"
        f"</head><body><h1>Audit of {names}</h1>{_table_html(_overall_rows(doc))}"
        f"<h2>per source</h2>{_sources_table(doc)}{_reversed(doc)}{images}</body></html>\n"
    )


def _table_html(rows: list[tuple[str, str]]) -> str:
    return (
        "<table>"
        + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
        + ("</table>")
    )


def _shown(value: Any) -> str:
    return "not measured" if value is None else str(value)


def _overall_rows(doc: dict) -> list[tuple[str, str]]:
    bias, kinds = doc["length_bias"], doc["degenerate_pairs"]
    return [
        ("pairs", str(doc["pairs"])),
        ("exact_duplicates", str(doc["exact_duplicates"])),
        ("conflicting_pairs", str(doc["conflicting_pairs"])),
        (
            "near_duplicate_prompts",
            f"{doc['near_duplicate_prompts']} in {doc['near_duplicate_clusters']} clusters "
            f"(Jaccard >= {doc['options']['threshold']})",
        ),
        ("contaminated_prompts", _shown(doc["contaminated_prompts"])),
        ("length_bias", ", ".join(f"{k} {_shown(v)}" for k, v in bias.items())),
        ("degenerate_pairs", ", ".join(f"{k} {_shown(v)}" for k, v in kinds.items())),
        ("multi_turn", f"{doc['multi_turn']['pairs']} pairs ({doc['multi_turn']['share']:.1%})"),
    ]


def _sources_table(doc: dict) -> str:
    head = (
        "source",
        "pairs",
        "share",
        "duplicates",
        "conflicts",
        "near-duplicates",
        "contaminated",
        "degenerate",
        "chosen longer",
        "Cohen's d",
        "multi-turn",
    )
    rows = []
    for name, s in doc["sources"].items():
        cells = (
            name,
            s["pairs"],
            f"{doc['source_mix'][name]['share']:.1%}",
            s["exact_duplicates"],
            s["conflicting_pairs"],
            s["near_duplicate_prompts"],
            _shown(s["contaminated_prompts"]),
            s["degenerate_pairs"]["any"],
            _shown(s["length_bias"]["fraction_chosen_longer"]),
            _shown(s["length_bias"]["cohens_d"]),
            f"{s['multi_turn']['share']:.1%}",
        )
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"


def _reversed(doc: dict) -> str:
    if "reference" not in doc or not doc["reference"]["reversed"]:
        return ""
    rows = "".join(
        f"<tr><td>{r['pair']}</td><td>{html.escape(r['source'])}</td><td>{r['margin']:.3f}</td></tr>"
        for r in doc["reference"]["reversed"]
    )
    return (
        "<h2>pairs the reference most prefers reversed</h2><table><tr><th>pair</th><th>source</th>"
        f"<th>margin</th></tr>{rows}</table>"
    )
