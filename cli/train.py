"""`dpo-train`: the distributed DPO trainer (lands with the trainer issue; today it says so and exits 2)."""

import sys

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config", required=False)
@click.version_option(package_name="dpo-toolkit")
def main(config) -> None:
    """Train with DPO from a YAML CONFIG.

    Not available yet: the trainer arrives with issue 4. Exits with status 2.
    """
    click.echo("error: dpo-train is not implemented yet (the trainer lands with issue 4)", err=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
