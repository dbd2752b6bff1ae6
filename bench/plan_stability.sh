#!/usr/bin/env bash
# Issue 21 item 3: does `memfit plan` give the same plan from run to run?
# Five runs of each case, on a quiet machine and then with `yes > /dev/null`
# keeping one core busy; each line is one run's plan (micro-batch, precision,
# checkpoint, offload), its tie band (Plan::measured_tie), whether a busy
# machine left the choice to what the plans do ("busy") or times decided
# ("timed"), how many candidates were timed, and the command's wall time.
# After each case's runs, a line counts how many of them gave the most common
# plan, and the most common micro-batch and precision (what the plan computes;
# plans that differ only in what they recompute or offload give the same
# gradients, bitwise).
#
# Usage (after `make build`): [EXTRA_ARGS=...] bash bench/plan_stability.sh [BUILD] [RUNS] [CASES]
# EXTRA_ARGS: more `memfit plan` flags for every case (e.g. "--threads 1").
# MODES: "quiet busy" (the default), or either alone.
# bench/stability_rules.py replays a tight run's timed choices under the
# one-band and the two-band tie rule.
# CASES: "default" (the cases below), "gpt" (its GPT case alone), "tight": the CNN of bench/peers.py's
# table at the budgets where hand-tuned PyTorch runs stop fitting, where the
# best candidates lie within a few percent of each other, or "peers_gpt":
# bench/peers.py's GPT at the two budgets of its table where plans varied.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
runs=${2:-5}
case ${3:-default} in
  default)
    cases=(
      "--model resnet --batch 64 --budget 64MiB"
      "--model resnet --batch 128 --budget 96MiB --batch-statistics per-micro-batch"
      "--model resnet --batch 128 --budget 38MiB --batch-statistics per-micro-batch"
      "--model gpt --batch 16 --budget 40MiB"
      "--model mlp --batch 256 --budget 1MiB"
    ) ;;
  gpt)
    cases=("--model gpt --batch 16 --budget 40MiB") ;;
  tight)
    cases=()
    for budget in 19.23MiB 15.82MiB 15.36MiB; do
      cases+=("--model resnet --depth 3 --batch 128 --budget $budget --batch-statistics per-micro-batch")
    done ;;
  peers_gpt)
    cases=()
    for budget in 28.66MiB 11.59MiB; do
      cases+=("--model gpt --width 64 --depth 4 --heads 4 --context 128 --batch 16 --threads 2 --budget $budget")
    done ;;
  *) echo "plan_stability.sh: CASES is default, gpt, tight or peers_gpt, got '$3'" >&2; exit 2 ;;
esac
json=$(mktemp)
keys=$(mktemp)
busy=
trap 'rm -f "$json" "$keys"; [ -n "$busy" ] && kill "$busy" 2>/dev/null || true' EXIT
for mode in ${MODES:-quiet busy}; do
  if [ "$mode" = busy ]; then
    yes > /dev/null &
    busy=$!
  fi
  for c in "${cases[@]}"; do
    echo "== $mode: memfit plan $c${EXTRA_ARGS:+ $EXTRA_ARGS}"
    : > "$keys"
    for _ in $(seq "$runs"); do
      start=$(date +%s.%N)
      # shellcheck disable=SC2086  # the case's words are separate arguments
      "$build/memfit" plan $c ${EXTRA_ARGS:-} --json > "$json"
      end=$(date +%s.%N)
      python3 - "$json" "$start" "$end" "$keys" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
with open(sys.argv[4], "a") as keys:  # the plan, then what it computes
    print(json.dumps([[j.get(k) for k in ("micro_batch", "precision", "checkpoint", "offload", "tile_bytes")],
                      [j["micro_batch"], j["precision"]]]), file=keys)
timed = [w for w in j["why"] if w.startswith("timed")]
how = "busy" if timed and "what the plans do" in timed[0] else "timed"
tiles = f", tiles of {j['tile_bytes']} bytes" if j.get("tile_bytes") else ""
print(f"micro-batch {j['micro_batch']}, {j['precision']}, checkpoint {j['checkpoint']}, offload {j['offload']}{tiles}; "
      f"tie {j['measured_tie']:.2f}, {how}, {len(j['timed'])} timed, {float(sys.argv[3]) - float(sys.argv[2]):.1f} s")
if j["timed"]:  # what the choice saw: each timed candidate's fastest step
    print("  timed: " + "; ".join(
        f"{t['micro_batch']} {t['offload']} [{t['checkpoint']}] {1e3 * t['measured_seconds']:.1f} ms" for t in j["timed"]))
PY
    done
    python3 - "$keys" <<'PY'
import collections, json, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
most = lambda i: collections.Counter(json.dumps(r[i]) for r in runs).most_common(1)[0][1]
print(f"-- the same plan in {most(0)} of {len(runs)} runs; the same micro-batch and precision in {most(1)} of {len(runs)}")
PY
  done
done
