#!/usr/bin/env bash
# The device check on one CUDA GPU (a few minutes): collectives under NCCL, bf16 log-probs against fp32
# with the attention the trainer picks, precompute, train, SIGKILL, resume and a bitwise comparison,
# the architecture zoo on the device (every path and layout against eager unpacked),
# tokens/s and model FLOPs utilization. Prints one JSON summary; exit 0 when every part passed.
#
#   bash scripts/device_check.sh            # on a GPU machine; PYTHON may name an interpreter with CUDA torch
#   bash scripts/device_check.sh --device cpu   # the same steps on CPU and gloo, to check the script itself
#   bash scripts/device_check.sh --model DIR    # another Hugging Face model directory than the bundled SmolLM2
#
# With no PYTHON set it uses .venv (created by scripts/env.sh; set DPO_TORCH=torch there for a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-}
if [ -z "$python" ]; then
  bash scripts/env.sh
  python=.venv/bin/python
fi
export TRANSFORMERS_VERBOSITY=error
exec "$python" scripts/device_check.py "$@"
