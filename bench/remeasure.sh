#!/usr/bin/env bash
# Re-runs the CPU measurements that the README and docs/ quote, one after
# another (never two at once: on 2 cores a second run slows the first many
# times over), each into docs/measurements/NAME.txt (one run file per
# benchmark; git keeps the history), headed by its command, the date,
# `memfit --version` (LibTorch, BLAS) and the load, and closed by its wall time.
#
# Usage (after `make build`): bash bench/remeasure.sh [NAME...]
#   NAMES: main memory checkpoint checkpoint_host precision trainer tax tax_python plan plan_peers accuracy own stream cost stability stability_tight distributed
#          recovery recovery_offload recovery_sweep replan
#          stability_gpt (bench/peers.py's GPT table, quiet runs only)
#          probes (scripts/probe-bad-input.sh: careless and hostile input, by class)
#          gpt_train gpt_budget peers peers_gpt      (default: all, in that order)
#          peers_torch2 peers_gpt_torch2  (peers with PyTorch 2.15's tools too: after
#          `make build LIBTORCH=pip`; not in the default list)
#          tax_python_torch2 process_noise_torch2 optim_step_torch2 tax_optim_torch2
#          (in PyTorch 2.15's Python, on build-pip: ditto); optim_step (1.13)
#          fresh_make_run (scripts/fresh-make-run.sh: `make run` on a fresh Debian 12
#          chroot; as root, with Debian's mirror; not in the default list)
#   BUILD=build OUT=docs/measurements bash bench/remeasure.sh ...
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
torch2=${MEMFIT_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/memfit/torch-2.15}/bin/python
out=${OUT:-docs/measurements}
mkdir -p "$out"

# run NAME COMMAND...: the command's output into $out/NAME.txt, written
# through a temporary file so an interrupted run leaves the old file.
run() {
  local name=$1; shift
  local file="$out/${name}.txt" start
  echo "remeasure: $name: $*" >&2
  start=$(date +%s)
  {
    echo "# $*"
    echo "# $(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $("$build/memfit" --version)"
    "$@" 2>&1
    echo "# wall time: $(( $(date +%s) - start )) s"
  } >"$file.tmp"
  mv "$file.tmp" "$file"
}

bench() { run "$1" "$build/bench/$2" "${@:3}"; }

