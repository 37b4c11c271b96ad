"""Draft checkpoint conversion at full size: torch -> Orbax -> torch vs a raw sequential read.

Generates (once, with --generate) a synthetic 68-tensor Kimi-K3 DSpark checkpoint (7.1 GB of
random finite bf16, exactly the published layout: same names, shapes, header size and file size),
then in fresh child processes, each starting with the files evicted from the page cache:
  1. reads model.safetensors sequentially (the baseline), 2. copies it (read + write + fsync: the
  floor for any converter on this disk), 3. converts torch -> Orbax, 4. converts Orbax -> torch,
and prints each step's wall time (measured inside the child, after imports), its ratio to the raw
read and to the raw copy, and the child's peak RSS (`wait4` rusage), then each direction against
the goal (within 2x the raw read, peak RSS under 2 GB). The round trip is then compared byte for
byte. Absolute times depend on the disk; the ratios and peak RSS are the result. Needs ~22 GB free.

    python -m benchmarks.convert_draft --dir /tmp/dspark_bench --generate
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

# No jax/numpy imports at module level: children inherit the parent's RSS at fork, which would
# inflate every peak-RSS figure; the generator runs in a child of its own.
REPO = Path(__file__).resolve().parents[1]

_DIR = flags.DEFINE_string("dir", None, "Work directory for the synthetic checkpoint and outputs.", required=True)
_CONFIG = flags.DEFINE_string("config", str(REPO / "dspark_jax" / "configs" / "kimi-k3-dspark.json"),
                              "Draft config.json to size the synthetic checkpoint.")
_GENERATE = flags.DEFINE_bool("generate", False, "Create <dir>/torch if it is missing.")
_KEEP = flags.DEFINE_bool("keep", False, "Keep all files afterwards (default: delete everything).")

_BLOCK = 16 * 2**20
_GOAL_RATIO = 2.0     # x the raw read, each direction
_GOAL_RSS_GB = 2.0

_READ = """
import sys, time
t = time.perf_counter(); n = 0
with open(sys.argv[1], "rb", buffering=0) as f:
    while (b := f.read({block})):
        n += len(b)
print(time.perf_counter() - t, n)
""".format(block=_BLOCK)

_COPY = """
import os, sys, time
t = time.perf_counter()
with open(sys.argv[1], "rb", buffering=0) as src, open(sys.argv[2], "wb", buffering=0) as dst:
    while (b := src.read({block})):
        dst.write(b)
    os.fsync(dst.fileno())
