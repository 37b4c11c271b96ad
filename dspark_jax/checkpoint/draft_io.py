"""DSpark draft checkpoints: the torch layout <-> an Orbax layout, bit-exact and streaming.

Torch layout (as published, spec C.1/C.2): `config.json` + one `model.safetensors` (all tensors in
the config's `torch_dtype`, metadata `{"torchspec_version": "0.1.0"}`; `embed_tokens.weight` is a
copy of the target's table, optional).

Orbax layout (this package's):
    config.json                 the source config.json, byte for byte
    safetensors_layout.json     {"format", "version", "file", "header"}: the safetensors header
                                verbatim (names, order, dtypes, shapes, offsets, metadata)
    params/                     an Orbax PyTree checkpoint of `{"layers": {"0": {"self_attn":
                                {"q_a_proj": {"weight": array}}}}, ...}`: the torch name split at
                                the dots (= the NNX param path), arrays in their stored dtype
`ocp.load(dst / "params")` therefore gives the draft's weights as a plain nested dict, and the
header makes torch -> Orbax -> torch byte-identical (same names, order, dtypes, bytes, metadata).
An Orbax dir without the layout file (a trained draft: `nnx.to_pure_dict(nnx.state(draft,
nnx.Param))` saved under params/, config.json beside) exports with a fresh header in the reference
writer's order and the TorchSpec metadata, i.e. the file TorchSpec itself would write.

Streaming: tensors are read one at a time (torch side: straight into one array; Orbax side: a
partial load of one leaf) and written one group at a time (Orbax partial saves of at most
`_GROUP_BYTES`, a tensor above that alone, without Orbax's defensive copy), so host memory peaks
near one copy of the largest tensor torch -> Orbax and two Orbax -> torch (tensorstore's read
buffer and the result), never the checkpoint. Output goes to a temp dir next to the destination
and is renamed into place at the end; any failure removes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dspark_jax import params as params_lib
from dspark_jax import sharding as sharding_lib
from dspark_jax.checkpoint.safetensors_io import (DTYPE_NAMES, DTYPES, CheckpointError, SafetensorsFile,
                                                  header_for, save_arrays, write_streaming)
from dspark_jax.config import ConfigError, DraftConfig
from dspark_jax.models.dspark import K3DSparkModel

SAFETENSORS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
LAYOUT_FILE = "safetensors_layout.json"
PARAMS_DIR = "params"
EMBED_NAME = "embed_tokens.weight"
TORCHSPEC_METADATA = {"torchspec_version": "0.1.0"}
LAYOUT_FORMAT = "dspark_jax.draft_orbax"
LAYOUT_VERSION = 1

_GROUP_BYTES = 256 * 2**20    # fewer Orbax partial saves (each commits metadata) at bounded memory
_COMPARE_BYTES = 64 * 2**20   # --check compares in slices: no full-size temporaries
_MAX_LISTED = 12

Progress = Callable[[str], None]


# ---------------------------------------------------------------------------------------------
# abstract inventory


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str                # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def num_params(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.num_params * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class DraftInventory:
    """What the torch-layout file of a draft holds, in file order, and its exact size."""
    tensors: tuple[TensorEntry, ...]
    header_size: int          # JSON header bytes (padded to 8-byte alignment)

    @property
    def num_params(self) -> int:
        return sum(t.num_params for t in self.tensors)

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        return 8 + self.header_size + self.data_bytes


def _dtype_name(dtype) -> str:
    return DTYPE_NAMES[np.dtype(jnp.dtype(dtype))]


def abstract_draft(cfg: DraftConfig, dtype=None) -> K3DSparkModel:
    """The draft with ShapeDtypeStruct params (nothing allocated); dtype defaults to the config's."""
    dt = jnp.dtype(dtype if dtype is not None else cfg.dtype)
    return nnx.eval_shape(lambda: K3DSparkModel(cfg, dtype=dt, rngs=nnx.Rngs(0)))


def expected_tensors(cfg: DraftConfig, *, include_embed: bool = True) -> dict[str, TensorEntry]:
    """Name -> entry for every tensor the config implies (the model's params, plus the target's
    embedding copy), all in the config's `torch_dtype`."""
    dt = _dtype_name(cfg.dtype)
    out = {}
    if include_embed:
        out[EMBED_NAME] = TensorEntry(EMBED_NAME, dt, (cfg.vocab_size, cfg.hidden_size))
    for name, p in params_lib.flat_params(abstract_draft(cfg)).items():
        out[name] = TensorEntry(name, dt, tuple(p.get_value().shape))
    return out


