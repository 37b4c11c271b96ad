"""Serving memory plan: does a target + DSpark draft fit a device mesh?

Everything is abstract: the models are built with `params.abstract` (ShapeDtypeStructs, no
weights), the caches with `jax.eval_shape`, and the serving programs are lowered and compiled
ahead of time (`jax.jit(f).lower(abstract args).compile()`) for a mesh of fake CPU devices. The
plan reports per weight class its sharding and per-device bytes, the cache bytes, and per program
XLA's own per-device buffer assignment (`compiled.memory_analysis()`): arguments, outputs not
aliased to donated inputs, and temporaries.

Programs (caches are donated, as a server would):
- `prefill`: one chunk of one sequence's prompt (`prefill_chunk`: `Engine.prefill_fn`'s body
  at the chunk's positions, continuing the slot's KDA state: `steps.target_forward` in chunked-KDA
  mode, the draft's context rows, the next token), on the full serving caches. Long prompts must
  be prefilled chunk by chunk (a whole 16K-token prompt does not fit K3 on 8 x 288 GB); a chunk
  costs the same at any offset (attention reads the whole logical cache under a mask).
- `step`: one speculative decode step for the whole batch (`Engine.step_fn`: propose T drafts,
  verify `[x0, d_1..d_T]` with per-token KDA snapshots, accept, commit, draft context rows).
- `propose`: the draft's block pass alone (`steps.draft_block`), also part of `step`.
The report's peak is the largest of `max(arguments, weights + caches) + temporaries + outputs not
aliased to donated inputs` over the programs.

The numbers are XLA:CPU's. XLA:CPU runs bf16 matmuls in f32 and keeps f32 copies of bf16
weights as temporaries, and handles fp8 cache pages through f16 copies; a GPU build needs neither,
so the temporaries here are an upper bound for the GPU's.

One module although it is a little over 450 lines: the accounting (weight classes, caches,
programs) and its report are one computation, read top to bottom.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import time
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax import params as params_lib
from dspark_jax import sharding as sharding_lib
from dspark_jax import steps
from dspark_jax.cache import KDAStates, PagedPool, TargetCaches
from dspark_jax.config import DraftConfig, KimiConfig, load_config
from dspark_jax.engine_config import EngineConfig
from dspark_jax.sampling import sample_tokens

GIB = 2**30
# XLA flags for compiling without running: LLVM's optimisations change code speed, not buffers
# (the buffer assignment and memory_analysis are identical), and cost most of the compile time.
PLAN_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
Progress = Callable[[str], None]


def configure_cpu_devices(num_devices: int) -> None:
    """Make JAX see `num_devices` fake CPU devices (and only CPU); call before JAX initialises."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f for f in PLAN_XLA_FLAGS if f not in flags])
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", num_devices)
    if jax.device_count() != num_devices:
        raise RuntimeError(f"JAX was initialised with {jax.device_count()} devices before the plan could "
                           f"ask for {num_devices}; run the plan in a fresh process")


# ---------------------------------------------------------------------------------------------
# configs


