#!/usr/bin/python3
"""memfit's library tax: its Trainer against a hand-written LibTorch loop and PyTorch Python, side by side.

One process, one LibTorch, one allocator (memfit's byte-exact meter), one
thread pool. Python builds the model (bench/peers.py's CNN, or its GPT, layer
for layer memfit's) and hands build/bench/libmemfit_tax.so the same data and
the same initial parameters; then each round runs one optimizer step of each
side, in turn, in a rotating order:

  python   PyTorch's own loop: forward, cross-entropy, backward (each
           micro-batch's loss weighted by its share and read once), Adam,
           zero_grad(set_to_none=True);
  loop     the same loop written by hand in C++ on memfit's make_resnet or
           make_gpt (bench/tax.cpp);
  trainer  memfit::Trainer::train_step on the same C++ model, with
           micro_batch_size set;
  script   (the CNN) the Trainer on memfit::load_torchscript of Python's
           torch.jit.script of its model: what bench/peers.py and a user
           with a scripted model hand memfit.

With --precision fp32,bf16 (the default) each configuration runs in fp32 and
again with every side's forwards under bf16 autocast and the loss in fp32
(the Trainer's TrainerOptions::precision(kBF16), the loop's AutocastGuard,
Python's torch.autocast), as bench/peers.py's bf16 runs take it.

Reported per configuration (whole batches, then micro-batches): each side's
median step time, its step peak, its losses (equal when the math is), and the
ratios trainer/loop, trainer/python and loop/python, each as the median of the
per-round ratios with the 10th–90th percentile spread.

With --device cuda (a GPU machine; its python3's PyTorch, memfit built against
it): every side trains on the GPU, copies its batch from host memory inside
its step, and is timed to the end of its device work; peaks are the CUDA
caching allocator's. Python's Adam is then its default multi-tensor
(foreach) kernel, LibTorch's C++ Adam one kernel sequence per parameter: the
losses may part by rounding, and are reported, not required equal.

Usage (after `make`; against the pip torch, its venv's python and build-pip):
  /usr/bin/python3 bench/tax.py [--model cnn|gpt|both] [--rounds 30] [--threads 2] [--build build]
                                [--device cuda] [--gpt-size W,D,H,C] [--gpt-batch 16] [--precision fp32,bf16]
"""
import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from peers import (FASHION, GPT, TORCH_VERSION, loss_of, make_chain, make_gpt, read_idx,  # noqa: E402
                   read_jargon, set_gpt_size, np, torch)
from run_report import keep_freed_host_memory, mib, python_blas  # noqa: E402

SIDES = ("python", "loop", "trainer", "script")
BATCHES = 4  # distinct batches, cycled


def python_step(model, opt, x, y, micro, low):
    x, y = x.to(peers.DEVICE), y.to(peers.DEVICE)
    k = 1 if micro == 0 else len(x) // micro
    total = 0.0
    for xs, ys in zip(x.chunk(k), y.chunk(k)):
        with torch.autocast(peers.DEVICE.type, dtype=torch.bfloat16, enabled=low):
            out = model(xs)
        loss = loss_of(out, ys)
        if k > 1:
            loss = loss * (len(xs) / len(x))
        total += float(loss)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def load(lib_path):
    lib = ctypes.CDLL(lib_path)
    lib.memfit_tax_error.restype = ctypes.c_char_p
    lib.memfit_tax_setup.argtypes = [ctypes.c_char_p] + [ctypes.c_int64] * 7 + [ctypes.c_char_p] * 4
    lib.memfit_tax_set_data.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                                        ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    lib.memfit_tax_parameter_count.restype = ctypes.c_int64
    lib.memfit_tax_set_parameter.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    lib.memfit_tax_step.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.memfit_tax_step.restype = ctypes.c_double
    lib.memfit_tax_kernel_ran.restype = ctypes.c_char_p
    for f in ("memfit_tax_allocated", "memfit_tax_peak"):
        getattr(lib, f).restype = ctypes.c_int64
    return lib


def check(lib, rc, what):
    if rc != 0:
        sys.exit(f"tax.py: {what}: {lib.memfit_tax_error().decode()}")


def shape_of(t):
    return (ctypes.c_int64 * t.dim())(*t.shape), t.dim()


OPTIONS = {"kernel": "auto", "python": "default"}  # --optimizer-kernel, --python-optimizer


def python_optimizer(params):
    """PyTorch's Adam as --python-optimizer asks: default (on the CPU its for-loop), foreach or fused."""
    flags = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[OPTIONS["python"]]
    return torch.optim.Adam(params, lr=1e-3, **flags)


