"""The server's own programs for a deployment plan (`dspark_jax.plan.serving`), without weights.

`serving_scheduler` builds the `Scheduler` that `serve.server` builds for the same flags, over a
`PlanEngine`: the `Engine` over abstract weights (ShapeDtypeStructs placed as the loaders place
them) and abstract caches carrying the engine's own cache shardings. `warmup.program_shapes` of
that scheduler is the server's warm-up list; `program_call` makes the scheduler's own call for one of
its shapes, and the engine, instead of running the program, hands back the jitted program
(`Engine.prefill_jit` / `step_jit`) with exactly the arguments the call passed, to be lowered and
compiled ahead of time. `moe_flops` counts one MoE layer's FLOPs per device from the layer's
shapes and its weights' shards.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from dspark_jax import params as params_lib
from dspark_jax import sharding as sharding_lib
from dspark_jax.cache import TargetCaches
from dspark_jax.decode import warmup
from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.decode.engine import Engine
from dspark_jax.decode.scheduler import Scheduler
from dspark_jax.decode.spec_length import StepCosts

# the programs a plan compiles, the largest of each kind in the server's warm-up list
PROGRAMS = ("prefill", "step", "verify")


class ProgramCall(Exception):
    """A program call `PlanEngine` made instead of running it: the jitted program (a jax.jit-wrapped
    Engine function) and its arguments."""

    def __init__(self, program, args: tuple, kw: dict):
        super().__init__("a plan lowers the engine's programs, it does not run them")
        self.program, self.call_args, self.kw = program, args, kw

    def lower(self) -> "jax.stages.Lowered":
        return self.program.lower(*self.call_args, **self.kw)


class PlanEngine(Engine):
    """The server's `Engine` over abstract weights and caches: `new_caches` gives the abstract,
    sharded caches, and a program call (`prefill`, `step`, ...) raises `ProgramCall` with the
    jitted program and exactly the arguments the caller passed, instead of running it."""

    abstract_caches: TargetCaches | None = None

    def new_caches(self, batch: int, max_len: int) -> TargetCaches:
        return self.abstract_caches

    def _call(self, name, *args, tag=None, **kw):
        raise ProgramCall(getattr(self, f"{name}_jit"), args, kw)


def with_shardings(tree, shardings):
    """ShapeDtypeStructs of `tree`'s leaves carrying `shardings`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def serving_scheduler(target, draft, config: EngineConfig, scheduling: SchedulerConfig, mesh: Mesh) -> Scheduler:
    """A `Scheduler` as `serve.server` builds it for these flags, over a `PlanEngine` of these
    (abstract) models. Step costs: none measured (every speculation length is reachable) unless
    the config gives a cost model."""
    engine = PlanEngine(target, draft, config)
    engine.t_state = with_shardings(engine.t_state, sharding_lib.param_shardings(engine.t_state, mesh))
    if engine.d_state is not None:
        engine.d_state = with_shardings(engine.d_state, sharding_lib.param_shardings(engine.d_state, mesh))
    b, max_len = scheduling.max_num_seqs, scheduling.max_model_len
    caches = jax.eval_shape(lambda: Engine.new_caches(engine, b, max_len))     # no mesh yet: no placement
    engine.mesh = mesh        # as an engine over placed weights finds it (its outputs are pinned to it)
    engine.abstract_caches = with_shardings(caches, engine._cache_shardings(caches))
    return Scheduler(engine, scheduling.replace(step_costs=scheduling.step_costs or StepCosts()))


def largest_programs(shapes: Sequence[warmup.ProgramShape], t: int) -> dict[str, warmup.ProgramShape]:
    """The largest shape of each kind in a warm-up list (cheapest first, so the last of each):
    `prefill`; `step`, the one-token step (width 0, or any step of an engine without drafts); `verify`, T
    drafts (width None)."""
    out = {}
    for s in shapes:
        if s.kind == "prefill":
            out["prefill"] = s
        elif s.width == 0 or not t:
            out["step"] = s
        elif s.width is None:
            out["verify"] = s
    return {k: out[k] for k in PROGRAMS if k in out}


