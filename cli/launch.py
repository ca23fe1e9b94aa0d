"""torchrun for `dpo-train --nproc-per-node N`, without the launcher's own traceback when a rank fails.

The failing rank has already printed its named error; torchrun would add its Python traceback and a
failure block on top. This exits with the first failed rank's exit code instead (2 for a config, data
or resume error, 1 otherwise), after one line naming the rank. A rendezvous that fails (a node that never
joins, an endpoint nobody serves) is one line too, exit 1: the machines', not the command's, to fix.
"""

from __future__ import annotations

import sys


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(sys.argv[1:])
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 1  # a signal (negative) is a failure too
        print(f"rank {rank} exited with {failure.exitcode}", file=sys.stderr, flush=True)
        sys.exit(code)
    except RendezvousError as e:
        print(f"error: {_rendezvous_failure(e)}", file=sys.stderr, flush=True)
        sys.exit(1)


def _rendezvous_failure(error: BaseException) -> str:
    """One line: what failed, its first cause (torch's C++ errors append their stack frames), and the fix."""
    cause = error.__cause__
    why = f" ({type(cause).__name__}: {(str(cause).splitlines() or [''])[0]})" if cause else ""
    return (
        f"the rendezvous failed: {type(error).__name__}: {error}{why}. Fix: start dpo-train on every node with the "
        "same --nnodes, --rdzv-endpoint (a host:port every node reaches) and --rdzv-id"
    )


if __name__ == "__main__":
    main()
