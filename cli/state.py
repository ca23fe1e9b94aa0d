"""`dpo-state`: inspect, diff and verify checkpoints (no process group, nothing unpickled); verify and push exports;
report a run; describe this environment."""

from __future__ import annotations

import json
import sys

import click

from dpo_cli.errors import user_errors


def _guard(fn, *args, **kwargs):
    """Bad input (a missing path, a malformed or hostile state file) is a named error, exit 2."""
    with user_errors(OSError):
        return fn(*args, **kwargs)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="dpo-toolkit")
def main() -> None:
    """Audit training checkpoints (docs/checkpoints.md).

    PATH is a step directory (OUTPUT/checkpoints/step-NNNNNN) or a run's output directory, which means
    its latest committed checkpoint. State files are JSON and safetensors and are never unpickled. Only
    `verify` and `diff --values` read DCP's files: its metadata (a pickle) through a restricted unpickler
    that builds only DCP's metadata classes, after every file's sha256 matched the commit record; tensor
    data with torch's weights-only loader (docs/security.md).

    `env` describes this environment for a bug report (docs/dependencies.md).
    """


@main.command()
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(path, as_json) -> None:
    """What a checkpoint holds: step, epoch, consumption, identity, tensors per group, per-rank loader
    positions, lineage. Reads JSON files only."""
    from dpo_state import inspect_checkpoint

    info = _guard(inspect_checkpoint, path)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    ident = info["identity"]
    lines = [
        f"checkpoint  {info['path']} ({'committed' if info['committed'] else 'INCOMPLETE: no commit record'})",
        f"format      {info['format_version']}, written by {info['package']['name']} {info['package']['version']}",
        "libraries   "
        + (", ".join(f"{k} {v}" for k, v in env.items()) if (env := info["environment"]) else "not recorded"),
        f"position    step {info['step']}, epoch {info['epoch']}; consumed {info['consumed']['pairs']} pairs, "
        f"{info['consumed']['input_tokens']} input tokens, {info['consumed']['supervised_tokens']} supervised",
        f"files       {info['files']} files, {info['bytes']:,} bytes",
    ]
    for group, t in info["tensors"].items():
        lines.append(f"tensors     {group}: {t['count']} tensors, {t['bytes']:,} bytes")
    lines += [
        f"dataset     {ident['dataset']['fingerprint']} ({ident['dataset']['num_pairs']} pairs)",
        f"tokenizer   {ident['tokenizer']['fingerprint']}",
        f"reference   {ident['reference']['mode']}, weights {ident['reference']['weights_fingerprint']}",
        "objective   " + ", ".join(f"{k}={v}" for k, v in ident["objective"].items()),
        f"optimizer   {ident['optimizer']['class']}, {len(ident['optimizer']['parameters'])} parameters, "
        + ", ".join(f"{k}={v}" for k, v in ident["optimizer"]["hyperparameters"][0].items()),
        "model       "
        + ("LoRA " + ", ".join(f"{k}={v}" for k, v in lora.items()) if (lora := ident["model"]["lora"]) else "full"),
        f"scheduler   {ident['scheduler']['class']} ({ident['scheduler']['kind']})",
        "layout      " + ", ".join(f"{k}={v}" for k, v in ident["layout"].items()),
        f"lineage     run {info['lineage']['run_id']}, parent {info['lineage']['parent']}"
        + (f", resumed from {info['lineage']['resumed_from']}" if info["lineage"].get("resumed_from") else ""),
    ]
    for r in info["ranks"]:
        lines.append(f"rank {r['rank']:<6} {r['file']}: loader at {r['loader_position']}")
    click.echo("\n".join(lines))


@main.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--values", is_flag=True, help="Also compare tensor values: the largest absolute difference per tensor.")
@click.option(
    "--atol", type=float, default=0.0, show_default=True, help="With --values: differences up to this count as equal."
)
def diff(a, b, as_json, values, atol) -> None:
    """Differences between two checkpoints: config, data, tokenizer, objective, optimizer and scheduler
    identity, layout, positions and the library releases (environment); with --values, tensors. Exit 0
    equal, 1 different, 2 error."""
    from dpo_state import diff_checkpoints

    result = _guard(diff_checkpoints, a, b, values=values, atol=atol)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        for section, rows in result["sections"].items():
            click.echo(f"[{section}]")
            for row in rows:
                click.echo(f"  {row['path']}: {json.dumps(row['a'])} -> {json.dumps(row['b'])}")
        if values:
            t = result["tensors"]
            for row in t["per_tensor"]:
                if row["max_abs_diff"] is None or row["max_abs_diff"] > atol:
                    click.echo(
                        f"  tensor {row['tensor']}: " + (row.get("note") or f"max |a - b| = {row['max_abs_diff']:.3g}")
                    )
            click.echo(f"tensors: {t['differ']} of {t['count']} differ (atol {atol})")
        click.echo("equal" if result["equal"] else "different")
    sys.exit(0 if result["equal"] else 1)


