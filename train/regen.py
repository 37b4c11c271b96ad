"""Cache the target's answers to the prompt pool (docs/architecture.md §4; format in dspark_jax/train/regen.py).

    python -m train.regen --prompts runs/demo/prompts.jsonl --out runs/demo/regen.jsonl \
        [--model smollm2-135m] [--max_new_tokens 256] [--batch_size 8] [--limit N] [--snapshot FILE]

Greedy (temperature 0) by default, through `generate()` with the serving chat template. Rerunning the same
command resumes: prompts already in --out are skipped. Progress (prompts, tokens/s, ETA) goes to
stdout after every batch. --num_shards/--shard_index split the pool over several processes, each
writing its own --out. --tp N places the target on N devices as serving does (a Kimi-K3 target on
one node: --tp 8; dspark_jax/train/train_mesh.py), --dp M adds a data axis of M.

Multi-host (docs/scaling.md): the same command on every host with --coordinator_address,
--num_processes, --process_id (or $DSPARK_COORDINATOR, $DSPARK_NUM_PROCESSES, $DSPARK_PROCESS_ID);
process i of n answers every n-th prompt from i on its own devices (--tp x --dp of them), into its own cache beside
--out (`regen.jsonl` -> `regen-0000i-of-0000n.jsonl`; `train.distill --data` takes the shards
as a glob or a comma-separated list).
"""

from __future__ import annotations

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
from dspark_jax.tokenizer import load_tokenizer
from dspark_jax.train import regen, train_mesh

FLAGS = flags.FLAGS
flags.DEFINE_string("prompts", None, "Prompt pool JSONL ({id, source, messages}).")
flags.DEFINE_string("out", None, "Answer cache JSONL (appended; resumable).")
pair_flags.define_model("smollm2-135m", help="Target: directory or preset name.")
pair_flags.define_tp()
train_mesh.define_flags(fsdp=False)
pair_flags.define_dtype("float32", ("float32", "bfloat16"), "Target compute dtype.")
flags.DEFINE_integer("max_new_tokens", 256, "Answer length limit.", lower_bound=1)
flags.DEFINE_integer("batch_size", 8, "Sequences decoded at once (continuous batching).", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy).", lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("max_num_batched_tokens", None, "Prompt tokens prefilled per engine step: longer prompts go in "
                     "chunk by chunk (as serve.server does; needed where a whole prompt's activations do not fit, "
                     "e.g. Kimi-K3); unset: whole prompts. Greedy answers are the same either way.", lower_bound=1)
flags.DEFINE_integer("min_loss_tokens", regen.MIN_LOSS_TOKENS, "Answers shorter than this are not kept.")
flags.DEFINE_list("first_sources", [], "Answer these pool sources first, in this order (e.g. gsm8k_train); "
                  "the rest follow in pool order. --limit and --snapshot count in this order.")
flags.DEFINE_integer("limit", None, "Use only the first N prompts of the pool (after --first_sources).",
                     lower_bound=1)
flags.DEFINE_integer("num_shards", 1, "Split the pool over this many processes.", lower_bound=1)
flags.DEFINE_integer("shard_index", 0, "This process's shard (prompts i with i % num_shards == index).")
flags.DEFINE_string("snapshot", None, "After the run, also write the answers of the first --limit prompts, in "
                    "pool order, to this file: a fixed training set while --out keeps growing.")
flags.DEFINE_string("archive", None, "A directory of gzipped answer parts (committable): restored into --out "
                    "before the run, and every finished part of 500 answers copied there as the run goes.")
flags.DEFINE_bool("snapshot_archived", False, "--snapshot holds the longest head of the pool (within --limit) "
                  "whose answers --archive holds, not all of the first --limit: a time-budgeted run's "
                  "training set, rebuilt later from the committed parts alone.")
flags.DEFINE_float("time_budget", None, "Seconds from the program's start after which no further prompt starts; "
                   "the running ones finish, so the answered prompts stay the pool's first ones (a rerun "
                   "resumes).", lower_bound=0)
