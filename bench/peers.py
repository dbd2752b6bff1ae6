#!/usr/bin/python3
"""memfit against PyTorch's own memory tools, side by side, in one go.

The same model (a ResNet-style chain of 15 layers on Fashion-MNIST, built here
and handed to memfit as TorchScript), the same batch, seed, optimizer (Adam)
and thread count, trained for a few steps by

  PyTorch (Debian's python3-torch 1.13, the kernels memfit's LibTorch has):
    plain; torch.utils.checkpoint.checkpoint_sequential with each segment
    count; bf16 autocast; gradient accumulation in 2, 4 and 8 micro-batches;
  memfit (`memfit train --torchscript ... --budget B`, the plan chosen by
    itself) at budgets equal to each checkpoint_sequential run's peak, and at
    1/2, 1/4 and 1/8 of the plain run's peak.

Both sides' peaks come from the same byte-exact meter: memfit's tracking
allocator, loaded into this Python process from build/bench/libmemfit_meter.so
(it becomes LibTorch's CPU allocator here, as it is in memfit's process).
Step time is the median over the steps after the first.

Usage (after `make`):
  /usr/bin/python3 bench/peers.py [--build build] [--batch 128] [--steps 6] [--threads 2] [--repeats 1]
"""
import argparse
import ctypes
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

try:
    import numpy as np
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint_sequential
except ImportError as e:  # exit 77: ctest's skip
    print(f"peers.py: skipped: {e} (install Debian's python3-torch and run it with /usr/bin/python3)")
    sys.exit(77)

FASHION = "/usr/share/datasets/fashion-mnist"


class Block(nn.Module):
    """A basic residual block, as memfit's built-in ResNet has."""

    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


def make_chain(width=16):
    layers = [nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    c = width
    for stage, stride in enumerate([1, 2, 2]):
        out = width * 2**stage
        for b in range(3):
            layers.append(Block(c, out, stride if b == 0 else 1))
            c = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10)]
    return nn.Sequential(*layers)


