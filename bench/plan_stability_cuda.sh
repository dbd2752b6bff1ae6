#!/usr/bin/env bash
# Issue 21 on a GPU: does `memfit plan` give the same plan from run to run for
# the GPT of bench/peers.py's CUDA table, and which candidates run out of
# memory under the budget (with the allocated and reserved bytes the plan
# gives for them)? Three runs at each budget; each line is one run's plan, its
# prediction and measured time, its tie band, how many candidates were timed
# and how many of them ran out of memory, and the command's wall time; the
# plan's lines on out-of-memory candidates and on a second search follow.
#
# Usage (after scripts/cuda-check.sh built BUILD): bash bench/plan_stability_cuda.sh [BUILD] [RUNS]
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-cuda}
runs=${2:-3}
g="--model gpt --width 256 --depth 4 --heads 4 --context 256 --batch 32 --device cuda"
json=$(mktemp)
err=$(mktemp)
trap 'rm -f "$json" "$err"' EXIT
echo "# g=\"$g\"; for b in BUDGETS; do for i in \$(seq $runs); do $build/memfit plan \$g --budget \$b --json; done; done"
for b in 504MiB 360.08MiB 323MiB 242.89MiB 150.13MiB; do
  for _ in $(seq "$runs"); do
    s=$SECONDS
    # shellcheck disable=SC2086  # the model's words are separate arguments
    "$build/memfit" plan $g --budget "$b" --json > "$json" 2> "$err"
    python3 - "$json" "$b" "$((SECONDS - s))" "$err" <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except ValueError:
    print(sys.argv[2], "no plan:", open(sys.argv[4]).read().strip()[:300])
    sys.exit()
oom = [t for t in j.get("timed", []) if t.get("measured_seconds", 1) == 0]
print(f"{sys.argv[2]}: micro-batch {j['micro_batch']}, {j['precision']}, checkpoint {j['checkpoint']}, "
      f"selective {j['selective_recompute']}, offload {j['offload']}, predicted {j['predicted_peak_bytes'] / 2**20:.2f} MiB "
      f"{j['predicted_seconds'] * 1e3:.1f} ms, measured {j.get('measured_seconds', 0) * 1e3:.1f} ms; "
      f"tie {j['measured_tie']:.2f}; {len(j['timed'])} timed, {len(oom)} out of memory; {sys.argv[3]} s")
for w in j["why"]:
    if (w.startswith("timed") and "out of memory" in w) or "searched again" in w or "choice so far" in w:
        print("   ", w)
PY
  done
done
