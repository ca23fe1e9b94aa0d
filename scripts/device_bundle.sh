#!/usr/bin/env bash
# Bundle, on a machine with the package registry, what a device run needs and an offline GPU machine lacked at
# stop 46 (torch, numpy, pyarrow, pandas, accelerate and the like were there): the project's Python 3.12 wheels at
# the versions this .venv tests, and the bundled model's GGUF, zstd-compressed and cut in two parts so that each
# of two device calls carries about 59 MiB, under the 64 MiB limit with the tree (about 3 MiB). Everything goes
# to .dev/device (ignored).
#
#   bash scripts/device_bundle.sh               # then, on the device, scripts/device_run.sh (its header: the calls)
#
# Python 3.12 and manylinux x86_64 are the device's (docs/benchmarks/device.md, "The device check"); DEVICE_PYTHON
# changes the version (e.g. 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.dev/device
venv=.venv/bin/python
[ -x "$venv" ] || bash scripts/env.sh
packages=(torchdata zstandard orjson jsonschema jsonschema-specifications referencing rpds-py attrs transformers
  huggingface-hub httpx2 httpcore2 truststore idna anyio typing-extensions regex tomlkit click kernels tokenizers
  safetensors gguf trl datasets dill multiprocess accelerate xxhash h11 pytest pluggy iniconfig pygments packaging)
pinned=()
for name in "${packages[@]}"; do
  pinned+=("$name==$("$venv" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
version=${DEVICE_PYTHON:-3.12}
rm -rf "$out" && mkdir -p "$out/wheels"
"$venv" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$version" --implementation cp --abi "cp${version/./}" --abi abi3 --abi none \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d "$out/wheels" "${pinned[@]}"
gguf=$("$venv" -c "from dpo_train.model.bundled import gguf_path; print(gguf_path())")
# the first part rides with the wheels, the second alone: the two calls carry the same (about 59 MiB each)
wheels=$(du -sb "$out/wheels" | cut -f1)
"$venv" - "$gguf" "$out" "$wheels" <<'EOF'
import sys
from pathlib import Path

import zstandard

gguf, out, wheels = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
packed = zstandard.ZstdCompressor(level=19).compress(gguf.read_bytes())
first = max(0, (len(packed) - wheels) // 2)
(out / "model.1").write_bytes(packed[:first])
(out / "model.2").write_bytes(packed[first:])
(out / "model.name").write_text(gguf.name)
print(f"{len(packed) >> 20} MiB of model in two parts: {first >> 20} and {(len(packed) - first) >> 20} MiB")
EOF
du -sh "$out"/wheels "$out"/model.1 "$out"/model.2