def resolve_config_path(name_or_path: str) -> Path:
    """A packaged config name (`kimi-k3`, `kimi-k3-dspark`), a config.json, or a model directory."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path
    packaged = resources.files("dspark_jax") / "configs" / f"{name_or_path}.json"
    if packaged.is_file():
        return Path(str(packaged))
    names = sorted(p.name[:-5] for p in (resources.files("dspark_jax") / "configs").iterdir()
                   if p.name.endswith(".json"))
    raise FileNotFoundError(f"--config {name_or_path!r}: not a config.json, a model directory or a packaged "
                            f"config ({', '.join(names)})")


def load_plan_configs(config: str, draft_config: str | None) -> tuple[KimiConfig, DraftConfig | None]:
    """The target config and the draft's (`draft_config` "auto": the packaged draft named
    `<config>-dspark` if there is one; "none" or None: no draft)."""
    cfg = load_config(resolve_config_path(config))
    if not isinstance(cfg, KimiConfig):
        raise ValueError(f"--config {config!r}: the plan covers kimi_linear-family targets, got {cfg.family!r}")
    if draft_config == "auto":
        packaged = resources.files("dspark_jax") / "configs" / f"{config}-dspark.json"
        draft_config = f"{config}-dspark" if packaged.is_file() else None
    if draft_config in (None, "", "none"):
        return cfg, None
    dcfg = load_config(resolve_config_path(draft_config))
    if not isinstance(dcfg, DraftConfig):
        raise ValueError(f"--draft_config {draft_config!r} is not a DSpark draft config")
    return cfg, dcfg


# ---------------------------------------------------------------------------------------------
# the report


@dataclasses.dataclass(frozen=True)
class ServingShape:
    num_devices: int
    engine: EngineConfig                  # T, cache dtype, page size, slots, max_model_len (required here)
    prefill_chunk: int = 4096             # tokens of one sequence per prefill program

    def __post_init__(self):
        if self.engine.max_model_len is None:
            raise ValueError("a serving plan needs EngineConfig.max_model_len")


@dataclasses.dataclass
class TensorGroup:
    """A class of weights (or one cache tensor) with its shardings and bytes."""
    name: str
    shape: str = ""                       # caches: the tensor's shape
    count: int = 0
    elements: int = 0
    total_bytes: int = 0
    device_bytes: int = 0                 # per device (shards split evenly: logical_to_spec)
    specs: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    dtypes: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, shape: Sequence[int], dtype, sharding: NamedSharding) -> None:
        itemsize = np.dtype(dtype).itemsize
        self.count += 1
        self.elements += math.prod(shape)
        self.total_bytes += math.prod(shape) * itemsize
        self.device_bytes += math.prod(sharding.shard_shape(tuple(shape))) * itemsize
        self.specs[_spec_str(sharding.spec, len(shape))] += 1
        self.dtypes[np.dtype(dtype).name] += 1


@dataclasses.dataclass
class ProgramReport:
    name: str
    description: str
    lower_s: float
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int

    def peak_bytes(self, persistent: int) -> int:
        """Weights and caches stay resident while any program runs, also those it does not take
        (jit drops unused arguments): the larger of them and the arguments, plus temporaries and
        the outputs that do not reuse donated inputs."""
        return max(self.argument_bytes, persistent) + self.temp_bytes + self.output_bytes - self.alias_bytes


@dataclasses.dataclass
class Plan:
    shape: ServingShape
    mesh_shape: dict[str, int]
    weights: list[TensorGroup]
    caches: list[TensorGroup]
    programs: list[ProgramReport]
    capacity_gib: float
    usable_fraction: float

    @property
    def weight_bytes(self) -> int:
        return sum(g.device_bytes for g in self.weights)

    @property
    def cache_bytes(self) -> int:
        return sum(g.device_bytes for g in self.caches)

    @property
    def persistent_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes

    @property
    def peak_bytes(self) -> int:
        return max([self.persistent_bytes] + [p.peak_bytes(self.persistent_bytes) for p in self.programs])

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_gib * GIB * self.usable_fraction


def _spec_str(spec: P, rank: int) -> str:
    parts = list(spec) + [None] * (rank - len(spec))
    return "(" + ", ".join("-" if p is None else (p if isinstance(p, str) else "+".join(p)) for p in parts) + ")"


def weight_class(path: str, cfg: KimiConfig) -> str:
    """The report row of a target weight (NNX path without the checkpoint prefix)."""
    parts = path.split(".")
    if path.startswith("model.embed_tokens."):
        return "embeddings"
    if path.startswith("lm_head."):
        return "lm_head"
    if len(parts) > 3 and parts[1] == "layers":
        layer, module = int(parts[2]), parts[3]
        if module == "self_attn":
            return "attention MLA" if cfg.is_mla(layer) else "attention KDA"
        if module == "mlp":
            return "dense MLP"
        if module == "block_sparse_moe":
            sub = parts[4]
            if sub == "gate":
                return "router"
            if sub == "experts":
                return "routed experts" + (" (MXFP4 packed)" if cfg.quantization == "mxfp4" else "")
            if sub == "shared_experts":
                return "shared experts"
            return "latent MoE proj + norm"
    return "norms + AttnRes"


_CLASS_ORDER = ("embeddings", "lm_head", "attention MLA", "attention KDA", "dense MLP", "router",
                "routed experts (MXFP4 packed)", "routed experts", "latent MoE proj + norm",
                "shared experts", "norms + AttnRes", "draft")


def weight_groups(target, draft, mesh: Mesh) -> list[TensorGroup]:
    groups: dict[str, TensorGroup] = {}

    def add(cls: str, p: nnx.Param) -> None:
        v = p.get_value()
        spec = sharding_lib.logical_to_spec(params_lib.logical_axes(p), v.shape, mesh)
        groups.setdefault(cls, TensorGroup(cls)).add(v.shape, v.dtype, NamedSharding(mesh, spec))

    for path, p in params_lib.flat_params(target).items():
        add(weight_class(path, target.cfg), p)
    if draft is not None:
        for p in params_lib.flat_params(draft).values():
            add("draft", p)
    return sorted(groups.values(), key=lambda g: _CLASS_ORDER.index(g.name))


# ---------------------------------------------------------------------------------------------
# abstract serving state


def cache_shardings(caches: TargetCaches, mesh: Mesh) -> TargetCaches:
    """The pool is replicated (every head reads the shared MLA latent rows, as with ATOM's TP);
    KDA SSM states are split by head like the KDA weights; conv windows (q|k|v concatenated, small)
    are replicated."""
    def named(x, axes):
        return NamedSharding(mesh, sharding_lib.logical_to_spec(axes, x.shape, mesh))

    pool = PagedPool(named(caches.pool.pages, (None, None, None, None)),
                     named(caches.pool.block_table, ("batch", None)))
    kda = None
    if caches.kda is not None:
        kda = KDAStates(named(caches.kda.conv, (None, "batch", None, None)),
                        named(caches.kda.ssm, (None, "batch", "heads", None, None)))
    return TargetCaches(pool, kda)


def _with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def cache_groups(caches: TargetCaches, shardings: TargetCaches) -> list[TensorGroup]:
    rows = [("KV pool (MLA + draft rows)", caches.pool.pages, shardings.pool.pages)]
    if caches.kda is not None:
        rows += [("KDA conv windows", caches.kda.conv, shardings.kda.conv),
                 ("KDA SSM states", caches.kda.ssm, shardings.kda.ssm)]
    out = []
    for name, x, s in rows:
        g = TensorGroup(name, shape=str(list(x.shape)))
        g.add(x.shape, x.dtype, s)
        out.append(g)
    return out


def prefill_chunk(engine, t_state, d_state, tokens_BC: jax.Array, start_B: jax.Array, n_valid_B: jax.Array,
                  slots_B: jax.Array, caches: TargetCaches, key: jax.Array):
    """Prefill one chunk of B sequences' prompts, at positions start..start+C-1 (the first
    `n_valid` tokens are real), into their cache slots of the full serving caches. Returns the
    token sampled after each chunk's last valid token (the first generated token once the chunk
    is the prompt's last) and the caches. Equal to `Engine.prefill_fn` over the whole prompt
    when the chunks are fed in order."""
    target, draft = engine.merge(t_state, d_state)
    c = tokens_BC.shape[1]
    positions = start_B[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
    valid = jnp.arange(c)[None] < n_valid_B[:, None]
    table = caches.pool.block_table
    kda = caches.kda
    view = TargetCaches(caches.pool._replace(block_table=table[slots_B]),
                              None if kda is None else KDAStates(kda.conv[:, slots_B], kda.ssm[:, slots_B]))
    out, view, _ = steps.target_forward(target, tokens_BC, positions, valid, view, engine.aux_ids,
                                        verify=False)
    pool = view.pool
    if draft is not None:
        pool = steps.draft_context(draft, out.aux_hidden, positions, valid, pool, target.attention_rows)
    if kda is not None:
        kda = KDAStates(kda.conv.at[:, slots_B].set(view.kda.conv), kda.ssm.at[:, slots_B].set(view.kda.ssm))
    last = jnp.take_along_axis(out.logits, (n_valid_B - 1)[:, None, None], axis=1)[:, 0]
    first = sample_tokens(last, engine.temperature, engine.top_p, key)
    return first, TargetCaches(pool._replace(block_table=table), kda)


def propose(engine, t_state, d_state, x0_B: jax.Array, lens_B: jax.Array, pool: PagedPool) -> steps.DraftProposal:
    """The draft's block pass from the shared pool (the propose half of `Engine.step_fn`)."""
    from dspark_jax.engine import embed_and_head

    target, draft = engine.merge(t_state, d_state)
    embed, head = embed_and_head(target)
    return steps.draft_block(draft, embed, head, x0_B, lens_B, pool, target.attention_rows, engine.t)


