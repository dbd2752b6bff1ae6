#!/usr/bin/env python3
"""Replays the timed choices of `bench/plan_stability.sh ... tight` output
under two rules, to compare them on the same measurements:

- one band: of the candidates measured within the run's tie band (3%, or
  its timing noise) of the fastest, the one that does least;
- two bands (since 2026-11-27, detail::choose_timed): of each micro-batch
  size, the one that does least within the run's band of that size's
  fastest and within 5% (or the run's band, the wider) of the fastest of
  all; then the one of those that does least.

"Does least" is the planner's order: no recomputation, then less offload,
then fewer micro-batches, then the faster. A larger offload of the same step
(same micro-batch and schedule) counts at least the time of the smaller one,
as the planner's offload_adds_copies does. Runs a busy machine decided
(what the plans do, not times) are left out. Each run's own plan is the
one-band rule's where the output came from a build before 2026-11-27's
change, and the two-band rule's after it: the script counts both, to show
that the replay is faithful.

Usage: python3 bench/stability_rules.py FILE [--batch 128]
"""
import argparse
import collections
import re
import sys

OFFLOAD = {"none": 0, "optimizer": 1, "optimizer, gradients": 2}


def parse(path):
    cases, case, run = [], None, None
    for line in open(path):
        line = line.rstrip("\n")
        if line.startswith("== "):
            case = {"name": line[3:], "runs": []}
            cases.append(case)
        elif line.startswith("micro-batch ") and case is not None:
            m = re.match(r"micro-batch (\d+), (\w+), checkpoint (.*), offload (.*?); tie ([\d.]+), (\w+),", line)
            plan = (int(m.group(1)), m.group(4), m.group(3).replace("0: ", ""))
            run = {"plan": plan, "tie": float(m.group(5)), "busy": m.group(6) == "busy", "timed": []}
            case["runs"].append(run)
        elif line.startswith("  timed: ") and run is not None:
            for item in line[len("  timed: "):].split("; "):
                m = re.match(r"(\d+) (.*?) \[(.*)\] ([\d.]+) ms", item)
                if m and float(m.group(4)) > 0:
                    run["timed"].append((int(m.group(1)), m.group(2), m.group(3), float(m.group(4))))
    return cases


def key(c, batch):
    mb, offload, ckpt, ms = c
    return ("*" in ckpt, OFFLOAD.get(offload, 3), batch // mb, ms)


def with_copies(timed):
    out = []
    for c in timed:
        ms = c[3]
        for d in timed:
            if d[0] == c[0] and d[2] == c[2] and OFFLOAD.get(d[1], 3) < OFFLOAD.get(c[1], 3):
                ms = max(ms, d[3])
        out.append((c[0], c[1], c[2], ms))
    return out


def one_band(timed, tie, batch):
    fastest = min(c[3] for c in timed)
    return min((c for c in timed if c[3] <= fastest * (1 + tie)), key=lambda c: key(c, batch))


def two_bands(timed, tie, batch):
    fastest = min(c[3] for c in timed)
    picks = []
    for mb in sorted({c[0] for c in timed}):
        same = [c for c in timed if c[0] == mb]
        near = min(c[3] for c in same)
        running = [c for c in same if c[3] <= near * (1 + tie) and c[3] <= fastest * (1 + max(0.05, tie))]
        if running:
            picks.append(min(running, key=lambda c: key(c, batch)))
    return min(picks, key=lambda c: key(c, batch))


def main():
    """Prints the replay; exits 1 where a run's own plan is neither rule's (the replay would not be faithful)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file")
    p.add_argument("--batch", type=int, default=128)
    a = p.parse_args()
    unfaithful = 0
    for case in parse(a.file):
        runs = [r for r in case["runs"] if not r["busy"] and r["timed"]]
        if not runs:
            continue
        print(f"== {case['name']}")
        chosen = collections.defaultdict(list)
        faithful = collections.Counter()
        for r in runs:
            timed = with_copies(r["timed"])
            for name, rule in (("one band", one_band), ("two bands", two_bands)):
                c = rule(timed, r["tie"], a.batch)
                chosen[name].append(c[:3])
            for name in chosen:
                faithful[name] += chosen[name][-1] == r["plan"]
            unfaithful += all(plans[-1] != r["plan"] for plans in chosen.values())
            print(f"  tie {r['tie']:.2f}: one band {fmt(chosen['one band'][-1])}; two bands {fmt(chosen['two bands'][-1])}"
                  f"; the run chose {fmt(r['plan'])}")
        for name, plans in chosen.items():
            same = collections.Counter(plans).most_common(1)[0][1]
            size = collections.Counter(p[0] for p in plans).most_common(1)[0][1]
            print(f"-- {name}: the same plan in {same} of {len(plans)}; the same micro-batch in {size} of {len(plans)}")
        print(f"-- each run's own plan is the one-band replay's in {faithful['one band']} of {len(runs)}, "
              f"the two-band replay's in {faithful['two bands']}")
    if unfaithful:
        print(f"stability_rules.py: {unfaithful} run(s) chose a plan that neither rule replays from its timed "
              f"candidates: the output's format or the planner's rule has changed", file=sys.stderr)
        sys.exit(1)


def fmt(plan):
    return f"{plan[0]} {plan[1]} [{plan[2]}]"


if __name__ == "__main__":
    main()
