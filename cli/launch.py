"""torchrun for `dpo-train --nproc-per-node N`, without the launcher's own traceback when a rank fails.

The failing rank has already printed its named error; torchrun would add its Python traceback and a
failure block on top. This exits with the first failed rank's exit code instead (2 for a config, data
or resume error, 1 otherwise), after one line naming the rank.
"""

from __future__ import annotations

import sys


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(sys.argv[1:])
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 1  # a signal (negative) is a failure too
        print(f"rank {rank} exited with {failure.exitcode}", file=sys.stderr, flush=True)
        sys.exit(code)


if __name__ == "__main__":
    main()
