#!/usr/bin/env bash
# Numbers a refactor must not change: the demo's 24 training steps (losses, learning rates, gradient norms, every
# metric but the clock's) and a run killed with SIGKILL after its step-4 checkpoint and resumed, against the same
# run uninterrupted. Writes OUT/numbers.txt (one digest line per run, the metrics behind it in OUT/*.numbers);
# compare two trees' files with `diff`. Needs the demo's data and reference (run scripts/demo.sh once).
# Usage: bash scripts/same_numbers.sh OUT
set -euo pipefail
out=$(realpath -m "${1:?usage: scripts/same_numbers.sh OUT}")
root="$(cd "$(dirname "$0")/.." && pwd)"
export PATH="$root/.venv/bin:$PATH" TRANSFORMERS_VERBOSITY=error
data="$root/runs/demo/data"
[ -d "$data/train" ] && [ -d "$root/runs/demo/reference" ] || { echo "error: run scripts/demo.sh first" >&2; exit 2; }
model=$(dpo-data smollm2)
rm -rf "$out"; mkdir -p "$out"
sets=(--set "model.path=$model" --set "data.path=$data/train" --set "reference.path=$root/runs/demo/reference"
      --set "eval.path=$data/heldout" --set train.log_every=1)
numbers() {  # every metric of every step but the clock's
  python - "$1/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    print(json.dumps({k: v for k, v in row.items() if k not in ("time", "pairs/s", "tokens/s")}, sort_keys=True))
PY
}
echo "== the demo's training (24 steps)"
dpo-train "$root/examples/demo-train.yaml" "${sets[@]}" --set "train.output_dir=$out/demo" --quiet
numbers "$out/demo" > "$out/demo.numbers"
short=("${sets[@]}" --set train.max_steps=8 --set train.save_every=4 --set train.keep_last=2)
echo "== 8 steps uninterrupted"
dpo-train "$root/examples/demo-train.yaml" "${short[@]}" --set "train.output_dir=$out/whole" --quiet
numbers "$out/whole" > "$out/whole.numbers"
echo "== 8 steps, SIGKILL once step 5 is logged (after the step-4 checkpoint), then resumed"
dpo-train "$root/examples/demo-train.yaml" "${short[@]}" --set "train.output_dir=$out/killed" --quiet &
pid=$!
until [ -f "$out/killed/metrics.jsonl" ] && [ "$(wc -l < "$out/killed/metrics.jsonl")" -ge 6 ]; do
  kill -0 $pid 2>/dev/null || { echo "error: the run ended before it could be killed" >&2; exit 1; }
  sleep 0.2
done
kill -KILL $pid; wait $pid 2>/dev/null || true
dpo-train "$root/examples/demo-train.yaml" "${short[@]}" --set "train.output_dir=$out/killed" --quiet
numbers "$out/killed" > "$out/killed.numbers"
cmp "$out/whole.numbers" "$out/killed.numbers" && echo "resumed run: bitwise equal to the uninterrupted one"
for run in demo whole killed; do echo "$run $(sha256sum < "$out/$run.numbers" | cut -c1-16)"; done | tee "$out/numbers.txt"
