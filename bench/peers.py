#!/usr/bin/python3
"""memfit against PyTorch's own memory tools, side by side, in one go.

The same model (a ResNet-style chain of 15 layers on Fashion-MNIST, built here
and handed to memfit as TorchScript; or, with --model gpt, memfit's GPT built
layer for layer in Python, on the Jargon File), the same batch, seed,
optimizer (Adam) and thread count, trained for a few steps by

  PyTorch (Debian's python3-torch 1.13, the kernels memfit's LibTorch has):
    what a user tunes by hand: gradient accumulation in 1, 2, 4 and 8
    micro-batches × torch.utils.checkpoint.checkpoint_sequential with each
    segment count or none × bf16 autocast or not;
  PyTorch 2.x (with --torch2 PYTHON, e.g. the venv of scripts/install-torch.sh,
    in a second process with its own meter from --torch2-build), its tools
    too: accumulation in 1, 2, 4 and 8 micro-batches × (none; non-reentrant
    checkpoint_sequential with each segment count; selective activation
    checkpointing, create_selective_checkpoint_contexts saving matmuls and
    convolutions, each layer; torch.compile, inductor on the CPU, with
    torch._functorch.config.activation_memory_budget 1.0, 0.5 and 0.25), in
    fp32; and torch.autograd.graph.save_on_cpu;
  memfit (`memfit train --torchscript ... --budget B`, the plan chosen by
    itself) at each budget where the fastest fitting run changes, and at 1/2,
    1/4 and 1/8 of the plain run's peak, in pairs alternating with that run
    (a fresh process for memfit each time, and for a PyTorch 2.x run too:
    one sample against one, never against the fastest of --repeats).

Both sides' peaks come from the same byte-exact meter: memfit's tracking
allocator, loaded into this Python process from build/bench/libmemfit_meter.so
(it becomes LibTorch's CPU allocator here, as it is in memfit's process).
Step time is the median over the steps after the first.

With --device cuda (a GPU machine; python3 there is PyTorch 2.x with CUDA, and
memfit is built against it, e.g. by scripts/cuda-check.sh into build-cuda):
both sides train on the GPU, the batch copied from host memory inside each
timed step, and both peaks are the CUDA caching allocator's allocated bytes
(torch.cuda.max_memory_allocated here; memfit reads the same counter), each
run's cuBLAS workspaces included: this process drops them before each run,
as memfit's fresh process starts without them. Timing synchronizes the device.

Usage (after `make`, and `make LIBTORCH=pip` for --torch2):
  /usr/bin/python3 bench/peers.py [--model cnn|gpt] [--build build] [--batch 128] [--steps 6] [--threads 2]
                                  [--repeats 1] [--torch2 ~/.cache/memfit/torch-2.15/bin/python --torch2-build build-pip]
On a GPU machine:
  python3 bench/peers.py --device cuda --build build-cuda --torch2 "$(command -v python3)" --torch2-build build-cuda \
                         --model gpt --gpt-size 256,4,4,256 --batch 32 [--no-compile]
"""
import argparse
import contextlib
import ctypes
import functools
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from run_report import environment_text, keep_freed_host_memory, mib, plan_knobs, python_blas

try:
    import numpy as np
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential
except ImportError as e:  # exit 77: ctest's skip
    print(f"peers.py: skipped: {e} (install Debian's python3-torch and run it with /usr/bin/python3)")
    sys.exit(77)

FASHION = "/usr/share/datasets/fashion-mnist"
DEVICE = torch.device("cpu")  # --device
TORCH_VERSION = torch.__version__.split("+")[0]
TORCH2 = int(TORCH_VERSION.split(".")[0]) >= 2


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
        pos = torch.arange(ids.shape[1], dtype=torch.long, device=ids.device)
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
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
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


def set_gpt_size(text, prog):
    """--gpt-size W,D,H,C into GPT (exits with a one-line usage error when it is not four integers)."""
    try:
        GPT.update(zip(GPT.keys(), (int(v) for v in text.split(",")), strict=True))
    except ValueError:
        sys.exit(f"{prog}: --gpt-size {text}: give width,depth,heads,context, e.g. 256,4,4,256")


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

    def allocated(self):
        return self.lib.memfit_meter_allocated()