def setup(lib, kind, batch, micro, script, precision):
    """The Python side's model, optimizer and data; the C++ sides get copies of all three."""
    if kind == "gpt":
        inputs, targets, vocab = read_jargon(GPT["context"], batch * BATCHES)
        make = lambda: make_gpt(vocab)  # noqa: E731
        sizes = (vocab, GPT["width"], GPT["depth"], GPT["heads"], GPT["context"])
    else:
        n = batch * BATCHES
        inputs = torch.from_numpy(read_idx("train-images-idx3-ubyte")[:n].copy()).float().div_(255)
        inputs = inputs.sub_(0.2860).div_(0.3530).unsqueeze(1).contiguous()
        targets = torch.from_numpy(read_idx("train-labels-idx1-ubyte")[:n].astype(np.int64))
        make = make_chain
        sizes = (0, 0, 0, 0, 0)
    torch.manual_seed(0)
    model = make()
    model.train()
    if kind == "cnn":
        torch.jit.script(model).save(script)
    check(lib, lib.memfit_tax_setup(kind.encode(), batch, micro, *sizes, script.encode() if kind == "cnn" else b"",
                                    str(peers.DEVICE).encode(), precision.encode(), OPTIONS["kernel"].encode()),
          "setup")
    s, d = shape_of(inputs)
    ts, td = shape_of(targets)
    check(lib, lib.memfit_tax_set_data(inputs.data_ptr(), int(not inputs.is_floating_point()), s, d,
                                       targets.data_ptr(), ts, td), "data")
    params = list(model.parameters())
    if lib.memfit_tax_parameter_count() != len(params):
        sys.exit(f"tax.py: the C++ model has {lib.memfit_tax_parameter_count()} parameters, Python's {len(params)}")
    for i, p in enumerate(params):
        c = p.detach().contiguous()
        check(lib, lib.memfit_tax_set_parameter(i, c.data_ptr(), c.numel()), f"parameter {i}")
    model.to(peers.DEVICE)
    return model, python_optimizer(model.parameters()), inputs, targets


def measure(lib, kind, batch, micro, rounds, script, precision):
    model, opt, inputs, targets = setup(lib, kind, batch, micro, script, precision)
    sides = SIDES if kind == "cnn" else SIDES[:3]

    def step(side, s):
        if side == "python":
            i = s % BATCHES
            return python_step(model, opt, inputs[i * batch:(i + 1) * batch], targets[i * batch:(i + 1) * batch],
                               micro, precision == "bf16")
        return lib.memfit_tax_step(SIDES.index(side) - 1, s)

    times = {side: [] for side in sides}
    peaks = {side: 0 for side in sides}
    losses = {side: [] for side in sides}
    warmup = 2
    cuda = peers.DEVICE.type == "cuda"
    for r in range(warmup + rounds):
        order = sides[r % len(sides):] + sides[:r % len(sides)]
        for side in order:
            lib.memfit_tax_reset_peak()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = step(side, r)
            if cuda:  # to the end of the step's device work
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if loss != loss:
                sys.exit(f"tax.py: the {side} step failed: {lib.memfit_tax_error().decode()}")
            losses[side].append(loss)
            if side == "trainer":
                RAN["trainer"] = lib.memfit_tax_kernel_ran().decode()
            if r >= warmup:
                times[side].append(seconds)
                peaks[side] = max(peaks[side], lib.memfit_tax_peak() - lib.memfit_tax_allocated())
    lib.memfit_tax_teardown()
    return times, peaks, losses


RAN = {"trainer": "none"}  # the optimizer kernel the Trainer's last step ran


def spread(values):
    """Median and the 10th and 90th percentiles."""
    v = sorted(values)
    at = lambda q: v[min(len(v) - 1, int(round(q * (len(v) - 1))))]  # noqa: E731
    return statistics.median(v), at(0.1), at(0.9)


