#!/usr/bin/env bash
# Probes of careless and hostile input (#20), by class: prints each probe as
# handled or not, and a count per class. Run against any memfit binary to
# compare builds: bash scripts/probe-bad-input.sh build/memfit
set -u
bin=$(realpath "${1:-build/memfit}")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export MEMFIT_CACHE_DIR="$tmp/cache"
declare -A ok total
small=(--model mlp --width 8 --depth 1 --no-eval -q)
# probe CLASS NAME EXPECTED_EXIT [grep PATTERN on stderr] -- ARGS: handled when
# the exit code matches, stderr is one line holding PATTERN, and (exit 2) no
# training output was printed.
probe() {
  local class=$1 name=$2 code=$3 pattern=$4
  shift 5
  timeout -s KILL 120 "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$? good=1
  [ "$rc" -eq "$code" ] || good=0
  grep -qE -- "$pattern" "$tmp/err" || good=0
  [ "$(wc -l <"$tmp/err")" -eq 1 ] || good=0
  [ "$code" -ne 2 ] || [ ! -s "$tmp/out" ] || good=0
  record "$class" "$name" "$good" "exit $rc: $(head -c 150 "$tmp/err" | tr '\n' ' ')"
}
record() {
  total[$1]=$(( ${total[$1]:-0} + 1 )); ok[$1]=$(( ${ok[$1]:-0} + $3 ))
  printf '%-8s %-34s %s  %s\n' "$1" "$2" "$([ "$3" -eq 1 ] && echo handled || echo NOT)" "$4"
}

mkdir -p "$tmp/cut" "$tmp/junk" "$tmp/raw"
for f in /usr/share/datasets/fashion-mnist/*.gz; do
  b=$(basename "$f"); head -c 3000 "$f" >"$tmp/cut/$b"; head -c 5000 /dev/urandom | gzip -c >"$tmp/junk/$b"
  echo "plain text" >"$tmp/raw/$b"
done
probe data truncated-gz 1 'cut/train-images.*damaged' -- train "${small[@]}" --steps 1 --data "$tmp/cut"
probe data gzipped-garbage 1 'junk/train-images.*damaged' -- train "${small[@]}" --steps 1 --data "$tmp/junk"
probe data not-gzip 1 'raw/train-images.*damaged' -- train "${small[@]}" --steps 1 --data "$tmp/raw"
timeout 120 "$bin" train "${small[@]}" --steps 1 >/dev/null 2>&1
record data good-run-after-bad "$([ $? -eq 0 ] && echo 1 || echo 0)" "the default data trains after damaged ones"

probe output report-missing-folder 2 'does not exist' -- train "${small[@]}" --steps 1 --report "$tmp/no/r.json"
# A device node of our own (as root): an old build would replace it, and
# must not replace the machine's /dev/null.
mknod "$tmp/null" c 1 3 2>/dev/null || { echo "run as root to probe a device node"; touch "$tmp/null"; }
probe output report-to-device 2 'character device' -- train "${small[@]}" --steps 1 --report "$tmp/null"
probe output report-to-folder 2 'directory' -- train "${small[@]}" --steps 1 --report "$tmp"
echo '{}' >"$tmp/run.json"
probe output report-onto-its-input 2 'also an input' -- report "$tmp/run.json" -o "$tmp/run.json"
mkfifo "$tmp/fifo"
probe output report-to-fifo 2 'FIFO' -- report "$tmp/run.json" -o "$tmp/fifo"
probe output save-into-a-file 2 'not a folder' -- train "${small[@]}" --steps 1 --save "$tmp/run.json/ck"
echo old >"$tmp/target.json" && ln -s target.json "$tmp/link.json"
timeout 120 "$bin" train "${small[@]}" --steps 1 --report "$tmp/link.json" >/dev/null 2>&1
record output report-through-link "$([ -L "$tmp/link.json" ] && grep -q summary "$tmp/target.json" && echo 1 || echo 0)" "link kept, target written"

probe number batch-zero 2 '^memfit train: error: --batch must be a positive integer' -- train --batch 0
probe number batch-huge 2 '--batch must be' -- train --batch 99999999999999999999
probe number steps-huge 2 '--steps must be' -- train --steps 99999999999999999999999
probe number epochs-huge 2 '--epochs must be' -- train --epochs 9223372036854775807
probe number checkpoint-k-huge 2 'checkpoint' -- train --checkpoint every:99999999999999999999
probe number lr-nan 2 '--lr' -- train --lr nan
probe number threads-huge 2 '--threads' -- train --threads 100000
probe number seed-negative 2 '--seed' -- train --seed -1
probe number model-too-big 2 'memory' -- train --model mlp --width 65536 --depth 64

probe exit device-tpu 2 'tpu' -- train --device tpu
probe exit heads-3 2 'heads' -- train --model gpt --heads 3
probe exit offload-gradients-alone 2 'optimizer,gradients' -- train --offload gradients
probe exit fp16-on-cpu 2 'fp16' -- train --precision fp16
probe exit budget-0-train 2 '--budget must be positive' -- train --budget 0
probe exit budget-0-plan 2 '--budget must be positive' -- plan --budget 0
probe exit budget-0-find-batch 2 '--budget must be positive' -- find-batch --budget 0

timeout 120 "$bin" train "${small[@]}" --steps 2 --save "$tmp/ck" >/dev/null 2>&1
probe resume other-optimizer 2 'optim::Adam.*optim::SGD' -- train "${small[@]}" --steps 3 --resume "$tmp/ck" --optimizer sgd
probe resume other-batch 2 '--batch 64.*32' -- train "${small[@]}" --steps 3 --resume "$tmp/ck" --batch 32
probe resume other-precision 2 '--precision fp32.*bf16' -- train "${small[@]}" --steps 3 --resume "$tmp/ck" --precision bf16

"$bin" train "${small[@]}" --steps 1000000 --save "$tmp/sig" >"$tmp/sig.out" 2>&1 &
pid=$!
for _ in $(seq 1 600); do grep -q 'memfit train: model' "$tmp/sig.out" && break; sleep 0.05; done
sleep 1; kill -INT "$pid"; wait "$pid"; rc=$?
record signal sigint-saves "$([ "$rc" -eq 130 ] && [ -f "$tmp/sig/checkpoint.pt" ] && echo 1 || echo 0)" "exit $rc"
orphans=0
for _ in $(seq 1 10); do
  "$bin" launch --nproc 2 --grace 1 -- bash -c 'sleep 3019 & sleep 3019; wait' >/dev/null 2>&1 &
  pid=$!; sleep 1; kill -TERM "$pid"; wait "$pid"
done
sleep 0.5
orphans=$(pgrep -fc 'sleep 3019'); pkill -f 'sleep 3019'
record signal launcher-sigterm-x10 "$([ "$orphans" -eq 0 ] && echo 1 || echo 0)" "$orphans orphans"

echo
for class in data output number exit resume signal; do echo "$class: ${ok[$class]:-0} of ${total[$class]:-0} handled"; done