class CudaMeter:
    """The CUDA caching allocator's allocated bytes: the counter memfit's CUDA peaks read."""

    def reset(self):
        torch.cuda.synchronize()
        # Each run pays for its own cuBLAS workspaces, as memfit's fresh process does.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def peak(self):
        return torch.cuda.max_memory_allocated()

    def allocated(self):
        return torch.cuda.memory_allocated()


def run_pytorch(name, step_fn, make, initial, images, labels, batch, steps, meter, repeats=1):
    """The run with the least median step time of `repeats` (the peak is the same each time)."""
    runs = [run_pytorch_once(name, step_fn, make, initial, images, labels, batch, steps, meter)
            for _ in range(repeats)]
    return min(runs, key=lambda r: r["seconds"])


def run_pytorch_once(name, step_fn, make, initial, images, labels, batch, steps, meter):
    # What an earlier run left behind (torch.compile's caches hold a few MiB) is not this run's: its
    # peak counts from what is held before its model is made, as memfit's process counts from nothing.
    meter.reset()
    held = meter.allocated()
    torch.manual_seed(0)
    model = make().to(DEVICE)
    model.load_state_dict(initial)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    cuda = DEVICE.type == "cuda"
    for s in range(steps):
        if not cuda:
            x = images[s * batch:(s + 1) * batch].clone()
            y = labels[s * batch:(s + 1) * batch].clone()
        else:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if cuda:  # the copy to the device is part of the step, as it is in memfit's
            x = images[s * batch:(s + 1) * batch].to(DEVICE)
            y = labels[s * batch:(s + 1) * batch].to(DEVICE)
        loss = step_fn(model, x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del x, y
    peak = meter.peak() - held
    del model, opt
    return {"side": f"PyTorch {TORCH_VERSION}", "config": name, "peak": peak,
            "seconds": statistics.median(times[1:]), "loss": float(loss)}


def plain(model, x, y):
    loss = loss_of(model(x), y)
    loss.backward()
    return loss.detach()


def checkpointed_forward(segments, reentrant=True):
    """checkpoint_sequential over the model (for token ids: the embedding first, the rest checkpointed, as GPT code does)."""
    extra = {} if not TORCH2 else {"use_reentrant": reentrant}

    def forward(model, x):
        if x.is_floating_point():
            if reentrant:
                x = x.detach().requires_grad_(True)  # use_reentrant checkpointing needs an input that requires grad
            return checkpoint_sequential(model, segments, x, **extra)
        return checkpoint_sequential(model[1:], segments, model[0](x), **extra)
    return forward


def checkpointed(segments, reentrant=True):
    forward = checkpointed_forward(segments, reentrant)

    def step(model, x, y):
        loss = loss_of(forward(model, x), y)
        loss.backward()
        return loss.detach()
    return step


def selective_forward(model, x):
    """Selective activation checkpointing (PyTorch 2.4+): each layer checkpointed,
    keeping the outputs of matrix products and convolutions, recomputing the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    saved = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.convolution.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    context = functools.partial(create_selective_checkpoint_contexts, policy)
    h = x
    for i, layer in enumerate(model):
        if i == 0 and not x.is_floating_point():
            h = layer(h)  # the embedding, as checkpoint_sequential's GPT runs do
        else:
            h = checkpoint(layer, h, use_reentrant=False, context_fn=context)
    return h


def on_cpu(model, x, y):
    """torch.autograd.graph.save_on_cpu: what backward needs, copied to the host (here already the host)."""
    with torch.autograd.graph.save_on_cpu(pin_memory=DEVICE.type == "cuda"):
        out = model(x)
    loss = loss_of(out, y)
    loss.backward()
    return loss.detach()


def compiled_forward(budget):
    """torch.compile (inductor) with the min-cut partitioner's activation memory budget (PyTorch 2.4+)."""
    cache = {}

    def forward(model, x):
        if id(model) not in cache:  # a fresh model per run: compile it once, under this budget
            torch._dynamo.reset()
            torch._functorch.config.activation_memory_budget = budget
            cache.clear()
            cache[id(model)] = torch.compile(model)
        return cache[id(model)](x)
    return forward


def torch2_rows(run, quick, segment_counts, only=None, compile_=True):
    """What a user of PyTorch 2.x tunes by hand, each run through `run(name, step)`: accumulation ×
    (non-reentrant checkpoint_sequential segments, selective checkpointing, torch.compile's activation
    memory budgets), in fp32; save_on_cpu alone. `only`: just the row of that name."""
    tools = [("", lambda model, x: model(x))]
    tools += [(f"checkpoint_sequential {s} non-reentrant", checkpointed_forward(s, False))
              for s in (segment_counts[:1] if quick else segment_counts)]
    tools.append(("selective checkpointing (saves mm, bmm, addmm, convolution) each layer", selective_forward))
    if compile_:
        tools += [(f"torch.compile activation_memory_budget {b}", compiled_forward(b)) for b in (1.0, 0.5, 0.25)]
    grid = []
    for k in (1, 2) if quick else (1, 2, 4, 8):
        for name, forward in tools:
            label = " × ".join(p for p in (f"accumulation {k}" if k > 1 else "", name) if p) or "plain"
            grid.append((label, accumulated(k, forward, False)))
    grid.append(("save_on_cpu", on_cpu))
    if only is not None:
        grid = [(label, step) for label, step in grid if label == only]
        if not grid:
            sys.exit(f"peers.py: --only {only!r} names no PyTorch 2.x row")
    return [run(label, step) for label, step in grid]


def run_torch2(a, python, build, only=None, repeats=None):
    """The PyTorch 2.x rows, from `python` running this script with --peer-rows (`only`: one row, in a
    fresh process, as each pair runs it)."""
    cmd = [python, os.path.abspath(__file__), "--peer-rows", "--build", build, "--model", a.model,
           "--batch", str(a.batch), "--steps", str(a.steps), "--threads", str(a.threads),
           "--repeats", str(repeats or a.repeats), *(["--quick"] if a.quick else []),
           "--device", a.device, *(["--gpt-size", a.gpt_size] if a.gpt_size else []),
           *([] if a.compile else ["--no-compile"]),
           *(["--only", only] if only is not None else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"peers.py: {' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for r in out["rows"]:
        r["second_process"] = True  # never the row of the same name in this process's grid
    return out


def run_memfit(exe, model_args, budget, batch, steps, threads):
    """One fresh `memfit train` process (under --budget unless `budget` is None): its plan, peak, median
    step time after the first, and final loss, or its error."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "run.json")
        cmd = [exe, "train", *model_args, "--batch", str(batch), "--steps", str(steps),
               *([] if budget is None else ["--budget", str(budget)]), "--no-eval", "-q", "--threads", str(threads),
               "--report", report, "--device", str(DEVICE)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        under = "" if budget is None else f"--budget {mib(budget)}"
        if done.returncode != 0:
            return {"side": "memfit", "config": under, "error": done.stderr.strip()}
        with open(report) as f:
            r = json.load(f)
        knobs = plan_knobs(r.get("plan", {}), batch)
        steps_ = r["steps"]
        return {"side": "memfit", "config": ": ".join(p for p in (under, ", ".join(knobs) or "plain") if p),
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
    p.add_argument("--pairs", type=int, default=3, help="memfit against the best hand-tuned run, pairs per budget")
    p.add_argument("--low-precision", action=argparse.BooleanOptionalAction, default=True,
                   help="also compare where precision may change: the hand grid's bf16 autocast rows, and memfit "
                        "--precision any against the whole grid")
    p.add_argument("--quick", action="store_true", help="a small grid (accumulation 1, 2; one segment count)")
    p.add_argument("--torch2", metavar="PYTHON", help="a Python with PyTorch 2.x: its tools too, in a second process")
    p.add_argument("--torch2-build", default="build-pip", help="memfit built against that PyTorch (its meter)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="train both sides on this device (cuda: peaks from the CUDA caching allocator)")
    p.add_argument("--gpt-size", metavar="W,D,H,C",
                   help="with --model gpt: width, depth, heads and context (default %s)" %
                        ",".join(str(v) for v in GPT.values()))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="with --torch2: torch.compile's rows too (inductor compiles each, which takes minutes)")
    p.add_argument("--peer-rows", action="store_true", help=argparse.SUPPRESS)  # --torch2's second process
    p.add_argument("--only", help=argparse.SUPPRESS)  # with --peer-rows: just this row (a pair's peer run)
    a = p.parse_args()
    if a.pairs < 1 or a.repeats < 1 or a.steps < 2:
        sys.exit("peers.py: --pairs and --repeats must be positive and --steps at least 2")
    if a.torch2 and not os.path.exists(a.torch2):
        sys.exit(f"peers.py: --torch2 {a.torch2} does not exist: install it with scripts/install-torch.sh")
    global DEVICE
    DEVICE = torch.device(a.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"peers.py: --device cuda, but PyTorch {torch.__version__} here sees no CUDA device")
    if a.gpt_size:
        set_gpt_size(a.gpt_size, "peers.py")
    exe = os.path.join(a.build, "memfit")
    meter_lib = os.path.join(a.build, "bench", "libmemfit_meter.so")
    meters = [] if DEVICE.type == "cuda" else [meter_lib]
    for f in (meters if a.peer_rows else [exe, *meters]):
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
    meter = CudaMeter() if DEVICE.type == "cuda" else Meter(meter_lib)  # from here on every tensor byte is counted

    def pytorch(name, fn, repeats=a.repeats):
        return run_pytorch(name, fn, make, initial, images, labels, a.batch, a.steps, meter, repeats)

    n_layers = len(make()) - (1 if a.model == "gpt" else 0)
    segment_counts = sorted({2, 3, 4, 5, 8, n_layers} & set(range(2, n_layers + 1)))
    if a.peer_rows:  # PyTorch 1.x: the hand-tuning grid's rows (process_noise.py's peer)
        if TORCH2:
            rows = torch2_rows(pytorch, a.quick, segment_counts, a.only, a.compile)
        else:
            grid = [(n, step) for n, step in hand_grid(a.quick, segment_counts, a.low_precision) if a.only in (None, n)]
            if not grid:
                sys.exit(f"peers.py: --only {a.only!r} names no row of the hand-tuning grid")
            rows = [pytorch(n, step) for n, step in grid]
        print(json.dumps({"rows": rows, "blas": blas, "threads": torch.get_num_threads()}))
        return
    grid = hand_grid(a.quick, segment_counts, a.low_precision)
    rows = [pytorch(name, step) for name, step in grid]
    base = rows[0]
    torch2 = run_torch2(a, a.torch2, a.torch2_build) if a.torch2 else None
    exe2 = os.path.join(a.torch2_build, "memfit") if a.torch2 else None
    peers = rows + (torch2["rows"] if torch2 else [])
    same_math = [r for r in peers if "bf16" not in r["config"]]
    budgets = frontier_budgets(same_math, base)
    extra = ["--batch-statistics", "per-micro-batch"] if a.model == "cnn" else []  # as accumulation changes them
    steps = {name: step for name, step in grid}

    def pair_rows(candidates, budgets, precision):
        """At each budget: the fastest fitting candidate, then pairs of it and memfit's plan, alternating."""
        out = []
        for b in budgets:
            fits = [c for c in candidates if c["peak"] <= b]
            best = min(fits, key=lambda c: c["seconds"]) if fits else None
            ratios, mine, theirs = [], [], []
            for i in range(a.pairs):
                def peer():
                    if best is None:
                        return None
                    if best.get("second_process"):  # a --torch2 row: run again once, in its own process, as memfit is
                        return run_torch2(a, a.torch2, a.torch2_build, only=best["config"], repeats=1)["rows"][0]
                    return pytorch(best["config"], steps[best["config"]], repeats=1)
                def ours():
                    # Against a --torch2 run, memfit built against that LibTorch: the same library on both sides.
                    same_library = best is not None and best.get("second_process") and os.path.exists(exe2 or "")
                    m = run_memfit(exe2 if same_library else exe, model_args + extra + ["--precision", precision], b,
                                   a.batch, a.steps, a.threads)
                    if same_library:
                        m["config"] = f"[{a.torch2_build}] " + m["config"]
                    return m
                if i % 2 == 0:
                    p_ = peer()
                    m_ = ours()
                else:
                    m_ = ours()
                    p_ = peer()
                mine.append(m_)
                if p_ is not None:
                    theirs.append(p_)
                    if "error" not in m_:
                        ratios.append(m_["seconds"] / p_["seconds"])
            out.append({"budget": b, "best": best, "memfit": mine, "peer": theirs, "ratios": ratios})
            # As it goes, so that a run cut short (a lent GPU's time limit) still tells what it measured.
            print(f"peers.py: {precision} {mib(b)}: memfit " + ", ".join(
                f"{1e3 * m['seconds']:.1f} ms ({m['config']})" if "error" not in m else "does not fit" for m in mine) +
                  (f"; {best['side']} {best['config']}: " + ", ".join(f"{1e3 * r['seconds']:.1f} ms" for r in theirs)
                   if best else "; none fits"), file=sys.stderr, flush=True)
        return out

    fp32_pairs = pair_rows(same_math, budgets, "fp32")
    low_budgets = frontier_budgets(peers, base)
    any_pairs = pair_rows(peers, low_budgets, "any") if a.low_precision else []
    print_report(a, description, base, rows, torch2, blas, fp32_pairs, any_pairs)


def hand_grid(quick, segment_counts, low_precision=True):
    """What a user tries by hand: accumulation × checkpoint_sequential segments × bf16 (where `low_precision`:
    the precision may change), each a (name, step)."""
    ks = (1, 2) if quick else (1, 2, 4, 8)
    segs = [None] + (segment_counts[:1] if quick else segment_counts)
    grid = []
    for low in (False, True) if low_precision else (False,):
        for k in ks:
            for s in segs:
                parts = [f"accumulation {k}" if k > 1 else "", f"checkpoint_sequential {s}" if s else "",
                         "bf16 autocast" if low else ""]
                name = " × ".join(p for p in parts if p) or "plain"
                grid.append((name, hand_step(k, s, low)))
    return grid


def hand_step(k, segments, low):
    """k micro-batches, each checkpointed in `segments`, under bf16 autocast where `low`."""
    return accumulated(k, checkpointed_forward(segments) if segments else (lambda model, x: model(x)), low)


def accumulated(k, forward, low):
    """k micro-batches (each loss weighted by its share) through `forward(model, x)`, under bf16 autocast where `low`."""
    def step(model, x, y):
        total = 0.0
        for xs, ys in zip(x.chunk(k), y.chunk(k)):
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=low):
                out = forward(model, xs)
            loss = loss_of(out, ys)
            if k > 1:
                loss = loss * (len(xs) / len(x))
            loss.backward()
            total += float(loss)
        return torch.tensor(total)
    return step


def frontier_budgets(runs, base):
    """The peaks of the runs no other run beats in both peak and time (where the fastest fitting run changes),
    then 1/2, 1/4 and 1/8 of plain's, and half the smallest peak (below every run)."""
    front = [r for r in runs if "error" not in r and not any(
        o["peak"] <= r["peak"] and o["seconds"] < r["seconds"] for o in runs if "error" not in o and o is not r)]
    lowest = min(r["peak"] for r in runs if "error" not in r)
    fractions = {base["peak"] // 2, base["peak"] // 4, base["peak"] // 8, lowest // 2}
    return sorted({r["peak"] for r in front} | fractions, reverse=True)


def print_report(a, description, base, rows, torch2, blas, fp32_pairs, any_pairs):
    meter = ("the CUDA caching allocator's allocated bytes (cuBLAS workspaces included) on both sides, on "
             f"{torch.cuda.get_device_name()}" if DEVICE.type == "cuda" else "memfit's byte-exact meter on both sides")
    print(f"Model: {description}; batch {a.batch}, Adam, {a.steps} steps, {a.threads} threads; peak from {meter}; "
          f"step time the median of steps 2..{a.steps}, the fastest of {a.repeats} run(s).")
    envs = sorted({m["environment"] for p in fp32_pairs + any_pairs for m in p["memfit"] if "environment" in m})
    memfit_env = "; and ".join(envs) if envs else "no memfit run succeeded"
    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads, BLAS: {blas}; memfit: {memfit_env}.")
    if torch2:
        print(f"Against a {torch2['rows'][0]['side']} run, memfit's plan runs from {a.torch2_build}/memfit (built "
              f"against that LibTorch; its plans are marked [{a.torch2_build}]), so both sides run the same library.")
    if torch2:
        t2 = torch2["rows"][0]["side"]
        print(f"{t2} (--torch2 {a.torch2}): {torch2['threads']} threads, BLAS: {torch2['blas']}; its own meter "
              f"({a.torch2_build}/bench/libmemfit_meter.so); 'vs plain' is against its own plain run.")
    print("\nWhat a user tunes by hand: accumulation × checkpoint_sequential segments × bf16 autocast.\n")
    print("| side | configuration | peak | vs plain peak | step time | vs plain time |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows + (torch2["rows"] if torch2 else []):
        own = torch2["rows"][0] if torch2 and r["side"] == torch2["rows"][0]["side"] and r is not base else base
        print(f"| {r['side']} | {r['config']} | {mib(r['peak'])} | {r['peak'] / own['peak']:.2f} | "
              f"{1e3 * r['seconds']:.0f} ms | {r['seconds'] / own['seconds']:.2f}× |")
    batch_stats = " and --batch-statistics per-micro-batch, as accumulation changes BatchNorm's statistics too" \
        if a.model == "cnn" else ""
    print(f"\nAt equal budgets, the math unchanged (fp32): memfit's plan (`memfit train --budget B`{batch_stats}) "
          f"against the fastest hand-tuned fp32 run that fits, in {a.pairs} pair(s) run alternately; ratio: memfit's "
          f"time ÷ that run's, median (min–max) over the pairs.\n")
    pair_table(fp32_pairs, base)
    if any_pairs:
        print("\nAt equal budgets, precision free (bf16 changes the math): memfit's plan with `--precision any` "
              "against the fastest hand-tuned run of the whole grid that fits.\n")
        pair_table(any_pairs, base)


def pair_table(pairs, base):
    print("| budget | fastest hand-tuned run that fits | its time | memfit's plan | memfit's time | memfit ÷ it |")
    print("|---:|---|---:|---|---:|---:|")
    for p in pairs:
        ok = [m for m in p["memfit"] if "error" not in m]
        if not ok:
            best = f"{p['best']['side']}: {p['best']['config']}" if p["best"] else "none fits"
            theirs = f"{1e3 * statistics.median(r['seconds'] for r in p['peer']):.0f} ms" if p["peer"] else ""
            print(f"| {mib(p['budget'])} | {best} | {theirs} | does not fit: "
                  f"{p['memfit'][0]['error'].splitlines()[-1][:240]} | | |")
            continue
        plans = sorted({m["config"] for m in ok})
        mine = statistics.median(m["seconds"] for m in ok)
        plan_text = "; ".join(plans) + ("" if len(ok) == len(p["memfit"]) else f" ({len(p['memfit']) - len(ok)} failed)")
        if p["best"] is None:
            print(f"| {mib(p['budget'])} | none fits | | {plan_text} | {1e3 * mine:.0f} ms "
                  f"({mine / base['seconds']:.2f}× plain) | |")
            continue
        theirs = statistics.median(r["seconds"] for r in p["peer"])
        r = p["ratios"]
        spread = f"{statistics.median(r):.2f} ({min(r):.2f}–{max(r):.2f})" if r else ""
        print(f"| {mib(p['budget'])} | {p['best']['side']}: {p['best']['config']} | {1e3 * theirs:.0f} ms | "
              f"{plan_text} | {1e3 * mine:.0f} ms | {spread} |")

if __name__ == "__main__":
    keep_freed_host_memory()  # as memfit does: both sides allocate alike
    main()
