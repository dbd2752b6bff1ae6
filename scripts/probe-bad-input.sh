#!/usr/bin/env bash
# Probes of careless and hostile input, by class: prints each probe as
# handled or not, and a count per class. Run against any memfit binary to
# compare builds: bash scripts/probe-bad-input.sh build/memfit
# Classes data .. signal are #20's; plan .. empty are #52's (hand-edited
# files, outputs over inputs, concurrent runs, ranks, the environment).
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
  # shellcheck disable=SC2086  # PENV: variables for this probe, split on spaces
  timeout -s KILL 120 env ${PENV:-} "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
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

# ---- #52: hand-edited plan files ----
timeout 120 "$bin" plan --model mlp --width 8 --depth 1 --batch 64 --budget 1MiB --save "$tmp/p.json" >/dev/null 2>&1
# edit NAME PYTHON: $tmp/p-NAME.json, the plan with `j` changed by PYTHON.
edit() {
  python3 -c "import json, sys; j = json.load(open(sys.argv[1])); $2; json.dump(j, open(sys.argv[2], 'w'))" \
    "$tmp/p.json" "$tmp/p-$1.json"
}
planned=(train "${small[@]}" --steps 1 --batch 64)
edit precision "j['settings']['precision'] = 7"
probe plan precision-7 2 'p-precision.json is damaged: "precision" is 7' -- "${planned[@]}" --plan "$tmp/p-precision.json"
edit micro "j['settings']['micro_batch'] = -3"
probe plan micro-batch-negative 2 'p-micro.json is damaged' -- "${planned[@]}" --plan "$tmp/p-micro.json"
edit micro-text "j['settings']['micro_batch'] = 'eight'"
probe plan micro-batch-text 2 'p-micro-text.json is damaged: "micro_batch" is string' -- "${planned[@]}" --plan "$tmp/p-micro-text.json"
edit offload "j['settings']['offload_optimizer'] = 9"
probe plan offload-9 2 'p-offload.json is damaged' -- "${planned[@]}" --plan "$tmp/p-offload.json"
edit fits "del j['fits']"
probe plan field-missing 2 'p-fits.json is damaged: "fits" is missing' -- "${planned[@]}" --plan "$tmp/p-fits.json"
edit budget "j['budget'] = -1"
probe plan budget-negative 2 'p-budget.json is damaged' -- "${planned[@]}" --plan "$tmp/p-budget.json"
edit format "j['format'] = 'memfit.module_plan.v9'"
probe plan format-v9 2 'p-format.json' -- "${planned[@]}" --plan "$tmp/p-format.json"
python3 -c "import sys; open(sys.argv[1], 'w').write('[' * 100000 + ']' * 100000)" "$tmp/p-deep.json"
probe plan nested-deep 2 'p-deep.json is damaged: it nests deeper than' -- "${planned[@]}" --plan "$tmp/p-deep.json"
: >"$tmp/p-empty.json"
probe plan empty-file 2 'p-empty.json' -- "${planned[@]}" --plan "$tmp/p-empty.json"
probe plan other-model 2 'another model' -- train --model mlp --width 16 --depth 1 --no-eval -q --steps 1 --batch 64 \
  --plan "$tmp/p.json"
probe plan other-optimizer 2 'optimizer' -- "${planned[@]}" --plan "$tmp/p.json" --optimizer sgd
probe plan other-batch 2 'batch' -- train "${small[@]}" --steps 1 --batch 32 --plan "$tmp/p.json"

