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
- Teacher: online (target prefill inside the same jitted step) or offline (`teacher.ShardStream`).
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

One module although it is over 450 lines: the step, its gradient accumulation, checkpointing,
export and the held-out evaluation hooks share the trainer's state and run as one loop.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax import sharding as sharding_lib
from dspark_jax.config import DraftConfig
from dspark_jax.models.dspark import K3DSparkModel
from dspark_jax.train import loss as loss_lib
from dspark_jax.train.regen import Sample
from dspark_jax.train.teacher import (ShardStream, StreamPosition, TeacherOutputs, frozen_tables, pad_batch,
                                      teacher_outputs)


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
# data


class Example(NamedTuple):
    sample: Sample
    aux_SA: np.ndarray | None = None       # offline teacher outputs
    final_SH: np.ndarray | None = None


class SampleSource:
    """Regenerated samples for the online teacher: a seeded permutation per epoch; the position
    (epoch, index) is all a resume needs. With `group` (the global batch), each window of 16
    batches is sorted by length before it is cut into batches, and the batches are shuffled:
    a batch then holds similar lengths, so padding to its longest sample wastes little."""

    WINDOW = 16

    def __init__(self, samples: Sequence[Sample], seed: int, group: int | None = None):
        if not samples:
            raise ValueError("no training samples")
        self.samples, self.seed, self.group = list(samples), seed, group
        self.lengths = np.array([len(s.input_ids) for s in self.samples])
        self.epoch, self.index = 0, 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.samples))
        if not self.group:
            return order
        out = []
        for start in range(0, len(order), self.group * self.WINDOW):
            win = order[start:start + self.group * self.WINDOW]
            win = win[np.argsort(self.lengths[win], kind="stable")]
            batches = [win[i:i + self.group] for i in range(0, len(win), self.group)]
            out.extend(batches[j] for j in rng.permutation(len(batches)))
        return np.concatenate(out)

    @property
    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, position: Mapping) -> None:
        self.epoch, self.index = int(position["epoch"]), int(position["index"])
        self._order = self._perm(self.epoch)

    def take(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            if self.index == len(self.samples):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._perm(self.epoch)
            out.append(Example(self.samples[self._order[self.index]]))
            self.index += 1
        return out


class ShardSource:
    """Offline teacher data from a shard directory (live or complete)."""

    def __init__(self, stream: ShardStream):
        self.stream = stream

    @property
    def position(self) -> dict:
        return self.stream.position.to_json()

    def restore(self, position: Mapping) -> None:
        self.stream.position = StreamPosition.from_json(dict(position))

    def take(self, n: int) -> list[Example]:
        return [Example(ex.sample, ex.aux_SA, ex.final_SH) for ex in (next(self.stream) for _ in range(n))]


def collate(examples: Sequence[Example], cfg: TrainConfig, offline: bool) -> dict[str, np.ndarray]:
    """[accum, micro, S, ...] arrays of one global batch, right-padded to S: the longest sample
    rounded up to a multiple of 128 (a handful of compiled shapes), at most `max_len`."""
    longest = max(len(e.sample.input_ids) for e in examples)
    m, b, s = cfg.accum_steps, cfg.micro_batch, min(cfg.max_len, -(-longest // 128) * 128)
    ids, mask, valid = pad_batch([e.sample for e in examples], s)
    batch = {"input_ids": ids.reshape(m, b, s), "loss_mask": mask.reshape(m, b, s), "valid": valid.reshape(m, b, s)}
    if offline:
        a, h = examples[0].aux_SA.shape[-1], examples[0].final_SH.shape[-1]
        aux = np.zeros((m * b, s, a), examples[0].aux_SA.dtype)
        final = np.zeros((m * b, s, h), examples[0].final_SH.dtype)
        for i, e in enumerate(examples):
            n = min(len(e.aux_SA), s)
            aux[i, :n], final[i, :n] = e.aux_SA[:n], e.final_SH[:n]
        batch["aux"], batch["final"] = aux.reshape(m, b, s, a), final.reshape(m, b, s, h)
    return batch


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
            import orbax.checkpoint as ocp
            opts = ocp.CheckpointManagerOptions(max_to_keep=self.cfg.keep_checkpoints, create=True)
            self._manager = ocp.CheckpointManager(Path(self.cfg.run_dir).absolute() / "checkpoints",
                                                  options=opts, item_names=("state", "meta"))
        return self._manager

    def save(self, meta: Mapping) -> None:
        import orbax.checkpoint as ocp
        step = int(self.state.step)
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(self.state._asdict()),
                                                        meta=ocp.args.JsonSave(dict(meta))))
        self.manager.wait_until_finished()

    def restore_latest(self) -> dict | None:
        """Restore the newest checkpoint (params, optimizer, step); returns its JSON meta."""
        import orbax.checkpoint as ocp
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
        from dspark_jax.checkpoint.draft_io import save_torch_draft
        cfg = dict(self.draft_cfg.raw)
        cfg["torch_dtype"] = "bfloat16"
        save_torch_draft(self.draft(), cfg, dst)


# ---------------------------------------------------------------------------------------------
# the loop


def _truncate_metrics(path: Path, last_step: int) -> None:
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def _fmt_eta(seconds: float) -> str:
    h, rem = divmod(int(seconds), 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def _cpu_seconds_so_far(path: Path) -> float:
    """The run's cumulative training CPU seconds: the last metrics row's `cpu_seconds`."""
    last = 0.0
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                last = json.loads(line).get("cpu_seconds", last)
    return last


def run(trainer: Trainer, source, *, stop_after: int | None = None, stop_at: int | None = None, evaluator=None,
        cpu_budget: float | None = None, time_budget: float | None = None) -> list[dict]:
    """Train to `cfg.total_steps` (or `stop_after` more steps, or to step `stop_at`: a
    constant-lr run stopped at a chosen step, saved and exported there), resuming from the run
    dir's latest checkpoint. Returns the metrics of the steps run by this call. `evaluator(draft) ->
    {"tok_per_fwd", ...}` (e.g. `monitor.HeldOutEval`) runs every `cfg.eval_every` steps.

    Every step records its process CPU seconds (all threads; evaluation excluded) and the run's
    running total `cpu_seconds`, which survives resumption; with `cpu_budget` the run saves,
    exports and stops at the first step that brings the total to the budget (the equal-CPU-time
    ablations compare runs whose steps cost differently). `time_budget` does the same once this
    call has run that many wall-clock seconds (a run on a machine available for a fixed time)."""
    cfg = trainer.cfg
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = trainer.restore_latest()
    start = int(trainer.state.step)
    if meta is not None:
        source.restore(meta["data_position"])
        trainer.log(f"resumed from step {start} ({run_dir / 'checkpoints'})")
    metrics_path = run_dir / "metrics.jsonl"
    lead = jax.process_index() == 0       # one writer of metrics files in a multi-process run
    tb = None
    if lead:
        _truncate_metrics(metrics_path, start)
        from tensorboardX import SummaryWriter
        tb = SummaryWriter(str(run_dir / "tb"), purge_step=start + 1 if start else None)
    cpu_total = _cpu_seconds_so_far(metrics_path) if lead else 0.0
    offline = not trainer.online
    evals = None
    if evaluator is not None and cfg.eval_every > 0 and lead:
        from dspark_jax.train.monitor import EvalHistory
        evals = EvalHistory(run_dir)
        done = {r["step"] for r in evals.truncate(start)}
        if start not in done:        # the curve's first point: the initial (or restored) weights
            _evaluate(trainer, evaluator, evals, tb, start, None, cpu_total)
    history = []
    end = cfg.total_steps if stop_after is None else min(cfg.total_steps, start + stop_after)
    if stop_at is not None:
        end = min(end, stop_at)
    t_start, last_saved = time.time(), start
    deadline = None if time_budget is None else t_start + time_budget
    if cpu_budget is not None and cpu_total >= cpu_budget:
        trainer.log(f"CPU budget {cpu_budget:.0f}s already spent ({cpu_total:.0f}s at step {start})")
        end = start
    try:
        for step in range(start, end):
            c0 = time.process_time()
            batch = collate(source.take(cfg.global_batch), cfg, offline)
            t0 = time.time()
            m = trainer.step(batch)
            m["step"] = step + 1
            m["step_seconds"] = time.time() - t0
            m["step_cpu_seconds"] = time.process_time() - c0
            cpu_total += m["step_cpu_seconds"]
            m["cpu_seconds"] = cpu_total
            out_of_time = deadline is not None and time.time() >= deadline
            over_budget = (cpu_budget is not None and cpu_total >= cpu_budget) or out_of_time
            history.append(m)
            if lead:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(m) + "\n")
                for k, v in m.items():
                    if k != "step":
                        tb.add_scalar(f"train/{k.replace('@', '_at_')}", v, step + 1)
                tb.add_scalar("train/sequences_seen", (step + 1) * cfg.global_batch, step + 1)
            if (step + 1) % cfg.log_every == 0 or step + 1 == end:
                done = step + 1 - start
                eta = (time.time() - t_start) / done * (cfg.total_steps - step - 1)
                trainer.log(f"step {step + 1}/{cfg.total_steps} loss {m['loss']:.4f} ce {m['ce']:.3f} "
                            f"l1 {m['l1']:.3f} bce {m['bce']:.3f} tau {m['tau_probabilistic']:.3f} "
                            f"acc@1 {m['accept@1']:.3f} top1 {m['top1_acc']:.3f} agree {m['teacher_agreement']:.3f} "
                            f"lr {m['lr']:.2e} gnorm {m['grad_norm']:.3f} {m['step_seconds']:.2f}s/step "
                            f"ETA {_fmt_eta(eta)}")
            if evals is not None and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.total_steps
                                      or over_budget):
                _evaluate(trainer, evaluator, evals, tb, step + 1, m.get("tau_probabilistic"), cpu_total)
            if (step + 1) % cfg.save_every == 0 or step + 1 in (end, cfg.total_steps) or over_budget:
                trainer.save({"data_position": source.position, "step": step + 1})
                last_saved = step + 1
                if cfg.export:
                    _export_latest(trainer, run_dir, step + 1)
            if out_of_time:
                trainer.log(f"time budget spent: {time.time() - t_start:.0f}s at step {step + 1}")
                break
            if over_budget:
                trainer.log(f"CPU budget spent: {cpu_total:.0f}s of training CPU time at step {step + 1}")
                break
    finally:
        if tb is not None:
            tb.close()
    if last_saved != int(trainer.state.step):
        trainer.save({"data_position": source.position, "step": int(trainer.state.step)})
    return history