def program_call(scheduler: Scheduler, shape: warmup.ProgramShape) -> ProgramCall:
    """The program and arguments `scheduler` (over a `PlanEngine`) calls for `shape`."""
    try:
        warmup.call_program(scheduler, shape)
    except ProgramCall as call:
        return call
    raise RuntimeError(f"{shape}: the scheduler's call reached no engine program")


def describe(kind: str, s: warmup.ProgramShape, scheduler: Scheduler) -> str:
    t, max_len = scheduler.engine.t, scheduler.max_len
    sampling = "sampling" if s.sampled else "greedy"
    if kind == "prefill":
        what = f"{s.rows} x {s.length}-token prompt chunk (target + draft context rows)"
    else:
        what = f"one-token step, {s.rows} sequences" if kind == "step" else (
            f"propose {t} + verify {t + 1} tokens, {s.rows} sequences")
    return f"{what}; up to {max_len} positions; {sampling}"


@dataclasses.dataclass(frozen=True)
class MoEFlops:
    """FLOPs per device of one MoE layer over `tokens` tokens (a multiply-add is 2)."""
    tokens: int
    top_k: int
    expert_in: int                # the experts' input width (the latent width of a latent MoE)
    expert_width: int             # moe_intermediate_size
    ep: int                       # devices the experts are split over
    routed: float                 # one row per routed pair, the pairs spread evenly over the EP devices
    shared: float                 # shared experts, by their shards
    router: float
    latent: float                 # latent down/up projections, by their shards
    latent_replicated: bool

    @property
    def minimum(self) -> float:
        """The routed minimum: routed pairs x 3 GEMMs / EP devices, plus the shared experts' share."""
        return self.tokens * self.top_k * 6 * self.expert_in * self.expert_width / self.ep + self.shared

    @property
    def total(self) -> float:
        return self.routed + self.shared + self.router + self.latent


def moe_flops(target, mesh: Mesh, tokens: int) -> MoEFlops | None:
    """Per-device FLOPs of the target's first MoE layer over `tokens` tokens (None: no MoE layer),
    counted from its shapes and each weight's shard. XLA's cost analysis cannot give them: it
    counts a loop's body once, and the routed expert loop's trip count is data-dependent. The
    routed experts multiply one row per routed pair (layers/moe.py, no padding); their count
    assumes the pairs spread evenly over the EP devices (a skewed router moves pairs between
    devices, not the per-pair cost)."""
    cfg = target.cfg
    flat = params_lib.flat_params(target)
    layers = [p.split(".")[2] for p in flat if ".block_sparse_moe." in p]
    if not layers:
        return None
    prefix = f"model.layers.{layers[0]}.block_sparse_moe."
    parts: collections.Counter = collections.Counter()
    latent_replicated = False
    for path, p in flat.items():
        sub = path[len(prefix):].split(".")[0] if path.startswith(prefix) else None
        if sub in (None, "experts", "routed_expert_norm") or not path.endswith(".weight"):
            continue                  # experts: counted by pairs; norms and biases: no products
        v = p.get_value()
        spec = sharding_lib.logical_to_spec(params_lib.logical_axes(p), v.shape, mesh)
        parts[sub] += 2 * tokens * math.prod(NamedSharding(mesh, spec).shard_shape(v.shape))
        if sub.startswith("routed_expert_") and all(a is None for a in spec):
            latent_replicated = True
    n = mesh.shape.get("tensor", 1)
    ep = n if n > 1 and cfg.num_experts % n == 0 else 1          # as layers/moe.py's _ep_mesh
    d_in, width, k = cfg.moe_expert_in, cfg.moe_intermediate_size, cfg.num_experts_per_token
    latent = parts["routed_expert_down_proj"] + parts["routed_expert_up_proj"]
    return MoEFlops(tokens, k, d_in, width, ep, tokens * k * 6 * d_in * width / ep, float(parts["shared_experts"]),
                    float(parts["gate"]), float(latent), latent_replicated)
