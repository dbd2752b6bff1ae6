"""Reading `memfit train --report` JSON, for bench/peers.py and bench/gpt_budget.py."""

import os


def mib(b):
    return f"{b / 2**20:.2f} MiB"


def plan_knobs(plan, batch):
    """The knobs a run's plan turned on, as short phrases (none for no plan or a plain step)."""
    knobs = []
    if plan.get("micro_batch", 0) and plan["micro_batch"] < batch:
        knobs.append(f"micro-batch {plan['micro_batch']}")
    if plan.get("checkpoint", "none") not in ("none", ""):
        knobs.append(f"checkpoint {plan['checkpoint']}")
    if plan.get("selective_recompute", False):
        knobs.append("selective recompute")
    if plan.get("precision", "fp32") != "fp32":
        knobs.append(plan["precision"])
    if plan.get("offload", "none") != "none":
        knobs.append("offload " + plan["offload"])
    return knobs


def environment_text(report):
    """The LibTorch version, threads and BLAS a `memfit train --report` run recorded, in one line."""
    env = report.get("environment")
    if not env:
        return "not recorded"
    blas = env.get("blas", {})
    library = f" ({blas['library']})" if blas.get("library") else ""
    return (f"LibTorch {env.get('libtorch', '?')}, {env.get('threads', '?')} threads, "
            f"BLAS: {blas.get('name', '?')}{library}{', freed host memory kept' if env.get('host_memory_kept') else ''}"
            f"{', CPU without native bf16' if env.get('cpu_bf16') is False else ''}")


def keep_freed_host_memory():
    """What `memfit` does at start (memfit::keep_freed_host_memory, environment.h), for the PyTorch peers in
    this process: glibc's malloc keeps freed tensors' memory in the heap (mmap threshold 32 MiB, trim
    threshold 2 GiB) instead of mapping it afresh each step, so that both sides allocate alike. Skipped,
    as memfit skips it, where the environment configures malloc. Returns whether it applied."""
    import ctypes
    if any(os.environ.get(v) for v in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    if any(a in os.environ.get("LD_PRELOAD", "") for a in ("jemalloc", "tcmalloc", "mimalloc")):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    return libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1


def python_blas():
    """The BLAS this Python process calls (after `import torch`), as (text, warning or None).

    Debian's python3-torch calls whichever libblas.so.3 the alternatives select;
    /proc/self/maps names the files mapped, symbolic links resolved."""
    libraries = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line[line.find("/"):].strip() if "/" in line else ""
            name = path.rsplit("/", 1)[-1]
            if (name.startswith("libblas.so") or name.startswith("libopenblas")) and path not in libraries:
                libraries.append(path)
    text = ", ".join(libraries)
    if not text:  # PyPI's torch links its BLAS (MKL) in
        import torch
        info = [w.split("=", 1)[1] for w in torch.__config__.show().replace(",", " ").split() if w.startswith("BLAS_INFO=")]
        text = f"{info[0] if info else 'unknown'}, built into torch"
    silenced = os.environ.get("MEMFIT_BLAS_CHECK", "").lower() in ("0", "off", "false")
    warning = None
    if any("/blas/libblas.so" in path for path in libraries):
        warning = ("PyTorch's CPU matrix products run on the netlib reference BLAS, often hundreds of times slower "
                   "than OpenBLAS: install libopenblas0-openmp")
    elif any("openblas-pthread" in path for path in libraries):
        warning = ("OpenBLAS's pthread variant oversubscribes the cores beside PyTorch's OpenMP threads: "
                   "install libopenblas0-openmp and select it with update-alternatives")
    return text, None if silenced else warning