def draft_inventory(cfg: DraftConfig, *, include_embed: bool = True,
                    metadata: Mapping[str, str] | None = TORCHSPEC_METADATA) -> DraftInventory:
    """The tensors a torch-layout draft file holds for `cfg`, in the order torch's `save_file`
    writes them (wider dtypes first, then by name), and the header size; computed abstractly."""
    entries = sorted(expected_tensors(cfg, include_embed=include_embed).values(),
                     key=lambda t: (-DTYPES[t.dtype].itemsize, t.name))
    raw, _ = header_for([(t.name, t.dtype, t.shape) for t in entries], metadata)
    return DraftInventory(tuple(entries), len(raw))


# ---------------------------------------------------------------------------------------------
# validation against config.json

# Which config.json keys size each dimension, for errors that say what to fix.
_DIM_KEYS: dict[str, tuple[str, ...]] = {
    "embed_tokens.weight": ("vocab_size", "hidden_size"),
    "context_proj.weight": ("hidden_size", "len(target_layer_ids) * target_hidden_size"),
    "context_norm.weight": ("hidden_size",),
    "final_norm.weight": ("hidden_size",),
    "input_layernorm.weight": ("hidden_size",),
    "post_attention_layernorm.weight": ("hidden_size",),
    "markov_w1.weight": ("vocab_size", "markov_rank"),
    "markov_w2.weight": ("vocab_size", "markov_rank"),
    "proj.weight": ("1", "hidden_size + markov_rank (confidence_head_with_markov)"),
    "proj.bias": ("1",),
    "q_proj.weight": ("num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)", "hidden_size"),
    "q_a_proj.weight": ("q_lora_rank", "hidden_size"),
    "q_a_layernorm.weight": ("q_lora_rank",),
    "q_b_proj.weight": ("num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)", "q_lora_rank"),
    "kv_a_proj_with_mqa.weight": ("kv_lora_rank + qk_rope_head_dim", "hidden_size"),
    "kv_a_layernorm.weight": ("kv_lora_rank",),
    "kv_b_proj.weight": ("num_attention_heads * (qk_nope_head_dim + v_head_dim)", "kv_lora_rank"),
    "o_proj.weight": ("hidden_size", "num_attention_heads * v_head_dim"),
    "gate_proj.weight": ("intermediate_size", "hidden_size"),
    "up_proj.weight": ("intermediate_size", "hidden_size"),
    "down_proj.weight": ("hidden_size", "intermediate_size"),
}


def _dim_keys(name: str) -> tuple[str, ...] | None:
    parts = name.split(".")
    return _DIM_KEYS.get(".".join(parts[-2:]), _DIM_KEYS.get(name))


def _presence_hint(name: str, cfg: DraftConfig, missing: bool) -> str:
    """The config key that decides whether a tensor exists."""
    layer = re.match(r"layers\.(\d+)\.", name)
    if layer and (missing or int(layer.group(1)) >= cfg.num_hidden_layers):
        return f"config.json num_hidden_layers={cfg.num_hidden_layers}"
    if layer:
        return "no DSpark draft layer has it"
    if name.startswith("markov_head."):
        return f"config.json markov_rank={cfg.markov_rank}"
    if name.startswith("confidence_head."):
        return f"config.json enable_confidence_head={str(cfg.enable_confidence_head).lower()}"
    return "the draft needs it" if missing else "not a DSpark draft tensor"


def _shape_problem(name: str, got: tuple[int, ...], want: tuple[int, ...], cfg: DraftConfig) -> str:
    keys = _dim_keys(name)
    if len(got) != len(want) or keys is None:
        return f"has shape {list(got)}, config.json implies {list(want)}"
    bad = [f"dim {i} is {g}, config.json {keys[i]} = {w}"
           for i, (g, w) in enumerate(zip(got, want)) if g != w]
    return f"has shape {list(got)}, config.json implies {list(want)} ({'; '.join(bad)})"


