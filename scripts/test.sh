#!/usr/bin/env bash
# Install (scripts/env.sh), check lint and formatting (ruff), then run the whole test suite, slow tests
# included. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q --durations=25 "$@"  # the slowest tests, for keeping the suite fast
