#!/usr/bin/env bash
# CLI behaviour of `memfit`: help, exit codes and one-line errors.
# Usage: MEMFIT=path/to/memfit bash tests/cli_test.sh
set -u
bin=${MEMFIT:?set MEMFIT to the memfit binary}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0

# expect NAME CODE PATTERN_IN_STREAM STREAM -- ARGS...
# (one_line=0 expect ...: a usage error said by several processes, as under launch)
expect() {
  local name=$1 code=$2 pattern=$3 stream=$4
  shift 5
  "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  local text
  text=$(cat "$tmp/$stream")
  if [ "$rc" -ne "$code" ]; then
    echo "FAIL $name: exit $rc, expected $code"; sed 's/^/  | /' "$tmp/out" "$tmp/err" | tail -20
    failed=$((failed + 1)); return
  fi
  if ! grep -qiE -- "$pattern" "$tmp/$stream"; then
    echo "FAIL $name: $stream lacks /$pattern/"; sed 's/^/  | /' "$tmp/$stream" | tail -20
    failed=$((failed + 1)); return
  fi
  if [ "$code" -eq 2 ] && [ "${one_line:-1}" -eq 1 ] && [ "$(wc -l <"$tmp/err")" -ne 1 ]; then
    echo "FAIL $name: usage errors are one line, got:"; sed 's/^/  | /' "$tmp/err"
    failed=$((failed + 1)); return
  fi
  echo "ok   $name"
  passed=$((passed + 1))
}

# check NAME CONDITION...: records a check that is not one memfit call.
check() {
  local name=$1
  shift
  if "$@"; then echo "ok   $name"; passed=$((passed + 1)); else echo "FAIL $name"; failed=$((failed + 1)); fi
}
lacks() { ! grep -q -- "$1" "$2"; }  # lacks PATTERN FILE

expect help 0 'train' out -- --help
# One `train --help` (each memfit process spends about 0.6 s loading LibTorch),
# then every flag is looked up in what it printed.
expect train-help 0 'Usage' out -- train --help
cp "$tmp/out" "$tmp/train-help"
for flag in --model --width --depth --batch --steps --epochs --lr --optimizer --seed --budget \
            --data --report --eval-batch --no-eval --quiet --threads --checkpoint \
            --checkpoint-budget --offload-checkpoints --precision --master-weights --device --clip-grad-norm --skip-nonfinite \
            --micro-batch --prefetch-factor --freeze --offload --offload-tile --save --save-every --resume --plan --dist-timeout \
            --zero-stage --parallel --chunks --schedule --heads --context --dropout --selective-recompute --text \
            --torchscript --on-out-of-memory --budget-change --restore-after; do
  check "train-help-documents$flag" grep -q -- "$flag" "$tmp/train-help"
done
expect version 0 'memfit 0\.' out -- --version
expect no-subcommand 2 'subcommand' err --
expect unknown-flag 2 'bogus' err -- train --bogus
expect malformed-size 2 "12XB.*512MiB" err -- train --budget 12XB
expect negative-size 2 'budget' err -- train --budget -1GiB
expect zero-batch 2 'batch' err -- train --batch 0
expect negative-batch 2 'batch' err -- train --batch -5
expect unknown-model 2 'vgg' err -- train --model vgg
expect steps-and-epochs 2 'excludes' err -- train --steps 3 --epochs 1
expect bad-checkpoint 2 "revolve.*every:K" err -- train --checkpoint revolve
expect checkpoint-every-needs-k 2 'every:K' err -- train --checkpoint every
expect optimal-needs-budget 2 'checkpoint-budget' err -- train --checkpoint optimal
expect optimal-impossible-budget 1 'most frugal schedule needs' err -- \
  train --model resnet --width 4 --steps 1 --no-eval -q --checkpoint optimal --checkpoint-budget 1KiB
expect checkpointed-run 0 'checkpoint schedule: \[0,4\)\* \[4,8\)\* \[8,12\)' out -- \
  train --model resnet --width 4 --steps 3 --batch 16 --no-eval -q --checkpoint sqrt --offload-checkpoints
expect optimal-run 0 'checkpoint schedule: .*\*' out -- \
  train --model resnet --width 4 --steps 3 --batch 16 --no-eval -q --checkpoint optimal \
  --checkpoint-budget 3MiB
expect bad-precision 2 'precision.*fp8' err -- train --precision fp8
expect master-weights-need-precision 2 'precision bf16' err -- train --master-weights host
expect bad-device 2 "invalid device 'tpu'.*cpu, cuda or cuda:N" err -- train --device tpu --steps 1
expect bf16-run 0 'precision bf16, parameters in bf16 with fp32 master weights on the host' out -- \
  train --model resnet --width 4 --steps 3 --batch 16 --no-eval -q --precision bf16 --master-weights host
# bf16 alone on a CPU that computes it through LibTorch's fallback kernels is
# warned about, in one line, and only there.
if grep -qw avx512_bf16 /proc/cpuinfo; then
  check bf16-run-no-warning-on-native-bf16 lacks 'without AVX-512 BF16' "$tmp/err"
else
  check bf16-run-warns-without-native-bf16 grep -q \
    '^memfit: warning: bf16 on a CPU without AVX-512 BF16: .*--precision any times both' "$tmp/err"
fi
version=$("$bin" --version)
if [[ "$version" == *"LibTorch 1."* ]]; then
  expect fp16-on-cpu-refused 2 'fp16 compute is not available on the CPU.*--precision bf16' err -- \
    train --precision fp16 --steps 1 --no-eval -q
fi
if [[ "$version" == *"CPU only"* ]]; then
  expect cuda-on-cpu-build 2 'no CUDA device.*--device cpu' err -- train --device cuda --steps 1
fi
expect negative-clip 2 'clip-grad-norm' err -- train --clip-grad-norm -1
expect nan-loss-names-the-step 1 'step [0-9]+ \(epoch 0\): the loss is (NaN|inf|-inf);.*--skip-nonfinite' err -- \
  train --model mlp --width 8 --depth 1 --steps 5 --lr 1e38 --optimizer sgd --no-eval -q
expect clipped-run 0 'final loss' out -- \
  train --model mlp --width 8 --depth 1 --steps 3 --clip-grad-norm 0.5 --no-eval -q
expect missing-data 1 'dataset-fashion-mnist' err -- train --data "$tmp/none" --steps 1

# Hostile input (#20): every usage error exits 2 in one line before any work
# (nothing on stdout), numbers have bounds, outputs are checked first.
usage() {  # usage NAME PATTERN ARGS...: exit 2, the pattern in one line, no work done
  local name=$1 pattern=$2
  shift 2
  expect "$name" 2 "$pattern" err -- "$@"
  if [ -s "$tmp/out" ]; then echo "FAIL $name-before-work: stdout is not empty"; failed=$((failed + 1)); fi
}
usage empty--data '--data must name a folder, got an empty string' train --data "" --steps 1
# The job's variables are input too: refused before any work, exit 2.
RANK=5 WORLD_SIZE=2 usage env-rank-not-in-world "environment variable RANK='5' is not an integer in \[0, 1\]" train --steps 1
# libgomp says its own line about it first (one_line=0); memfit's line is the refusal.
OMP_NUM_THREADS=many one_line=0 expect env-omp-threads-text 2 \
  "^memfit train: error: OMP_NUM_THREADS='many' is not a number of threads" err -- train --steps 1
OMP_NUM_THREADS=many expect env-omp-threads-text-with-threads 0 'final loss' out -- \
  train --model mlp --width 8 --depth 1 --no-eval -q --steps 1 --threads 1
usage huge-batch '--batch must be a positive integer of at most 16777216, got 9999' train --batch 99999999999999999999
usage huge-epochs '--epochs must be a positive integer of at most' train --epochs 9223372036854775807
usage huge-steps '--steps must be a positive integer' train --steps 99999999999999999999999
usage nan-lr '--lr must be a number in \(0, 3.4e\+38\], got nan' train --lr nan
usage inf-lr '--lr must be a number' train --lr inf
usage nan-clip '--clip-grad-norm must be' train --clip-grad-norm nan
usage huge-checkpoint-k 'below 10\^9' train --checkpoint every:99999999999999999999999
usage huge-threads '--threads must be an integer from 0 to 4096' train --threads 99999
usage negative-seed '--seed must be an integer' train --seed -1
usage fraction-batch '--batch must be a positive integer' train --batch 2.5
for command in train plan find-batch; do  # a zero budget means the same everywhere
  usage "zero-budget-$command" '--budget must be positive, e.g. 64MiB, got 0' $command --budget 0
done
usage model-too-big "its parameters alone need more than a quarter of this machine's" \
  train --model mlp --width 65536 --depth 64
