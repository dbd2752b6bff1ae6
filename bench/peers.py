#!/usr/bin/python3
"""memfit against PyTorch's own memory tools, side by side, in one go.

The same model (a ResNet-style chain of 15 layers on Fashion-MNIST, built here
and handed to memfit as TorchScript; or, with --model gpt, memfit's GPT built
layer for layer in Python, on the Jargon File), the same batch, seed,
optimizer (Adam) and thread count, trained for a few steps by

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
  /usr/bin/python3 bench/peers.py [--model cnn|gpt] [--build build] [--batch 128] [--steps 6] [--threads 2]
                                  [--repeats 1]
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

from run_report import environment_text, mib, plan_knobs, python_blas

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


class GptEmbedding(nn.Module):
    """memfit's GPT, layer for layer (src/models.cpp): token and position embeddings."""

    def __init__(self, vocab, context, width):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.drop = nn.Dropout(0.0)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], dtype=torch.long)
        return self.drop(self.tokens(ids) + self.positions(pos))


class GptBlock(nn.Module):
    """A pre-LayerNorm block: causal attention, then a 4×width GELU MLP."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / (q.shape[-1] ** 0.5))
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        weights = torch.dropout(torch.softmax(scores.masked_fill(mask, float("-inf")), -1), 0.0, self.training)
        y = torch.matmul(weights, v).transpose(1, 2).reshape(b, t, c)
        h = x + self.drop(self.proj(y))
        return h + self.drop(self.out(nn.functional.gelu(self.fc(self.ln2(h)))))


class GptHead(nn.Module):
    def __init__(self, width, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.logits = nn.Linear(width, vocab, bias=False)

    def forward(self, x):
        return self.logits(self.ln(x))


GPT = {"width": 64, "depth": 4, "heads": 4, "context": 128}


def make_gpt(vocab):
    g = GPT
    return nn.Sequential(GptEmbedding(vocab, g["context"], g["width"]),
                         *[GptBlock(g["width"], g["heads"]) for _ in range(g["depth"])],
                         GptHead(g["width"], vocab))


def read_jargon(context, n):
    """The first n training windows of memfit's text_windows: byte ids and the next bytes."""
    with gzip.open("/usr/share/doc/jargon-text/jargon.txt.gz", "rb") as f:
        text = np.frombuffer(f.read(), dtype=np.uint8)
    vocab = np.unique(text)
    ids = np.searchsorted(vocab, text).astype(np.int64)
    x = torch.from_numpy(ids[:n * context].reshape(n, context).copy())
    y = torch.from_numpy(ids[1:n * context + 1].reshape(n, context).copy())
    return x, y, len(vocab)


def loss_of(out, y):
    """Cross-entropy as memfit's Trainer takes it: per class, or per token (mean over all)."""
    if out.dim() > 2:
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return nn.functional.cross_entropy(out.float(), y)


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


def run_pytorch(name, step_fn, make, initial, images, labels, batch, steps, meter, repeats=1):
    """The run with the least median step time of `repeats` (the peak is the same each time)."""
    runs = [run_pytorch_once(name, step_fn, make, initial, images, labels, batch, steps, meter)
            for _ in range(repeats)]
    return min(runs, key=lambda r: r["seconds"])


def run_pytorch_once(name, step_fn, make, initial, images, labels, batch, steps, meter):
    torch.manual_seed(0)
    model = make()
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
    loss = loss_of(model(x), y)
    loss.backward()
    return loss.detach()


def checkpointed(segments):
    def step(model, x, y):
        if x.is_floating_point():
            x.requires_grad_(True)  # use_reentrant checkpointing needs an input that requires grad
            out = checkpoint_sequential(model, segments, x)
        else:  # token ids: the embedding runs first, as GPT code does, and the rest is checkpointed
            out = checkpoint_sequential(model[1:], segments, model[0](x))
        loss = loss_of(out, y)
        loss.backward()
        return loss.detach()
    return step


