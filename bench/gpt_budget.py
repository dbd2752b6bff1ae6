#!/usr/bin/env python3
"""The GPT under memory budgets: memfit's plans against the plain run.

Trains the same GPT on the Jargon File (same shape, seed, batch and steps)
plainly and with `memfit train --budget` at 1/2, 1/4 and 1/8 of the plain
step's peak, then evaluates each on the test windows; and asks `memfit
find-batch` for the largest batch that fits the plain step's peak in one
pass, plainly and with checkpointing, bf16 and offload. Prints the budget,
the plan's knobs, the measured peak, the time per sample against plain and
the test loss against plain.

Usage (after `make`; needs only Python's standard library):
  python3 bench/gpt_budget.py [--build build] [--batch 16] [--steps 20] [--threads 2]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from run_report import environment_text, mib, plan_knobs

SHAPE = ["--model", "gpt", "--width", "64", "--depth", "4", "--heads", "4", "--context", "128"]


def train(exe, args, extra, tmp, name):
    report = os.path.join(tmp, name + ".json")
    cmd = [exe, "train", *SHAPE, "--batch", str(args.batch), "--steps", str(args.steps), "--threads",
           str(args.threads), "--eval-batch", "64", "-q", "--report", report, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"gpt_budget.py: {' '.join(cmd)} failed:\n{done.stderr}")
    with open(report) as f:
        r = json.load(f)
    steps = r["steps"]
    knobs = plan_knobs(r.get("plan", {}), args.batch)
    return {"peak": max(s["peak_bytes"] for s in steps),
            "seconds": statistics.median(s["seconds"] for s in steps[1:]), "test_loss": r["summary"]["test_loss"],
            "knobs": ", ".join(knobs) or "none", "environment": environment_text(r)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    exe = os.path.join(args.build, "memfit")
    if not os.path.exists(exe):
        sys.exit(f"gpt_budget.py: {exe} is missing: build memfit first (make)")
    with tempfile.TemporaryDirectory() as tmp:
        plain = train(exe, args, [], tmp, "plain")
        rows = [("none", plain)]
        for k in (2, 4, 8):
            budget = plain["peak"] // k
            rows.append((f"1/{k}: {mib(budget)}", train(exe, args, ["--budget", str(budget)], tmp, f"b{k}")))
        found = subprocess.run([exe, "find-batch", *SHAPE, "--batch", str(args.batch), "--budget",
                                str(plain["peak"]), "--precision", "any", "--threads", str(args.threads), "--json"],
                               capture_output=True, text=True)
    print(f"GPT: width 64, 4 blocks, 4 heads, context 128, batch {args.batch}, Adam, {args.steps} steps, "
          f"{args.threads} threads; time is the median step time of steps 2..{args.steps}; the test loss is "
          f"the mean next-byte cross-entropy on the test windows after the steps.\n{plain['environment']}.\n")
    print("| budget | plan | step peak | time per sample vs plain | test loss | vs plain |")
    print("|---|---|---:|---:|---:|---:|")
    for budget, r in rows:
        print(f"| {budget} | {r['knobs']} | {mib(r['peak'])} | {r['seconds'] / plain['seconds']:.2f}× | "
              f"{r['test_loss']:.6f} | {r['test_loss'] - plain['test_loss']:+.1e} |")
    if found.returncode == 0:
        f = json.loads(found.stdout)
        a, b = f["plain"], f["with_techniques"]
        print(f"\nLargest batch in one pass under {mib(plain['peak'])} (the plain step's peak at batch "
              f"{args.batch}), `memfit find-batch --precision any`: plain {a['batch']}, with techniques "
              f"{b['batch']} ({b['precision']}, checkpoint {b['checkpoint']}"
              f"{', selective recompute' if b.get('selective_recompute') else ''}, offload {b['offload']}; "
              f"measured {mib(b['measured_peak_bytes'])}): {b['batch'] / max(a['batch'], 1):.2f}×.")
    else:
        print(f"\nfind-batch failed: {found.stderr.strip()}")


if __name__ == "__main__":
    main()