def report(kind, batch, micro, precision, times, peaks, losses):
    m = {side: statistics.median(times[side]) for side in times}
    how = ("whole batches" if micro == 0 else f"{batch // micro} micro-batches of {micro}") + \
        (", bf16 autocast" if precision == "bf16" else "")
    ratios = []
    for a, b in (("trainer", "loop"), ("trainer", "python"), ("loop", "python"), ("script", "trainer")):
        r = spread([x / y for x, y in zip(times[a], times[b])]) if a in times else None
        ratios.append(f"{r[0]:.3f} ({r[1]:.3f}–{r[2]:.3f})" if r else "")
    def drift(sides):
        return max((abs(losses["trainer"][i] - losses[s][i]) for s in sides for i in range(len(losses[s]))),
                   default=0.0)
    # The sides that must agree: the Trainers (one kernel) always, the hand loop (torch::optim::Adam) when
    # the Trainer's optimizer ran the loop kernel; the rest are reported, apart by rounding.
    cpp = drift([s for s in losses if s not in ("python", "loop") or (s == "loop" and RAN["trainer"] == "loop")])
    python = drift(["python"]) if RAN["trainer"] == "loop" and OPTIONS["python"] == "default" else 0.0
    shown = drift([s for s in losses if s != "python"]), drift(["python"])
    cells = " | ".join(f"{1e3 * m[s]:.1f} ms" if s in m else "" for s in SIDES)
    print(f"| {kind} | {batch}, {how} | {cells} | {' | '.join(ratios)} | "
          f"{', '.join(mib(peaks[s]) for s in peaks)} | {shown[0]:.1e} | {shown[1]:.1e} |")
    sys.stdout.flush()
    return cpp, python if precision == "fp32" else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--model", choices=["cnn", "gpt", "both"], default="both")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per configuration (after 2 warm-up rounds)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--gpt-size", metavar="W,D,H,C", help="the GPT's width, depth, heads and context")
    p.add_argument("--gpt-batch", type=int, default=16, help="the GPT's batch (micro-batches of half of it)")
    p.add_argument("--optimizer-kernel", choices=["auto", "loop", "fused"], default="auto",
                   help="the Trainers' optimizer kernel (memfit::optim::Kernel); the C++ loop keeps torch::optim::Adam")
    p.add_argument("--python-optimizer", choices=["default", "foreach", "fused"], default="default",
                   help="PyTorch's Adam: its default (the for-loop on the CPU), foreach=True or fused=True")
    p.add_argument("--precision", default="fp32,bf16",
                   help="comma-separated: fp32, bf16 (every side's forwards under bf16 autocast, the loss in fp32)")
    a = p.parse_args()
    peers.DEVICE = torch.device(a.device)
    OPTIONS.update(kernel=a.optimizer_kernel, python=a.python_optimizer)
    if a.gpt_size:
        set_gpt_size(a.gpt_size, "tax.py")
    if a.rounds < 1 or a.threads < 1:
        sys.exit("tax.py: --rounds and --threads must be positive")
    precisions = a.precision.split(",")
    if not precisions or any(x not in ("fp32", "bf16") for x in precisions):
        sys.exit(f"tax.py: --precision {a.precision}: expected fp32, bf16 or fp32,bf16")
    lib_path = os.path.join(a.build, "bench", "libmemfit_tax.so")
    if not os.path.exists(lib_path):
        sys.exit(f"tax.py: {lib_path} is missing: build memfit's benchmarks first (make)")
    lib = load(lib_path)  # its tracking allocator is LibTorch's CPU allocator from here on
    lib.memfit_tax_allocated()
    torch.set_num_threads(a.threads)
    blas, warning = python_blas()
    if warning:
        print(f"tax.py: warning: {warning}", file=sys.stderr)
    on = f", on {torch.cuda.get_device_name()} (peaks: the CUDA caching allocator's)" if a.device == "cuda" else ""
    print(f"PyTorch {TORCH_VERSION} in this process and memfit on its LibTorch{on}, {torch.get_num_threads()} threads, "
          f"BLAS: {blas}; Adam (lr 1e-3); {a.rounds} rounds of one step per side in rotating order after 2 "
          f"warm-up rounds; time: median step; ratios: median of the per-round ratios (10th–90th percentile); "
          f"peak: the step's peak above what is held before it, memfit's meter; loss drift: the largest "
          f"difference between the Trainer's loss and the other C++ sides' (loop, script), and Python's, at the "
          f"same step. Under bf16 autocast Python's may part from the C++ sides' by rounding: LibTorch's C++ "
          f"nn::Linear on inputs of more than 2 dimensions adds its fp32 bias to the bf16 product after "
          f"the matmul, where Python's aten::linear adds it rounded to bf16 (the GPT; the CNN's Linear takes "
          f"2-D inputs).\n")
    print("| model | batch | python | loop | trainer | script | trainer ÷ loop | trainer ÷ python | loop ÷ python "
          "| script ÷ trainer | step peaks (python, loop, trainer[, script]) | loss drift, C++ | loss drift, Python |")
    print("|---|---|---:|---:|---:|---:|---|---|---|---|---|---:|---:|")
    configs = []
    for precision in precisions:
        if a.model in ("cnn", "both"):
            configs += [("cnn", 128, 0, precision), ("cnn", 128, 64, precision)]
        if a.model in ("gpt", "both"):
            configs += [("gpt", a.gpt_batch, 0, precision), ("gpt", a.gpt_batch, a.gpt_batch // 2, precision)]
    drift = 0.0  # where the sides must agree: the C++ ones always, Python's in fp32
    with tempfile.TemporaryDirectory() as tmp:
        for kind, batch, micro, precision in configs:
            drift = max(drift, *report(kind, batch, micro, precision,
                                       *measure(lib, kind, batch, micro, a.rounds, os.path.join(tmp, "chain.pt"),
                                                precision)))
    # The same kernels in the same order give the same losses; a fused optimizer on one side parts them by
    # rounding (reported in the table, not required equal).
    print(f"\nOptimizers: the Trainer's ran the {RAN['trainer']} kernel (--optimizer-kernel {OPTIONS['kernel']}), "
          f"the C++ loop's is torch::optim::Adam, Python's Adam is its {OPTIONS['python']}; losses required equal "
          f"(within 1e-6) where two sides run the same optimizer kernel.")
    if drift > 1e-6 and peers.DEVICE.type == "cpu":
        sys.exit(f"tax.py: the sides' losses differ by up to {drift:.1e}: they do not run the same math, "
                 f"so their times do not compare")


if __name__ == "__main__":
    keep_freed_host_memory()  # as memfit does: both sides allocate alike
    main()
