"""The DSpark draft's tensor inventory (docs/architecture.md §3.2) derived from its config.json, and the check
of a checkpoint's tensors against it: names, shapes and dtypes, each problem named with the
config key that decides it. No data is touched: the full-size K3 draft's 68 tensors are counted
abstractly."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax.checkpoint.safetensors_io import DTYPE_NAMES, DTYPES, CheckpointError, header_for
from dspark_jax.config.draft import DraftConfig
from dspark_jax.models.dspark import VOCAB_MAP_DTYPES, K3DSparkModel, VocabMap

EMBED_NAME = "embed_tokens.weight"
TORCHSPEC_METADATA = {"torchspec_version": "0.1.0"}
MAX_LISTED = 12               # problems listed in one error message


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


def dtype_name(dtype) -> str:
    return DTYPE_NAMES[np.dtype(jnp.dtype(dtype))]


def abstract_draft(cfg: DraftConfig, dtype=None) -> K3DSparkModel:
    """The draft with ShapeDtypeStruct params (nothing allocated); dtype defaults to the config's."""
    dt = jnp.dtype(dtype if dtype is not None else cfg.dtype)
    return nnx.eval_shape(lambda: K3DSparkModel(cfg, dtype=dt, rngs=nnx.Rngs(0)))


def vocab_map_vars(module) -> dict[str, VocabMap]:
    """`{"d2t": var, "t2d": var}` of a reduced-vocabulary draft ({} at full vocabulary)."""
    state = nnx.state(module, VocabMap)
    return {".".join(str(k) for k in path): v for path, v in nnx.to_flat_state(state)}


def expected_tensors(cfg: DraftConfig, *, include_embed: bool = True) -> dict[str, TensorEntry]:
    """Name -> entry for every tensor the config implies (the model's params, plus the target's
    embedding copy), all in the config's `torch_dtype`; with `draft_vocab_size` < `vocab_size`
    also the vocabulary map `d2t` (I64 [K]) and `t2d` (BOOL [V]) as EAGLE-3 checkpoints carry it."""
    dt = dtype_name(cfg.dtype)
    out = {}
    if include_embed:
        out[EMBED_NAME] = TensorEntry(EMBED_NAME, dt, (cfg.vocab_size, cfg.hidden_size))
    model = abstract_draft(cfg)
    for name, p in params_lib.flat_params(model).items():
        out[name] = TensorEntry(name, dt, tuple(p.get_value().shape))
    for name, v in vocab_map_vars(model).items():
        out[name] = TensorEntry(name, VOCAB_MAP_DTYPES[name], tuple(v.get_value().shape))
    return out


def check_vocab_map(cfg: DraftConfig, d2t: np.ndarray, t2d: np.ndarray, where: str) -> np.ndarray:
    """The kept target ids [K] of a map read from a checkpoint, after checking that `d2t` and `t2d`
    agree with each other and with config.json; the error names the tensor."""
    k, v = cfg.draft_vocab, cfg.vocab_size
    d2t, t2d = np.asarray(d2t), np.asarray(t2d)
    if d2t.shape != (k,):
        raise CheckpointError(f"{where}: tensor 'd2t' has shape {list(d2t.shape)}, config.json draft_vocab_size = {k}")
    if t2d.shape != (v,):
        raise CheckpointError(f"{where}: tensor 't2d' has shape {list(t2d.shape)}, config.json vocab_size = {v}")
    ids = np.arange(k, dtype=np.int64) + d2t.astype(np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= v))
    if bad.size:
        raise CheckpointError(f"{where}: tensor 'd2t' maps draft index {int(bad[0])} to target id "
                              f"{int(ids[bad[0]])}, outside 0..vocab_size-1={v - 1}")
    if k > 1 and not np.all(np.diff(ids) > 0):
        i = int(np.flatnonzero(np.diff(ids) <= 0)[0])
        raise CheckpointError(f"{where}: tensor 'd2t' target ids are not strictly increasing (draft index "
                              f"{i} -> {int(ids[i])}, {i + 1} -> {int(ids[i + 1])}); EAGLE-3 maps keep them sorted")
    want = np.zeros(v, bool)
    want[ids] = True
    if not np.array_equal(t2d.astype(bool), want):
        j = int(np.flatnonzero(t2d.astype(bool) != want)[0])
        raise CheckpointError(f"{where}: tensor 't2d' disagrees with 'd2t' at target id {j} "
                              f"(t2d {bool(t2d[j])}, d2t {'keeps' if want[j] else 'drops'} it)")
    return ids


def draft_inventory(cfg: DraftConfig, *, include_embed: bool = True,
                    metadata: Mapping[str, str] | None = TORCHSPEC_METADATA) -> DraftInventory:
    """The tensors a torch-layout draft file holds for `cfg`, in the order torch's `save_file`
    writes them (wider dtypes first, then by name), and the header size; computed abstractly."""
    entries = sorted(expected_tensors(cfg, include_embed=include_embed).values(),
                     key=lambda t: (-DTYPES[t.dtype].itemsize, t.name))
    raw, _ = header_for([(t.name, t.dtype, t.shape) for t in entries], metadata)
    return DraftInventory(tuple(entries), len(raw))


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
    "markov_w2.weight": ("draft_vocab_size", "markov_rank"),
    "d2t": ("draft_vocab_size",),
    "t2d": ("vocab_size",),
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
    if name in VOCAB_MAP_DTYPES:
        return (f"config.json draft_vocab_size={cfg.draft_vocab} < vocab_size={cfg.vocab_size} needs the map"
                if missing else f"config.json draft_vocab_size={cfg.draft_vocab} = vocab_size: no map "
                "for a full draft vocabulary")
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
        elif t.dtype != w.dtype and name in VOCAB_MAP_DTYPES:
            problems.append(f"{where}: tensor {name!r} is {t.dtype}, the EAGLE-3 map tensor is {w.dtype}")
        elif t.dtype != w.dtype:
            problems.append(f"{where}: tensor {name!r} is {t.dtype}, config.json torch_dtype "
                            f"{cfg.dtype!r} implies {w.dtype}")
    for name in have:
        if name not in want:
            problems.append(f"{where}: unexpected tensor {name!r} ({_presence_hint(name, cfg, False)})")
    if problems:
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise CheckpointError(f"{where} does not match its config.json ({len(problems)} problem(s)):\n  "
                              + "\n  ".join(problems[:MAX_LISTED]) + more)
