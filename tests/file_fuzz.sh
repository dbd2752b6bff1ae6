#!/usr/bin/env bash
# Fuzzing the files memfit reads (#52): the checkpoint, model.json and
# plan.json that `train --save` writes, a plan file and a run report, each
# truncated, with bytes flipped, with a JSON value of another type, nested
# deeply, or swapped for another model's file; then read back by the command
# that reads it (train --resume, generate, train --plan, report). For at most
# FUZZ_CASES cases and FUZZ_SECONDS seconds (seeded by FUZZ_SEED). Every case
# must exit 0, 1 or 2 within its time (no signal, no hang), say a usage error
# in one line, leave no temporary file, and change no file it reads.
# Usage: MEMFIT=path/to/memfit bash tests/file_fuzz.sh
set -u
bin=${MEMFIT:?set MEMFIT to the memfit binary}
cases=${FUZZ_CASES:-40}
budget=${FUZZ_SECONDS:-200}
seed=${FUZZ_SEED:-52}
RANDOM=$seed
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export MEMFIT_CACHE_DIR="$tmp/cache"

# The originals: two runs of other widths under a plan (checkpoint, model.json, plan.json), a
# GPT run where the Jargon File is installed (model.json for generate), a plan file and a report.
small=(--model mlp --depth 1 --batch 32 --no-eval -q --threads 1)
mkdir -p "$tmp/orig"
"$bin" train "${small[@]}" --width 16 --steps 2 --budget 4MiB --save "$tmp/orig/run" \
  --report "$tmp/orig/report.json" >/dev/null 2>&1 || { echo "FAIL setup: could not save a run"; exit 1; }
"$bin" train "${small[@]}" --width 24 --steps 2 --budget 4MiB --save "$tmp/orig/other" >/dev/null 2>&1 ||
  { echo "FAIL setup: could not save a second run"; exit 1; }
"$bin" plan --model mlp --width 16 --depth 1 --batch 32 --budget 4MiB --save "$tmp/orig/plan.json" >/dev/null 2>&1 ||
  { echo "FAIL setup: could not save a plan"; exit 1; }
gpt=0
if [ -f /usr/share/doc/jargon-text/jargon.txt.gz ] &&
   "$bin" train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 8 --steps 1 --no-eval -q --threads 1 \
     --save "$tmp/orig/gpt" >/dev/null 2>&1; then
  gpt=1
fi

# mutate KIND FILE OTHER: changes FILE in place (OTHER: the other run's file of the same name).
mutate() {
  python3 - "$1" "$2" "$3" "$RANDOM" <<'EOF'
import json, os, random, shutil, sys
kind, path, other, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rng = random.Random(seed)
data = bytearray(open(path, 'rb').read())
if kind == 'truncate':
    data = data[:rng.randrange(0, max(1, len(data)))]
elif kind == 'flip':
    for _ in range(rng.choice([1, 1, 2, 8])):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
elif kind == 'type':
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc:
        key = rng.choice(sorted(doc))
        doc[key] = rng.choice(['x', -1, 1e308, None, [], {'a': 1}, True, 2**70])
        data = bytearray(json.dumps(doc).encode())
    else:  # not JSON: a JSON document where bytes were
        data = bytearray(b'{"format": 7}')
elif kind == 'nest':
    depth = rng.choice([40, 1000, 100000])
    data = bytearray(b'[' * depth + b'1' + b']' * depth)
elif kind == 'swap' and os.path.exists(other):
    data = bytearray(open(other, 'rb').read())
open(path, 'wb').write(bytes(data))
EOF
}

sums() { find "$tmp/case" -type f ! -name '*.html' -exec md5sum {} + | sort; }
source "$(dirname "$0")/fuzz_case.sh"
kinds=(truncate flip type nest swap)
passed=0 failed=0 start=$SECONDS
declare -a codes
for n in $(seq 1 "$cases"); do
  [ $((SECONDS - start)) -ge "$budget" ] && break
  rm -rf "$tmp/case" && mkdir -p "$tmp/case" && cp -r "$tmp/orig/." "$tmp/case/"
  kind=${kinds[RANDOM % ${#kinds[@]}]}
  case $((RANDOM % (4 + gpt))) in
    0) file=run/checkpoint.pt; args=(train "${small[@]}" --width 16 --steps 3 --budget 4MiB --resume "$tmp/case/run") ;;
    1) file=run/plan.json; args=(train "${small[@]}" --width 16 --steps 3 --budget 4MiB --resume "$tmp/case/run") ;;
    2) file=plan.json; args=(train "${small[@]}" --width 16 --steps 1 --plan "$tmp/case/plan.json") ;;
    3) file=report.json; args=(report "$tmp/case/report.json" -o "$tmp/case/report.html") ;;
    4) file=gpt/model.json; args=(generate --resume "$tmp/case/gpt" --prompt hacker --tokens 4) ;;
  esac
  mutate "$kind" "$tmp/case/$file" "$tmp/orig/other/$(basename "$file")"
  before=$(sums)
  run_case "$tmp/case" "${args[@]}"
  [ -z "$why" ] && [ "$(sums)" != "$before" ] && why="changed a file it reads"
  codes[$rc]=$(( ${codes[$rc]:-0} + 1 ))
  if [ -n "$why" ]; then
    echo "FAIL case $n ($kind $file): $why: memfit ${args[*]}"; sed 's/^/  | /' "$tmp/stderr" | tail -5
    failed=$((failed + 1))
  else
    passed=$((passed + 1))
  fi
  [ -n "${FUZZ_VERBOSE:-}" ] && echo "case $n: $kind $file: exit $rc: $(head -c 200 "$tmp/stderr")"
done
echo "$passed passed, $failed failed (seed $seed, $((SECONDS - start)) s; exit 0: ${codes[0]:-0}, 1: ${codes[1]:-0}, 2: ${codes[2]:-0})"
[ "$failed" -eq 0 ]
