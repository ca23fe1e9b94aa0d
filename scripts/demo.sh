#!/usr/bin/env bash
# The demo on embedded defaults: install, materialize SmolLM2-135M-Instruct, build the bundled sample
# (train and held-out splits) into attested datasets, inspect and verify them, preview the loader's
# plan, train the real model for a few steps, and draw the run's report. Output: runs/demo/.
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
ref=runs/demo/reference
sets=(--set "model.path=$model" --set "data.path=$out/train" --set "reference.path=$ref" --set "eval.path=$out/heldout")
echo; echo "== dpo-train --precompute-reference --only-planned (the reference's log-probs of the pairs the 24 steps read, once)"
rm -rf runs/demo/train "$ref"
dpo-train examples/demo-train.yaml "${sets[@]}" --precompute-reference --only-planned
echo; echo "== dpo-train (SmolLM2-135M-Instruct, 24 steps of 8 pairs, CPU, a checkpoint every 12 steps)"
dpo-train examples/demo-train.yaml "${sets[@]}"
echo; echo "== dpo-state inspect (the last checkpoint) and verify"
dpo-state inspect runs/demo/train
dpo-state verify runs/demo/train
echo; echo "== held-out preference accuracy ($out/heldout)"
python - <<'PY'
import json
rows = [json.loads(line) for line in open("runs/demo/train/eval.jsonl")]
before, after = rows[0], rows[-1]
print(f"pairs whose chosen margin over the reference is positive: {before['accuracy']:.1%} before "
      f"(step {before['step']}: policy = reference, every margin ties) -> {after['accuracy']:.1%} after "
      f"(step {after['step']}), reward margin {after['rewards/margins']:+.3f} (rewards/margins, beta-scaled as "
      f"in training; log-ratio margin {after['logratio_margin']:+.3f})")
print(f"pairs whose chosen completion is more likely than the rejected one (policy alone): "
      f"{before['logp_accuracy']:.1%} -> {after['logp_accuracy']:.1%}")
m = [json.loads(line) for line in open("runs/demo/train/metrics.jsonl")]
print(f"training: {len(m)} steps, loss {m[0]['loss']:.4f} -> {m[-1]['loss']:.4f}, "
      f"{sum(r['pairs'] for r in m)} pairs, {sum(r['pairs'] for r in m) / sum(r['pairs'] / r['pairs/s'] for r in m):.2f} pairs/s")
PY
echo; echo "== dpo-state report (charts of the run: docs/report.md)"
report=$(dpo-state report runs/demo/train)
echo "report: $report"
echo; echo "demo done: datasets in $out/, run in runs/demo/train/ (metrics.jsonl, eval.jsonl, checkpoints/, final/, report/)"
