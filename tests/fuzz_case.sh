# Shared by tests/cli_fuzz.sh and tests/file_fuzz.sh (sourced; they set $bin and $tmp).
# run_case DIR ARGS...: runs memfit with ARGS under a 120 s limit, output in
# $tmp/stdout and $tmp/stderr; sets rc, and why: empty when the case behaved,
# else a hang, a crash, a usage error in more than one line, or a temporary
# file left under DIR.
run_case() {
  local dir=$1
  shift
  timeout -s KILL 120 "$bin" "$@" >"$tmp/stdout" 2>"$tmp/stderr"
  rc=$?
  why=""
  if [ "$rc" -eq 137 ]; then why="ran past 120 s (a hang?)"
  elif [ "$rc" -gt 2 ]; then why="exit $rc (a crash?)"
  elif [ "$rc" -eq 2 ] && [ "$(wc -l <"$tmp/stderr")" -ne 1 ]; then why="a usage error in $(wc -l <"$tmp/stderr") lines"
  elif [ -n "$(find "$dir" -name '*.tmp*' -print -quit)" ]; then why="left $(find "$dir" -name '*.tmp*' | head -1)"
  fi
}