usage plan-model-too-big "choose a smaller --width or --depth" plan --model mlp --width 65536 --depth 64 --budget 1GiB
usage report-folder-missing "cannot write $tmp/missing/r.json: the folder $tmp/missing does not exist" \
  train --model mlp --steps 1 --report "$tmp/missing/r.json"
# A device node of our own when we may make one (as root): a regression must
# not replace the machine's /dev/null, which only root could.
device=/dev/null
mknod "$tmp/null" c 1 3 2>/dev/null && device="$tmp/null"
usage report-to-device 'it is a character device, and memfit replaces only regular files' \
  train --model mlp --steps 1 --report "$device"
check device-is-still-a-device test -c "$device"
usage report-to-folder 'it is a directory' train --model mlp --steps 1 --report "$tmp"
usage save-into-a-file "is a regular file, not a folder" train --model mlp --steps 1 --save /etc/hostname/ck
usage report-input-is-output 'is also an input of this command' report /etc/hostname -o /etc/hostname
mkfifo "$tmp/fifo"
usage report-to-fifo 'it is a FIFO' report /etc/hostname -o "$tmp/fifo"
check fifo-is-still-a-fifo test -p "$tmp/fifo"
usage plan-device 'invalid device' plan --model mlp --budget 1GiB --device tpu
usage train-precision-any-unplanned '--precision any lets the plan choose the precision.*add --budget SIZE' \
  train --model mlp --precision any --steps 1
usage train-precision-any-by-hand '--precision any lets the plan choose' \
  train --model mlp --precision any --budget 1MiB --micro-batch 8 --steps 1
usage plan-measure-candidates '--measure-candidates must be an integer from 0 to 64, got -1' plan --model mlp --budget 1GiB --measure-candidates -1
# A report written through a symbolic link replaces the link's target and keeps the link.
echo old >"$tmp/target.json"
ln -s target.json "$tmp/link.json"
expect report-through-link 0 'report written' out -- train --model mlp --width 8 --depth 1 --steps 1 --no-eval -q \
  --report "$tmp/link.json"
check link-is-kept test -L "$tmp/link.json"
check link-target-written grep -q '"summary"' "$tmp/target.json"
# A temporary file left by a killed save is removed by the next save.
sleep 0 & dead=$!; wait "$dead"
mkdir -p "$tmp/stale" && echo torn >"$tmp/stale/checkpoint.pt.tmp.$dead"
expect save-after-a-kill 0 'checkpoint saved' out -- train --model mlp --width 8 --depth 1 --steps 1 --no-eval -q \
  --save "$tmp/stale"
check stale-temporary-removed test ! -e "$tmp/stale/checkpoint.pt.tmp.$dead"
expect threads-capped 0 'more than this machine.s [0-9]+ hardware threads; using' err -- \
  train --model mlp --width 8 --depth 1 --steps 1 --no-eval -q --threads 4096