def bf16(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    loss = loss_of(out, y)
    loss.backward()
    return loss.detach()


def accumulated(k):
    def step(model, x, y):
        total = 0.0
        for xs, ys in zip(x.chunk(k), y.chunk(k)):
            loss = loss_of(model(xs), ys) * (len(xs) / len(x))
            loss.backward()
            total += float(loss)
        return torch.tensor(total)
    return step


def run_memfit(exe, model_args, budget, batch, steps, threads):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "run.json")
        cmd = [exe, "train", *model_args, "--batch", str(batch), "--steps", str(steps),
               "--budget", str(budget), "--no-eval", "-q", "--threads", str(threads), "--report", report]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return {"side": "memfit", "config": f"--budget {mib(budget)}", "error": done.stderr.strip()}
        with open(report) as f:
            r = json.load(f)
        knobs = plan_knobs(r.get("plan", {}), batch)
        steps_ = r["steps"]
        return {"side": "memfit", "config": f"--budget {mib(budget)}: " + (", ".join(knobs) or "plain"),
                "peak": max(s["peak_bytes"] for s in steps_), "seconds": statistics.median(s["seconds"] for s in steps_[1:]),
                "loss": r["summary"]["final_loss"], "budget": budget, "environment": environment_text(r)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration; the fastest is kept")
    p.add_argument("--model", choices=["cnn", "gpt"], default="cnn")
    a = p.parse_args()
    exe = os.path.join(a.build, "memfit")
    meter_lib = os.path.join(a.build, "bench", "libmemfit_meter.so")
    for f in (exe, meter_lib):
        if not os.path.exists(f):
            sys.exit(f"peers.py: {f} is missing: build memfit first (make)")
    torch.set_num_threads(a.threads)
    blas, warning = python_blas()
    if warning:
        print(f"peers.py: warning: {warning}", file=sys.stderr)
    tmp = tempfile.mkdtemp()
    if a.model == "gpt":
        n = a.batch * a.steps
        images, labels, vocab = read_jargon(GPT["context"], n)
        make = lambda: make_gpt(vocab)  # noqa: E731
        model_args = ["--model", "gpt", *[f"--{k}={v}" for k, v in GPT.items()]]
        description = (f"the GPT of width {GPT['width']}, {GPT['depth']} blocks, {GPT['heads']} heads and context "
                       f"{GPT['context']} (memfit's make_gpt, layer for layer) on the Jargon File; PyTorch's "
                       f"checkpoint_sequential runs the embedding first and checkpoints the blocks and the head")
    else:
        make = make_chain
        torch.manual_seed(0)
        script = os.path.join(tmp, "chain.pt")
        torch.jit.script(make_chain()).save(script)
        model_args = ["--torchscript", script, "--data", FASHION]
        n = a.batch * a.steps
        images = torch.from_numpy(read_idx("train-images-idx3-ubyte")[:n].copy()).float().div_(255)
        images = images.sub_(0.2860).div_(0.3530).unsqueeze(1)
        labels = torch.from_numpy(read_idx("train-labels-idx1-ubyte")[:n].astype(np.int64))
        description = "a ResNet-style chain of 15 layers (width 16, 3 stages of 3 blocks) on Fashion-MNIST"
    torch.manual_seed(0)
    initial = {k: v.clone() for k, v in make().state_dict().items()}
    meter = Meter(meter_lib)  # from here on every CPU tensor byte is counted

    def pytorch(name, fn):
        return run_pytorch(name, fn, make, initial, images, labels, a.batch, a.steps, meter, a.repeats)

    rows = [pytorch("plain", plain)]
    n_layers = len(make()) - (1 if a.model == "gpt" else 0)
    for segments in sorted({2, 3, 4, 5, 8, n_layers} & set(range(2, n_layers + 1))):
        rows.append(pytorch(f"checkpoint_sequential, {segments} segments", checkpointed(segments)))
    rows.append(pytorch("bf16 autocast", bf16))
    for k in (2, 4, 8):
        rows.append(pytorch(f"accumulation, {k} micro-batches", accumulated(k)))
    base = rows[0]
    # One budget per distinct peak (to the KiB), and 1/2, 1/4, 1/8 of plain.
    peaks = {}
    for r in rows:
        if r["config"].startswith("checkpoint"):
            peaks.setdefault(r["peak"] // 1024, r["peak"])
    budgets = sorted(set(peaks.values()) | {base["peak"] // 2, base["peak"] // 4, base["peak"] // 8}, reverse=True)
    for b in budgets:
        runs = [run_memfit(exe, model_args, b, a.batch, a.steps, a.threads) for _ in range(a.repeats)]
        ok = [r for r in runs if "error" not in r]
        rows.append(min(ok, key=lambda r: r["seconds"]) if ok else runs[0])

    print(f"Model: {description}; batch {a.batch}, Adam, {a.steps} steps, {a.threads} threads; peak from memfit's "
          f"byte-exact meter on "
          f"both sides; step time the median of steps 2..{a.steps}, the fastest of {a.repeats} run(s).")
    memfit_env = next((r["environment"] for r in rows if "environment" in r), "no memfit run succeeded")
    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads, BLAS: {blas}; memfit: {memfit_env}.\n")
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
