#!/usr/bin/env bash
# Recovery that moves the optimizer state to the host: `memfit train` of
# the MLP under 7 MiB (its parameters, gradients and Adam state need 10.2),
# and under 5 MiB, where its parameters and gradients alone (5.11) do not
# fit and the gradients move too, and under 1 MiB, where its first weight
# and gradient (3.06) fit only in tiles; and an MLP of eight 256-wide
# layers under 2 MiB, where its parameters alone (2.53) do not fit and are
# streamed; each against the same model's run without a budget, step by
# step.
# Usage: bash bench/recovery_offload.sh [BUILD]
set -euo pipefail
build=${1:-build}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for run in "7MiB" "5MiB" "1MiB" "2MiB --width 256 --depth 8"; do
  read -r budget shape <<< "$run"
  echo "## without a budget${shape:+: $shape}"
  "$build/memfit" train --model mlp $shape --steps 3 --no-eval --plan none --report "$tmp/plain.json"
  echo "## under $budget${shape:+: $shape}"
  "$build/memfit" train --model mlp $shape --budget $budget --steps 3 --no-eval --plan none --report "$tmp/budget.json"
  echo "## per step under $budget: loss under the budget and without, peak bytes, seconds, re-plans"
  python3 - "$tmp/budget.json" "$tmp/plain.json" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
for x, y in zip(a["steps"], b["steps"]):
    print("step", x["step"], "loss", x["loss"], y["loss"], "equal" if x["loss"] == y["loss"] else "DIFFER",
          "peak", x["peak_bytes"], y["peak_bytes"], "seconds", round(x["seconds"], 4), round(y["seconds"], 4),
          "replans", x["replans"])
print("recoveries", a["recoveries"])
PY
done