# Damaged data is refused naming the file, and never poisons the cache that
# later runs on good data read.
export MEMFIT_CACHE_DIR="$tmp/cache"
mkdir -p "$tmp/cut"
for f in /usr/share/datasets/fashion-mnist/*.gz; do head -c 3000 "$f" >"$tmp/cut/$(basename "$f")"; done
expect truncated-data 1 "file $tmp/cut/train-images-idx3-ubyte.gz is damaged: its gzip stream is broken" err -- \
  train --model mlp --steps 1 --data "$tmp/cut"
for f in "$tmp"/cut/*.gz; do head -c 5000 /dev/urandom | gzip -c >"$f"; done
expect gzipped-garbage 1 "train-images-idx3-ubyte.gz is damaged: its IDX magic number is" err -- \
  train --model mlp --steps 1 --data "$tmp/cut"
expect good-data-after-bad 0 'final loss' out -- train --model mlp --width 8 --depth 1 --steps 1 --no-eval -q
unset MEMFIT_CACHE_DIR
expect over-budget 1 'out of memory.*tried to allocate' err -- \
  train --model mlp --budget 1MiB --steps 2 --no-eval -q --plan none --on-out-of-memory throw
expect over-budget-fixed 1 'the budget 1.00 MiB is smaller than the bytes no re-plan can move .*stream the parameters from the host \(--offload parameters; not here: parameters are streamed in fp32 only\)' err -- \
  train --model mlp --precision bf16 --budget 1MiB --steps 2 --no-eval -q --plan none
expect over-budget-recovered 0 'recovered from out of memory [0-9]+ times? .*micro-batches of' out -- \
  train --model mlp --width 64 --batch 256 --budget 1.3MiB --steps 2 --no-eval -q --plan none \
  --report "$tmp/recovered.json"
check over-budget-recovery-line grep -qE 'memfit train: step [0-9]+ ran out of memory .* re-planned to micro-batches of' "$tmp/err"
check over-budget-recovery-reported python3 -c 'import json, sys; j = json.load(open(sys.argv[1]))
r = j["recoveries"]; assert r and r[-1]["after"].startswith("micro-batches of"), r
assert j["summary"]["recoveries"] == len(r) and sum(s["replans"] for s in j["steps"]) == len(r), j["summary"]' \
  "$tmp/recovered.json"
# Only the optimizer state does not fit: it moves to the host, and the losses are the unbudgeted run's.
expect over-budget-offloaded 0 'recovered from out of memory 1 time .*the run ended with optimizer state on the host' out -- \
  train --model mlp --budget 7MiB --steps 3 --no-eval -q --plan none --report "$tmp/offloaded.json"
expect unbudgeted-for-offloaded 0 'final loss' out -- \
  train --model mlp --steps 3 --no-eval -q --plan none --report "$tmp/unbudgeted.json"
check over-budget-offloaded-same-losses python3 -c 'import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]], (a["steps"], b["steps"])' \
  "$tmp/offloaded.json" "$tmp/unbudgeted.json"
# Under 5 MiB the parameters and their gradients alone (5.11 MiB) do not fit: both move with the state.
expect over-budget-gradients-offloaded 0 'recovered from out of memory 1 time .*the run ended with optimizer state and gradients on the host' out -- \
  train --model mlp --budget 5MiB --steps 3 --no-eval -q --plan none --report "$tmp/gradients-offloaded.json"
check over-budget-gradients-offloaded-same-losses python3 -c 'import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]], (a["steps"], b["steps"])' \
  "$tmp/gradients-offloaded.json" "$tmp/unbudgeted.json"
# An MLP of eight small layers under 2 MiB: its parameters alone (2.53 MiB) do not fit; they are streamed,
# the first weight in tiles (it and its gradient take 1.53 MiB). Tiles promise 1e-5, not bitwise: one CI
# run's first loss came out one float32 ulp from the unbudgeted run's.
expect over-budget-streamed 0 'recovered from out of memory 1 time .*the run ended with optimizer state, gradients and parameters on the host' out -- \
  train --model mlp --width 256 --depth 8 --budget 2MiB --steps 3 --no-eval -q --plan none --report "$tmp/streamed.json"
expect unbudgeted-for-streamed 0 'final loss' out -- \
  train --model mlp --width 256 --depth 8 --steps 3 --no-eval -q --plan none --report "$tmp/unstreamed.json"
check over-budget-streamed-losses-within-1e-5 python3 -c 'import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
assert all(abs(x["loss"] - y["loss"]) <= 1e-5 for x, y in zip(a["steps"], b["steps"])), (a["steps"], b["steps"])' \
  "$tmp/streamed.json" "$tmp/unstreamed.json"
# The default MLP under 1 MiB: its first weight (1.53 MiB) and gradient fit only in tiles.
expect over-budget-tiled 0 'recovered from out of memory [0-9]+ times? .*the run ended with .*parameters on the host, streamed in tiles of 256.00 KiB' out -- \
  train --model mlp --budget 1MiB --steps 3 --no-eval -q --plan none --report "$tmp/tiled.json"
check over-budget-tiled-losses-within-1e-5 python3 -c 'import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
assert all(abs(x["loss"] - y["loss"]) <= 1e-5 for x, y in zip(a["steps"], b["steps"])), (a["steps"], b["steps"])' \
  "$tmp/tiled.json" "$tmp/unbudgeted.json"
# Eight 128-wide layers under 1 MiB: the parameters (849 KiB) fit, but not beside the first weight's
# gradient (392 KiB), which micro-batches and gradients sent to the host both make on the device: streamed at once.
expect over-budget-beside-gradient 0 'recovered from out of memory 1 time .*the run ended with .*parameters on the host, streamed in tiles' out -- \
  train --model mlp --width 128 --depth 8 --budget 1MiB --steps 2 --no-eval -q --plan none
# Evaluating under a budget the training fitted by streaming: the test set is read in smaller batches.
expect over-budget-evaluated 0 'test accuracy .*evaluated under no-grad in batches of [0-9]+' out -- \
  train --model mlp --budget 1.2MiB --steps 2 -q --plan none
expect on-out-of-memory-bad 2 'on-out-of-memory' err -- train --on-out-of-memory retry
expect over-budget-recomputed 0 "recovered from out of memory 1 time .*the run ended with recomputing '0' \\[0,4\\)\\*" out -- \
  train --model resnet --width 4 --batch 64 --budget 13MiB --steps 2 --no-eval -q --plan none
# A rehearsed drop after step 2, under the plain step's 1.67 MiB: the planned run re-plans from its step
# model once, and trains as the run without the drop (within 1e-5: micro-batches sum in another order).
expect budget-change-replanned 0 "recovered from out of memory 1 time .*\(the step model's choice\)" out -- \
  train --model mlp --width 64 --batch 256 --steps 4 --no-eval -q --budget 64MiB --budget-change 2:1.3MiB \
  --report "$tmp/changed.json"
check budget-change-said grep -q 'memfit train: after step 2 the budget is 1.30 MiB (--budget-change)' "$tmp/err"
expect budget-unchanged 0 'final loss' out -- \
  train --model mlp --width 64 --batch 256 --steps 4 --no-eval -q --budget 64MiB --report "$tmp/unchanged.json"
check budget-change-same-losses python3 -c 'import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
assert a["summary"]["recoveries"] == 1 and [s["replans"] for s in a["steps"]] == [0, 0, 1, 0], a["steps"]
assert all(abs(x["loss"] - y["loss"]) <= 1e-5 for x, y in zip(a["steps"], b["steps"])), (a["steps"], b["steps"])' \
  "$tmp/changed.json" "$tmp/unchanged.json"
# Lifted after step 4: two clean steps later the run takes its first settings back.
expect budget-change-restored 0 'recovered from out of memory [0-9]+ times? .*the run ended with no micro-batching' out -- \
  train --model mlp --width 64 --batch 256 --steps 8 --no-eval -q --plan none --budget-change 2:1.3MiB \
  --budget-change 4:none --restore-after 2
expect budget-change-kept 0 'recovered from out of memory [0-9]+ times? .*the run ended with micro-batches of' out -- \
  train --model mlp --width 64 --batch 256 --steps 8 --no-eval -q --plan none --budget-change 2:1.3MiB \
  --budget-change 4:none
expect budget-change-malformed 2 '--budget-change must be STEP:SIZE.*got 5 ' err -- train --budget-change 5
expect budget-change-zero-step 2 '--budget-change must be STEP:SIZE.*got 0:1MiB' err -- train --budget-change 0:1MiB
expect budget-change-bad-size 2 '--budget-change.*12XB' err -- train --budget-change 3:12XB
expect budget-change-twice 2 '--budget-change 3:1MiB and 3:2MiB both change the budget after step 3' err -- \
  train --budget-change 3:1MiB --budget-change 3:2MiB
expect restore-after-without-recovery 2 '--restore-after 2 takes back .*--on-out-of-memory throw' err -- \
  train --restore-after 2 --on-out-of-memory throw
expect over-budget-plan 1 'nothing fits 16.00 KiB .*tried micro-batches of 64 down to 1.*the closest predicted peak is .* \(micro-batch 1, fp32, offload .*parameters.*\).*less may fit with --precision any' err -- \
  train --model mlp --budget 16KiB --steps 2 --no-eval -q
# The default MLP's 2.55 MiB of parameters train in 1 MiB: streamed from the host in tiles.
expect streamed-plan 0 'peak memory .* of budget 1.00 MiB' out -- train --model mlp --budget 1MiB --steps 2 --no-eval
# Unplanned, the same MLP's parameters stay on the device until step 1's re-plan streams them: the line says so.
expect unplanned-stream-peak 0 'peak memory 2\.[0-9]+ MiB .* of budget 1\.00 MiB \(the model as built, until a re-plan moved it to the host; its steps peaked at [0-9.]+ (KiB|MiB)\)' out -- \
  train --model mlp --budget 1MiB --steps 2 --no-eval --plan none
expect streamed-plan-explains 0 'parameters in host memory, streamed to the device layer by layer' out -- \
  train --model mlp --budget 1MiB --steps 1 --no-eval
# fp32 fits no plan under 9 MiB, and the error names --precision any, which tries bf16 (below).
expect train-precision-fp32-misses 1 'fits 9.00 MiB.*less may fit with --precision any' err -- \
  train --model resnet --width 8 --depth 1 --batch 64 --budget 9MiB --steps 1 --no-eval --measure-candidates 0
# bf16 holds less only where the CPU computes bf16 natively (AVX-512 BF16,
# docs/precision.md); elsewhere LibTorch's fallback convolutions hold more,
# nothing fits, and the error shows that bf16 was tried.
if grep -qw avx512_bf16 /proc/cpuinfo; then
  expect train-precision-any 0 'precision bf16: autocast' out -- \
    train --model resnet --width 8 --depth 1 --batch 64 --budget 9MiB --precision any --steps 1 --no-eval \
    --measure-candidates 0
else
  expect train-precision-any 1 'nothing fits 9.00 MiB.*precision fp32, bf16' err -- \
    train --model resnet --width 8 --depth 1 --batch 64 --budget 9MiB --precision any --steps 1 --no-eval \
    --measure-candidates 0
fi
expect trains-and-evaluates 0 'test accuracy' out -- \
  train --model mlp --width 64 --depth 1 --steps 40 --batch 64 --budget 64MiB -q \
  --report "$tmp/report.json"
expect report-written 0 'report written' out -- \
  train --model mlp --width 16 --depth 1 --steps 2 -q --report "$tmp/r2.json"
if grep -q '"test_accuracy"' "$tmp/r2.json" && grep -q '"peak_bytes"' "$tmp/r2.json"; then
  echo "ok   report-has-summary"; passed=$((passed + 1))
else
  echo "FAIL report-has-summary"; failed=$((failed + 1))
fi
# The optimizer kernel: the one --version names runs by default and the report says so; loop on request;
# fused where LibTorch has none is a usage error.
if [[ "$version" == *"optimizer kernel: fused"* ]]; then
  check report-names-the-fused-kernel grep -q '"optimizer_kernel": "fused"' "$tmp/r2.json"
else
  check report-names-the-loop-kernel grep -q '"optimizer_kernel": "loop"' "$tmp/r2.json"
  expect optimizer-kernel-fused-without-kernels 2 'optimizer-kernel fused needs LibTorch 2.4.*auto or loop' err -- \
    train --model mlp --width 16 --depth 1 --steps 2 -q --optimizer-kernel fused
fi
expect optimizer-kernel-loop 0 'report written' out -- \
  train --model mlp --width 16 --depth 1 --steps 2 -q --no-eval --optimizer-kernel loop --report "$tmp/r3.json"
check report-names-the-loop-kernel-asked-for grep -q '"optimizer_kernel": "loop"' "$tmp/r3.json"
expect optimizer-kernel-unknown 2 'optimizer-kernel.*foreach' err -- train --optimizer-kernel foreach


# Micro-batching, freezing, offloading the optimizer.
small=(train --model mlp --width 32 --depth 1 --no-eval -q)
expect micro-batch-run 0 'batch 100 in micro-batches of 32' out -- "${small[@]}" --steps 2 --batch 100 --micro-batch 32
expect negative-micro-batch 2 'micro-batch' err -- train --micro-batch -1
# Reading ahead trains on the same batches with the same peak.
"$bin" "${small[@]}" --steps 3 >"$tmp/in_step" 2>&1
"$bin" "${small[@]}" --steps 3 --prefetch-factor 2 >"$tmp/ahead" 2>&1
loss_and_peak() { grep -E '^(final loss|peak memory)' "$1" | cut -d'|' -f1; }
in_step=$(loss_and_peak "$tmp/in_step")
check prefetch-same-loss-and-peak test "$(echo "$in_step" | wc -l)" -eq 2 -a "$in_step" = "$(loss_and_peak "$tmp/ahead")"
expect negative-prefetch 2 'prefetch-factor must be an integer from 0 to 64, got -1' err -- train --prefetch-factor -1
expect freeze-run 0 'parameters, 25120 frozen' out -- "${small[@]}" --steps 2 --freeze 'fc0.*'
expect freeze-no-match 2 "pattern 'layer9.\*' matches no parameter name; names look like: fc0.weight" err -- \
  "${small[@]}" --steps 1 --freeze 'layer9.*'
expect offload-optimizer-run 0 'optimizer state +0 bytes' out -- "${small[@]}" --steps 2 --offload optimizer
expect offload-gradients-run 0 'gradients +0 bytes' out -- "${small[@]}" --steps 2 --offload optimizer,gradients
expect offload-gradients-needs-optimizer 2 'use --offload optimizer,gradients' err -- "${small[@]}" --steps 1 --offload gradients
expect bad-offload 2 'offload' err -- train --offload gpu
expect offload-parameters-run 0 'parameters +16 bytes' out -- "${small[@]}" --steps 2 --offload optimizer,gradients,parameters \
  --offload-tile 8KiB
expect offload-parameters-needs-both 2 'offload optimizer,gradients,parameters' err -- "${small[@]}" --steps 1 \
  --offload optimizer,parameters
expect malformed-offload-tile 2 "12XB" err -- "${small[@]}" --steps 1 --offload optimizer,gradients,parameters \
  --offload-tile 12XB
expect offload-tile-needs-parameters 2 'add --offload optimizer,gradients,parameters' err -- "${small[@]}" --steps 1 \
  --offload-tile 8KiB
expect save-every-needs-save 2 'save-every.*requires.*save|save-every.*save' err -- train --save-every 2

# Save and resume: 8 steps straight equal 4 steps, save, resume, 4 steps.
run_args=(train --model mlp --width 32 --depth 1 --batch 64 --no-eval -q --seed 3)
expect straight-run 0 'final loss' out -- "${run_args[@]}" --steps 8 --report "$tmp/straight.json"
expect first-half 0 'checkpoint saved to' out -- "${run_args[@]}" --steps 4 --save "$tmp/ck" --save-every 2
expect resumed-half 0 'resumed from .* at step 4' out -- \
  "${run_args[@]}" --steps 8 --resume "$tmp/ck" --save "$tmp/ck" --report "$tmp/resumed.json"
losses() { grep '"loss"' "$1" | sed 's/,$//'; }
check resume-is-bit-identical \
  test "$(losses "$tmp/straight.json" | tail -n 4)" = "$(losses "$tmp/resumed.json")"
expect resume-complete-run 0 'complete at step 8: nothing left to train' out -- \
  "${run_args[@]}" --steps 8 --resume "$tmp/ck"
check resume-complete-run-shows-no-step-figures lacks 'final loss\|largest training step' "$tmp/out"
sum_before=$(md5sum <"$tmp/ck/checkpoint.pt")
expect resume-mismatch 2 "tensor '0.sequential.fc0.weight' is \[32, 784\] Float in the checkpoint but \[64, 784\]" err -- \
  train --model mlp --width 64 --depth 1 --steps 9 --no-eval -q --resume "$tmp/ck" --save "$tmp/ck"
check resume-mismatch-changes-nothing test "$sum_before" = "$(md5sum <"$tmp/ck/checkpoint.pt")"
expect resume-missing 2 'no checkpoint file at' err -- "${run_args[@]}" --steps 8 --resume "$tmp/none"

# A run saved under a plan resumes under it (DIR/plan.json), not under a new
# plan that timing noise may make another, which its checkpoint may refuse.
planned=(train --model mlp --width 32 --depth 1 --batch 64 --budget 1MiB --no-eval -q --seed 3)
expect planned-save 0 'checkpoint saved to' out -- "${planned[@]}" --steps 2 --save "$tmp/pl"
check planned-save-writes-its-plan test -f "$tmp/pl/plan.json"
# The saved plan says micro-batches of 8 (no plan of this budget's would):
# the resumed run trains with them, whatever planning again would choose.
python3 -c 'import json, sys; p = sys.argv[1]; j = json.load(open(p)); j["settings"]["micro_batch"] = 8; json.dump(j, open(p, "w"))' \
  "$tmp/pl/plan.json"
expect resumed-under-the-saved-plan 0 "plan: the saved run's, read from .*plan.json, not planned again" out -- \
  "${planned[@]}" --steps 3 --resume "$tmp/pl/checkpoint.pt" --save "$tmp/pl" --report "$tmp/pl-report.json"
check resumed-in-the-saved-micro-batches grep -q '"phase": "forward 8"' "$tmp/pl-report.json"
check resumed-run-keeps-its-plan grep -q '"micro_batch": 8' "$tmp/pl/plan.json"
expect resumed-under-another-budget 0 "saved run's plan .* does not suit this run: it was made for a budget of 1.00 MiB, not 2.00 MiB; planning again" out -- \
  train --model mlp --width 32 --depth 1 --batch 64 --budget 2MiB --no-eval -q --steps 4 --resume "$tmp/pl"
sum_before=$(md5sum <"$tmp/pl/checkpoint.pt")
echo '{"format": "memfit.module_plan.v1"}' >"$tmp/pl/plan.json"
expect resume-damaged-plan 2 'plan.json is damaged: "fits" is missing' err -- "${planned[@]}" --steps 5 --resume "$tmp/pl" --save "$tmp/pl"
check resume-damaged-plan-changes-nothing test "$sum_before" = "$(md5sum <"$tmp/pl/checkpoint.pt")"
mkdir -p "$tmp/plan-dir/plan.json"
expect save-plan-not-a-file 2 "plan.json" err -- "${planned[@]}" --steps 1 --save "$tmp/plan-dir"

# Plan once, train many: `memfit plan --save FILE`, then `train --plan FILE`
# trains with that plan under its budget, planning nothing.
# The CLI names its flags, never the planner's C++ options (PlanOptions::...).
expect plan-names-the-budget-flag 0 'above the budget \(--budget\)' out -- plan --model mlp --batch 256 --budget 256KiB
check plan-names-no-cpp-option lacks 'PlanOptions::' "$tmp/out"
expect train-names-the-planners-margin 1 "after the planner's 97% margin" err -- train --model mlp --budget 4096 --steps 1
check train-names-no-cpp-option lacks 'PlanOptions::' "$tmp/err"
expect plan-save 0 'chosen: micro-batch' out -- plan --model mlp --width 32 --depth 1 --batch 64 --budget 1MiB \
  --save "$tmp/mlp-plan.json"
check plan-save-writes-the-plan grep -q '"format": "memfit.module_plan.v1"' "$tmp/mlp-plan.json"
python3 -c 'import json, sys; p = sys.argv[1]; j = json.load(open(p)); j["settings"]["micro_batch"] = 16; json.dump(j, open(p, "w"))' \
  "$tmp/mlp-plan.json"
expect train-with-a-plan-file 0 'plan: read from .*mlp-plan.json, not planned again' out -- \
  train --model mlp --width 32 --depth 1 --batch 64 --plan "$tmp/mlp-plan.json" --steps 2 --no-eval -q \
  --report "$tmp/plan-file-report.json"
check plan-file-sets-the-budget grep -q 'budget 1.00 MiB' "$tmp/out"
check plan-file-sets-the-micro-batches grep -q '"phase": "forward 4"' "$tmp/plan-file-report.json"
usage plan-file-other-batch 'does not suit this run: it was made for a batch of 64, not 32; train with the flags it was planned with \(--batch 64 and --budget 1048576 or none\)' \
  train --model mlp --width 32 --depth 1 --batch 32 --plan "$tmp/mlp-plan.json" --steps 2 --no-eval -q
usage plan-file-other-budget 'it was made for a budget of 1.00 MiB, not 2.00 MiB' \
  train --model mlp --width 32 --depth 1 --batch 64 --budget 2MiB --plan "$tmp/mlp-plan.json" --steps 2 --no-eval -q
usage plan-file-other-model 'does not suit this run: it was made for another model \([0-9]+ tensors of [0-9]+ values' \
  train --model mlp --width 48 --depth 1 --batch 64 --plan "$tmp/mlp-plan.json" --steps 2 --no-eval -q
check plan-file-records-the-optimizer grep -q '"optimizer": "Adam"' "$tmp/mlp-plan.json"
usage plan-file-other-optimizer 'does not suit this run: its steps were measured with the optimizer Adam, not SGD with momentum' \
  train --model mlp --width 32 --depth 1 --batch 64 --optimizer sgd --plan "$tmp/mlp-plan.json" --steps 2 --no-eval -q
usage plan-file-missing "--plan $tmp/none.json: neither auto, none nor a plan's file" \
  train --model mlp --plan "$tmp/none.json" --steps 2
usage plan-file-and-knobs '--plan .* sets the micro-batch, checkpointing and offload itself' \
  train --model mlp --plan "$tmp/mlp-plan.json" --micro-batch 8 --steps 2
mkdir -p "$tmp/pf" && cp "$tmp/mlp-plan.json" "$tmp/pf/plan.json"
expect plan-file-of-the-run-it-saves 0 'plan: read from .*pf/plan.json, not planned again' out -- \
  train --model mlp --width 32 --depth 1 --batch 64 --plan "$tmp/pf/plan.json" --save "$tmp/pf" --steps 1 --no-eval -q
check plan-file-written-back-unchanged python3 -c 'import json, sys; a, b = (json.load(open(f)) for f in sys.argv[1:]); sys.exit(a != b)' \
  "$tmp/mlp-plan.json" "$tmp/pf/plan.json"
usage plan-save-onto-a-folder "cannot write $tmp: it is a directory" plan --model mlp --budget 1MiB --save "$tmp"

# A process killed while it saves leaves the previous checkpoint loadable:
# kill -9 the moment a temporary file appears, until one is caught mid-save.
killed_mid_save=0
for attempt in 1 2 3 4 5 6 7 8 9 10; do
  rm -rf "$tmp/kill"
  "$bin" train --model resnet --batch 8 --steps 100000 --no-eval -q --save "$tmp/kill" \
    --save-every 1 >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do [ -e "$tmp/kill/checkpoint.pt" ] && break; sleep 0.05; done
  while kill -0 "$pid" 2>/dev/null && ! compgen -G "$tmp/kill/checkpoint.pt.tmp.*" >/dev/null; do :; done
  kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  if compgen -G "$tmp/kill/checkpoint.pt.tmp.*" >/dev/null; then killed_mid_save=1; break; fi
done
check killed-during-a-save test "$killed_mid_save" -eq 1
expect killed-run-resumes 0 'resumed from .* at step [1-9]' out -- \
  train --model resnet --batch 8 --steps 1 --no-eval -q --resume "$tmp/kill" --save "$tmp/kill"  # no stuck lock

# SIGINT, and SIGHUP (a closed terminal), end a run after the step in
# progress, saving first with --save, and exit 128 + the signal as a shell
# reports it; the saved run resumes.
for sig in INT:2 HUP:1; do
  name=$(echo "${sig%:*}" | tr A-Z a-z)
  "$bin" train --model mlp --width 32 --depth 1 --steps 1000000 --no-eval -q --save "$tmp/sig$name" \
    >"$tmp/sig$name.out" 2>"$tmp/sig$name.err" &
  pid=$!
  for _ in $(seq 1 600); do grep -q 'memfit train: model' "$tmp/sig$name.out" && break; sleep 0.05; done
  sleep 1
  # One run per folder: a second one is refused while the first runs.
  for _ in $(seq 1 200); do [ -e "$tmp/sig$name/.memfit.lock" ] && break; sleep 0.05; done
  [ "$name" = int ] && expect second-run-on-a-held-folder 2 "--save $tmp/sigint is in use by another run \(memfit pid $pid on " err -- \
      train --model mlp --width 32 --depth 1 --steps 1 --no-eval -q --save "$tmp/sigint"
  kill -"${sig%:*}" "$pid"
  wait "$pid"
  check "sig$name-exits-$((128 + ${sig#*:}))" test $? -eq $((128 + ${sig#*:}))
  check "sig$name-says-it-saved" grep -q "stopped by signal ${sig#*:} after step [1-9][0-9]*; checkpoint saved" "$tmp/sig$name.out"
done
check sigint-leaves-no-temporary test -z "$(ls "$tmp/sigint" | grep tmp)"
expect sigint-run-resumes 0 'resumed from .* at step [1-9]' out -- \
  train --model mlp --width 32 --depth 1 --steps 1 --no-eval -q --resume "$tmp/sigint"
check released-folder-has-no-lock-file test ! -e "$tmp/sigint/.memfit.lock"
sum_before=$(md5sum <"$tmp/sigint/checkpoint.pt")
expect new-run-over-another-runs-checkpoint 2 "--save $tmp/sigint holds another run's checkpoint.pt.*--resume $tmp/sigint" err -- \
  train --model mlp --width 32 --depth 1 --steps 1 --no-eval -q --save "$tmp/sigint"
check refused-new-run-keeps-the-checkpoint test "$sum_before" = "$(md5sum <"$tmp/sigint/checkpoint.pt")"
# A checkpoint damaged in its middle is refused by its seal, before anything changes.
mkdir -p "$tmp/damaged" && cp "$tmp/sigint/checkpoint.pt" "$tmp/damaged/"
python3 -c "import sys; p=sys.argv[1]; b=bytearray(open(p,'rb').read()); b[len(b)//2]^=0x10; open(p,'wb').write(b)" "$tmp/damaged/checkpoint.pt"
expect resume-damaged-checkpoint 2 "checkpoint.pt is damaged: its bytes have CRC-32 [0-9a-f]{8}, but it was sealed with" err -- \
  train --model mlp --width 32 --depth 1 --steps 1 --no-eval -q --resume "$tmp/damaged" --save "$tmp/damaged"
card_before=$(md5sum <"$tmp/sigint/model.json")
expect resume-other-width 2 "tensor '0.sequential.fc0.weight' is \[32, 784\] Float in the checkpoint but \[64, 784\]" err -- \
  train --model mlp --width 64 --depth 1 --steps 1 --no-eval -q --resume "$tmp/sigint" --save "$tmp/sigint"
check refused-resume-keeps-the-model-card test "$card_before" = "$(md5sum <"$tmp/sigint/model.json")"
expect resume-other-optimizer 2 'was saved with the optimizer torch::optim::Adam, but this run.s is torch::optim::SGD' err -- \
  train --model mlp --width 32 --depth 1 --steps 1 --no-eval -q --resume "$tmp/sigint" --optimizer sgd
expect resume-other-batch 2 'saved with --batch 64, but this run.s is 32' err -- \
  train --model mlp --width 32 --depth 1 --steps 1 --no-eval -q --resume "$tmp/sigint" --batch 32
expect resume-other-precision 2 'saved with --precision fp32, but this run.s is bf16' err -- \
  train --model mlp --width 32 --depth 1 --steps 1 --no-eval -q --resume "$tmp/sigint" --precision bf16

# Files memfit reads are checked before any work; no output replaces an input or another output.
"$bin" plan --model mlp --width 16 --depth 2 --batch 64 --budget 2MiB --save "$tmp/p.json" >/dev/null 2>&1
python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
j = json.load(open(d + "/p.json"))
j["settings"]["precision"] = 7
json.dump(j, open(d + "/p-precision.json", "w"))
j["settings"]["precision"] = "fp16"
json.dump(j, open(d + "/p-type.json", "w"))
text = open(d + "/p.json").read()
open(d + "/p-deep.json", "w").write(text.replace('"schedules": [', '"schedules": [' + "[0,6,true," * 100000 + "[]" + "]" * 100000 + ",", 1))
PY
plan_args="train --model mlp --width 16 --depth 2 --batch 64 --budget 2MiB --steps 1 --no-eval -q"
expect plan-file-precision 2 'p-precision.json is damaged: "precision" is 7, not one of 0 to 2' err -- $plan_args --plan "$tmp/p-precision.json"
expect plan-file-type 2 'p-type.json is damaged: "precision" is string, not a number' err -- $plan_args --plan "$tmp/p-type.json"
expect plan-file-deep 2 'p-deep.json is damaged: it nests deeper than' err -- $plan_args --plan "$tmp/p-deep.json"
check plan-file-messages-name-no-cpp lacks 'save_plan' "$tmp/err"
cp "$tmp/p.json" "$tmp/p-kept.json"
expect report-over-plan 2 'report .*p.json is also an input of this command' err -- $plan_args --plan "$tmp/p.json" --report "$tmp/p.json"
check report-over-plan-keeps-it cmp -s "$tmp/p.json" "$tmp/p-kept.json"
mkdir -p "$tmp/data-copy" && cp /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz "$tmp/data-copy/"
expect report-over-data 2 'is also an input of this command' err -- \
  train --model mlp --steps 1 --no-eval -q --data "$tmp/data-copy" --report "$tmp/data-copy/t10k-labels-idx1-ubyte.gz"
mkdir -p "$tmp/clash"
expect report-over-checkpoint 2 'is also where --save writes' err -- \
  train --model mlp --steps 1 --no-eval -q --save "$tmp/clash" --report "$tmp/clash/checkpoint.pt"
for flag in --report --save --resume; do
  expect "empty$flag" 2 "$flag must name a (file|folder), got an empty string" err -- train --model mlp --steps 1 "$flag" ""
done
expect empty-plan-save 2 'save must name a file, got an empty string' err -- plan --model mlp --budget 2MiB --save ""
expect nan-loss-names-flags 1 'the loss is NaN; lower the learning rate, clip gradients \(--clip-grad-norm\), or skip such steps \(--skip-nonfinite\)' err -- \
  train --model mlp --width 16 --depth 1 --batch 64 --steps 3 --no-eval -q --lr 1e30
"$bin" train --model mlp --width 16 --depth 1 --batch 64 --steps 3 --no-eval -q --lr 1e30 --skip-nonfinite \
  --report "$tmp/nan.json" >/dev/null 2>&1
expect report-of-a-nan-run 0 'report written' out -- report "$tmp/nan.json" --output "$tmp/nan.html"
check report-of-a-nan-run-says-so grep -q 'NaN or infinite' "$tmp/nan.html"
echo '{"steps": [], "summary": {"final_loss": "x"}}' >"$tmp/not-report.json"
expect report-not-a-report 2 'not-report.json: not a memfit run report .summary "final_loss" is string' err -- \
  report "$tmp/not-report.json" --output "$tmp/not-report.html"
echo '{"steps": [{"step": 1, "peak_bytes": "big"}], "summary": {}}' >"$tmp/step-text.json"
expect report-step-entry-not-a-number 2 'not a memfit run report \("steps" entry 0: "peak_bytes" is string, not a number\)' \
  err -- report "$tmp/step-text.json" --output "$tmp/step-text.html"
usage report-empty-output 'output must name a file, got an empty string' report "$tmp/step-text.json" -o ""
echo '{"steps": [' >"$tmp/not-json.json"
expect report-not-json 2 'not-json.json: not a memfit run report \(not JSON at byte [0-9]+\)' err -- \
  report "$tmp/not-json.json" --output "$tmp/not-json.html"

# The launcher stopped by SIGTERM passes it to every worker's process group
# and leaves no process behind, workers started through a shell included.
codes=""
for i in $(seq 1 10); do
  "$bin" launch --nproc 2 --grace 1 -- bash -c 'sleep 3017 & sleep 3017; wait' >/dev/null 2>&1 &
  pid=$!
  sleep 1  # the workers and their shells' children run
  kill -TERM "$pid"
  wait "$pid"
  codes="$codes $?"
done
sleep 0.3
check launcher-sigterm-exits-143 test "$codes" = "$(printf ' 143%.0s' $(seq 1 10))"
check launcher-sigterm-leaves-no-orphans test "$(pgrep -fc 'sleep 3017')" -eq 0

# The planner.
expect plan-help 0 'budget' out -- plan --help
expect plan-needs-budget 2 'budget' err -- plan --model mlp
expect plan-fits 0 '"fits": true' out -- plan --model resnet --width 4 --depth 1 --batch 64 --budget 3MiB --json \
  --batch-statistics per-micro-batch
expect plan-explains 0 'predicted peak .* per batch' out -- plan --model resnet --width 4 --depth 1 --batch 64 --budget 3MiB \
  --batch-statistics per-micro-batch
expect plan-says-the-math-changes 0 "the math changes: BatchNorm layer '[0-9a-z_.]*stem_bn'.*--batch-statistics per-micro-batch" out -- \
  plan --model resnet --width 4 --depth 1 --batch 64 --budget 3MiB --batch-statistics per-micro-batch
expect plan-keeps-batch-statistics 1 "micro-batches were not tried because BatchNorm layer '[0-9a-z_.]*stem_bn'.*--batch-statistics per-micro-batch allows them" err -- \
  plan --model resnet --width 4 --depth 1 --batch 64 --budget 3MiB
expect plan-batch-statistics-domain 2 'batch-statistics' err -- plan --model mlp --budget 1MiB --batch-statistics sometimes
expect plan-batch-beyond-data 2 '^memfit plan: error: --batch 60001 is larger than the training set \(60000 Fashion-MNIST images\): use --batch 60000 or less \(see' err -- \
  plan --model mlp --budget 1MiB --batch 60001
expect plan-batch-too-small 2 '^memfit plan: error: --batch 3: the planner measures the step in micro-batches of two sizes, so it plans batches of 4 examples or more; use --batch 4 or more' err -- \
  plan --model mlp --budget 1MiB --batch 3
expect train-budget-batch-too-small 2 'batch 2 under --budget: .*use --batch 4 or more, or set the knobs by hand \(--plan none\)' err -- \
  train --model mlp --budget 1MiB --batch 2 --steps 1 --no-eval
expect train-batch-beyond-data 2 'batch 70000 is larger than the training set \(60000 Fashion-MNIST images\)' err -- \
  train --model mlp --batch 70000 --steps 1 --budget 64MiB
expect plan-says-what-it-measured 0 "measured the module's step at micro-batches of 16 and 32 \(fp32; offload none, optimizer, optimizer and gradients[^)]*\), 1 chain\(s\)" out -- \
  plan --model mlp --width 32 --depth 1 --batch 4096 --budget 1MiB
expect plan-times-close-candidates 0 'timed the [0-9] closest candidate\(s\) with real steps under the budget.*: predicted [0-9.]+ ms, measured [0-9.]+ ms.*chose (the fastest measured|by what the plans do|.+, [0-9.]+% behind the fastest measured \(.+\): within the tie)' out -- \
  plan --model mlp --width 32 --depth 1 --batch 256 --budget 1MiB
expect plan-by-prediction 0 'predicted peak' out -- \
  plan --model mlp --width 32 --depth 1 --batch 256 --budget 1MiB --measure-candidates 0
check plan-by-prediction-times-nothing lacks 'timed the' "$tmp/out"
expect plan-nothing-fits 1 'nothing fits 16.00 KiB .*the closest predicted peak is [0-9.]+ KiB \(micro-batch 1, .*\); less may fit with --precision any' err -- \
  plan --model mlp --batch 64 --budget 16KiB
expect profile-table 0 'measured plain training step: peak' out -- profile --model mlp --width 32 --depth 1 --batch 16
expect profile-json 0 '"predicted_step_peak_bytes"' out -- profile --model mlp --width 32 --depth 1 --batch 16 --json
expect find-batch 0 'plainly: batch [0-9]+ .*measured [0-9.]+ [KM]iB in [0-9]+ run' out -- \
  find-batch --model resnet --width 4 --depth 1 --budget 4MiB --batch 512 --batch-statistics per-micro-batch
expect find-batch-json 0 '"with_techniques"' out -- \
  find-batch --model resnet --width 4 --depth 1 --budget 4MiB --no-verify --json
expect find-batch-needs-budget 2 'budget' err -- find-batch --model mlp
expect report-needs-run 2 'run' err -- report -o "$tmp/x.html"
expect report-missing-run 2 'does not exist|not exist' err -- report "$tmp/none.json" -o "$tmp/x.html"
expect train-plans 0 'the plan predicted' out -- \
  train --model resnet --width 4 --depth 1 --batch 128 --steps 2 --budget 4MiB --batch-statistics per-micro-batch \
  --no-eval -q --report "$tmp/planned.json"
check train-report-holds-plan grep -q '"predicted_peak_bytes"' "$tmp/planned.json"
expect train-plan-by-hand 0 'plan: none' out -- \
  train --model mlp --width 32 --depth 1 --steps 1 --budget 64MiB --micro-batch 16 --no-eval -q

# The GPT on the Jargon File, and text from it.
if [ -f /usr/share/doc/jargon-text/jargon.txt.gz ]; then
expect train-gpt 0 'perplexity' out -- train --model gpt --width 16 --depth 1 --heads 2 --context 16 \
  --batch 8 --steps 3 --eval-batch 4096 -q --save "$tmp/gpt"
check train-gpt-writes-model-card grep -q '"vocab"' "$tmp/gpt/model.json"
expect generate 0 '^hacker' out -- generate --resume "$tmp/gpt" --prompt hacker --tokens 20 --seed 3
expect generate-greedy-is-repeatable 0 '^hacker' out -- generate --resume "$tmp/gpt" --prompt hacker --tokens 20 --temperature 0
first=$(cat "$tmp/out")
"$bin" generate --resume "$tmp/gpt" --prompt hacker --tokens 20 --temperature 0 >"$tmp/again" 2>&1
check generate-greedy-twice-the-same test "$first" = "$(cat "$tmp/again")"
# Usage errors of generate exit 2 in one line: bytes the corpus lacks, an empty prompt, no or a
# damaged model.json, another model's folder, and a checkpoint that is not the card's model.
expect generate-unknown-byte 2 'byte 1 at position 2' err -- generate --resume "$tmp/gpt" --prompt "$(printf 'ok\001')"
expect generate-empty-prompt 2 'prompt is empty' err -- generate --resume "$tmp/gpt" --prompt ""
expect generate-needs-model-card 2 'no model.json' err -- generate --resume "$tmp" --prompt x
expect generate-another-model 2 "holds a 'mlp' model" err -- generate --resume "$tmp/sigint" --prompt x
mkdir -p "$tmp/gpt-card" && cp "$tmp/gpt/checkpoint.pt" "$tmp/gpt-card/"
sed 's/"width": 16/"width": "x"/' "$tmp/gpt/model.json" >"$tmp/gpt-card/model.json"
expect generate-card-field 2 'model.json is damaged: "width" is missing or not an integer' err -- \
  generate --resume "$tmp/gpt-card" --prompt hacker
sed 's/"width": 16/"width": 32/' "$tmp/gpt/model.json" >"$tmp/gpt-card/model.json"
expect generate-card-of-another-width 2 "does not match the model" err -- generate --resume "$tmp/gpt-card" --prompt hacker
echo '{"model": "gpt", ' >"$tmp/gpt-card/model.json"
expect generate-card-not-json 2 'model.json is damaged: not JSON at byte' err -- generate --resume "$tmp/gpt-card" --prompt hacker
expect train-gpt-selective 0 'final loss' out -- train --model gpt --width 16 --depth 1 --heads 2 --context 16 \
  --batch 8 --steps 2 --no-eval -q --selective-recompute --dropout 0.1
expect plan-gpt-chooses-selective-recompute 0 '"selective_recompute"' out -- plan --model gpt --width 16 --depth 1 \
  --heads 2 --context 16 --batch 8 --budget 2MiB --json
# profile measures the model as built: with --selective-recompute its blocks keep less.
gpt_tiny=(--model gpt --width 16 --depth 1 --heads 2 --context 64 --batch 8 --json)
peak_of() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["measured_step_peak_bytes"])' "$1"; }
"$bin" profile "${gpt_tiny[@]}" >"$tmp/kept.json" 2>"$tmp/err"
"$bin" profile "${gpt_tiny[@]}" --selective-recompute >"$tmp/recomputed.json" 2>"$tmp/err"
check profile-measures-selective-recompute-as-asked test "$(peak_of "$tmp/recomputed.json")" -lt "$(peak_of "$tmp/kept.json")"
expect selective-recompute-needs-gpt 2 'only --model gpt has' err -- train --model mlp --selective-recompute --steps 1 --no-eval
expect train-gpt-bad-heads 2 'not a multiple of its 3 heads' err -- train --model gpt --width 16 --heads 3 --steps 1 --no-eval
else
  echo "skip gpt checks: Debian's jargon-text is not installed"
fi
expect generate-needs-resume 2 'resume' err -- generate --prompt x

# A TorchScript model from Python (Debian's python3-torch and python3-torchvision).
if /usr/bin/python3 "$(dirname "$0")/make_torchscript.py" "$tmp/ts" >/dev/null 2>&1; then
expect train-torchscript 0 'TorchScript .*11175370 parameters' out -- train --torchscript "$tmp/ts/resnet18.pt" \
  --steps 2 --batch 8 --no-eval -q --checkpoint sqrt --threads 1
expect train-torchscript-not-a-chain 1 'is not its children run in order' err -- \
  train --torchscript "$tmp/ts/resnet18_whole.pt" --steps 1 --no-eval
# TorchScript's own traceback (20-odd lines) is never the message: one line, on loading and in training.
expect train-torchscript-wrong-input 1 'wrong_input.pt.s forward fails on the check input of shape \[2, 1, 28, 28\]: .*mat1 and mat2 shapes cannot be multiplied' err -- \
  train --torchscript "$tmp/ts/wrong_input.pt" --steps 1 --no-eval
check train-torchscript-wrong-input-one-line test "$(wc -l <"$tmp/err")" -eq 1
expect train-torchscript-fails-in-training 1 "^memfit: error: TorchScript TwoOnly failed: .*expanded size" err -- \
  train --torchscript "$tmp/ts/two_only.pt" --steps 1 --batch 8 --no-eval
check train-torchscript-fails-in-training-no-traceback lacks 'Traceback' "$tmp/err"
else
  echo "skip torchscript checks: /usr/bin/python3 has no torch and torchvision (Debian's python3-torch)"
fi
expect train-torchscript-missing 2 'torchscript' err -- train --torchscript "$tmp/none.pt" --steps 1

# Data parallel: two ranks of batch 16 train like one process of batch 32.
# A port the kernel calls free now (one per launch: a fixed range could meet
# the ephemeral ports of Gloo's connections in tests running beside these).
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
expect launch-help 0 'nproc' out -- launch --help
# Each worker gets the cores shared out (torchrun's OMP_NUM_THREADS), unless the user set it.
cores=$(getconf _NPROCESSORS_ONLN) omp_threads=${OMP_NUM_THREADS-}
unset OMP_NUM_THREADS  # ctest sets it for every test
expect launch-shares-the-cores 0 "^threads=$((cores / 2 > 1 ? cores / 2 : 1))\$" out -- \
  launch --nproc 2 -- bash -c 'echo "threads=$OMP_NUM_THREADS"'
OMP_NUM_THREADS=3 expect launch-keeps-omp-num-threads 0 '^threads=3$' out -- launch --nproc 2 -- \
  bash -c 'echo "threads=$OMP_NUM_THREADS"'
OMP_NUM_THREADS=1 "$bin" train --model mlp --width 8 --depth 1 --steps 1 --no-eval -q --report "$tmp/omp.json" >/dev/null 2>&1
check train-runs-omp-num-threads python3 -c "import json,sys; sys.exit(json.load(open('$tmp/omp.json'))['environment']['threads'] != 1)"
[ -n "$omp_threads" ] && export OMP_NUM_THREADS=$omp_threads
expect dist-backend-nccl-needs-cuda 2 'dist-backend nccl reduces CUDA tensors.*--device cuda' err -- \
  train --model mlp --steps 1 --dist-backend nccl
expect dist-backend-nccl-not-in-pipelines 2 'pipelines run over Gloo' err -- \
  train --model mlp --steps 1 --dist-backend nccl --device cuda --parallel pipeline
expect dist-backend-unknown 2 'dist-backend' err -- train --model mlp --steps 1 --dist-backend mpi
if ! "$bin" --version | grep -qE ', c10d Gloo[;a-z ]'; then
  echo "skip launch checks: this build has no c10d Gloo process group"
else
# A port in use is said at once, in one line of memfit's (c10d's own log lines about it are dropped).
busy=$(free_port)
python3 -c 'import socket, sys, time; s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(); time.sleep(60)' "$busy" &
holder=$!
sleep 0.5
RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$busy expect port-in-use 1 \
  "^memfit: error: rank 0 of 2: port $busy of 127.0.0.1 is in use by another process: choose a free port \(memfit launch --master-port, or MASTER_PORT\)\$" err -- \
  train --model mlp --width 8 --depth 1 --steps 1 --no-eval -q --dist-timeout 30
check port-in-use-one-line test "$(wc -l <"$tmp/err")" -eq 1
kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null
# No rank 0: rank 1 gives up after --dist-timeout in one line, without a backtrace.
RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(free_port) expect no-rank-zero 1 \
  "^memfit: error: rank 1 of 2: could not meet the others at 127.0.0.1:[0-9]+ within 2000 ms" err -- \
  train --model mlp --width 8 --depth 1 --steps 1 --no-eval -q --dist-timeout 2
check no-rank-zero-one-line test "$(wc -l <"$tmp/err")" -eq 1
expect launch-two-ranks 0 'batch 16 per rank × 2 ranks' out -- launch --nproc 2 --master-port "$(free_port)" -- \
  "$bin" train --model mlp --width 32 --depth 1 --steps 6 --batch 16 --no-eval -q --threads 1
two=$(grep -o 'final loss [0-9.]*' "$tmp/out")
"$bin" train --model mlp --width 32 --depth 1 --steps 6 --batch 32 --no-eval -q --threads 1 >"$tmp/one" 2>&1
one=$(grep -o 'final loss [0-9.]*' "$tmp/one")
check launch-equals-one-process-with-the-double-batch test -n "$one" -a "$one" = "$two"
# Ranks started with other flags are refused before any step (exit 2, not an abort in Gloo; every
# rank says it, as Distributed.RanksStartedWithAnotherModelOrOptions... checks: the launcher may stop one first).
one_line=0 expect launch-ranks-disagree 2 "the ranks disagree before the first step: rank 1's --batch is 16, rank 0's is 8" err -- \
  launch --nproc 2 --master-port "$(free_port)" -- bash -c \
  "exec '$bin' train --model mlp --width 8 --depth 1 --steps 2 --batch \$((8 + 8 * RANK)) --no-eval -q --threads 1"
# Planned under launch: every rank trains with rank 0's plan (broadcast_plan).
expect launch-budget-trains-rank-0s-plan 0 "rank 0's plan, broadcast to all 2 ranks" out -- launch --nproc 2 \
  --master-port "$(free_port)" -- "$bin" train --model mlp --width 32 --depth 1 --steps 2 --batch 16 --no-eval \
  --threads 1 --budget 2MiB
# Both ranks run out of memory under the budget and re-plan together (recovery is on under launch too).
expect launch-recovered 0 'recovered from out of memory [0-9]+ times? .*micro-batches of' out -- launch --nproc 2 \
  --master-port "$(free_port)" -- "$bin" train --model mlp --width 64 --batch 256 --budget 1.3MiB --steps 2 \
  --no-eval -q --plan none --threads 1
expect launch-replan-pipeline 2 "re-plans data-parallel ranks together, not a pipeline's stages" err -- \
  train --model mlp --steps 1 --parallel pipeline --on-out-of-memory replan
expect launch-zero-stage-1 0 'ZeRO stage 1' out -- launch --nproc 2 --master-port "$(free_port)" -- \
  "$bin" train --model mlp --width 32 --depth 1 --steps 6 --batch 16 --no-eval -q --threads 1 --zero-stage 1
zero=$(grep -o 'final loss [0-9.]*' "$tmp/out")
check launch-zero-equals-unsharded test -n "$zero" -a "$zero" = "$two"
expect launch-offload-gradients 0 'data parallel over Gloo' out -- launch --nproc 2 --master-port "$(free_port)" -- \
  "$bin" train --model mlp --width 32 --depth 1 --steps 6 --batch 16 --no-eval -q --threads 1 --offload optimizer,gradients
ddp_off=$(grep -o 'final loss [0-9.]*' "$tmp/out")
check launch-offload-gradients-equals-one-process test -n "$ddp_off" -a "$ddp_off" = "$one"
expect launch-pipeline 0 'through a pipeline of 2 stages' out -- launch --nproc 2 --master-port "$(free_port)" -- \
  "$bin" train --model mlp --width 32 --depth 1 --steps 6 --batch 32 --no-eval -q --threads 1 --parallel pipeline --chunks 4 --schedule 1f1b
piped=$(grep -o 'final loss [0-9.]*' "$tmp/out")
check launch-pipeline-equals-one-process test -n "$piped" -a "$piped" = "$one"
expect launch-pipeline-clip 0 'through a pipeline of 2 stages' out -- launch --nproc 2 --master-port "$(free_port)" -- \
  "$bin" train --model mlp --width 32 --depth 1 --steps 6 --batch 32 --no-eval -q --threads 1 --parallel pipeline --chunks 4 --clip-grad-norm 0.05
piped_clip=$(grep -o 'final loss [0-9.]*' "$tmp/out")
"$bin" train --model mlp --width 32 --depth 1 --steps 6 --batch 32 --no-eval -q --threads 1 --clip-grad-norm 0.05 >"$tmp/one" 2>&1
one_clip=$(grep -o 'final loss [0-9.]*' "$tmp/one")
check launch-pipeline-clip-equals-one-process test -n "$one_clip" -a "$piped_clip" = "$one_clip" -a "$one_clip" != "$one"
expect launch-pipeline-checkpoint 0 'gpipe, checkpoint except_last' out -- launch --nproc 2 --master-port "$(free_port)" -- \
  "$bin" train --model mlp --width 32 --depth 1 --steps 6 --batch 32 --no-eval -q --threads 1 --parallel pipeline --chunks 4 --pipeline-checkpoint except_last
piped_ck=$(grep -o 'final loss [0-9.]*' "$tmp/out")
check launch-pipeline-checkpoint-equals-one-process test -n "$piped_ck" -a "$piped_ck" = "$one"
expect launch-pipeline-bf16 0 'through a pipeline of 2 stages' out -- launch --nproc 2 --master-port "$(free_port)" -- \
  "$bin" train --model mlp --width 32 --depth 1 --steps 6 --batch 32 --no-eval -q --threads 1 --parallel pipeline --chunks 4 --precision bf16
piped_bf16=$(grep -o 'final loss [0-9.]*' "$tmp/out")
"$bin" train --model mlp --width 32 --depth 1 --steps 6 --batch 32 --micro-batch 8 --no-eval -q --threads 1 --precision bf16 >"$tmp/one" 2>&1
one_bf16=$(grep -o 'final loss [0-9.]*' "$tmp/one")
check launch-pipeline-bf16-equals-one-process test -n "$one_bf16" -a "$piped_bf16" = "$one_bf16" -a "$one_bf16" != "$one"
expect launch-pipeline-offload 0 'through a pipeline of 2 stages' out -- launch --nproc 2 --master-port "$(free_port)" -- \
  "$bin" train --model mlp --width 32 --depth 1 --steps 6 --batch 32 --no-eval -q --threads 1 --parallel pipeline --chunks 4 --offload optimizer,gradients
piped_off=$(grep -o 'final loss [0-9.]*' "$tmp/out")
check launch-pipeline-offload-equals-one-process test -n "$piped_off" -a "$piped_off" = "$one"
one_line=0 expect launch-pipeline-not-checkpoint 2 'use --pipeline-checkpoint except_last .* instead of --checkpoint sqrt' err -- \
  launch --nproc 2 --master-port "$(free_port)" -- "$bin" train --model mlp --steps 1 --no-eval -q --parallel pipeline --checkpoint sqrt
expect pipeline-checkpoint-needs-pipeline 2 '--pipeline-checkpoint needs --parallel pipeline' err -- \
  train --model mlp --steps 1 --no-eval -q --pipeline-checkpoint always
expect launch-failing-worker 3 'rank 1 exited with status 3; stopping the other 1 worker' err -- \
  launch --nproc 2 --master-port "$(free_port)" -- sh -c 'if [ "$RANK" = 1 ]; then exit 3; fi; sleep 60'
fi
expect launch-node-rank 2 'node-rank 2 is not below --nnodes 1' err -- launch --nproc 1 --node-rank 2 -- true
expect launch-needs-nproc 2 'nproc' err -- launch -- true
expect launch-needs-command 2 'command' err -- launch --nproc 2
expect train-zero-needs-ranks 1 'zero_stage 1 shards the optimizer state over the ranks' err -- \
  train --model mlp --width 32 --depth 1 --steps 1 --no-eval --zero-stage 1
expect train-zero-stage-2 2 'zero-stage' err -- train --model mlp --steps 1 --no-eval --zero-stage 2
RANK=0 WORLD_SIZE=x usage train-dist-bad-env "WORLD_SIZE='x' is not an integer" train --model mlp --steps 1 --no-eval

# The BLAS check (issue: Debian's LibTorch on the reference BLAS): with each
# of Debian's libblas.so.3 builds preloaded, whichever the alternatives select.
arch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
reference=/usr/lib/$arch/blas/libblas.so.3
openmp=/usr/lib/$arch/openblas-openmp/libblas.so.3
tiny=(--model mlp --width 16 --depth 1 --batch 16)
if [ -e "$reference" ] && [ -e "$openmp" ]; then
  LD_PRELOAD=$reference expect blas-reference-train-warns 0 \
    'memfit: warning: .*netlib reference BLAS \(/usr/lib/.*/blas/libblas\.so\.3[0-9.]*\).*install libopenblas0-openmp' err -- \
    train "${tiny[@]}" --steps 1 --no-eval -q --report "$tmp/blas.json"
  check blas-warning-is-one-line test "$(grep -c 'warning:' "$tmp/err")" -eq 1
  check blas-recorded-in-report grep -q '"vendor": "reference"' "$tmp/blas.json"
  "$bin" report "$tmp/blas.json" -o "$tmp/blas.html" >/dev/null
  check blas-shown-in-html-report grep -q 'netlib reference BLAS' "$tmp/blas.html"
  LD_PRELOAD=$reference expect blas-reference-plan-warns 0 'reference BLAS' err -- plan "${tiny[@]}" --budget 64MiB
  LD_PRELOAD=$reference expect blas-reference-profile-warns 0 'reference BLAS' err -- profile "${tiny[@]}"
  LD_PRELOAD=$reference MEMFIT_BLAS_CHECK=0 "$bin" plan "${tiny[@]}" --budget 64MiB >/dev/null 2>"$tmp/err"
  check blas-check-off-silences lacks 'warning' "$tmp/err"
  LD_PRELOAD=$openmp "$bin" plan "${tiny[@]}" --budget 64MiB >/dev/null 2>"$tmp/err"
  check blas-openmp-draws-no-warning lacks 'warning' "$tmp/err"
  LD_PRELOAD=$openmp expect version-names-blas 0 'BLAS: OpenBLAS [0-9.]+ \(OpenMP\)' out -- --version
else
  echo "skip blas-*: needs $reference and $openmp (scripts/install-deps.sh installs both)"
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