def check_tensors(cfg: DraftConfig, found: Sequence[TensorEntry], where: str) -> None:
    """Raise CheckpointError listing every tensor in `found` that config.json does not imply
    (missing, unexpected, wrong shape, wrong dtype); `embed_tokens.weight` may be absent."""
    want = expected_tensors(cfg)
    have = {t.name: t for t in found}
    problems = []
    for name, w in want.items():
        if name not in have:
            if name != EMBED_NAME:
                problems.append(f"{where}: missing tensor {name!r} ({list(w.shape)} {w.dtype}; "
                                f"{_presence_hint(name, cfg, True)})")
            continue
        t = have[name]
        if t.shape != w.shape:
            problems.append(f"{where}: tensor {name!r} {_shape_problem(name, t.shape, w.shape, cfg)}")
        elif t.dtype != w.dtype:
            problems.append(f"{where}: tensor {name!r} is {t.dtype}, config.json torch_dtype "
                            f"{cfg.dtype!r} implies {w.dtype}")
    for name in have:
        if name not in want:
            problems.append(f"{where}: unexpected tensor {name!r} ({_presence_hint(name, cfg, False)})")
    if problems:
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise CheckpointError(f"{where} does not match its config.json ({len(problems)} problem(s)):\n  "
                              + "\n  ".join(problems[:_MAX_LISTED]) + more)


