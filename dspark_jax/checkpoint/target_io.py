"""Kimi-family targets in Orbax: a streaming HF -> Orbax converter and a loader into any mesh.

Orbax layout (this package's):
    config.json                the source's config.json, byte for byte
    target_layout.json         {"format", "version", "source_prefix"}: what this directory is
    params/                    an Orbax PyTree checkpoint of the model's NNX params,
                               `{"model": {"layers": {"1": {"block_sparse_moe": {"experts": {"w1":
                               {"weight_packed": [E, I, Din/2] uint8, ...}}}}}}, "lm_head": ...}`:
                               the NNX path (= the torch name without the K3 `language_model.`
                               prefix), experts stacked, MXFP4 kept packed, every dtype as stored
    tokenizer files etc.       the source directory's other small files (tokenizer, templates)

Conversion reads one HF tensor at a time and writes groups of at most `_GROUP_BYTES` by Orbax
partial saves. A sharded param is placed on a CPU "storage mesh" (`storage_mesh`: "tensor" over 8
CPU devices, which `convert.target` creates) in the rules table's sharding before it is written,
each device's shard read on its own (a stacked expert param from only that device's experts, a
row-split tensor from only its rows). Host memory therefore peaks near one param: for Kimi-K3 a
stacked packed expert projection, [896, 3072, 1792] uint8 = 4.9 GB (one stacked param of the
Orbax tree is 896 HF tensors; the largest single HF tensor, the embedding table, is 2.3 GB). The
checkpoint is checked against config.json before any data is read (the
loader's checks: missing, unexpected, mis-shaped, mis-typed tensors, truncated shards), and the
output goes to a temp dir renamed into place at the end.

Storage chunks follow the sharding: Orbax writes every storage shard separately in chunks of at
most `CHUNK_BYTES`, split along the sharded dimension first (experts: one expert per chunk). A
restore into a mesh whose "tensor" axis divides 8 (`load_kimi_orbax`; TP = EP = 8 for Kimi-K3)
therefore reads, on each host, exactly the chunks of its own shards (plus whole copies of the
replicated tensors).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dspark_jax import params as params_lib
from dspark_jax import sharding as sharding_lib
from dspark_jax.checkpoint import loader as loader_lib
from dspark_jax.checkpoint.orbax_io import PARAMS_DIR, flatten, nest, orbax, orbax_context, orbax_leaves, staging
from dspark_jax.checkpoint.safetensors_io import CheckpointError, ShardedCheckpoint
from dspark_jax.config.keys import ConfigError
from dspark_jax.config.kimi import KimiConfig

CONFIG_FILE = "config.json"
LAYOUT_FILE = "target_layout.json"
LAYOUT_FORMAT = "dspark_jax.target_orbax"
LAYOUT_VERSION = 1
# As `load_kimi`: the K3 wrapper also holds the vision tower and projector, not used by the text model.
IGNORED_TENSORS = (r"^vision_tower\.", r"^mm_projector\.", r"^multi_modal_projector\.")
# Storage chunk bound (chunks are what a restore reads): a few MiB, well above tensorstore's
# efficient minimum; arrays are written from a CPU mesh of STORAGE_SHARDS devices along "tensor".
CHUNK_BYTES = 8 * 2**20
STORAGE_SHARDS = 8
_GROUP_BYTES = 256 * 2**20
_SKIPPED_FILES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".gguf")
_MAX_LISTED = 12

Progress = Callable[[str], None]


# ---------------------------------------------------------------------------------------------
# storage layout


def storage_mesh() -> Mesh:
    """The CPU mesh arrays are written from: "tensor" over up to `STORAGE_SHARDS` CPU devices
    (a power of two). Orbax writes each device's shard as its own zarr shard, cut into chunks of
    at most `CHUNK_BYTES` along the sharded dimension first, so every chunk lies inside one
    storage shard, i.e. inside one shard of any "tensor" axis dividing `STORAGE_SHARDS`."""
    cpus = jax.devices("cpu")
    n = 1 << (min(len(cpus), STORAGE_SHARDS).bit_length() - 1)
    return sharding_lib.make_mesh(tensor=n, devices=cpus[:n])


def _storage_array(ckpt: ShardedCheckpoint, plan, mesh: Mesh) -> jax.Array | np.ndarray:
    """One param as written: replicated tensors as one host array; sharded ones on the storage
    mesh, each device's shard read on its own where the layout allows (stacked experts: only that
    device's experts; a split first dimension: only its rows), so host memory holds about one copy
    of the param."""
    spec = sharding_lib.logical_to_spec(plan.axes, plan.shape, mesh)
    if all(axis is None for axis in spec):
        return loader_lib.read_tensor(ckpt, plan.names[0], plan.dtype)
    sharding = NamedSharding(mesh, spec)
    if plan.stacked:
        return loader_lib.stacked_array(ckpt, plan, sharding)
    if spec[0] is None:         # columns split: read the tensor, place its slices
        return jax.device_put(loader_lib.read_tensor(ckpt, plan.names[0], plan.dtype), sharding)
    name = plan.names[0]
    info, path = ckpt.info(name), ckpt.dir / ckpt.where[name]
    row_bytes = info.nbytes // plan.shape[0]
    singles = []
    for device, index in sharding.addressable_devices_indices_map(plan.shape).items():
        lo, hi, _ = index[0].indices(plan.shape[0])
        rows = np.empty((hi - lo,) + plan.shape[1:], info.np_dtype)
        with open(path, "rb") as f:
            f.seek(info.begin + lo * row_bytes)
            if f.readinto(memoryview(rows.reshape(-1).view(np.uint8))) != rows.nbytes:
                raise CheckpointError(f"{path}: truncated while reading tensor {name!r}")
        singles.append(jax.device_put(rows[(slice(None),) + tuple(index[1:])].astype(plan.dtype, copy=False),
                                      device))
        del rows
    return jax.make_array_from_single_device_arrays(plan.shape, sharding, singles)


# ---------------------------------------------------------------------------------------------
# HF -> Orbax


def _abstract_target(cfg: KimiConfig, dtype=None):
    from dspark_jax.models.kimi import KimiLinearModel

    return params_lib.abstract(lambda: KimiLinearModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def _read_config(path: Path) -> tuple[KimiConfig, bytes]:
    try:
        raw = (path / CONFIG_FILE).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no {CONFIG_FILE}") from None
    return KimiConfig.from_json(path / CONFIG_FILE), raw


def _problems(where: str, problems: list[str]) -> CheckpointError:
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    return CheckpointError(f"{where} ({len(problems)} problem(s)):\n  " + "\n  ".join(problems[:_MAX_LISTED]) + more)


def _hf_plans(src: Path, cfg: KimiConfig) -> tuple[ShardedCheckpoint, list]:
    """Validate the HF checkpoint against config.json (headers only) the way `load_kimi` does;
    returns the per-param read plans."""
    from dspark_jax.models.kimi import hf_rename

    ckpt = ShardedCheckpoint(src)
    rename = hf_rename(set(ckpt.keys()), cfg.tensor_prefix)
    flat = params_lib.flat_params(_abstract_target(cfg))
    plans, errors = loader_lib.plan_params(flat, ckpt, lambda p: cfg.tensor_prefix + rename(p), "strict")
    consumed = {n for plan in plans for n in plan.names}
    ignore = [re.compile(r) for r in IGNORED_TENSORS]
    errors += [f"{ckpt.dir / ckpt.where[n]}: unexpected tensor {n!r} (no parameter of the model reads it)"
               for n in ckpt.keys() if n not in consumed and not any(r.search(n) for r in ignore)]
    if errors:
        raise _problems(f"checkpoint {src} does not fit its config.json", errors)
    return ckpt, plans


def _param_groups(plans: list) -> Iterator[list]:
    """Consecutive plans of at most `_GROUP_BYTES` together (a bigger param alone)."""
    group, size = [], 0
    for plan in plans:
        nbytes = int(np.prod(plan.shape, dtype=np.int64)) * plan.dtype.itemsize
        if group and size + nbytes > _GROUP_BYTES:
            yield group
            group, size = [], 0
        group.append(plan)
        size += nbytes
    if group:
        yield group


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, chat template, generation config...: every top-level file but the weights."""
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != CONFIG_FILE and not f.name.endswith(_SKIPPED_FILES):
            shutil.copy2(f, dst / f.name)