def _evaluate(trainer: Trainer, evaluator, evals, tb, step: int, train_tau: float | None,
              cpu_seconds: float | None = None) -> None:
    """One held-out eval of the current weights: a row in eval.jsonl, TensorBoard eval/*, the PNG."""
    res = evaluator(trainer.draft())
    row = {"step": step, "sequences_seen": step * trainer.cfg.global_batch, **res,
           "train_tau": None if train_tau is None else float(train_tau), "cpu_seconds": cpu_seconds}
    evals.append(row)
    tb.add_scalar("eval/tok_per_fwd", res["tok_per_fwd"], step)
    tb.add_scalar("eval/acceptance_rate", res["acceptance_rate"], step)
    tb.add_scalar("eval/sequences_seen", row["sequences_seen"], step)
    for k, p in enumerate(res.get("per_position_acceptance", ())):
        tb.add_scalar(f"eval/accept_at_{k + 1}", p, step)
    tb.flush()
    png = evals.plot()
    trainer.log(f"eval step {step} ({row['sequences_seen']} sequences seen): held-out tok/fwd "
                f"{res['tok_per_fwd']:.3f} acceptance {res['acceptance_rate']:.3f} on {res.get('prompts', '?')} "
                f"prompts ({res.get('eval_seconds', 0.0):.1f}s); curve {png}")


def _export_latest(trainer: Trainer, run_dir: Path, step: int) -> None:
    root = run_dir / "export"
    dst = root / f"step_{step:07d}"
    if dst.exists():
        return
    trainer.export(dst)
    others = sorted(d for d in root.iterdir() if d.is_dir() and d.name.startswith("step_") and d != dst)
    older = [d for d in others if d.name < dst.name]
    redone = [d for d in others if d.name > dst.name]      # steps a resumed run is doing again
    for old in redone + older[:max(0, len(older) - (trainer.cfg.keep_exports - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    trainer.log(f"exported the draft (torch layout) to {dst}")