# ---- #52: reports given to memfit report ----
timeout 120 "$bin" train "${small[@]}" --steps 2 --report "$tmp/r.json" >/dev/null 2>&1
# redit NAME PYTHON: $tmp/r-NAME.json, the report with `j` changed.
redit() {
  python3 -c "import json, sys; j = json.load(open(sys.argv[1])); $2; json.dump(j, open(sys.argv[2], 'w'))" \
    "$tmp/r.json" "$tmp/r-$1.json"
}
redit steps "j['steps'] = 'many'"
probe report steps-not-a-list 2 'not a memfit run report' -- report "$tmp/r-steps.json" -o "$tmp/r.html"
redit peak "j['summary']['peak_bytes'] = 'big'"
probe report peak-is-text 2 'summary "peak_bytes" is string' -- report "$tmp/r-peak.json" -o "$tmp/r.html"
redit step "j['steps'][0]['peak_bytes'] = 'big'"
probe report step-peak-is-text 2 '"steps" entry 0: "peak_bytes" is string, not a number' -- report "$tmp/r-step.json" -o "$tmp/r.html"
probe report a-plan-file 2 'not a memfit run report' -- report "$tmp/p.json" -o "$tmp/r.html"
head -c 300 "$tmp/r.json" >"$tmp/r-cut.json"
probe report truncated 2 'not a memfit run report' -- report "$tmp/r-cut.json" -o "$tmp/r.html"

# ---- #52: checkpoints ----
timeout 120 "$bin" train "${small[@]}" --steps 2 --save "$tmp/ck2" >/dev/null 2>&1
cp -r "$tmp/ck2" "$tmp/ck-flip" && printf '\x55' | dd of="$tmp/ck-flip/checkpoint.pt" bs=1 seek=200 conv=notrunc 2>/dev/null
probe checkpoint byte-flipped 2 'checkpoint.pt is damaged' -- train "${small[@]}" --steps 3 --resume "$tmp/ck-flip"
cp -r "$tmp/ck2" "$tmp/ck-cut" && truncate -s 1000 "$tmp/ck-cut/checkpoint.pt"
probe checkpoint truncated 2 'checkpoint.pt' -- train "${small[@]}" --steps 3 --resume "$tmp/ck-cut"
cp -r "$tmp/ck2" "$tmp/ck-empty" && : >"$tmp/ck-empty/checkpoint.pt"
probe checkpoint empty 2 'checkpoint.pt' -- train "${small[@]}" --steps 3 --resume "$tmp/ck-empty"
probe checkpoint other-width 2 'width|shape|model' -- train --model mlp --width 16 --depth 1 --no-eval -q --steps 3 \
  --resume "$tmp/ck2"
probe checkpoint folder-missing 2 'resume' -- train "${small[@]}" --steps 3 --resume "$tmp/nothing-here"
timeout 120 "$bin" train "${small[@]}" --steps 1 --resume "$tmp/ck2" >"$tmp/out" 2>"$tmp/err"
rc=$?
record checkpoint steps-already-done "$([ "$rc" -eq 0 ] && grep -q 'nothing left to train' "$tmp/out" && [ ! -s "$tmp/err" ] \
  && echo 1 || echo 0)" "exit $rc: $(grep -o 'the run is complete.*' "$tmp/out")"

# ---- #52: outputs over inputs and each other ----
probe clash report-onto-plan 2 'also an input|is the --plan' -- "${planned[@]}" --plan "$tmp/p.json" --report "$tmp/p.json"
probe clash report-onto-checkpoint 2 'checkpoint.pt' -- train "${small[@]}" --steps 1 --save "$tmp/ck3" \
  --report "$tmp/ck3/checkpoint.pt"
probe clash report-onto-resumed 2 'checkpoint.pt' -- train "${small[@]}" --steps 3 --resume "$tmp/ck2" \
  --report "$tmp/ck2/checkpoint.pt"