@main.command()
@click.argument("path", type=click.Path())
def verify(path) -> None:
    """Check the commit record, every file's size and sha256, the schemas and the rank files, and that no file
    or directory of the checkpoint (the step directory included) is a symbolic link. PATH may also be an export
    (OUTPUT/final, OUTPUT/final-merged): its files against its export.json (changed, missing, extra or symbolic
    links, the directory itself included), the record's step and run id against the model card (and, in its
    run directory, the run's checkpoints); one without export.json is named as such. Exit 0 when all hold, 1
    with every failure named."""
    from dpo_state import verify_checkpoint

    problems = verify_checkpoint(path)
    if problems:
        click.echo(f"FAILED: {path}", err=True)
        for p in problems:
            click.echo(f"  - {p}", err=True)
        sys.exit(1)
    click.echo(f"ok: {path}")


@main.command()
@click.argument("final_dir", type=click.Path())
@click.argument("repo_id")
@click.option("--token", default=None, help="A Hub token with write access [default: HF_TOKEN, or `hf auth login`'s].")
@click.option("--private", is_flag=True, help="Create the repository private (when it does not exist yet).")
def push(final_dir, repo_id, token, private) -> None:
    """Upload an export (OUTPUT/final or OUTPUT/final-merged) to the Hugging Face Hub as model repository
    REPO_ID (namespace/name; created when missing), in one commit: model card, weights, tokenizer,
    export.json. It must verify against its export.json first; nothing is sent otherwise. Prints the
    commit's URL. Exit 2 with the reason named (no token, no network, a refused repo id)."""
    from dpo_train.export.hub import push_export

    click.echo(_guard(push_export, final_dir, repo_id, token=token, private=private))


@main.command()
@click.argument("run_dir", type=click.Path())
@click.option(
    "--out", type=click.Path(), default=None, help="Where the charts and report.html go [default: RUN_DIR/report]."
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the summary and every series as one JSON object; draw nothing."
)
@click.option(
    "--smoothing",
    type=float,
    default=0.0,
    show_default=True,
    help="Also draw each step series as its moving average with this weight in [0, 1) (TensorBoard's slider).",
)
def report(run_dir, out, as_json, smoothing) -> None:
    """Charts of a run (docs/report.md): loss (the optimized objective, and its pair part where they differ),
    reward accuracy, margins, rewards, log-probs, gradient norm and learning rate, pairs/s and tokens/s,
    per-source pair loss, accuracy and pairs (the 12 sources with the most
    pairs; the others listed), held-out accuracy and margin, micro-batch fill; checkpoints marked. Writes
    PNGs and one self-contained report.html (images inlined, nothing fetched; the summary, then the charts at
    full width, then the identity folded) and prints its path. Reads RUN_DIR's logs, config and checkpoint
    JSON only; works on a running, resumed or stopped run."""
    if as_json:
        from dpo_report.summary import run_report

        click.echo(json.dumps(_guard(run_report, run_dir), indent=2))
        return
    from dpo_report.charts import write_report

    click.echo(_guard(write_report, run_dir, out, smoothing))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def env(as_json) -> None:
    """This environment, for a bug report: dpo-toolkit's version, Python, the platform, torch's accelerators,
    and every library dpo-toolkit declares (each extra's too) with its installed release against the range
    (docs/dependencies.md). Exit 0 when every installed one is within its range and none it always needs is
    missing, 1 otherwise: what dpo-train and dpo-data build refuse (an extra's library, when its feature is
    used)."""
    import platform

    import torch

    from dpo_data import __version__
    from dpo_state.installed import releases

    rows = releases()
    info = {
        "dpo-toolkit": __version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "platform": platform.platform(),
        "torch": torch.__version__,
        "accelerators": _accelerators(torch),
        "libraries": rows,
    }
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        lines = [f"{key:<13}{info[key]}" for key in ("dpo-toolkit", "python", "platform", "torch", "accelerators")]
        lines.append("libraries    installed, needed, verdict [the extra that declares it]")
        for row in rows:
            verdict = {True: "ok", False: "OUTSIDE THE RANGE", None: "not installed (optional)"}[row["within"]]
            extra = f"  [{row['extra']}]" if row["extra"] else ""
            installed = "-" if row["installed"] is None else row["shown"]  # escaped: a release may hold escapes
            lines.append(f"  {row['name']:<14}{installed:<21} {row['needed']:<12}{verdict}{extra}")
        click.echo("\n".join(lines))
    sys.exit(0 if all(row["within"] is not False for row in rows) else 1)


def _accelerators(torch) -> str:
    """CUDA's devices (and its version and NCCL's), or an Ascend NPU's, or none."""
    import importlib.util

    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "none"
        return f"CUDA {torch.version.cuda}: {names}; NCCL {nccl}"
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401 - registers the npu device

        if torch.npu.is_available():
            return f"NPU: {torch.npu.device_count()} device(s)"
    return "none (CPU only)"


if __name__ == "__main__":
    main()
