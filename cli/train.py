"""`dpo-train`: train with DPO from a YAML config; launches torchrun itself for --nproc-per-node > 1."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import click

from dpo_cli.errors import fail, user_errors

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")

MAX_NODES = 100_000
"""--nnodes at most: more machines than the largest clusters have is a typo, and torchrun's rendezvous would
wait for every one of them (it waited, silently, for --nnodes 99999999999999999999)."""
MAX_PROCS_PER_NODE = 1_024
"""--nproc-per-node at most: each process is a rank holding the model (or its shard) on this machine, and no
machine has that many accelerators or cores; torchrun would start every one before the first could fail."""
RDZV_BACKENDS = ("c10d", "static", "etcd-v2", "etcd")
"""torchrun's own rendezvous backends (torch.distributed.elastic.rendezvous.registry); the etcd ones need the
python-etcd package and an etcd server at --rdzv-endpoint."""
_ENDPOINT_HELP = "HOST:PORT with PORT 1-65535, HOST a hostname, an IPv4 address or [IPv6] (e.g. node0:29500)"
_LABEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,62}")  # of a hostname or IPv4 address: no space, no leading '-'
_PORT = re.compile(r"[0-9]{1,5}")
_RDZV_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # a key in the rendezvous store, e.g. a Slurm job id


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("config", metavar="[CONFIG]", required=False)
@click.option(
    "--from-trl",
    "from_trl",
    metavar="TRL.yaml",
    help="Translate a TRL config (flat DPOConfig / TrainingArguments / ModelConfig fields and the datasets: list, as "
    "`trl dpo --config` reads them) into this toolkit's config, print it (YAML) on stdout and exit; notes on "
    "stderr: the `dpo-data build` command its dataset and build-time fields (max_length, ...) make, the "
    "`dpo-state push` command of push_to_hub, what is not carried (an eval_strategy without --set eval.path). "
    "A Hub model id is found in the local Hugging Face cache or refused. --set applies to "
    "the translation, --nproc-per-node N (times --nnodes) sets the processes the global batch is counted for. "
    "Save it and train it: dpo-train --from-trl trl.yaml > train.yaml && dpo-train train.yaml. Table: "
    "docs/train-config.md.",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override one config key (value read as YAML); repeatable.",
)
@click.option(
    "--nproc-per-node",
    type=int,
    default=1,
    show_default=True,
    metavar="N",
    help=f"Processes on this machine, 1 to {MAX_PROCS_PER_NODE}; N > 1 relaunches under torchrun (running under "
    "torchrun works too).",
)
@click.option(
    "--nnodes",
    type=int,
    default=1,
    show_default=True,
    metavar="N",
    help=f"Machines in the run, 1 to {MAX_NODES}, each launching --nproc-per-node processes (torchrun's --nnodes); "
    "N > 1 needs --rdzv-endpoint, and train.output_dir on a filesystem every node sees.",
)
@click.option(
    "--node-rank",
    type=int,
    default=0,
    show_default=True,
    metavar="R",
    help="This machine's place in 0..N-1 (torchrun's --node-rank; the c10d rendezvous may order nodes itself).",
)
@click.option(
    "--rdzv-endpoint",
    metavar="HOST:PORT",
    default=None,
    help="Where the nodes meet (torchrun's --rdzv-endpoint): a host every node reaches, e.g. the first node; "
    f"{_ENDPOINT_HELP}.",
)
@click.option(
    "--rdzv-backend",
    default="c10d",
    show_default=True,
    help="torchrun's rendezvous backend: c10d, static (node ranks as given), or etcd-v2 / etcd (python-etcd and an "
    "etcd server).",
)
@click.option(
    "--rdzv-id",
    default="dpo-train",
    show_default=True,
    help="The run's rendezvous id, the same on every node (e.g. $SLURM_JOB_ID): 1 to 128 letters, digits, '.', '_' "
    "or '-'.",
)
@click.option(
    "--precompute-reference",
    is_flag=True,
    help="Score every pair of data.path with the reference (the initial policy) once and write the "
    "sidecar at reference.path, bound to the dataset and the weights; then exit. An existing sidecar "
    "there is refused unless --overwrite is given.",
)
@click.option("--overwrite", is_flag=True, help="With --precompute-reference: replace the sidecar at reference.path.")
@click.option(
    "--only-planned",
    is_flag=True,
    help="With --precompute-reference: score only the pairs this config's train.max_steps steps read (the "
    "loader's plan), not every pair; a run that reads any other pair (more steps, another data.seed, batch size "
    "or world size) is refused before its first step, with the fix (docs/reference.md).",
)
@click.option(
    "--quiet", "-q", is_flag=True, help="No start-up lines, no progress line (metrics.jsonl is written as always)."
)
@click.version_option(package_name="dpo-toolkit")
def main(
    config,
    from_trl,
    overrides,
    nproc_per_node,
    nnodes,
    node_rank,
    rdzv_endpoint,
    rdzv_backend,
    rdzv_id,
    precompute_reference,
    overwrite,
    only_planned,
    quiet,
) -> None:
    """Train with DPO from a YAML CONFIG (keys: docs/train-config.md), or translate a TRL config
    (--from-trl: TRL's names, their keys here, and what is refused, in docs/train-config.md "From TRL").

    Writes OUTPUT/config.resolved.yaml, OUTPUT/metrics.jsonl (one JSON object per optimizer step,
    pair-weighted over the whole step), OUTPUT/eval.jsonl with eval.path (held-out preference accuracy
    before and after) and the final policy in OUTPUT/final/ (a Hugging Face directory; with model.lora,
    a PEFT adapter directory and/or the merged model, per train.export; weights in train.export_dtype).
    Before step 1, each start-up stage is one line on stderr with its time (importing torch, loading the
    tokenizer, verifying the datasets, loading the model, the probe, the reference, a resume, the first step:
    docs/train-config.md). On a terminal a progress line shows step, loss, accuracy, pairs/s and ETA (in a
    log, a line per step with elapsed time and ETA); scoring, checkpoint saves and the export say when they
    start and end. --quiet prints none of these. `dpo-state
    report OUTPUT` draws the run (docs/report.md); train.report_to: [tensorboard] also writes
    OUTPUT/tensorboard/, [wandb] a W&B run (WANDB_* variables; docs/report.md).

    With train.save_every, checkpoints go to OUTPUT/checkpoints/step-NNNNNN/ and a rerun resumes from the
    newest committed one that verifies, after checking it belongs to this run (docs/checkpoints.md).

    train.max_steps wins over train.epochs when set (as TRL's); max_steps: null trains train.epochs
    epochs. OUTPUT is the run's alone: never a dataset, inside one or holding one, never / or a system
    directory, and one run at a time (OUTPUT.lock names the holder). final/ is renamed into place last.

    Exit 0 on success; 2 on a config, data, reference-sidecar or resume error; 1 when a rank fails
    (every rank stops, the failing rank names its error) or a save fails (nothing is committed, the
    partial checkpoint is removed); 130 on Ctrl-C, naming the last committed checkpoint to resume
    from (a Ctrl-C during a save lets it commit first; a second stops at once). With --nproc-per-node,
    the code of the first rank that failed.

    distributed.sequence_parallel {ulysses: U, context: C} splits each packed row over U x C ranks
    (world = dp x C x U); pairs stay whole and are counted once (docs/objective.md).

    Before step 1 the model's attention is checked against the path model.attention picks (windows,
    chunks, softcaps, sinks; a model with convolution, linear-attention or Mamba layers, or ALiBi,
    runs unpacked: each sequence alone in a padded batch, said once on stderr), and a packed row of
    synthetic pairs must score as its sequences do unpacked through eager (train.probe_packing); a
    mixture-of-experts model that returns a router loss adds it (loss.router_aux_coef). Dropout is off,
    all of it (modules, attributes, config keys). During step 1 the policy's training forward must
    score every pair of the run's own micro-batches as the reference does on the same row reordered
    (train.parity_guard), and as each sequence scores alone, unpadded, through the model as loaded
    (train.alone_check): a difference is exit 2 before the optimizer steps. A value named like dropout
    that the evaluation forward reads is kept (PhiMoE's routing threshold). Under auto a model the
    run's path cannot score takes a path the probe checked, said once. model.attention flex runs each
    layer's attention in one compiled FlexAttention call (rows padded to a power-of-two bucket; each compile
    said on stderr; DPO_FLEX_COMPILE=0 runs it uncompiled, for debugging); model.attention varlen runs it in
    one call of torch's variable-length FlashAttention (CUDA, bf16 or fp16, separate layout). Supported architectures:
    docs/train-config.md.

    First of all, the installed libraries must be within the ranges dpo-toolkit declares (torch, transformers,
    ...; PEFT with model.lora): a release outside them is exit 2, naming each and the pip command that fixes it
    (DPO_ALLOW_UNTESTED_DEPENDENCIES=1 warns instead); and every rank must run the same dpo-toolkit source and
    releases (docs/dependencies.md, "Checked at run time").

    Host tensors of 2 MiB or more go in huge pages (PyTorch's THP_MEM_ALLOC_ENABLE=1, set unless already
    set; =0 keeps 4 KiB pages): on a CPU a long pair's step then peaks gigabytes lower at the same speed. The
    model runs its own code, the code the checks above check: transformers' hub kernels are off
    (USE_HUB_KERNELS=NO unless set; YES brings them back, unchecked).

    Long pairs: train.logits_budget_mib (the vocabulary head in chunks), train.activation_checkpointing and
    train.mlp_tile_tokens (each MLP a tile of positions at a time; its default, auto, tiles where checkpointing
    makes that free) bound a step's memory (docs/train-config.md, "Long pairs").
    """
    _counts(nproc_per_node, nnodes)
    if from_trl or not config:
        processes = nproc_per_node * nnodes  # the global batch counts every process of every node
        other = precompute_reference or overwrite or only_planned
        sys.exit(_translate(config, from_trl, list(overrides), processes, other))
    nodes = _nodes(nnodes, node_rank, rdzv_endpoint, rdzv_backend, rdzv_id)  # the command line's flags first
    for flag, given in (("--overwrite", overwrite), ("--only-planned", only_planned)):
        if given and not precompute_reference:
            fail(f"{flag} only applies to --precompute-reference; drop it")
    raw = _config_file(config)  # before torch loads (seconds) or torchrun starts a process per rank
    _dependencies()
    _inputs(raw, overrides, precompute_reference)
    if (nproc_per_node > 1 or nnodes > 1) and "TORCHELASTIC_RUN_ID" not in os.environ:  # not yet under torchrun
        args = [
            sys.executable,
            "-m",
            "dpo_cli.launch",  # torchrun, minus its traceback on a failed rank
            *nodes,
            f"--nproc-per-node={nproc_per_node}",
            "-m",
            "dpo_cli.train",
            config,
            *(a for o in overrides for a in ("--set", o)),
            *(["--precompute-reference"] if precompute_reference else []),
            *(["--overwrite"] if overwrite else []),
            *(["--only-planned"] if only_planned else []),
            *(["--quiet"] if quiet else []),
        ]
        # rank variables inherited from an enclosing job would mislead torchrun's children: torchrun sets its own
        env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
        launcher = subprocess.Popen(args, env=env)
        try:
            code = launcher.wait()
        except KeyboardInterrupt:  # torchrun stops its ranks on SIGINT: pass it on, let it, then say what is left
            launcher.send_signal(signal.SIGINT)
            launcher.wait()
            click.echo(f"interrupted: {_resume_hint(config, overrides)}", err=True)
            sys.exit(130)
        if code:
            click.echo(f"error: a rank failed (exit {code}); its error is printed above", err=True)
        sys.exit(code)
    sys.exit(_run_rank(config, list(overrides), precompute_reference, quiet, overwrite, only_planned))


def _config_file(config: str) -> object:
    """CONFIG readable as YAML (missing, a directory, binary or oversized: one line, exit 2), checked by the
    loader's own reader, which imports no torch; `load_config` reads it again and checks what it says."""
    from dpo_train.config.strict_yaml import read_yaml_file
    from dpo_train.errors import ConfigError

    try:
        return read_yaml_file(Path(config))
    except ConfigError as e:
        fail(str(e))


def _inputs(raw: object, overrides: tuple[str, ...], precompute: bool) -> None:
    """The directories the run reads exist (data.path, eval.path, a precomputed sidecar; --set applied): a typo is
    named at once, before torch, the tokenizer or the model loads and before OUTPUT or its lock is created. The
    run's setup checks them again (`dpo_train.run.setup`), for callers that skip this CLI."""
    from dpo_train.config.overrides import apply_override
    from dpo_train.run.inputs import check_inputs

    if not isinstance(raw, dict):
        return  # not a mapping of sections: load_config names that
    with user_errors():
        for item in overrides:
            apply_override(raw, item)
        check_inputs(raw, precompute)


def _dependencies() -> None:
    """The installed libraries within the ranges dpo-toolkit declares, before torchrun starts a rank."""
    from dpo_state.installed import check_installed

    with user_errors():
        check_installed()


def _counts(nproc_per_node: int, nnodes: int) -> None:
    """The process counts within bounds (click takes any integer, 10**20 included), before anything starts."""
    if not 1 <= nnodes <= MAX_NODES:
        fail(f"--nnodes is {nnodes}; allowed: 1 or more machines, at most {MAX_NODES}. Fix: the machines in the run")
    if not 1 <= nproc_per_node <= MAX_PROCS_PER_NODE:
        fail(
            f"--nproc-per-node is {nproc_per_node}; allowed: 1 to {MAX_PROCS_PER_NODE} processes on this machine. "
            "Fix: give one per accelerator (or a few on CPU)"
        )


def _nodes(nnodes: int, node_rank: int, endpoint: str | None, backend: str, rdzv_id: str) -> list[str]:
    """torchrun's arguments for where this launcher's processes sit: `--standalone` on one machine, else the
    rendezvous every node joins. Bad values are refused here, by name, before torchrun starts: torchrun would
    print its traceback for some and wait for ever on others."""
    _rendezvous(backend, rdzv_id)
    if nnodes == 1:
        if endpoint or node_rank:
            fail("--rdzv-endpoint and --node-rank are for --nnodes 2 or more; drop them on one machine")
        return ["--standalone"]
    if not endpoint:
        fail(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, where the nodes meet (e.g. the first node)")
    problem = _endpoint_problem(endpoint)
    if problem:
        fail(
            f"--rdzv-endpoint is {endpoint!r} ({problem}); allowed: {_ENDPOINT_HELP}. Fix: the first node's address "
            "and a free port, the same on every node"
        )
    if not 0 <= node_rank < nnodes:
        fail(f"--node-rank is {node_rank}; allowed: 0 to {nnodes - 1} with --nnodes {nnodes}")
    return [
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
    ]


def _rendezvous(backend: str, rdzv_id: str) -> None:
    """A backend torchrun has (and can load here), and an id the rendezvous store takes as a key."""
    if backend not in RDZV_BACKENDS:
        fail(
            f"--rdzv-backend is {backend!r}; allowed: {', '.join(RDZV_BACKENDS)} (torchrun's). Fix: leave it at c10d, "
            "which needs no server"
        )
    if backend.startswith("etcd") and importlib.util.find_spec("etcd") is None:
        fail(f"--rdzv-backend {backend} needs the python-etcd package, not installed here; install it, or use c10d")
    if not _RDZV_ID.fullmatch(rdzv_id):
        fail(
            f"--rdzv-id is {rdzv_id!r}; allowed: 1 to 128 letters, digits, '.', '_' or '-'. Fix: a name or number the "
            "same on every node (e.g. $SLURM_JOB_ID)"
        )


def _endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with a rendezvous endpoint, or None for HOST:PORT (an IPv6 host in brackets, as torchrun
    reads it). The port is required: torchrun's default differs by backend, and every node must name the same."""
    host, colon, port = endpoint.rpartition(":")
    if not colon or not port or endpoint.endswith("]"):
        return "no port"
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        return f"the port {port!r} is not a number in 1-65535"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host} is not an IPv6 address"
        return None
    if ":" in host:
        return "an IPv6 address goes in brackets, e.g. [::1]:29500"
    if not host:
        return "no host before the port"
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return f"the host {host!r} is not a hostname or an IPv4 address"
    return None


def _run_rank(
    config: str,
    overrides: list[str],
    precompute: bool,
    quiet: bool,
    overwrite: bool = False,
    only_planned: bool = False,
) -> int:
    """One rank's run. Bad input: a one-line error and exit 2. Anything else: the rank's traceback and
    exit 1 without waiting for peers (torchrun then stops the other ranks; a peer blocked in a
    collective sees the closed connection)."""
    from dpo_train.run.progress import stage  # imports no torch: the line shows while torch loads

    rank = int(os.environ.get("RANK", "0"))
    with stage("imports", not quiet and rank == 0):
        from dpo_state.errors import ToolkitError
        from dpo_train.config.loading import load_config
        from dpo_train.parallel import collectives

    prefix = f"rank {rank}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    try:
        resolved = load_config(config, overrides)
        if precompute:
            from dpo_train.precompute import precompute_reference

            path = precompute_reference(resolved, overwrite, progress=not quiet, only_planned=only_planned)
            if rank == 0:
                click.echo(f"reference sidecar written: {path}")
            collectives.shutdown()
            sys.stdout.flush()
            return _exit(0)
        from dpo_train.trainer import train

        out = train(resolved, progress=not quiet)
        collectives.shutdown()
    except KeyboardInterrupt:
        if rank == 0 and "TORCHELASTIC_RUN_ID" not in os.environ:  # under torchrun the launcher says it
            click.echo(f"interrupted: {_resume_hint(config, overrides)}", err=True)
        return _exit(130)
    except ToolkitError as e:  # the user's to fix (exit 2), or a save that failed on some rank (exit 1)
        click.echo(f"error: {prefix}{e}", err=True)
        return _exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - a rank's failure must end every rank, named
        from dpo_state.disk import disk_errno, disk_message

        if (code := disk_errno(e)) is not None:  # a full or read-only disk no code named: the machine's, one line
            click.echo(f"error: {prefix}{disk_message(e, code)}", err=True)
            return _exit(1)
        click.echo(f"error: {prefix}{type(e).__name__}: {e}\n{traceback.format_exc()}", err=True)
        return _exit(1)
    if rank == 0:
        click.echo(f"done: {out}/metrics.jsonl, final policy in {out}/final")
    sys.stdout.flush()
    return _exit(0)  # everything is written and closed; an interpreter exit can still abort in gloo's teardown


def _translate(config: str | None, from_trl: str | None, overrides: list[str], world: int, other: bool) -> int:
    """`--from-trl`: the translated config on stdout, notes on stderr; exit 2 naming every field that does not
    translate (or a wrong combination of arguments)."""
    import yaml

    from dpo_state.errors import ToolkitError
    from dpo_train.config.trl import read_trl, translate

    wrong = (
        "give CONFIG to train, or --from-trl TRL.yaml to translate a TRL config"
        if not from_trl
        else "--from-trl translates a TRL config and trains nothing; give CONFIG or --from-trl, not both"
        if config
        else "--precompute-reference, --overwrite and --only-planned need CONFIG, not --from-trl"
        if other
        else ""
    )
    if wrong:
        click.echo(f"error: {wrong}", err=True)
        return 2
    try:
        translated, notes = translate(read_trl(from_trl), world, overrides)
    except ToolkitError as e:
        click.echo(f"error: {e}", err=True)
        return e.exit_code
    click.echo(yaml.safe_dump(translated, sort_keys=False), nl=False)
    for note in notes:
        click.echo(f"note: {note}", err=True)
    return 0


def _resume_hint(config: str, overrides: list[str]) -> str:
    from dpo_state.errors import ToolkitError
    from dpo_train.config.loading import load_config
    from dpo_train.run.directory import resume_hint

    try:
        return resume_hint(load_config(config, list(overrides)).train.output_dir)
    except ToolkitError:
        return "the run stopped before its config was read"


def _exit(code: int) -> int:
    """With peers, leave at once. After a failure, a clean interpreter exit could wait on a collective that never
    ends; after a success (every log, checkpoint and export closed, the process group destroyed), it can still
    abort in C++ teardown: SIGABRT, "terminate called without an active exception" (gloo threads at interpreter
    finalization, as in pytorch/pytorch#179291), seen on a rank of a finished 2-process FSDP run."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    main()
