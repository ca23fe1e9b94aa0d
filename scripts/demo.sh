#!/usr/bin/env bash
# The demo on embedded defaults: install, materialize SmolLM2-135M-Instruct, build the bundled sample
# (train and held-out splits) into attested datasets, inspect and verify them, preview the loader's
# plan, and train the real model for a few steps. Output: runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
export PATH="$PWD/.venv/bin:$PATH" TRANSFORMERS_VERBOSITY=error
model=$(dpo-data smollm2)
echo "model and tokenizer: $model"
out=runs/demo/data
for split in train heldout; do
  dir=examples/sample; [ "$split" = heldout ] && dir=examples/sample/heldout
  echo; echo "== dpo-data build ($split)"
  dpo-data build "$dir"/*.jsonl "$dir"/*.jsonl.zst "$dir"/*.json "$dir"/*.parquet \
    --tokenizer "$model" --out "$out/$split" --max-length 512 --num-proc 2 --overwrite
  echo; echo "== dpo-data inspect ($split)"
  dpo-data inspect "$out/$split"
  echo; echo "== dpo-data verify ($split)"
  dpo-data verify "$out/$split" --tokenizer "$model"
done
echo; echo "== dpo-data plan (train, 2 ranks, 32 pairs per step, 512-token micro-batches)"
dpo-data plan "$out/train" --batching pairs --world-size 2 --pairs-per-step 32 --max-tokens-per-microbatch 512 --steps 2
echo; echo "== dpo-train (SmolLM2-135M-Instruct, 4 steps of 8 pairs, CPU)"
rm -rf runs/demo/train
dpo-train examples/demo-train.yaml --set "model.path=$model" --set "data.path=$out/train"
python - <<'PY'
import json
for line in open("runs/demo/train/metrics.jsonl"):
    m = json.loads(line)
    print(f"step {m['step']}: loss {m['loss']:.4f}  accuracy {m['rewards/accuracies']:.3f}  "
          f"margin {m['rewards/margins']:+.4f}  {m['pairs']} pairs  {m['tokens/s']:.0f} tokens/s")
PY
echo; echo "demo done: datasets in $out/, training run in runs/demo/train/ (metrics.jsonl, final/)"