def convert_target(src: str | Path, dst: str | Path, *, progress: Progress | None = None) -> Path:
    """Convert an HF kimi_linear-family checkpoint directory to the Orbax layout at `dst` (which
    must be absent or empty). Raises CheckpointError/ConfigError naming what is wrong, leaving
    nothing behind."""
    ocp = orbax()
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise CheckpointError(f"{src}: source is not a directory")
    cfg, config_bytes = _read_config(src)
    ckpt, plans = _hf_plans(src, cfg)
    mesh = storage_mesh()
    with staging(dst) as tmp:
        (tmp / CONFIG_FILE).write_bytes(config_bytes)
        _copy_side_files(src, tmp)
        ctx = orbax_context()
        ctx.array.saving.storage_options.chunk_byte_size = CHUNK_BYTES
        with ctx:
            for group in _param_groups(plans):
                arrays = {plan.path: _storage_array(ckpt, plan, mesh) for plan in group}
                ocp.partial.save(tmp / PARAMS_DIR, nest(arrays))
                del arrays
                if progress is not None:
                    progress(f"saved {', '.join(plan.path for plan in group)}")
            ocp.partial.finalize(tmp / PARAMS_DIR)
        layout = {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, "source_prefix": cfg.tensor_prefix}
        (tmp / LAYOUT_FILE).write_text(json.dumps(layout, indent=1) + "\n")
        open_orbax_target(tmp)      # the output must read back against its own config.json
    return dst


