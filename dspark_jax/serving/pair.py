"""Model resolution for the entry points (`serve.generate`, `serve.server`, `serve.bench`) and the
start-up description they log.

`--model` / `--draft_model` take a directory or a preset name; omitted, they name the demo pair
(`smollm2-135m` + `smollm2-135m-dspark`). Two draft names are special:
- `none`: plain decoding;
- `untrained` or `untrained:CONFIG.json`: a randomly initialised draft of that config (default:
  the demo draft's config). Useful as a pipeline check and as the `--reference_draft` floor of the
  benchmark; its acceptance means nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import jax
from flax import nnx

from dspark_jax import sharding as sharding_lib
from dspark_jax.api import DEFAULT_DRAFT, DEFAULT_TARGET, load_draft, load_target
from dspark_jax.api import resolve_dtype as api_resolve_dtype
from dspark_jax.cache import value_dtype
from dspark_jax.config.draft import DraftConfig
from dspark_jax.decode.config import DTYPE_CHOICES, EngineConfig, SchedulerConfig
from dspark_jax.decode.engine import pool_geometry
from dspark_jax.decode.requests import tokenizer_for
from dspark_jax.presets import resolve_model_path

log = logging.getLogger("dspark_jax.serving")

DEMO_DRAFT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2-135m-dspark.json"
UNTRAINED = "untrained"


@dataclass
class ModelPair:
    target: object
    draft: object | None
    tokenizer: object | None
    target_name: str
    draft_name: str | None                 # None: plain decoding
    mesh: jax.sharding.Mesh | None = None


def make_mesh(tp: int) -> jax.sharding.Mesh | None:
    """A tensor-parallel mesh over the first `tp` devices (None: one device, no mesh). In a
    multi-process run (dspark_jax/distributed.py) the mesh must hold every process's devices,
    so `tp` must be the global device count."""
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    devices = jax.devices()
    if jax.process_count() > 1:
        if tp != len(devices):
            raise ValueError(f"--tp={tp}: a run over {jax.process_count()} processes places one model on all "
                             f"{len(devices)} devices of the global mesh; pass --tp {len(devices)}")
        return sharding_lib.make_mesh(tensor=tp, devices=devices)
    if tp == 1:
        return None
    if tp > len(devices):
        raise ValueError(f"--tp={tp} but only {len(devices)} {devices[0].platform} device(s) are visible")
    return sharding_lib.make_mesh(tensor=tp, devices=devices[:tp])


def untrained_draft(target, config: str | Path | None = None, seed: int = 0, mesh=None):
    """A randomly initialised draft (default: the demo draft's config), in the target's dtype."""
    path = Path(config) if config else DEMO_DRAFT_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"untrained draft: config {path} not found")
    from dspark_jax.models.dspark import K3DSparkModel
    cfg = DraftConfig.from_dict(json.loads(path.read_text()), where=str(path))
    if mesh is not None:
        return sharding_lib.create_sharded(lambda: K3DSparkModel(cfg, dtype=target.dtype, rngs=nnx.Rngs(seed)), mesh)
    return K3DSparkModel(cfg, dtype=target.dtype, rngs=nnx.Rngs(seed))


def load_draft_spec(spec: str, target, mesh=None):
    """A draft from a directory / preset name, `untrained[:CONFIG]`, or None for `none`."""
    if spec == "none":
        return None
    if spec == UNTRAINED or spec.startswith(UNTRAINED + ":"):
        return untrained_draft(target, spec[len(UNTRAINED) + 1:] or None, mesh=mesh)
    return load_draft(spec, dtype=target.dtype, mesh=mesh)


def fingerprint(spec: str, content_limit: int = 256 << 20) -> str:
    """What identifies a model's weights (a benchmark journal's key): sha256 over the directory's
    files (name, size, and the content of files up to `content_limit` bytes; larger ones by
    modification time), so a preset retrained under the same name gets a new fingerprint.
    `untrained[:CONFIG]` is its config; `none` is itself."""
    if spec == "none":
        return spec
    h = hashlib.sha256()
    if spec == UNTRAINED or spec.startswith(UNTRAINED + ":"):
        files = [Path(spec[len(UNTRAINED) + 1:] or DEMO_DRAFT_CONFIG)]
    else:
        files = sorted(p for p in resolve_model_path(spec).iterdir() if p.is_file())
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        if size <= content_limit:
            with open(path, "rb") as f:
                while block := f.read(16 << 20):
                    h.update(block)
        else:
            h.update(str(path.stat().st_mtime_ns).encode())
    return h.hexdigest()[:16]


def resolve_dtype(name: str | None):
    """A --dtype choice as a load dtype (None: the checkpoint's); `auto` logs what it chose and why."""
    if name is not None and name not in DTYPE_CHOICES:
        raise ValueError(f"--dtype {name!r}: expected one of {', '.join(DTYPE_CHOICES)}")
    return api_resolve_dtype(name, "--dtype")


def load_pair(model: str | None = None, draft_model: str | None = None, *, tp: int = 1,
              dtype: str | None = "auto") -> ModelPair:
    """Target + draft for an entry point (see the module docstring for the names); `dtype`: a
    --dtype choice (`resolve_dtype`)."""
    mesh = make_mesh(tp)
    target_name = model or DEFAULT_TARGET
    target = load_target(target_name, mesh=mesh, dtype=resolve_dtype(dtype))
    draft_name = draft_model or DEFAULT_DRAFT
    draft = load_draft_spec(draft_name, target, mesh)
    return ModelPair(target, draft, tokenizer_for(target), str(target_name),
                     None if draft is None else draft_name, mesh)


def describe(pair: ModelPair, config: EngineConfig, scheduling: SchedulerConfig, *, store_dtype=None,
             pool: bool = False) -> list[str]:
    """What the entry point detected, one line per component (logged at start-up); `pool`: also
    the page size and the paged pool's size (the server, which allocates it for its slots)."""
    draft, config = config.for_pair(pair.draft)
    num_speculative_tokens = config.num_speculative_tokens
    cfg = pair.target.cfg
    lines = []
    fam = f"family={cfg.family}"
    if cfg.family == "kimi_linear":
        fam += (f" ({len(cfg.kda_layers)} KDA + {len(cfg.full_attn_layers)} MLA layers, "
                f"{cfg.num_experts} routed experts)")
    lines.append(f"target: {pair.target_name}: {fam}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                 f"vocab {cfg.vocab_size}, params {jax.numpy.dtype(pair.target.dtype).name}")
    if draft is None:
        lines.append("drafter: none (plain decoding)")
    else:
        dc = pair.draft.cfg
        lines.append(f"drafter: DSpark {type(pair.draft).__name__} ({pair.draft_name}): {dc.num_hidden_layers} MLA "
                     f"layers, block of {num_speculative_tokens} speculative tokens, aux capture layer ids "
                     f"{list(dc.target_layer_ids)}, markov rank {dc.markov_rank}, confidence head "
                     f"{'on' if dc.enable_confidence_head else 'off'}"
                     + (f", speculation length {scheduling.speculative_length}"
                        + (" (0..T per step from measured step costs)" if scheduling.speculative_length == "adaptive"
                           else "")))
    cache = f"kv cache: --kv_cache_dtype {config.kv_cache_dtype}"
    if store_dtype is not None:
        stored, value = jax.numpy.dtype(store_dtype), value_dtype(store_dtype)
        cache += f" -> stored as {value.name}" + (f" (bit patterns in {stored.name})" if stored != value else "")
    if pool:
        max_num_seqs, max_model_len = scheduling.max_num_seqs, scheduling.max_len_for(pair.target)
        cache += f", block_size {config.page_size}"
        rows, width = pool_geometry(pair.target, draft)
        itemsize = jax.numpy.dtype(store_dtype or pair.target.dtype).itemsize
        nbytes = rows * max_num_seqs * max_model_len * width * itemsize
        cache += (f", {rows} rows x {max_num_seqs} slots x {max_model_len} positions x {width} wide "
                  f"({nbytes / 2 ** 20:.1f} MiB); prompts prefilled {scheduling.max_num_batched_tokens} tokens per step")
    lines.append(cache)
    if pair.mesh is None:
        d = jax.local_devices()[0]
        lines.append(f"mesh: none (one {d.platform} device: {d.device_kind})")
    else:
        shape = ", ".join(f"{k}={v}" for k, v in pair.mesh.shape.items())
        lines.append(f"mesh: {shape} over {pair.mesh.devices.size} {pair.mesh.devices.flat[0].platform} devices")
    return lines
