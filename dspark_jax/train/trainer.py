"""The distillation trainer (docs/architecture.md §4): AdamW + warmup/cosine, accumulation, FSDP, Orbax.

- Optimizer: clip_by_global_norm(clip) then AdamW on a warmup + cosine schedule (defaults: peak lr
  5e-5, 4 % linear warmup, cosine to `min_lr_frac * lr`, clip 1.0, TorchSpec's AdamW moments
  b1=0.9, b2=0.999, eps=1e-8, no weight decay); `lr_schedule="constant"`: the same linear warmup,
  then the peak lr to the end (min_lr_frac unused).
- Precision: fp32 master weights and optimizer state; the forward/backward runs on a copy cast to
  `compute_dtype` (bf16 by default); softmaxes and loss sums in fp32. `compute_dtype="float64"`
  (with JAX x64, for parity tests) keeps the masters in float64 too.
- Global batch = `global_batch` sequences per optimizer step, as `global_batch / micro_batch`
  micro-batches accumulated in one jitted `lax.scan`; gradients of the loss NUMERATORS are summed
  and divided once by the pooled weight of the whole global batch (docs/architecture.md §4.9).
- Frozen: the target's embedding table and lm_head are inputs, not draft parameters.
- Sharding: every draft parameter and its AdamW moments are placed by `sharding.LOGICAL_RULES` on
  a (data, fsdp, tensor) mesh (`train_mesh.training_mesh`; default: one device); batches split
  over data x fsdp when the micro-batch divides. The online teacher runs where the target was
  placed (with a tensor axis: split as in serving, `train_mesh.TEACHER_RULES`).
- Teacher: online (target prefill inside the same jitted step) or offline (`teacher_shards.ShardStream`).
- Checkpoints: an Orbax `CheckpointManager` under `<run_dir>/checkpoints` holding
  {params, opt_state, step} and a JSON item with the data position; a restart restores the latest
  one and continues exactly (anchor RNG = fold_in(seed, step, micro), data order from the saved
  position), truncating `metrics.jsonl` to the restored step.
- Metrics: one stdout line per `log_every` steps (progress, s/step, ETA), `<run_dir>/metrics.jsonl`
  and TensorBoard event files under `<run_dir>/tb` (tensorboardX; `train/*` per step, incl.
  `train/sequences_seen`).
- Held-out eval (`eval_every` > 0 and an evaluator, `monitor.HeldOutEval`): served tok/fwd of the
  current weights at step 0 (or the restored step) and every `eval_every` steps, appended to
  `<run_dir>/eval.jsonl` (truncated to the restored step on resume), TensorBoard `eval/*`, and
  `<run_dir>/learning_curve.png` (tok/fwd vs sequences seen) redrawn after each eval.
- Export: the draft in the torch layout (bf16, TorchSpec metadata) to `<run_dir>/export/step_N`
  at every checkpoint and at the end; the newest `keep_exports` are kept (for `train.average`).

The batches it steps on are built by `train.batches`; the loop around it (logging, checkpoints,
evaluation, export) is `train.loop.run`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax import sharding as sharding_lib
from dspark_jax.checkpoint.draft_io import save_torch_draft
from dspark_jax.config.draft import DraftConfig
from dspark_jax.models.dspark import K3DSparkModel
from dspark_jax.train import loss as loss_lib
from dspark_jax.train.teacher import TeacherOutputs, frozen_tables, teacher_outputs


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    run_dir: str
    total_steps: int
    global_batch: int = 8
    micro_batch: int = 1
    max_len: int = 1024
    lr: float = 5e-5
    warmup_frac: float = 0.04
    min_lr_frac: float = 0.0
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    compute_dtype: str = "bfloat16"
    seed: int = 0
    log_every: int = 1
    save_every: int = 100
    lr_schedule: str = "cosine"            # "cosine" | "constant" (both after the linear warmup)
    eval_every: int = 0                    # held-out served tok/fwd every N steps (0: off)
    keep_checkpoints: int = 2
    export: bool = True
    keep_exports: int = 1                  # exports kept (the newest), e.g. to average the last few
    loss: loss_lib.LossConfig = loss_lib.LossConfig()

    @property
    def accum_steps(self) -> int:
        if self.global_batch % self.micro_batch:
            raise ValueError(f"global_batch {self.global_batch} is not a multiple of micro_batch {self.micro_batch}")
        return self.global_batch // self.micro_batch


LR_SCHEDULES = ("cosine", "constant")


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    warmup = max(1, math.ceil(cfg.warmup_frac * cfg.total_steps)) if cfg.warmup_frac > 0 else 0
    if cfg.lr_schedule == "cosine":
        base = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
            decay_steps=max(cfg.total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_frac)
    elif cfg.lr_schedule == "constant":
        base = optax.warmup_constant_schedule(init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup)
    else:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {cfg.lr_schedule!r}")
    # optimizer step n (0-based) uses the value at n + 1: the first update is not a zero-lr step
    schedule = lambda count: base(count + 1)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    return tx, schedule


# ---------------------------------------------------------------------------------------------
# parameters as pure dicts (what Orbax and optax see)


def _stringify(tree):
    if isinstance(tree, Mapping):
        return {str(k): _stringify(v) for k, v in tree.items()}
    return tree


def flat_names(tree: Mapping, prefix: str = "") -> list[str]:
    """Dotted names (= torch tensor names) of the leaves of a pure params dict."""
    out = []
    for k, v in tree.items():
        out += flat_names(v, f"{prefix}{k}.") if isinstance(v, Mapping) else [f"{prefix}{k}"]
    return out


def draft_split(draft: K3DSparkModel):
    """(graphdef, template Param state, other state, pure params dict with string keys)."""
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
    return graphdef, params, rest, _stringify(nnx.to_pure_dict(params))


def merge_draft(graphdef, template, rest, pure: Mapping) -> K3DSparkModel:
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state, rest)


def _batch_sharding(mesh: Mesh, micro: int, ndim: int) -> NamedSharding:
    names = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
    size = math.prod(mesh.shape[a] for a in names) if names else 1
    axis = (names if len(names) > 1 else names[0]) if names and micro % size == 0 else None
    return NamedSharding(mesh, P(None, axis, *([None] * (ndim - 2))))


# ---------------------------------------------------------------------------------------------
# the trainer


class TrainState(NamedTuple):
    params: dict
    opt_state: Any
    step: jax.Array


class Trainer:
    """Holds the draft structure, the optimizer, the jitted step and the checkpoint manager.

    `target`: the target model; with `online=True` it is the teacher run inside the step,
    otherwise only its frozen embedding table and lm_head are used (teacher outputs then come
    with the batch)."""

    def __init__(self, cfg: TrainConfig, draft_cfg: DraftConfig, target, *, online: bool,
                 mesh: Mesh | None = None, init_draft: K3DSparkModel | None = None,
                 log: Callable[[str], None] = print):
        self.cfg, self.draft_cfg, self.online, self.log = cfg, draft_cfg, online, log
        self.mesh = mesh or sharding_lib.make_mesh(tensor=1, data=1, devices=jax.local_devices()[:1])
        self.tx, self.schedule = make_optimizer(cfg)
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)
        seed = cfg.seed
        if init_draft is None:
            init_draft = sharding_lib.create_sharded(
                lambda: K3DSparkModel(draft_cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed)), self.mesh)
        self.graphdef, self.template, self.rest, params = draft_split(init_draft)
        master = jnp.float64 if self.compute_dtype == jnp.float64 else jnp.float32
        self._sums_dtype = master          # the loss terms' dtype (float32 for a bf16 draft too)
        shardings = sharding_lib.param_shardings(self.template, self.mesh)
        self.param_shardings = _stringify(nnx.to_pure_dict(shardings))
        replicated = NamedSharding(self.mesh, P())
        # an abstract draft (ShapeDtypeStructs): a plan's trainer, whose step is only compiled
        self.abstract = all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
        if self.abstract:
            params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, master, sharding=s), params,
                                  self.param_shardings)
        else:
            # a copy: the step donates its state, the caller's draft must stay valid. Copied where it
            # lies first: device_put onto a mesh of several devices can alias a replicated leaf's
            # buffer on the source device even with may_alias=False, and the first step then
            # deletes the caller's array
            params = jax.device_put(jax.tree.map(lambda x: jnp.array(x, dtype=master, copy=True), params),
                                    self.param_shardings)
        opt_abstract = jax.eval_shape(self.tx.init, params)
        self.opt_shardings = optax.tree_map_params(self.tx, lambda _, s: s, opt_abstract, self.param_shardings,
                                                   transform_non_params=lambda _: replicated)
        if self.abstract:
            opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), opt_abstract,
                                     self.opt_shardings)
            self.state = TrainState(params, opt_state, jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))
        else:
            opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
            self.state = TrainState(params, opt_state, jax.device_put(jnp.zeros((), jnp.int32), replicated))
        self.state_shardings = TrainState(self.param_shardings, self.opt_shardings, replicated)

        self.aux_ids = tuple(draft_cfg.target_layer_ids)
        t_graph, t_state = nnx.split(target)
        self._t_graph = t_graph
        if online:
            self.frozen = t_state
        else:
            embed, head = frozen_tables(target)
            self.frozen = (embed, head)
        self._step_fn = jax.jit(self._train_step, donate_argnums=(0,),
                                out_shardings=(self.state_shardings, None))
        self._manager = None

    # -- the jitted step ------------------------------------------------------------------------

    def batch_sums(self, params: Mapping, mb: Mapping[str, jax.Array], frozen, key: jax.Array) -> loss_lib.LossSums:
        """Loss sums of one micro-batch (differentiable in `params`)."""
        cd = self.compute_dtype
        draft = merge_draft(self.graphdef, self.template, self.rest, jax.tree.map(lambda x: x.astype(cd), params))
        if self.online:
            target = nnx.merge(self._t_graph, frozen)
            teacher = teacher_outputs(target, mb["input_ids"], mb["valid"], self.aux_ids)
            embed, head = frozen_tables(target)
        else:
            teacher = TeacherOutputs(mb["aux"], mb["final"])
            embed, head = frozen
        return loss_lib.distill_outputs(draft, embed.astype(cd), head.astype(cd), mb["input_ids"], mb["loss_mask"],
                                        teacher.aux_BSA, teacher.final_hidden_BSH, key, self.cfg.loss).sums

    def _gradients(self, params: Mapping, batch: Mapping[str, jax.Array], frozen, step: jax.Array):
        """(gradient of the global batch's mean loss, its loss sums): the micro-batches' numerator
        gradients accumulated in a scan, divided once by the pooled weight."""
        key = jax.random.fold_in(jax.random.PRNGKey(self.cfg.seed), step)
        m = batch["input_ids"].shape[0]

        def micro(carry, xs):
            g_acc, s_acc = carry
            mb, i = xs

            def numerator(params):
                sums = self.batch_sums(params, mb, frozen, jax.random.fold_in(key, i))
                return sums.numerator, sums

            g, sums = jax.grad(numerator, has_aux=True)(params)
            return (jax.tree.map(jnp.add, g_acc, g), loss_lib.add_sums(s_acc, sums)), None

        zero_g = jax.tree.map(jnp.zeros_like, params)
        (g, sums), _ = jax.lax.scan(micro, (zero_g, loss_lib.zero_sums(self.cfg.loss, self._sums_dtype)),
                                    (batch, jnp.arange(m)))
        return jax.tree.map(lambda x: x / jnp.maximum(sums.weight, 1e-6), g), sums

    def _train_step(self, state: TrainState, batch: Mapping[str, jax.Array], frozen):
        g, sums = self._gradients(state.params, batch, frozen, state.step)
        updates, opt_state = self.tx.update(g, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = loss_lib.metrics_from_sums(sums, self.cfg.loss)
        metrics["grad_norm"] = optax.global_norm(g)
        metrics["lr"] = self.schedule(state.step)
        return TrainState(params, opt_state, state.step + 1), metrics

    def lower_step(self, batch: Mapping[str, jax.ShapeDtypeStruct]):
        """The training step lowered for abstract state and batch (`jax.stages.Lowered`): a plan
        compiles it for its memory and cost analyses."""
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=_batch_sharding(self.mesh, self.cfg.micro_batch,
                                                                                    len(v.shape)))
                 for k, v in batch.items()}
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.state,
                             self.state_shardings)
        return self._step_fn.lower(state, batch, self.frozen)

    def device_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.device_put(v, _batch_sharding(self.mesh, self.cfg.micro_batch, v.ndim))
                for k, v in batch.items()}

    def step(self, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        self.state, metrics = self._step_fn(self.state, self.device_batch(batch), self.frozen)
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def gradients(self, batch: Mapping[str, np.ndarray]) -> tuple[dict, loss_lib.LossSums]:
        """The next step's gradient (host arrays, the params' tree) and loss sums, without updating
        (what a sharded run must agree on with one device: tests)."""
        fn = jax.jit(self._gradients, out_shardings=(self.param_shardings, None))
        return jax.device_get(fn(self.state.params, self.device_batch(batch), self.frozen, self.state.step))

    def eval_sums(self, batch: Mapping[str, np.ndarray], step: int) -> loss_lib.LossSums:
        """Sums of a global batch at the current parameters, without updating (tests, eval)."""
        key = jax.random.fold_in(jax.random.PRNGKey(self.cfg.seed), step)
        dev = self.device_batch(batch)

        @jax.jit
        def run(params, batch, frozen):
            total = loss_lib.zero_sums(self.cfg.loss, self._sums_dtype)
            for i in range(batch["input_ids"].shape[0]):
                mb = {k: v[i] for k, v in batch.items()}
                total = loss_lib.add_sums(total, self.batch_sums(params, mb, frozen, jax.random.fold_in(key, i)))
            return total

        return jax.device_get(run(self.state.params, dev, self.frozen))

    # -- model access -----------------------------------------------------------------------------

    def draft(self) -> K3DSparkModel:
        """The draft with the current fp32 master weights."""
        return merge_draft(self.graphdef, self.template, self.rest, self.state.params)

    # -- checkpoints ------------------------------------------------------------------------------

    @property
    def manager(self):
        if self._manager is None:
            opts = ocp.CheckpointManagerOptions(max_to_keep=self.cfg.keep_checkpoints, create=True)
            self._manager = ocp.CheckpointManager(Path(self.cfg.run_dir).absolute() / "checkpoints",
                                                  options=opts, item_names=("state", "meta"))
        return self._manager

    def save(self, meta: Mapping) -> None:
        step = int(self.state.step)
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(self.state._asdict()),
                                                        meta=ocp.args.JsonSave(dict(meta))))
        self.manager.wait_until_finished()

    def restore_latest(self) -> dict | None:
        """Restore the newest checkpoint (params, optimizer, step); returns its JSON meta."""
        step = self.manager.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                self.state._asdict(), self.state_shardings._asdict())
        got = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        self.state = TrainState(**got["state"])
        return dict(got["meta"])

    def set_state(self, params: Mapping, opt_state, step: int) -> None:
        """Replace the training state (e.g. converted from a TorchSpec checkpoint)."""
        params = jax.device_put(params, self.param_shardings, may_alias=False)
        opt_state = jax.device_put(opt_state, self.opt_shardings, may_alias=False)
        self.state = TrainState(params, opt_state, jax.device_put(jnp.asarray(step, jnp.int32),
                                                                  self.state_shardings.step))

    def export(self, dst: Path) -> None:
        cfg = dict(self.draft_cfg.raw)
        cfg["torch_dtype"] = "bfloat16"
        save_torch_draft(self.draft(), cfg, dst)
