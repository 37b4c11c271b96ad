"""Serving memory plan: does a target + DSpark draft fit a device mesh, with the server's own programs?

Everything is abstract: the models are built with `params.abstract` (ShapeDtypeStructs, no
weights), the caches with `jax.eval_shape`, and the programs are lowered and compiled ahead of
time for a mesh of fake CPU devices. The plan reports per weight class its sharding and
per-device bytes, the cache bytes, and per program XLA's own per-device buffer assignment
(`compiled.memory_analysis()`): arguments, outputs not aliased to donated inputs, temporaries.

The programs are the server's (`dspark_jax.plan.server_programs`): an `Engine` over the abstract weights
(placed as `sharding.param_shardings` places them) and the engine's own cache shardings drives a
`Scheduler` with the serving flags (slots, `max_model_len`, `max_num_batched_tokens`, speculation
length). `warmup.program_shapes` lists what that scheduler can call (greedy and sampling programs,
as `serve.server` warms up); the plan makes the scheduler's own call for the largest shape
of each kind (`warmup.call_program`), and the engine, instead of running it, hands back the jitted
program (`Engine.prefill_jit` / `step_jit`) with exactly those arguments, which is then lowered
and compiled:
- `prefill`: one prompt chunk at the chunk width (`max_num_batched_tokens`);
- `step`: a one-token step (width 0) of the largest batch bucket;
- `verify`: a step verifying T drafts (the longest speculation) at that batch.
Attention reads the pool in key chunks inside a loop as far as the longest row reaches
(`kernels.paged_attention`), so one program serves every length and its buffers do not grow with
the context.
The rest of the list is counted, with an estimate of its compile time from the compile times
measured here. The report's peak is the largest of `max(arguments, weights + caches) +
temporaries + outputs not aliased to donated inputs` over the programs.

The numbers are XLA:CPU's. XLA:CPU runs bf16 matmuls in f32 and keeps f32 copies of bf16
weights as temporaries, and handles fp8 cache pages through f16 copies; a GPU build needs neither,
so the temporaries here are an upper bound for the GPU's.

The plan also counts one MoE layer's FLOPs per device over the prefill chunk against the routed
minimum (`plan_programs.moe_flops`: from shapes and shards, as XLA's cost analysis cannot see
into the routed expert loop).
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
from dspark_jax.cache import TargetCaches
from dspark_jax.config import load_config
from dspark_jax.config.draft import DraftConfig
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.decode import warmup
from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.models.dspark import K3DSparkModel
from dspark_jax.models.kimi import KimiLinearModel
from dspark_jax.plan.server_programs import (
    PROGRAMS,
    MoEFlops,
    describe,
    largest_programs,
    moe_flops,
    program_call,
    serving_scheduler,
)

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
    engine: EngineConfig              # T, cache dtype, page size
    # slots, max_model_len (required here), speculation length and the prefill chunk
    # (max_num_batched_tokens), as the server takes them
    scheduler: SchedulerConfig

    def __post_init__(self):
        if self.scheduler.max_model_len is None:
            raise ValueError("a serving plan needs SchedulerConfig.max_model_len")


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
    # the server's warm-up list (`warmup.program_shapes`) for these flags, by kind
    warmup_programs: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    moe: MoEFlops | None = None

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


def build_plan(cfg: KimiConfig, draft_cfg: DraftConfig | None, shape: ServingShape, *,
               capacity_gib: float = 288.0, usable_fraction: float = 0.93,
               programs: Sequence[str] = PROGRAMS, progress: Progress | None = None) -> Plan:
    """Build the models abstractly on a `tensor = num_devices` mesh (TP = EP = all devices, as
    ATOM serves K3), compile the largest of the server's programs of each kind in `programs`, count
    its warm-up list, and collect the report."""

    unknown = set(programs) - set(PROGRAMS)
    if unknown:
        raise ValueError(f"programs {sorted(unknown)}: the plan compiles {', '.join(PROGRAMS)}")
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
    scheduler = serving_scheduler(target, draft, config, shape.scheduler, mesh)
    t = scheduler.engine.t
    if progress:
        progress(f"abstract models built in {time.perf_counter() - t0:.1f} s")
    shapes = warmup.program_shapes(scheduler, sampled=True)
    largest = largest_programs(shapes, t)
    # no context mesh, as in serve.server: the programs find the mesh on their arguments' shardings
    reports = [compile_program(kind, describe(kind, s, scheduler), program_call(scheduler, s).lower, progress)[0]
               for kind, s in largest.items() if kind in programs]
    caches = scheduler.engine.abstract_caches
    shardings = jax.tree.map(lambda x: x.sharding, caches)
    prefill = largest.get("prefill")
    return Plan(shape, dict(mesh.shape), weight_groups(target, draft, mesh), cache_groups(caches, shardings),
                reports, capacity_gib, usable_fraction, collections.Counter(s.kind for s in shapes),
                None if prefill is None else moe_flops(target, mesh, prefill.rows * prefill.length))


# ---------------------------------------------------------------------------------------------
# printing


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def format_plan(plan: Plan, title: str) -> list[str]:
    """The report; the last line is `per-device peak: X GiB of C GiB (f usable)`."""
    s, e, c = plan.shape, plan.shape.engine, plan.shape.scheduler
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh_shape.items())
    lines = [f"{title}: {s.num_devices} devices, mesh {mesh}; max_model_len {c.max_model_len}, "
             f"max_num_seqs {c.max_num_seqs}, kv_cache_dtype {e.kv_cache_dtype}, block_size {e.page_size}, "
             f"max_num_batched_tokens {c.max_num_batched_tokens}, {e.num_speculative_tokens} speculative tokens "
             f"({c.speculative_length})",
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
    if plan.programs:
        lines += ["", "programs (XLA:CPU AOT compile, per device; peak = max(arguments, persistent) + temporaries"
                      " + outputs not aliased to donated inputs):",
                  f"{'program':<9} {'lower s':>8} {'compile s':>9} {'args GiB':>9} {'temps GiB':>9} "
                  f"{'out-alias':>9} {'peak GiB':>9}  what"]
    for p in plan.programs:
        lines.append(f"{p.name:<9} {p.lower_s:>8.1f} {p.compile_s:>9.1f} {_gib(p.argument_bytes):>9} "
                     f"{_gib(p.temp_bytes):>9} {_gib(p.output_bytes - p.alias_bytes):>9} "
                     f"{_gib(p.peak_bytes(plan.persistent_bytes)):>9}  "
                     f"{p.description}")
    lines += _warmup_lines(plan) + _moe_lines(plan.moe)
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines += ["", f"{verdict}: usable {plan.capacity_gib * plan.usable_fraction:.1f} GiB per device "
                  f"({plan.usable_fraction:g} of {plan.capacity_gib:g} GiB); temporaries are XLA:CPU's, an upper "
                  "bound for a GPU build (f32 copies of bf16 weights for CPU matmuls, f16 copies of fp8 pages)",
              f"per-device peak: {plan.peak_bytes / GIB:.1f} GiB of {plan.capacity_gib:g} GiB "
              f"({plan.usable_fraction:g} usable)"]
    return lines


def _warmup_lines(plan: Plan) -> list[str]:
    total = sum(plan.warmup_programs.values())
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(plan.warmup_programs.items()))
    lines = ["", f"server warm-up list (dspark_jax.decode.warmup.program_shapes, greedy and sampling): "
                 f"{total} programs ({kinds})" + ("; the largest of each kind compiled above" if plan.programs else "")]
    if plan.programs and total:
        mean = sum(p.lower_s + p.compile_s for p in plan.programs) / len(plan.programs)
        lines.append(f"estimated compile time of the whole list: {mean:.0f} s per program (the mean lower + compile "
                     f"time above) x {total} programs = {mean * total / 60:.0f} min (an estimate: XLA:CPU with "
                     "LLVM optimisation off; smaller shapes compile faster). serve.server compiles the cheapest "
                     "--warmup_max_programs of them at start, the rest on first use")
    return lines


def _moe_lines(m: MoEFlops | None) -> list[str]:
    if m is None:
        return []
    tf = lambda x: f"{x / 1e9:.4g}"
    latent = "" if not m.latent else (f", latent projections {tf(m.latent)}"
                                      + (" (replicated: every device projects every token)" if m.latent_replicated
                                         else ""))
    return ["", f"MoE GFLOP per device, one MoE layer over the prefill's {m.tokens} tokens, counted from shapes and "
                "shards (XLA's cost analysis counts a loop's body once, and the routed expert loop's trip count is "
                "data-dependent: it cannot count the routed experts):",
            f"  routed minimum: {m.tokens} tokens x top-{m.top_k} x 3 GEMMs of {m.expert_in} x {m.expert_width} / "
            f"{m.ep} devices + shared experts' share = {tf(m.minimum)}",
            f"  the program: routed experts {tf(m.routed)} (one row per routed pair, pairs spread evenly), shared "
            f"experts {tf(m.shared)}, router {tf(m.router)}{latent} = {tf(m.total)}, "
            f"{m.total / m.minimum:.2f}x the routed minimum"]


def plan_title(cfg: KimiConfig, draft_cfg: DraftConfig | None, config_name: str) -> str:
    what = f"{config_name} ({cfg.num_hidden_layers} layers: {len(cfg.kda_layers)} KDA + {len(cfg.full_attn_layers)} MLA"
    what += f", {cfg.num_experts} experts{' MXFP4' if cfg.quantization == 'mxfp4' else ''})"
    if draft_cfg is not None:
        what += f" + DSpark draft ({draft_cfg.num_hidden_layers} layers)"
    return what