def _read_config(path: Path) -> tuple[DraftConfig, bytes]:
    """The config and its exact bytes (copied verbatim by the converters)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json") from None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return DraftConfig.from_dict(doc, where=str(path)), raw


# ---------------------------------------------------------------------------------------------
# the two layouts


def _entries_in_file_order(sf: SafetensorsFile) -> list[TensorEntry]:
    """Tensors by data offset; the data must be contiguous from offset 0 to the end of the file,
    which is what lets the writer reproduce the file byte for byte."""
    infos = sorted(sf.tensors.values(), key=lambda i: (i.begin, i.end))
    pos = sf.data_start
    for info in infos:
        if info.begin != pos:
            raise CheckpointError(f"{sf.path}: tensor {info.name!r} starts at byte {info.begin}, expected "
                                  f"{pos} (gaps or overlaps between tensors are not supported)")
        pos = info.end
    size = sf.path.stat().st_size
    if pos != size:
        raise CheckpointError(f"{sf.path}: {size - pos} trailing bytes after the last tensor")
    return [TensorEntry(i.name, i.dtype, i.shape) for i in infos]


@dataclass
class TorchDraft:
    """A validated torch-layout draft directory (headers only; no tensor data read)."""
    path: Path
    cfg: DraftConfig
    config_bytes: bytes
    file: SafetensorsFile
    tensors: list[TensorEntry]    # file order

    def read(self, name: str) -> np.ndarray:
        """One tensor, read straight into its array (one copy of the tensor in memory)."""
        info = self.file.tensors[name]
        arr = np.empty(info.shape, info.np_dtype)
        with open(self.file.path, "rb") as f:
            f.seek(info.begin)
            got = f.readinto(memoryview(arr.reshape(-1).view(np.uint8)))
        if got != info.nbytes:
            raise CheckpointError(f"{self.file.path}: truncated while reading tensor {name!r}")
        return arr


def open_torch_draft(path: str | Path) -> TorchDraft:
    path = Path(path)
    st = path / SAFETENSORS_FILE
    if (path / "model.safetensors.index.json").exists():
        raise CheckpointError(f"{path}: sharded drafts are not supported (expected one {SAFETENSORS_FILE})")
    if not st.is_file():
        raise CheckpointError(f"{path}: no {SAFETENSORS_FILE}")
    cfg, raw = _read_config(path / CONFIG_FILE)
    sf = SafetensorsFile(st)
    entries = _entries_in_file_order(sf)
    check_tensors(cfg, entries, str(st))
    return TorchDraft(path, cfg, raw, sf, entries)


def _orbax():
    """orbax.checkpoint v1, imported on first use (it is slow to import and only converters need it)."""
    import orbax.checkpoint.experimental.v1 as ocp
    return ocp


def _orbax_context(*, partial_load: bool = False):
    ocp = _orbax()
    ctx = ocp.Context()
    # bf16 weights barely compress; zstd would dominate the conversion time
    ctx.array.saving.use_compression = False
    # the arrays are ours and never mutated during the save: Orbax's defensive copy would double
    # the peak memory
    ctx.memory.deepcopy_host_arrays = False
    ctx.pytree.loading.partial_load = partial_load
    return ctx


def _nest(flat: Mapping[str, object]) -> dict:
    """{"a.b.c": x} -> {"a": {"b": {"c": x}}}: the NNX path as the Orbax tree."""
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


@dataclass
class OrbaxDraft:
    """A validated Orbax-layout draft directory (metadata only; no tensor data read)."""
    path: Path
    cfg: DraftConfig
    config_bytes: bytes
    header_bytes: bytes
    tensors: list[TensorEntry]    # safetensors file order
    leaves: dict[str, object]     # name -> Orbax leaf metadata (the abstract leaf to load it with)

    @property
    def params_dir(self) -> Path:
        return self.path / PARAMS_DIR

    def read(self, name: str) -> np.ndarray:
        """One tensor by a partial load of just its leaf."""
        ocp = _orbax()
        try:
            with _orbax_context(partial_load=True):
                tree = ocp.load(self.params_dir, _nest({name: self.leaves[name]}))
        except Exception as e:  # Orbax/tensorstore raise many types; name what failed
            raise CheckpointError(f"{self.params_dir}: cannot read tensor {name!r} ({type(e).__name__}: {e})") from e
        return np.asarray(_flatten(tree)[name])


def _parse_header(header_bytes: bytes, where: str) -> list[TensorEntry]:
    try:
        doc = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: corrupt safetensors header ({e})") from None
    doc.pop("__metadata__", None)
    items, pos = [], 0
    for name, h in sorted(doc.items(), key=lambda kv: tuple(kv[1].get("data_offsets", (0, 0)))):
        dt, shape, (b, e) = h.get("dtype"), tuple(int(s) for s in h.get("shape", ())), h.get("data_offsets")
        if dt not in DTYPES:
            raise CheckpointError(f"{where}: tensor {name!r} has unsupported dtype {dt!r}")
        entry = TensorEntry(name, dt, shape)
        if b != pos or e - b != entry.nbytes:
            raise CheckpointError(f"{where}: tensor {name!r} has data_offsets {[b, e]}, expected "
                                  f"{[pos, pos + entry.nbytes]}")
        items.append(entry)
        pos = e
    return items


def open_orbax_draft(path: str | Path) -> OrbaxDraft:
    path = Path(path)
    cfg, raw = _read_config(path / CONFIG_FILE)
    layout_path = path / LAYOUT_FILE
    params_dir = path / PARAMS_DIR
    if not params_dir.is_dir():
        raise CheckpointError(f"{path}: no Orbax checkpoint directory {PARAMS_DIR}/")
    ocp = _orbax()
    try:
        with _orbax_context():
            leaves = _flatten(ocp.metadata(params_dir).metadata)
    except Exception as e:
        raise CheckpointError(f"{params_dir}: not a readable Orbax checkpoint ({type(e).__name__}: {e})") from e
    if layout_path.exists():
        try:
            layout = json.loads(layout_path.read_text())
            header_bytes = layout["header"].encode("utf-8")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{layout_path}: not a valid layout file ({type(e).__name__}: {e})") from None
        if layout.get("format") != LAYOUT_FORMAT or layout.get("version") != LAYOUT_VERSION:
            raise CheckpointError(f"{layout_path}: format {layout.get('format')!r} version "
                                  f"{layout.get('version')!r}, expected {LAYOUT_FORMAT!r} {LAYOUT_VERSION}")
        tensors = _parse_header(header_bytes, str(layout_path))
        check_tensors(cfg, tensors, str(layout_path))
    else:
        # an Orbax draft from elsewhere (training): export with a fresh header, embeddings if saved
        inv = draft_inventory(cfg, include_embed=EMBED_NAME in leaves)
        tensors = list(inv.tensors)
        header_bytes = header_for([(t.name, t.dtype, t.shape) for t in tensors], TORCHSPEC_METADATA)[0]
    problems = []
    for t in tensors:
        leaf = leaves.get(t.name)
        if leaf is None:
            problems.append(f"{params_dir}: missing tensor {t.name!r}")
            continue
        shape, dtype = tuple(getattr(leaf, "shape", ()) or ()), getattr(leaf, "dtype", None)
        if shape != t.shape or dtype is None or np.dtype(dtype) != DTYPES[t.dtype]:
            problems.append(f"{params_dir}: tensor {t.name!r} is {list(shape)} {dtype}, the header says "
                            f"{list(t.shape)} {DTYPES[t.dtype].name}")
    known = {t.name for t in tensors}
    problems += [f"{params_dir}: unexpected tensor {n!r}" for n in leaves if n not in known]
    if problems:
        raise CheckpointError(f"{path}: the Orbax params do not match the draft layout "
                              f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems[:_MAX_LISTED]))
    return OrbaxDraft(path, cfg, raw, header_bytes, tensors, leaves)


def is_torch_draft_dir(path: Path) -> bool:
    return (path / SAFETENSORS_FILE).is_file()


def is_orbax_draft_dir(path: Path) -> bool:
    return (path / PARAMS_DIR).is_dir()


# ---------------------------------------------------------------------------------------------
# conversion


@contextlib.contextmanager
def _staging(dst: Path) -> Iterator[Path]:
    """A fresh temp dir next to `dst`, renamed to `dst` on success and removed on any failure."""
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst}: destination exists and is not an empty directory")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
        os.rename(tmp, dst)      # atomic; replaces an empty dst directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ua = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    ub = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    return all(np.array_equal(ua[i:i + _COMPARE_BYTES], ub[i:i + _COMPARE_BYTES])
               for i in range(0, ua.size, _COMPARE_BYTES))


def _as_buffer(arr: np.ndarray) -> memoryview:
    """The raw bytes of an array without a copy (ndarray.tobytes would copy the tensor)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def _groups(tensors: Sequence[TensorEntry]) -> Iterator[list[TensorEntry]]:
    group, size = [], 0
    for t in tensors:
        if group and size + t.nbytes > _GROUP_BYTES:
            yield group
            group, size = [], 0
        group.append(t)
        size += t.nbytes
    if group:
        yield group


