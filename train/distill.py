"""Distil a DSpark draft from a target (docs/architecture.md §4; dspark_jax/train/trainer.py).

Online teacher (the target's prefill runs inside the training step):
    python -m train.distill --target smollm2-135m --data runs/demo/regen.jsonl \
        --draft_config dspark_jax/configs/smollm2-135m-dspark.json --run_dir runs/demo/distill \
        --total_steps 2000 --global_batch 16 --micro_batch 4 --max_len 512

Offline teacher (shards written by `python -m train.teacher`, possibly still being written):
    python -m train.distill --target smollm2-135m --teacher_dir runs/demo/teacher ...

Rerunning the same command resumes from the newest checkpoint in --run_dir. The starting draft
(dspark_jax/train/init_draft.py): --init_from starts from a torch-layout draft; --warm_start
initialises a fresh draft from the target where shapes allow (dspark_jax/train/warm_start.py: MLP
+ norms of the target's last layers, identity context_proj on the last aux layer, zero Markov
output side and confidence head; attention random);
--draft_vocab vocab.json (`python -m train.vocab`) trains a draft with a reduced vocabulary (the K
most frequent answer tokens): a fresh one, or --init_from's draft with its Markov output side
moved to the kept rows (a reduced draft given a new vocabulary keeps its rows for the ids both
hold; ids it lacked start at zero); the file is copied to <run_dir>/vocab.json and a resume must
give the same one (checkpoints hold parameters, not the map);
--add_layers N deepens --init_from's draft by N layers that start as identities;
--ce_weight / --l1_weight set the loss's mix of hard-label CE and L1 (spec: 0.1 / 0.9);
--resume_torchspec converts a TorchSpec training checkpoint (checkpoint_N.pt) into this run's first
checkpoint. The draft is exported in the torch layout to <run_dir>/export/step_N at every checkpoint.

Monitoring: --eval_every N measures the served tok/fwd of the current weights (temperature 0, 7 drafts,
generate()) on held-out prompts (default GSM8K test 60..60+--eval_num_prompts, outside the
acceptance benchmark's first 60; or --eval_prompts_file) at the start and every N steps:
<run_dir>/eval.jsonl, TensorBoard eval/* under <run_dir>/tb, <run_dir>/learning_curve.png.
--cpu_budget S stops (saving and exporting) once the training steps have used S process CPU seconds
in all; metrics.jsonl records every step's and the running total (for comparisons at equal CPU
time); --time_budget S stops the same way after S wall-clock seconds of this invocation.

Mesh (dspark_jax/train/train_mesh.py): --tp N splits the teacher over N devices as serving does
(TP = EP; a Kimi-K3 teacher on one node: --tp 8), --dp / --fsdp replicate / shard the draft and
its AdamW state over the rest; by default one process trains on one device.

Multi-host (docs/scaling.md): the same command on every host with --coordinator_address,
--num_processes, --process_id (or $DSPARK_COORDINATOR, $DSPARK_NUM_PROCESSES, $DSPARK_PROCESS_ID)
and a --run_dir every host sees; the mesh then holds every device of every host (by default all
but the tensor axis on fsdp), and the torch-layout export is written once, by process 0, at the end.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import app, flags, logging

from dspark_jax import distributed
from dspark_jax.api import load_target
from dspark_jax.config import load_config
from dspark_jax.data import answer_cache
from dspark_jax.presets import resolve_model_path
from dspark_jax.serving import pair_flags
from dspark_jax.train import init_draft, regen, teacher_shards, torchspec, train_mesh
from dspark_jax.train import loss as loss_lib
from dspark_jax.train import trainer as trainer_lib
from dspark_jax.train import loop as loop_lib
from dspark_jax.train import batches as batches_lib
from train import paths

FLAGS = flags.FLAGS
pair_flags.define_model("smollm2-135m", name="target", help="Target model: directory or preset name.")
pair_flags.define_tp()
train_mesh.define_flags()
flags.DEFINE_enum("target_dtype", "float32", ["float32", "bfloat16"], "Teacher compute dtype (the held-out eval "
                  "serves the target in float32 either way, as benchmarks.acceptance does).")
flags.DEFINE_string("data", None, "Regen cache JSONL (online teacher); several (the shards of a multi-host "
                    "train.regen, or a mixture): a glob or a comma-separated list; a file named k times is "
                    "read k times (oversampled k-fold).")
flags.DEFINE_string("teacher_dir", None, "Offline teacher shard directory (instead of --data).")
flags.DEFINE_float("teacher_timeout", None, "Seconds to wait for a live teacher shard (default: forever).")
flags.DEFINE_string("draft_config", None, "Draft config.json (default: --init_from's).")
flags.DEFINE_string("init_from", None, "Start from this torch-layout draft directory.")
flags.DEFINE_integer("add_layers", 0, "With --init_from: that draft with this many more decoder layers, each "
                     "a copy of its last with zero o_proj/down_proj (drafts as before until trained).",
                     lower_bound=0)
flags.DEFINE_string("resume_torchspec", None, "TorchSpec checkpoint_N.pt (or a dir holding training_checkpoint/).")
flags.DEFINE_string("run_dir", None, "Checkpoints, metrics.jsonl, tb/, export/.")
flags.DEFINE_integer("total_steps", None, "Optimizer steps (default: --epochs over the data).")
flags.DEFINE_float("epochs", None, "Epochs over the regenerated samples (online only).")
flags.DEFINE_integer("global_batch", 16, "Sequences per optimizer step.")
flags.DEFINE_integer("micro_batch", 4, "Sequences per forward/backward (accumulation = global/micro).")
flags.DEFINE_integer("max_len", 1024, "Sequence length (longer samples are truncated).")
flags.DEFINE_integer("num_anchors", 512, "Anchors per sequence.")
flags.DEFINE_integer("num_speculative_tokens", 7, "Drafts per block T (the block width the draft is trained "
                     "for; the serving programs' flag of the same name).", lower_bound=1)
flags.DEFINE_float("gamma", 4.0, "Position decay exp(-k/gamma).")
flags.DEFINE_float("ce_weight", loss_lib.LossConfig.ce_weight, "Weight of the hard-label cross-entropy term "
                   "(default: the published recipe's, docs/architecture.md §4).", lower_bound=0.0)
flags.DEFINE_float("l1_weight", loss_lib.LossConfig.l1_weight, "Weight of the L1 (2 x total variation) term "
                   "(default: the published recipe's, docs/architecture.md §4). Greedy acceptance needs only "
                   "the argmax to agree, which CE trains directly; L1 matches the whole distribution, which "
                   "sampling at T > 0 needs.", lower_bound=0.0)
flags.DEFINE_string("draft_vocab", None, "vocab.json of `python -m train.vocab`: train the draft over these K "
                    "target ids (draft_vocab_size, the d2t/t2d map); with --init_from, that draft "
                    "moved to them (its Markov rows for the ids it holds, zero for the rest).")
flags.DEFINE_bool("warm_start", False, "Initialise the draft from the target where shapes allow "
                  "(dspark_jax/train/warm_start.py); not with --init_from.")
flags.DEFINE_float("lr", 5e-5, "Peak learning rate.")
flags.DEFINE_enum("lr_schedule", "cosine", list(trainer_lib.LR_SCHEDULES),
                  "After the linear warmup: cosine decay to --min_lr_frac, or constant at --lr.")
flags.DEFINE_float("warmup_frac", 0.04, "Warmup fraction of total steps.")
flags.DEFINE_float("min_lr_frac", 0.0, "Final learning rate as a fraction of the peak.")
flags.DEFINE_float("clip", 1.0, "Gradient clipping (global norm).")
flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay.")
flags.DEFINE_enum("compute_dtype", "auto", ["auto", "bfloat16", "float32"],
                  "Draft forward/backward dtype; auto = bfloat16 on accelerators, float32 on CPU. bfloat16 "
                  "runs on CPU too, and faster where XLA:CPU has a native bf16 GEMM (AVX-512 BF16 / AMX), "
                  "as every CPU recipe in docs/training.md passes it.")
flags.DEFINE_integer("seed", 0, "Init, data order and anchor sampling seed.")
flags.DEFINE_integer("save_every", 100, "Checkpoint (and export) every N steps.")
flags.DEFINE_integer("log_every", 1, "Log every N steps.")
flags.DEFINE_integer("keep_exports", 1, "Exports kept, the newest (train.average averages the last few).",
                     lower_bound=1)
flags.DEFINE_integer("eval_every", 0, "Held-out served tok/fwd every N steps (0: off).", lower_bound=0)
flags.DEFINE_integer("eval_num_prompts", 8, "Held-out GSM8K-test prompts (from --eval_offset).", lower_bound=1)
flags.DEFINE_integer("eval_offset", 60, "First held-out GSM8K-test prompt (>= 60: benchmarks.acceptance "
                     "uses the first 60).", lower_bound=60)
flags.DEFINE_string("eval_prompts_file", None, "Held-out prompts JSONL instead of GSM8K ({\"prompt_ids\"}, "
                    "{\"messages\"} or {\"prompt\"} rows).")
flags.DEFINE_integer("eval_max_new_tokens", 128, "Tokens generated per held-out prompt.", lower_bound=1)
flags.DEFINE_integer("eval_batch_size", 8, "Held-out prompts per generate() call.", lower_bound=1)
flags.DEFINE_integer("stop_after", None, "Stop after this many steps in this invocation (resume later).")
flags.DEFINE_integer("stop_at", None, "Stop (save, export) at this step of the run: a constant-lr run's chosen "
                     "length, below --total_steps (which sets the warmup); a rerun resumes there and trains no "
                     "step.", lower_bound=1)
flags.DEFINE_float("cpu_budget", None, "Stop (save, export) once the run's training steps have used this many "
                   "process CPU seconds in all (recorded per step in metrics.jsonl; evaluation not counted): "
                   "equal-CPU-time ablations.", lower_bound=1.0)
flags.DEFINE_float("time_budget", None, "Stop (save, export) once this invocation's training loop has run this "
                   "many wall-clock seconds (a machine held for a fixed time).", lower_bound=1.0)
flags.mark_flags_as_required(["run_dir"])
flags.register_multi_flags_validator(
    ["ce_weight", "l1_weight"], lambda f: f["ce_weight"] + f["l1_weight"] > 0,
    "--ce_weight and --l1_weight are both 0: no term would train the draft's tokens")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)     # Orbax and JAX log every save at INFO
    if (FLAGS.data is None) == (FLAGS.teacher_dir is None):
        raise app.UsageError("give exactly one of --data (online teacher) and --teacher_dir (offline)")
    settings = distributed.initialize_program()
    primary = distributed.is_primary()
    t0 = time.time()

    def log(msg: str) -> None:
        if primary:
            print(f"[distill {time.time() - t0:8.1f}s] {msg}", flush=True)

    mesh = train_mesh.mesh_from_flags(load_config(resolve_model_path(FLAGS.target)))
    log(train_mesh.describe(mesh))
    init = init_draft.DraftInit(draft_config=FLAGS.draft_config, init_from=FLAGS.init_from,
                                add_layers=FLAGS.add_layers, draft_vocab=FLAGS.draft_vocab,
                                warm_start=FLAGS.warm_start, seed=FLAGS.seed)
    try:
        init.check()
    except init_draft.DraftInitError as e:
        raise app.UsageError(str(e)) from None
    if FLAGS.cpu_budget and settings.multi_process:
        raise app.UsageError("--cpu_budget is single-process only (one process keeps the CPU total)")
    if FLAGS.time_budget and settings.multi_process:
        raise app.UsageError("--time_budget is single-process only (each process's clock would stop it at "
                             "a different step)")
    if FLAGS.eval_every and settings.multi_process:
        raise app.UsageError("--eval_every is single-process only (the draft is sharded over hosts)")
    if FLAGS.lr_schedule == "constant" and FLAGS.min_lr_frac:
        log(f"note: --min_lr_frac {FLAGS.min_lr_frac} is unused with --lr_schedule constant")

    try:
        initial = init_draft.prepare(init, FLAGS.run_dir, mesh, log)
    except init_draft.DraftInitError as e:
        raise app.UsageError(str(e)) from None
    draft_cfg = initial.cfg
    target = load_target(FLAGS.target, dtype=jnp.dtype(FLAGS.target_dtype), mesh=mesh,
                         rules=train_mesh.TEACHER_RULES)
    start_draft = init_draft.finish(initial, init, target, mesh, log)
    online = FLAGS.data is not None
    if online:
        files = paths.expand(FLAGS.data, flag="data", what="regen cache", exists=Path.is_file)
        rows = [row for path in files for row in answer_cache.read_cache(path)]
        samples = list(regen.samples_from_cache(rows, max_len=FLAGS.max_len))
        source = batches_lib.SampleSource(samples, FLAGS.seed, group=FLAGS.global_batch)
        log(f"{len(samples)} samples from {FLAGS.data}")
    else:
        stream = teacher_shards.ShardStream(FLAGS.teacher_dir, poll_seconds=2.0, timeout_seconds=FLAGS.teacher_timeout,
                                     log=log)
        if tuple(stream.meta.aux_layer_ids) != tuple(draft_cfg.target_layer_ids):
            raise app.UsageError(f"{FLAGS.teacher_dir}: aux layers {stream.meta.aux_layer_ids} != the draft's "
                                 f"target_layer_ids {list(draft_cfg.target_layer_ids)}")
        source = batches_lib.ShardSource(stream)
        samples = None
    total = FLAGS.total_steps
    if total is None:
        if FLAGS.epochs is None or samples is None:
            raise app.UsageError("--total_steps is required (or --epochs with --data)")
        total = max(1, int(FLAGS.epochs * len(samples) / FLAGS.global_batch))
    cfg = trainer_lib.TrainConfig(
        run_dir=FLAGS.run_dir, total_steps=total, global_batch=FLAGS.global_batch, micro_batch=FLAGS.micro_batch,
        max_len=FLAGS.max_len, lr=FLAGS.lr, warmup_frac=FLAGS.warmup_frac, min_lr_frac=FLAGS.min_lr_frac,
        clip_norm=FLAGS.clip, weight_decay=FLAGS.weight_decay, compute_dtype=_compute_dtype(), seed=FLAGS.seed,
        log_every=FLAGS.log_every, save_every=FLAGS.save_every, lr_schedule=FLAGS.lr_schedule,
        eval_every=FLAGS.eval_every, keep_exports=FLAGS.keep_exports,
        # the per-checkpoint export reads every parameter on the host: multi-host exports once, below
        export=not settings.multi_process,
        loss=loss_lib.LossConfig(block_size=FLAGS.num_speculative_tokens, num_anchors=FLAGS.num_anchors, gamma=FLAGS.gamma,
                                  ce_weight=FLAGS.ce_weight, l1_weight=FLAGS.l1_weight))
    trainer = trainer_lib.Trainer(cfg, draft_cfg, target, online=online, mesh=mesh, init_draft=start_draft, log=log)
    if FLAGS.resume_torchspec and trainer.manager.latest_step() is None:
        names = set(trainer_lib.flat_names(trainer.state.params))
        ts = torchspec.read_torchspec_checkpoint(FLAGS.resume_torchspec, names)
        params, opt_state = torchspec.to_train_state(ts, trainer.state.params, trainer.tx)
        trainer.set_state(params, opt_state, ts.step)
        trainer.save({"data_position": source.position, "step": ts.step, "from_torchspec": str(FLAGS.resume_torchspec)})
        log(f"converted TorchSpec checkpoint {FLAGS.resume_torchspec} (step {ts.step}) "
            f"into {FLAGS.run_dir}/checkpoints")
    log(f"training {total} steps: global batch {cfg.global_batch} = {cfg.accum_steps} x {cfg.micro_batch}, "
        f"max_len {cfg.max_len}, {cfg.loss.num_anchors} anchors, {'online' if online else 'offline'} teacher, "
        f"{mesh.devices.size} device(s), compute {cfg.compute_dtype}")
    Path(FLAGS.run_dir).mkdir(parents=True, exist_ok=True)
    if primary:
        with open(Path(FLAGS.run_dir) / "flags.json", "w") as f:
            json.dump({k: v.value for k, v in FLAGS.__flags.items() if k in _OWN_FLAGS}, f, indent=1)
    evaluator = None
    if FLAGS.eval_every:
        from dspark_jax.train import monitor
        if FLAGS.eval_prompts_file:
            prompts = monitor.read_prompts_file(FLAGS.eval_prompts_file)
            where = FLAGS.eval_prompts_file
        else:
            prompts = monitor.gsm8k_heldout_prompts(FLAGS.eval_num_prompts, start=FLAGS.eval_offset)
            where = f"GSM8K test {FLAGS.eval_offset}..{FLAGS.eval_offset + len(prompts) - 1}"
        # served like benchmarks.acceptance serves it (float32), whatever dtype the teacher runs in
        served = target if FLAGS.target_dtype == "float32" else load_target(
            FLAGS.target, dtype=jnp.float32, mesh=mesh, rules=train_mesh.TEACHER_RULES)
        evaluator = monitor.HeldOutEval(served, prompts, max_new_tokens=FLAGS.eval_max_new_tokens,
                                        num_speculative_tokens=FLAGS.num_speculative_tokens,
                                        batch_size=FLAGS.eval_batch_size)
        log(f"held-out eval every {FLAGS.eval_every} steps: {len(prompts)} prompts ({where}), "
            f"{FLAGS.eval_max_new_tokens} new tokens, temperature 0, {FLAGS.num_speculative_tokens} drafts")
    loop_lib.run(trainer, source, stop_after=FLAGS.stop_after, stop_at=FLAGS.stop_at, evaluator=evaluator,
                    cpu_budget=FLAGS.cpu_budget, time_budget=FLAGS.time_budget)
    if settings.multi_process:
        _export_multihost(trainer, Path(FLAGS.run_dir), log)
    log("done")


def _export_multihost(trainer: trainer_lib.Trainer, run_dir: Path, log) -> None:
    """The draft in the torch layout at the current step. Its FSDP shards live on several hosts:
    every process joins one all-gather into a replicated copy, then process 0 writes it."""
    from jax.sharding import NamedSharding, PartitionSpec

    from dspark_jax.checkpoint.draft_io import save_torch_draft
    params = jax.jit(lambda p: p, out_shardings=NamedSharding(trainer.mesh, PartitionSpec()))(trainer.state.params)
    dst = run_dir / "export" / f"step_{int(trainer.state.step):07d}"
    if not distributed.is_primary() or dst.exists():
        return
    cfg = dict(trainer.draft_cfg.raw)
    cfg["torch_dtype"] = "bfloat16"
    save_torch_draft(trainer_lib.merge_draft(trainer.graphdef, trainer.template, trainer.rest, params), cfg, dst)
    log(f"exported the draft (torch layout) to {dst}")


def _compute_dtype() -> str:
    if FLAGS.compute_dtype != "auto":
        return FLAGS.compute_dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


_OWN_FLAGS = {"target", "target_dtype", "data", "teacher_dir", "draft_config", "init_from", "add_layers",
              "resume_torchspec", "run_dir", "total_steps", "epochs", "global_batch", "micro_batch", "max_len",
              "num_anchors", "num_speculative_tokens", "gamma", "ce_weight", "l1_weight", "lr", "warmup_frac", "min_lr_frac",
              "clip", "weight_decay", "compute_dtype", "seed", "save_every", "log_every", "keep_exports",
              "warm_start", "lr_schedule", "eval_every", "eval_num_prompts", "eval_offset", "eval_prompts_file",
              "eval_max_new_tokens", "eval_batch_size", "draft_vocab", "cpu_budget", "time_budget",
              "stop_at", "tp", "dp", "fsdp"}


if __name__ == "__main__":
    app.run(main)