# ---------------------------------------------------------------------------------------------
# building the plan


def compile_program(name: str, description: str, lower: Callable[[], "jax.stages.Lowered"],
                    progress: Progress | None) -> tuple[ProgramReport, "jax.stages.Compiled"]:
    """Lower (`lower()`) and compile one program ahead of time, with progress lines; its report
    (times, XLA's per-device buffer assignment) and the compiled program. Shared with train.plan."""
    if progress:
        progress(f"{name}: lowering")
    t0 = time.perf_counter()
    lowered = lower()
    t1 = time.perf_counter()
    if progress:
        progress(f"{name}: lowered in {t1 - t0:.0f} s; compiling")
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    if progress:
        progress(f"{name}: compiled in {t2 - t1:.0f} s")
    report = ProgramReport(name, description, t1 - t0, t2 - t1, int(mem.argument_size_in_bytes),
                           int(mem.output_size_in_bytes), int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes))
    return report, compiled


def _compile(name: str, description: str, fn, args, progress: Progress | None, **jit_kw) -> ProgramReport:
    return compile_program(name, description, lambda: jax.jit(fn, **jit_kw).lower(*args), progress)[0]


def build_plan(cfg: KimiConfig, draft_cfg: DraftConfig | None, shape: ServingShape, *,
               capacity_gib: float = 288.0, usable_fraction: float = 0.93,
               programs: Sequence[str] = ("prefill", "step", "propose"),
               progress: Progress | None = None) -> Plan:
    """Build the models abstractly on a `tensor = num_devices` mesh (TP = EP = all devices, as
    ATOM serves K3), compile the serving programs and collect the report."""
    from dspark_jax.engine import Engine
    from dspark_jax.models.dspark import K3DSparkModel
    from dspark_jax.models.kimi import KimiLinearModel

    devices = jax.devices()
    if len(devices) < shape.num_devices:
        raise ValueError(f"the plan needs {shape.num_devices} devices, JAX has {len(devices)} "
                         "(configure_cpu_devices before JAX initialises)")
    mesh = sharding_lib.make_mesh(tensor=shape.num_devices, devices=devices[:shape.num_devices])
    t0 = time.perf_counter()
    target = params_lib.abstract(lambda: KimiLinearModel(cfg, rngs=nnx.Rngs(0)))
    draft = None
    if draft_cfg is not None:
        draft = params_lib.abstract(lambda: K3DSparkModel(draft_cfg, dtype=jnp.dtype(draft_cfg.dtype),
                                                          rngs=nnx.Rngs(0)))
    draft, config = shape.engine.for_pair(draft)
    t_spec = config.num_speculative_tokens
    engine = Engine(target, draft, config)
    if progress:
        progress(f"abstract models built in {time.perf_counter() - t0:.1f} s")

    t_state = _with_shardings(engine.t_state, sharding_lib.param_shardings(engine.t_state, mesh))
    d_state = None
    if draft is not None:
        d_state = _with_shardings(engine.d_state, sharding_lib.param_shardings(engine.d_state, mesh))
    b, max_len = config.max_num_seqs, config.max_model_len
    abstract_caches = jax.eval_shape(lambda: engine.new_caches(b, max_len))
    c_shard = cache_shardings(abstract_caches, mesh)
    caches = _with_shardings(abstract_caches, c_shard)

    rep = NamedSharding(mesh, P())
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=rep)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)
    reports = []
    with jax.set_mesh(mesh):
        if "prefill" in programs:
            c = min(shape.prefill_chunk, max_len)
            reports.append(_compile(
                "prefill", f"one {c}-token chunk of one sequence (target + draft context rows)",
                lambda ts, ds, tok, st, nv, sl, cc, k: prefill_chunk(engine, ts, ds, tok, st, nv, sl, cc, k),
                (t_state, d_state, i32(1, c), i32(1), i32(1), i32(1), caches, key), progress,
                donate_argnums=(6,), out_shardings=(rep, c_shard)))
        if "step" in programs:
            what = (f"decode step, {b} sequences: propose {t_spec} + verify {t_spec + 1} tokens"
                    if t_spec else f"decode step, {b} sequences (no draft)")
            reports.append(_compile(
                "step", what,
                lambda ts, ds, x0, lens, act, ml, cc, k: engine.step_fn(ts, ds, x0, None, lens, act, ml, cc, k,
                                                                           temperature=0.0, top_p=1.0),
                (t_state, d_state, i32(b), i32(b), jax.ShapeDtypeStruct((b,), jnp.bool_, sharding=rep), i32(),
                 caches, key), progress,
                donate_argnums=(6,), out_shardings=(rep, rep, c_shard)))
        if "propose" in programs and draft is not None:
            reports.append(_compile(
                "propose", f"draft block pass alone, {b} sequences x {t_spec} tokens",
                lambda ts, ds, x0, lens, pool: propose(engine, ts, ds, x0, lens, pool),
                (t_state, d_state, i32(b), i32(b), caches.pool), progress, donate_argnums=(4,)))
    return Plan(shape, dict(mesh.shape), weight_groups(target, draft, mesh),
                cache_groups(abstract_caches, c_shard), reports, capacity_gib, usable_fraction)


