#!/usr/bin/env bash
# Fuzzing the CLI (#20): random combinations of flags, each value drawn from
# the flag's domain or just outside it, for at most FUZZ_CASES cases and
# FUZZ_SECONDS seconds (seeded by FUZZ_SEED, so a failure reproduces). Every
# case must exit 0, 1 or 2 within its time (no crash, no hang), say a usage
# error (2) in one line, leave no temporary file, and change no file it was
# not asked to write.
# Usage: MEMFIT=path/to/memfit bash tests/cli_fuzz.sh
set -u
bin=${MEMFIT:?set MEMFIT to the memfit binary}
cases=${FUZZ_CASES:-60}
budget=${FUZZ_SECONDS:-240}
RANDOM=${FUZZ_SEED:-20}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export MEMFIT_CACHE_DIR="$tmp/cache"

# Inputs the cases may read but never write: a saved run, a damaged data
# folder, a text file; their checksums are compared after every case. The
# outputs a case may name lie in out/, or are a FIFO, a device, a folder or
# one of these inputs, which must be refused.
mkdir -p "$tmp/in/bad" "$tmp/out"
mkfifo "$tmp/out/fifo"  # an output that is not a regular file
device=/dev/null  # a device node of our own where we may make one (as root)
mknod "$tmp/null" c 1 3 2>/dev/null && device="$tmp/null"
"$bin" train --model mlp --width 8 --depth 1 --steps 1 --no-eval -q --save "$tmp/in/run" >/dev/null 2>&1 ||
  { echo "FAIL setup: could not save a run"; exit 1; }
for f in /usr/share/datasets/fashion-mnist/*.gz; do head -c 2000 "$f" >"$tmp/in/bad/$(basename "$f")"; done
echo "not a model" >"$tmp/in/note.txt"
sums() { find "$tmp/in" -type f -exec md5sum {} + | sort; }
before=$(sums)

# Each flag's domain: values inside, then values just outside.
declare -A domain=(
  [--model]="mlp resnet gpt vgg ''"
  [--width]="8 0 -1 65537 1e3 x"
  [--depth]="1 0 -2 4097"
  [--heads]="2 3 0 4097"
  [--context]="16 0 65537"
  [--batch]="1 16 0 -1 16777217 99999999999999999999 2.5"
  [--steps]="1 2 0 -1 99999999999999999999999 x"
  [--epochs]="0 -1 1000001 9223372036854775807"
  [--lr]="0.01 0 -1 nan inf 1e39"
  [--optimizer]="sgd adam adamw lbfgs"
  [--seed]="0 7 -1 18446744073709551616"
  [--budget]="64MiB 2MiB 1KiB 0 -1 12XB 1e400GiB"
  [--checkpoint]="none sqrt every:2 uniform:3 every:0 uniform:99999999999999 optimal revolve"
  [--checkpoint-budget]="4MiB 0 x"
  [--precision]="fp32 bf16 fp16 auto fp8"
  [--master-weights]="none host device gpu"
  [--device]="cpu cuda cuda:9 tpu"
  [--clip-grad-norm]="1 0 -1 nan"
  [--micro-batch]="0 4 -1 16777217"
  [--offload]="optimizer optimizer,gradients optimizer,gradients,parameters gradients parameters gpu"
  [--offload-tile]="8KiB 0 x"
  [--threads]="0 1 4097"
  [--eval-batch]="64 0"
  [--save-every]="1 0"
  [--report]="$tmp/out/r.json $device $tmp/missing/r.json $tmp/in $tmp/out/fifo"
  [--save]="$tmp/out/ck $device $tmp/in/note.txt $tmp/out/fifo"
  [--resume]="$tmp/in/run $tmp/none $tmp/in/note.txt"
  [--data]="/usr/share/datasets/fashion-mnist $tmp/in/bad $tmp/none"
  [--freeze]="fc0.* nothing*"
  [--plan]="auto none x"
  [--torchscript]="$tmp/in/note.txt $tmp/none"
  [--no-eval]="FLAG"
  [--selective-recompute]="FLAG"
)
flags=("${!domain[@]}")
plan_flags=(--model --width --depth --batch --budget --precision --device --threads --optimizer)

pick() { local a=($1); echo "${a[RANDOM % ${#a[@]}]}"; }
source "$(dirname "$0")/fuzz_case.sh"

passed=0 failed=0 start=$SECONDS
declare -a codes
for n in $(seq 1 "$cases"); do
  [ $((SECONDS - start)) -ge "$budget" ] && break
  case $((RANDOM % 10)) in
    0) args=(plan) ;; 1) args=(find-batch --no-verify) ;; *) args=(train -q) ;;
  esac
  k=$((1 + RANDOM % 4))
  for _ in $(seq 1 "$k"); do
    if [ "${args[0]}" = train ]; then f=${flags[RANDOM % ${#flags[@]}]}; else f=${plan_flags[RANDOM % ${#plan_flags[@]}]}; fi
    [[ " ${args[*]} " == *" $f "* ]] && continue
    v=$(pick "${domain[$f]}")
    if [ "$v" = FLAG ]; then args+=("$f"); else args+=("$f" "$v"); fi
  done
  # Keep accepted runs short: a small model unless the case chose one, and one step.
  [[ " ${args[*]} " == *" --steps "* || " ${args[*]} " == *" --epochs "* || "${args[0]}" != train ]] ||
    args+=(--steps 1)
  [[ " ${args[*]} " == *" --model "* ]] || args+=(--model mlp)
  [[ " ${args[*]} " == *" --width "* ]] || args+=(--width 8)
  run_case "$tmp" "${args[@]}"
  if [ -n "$why" ]; then :
  elif [ "$(sums)" != "$before" ]; then why="changed an input"
  elif [ ! -c "$device" ]; then why="replaced the device $device"
  fi
  codes[$rc]=$(( ${codes[$rc]:-0} + 1 ))
  if [ -n "$why" ]; then
    echo "FAIL case $n: $why: memfit ${args[*]}"; sed 's/^/  | /' "$tmp/stderr" | tail -5
    failed=$((failed + 1))
    before=$(sums)  # one failure, not every later case
  else
    passed=$((passed + 1))
  fi
  rm -rf "$tmp/out" "$tmp/missing" && mkdir -p "$tmp/out" && mkfifo "$tmp/out/fifo"
done
echo "$passed passed, $failed failed (seed ${FUZZ_SEED:-20}, $((SECONDS - start)) s; exit 0: ${codes[0]:-0}, 1: ${codes[1]:-0}, 2: ${codes[2]:-0})"
[ "$failed" -eq 0 ]
