"""What the host is, in words a measured figure and a start-up log can carry: the CPU model, its
core count, the instruction-set flags that decide how fast XLA:CPU runs bf16 GEMMs, and the memory
read bandwidth that bounds batch-1 decoding."""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from pathlib import Path

import numpy as np

# flags that change what XLA:CPU can do with bf16 and int8 products
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")


@functools.cache
def cpu_model_and_flags() -> tuple[str, tuple[str, ...]]:
    """(model name, the BF16_FLAGS it has); ("unknown CPU", ()) where /proc/cpuinfo is unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU", ()
    return parse_cpuinfo(text)


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """(model name, the BF16_FLAGS it has) of /proc/cpuinfo's text. A model name without a number
    (a virtual machine's "AMD EPYC", which hides the part) gets the family and model numbers, which
    tell the generations apart: their step costs differ (the demo pair's bf16 batch-8 one-token
    step took 24.9 ms on one "AMD EPYC" guest, family 26, and 43.5 ms on another)."""
    def field(name: str) -> str | None:
        m = re.search(rf"^{name}\s*:\s*(.+)$", text, re.M)
        return m.group(1).strip() if m else None

    model = field("model name") or "unknown CPU"
    family, number = field("cpu family"), field("model")
    if not re.search(r"\d", model) and family is not None and number is not None:
        model = f"{model} (family {family}, model {number})"
    flags = field("flags")
    have = set(flags.split()) if flags else set()
    return model, tuple(f for f in BF16_FLAGS if f in have)


def describe_cpu() -> str:
    """e.g. "AMD EPYC, 2 cores, AVX-512 BF16, no AMX" (the form figures name their CPU in)."""
    model, flags = cpu_model_and_flags()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    bf16 = "AVX-512 BF16" if "avx512_bf16" in flags else "no AVX-512 BF16"
    amx = "AMX" if any(f.startswith("amx") for f in flags) else "no AMX"
    return f"{model}, {cores} cores, {bf16}, {amx}"


def read_bandwidth_gb_s(nbytes: int = 1 << 30, threads: int | None = None, repeats: int = 5) -> float:
    """Memory read bandwidth in GB/s: the best of `repeats` sums of an `nbytes` float32 array (far
    beyond any cache), split over `threads` threads (default: the usable CPUs; numpy releases the
    GIL in the reduction). The ceiling a batch-1 decoding step that reads every weight once can
    approach: tok/s <= bandwidth / weight bytes."""
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    data = np.ones(max(nbytes // 4, threads), np.float32)    # written once: every page is resident
    parts = np.array_split(data, threads)
    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best / 1e9
