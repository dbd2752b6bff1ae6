#!/usr/bin/env bash
# kill -9 during saves, ROUNDS times (#20's measure): each round starts a run
# that saves every step, kills it the moment a temporary checkpoint file
# appears, and resumes the folder. Prints how many rounds were killed mid-save
# and how many left a checkpoint that did not resume.
# Usage: bash scripts/kill-during-save.sh [MEMFIT_BINARY] [ROUNDS]
set -u
bin=${1:-build/memfit}
rounds=${2:-20}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mid_save=0 unreadable=0
for round in $(seq 1 "$rounds"); do
  rm -rf "$tmp/ck"
  "$bin" train --model resnet --batch 8 --steps 100000 --no-eval -q --save "$tmp/ck" --save-every 1 \
    >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do [ -e "$tmp/ck/checkpoint.pt" ] && break; sleep 0.05; done
  deadline=$((SECONDS + 20))
  while kill -0 "$pid" 2>/dev/null && ! compgen -G "$tmp/ck/checkpoint.pt.tmp.*" >/dev/null &&
        [ "$SECONDS" -lt "$deadline" ]; do :; done
  kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  compgen -G "$tmp/ck/checkpoint.pt.tmp.*" >/dev/null && mid_save=$((mid_save + 1))
  if ! "$bin" train --model resnet --batch 8 --steps 1 --no-eval -q --resume "$tmp/ck" >/dev/null 2>&1; then
    unreadable=$((unreadable + 1))
  fi
  # The next save into the folder removes the temporaries (a new run: the old checkpoint goes first).
  if compgen -G "$tmp/ck/checkpoint.pt.tmp.*" >/dev/null && rm -f "$tmp/ck/checkpoint.pt" &&
     ! "$bin" train --model resnet --batch 8 --steps 1 --no-eval -q --save "$tmp/ck" >/dev/null 2>&1; then :; fi
done
left=$(compgen -G "$tmp/ck/checkpoint.pt.tmp.*" | wc -l)
echo "rounds $rounds, killed mid-save $mid_save, unreadable checkpoints $unreadable, temporaries left after the last save $left"