def _prefetched(keys: Sequence, load: Callable) -> Iterator[tuple[object, object]]:
    """(key, load(key)) in order, loading the next key in a worker thread while the caller
    handles the current one: reads overlap writes (file I/O and tensorstore release the GIL) at
    the cost of one extra item in memory."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(load, keys[0]) if keys else None
        for i, key in enumerate(keys):
            value = pending.result()
            pending = pool.submit(load, keys[i + 1]) if i + 1 < len(keys) else None
            yield key, value
            del value


def _compare_all(what: str, tensors: Sequence[TensorEntry], read_a, read_b) -> None:
    for t in tensors:
        if not _same_bytes(read_a(t.name), read_b(t.name)):
            raise CheckpointError(f"--check: tensor {t.name!r} differs after conversion ({what})")


def torch_to_orbax(src: str | Path, dst: str | Path, *, check: bool = False,
                   progress: Progress | None = None) -> OrbaxDraft:
    """Convert a torch-layout draft dir to the Orbax layout (see the module docstring)."""
    ocp = _orbax()
    src_draft = open_torch_draft(src)
    dst = Path(dst)
    header = src_draft.file.header_bytes
    with _staging(dst) as tmp:
        (tmp / CONFIG_FILE).write_bytes(src_draft.config_bytes)
        layout = {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, "file": SAFETENSORS_FILE,
                  "header": header.decode("utf-8")}
        (tmp / LAYOUT_FILE).write_text(json.dumps(layout, indent=1) + "\n")
        read_group = lambda group: {t.name: src_draft.read(t.name) for t in group}
        with _orbax_context():
            for group, arrays in _prefetched(list(_groups(src_draft.tensors)), read_group):
                ocp.partial.save(tmp / PARAMS_DIR, _nest(arrays))
                del arrays
                if progress is not None:
                    progress(f"saved {', '.join(t.name for t in group)}")
            ocp.partial.finalize(tmp / PARAMS_DIR)
        out = open_orbax_draft(tmp)
        if out.header_bytes != header or out.config_bytes != src_draft.config_bytes:
            raise CheckpointError(f"{tmp}: header or config.json changed on the way (bug)")
        if check:
            _compare_all(f"{src_draft.file.path} vs {tmp / PARAMS_DIR}", src_draft.tensors,
                         src_draft.read, out.read)
    return open_orbax_draft(dst)


def orbax_to_torch(src: str | Path, dst: str | Path, *, check: bool = False,
                   progress: Progress | None = None) -> TorchDraft:
    """Convert an Orbax-layout draft dir back to config.json + model.safetensors."""
    src_draft = open_orbax_draft(src)
    dst = Path(dst)

    def chunks():
        for t, arr in _prefetched(src_draft.tensors, lambda t: src_draft.read(t.name)):
            yield t.name, _as_buffer(arr)
            del arr
            if progress is not None:
                progress(f"wrote {t.name}")

    with _staging(dst) as tmp:
        write_streaming(tmp / SAFETENSORS_FILE, [(t.name, t.dtype, t.shape) for t in src_draft.tensors],
                        chunks(), header_bytes=src_draft.header_bytes)
        (tmp / CONFIG_FILE).write_bytes(src_draft.config_bytes)
        out = open_torch_draft(tmp)
        if out.file.header_bytes != src_draft.header_bytes:
            raise CheckpointError(f"{tmp / SAFETENSORS_FILE}: header changed on the way (bug)")
        if check:
            _compare_all(f"{src_draft.params_dir} vs {tmp / SAFETENSORS_FILE}", src_draft.tensors,
                         src_draft.read, out.read)
    return open_torch_draft(dst)


def convert_draft(src: str | Path, dst: str | Path, *, check: bool = False,
                  progress: Progress | None = None) -> str:
    """Convert in the direction the source implies; returns "torch->orbax" or "orbax->torch"."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src}: source is not a directory")
    if is_torch_draft_dir(src):
        torch_to_orbax(src, dst, check=check, progress=progress)
        return "torch->orbax"
    if is_orbax_draft_dir(src):
        orbax_to_torch(src, dst, check=check, progress=progress)
        return "orbax->torch"
    raise CheckpointError(f"{src}: neither a torch draft ({SAFETENSORS_FILE} + {CONFIG_FILE}) nor an Orbax "
                          f"draft ({PARAMS_DIR}/ + {CONFIG_FILE})")


