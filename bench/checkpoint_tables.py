#!/usr/bin/env python3
"""The tables of docs/checkpointing.md from memfit_checkpoint_bench's console output.

Usage: python3 bench/checkpoint_tables.py docs/measurements/checkpoint.txt
Prints (1) sqrt(n) and the optimal schedule at 1/2 and 1/4 of the plain
activation peak against the best checkpoint_sequential split, per chain, and
(2) the memory-time curve of the 64-block chains and the ResNet, with the cost
model's own prediction of optimal / best split.
"""
import re
import sys


def rows(path):
    """{benchmark name without its /iterations or /min_time suffix: {counter: value or text}}."""
    out = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"^((?:sqrt|optimal|model|overhead)/\S+?)(?:/(?:iterations|min_time):\S+)?\s+(.*)$", line)
            if not m:
                continue
            counters = dict(re.findall(r"(\S+?)=(\S+)", m.group(2)))
            if "ERROR OCCURRED" in m.group(2):
                counters["error"] = m.group(2).split("ERROR OCCURRED:", 1)[1].strip().strip("'")
            out[m.group(1)] = counters
    return out


def f2(x):
    return f"{float(x):.2f}"


def times(x):
    return f"{float(x):.2f}×"


def optimal_cell(r):
    if r is None:
        return "—"
    if "error" in r:
        least = re.search(r"needs ([0-9.]+ [KMG]iB)", r["error"])
        return f"does not fit (the least is {least.group(1)})" if least else "does not fit"
    return f"{f2(r['opt_mem_ratio'])}, {times(r['optimal_vs_plain'])}"


def split_cell(r):
    if r is None or "error" in r or float(r.get("seq_segments", 0)) == 0:
        return "no split fits"
    return f"{int(float(r['seq_segments']))}, {f2(r['seq_mem_ratio'])}, {times(r['ckseq_vs_plain'])}"


def ratio_cell(r, bold_below=0.95):
    if r is None or "error" in r or float(r.get("seq_segments", 0)) == 0:
        return "—"
    v = float(r["optimal_vs_ckseq"])
    return f"**{v:.2f}**" if v < bold_below else f"{v:.2f}"


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: checkpoint_tables.py OUTPUT_OF_memfit_checkpoint_bench")
    r = rows(sys.argv[1])
    print("| chain | n | plain activations | sqrt(n): memory, time | optimal ½: memory, time | "
          "best ckseq ½: segments, memory, time | optimal ÷ ckseq ½ | optimal ¼: memory, time | "
          "best ckseq ¼: segments, memory, time | optimal ÷ ckseq ¼ |")
    print("|---|---:|---:|---|---|---|---:|---|---|---:|")
    for name, s in r.items():
        if not name.startswith("sqrt/"):
            continue
        _, chain, n = name.split("/")
        half, quarter = r.get(f"optimal/{chain}/{n}/0.50"), r.get(f"optimal/{chain}/{n}/0.25")
        print(f"| {chain} | {n} | {float(s['plain_act_MiB']):.2f} MiB | {f2(s['mem_ratio'])}, "
              f"{times(s['sqrt_vs_plain'])} | {optimal_cell(half)} | {split_cell(half)} | {ratio_cell(half)} | "
              f"{optimal_cell(quarter)} | {split_cell(quarter)} | {ratio_cell(quarter)} |")
    print()
    print("| chain | budget | optimal: memory, time | best ckseq: segments, memory, time | optimal ÷ ckseq | model |")
    print("|---|---:|---|---|---:|---:|")
    for name, s in r.items():
        parts = name.split("/")
        if parts[0] != "optimal" or (parts[2] != "64" and parts[1] != "resnet"):
            continue
        chain, n, budget = parts[1], parts[2], parts[3]
        model = r.get(f"model/{chain}/{n}", {}).get(f"opt/seq@{budget}")
        model_cell = f2(model) if model and float(model) > 0 else "—"
        print(f"| {chain} | {budget} | {optimal_cell(s)} | {split_cell(s)} | {ratio_cell(s)} | {model_cell} |")
    overhead = r.get("overhead/checkpoint")
    if overhead:
        print("\noverhead/checkpoint: " + ", ".join(f"{k}={v}" for k, v in overhead.items()))


if __name__ == "__main__":
    main()
