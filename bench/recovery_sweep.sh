#!/usr/bin/env bash
# Recovery in the default order (`--plan none`) under every budget from 5%
# to 95% of a model's plain peak: each `memfit train` of 2 steps and its
# evaluation, with the re-plans it made, the settings it ended with, and
# whether its losses equal the unbudgeted run's (within 1e-5: tiles and
# micro-batches round differently). A run that gives up is counted and
# shown with its error line.
# Usage: bash bench/recovery_sweep.sh [BUILD]
set -euo pipefail
build=${1:-build}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
models=("--model mlp" "--model mlp --width 128 --depth 8" "--model resnet --width 4 --batch 64"
  "--model gpt --width 64 --depth 2 --context 64 --batch 16")
gave_up=0 runs=0
for model in "${models[@]}"; do
  # shellcheck disable=SC2086
  "$build/memfit" train $model --steps 2 --plan none --report "$tmp/plain.json" >/dev/null 2>&1
  peak=$(python3 -c 'import json, sys; print(max(s["peak_bytes"] for s in json.load(open(sys.argv[1]))["steps"]))' \
    "$tmp/plain.json")
  echo "## $model: plain step peak $peak bytes"
  for pct in 5 8 10 15 20 25 30 35 40 45 50 55 60 65 70 75 80 85 90 95; do
    budget=$((peak * pct / 100))
    runs=$((runs + 1))
    # shellcheck disable=SC2086
    if "$build/memfit" train $model --steps 2 --plan none --budget "${budget}B" --report "$tmp/run.json" \
      >"$tmp/out" 2>"$tmp/err"; then
      python3 - "$pct" "$tmp/run.json" "$tmp/plain.json" "$tmp/out" <<'PY'
import json, re, sys
pct, run, plain, out = sys.argv[1], *(json.load(open(f)) for f in sys.argv[2:4]), open(sys.argv[4]).read()
same = all(abs(x["loss"] - y["loss"]) <= 1e-5 for x, y in zip(run["steps"], plain["steps"]))
ended = re.search(r"the run ended with (.*)", out)
batches = re.search(r"evaluated under no-grad( in batches of \d+)?", out)
print(f"{pct:>3}%: {len(run['recoveries'])} re-plans, losses {'within 1e-5' if same else 'DIFFER'}; "
      f"ended with {ended.group(1) if ended else 'its first settings'}"
      f"{'; evaluated' + batches.group(1) if batches and batches.group(1) else ''}")
PY
    else
      gave_up=$((gave_up + 1))
      echo "${pct}%: GAVE UP: $(grep 'error' "$tmp/err" | head -1)"
    fi
  done
done
echo "runs $runs, gave up $gave_up"