def read_idx(name):
    with gzip.open(os.path.join(FASHION, name + ".gz"), "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


class Meter:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        for f in ("memfit_meter_install", "memfit_meter_allocated", "memfit_meter_peak"):
            getattr(self.lib, f).restype = ctypes.c_int64
        self.lib.memfit_meter_install()

    def reset(self):
        self.lib.memfit_meter_reset_peak()

    def peak(self):
        return self.lib.memfit_meter_peak()


def mib(b):
    return f"{b / 2**20:.2f} MiB"


def run_pytorch(name, step_fn, initial, images, labels, batch, steps, meter, repeats=1):
    """The run with the least median step time of `repeats` (the peak is the same each time)."""
    runs = [run_pytorch_once(name, step_fn, initial, images, labels, batch, steps, meter) for _ in range(repeats)]
    return min(runs, key=lambda r: r["seconds"])


def run_pytorch_once(name, step_fn, initial, images, labels, batch, steps, meter):
    torch.manual_seed(0)
    model = make_chain()
    model.load_state_dict(initial)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    meter.reset()
    for s in range(steps):
        x = images[s * batch:(s + 1) * batch].clone()
        y = labels[s * batch:(s + 1) * batch].clone()
        start = time.perf_counter()
        loss = step_fn(model, x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        del x, y
    peak = meter.peak()
    del model, opt
    return {"side": "PyTorch", "config": name, "peak": peak, "seconds": statistics.median(times[1:]),
            "loss": float(loss)}


def plain(model, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def checkpointed(segments):
    def step(model, x, y):
        x.requires_grad_(True)  # use_reentrant checkpointing needs an input that requires grad
        loss = nn.functional.cross_entropy(checkpoint_sequential(model, segments, x), y)
        loss.backward()
        return loss.detach()
    return step


def bf16(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    loss = nn.functional.cross_entropy(out.float(), y)
    loss.backward()
    return loss.detach()


def accumulated(k):
    def step(model, x, y):
        total = 0.0
        for xs, ys in zip(x.chunk(k), y.chunk(k)):
            loss = nn.functional.cross_entropy(model(xs), ys) * (len(xs) / len(x))
            loss.backward()
            total += float(loss)
        return torch.tensor(total)
    return step


def run_memfit(exe, script, budget, batch, steps, threads, data_dir):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "run.json")
        cmd = [exe, "train", "--torchscript", script, "--batch", str(batch), "--steps", str(steps),
               "--budget", str(budget), "--no-eval", "-q", "--threads", str(threads), "--report", report,
               "--data", data_dir]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return {"side": "memfit", "config": f"--budget {mib(budget)}", "error": done.stderr.strip()}
        with open(report) as f:
            r = json.load(f)
        plan = r.get("plan", {})
        knobs = []
        if plan.get("micro_batch", 0) and plan["micro_batch"] < batch:
            knobs.append(f"micro-batch {plan['micro_batch']}")
        if plan.get("checkpoint", "none") not in ("none", ""):
            knobs.append(f"checkpoint {plan['checkpoint']}")
        if plan.get("precision", "fp32") != "fp32":
            knobs.append(plan["precision"])
        if plan.get("offload", "none") != "none":
            knobs.append("offload " + plan["offload"])
        steps_ = r["steps"]
        return {"side": "memfit", "config": f"--budget {mib(budget)}: " + (", ".join(knobs) or "plain"),
                "peak": max(s["peak_bytes"] for s in steps_), "seconds": statistics.median(s["seconds"] for s in steps_[1:]),
                "loss": r["summary"]["final_loss"], "budget": budget}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration; the fastest is kept")
    a = p.parse_args()
    exe = os.path.join(a.build, "memfit")
    meter_lib = os.path.join(a.build, "bench", "libmemfit_meter.so")
    for f in (exe, meter_lib):
        if not os.path.exists(f):
            sys.exit(f"peers.py: {f} is missing: build memfit first (make)")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = make_chain()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    tmp = tempfile.mkdtemp()
    script = os.path.join(tmp, "chain.pt")
    torch.jit.script(model).save(script)
    del model

    n = a.batch * a.steps
    images = torch.from_numpy(read_idx("train-images-idx3-ubyte")[:n].copy()).float().div_(255)
    images = images.sub_(0.2860).div_(0.3530).unsqueeze(1)
    labels = torch.from_numpy(read_idx("train-labels-idx1-ubyte")[:n].astype(np.int64))
    meter = Meter(meter_lib)  # from here on every CPU tensor byte is counted

    rows = [run_pytorch("plain", plain, initial, images, labels, a.batch, a.steps, meter, a.repeats)]
    n_layers = len(make_chain())
    for segments in (2, 3, 4, 5, 8, n_layers):
        rows.append(run_pytorch(f"checkpoint_sequential, {segments} segments", checkpointed(segments), initial,
                                images, labels, a.batch, a.steps, meter, a.repeats))
    rows.append(run_pytorch("bf16 autocast", bf16, initial, images, labels, a.batch, a.steps, meter, a.repeats))
    for k in (2, 4, 8):
        rows.append(run_pytorch(f"accumulation, {k} micro-batches", accumulated(k), initial, images, labels,
                                a.batch, a.steps, meter, a.repeats))
    base = rows[0]
    # One budget per distinct peak (to the KiB), and 1/2, 1/4, 1/8 of plain.
    peaks = {}
    for r in rows:
        if r["config"].startswith("checkpoint"):
            peaks.setdefault(r["peak"] // 1024, r["peak"])
    budgets = sorted(set(peaks.values()) | {base["peak"] // 2, base["peak"] // 4, base["peak"] // 8}, reverse=True)
    for b in budgets:
        runs = [run_memfit(exe, script, b, a.batch, a.steps, a.threads, FASHION) for _ in range(a.repeats)]
        ok = [r for r in runs if "error" not in r]
        rows.append(min(ok, key=lambda r: r["seconds"]) if ok else runs[0])

    print(f"Model: a ResNet-style chain of {n_layers} layers (width 16, 3 stages of 3 blocks), Fashion-MNIST, "
          f"batch {a.batch}, Adam, {a.steps} steps, {a.threads} threads; peak from memfit's byte-exact meter on "
          f"both sides; step time the median of steps 2..{a.steps}, the fastest of {a.repeats} run(s).\n")
    print("| side | configuration | peak | vs plain peak | step time | vs plain time |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['side']} | {r['config']} | does not fit: {r['error'].splitlines()[-1][:120]} | | | |")
            continue
        print(f"| {r['side']} | {r['config']} | {mib(r['peak'])} | {r['peak'] / base['peak']:.2f} | "
              f"{1e3 * r['seconds']:.0f} ms | {r['seconds'] / base['seconds']:.2f}× |")
    print("\nAt equal budgets: memfit's plan against the fastest checkpoint_sequential run whose peak fits.\n")
    print("| budget | fastest checkpoint_sequential that fits | its time | memfit's time | memfit faster by |")
    print("|---:|---|---:|---:|---:|")
    ck = [r for r in rows if r["side"] == "PyTorch" and r["config"].startswith("checkpoint")]
    for r in rows:
        if r["side"] != "memfit" or "error" in r:
            continue
        fits = [c for c in ck if c["peak"] <= r["budget"]]
        if not fits:
            print(f"| {mib(r['budget'])} | none fits | | {1e3 * r['seconds']:.0f} ms | |")
            continue
        best = min(fits, key=lambda c: c["seconds"])
        print(f"| {mib(r['budget'])} | {best['config']} | {1e3 * best['seconds']:.0f} ms | "
              f"{1e3 * r['seconds']:.0f} ms | {best['seconds'] / r['seconds']:.2f}× |")


if __name__ == "__main__":
    main()
