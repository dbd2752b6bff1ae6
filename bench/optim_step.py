#!/usr/bin/python3
"""The optimizer step alone: memfit::optim, LibTorch's torch::optim and PyTorch Python's optimizers, side by side.

One process, one LibTorch, one thread pool. For each model's parameter
shapes (bench/peers.py's CNN, and its GPT at --gpt-size) and each optimizer
(Adam; SGD with momentum 0.9), every side gets its own seeded parameters and
gradients and the rounds run each side --steps steps in turn, in a rotating
order:

  py-loop      torch.optim with foreach=False, fused=False: what PyTorch runs
               by default on the CPU
  py-foreach   foreach=True
  py-fused     fused=True (PyTorch 2.4 and later)
  libtorch     LibTorch's C++ torch::optim: what a C++ user has
  loop, fused  memfit::optim with Kernel::kLoop and kFused (fused: 2.4 and later)
  foreach      (Adam) LibTorch's _foreach_* operations called from C++

Reported: each side's median time per step, and the ratios of memfit's
default kernel (fused where LibTorch has it, else loop) to LibTorch's
optimizer, to PyTorch's fastest side and to its default, as the median of the
per-round ratios with the 10th-90th percentile spread; and each side's
transient bytes in one step (its peak above what it held before the step, on
memfit's byte-exact meter, which serves Python's tensors too: one allocator).

Usage (after `make`; against the pip torch, its venv's python and build-pip):
  /usr/bin/python3 bench/optim_step.py [--build build] [--rounds 7] [--steps 20] [--threads 2]
                                       [--gpt-size 256,4,4,256]
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import GPT, make_chain, make_gpt, read_jargon, set_gpt_size, torch  # noqa: E402

HAS_FUSED = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 4)


def load(build):
    lib = ctypes.CDLL(os.path.join(build, "bench", "libmemfit_optim_step.so"))
    lib.memfit_optim_error.restype = ctypes.c_char_p
    lib.memfit_optim_add_side.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64),
                                          ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.memfit_optim_steps.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.memfit_optim_steps.restype = ctypes.c_double
    lib.memfit_optim_kernel_ran.restype = ctypes.c_char_p
    for f in ("memfit_optim_allocated", "memfit_optim_peak"):
        getattr(lib, f).restype = ctypes.c_int64
    lib.memfit_optim_allocated()  # memfit's meter is LibTorch's CPU allocator from here on
    return lib


def python_side(shapes, optimizer, how):
    torch.manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.randn(shape, requires_grad=True)
        p.grad = torch.randn_like(p)
        params.append(p)
    flags = {"py-loop": dict(foreach=False), "py-foreach": dict(foreach=True), "py-fused": dict(fused=True)}[how]
    if optimizer == "adam":
        opt = torch.optim.Adam(params, lr=1e-3, **flags)
    else:
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9, **flags)

    def run(steps):
        start = time.perf_counter()
        for _ in range(steps):
            opt.step()
        return time.perf_counter() - start
    return run


def cpp_side(lib, shapes, optimizer, kernel):
    sizes = [s for shape in shapes for s in shape]
    index = lib.memfit_optim_add_side(optimizer.encode(), kernel.encode(), (ctypes.c_int64 * len(sizes))(*sizes),
                                      (ctypes.c_int * len(shapes))(*[len(s) for s in shapes]), len(shapes))
    if index < 0:
        sys.exit(f"optim_step.py: {kernel}: {lib.memfit_optim_error().decode()}")

    def run(steps):
        seconds = lib.memfit_optim_steps(index, steps)
        if seconds < 0:
            sys.exit(f"optim_step.py: {kernel}: {lib.memfit_optim_error().decode()}")
        return seconds
    return run, index


def spread(values):
    v = sorted(values)
    return statistics.median(v), v[int(0.1 * (len(v) - 1))], v[int(round(0.9 * (len(v) - 1)))]


def measure(lib, name, shapes, optimizer, a):
    sides = {}
    for how in ("py-loop", "py-foreach") + (("py-fused",) if HAS_FUSED else ()):
        sides[how] = python_side(shapes, optimizer, how)
    kernels = ["libtorch", "loop"] + (["fused"] if HAS_FUSED else []) + (["foreach"] if optimizer == "adam" else [])
    ran = {}
    for k in kernels:
        sides[k], ran[k] = cpp_side(lib, shapes, optimizer, k)
    order = list(sides)
    transient = {}
    for s in order:  # one step each (the state exists after it), then the transient of the next
        sides[s](1)
        before = lib.memfit_optim_allocated()
        lib.memfit_optim_reset_peak()
        sides[s](1)
        transient[s] = lib.memfit_optim_peak() - before
    times = {s: [] for s in order}
    for r in range(a.rounds + 1):  # round 0 warms up
        for s in order[r % len(order):] + order[:r % len(order)]:
            t = sides[s](a.steps) / a.steps
            if r > 0:
                times[s].append(t)
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"\n{name}: {len(shapes)} tensors, {numel / 1e6:.2f} M parameters; {optimizer}"
          f"{' (momentum 0.9)' if optimizer == 'sgd' else ''}; median ms per step over {a.rounds} rounds of "
          f"{a.steps} steps")
    for s in order:
        label = f"{s} (ran {lib.memfit_optim_kernel_ran(ran[s]).decode()})" if s in ran and s != "foreach" else s
        print(f"  {label:<24} {statistics.median(times[s]) * 1e3:8.3f} ms   transient {transient[s]:>9,} bytes")
    ours = "fused" if HAS_FUSED else "loop"
    python = [s for s in order if s.startswith("py-")]
    fastest = min(python, key=lambda s: statistics.median(times[s]))
    for other in dict.fromkeys(("libtorch", fastest, "py-loop")):  # in order, once each
        ratios = [x / y for x, y in zip(times[ours], times[other])]
        m, lo, hi = spread(ratios)
        print(f"  memfit {ours} / {other}: {m:.2f} ({lo:.2f}-{hi:.2f})")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default="build")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gpt-size", default="256,4,4,256", metavar="W,D,H,C")
    a = p.parse_args()
    if a.rounds < 1 or a.steps < 1 or a.threads < 1:
        sys.exit("optim_step.py: --rounds, --steps and --threads must be positive")
    set_gpt_size(a.gpt_size, "optim_step.py")
    torch.set_num_threads(a.threads)
    lib = load(a.build)
    _, _, vocab = read_jargon(GPT["context"], 1)
    models = {"CNN (bench/peers.py make_chain)": make_chain(),
              f"GPT (width {GPT['width']}, {GPT['depth']} blocks, vocab {vocab})": make_gpt(vocab)}
    print(f"optim_step.py: PyTorch {torch.__version__}, {a.threads} threads; python {sys.version.split()[0]}")
    for name, model in models.items():
        shapes = [list(q.shape) for q in model.parameters()]
        for optimizer in ("adam", "sgd"):
            measure(lib, name, shapes, optimizer, a)


if __name__ == "__main__":
    main()