print(time.perf_counter() - t)
""".format(block=_BLOCK)

# The converter's lazy imports (orbax, tensorstore) are done before the clock starts, like the
# rest: the import time is printed apart.
_CONVERT = """
import sys, time
t = time.perf_counter()
from dspark_jax.checkpoint.draft_convert import convert_draft
import orbax.checkpoint.experimental.v1, tensorstore
imports = time.perf_counter() - t
t = time.perf_counter()
convert_draft(sys.argv[1], sys.argv[2])
print(imports, time.perf_counter() - t)
"""


_GENERATE_CODE = """
import sys
from pathlib import Path
from benchmarks.convert_draft import generate
generate(Path(sys.argv[1]), Path(sys.argv[2]))
"""


def generate(cfg_path: Path, dst: Path) -> None:
    """Write the synthetic checkpoint: the inventory's header, then random finite bf16 (magnitude
    < 2: the exponent MSB is cleared, so no inf/nan) tensor by tensor in 16 MiB blocks."""
    import numpy as np

    from dspark_jax.checkpoint.draft_layout import TORCHSPEC_METADATA, draft_inventory
    from dspark_jax.checkpoint.safetensors_io import header_for
    from dspark_jax.config.draft import DraftConfig

    cfg = DraftConfig.from_json(cfg_path)
    inv = draft_inventory(cfg)
    header, _ = header_for([(t.name, t.dtype, t.shape) for t in inv.tensors], TORCHSPEC_METADATA)
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(0)
    with open(tmp / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for t in inv.tensors:
            if t.dtype != "BF16":
                raise ValueError(f"{t.name}: the generator writes bf16 only, the config says {t.dtype}")
            for start in range(0, t.num_params, _BLOCK // 2):
                n = min(_BLOCK // 2, t.num_params - start)
                f.write((rng.integers(0, 2**16, n, dtype=np.uint16) & np.uint16(0xBFFF)).tobytes())
    size = (tmp / "model.safetensors").stat().st_size
    if size != inv.file_bytes:
        raise RuntimeError(f"generated {size} bytes, the inventory says {inv.file_bytes}")
    shutil.copyfile(cfg_path, tmp / "config.json")
    tmp.rename(dst)


def evict(path: Path) -> None:
    """Drop `path`'s pages from the page cache (flushing dirty ones first), so reads hit the disk."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child(code: str, *args: str) -> tuple[str, float, float]:
    """Run `code` in a fresh interpreter; (its stdout, its peak RSS in GB and its CPU seconds,
    user + system, from wait4's rusage)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"child failed ({proc.returncode}):\n{err.read()[-4000:]}")
        return out.read().strip(), usage.ru_maxrss * 1024 / 1e9, usage.ru_utime + usage.ru_stime


def same_files(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while (x := fa.read(_BLOCK)):
            if x != fb.read(_BLOCK):
                return False
    return True


def main(argv: list[str]) -> None:
    del argv
    root = Path(_DIR.value)
    src, orb, back = root / "torch", root / "orbax", root / "back"
    if not (src / "model.safetensors").exists():
        if not _GENERATE.value:
            raise app.UsageError(f"{src} missing; pass --generate to create it")
        t = time.perf_counter()
        child(_GENERATE_CODE, _CONFIG.value, str(src))
        print(f"generated {src} in {time.perf_counter() - t:.1f}s")
    for d in (orb, back):
        shutil.rmtree(d, ignore_errors=True)
    nbytes = (src / "model.safetensors").stat().st_size
    try:
        rows = []
        evict(src)
        out, rss, cpu = child(_READ, str(src / "model.safetensors"))
        raw = float(out.split()[0])
        rows.append(("raw sequential read", raw, rss, cpu))
        # the floor of any converter on this disk: read + write + fsync of the same bytes
        evict(src)
        out, rss, cpu = child(_COPY, str(src / "model.safetensors"), str(root / "copy.bin"))
        (root / "copy.bin").unlink()
        rows.append(("raw copy (read+write)", float(out), rss, cpu))
        imports = []
        for name, a, b in (("torch -> Orbax", src, orb), ("Orbax -> torch", orb, back)):
            evict(a)
            out, rss, cpu = child(_CONVERT, str(a), str(b))
            imported, secs = map(float, out.splitlines()[-1].split())
            rows.append((name, secs, rss, cpu))
            imports.append(imported)
        identical = same_files(src / "model.safetensors", back / "model.safetensors") and \
            (src / "config.json").read_bytes() == (back / "config.json").read_bytes()
    finally:
        if not _KEEP.value:
            shutil.rmtree(orb, ignore_errors=True)
            shutil.rmtree(back, ignore_errors=True)
    print(f"\n{nbytes / 1e9:.2f} GB checkpoint ({json.loads(Path(_CONFIG.value).read_text())['architectures'][0]}),"
          f" cold page cache before each step, {os.cpu_count()} CPUs")
    copy = rows[1][1]
    print(f"{'step':<24}{'wall s':>8}{'x raw read':>12}{'x raw copy':>12}{'GB/s':>7}{'CPU s':>8}"
          f"{'peak RSS GB':>13}")
    for name, secs, rss, cpu in rows:
        print(f"{name:<24}{secs:>8.2f}{secs / raw:>12.2f}{secs / copy:>12.2f}{nbytes / secs / 1e9:>7.2f}"
              f"{cpu:>8.1f}{rss:>13.2f}")
    print(f"(wall: inside the child, after imports (the converters' took {min(imports):.1f}-"
          f"{max(imports):.1f} s); CPU: the whole child, imports included)")
    print(f"round trip byte-identical: {identical}")
    print(f"goal: each direction within {_GOAL_RATIO:g}x the raw read, peak RSS under {_GOAL_RSS_GB:g} GB")
    for name, secs, rss, _ in rows[2:]:
        ok = secs / raw <= _GOAL_RATIO and rss < _GOAL_RSS_GB
        print(f"  {name}: {secs / raw:.2f}x raw read ({secs / copy:.2f}x raw copy), peak RSS {rss:.2f} GB"
              f" -> {'met' if ok else 'NOT met'}")
    if not _KEEP.value:
        shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
