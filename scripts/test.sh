#!/usr/bin/env bash
# Install (scripts/env.sh), then run the whole test suite, slow tests included. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
export TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