mkdir -p "$tmp/data" && cp /usr/share/datasets/fashion-mnist/*.gz "$tmp/data/"
probe clash report-onto-data 2 'input' -- train "${small[@]}" --steps 1 --data "$tmp/data" \
  --report "$tmp/data/train-labels-idx1-ubyte.gz"
probe clash plan-save-onto-torchscript 2 'input' -- plan --torchscript "$tmp/p.json" --budget 1MiB --save "$tmp/p.json"
probe clash new-run-over-a-checkpoint 2 "holds another run's checkpoint" -- train "${small[@]}" --steps 1 --save "$tmp/ck2"

# ---- #52: concurrent runs on one folder ----
cp -r "$tmp/ck2" "$tmp/held"  # a folder with a checkpoint, resumed and saved by the holder
"$bin" train "${small[@]}" --steps 1000000 --resume "$tmp/held" --save "$tmp/held" >"$tmp/held.out" 2>&1 &
holder=$!
for _ in $(seq 1 600); do grep -q 'memfit train: model' "$tmp/held.out" && break; sleep 0.05; done
probe concurrent second-writer 2 'in use by another run' -- train "${small[@]}" --steps 1 --save "$tmp/held" \
  --resume "$tmp/held"
probe concurrent resume-a-held-folder 2 'in use by another run' -- train "${small[@]}" --steps 3 --resume "$tmp/held" \
  --save "$tmp/held"
kill -TERM "$holder"; wait "$holder"
record concurrent holder-saved-on-sigterm "$([ -f "$tmp/held/checkpoint.pt" ] && echo 1 || echo 0)" "after the refused runs"

# ---- #52: ranks and the environment ----
PENV="RANK=5 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29501" probe env rank-not-in-world 2 'RANK' -- \
  train "${small[@]}" --steps 1
PENV="RANK=0 WORLD_SIZE=0" probe env world-size-zero 2 'WORLD_SIZE' -- train "${small[@]}" --steps 1
PENV="RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=http" probe env master-port-text 2 'MASTER_PORT' -- \
  train "${small[@]}" --steps 1
# libgomp says its own line about it before main: memfit's is the only other.
timeout 120 env OMP_NUM_THREADS=many "$bin" train "${small[@]}" --steps 1 >"$tmp/out" 2>"$tmp/err"
rc=$?
record env omp-threads-text "$([ "$rc" -eq 2 ] && [ "$(grep -vc '^libgomp\|^$' "$tmp/err")" -eq 1 ] && \
  grep -q "OMP_NUM_THREADS='many' is not a number of threads" "$tmp/err" && echo 1 || echo 0)" "exit $rc"
PENV="MEMFIT_CACHE_DIR=$tmp/p.json" probe env cache-dir-is-a-file 1 'set MEMFIT_CACHE_DIR to a writable folder' -- \
  train "${small[@]}" --steps 1
timeout 120 env -u HOME -u MEMFIT_CACHE_DIR TMPDIR="$tmp" "$bin" train "${small[@]}" --steps 1 >"$tmp/out" 2>"$tmp/err"
record env no-home "$([ $? -eq 0 ] && grep -q 'MEMFIT_CACHE_DIR' "$tmp/err" && echo 1 || echo 0)" "$(head -c 150 "$tmp/err")"
timeout 120 "$bin" launch --nproc 2 --master-port 29513 -- sh -c \
  "exec '$bin' train ${small[*]} --steps 2 --threads 1 --batch \$((8 + 8 * RANK))" >"$tmp/out" 2>"$tmp/err"
rc=$?
record env ranks-disagree "$([ "$rc" -eq 2 ] && grep -q "the ranks disagree" "$tmp/err" && echo 1 || echo 0)" "exit $rc"

# ---- #52: empty strings ----
for flag in --report --save --resume --plan --data --torchscript; do
  probe empty "train$flag" 2 "${flag#--}" -- train "${small[@]}" --steps 1 "$flag" ""
done
probe empty plan--save 2 'save' -- plan --model mlp --budget 1MiB --save ""
probe empty report--output 2 'output must name a file' -- report "$tmp/r.json" -o ""

# ---- #52: signals other than SIGINT ----
for sig in TERM:15 HUP:1; do
  "$bin" train "${small[@]}" --steps 1000000 --save "$tmp/sig-${sig%%:*}" >"$tmp/sig.out" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do grep -q 'memfit train: model' "$tmp/sig.out" && break; sleep 0.05; done
  sleep 1; kill -"${sig%%:*}" "$pid"; wait "$pid"; rc=$?
  record signal "sig${sig%%:*}-saves" "$([ "$rc" -eq $((128 + ${sig##*:})) ] && [ -f "$tmp/sig-${sig%%:*}/checkpoint.pt" ] && \
    echo 1 || echo 0)" "exit $rc"
done

echo
for class in data output number exit resume signal plan report checkpoint clash concurrent env empty; do echo "$class: ${ok[$class]:-0} of ${total[$class]:-0} handled"; done
