"""`dpo-train`: train with DPO from a YAML config; launches torchrun itself for --nproc-per-node > 1."""

from __future__ import annotations

import os
import subprocess
import sys

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("config", metavar="CONFIG")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one config key (value read as YAML); repeatable.")
@click.option("--nproc-per-node", type=int, default=1, show_default=True, metavar="N",
              help="Processes on this machine; N > 1 relaunches under torchrun (running under torchrun works too).")
@click.version_option(package_name="dpo-toolkit")
def main(config, overrides, nproc_per_node) -> None:
    """Train with DPO from a YAML CONFIG (keys: docs/train-config.md).

    Writes OUTPUT/config.resolved.yaml, OUTPUT/metrics.jsonl (one JSON object per optimizer step,
    pair-weighted over the whole step) and the final policy in OUTPUT/final/ (a Hugging Face directory).
    Checkpointing and resume arrive with issue 5. Exit 0 on success, 2 on a config error.
    """
    from dpo_data.errors import DataError
    from dpo_train.config import ConfigError, load_config

    if nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}",
                "-m", "cli.train", config, *(a for o in overrides for a in ("--set", o))]
        sys.exit(subprocess.call(args))
    try:
        resolved = load_config(config, list(overrides))
        from dpo_train.trainer import train

        out = train(resolved)
    except (ConfigError, DataError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if int(os.environ.get("RANK", "0")) == 0:
        click.echo(f"done: {out}/metrics.jsonl, final policy in {out}/final")


if __name__ == "__main__":
    main()