# ---------------------------------------------------------------------------------------------
# reading


def is_orbax_target_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / LAYOUT_FILE).is_file() and (path / PARAMS_DIR).is_dir()


def open_orbax_target(path: str | Path) -> tuple[KimiConfig, dict[str, object]]:
    """Validate an Orbax target dir (metadata only): its config and `{NNX path: leaf metadata}`."""
    path = Path(path)
    cfg, _ = _read_config(path)
    try:
        layout = json.loads((path / LAYOUT_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {LAYOUT_FILE} (not an Orbax target written by convert.target)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / LAYOUT_FILE}: not valid JSON ({e})") from None
    if not isinstance(layout, dict) or layout.get("format") != LAYOUT_FORMAT or layout.get("version") != LAYOUT_VERSION:
        raise CheckpointError(f"{path / LAYOUT_FILE}: expected format {LAYOUT_FORMAT!r} version {LAYOUT_VERSION}")
    return cfg, orbax_leaves(path)


def _leaf_problems(flat: Mapping[str, nnx.Param], leaves: Mapping[str, object], where: Path,
                   cast: bool) -> list[str]:
    problems = []
    for path, p in flat.items():
        want = p.get_value()
        leaf = leaves.get(path)
        if leaf is None:
            problems.append(f"{where}: missing tensor {path!r} ({list(want.shape)} {np.dtype(want.dtype).name})")
            continue
        shape, dtype = tuple(getattr(leaf, "shape", ()) or ()), np.dtype(getattr(leaf, "dtype", None))
        if shape != tuple(want.shape):
            problems.append(f"{where}: tensor {path!r} has shape {list(shape)}, config.json implies "
                            f"{list(want.shape)}")
        elif dtype != want.dtype and not (cast and jnp.issubdtype(dtype, jnp.floating)
                                          and jnp.issubdtype(want.dtype, jnp.floating)):
            problems.append(f"{where}: tensor {path!r} is {dtype.name}, the model expects "
                            f"{np.dtype(want.dtype).name}")
    problems += [f"{where}: unexpected tensor {n!r}" for n in leaves if n not in flat]
    return problems


def load_kimi_orbax(path: str | Path, *, mesh: Mesh | None = None, dtype=None, rules=None):
    """A `KimiLinearModel` from an Orbax target dir, every param restored straight into its
    sharding on `mesh` (default: one device): each process reads only its devices' shards.
    `dtype` overrides the bf16-class params' dtype (floats are cast while reading; F32/U8
    tensors keep theirs); without it stored dtypes must equal config.json's."""
    path = Path(path)
    cfg, leaves = open_orbax_target(path)
    mesh = mesh if mesh is not None else sharding_lib.make_mesh(devices=jax.local_devices()[:1])
    model = _abstract_target(cfg, dtype)
    problems = _leaf_problems(params_lib.flat_params(model), leaves, path / PARAMS_DIR, cast=dtype is not None)
    if problems:
        raise _problems(f"{path}: the Orbax params do not match config.json", problems)

    def restore(targets):
        ocp = orbax()
        try:
            with orbax_context():
                return flatten(ocp.load(path / PARAMS_DIR, nest(targets)))
        except Exception as e:
            raise CheckpointError(f"{path / PARAMS_DIR}: cannot restore the params ({type(e).__name__}: {e})") from e

    return sharding_lib.place_params(model, mesh, restore, rules or sharding_lib.LOGICAL_RULES)
