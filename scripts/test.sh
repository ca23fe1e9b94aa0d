#!/usr/bin/env bash
# Install (scripts/env.sh), check lint and formatting (ruff), then run the whole test suite, slow tests
# included, in DPO_TEST_WORKERS pytest-xdist workers (default 2; 0 runs in this process). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
# --dist loadfile: a test file stays on one worker, so its module fixtures (uninterrupted reference runs)
# are computed once. Much of the suite's time is process start-up and imports, on one core, so two workers
# keep two cores busier. --no-loadscope-reorder: files are dealt out in collection order, which
# tests/conftest.py's HEAVIEST_FIRST starts with the longest files (xdist's default deals the files with the
# most tests first, so a heavy file of few tests ran alone at the end while the other worker idled).
exec .venv/bin/python -m pytest -q -n "${DPO_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  --durations=25 "$@"  # the slowest tests, for keeping the suite fast