# ---------------------------------------------------------------------------------------------
# loading a model


def load_draft(path: str | Path, *, dtype=None, mesh: Mesh | None = None) -> K3DSparkModel:
    """The draft from a torch-layout dir, an Orbax-layout dir or a preset name, tensor by tensor,
    each placed straight into its sharding on `mesh` (default: one device). `dtype` overrides the
    config's (floats are cast, e.g. float32 for tests). `embed_tokens` is not loaded (the target's
    table is used)."""
    from dspark_jax.presets import resolve_model_path

    path = resolve_model_path(path)
    if is_torch_draft_dir(path):
        src = open_torch_draft(path)
    elif is_orbax_draft_dir(path):
        src = open_orbax_draft(path)
    else:
        raise CheckpointError(f"{path}: neither a torch nor an Orbax draft directory")
    mesh = mesh if mesh is not None else sharding_lib.make_mesh(devices=jax.devices()[:1])
    graphdef, state = nnx.split(abstract_draft(src.cfg, dtype))
    flat = []
    for key_path, var in nnx.to_flat_state(state):
        name = ".".join(str(k) for k in key_path)
        abstract = var.get_value()
        spec = sharding_lib.logical_to_spec(params_lib.logical_axes(var), abstract.shape, mesh)
        value = src.read(name).astype(abstract.dtype, copy=False)
        flat.append((key_path, var.replace(jax.device_put(value, NamedSharding(mesh, spec)))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---------------------------------------------------------------------------------------------
# exporting a model (training)


def save_torch_draft(model: K3DSparkModel, cfg_dict: Mapping, dst: str | Path) -> TorchDraft:
    """Write a draft model in the torch layout: `config.json` (cfg_dict as given; its
    `torch_dtype` decides the tensor dtype) + `model.safetensors` in the reference writer's order
    with the TorchSpec metadata, without `embed_tokens` (the target's). Atomic (temp dir + rename)."""
    cfg = DraftConfig.from_dict(dict(cfg_dict), where="save_torch_draft config")
    dt = np.dtype(jnp.dtype(cfg.dtype))
    arrays = {name: np.asarray(jax.device_get(p.get_value())).astype(dt)
              for name, p in params_lib.flat_params(model).items()}
    check_tensors(cfg, [TensorEntry(n, _dtype_name(a.dtype), tuple(a.shape)) for n, a in arrays.items()],
                  "save_torch_draft")
    with _staging(Path(dst)) as tmp:
        save_arrays(tmp / SAFETENSORS_FILE, arrays, TORCHSPEC_METADATA)
        (tmp / CONFIG_FILE).write_text(json.dumps(dict(cfg_dict), indent=2) + "\n")
    return open_torch_draft(dst)