# ---------------------------------------------------------------------------------------------
# printing


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def format_plan(plan: Plan, title: str) -> list[str]:
    """The report; the last line is `per-device peak: X GiB of C GiB (f usable)`."""
    s, e = plan.shape, plan.shape.engine
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh_shape.items())
    lines = [f"{title}: {s.num_devices} devices, mesh {mesh}; max_model_len {e.max_model_len}, "
             f"max_num_seqs {e.max_num_seqs}, kv_cache_dtype {e.kv_cache_dtype}, block_size {e.page_size}, "
             f"prefill chunk {s.prefill_chunk} tokens, {e.num_speculative_tokens} speculative tokens",
             "",
             f"{'weights':<30} {'tensors':>7} {'GiB total':>10} {'GiB/device':>10}  dtype; sharding (tensors)"]

    def row(g: TensorGroup) -> str:
        dtypes = "/".join(sorted(g.dtypes))
        specs = ", ".join(f"{spec} x{n}" for spec, n in g.specs.most_common(3))
        if len(g.specs) > 3:
            specs += f", +{len(g.specs) - 3} more"
        if g.shape:     # a cache tensor: its shape instead of a count
            return (f"{g.name:<30} {_gib(g.total_bytes):>10} {_gib(g.device_bytes):>10}  {g.shape} {dtypes}; "
                    f"{specs.removesuffix(' x1')}")
        return f"{g.name:<30} {g.count:>7} {_gib(g.total_bytes):>10} {_gib(g.device_bytes):>10}  {dtypes}; {specs}"

    lines += [row(g) for g in plan.weights]
    lines.append(f"{'weights total':<30} {sum(g.count for g in plan.weights):>7} "
                 f"{_gib(sum(g.total_bytes for g in plan.weights)):>10} {_gib(plan.weight_bytes):>10}")
    lines += ["", f"{'caches':<30} {'GiB total':>10} {'GiB/device':>10}  shape dtype; sharding"]
    lines += [row(g) for g in plan.caches]
    lines.append(f"{'persistent (weights + caches)':<30} {'':>10} {_gib(plan.persistent_bytes):>10}")
    lines += ["", "programs (XLA:CPU AOT compile, per device; peak = max(arguments, persistent) + temporaries"
                  " + outputs not aliased to donated inputs):",
              f"{'program':<9} {'lower s':>8} {'compile s':>9} {'args GiB':>9} {'temps GiB':>9} "
              f"{'out-alias':>9} {'peak GiB':>9}  what"]
    for p in plan.programs:
        lines.append(f"{p.name:<9} {p.lower_s:>8.1f} {p.compile_s:>9.1f} {_gib(p.argument_bytes):>9} "
                     f"{_gib(p.temp_bytes):>9} {_gib(p.output_bytes - p.alias_bytes):>9} "
                     f"{_gib(p.peak_bytes(plan.persistent_bytes)):>9}  "
                     f"{p.description}")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines += ["", f"{verdict}: usable {plan.capacity_gib * plan.usable_fraction:.1f} GiB per device "
                  f"({plan.usable_fraction:g} of {plan.capacity_gib:g} GiB); temporaries are XLA:CPU's, an upper "
                  "bound for a GPU build (f32 copies of bf16 weights for CPU matmuls, f16 copies of fp8 pages)",
              f"per-device peak: {plan.peak_bytes / GIB:.1f} GiB of {plan.capacity_gib:g} GiB "
              f"({plan.usable_fraction:g} usable)"]
    return lines


def plan_title(cfg: KimiConfig, draft_cfg: DraftConfig | None, config_name: str) -> str:
    what = f"{config_name} ({cfg.num_hidden_layers} layers: {len(cfg.kda_layers)} KDA + {len(cfg.full_attn_layers)} MLA"
    what += f", {cfg.num_experts} experts{' MXFP4' if cfg.quantization == 'mxfp4' else ''})"
    if draft_cfg is not None:
        what += f" + DSpark draft ({draft_cfg.num_hidden_layers} layers)"
    return what

