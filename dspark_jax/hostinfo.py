"""What the host is, in words a measured figure and a start-up log can carry: the CPU model, its
core count and the instruction-set flags that decide how fast XLA:CPU runs bf16 GEMMs."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

# flags that change what XLA:CPU can do with bf16 and int8 products
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")


@functools.cache
def cpu_model_and_flags() -> tuple[str, tuple[str, ...]]:
    """(model name, the BF16_FLAGS it has); ("unknown CPU", ()) where /proc/cpuinfo is unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU", ()
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:(.*)$", text, re.M)
    have = set(flags.group(1).split()) if flags else set()
    return (model.group(1).strip() if model else "unknown CPU"), tuple(f for f in BF16_FLAGS if f in have)


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