measure() {
  case "$1" in
    main) run main "$build/memfit" train --model resnet --epochs 1 --budget 64MiB ;;
    memory) bench memory memfit_bench ;;
    checkpoint) bench checkpoint memfit_checkpoint_bench --benchmark_filter='^(overhead|model|sqrt|optimal)/' ;;
    checkpoint_host) bench checkpoint_host memfit_checkpoint_bench --benchmark_filter='^host/' ;;
    precision) bench precision memfit_precision_bench ;;
    trainer) bench trainer memfit_trainer_bench --benchmark_filter='micro|techniques' ;;
    tax) bench trainer_tax memfit_trainer_bench --benchmark_filter=tax ;;
    tax_python) run tax_python /usr/bin/python3 bench/tax.py --build "$build" --rounds 30 ;;
    plan) bench plan memfit_plan_bench --benchmark_filter='plan/(resnet|mlp)/batch(64|256)' ;;
    plan_peers) bench plan_peers memfit_plan_bench --benchmark_filter='plan/(resnet/depth3|gpt)' ;;
    accuracy) bench plan_accuracy memfit_plan_bench --benchmark_filter=accuracy ;;
    own) bench plan_own memfit_plan_bench --benchmark_filter=own ;;
    stream) bench stream_own memfit_plan_bench --benchmark_filter=stream ;;
    cost) bench plan_cost memfit_plan_bench --benchmark_filter=cost ;;
    stability) run plan_stability bash bench/plan_stability.sh "$build" ;;
    stability_tight) run plan_stability_tight bash bench/plan_stability.sh "$build" 5 tight ;;
    stability_gpt) MODES=quiet run plan_stability_peers_gpt bash bench/plan_stability.sh "$build" 5 peers_gpt ;;
    probes) run probes bash scripts/probe-bad-input.sh "$build/memfit" ;;
    recovery) bench recovery memfit_trainer_bench --benchmark_filter='recovery|tax/' ;;
    recovery_offload) run recovery_offload bash bench/recovery_offload.sh "$build" ;;
    recovery_sweep) run recovery_sweep bash bench/recovery_sweep.sh "$build" ;;
    replan) bench replan memfit_plan_bench --benchmark_filter=replan ;;
    fresh_make_run) run fresh_make_run bash scripts/fresh-make-run.sh "$(mktemp -d)/debian12" ;;
    distributed) bench distributed memfit_distributed_bench --steps 60 --pairs 11 ;;
    gpt_train) run gpt_train "$build/memfit" train --model gpt --width 64 --depth 2 --context 64 --batch 32 --steps 100 ;;
    gpt_budget) run gpt_budget python3 bench/gpt_budget.py --build "$build" ;;
    peers) run peers /usr/bin/python3 bench/peers.py --build "$build" --steps 8 --batch 128 --repeats 2 --pairs 3 ;;
    peers_gpt) run peers_gpt /usr/bin/python3 bench/peers.py --build "$build" --model gpt --steps 8 --batch 16 --repeats 3 \
      --pairs 3 ;;
    peers_torch2) run peers_torch2 /usr/bin/python3 bench/peers.py --build "$build" --steps 8 --batch 128 --repeats 2 \
      --pairs 3 --no-low-precision --torch2 "$torch2" --torch2-build "${BUILD_PIP:-build-pip}" ;;
    tax_python_torch2) build=${BUILD_PIP:-build-pip} run tax_python_torch2 "$torch2" bench/tax.py \
      --build "${BUILD_PIP:-build-pip}" --model gpt --rounds 30 ;;
    process_noise_torch2) build=${BUILD_PIP:-build-pip} run process_noise_torch2 /usr/bin/python3 \
      bench/process_noise.py --build "${BUILD_PIP:-build-pip}" --python "$torch2" --rounds 8 ;;
    optim_step) run optim_step /usr/bin/python3 bench/optim_step.py --build "$build" ;;
    optim_step_torch2) build=${BUILD_PIP:-build-pip} run optim_step_torch2 "$torch2" bench/optim_step.py \
      --build "${BUILD_PIP:-build-pip}" ;;
    tax_optim_torch2) build=${BUILD_PIP:-build-pip} run tax_optim_torch2 bash -c "for p in default fused; do \
      '$torch2' bench/tax.py --build '${BUILD_PIP:-build-pip}' --precision fp32 --rounds 30 --python-optimizer \$p; done" ;;
    peers_gpt_torch2) run peers_gpt_torch2 /usr/bin/python3 bench/peers.py --build "$build" --model gpt --steps 8 \
      --batch 16 --repeats 3 --pairs 5 --torch2 "$torch2" --torch2-build "${BUILD_PIP:-build-pip}" ;;
  esac
}

all=(main memory checkpoint checkpoint_host precision trainer tax tax_python plan plan_peers accuracy own stream cost stability stability_tight distributed
  recovery recovery_offload recovery_sweep replan gpt_train gpt_budget peers peers_gpt)
known=("${all[@]}" stability_gpt probes fresh_make_run peers_torch2 peers_gpt_torch2 tax_python_torch2 process_noise_torch2 optim_step optim_step_torch2
  tax_optim_torch2)
names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${all[@]}")
for name in "${names[@]}"; do  # every name checked before anything runs
  [[ " ${known[*]} " == *" $name "* ]] || { echo "remeasure: unknown measurement '$name'; one of: ${known[*]}" >&2; exit 2; }
done
[ -x "$build/memfit" ] || { echo "remeasure: $build/memfit is missing: run make build first" >&2; exit 2; }
for name in "${names[@]}"; do measure "$name"; done
