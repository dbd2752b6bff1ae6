#!/usr/bin/python3
"""How much one process's step time varies from the next on this machine, on both sides.

Alternates ROUNDS fresh processes of the same step: memfit (`memfit train`,
the GPT of bench/peers.py, batch 16 in micro-batches of 8) and PyTorch Python
(bench/peers.py --peer-rows --only "accumulation 2", the same step, with the
meter from the same build). Each process's time is its median step after the
first, as bench/peers.py reads it. A pair's ratio is only as steady as these.

Usage: python3 bench/process_noise.py [--build build] [--python /usr/bin/python3] [--rounds 6] [--steps 10]
  (PyTorch 2.15: --build build-pip --python ~/.cache/memfit/torch-2.15/bin/python)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import GPT, run_memfit  # noqa: E402


def memfit_once(build, steps):
    gpt = ["--model", "gpt", *[f"--{k}={v}" for k, v in GPT.items()], "--micro-batch", "8"]
    run = run_memfit(os.path.join(build, "memfit"), gpt, None, 16, steps, 2)
    if "error" in run:
        sys.exit(f"process_noise.py: memfit train failed: {run['error'][-2000:]}")
    return run["seconds"]


def python_once(python, build, steps):
    cmd = [python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers.py"), "--peer-rows", "--build",
           build, "--model", "gpt", "--batch", "16", "--steps", str(steps), "--threads", "2", "--repeats", "1",
           "--only", "accumulation 2"]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["rows"][0]["seconds"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--python", default="/usr/bin/python3")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    if a.rounds < 1 or a.steps < 2:
        sys.exit("process_noise.py: --rounds must be positive and --steps at least 2")
    mine, theirs = [], []
    print("| round | memfit | PyTorch Python |\n|---:|---:|---:|")
    for r in range(a.rounds):
        mine.append(memfit_once(a.build, a.steps))
        theirs.append(python_once(a.python, a.build, a.steps))
        print(f"| {r + 1} | {1e3 * mine[-1]:.1f} ms | {1e3 * theirs[-1]:.1f} ms |", flush=True)
    for name, t in (("memfit", mine), ("PyTorch Python", theirs)):
        print(f"{name}: min {1e3 * min(t):.1f} ms, median {1e3 * statistics.median(t):.1f} ms, "
              f"max {1e3 * max(t):.1f} ms (max/min {max(t) / min(t):.2f})")


if __name__ == "__main__":
    main()
