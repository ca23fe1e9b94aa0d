"""`dpo-state`: inspect, diff and verify checkpoints (the commands land with the checkpoint-state issue)."""

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dpo-toolkit")
def main() -> None:
    """Audit checkpoints: inspect, diff, verify.

    Not available yet: these commands arrive with the checkpoint-state package (issue 5).
    Today this command only reports its version.
    """


if __name__ == "__main__":
    main()