flags.mark_flags_as_required(["prompts", "out"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    deadline = None if FLAGS.time_budget is None else time.time() + FLAGS.time_budget
    logging.set_verbosity(logging.WARNING)     # Orbax and JAX log every save at INFO
    dist = distributed.initialize_program()
    num_shards, shard_index, out = FLAGS.num_shards, FLAGS.shard_index, FLAGS.out
    if dist.multi_process:
        if num_shards != 1 or shard_index != 0:
            raise app.UsageError("--num_shards/--shard_index split the pool by hand; a multi-process run "
                                 "splits it by process: drop them")
        # answering is embarrassingly parallel: each process decodes its shard on its own devices
        num_shards, shard_index = dist.num_processes, dist.process_id
        out = str(shard_path(out, shard_index, num_shards))
    if FLAGS.snapshot_archived and not (FLAGS.snapshot and FLAGS.archive):
        raise app.UsageError("--snapshot_archived needs --snapshot and --archive")
    if FLAGS.snapshot and num_shards > 1:
        raise app.UsageError("--snapshot needs the whole pool in one cache: run it without shards")
    if not 0 <= shard_index < num_shards:
        raise app.UsageError(f"--shard_index={shard_index} is not in 0..{num_shards - 1}")
    t0 = time.time()
    tag = f"regen {shard_index}/{num_shards}" if num_shards > 1 else "regen"

    def log(msg: str) -> None:
        print(f"[{tag} {time.time() - t0:8.1f}s] {msg}", flush=True)

    pool = regen.order_by_source(regen.read_jsonl(FLAGS.prompts), FLAGS.first_sources)
    records = pool[:FLAGS.limit][shard_index::num_shards]
    path = resolve_model_path(FLAGS.model)
    # this process's own devices (the loader's default, jax.devices()[0], is process 0's)
    local = train_mesh.mesh_from_flags(load_config(path), devices=jax.local_devices(), multi_process=False)
    log(train_mesh.describe(local))
    target = load_target(path, dtype=jnp.dtype(FLAGS.dtype), mesh=local)
    tokenizer = load_tokenizer(path)
    settings = regen.RegenSettings(target=str(FLAGS.model), max_new_tokens=FLAGS.max_new_tokens,
                                   temperature=FLAGS.temperature, seed=FLAGS.seed,
                                   chat_template_sha256=regen.template_sha256(tokenizer),
                                   min_loss_tokens=FLAGS.min_loss_tokens)
    if FLAGS.archive:
        n = regen.restore_cache(FLAGS.archive, out)
        if n:
            log(f"restored {n} answers from {FLAGS.archive}")
    on_write = (lambda: regen.archive_cache(out, FLAGS.archive)) if FLAGS.archive else None
    counts = regen.regenerate(target, tokenizer, records, out, settings=settings,
                              batch_size=FLAGS.batch_size, log=log, on_write=on_write, deadline=deadline,
                              max_num_batched_tokens=FLAGS.max_num_batched_tokens)
    cached = answer_cache.read_cache(out)
    if FLAGS.archive and num_shards == 1 and {r["id"] for r in cached} >= {r["id"] for r in pool}:
        n = regen.archive_cache(out, FLAGS.archive, complete=True)   # the whole pool: its tail too
        log(f"the whole pool is answered: {n} answers archived in {FLAGS.archive}")
    kept = sum(r["kept"] for r in cached)
    log(f"done: {counts}; {kept} kept samples in {out}")
    if FLAGS.snapshot_archived:
        n = regen.write_snapshot(out, regen.archived_head(records, FLAGS.archive), FLAGS.snapshot)
        log(f"snapshot: the answers of the first {n} prompts (all archived) in {FLAGS.snapshot}")
    elif FLAGS.snapshot:
        if counts["unanswered"]:
            raise app.UsageError(f"--snapshot: the time budget left {counts['unanswered']} of the first "
                                 f"{len(records)} prompts unanswered; rerun to finish them")
        n = regen.write_snapshot(out, [r["id"] for r in records], FLAGS.snapshot)
        log(f"snapshot: the answers of {n} prompts in {FLAGS.snapshot}")


def shard_path(out: str, index: int, count: int) -> Path:
    """Process `index` of `count`'s cache beside `out`: regen.jsonl -> regen-00001-of-00002.jsonl."""
    p = Path(out)
    return p.with_name(f"{p.stem}-{index:05d}-of-{count:05d}{p.suffix}")


if __name__ == "__main__":
    app.run(main)
