#!/usr/bin/env bash
# Two runs started at once with --save on one folder, PAIRS times (#52's
# measure): the runs train MLPs of different widths, so a folder that mixes
# them has a model.json whose width its checkpoint.pt does not resume into.
# Prints, per pair, both exit codes and the refusal, then how many folders
# were mixed, held no checkpoint, or kept a lock file.
# Usage: bash scripts/concurrent-saves.sh [MEMFIT_BINARY] [PAIRS]
set -u
bin=${1:-build/memfit}
pairs=${2:-20}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mixed=0 empty=0 locks=0 both_ran=0
run() {  # run WIDTH: a short run saving to the shared folder
  "$bin" train --model mlp --width "$1" --depth 1 --batch 32 --steps 3 --no-eval -q --threads 1 \
    --save "$tmp/ck" >"$tmp/out$1" 2>"$tmp/err$1"
  echo $? >"$tmp/rc$1"
}
for pair in $(seq 1 "$pairs"); do
  rm -rf "$tmp/ck"
  run 16 & run 24 & wait
  rc16=$(cat "$tmp/rc16") rc24=$(cat "$tmp/rc24")
  [ "$rc16" -eq 0 ] && [ "$rc24" -eq 0 ] && both_ran=$((both_ran + 1))
  why=$(cat "$tmp/err16" "$tmp/err24" | grep -o 'in use by another run\|holds another run.s checkpoint' | head -1)
  width=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['width'])" "$tmp/ck/model.json" 2>/dev/null)
  state=whole
  if [ ! -f "$tmp/ck/checkpoint.pt" ] || [ -z "$width" ]; then
    state="no checkpoint"; empty=$((empty + 1))
  elif ! "$bin" train --model mlp --width "$width" --depth 1 --batch 32 --steps 3 --no-eval -q --threads 1 \
         --resume "$tmp/ck" >/dev/null 2>&1; then
    state="mixed"; mixed=$((mixed + 1))
  fi
  [ -e "$tmp/ck/.memfit.lock" ] && locks=$((locks + 1))
  echo "pair $pair: exits $rc16 (width 16) and $rc24 (width 24), ${why:-no refusal}; folder: $state (width ${width:-?})"
done
echo "pairs $pairs, mixed folders $mixed, folders without a checkpoint $empty, both runs saved $both_ran," \
     "lock files left $locks"
