#!/usr/bin/env bash
# The layers of ../DESIGN.md, checked on the sources: nothing below the
# planner includes a planner header, and no public header includes an
# internal one. Prints each offending include and exits 1.
set -u
root=${1:?usage: layers_test.sh SOURCE_DIR}
cd "$root" || exit 2
status=0
# The planner: plan.h, module_plan.h, the step model, the choice, the report and the wire format.
planner='^(src/(plan|module_plan|plan_model|plan_choice|plan_report)\.cpp|src/plan_(model|choice|report|wire)\.h|include/memfit/(plan|module_plan)\.h)$'
for f in src/*.cpp src/*.h include/memfit/*.h; do
  [[ $f =~ $planner ]] && continue
  if grep -nE '#include "(memfit/)?(plan|module_plan|plan_model|plan_choice|plan_report|plan_wire)\.h"' "$f"; then
    echo "$f: below the planner, it includes a planner header" >&2
    status=1
  fi
done
for f in include/memfit/*.h; do
  if grep -nE '#include "[^/"]+\.h"' "$f"; then
    echo "$f: a public header includes an internal one (only memfit/... headers are installed)" >&2
    status=1
  fi
done
[ $status = 0 ] && echo "layers: nothing below the planner includes it; public headers include only public ones"
exit $status
