"""Sample chat requests from the target itself (Magpie) into a resumable query cache.

    python -m train.magpie --model smollm2-135m --dtype bfloat16 --num_queries 2000 \
        --out runs/demo/magpie.jsonl --archive datasets/magpie-smollm2-135m.jsonl.gz
    python -m train.prompts --sources magpie --magpie_cache runs/demo/magpie.jsonl \
        --out runs/demo/prompts-magpie.jsonl          # decontaminated, deduplicated pool
    python -m train.regen --prompts runs/demo/prompts-magpie.jsonl --out runs/demo/regen-magpie.jsonl ...

    python -m train.magpie --openers "Write,Pretend,Imagine" --out runs/demo/magpie-open.jsonl ...
                                                      # requests that start with those words, in turn

The target continues its chat template from the opening of a user turn (dspark_jax/data/magpie.py);
requests that end their turn on their own are kept. Rerun the same command to continue after an
interruption. With --archive the cache is restored from that gzip first (sampled requests differ
from CPU to CPU, so a fresh machine restores rather than resamples) and rewritten as it grows.
"""

from __future__ import annotations

import os
import time

import jax.numpy as jnp
from absl import app, flags, logging

from dspark_jax.api import load_target
from dspark_jax.data import magpie
from dspark_jax.presets import resolve_model_path
from dspark_jax.serving import pair_flags
from dspark_jax.tokenizer import load_tokenizer

FLAGS = flags.FLAGS
pair_flags.define_model("smollm2-135m", help="Target: directory or preset name (instruction-tuned).")
pair_flags.define_dtype("float32", ("float32", "bfloat16"), "Target compute dtype.")
pair_flags.define_tp()
flags.DEFINE_string("out", None, "Query cache JSONL (appended; resumable).")
flags.DEFINE_integer("num_queries", 2000, "Accepted requests to reach.", lower_bound=1)
flags.DEFINE_integer("batch_size", 8, "Sequences decoded at once.", lower_bound=1)
flags.DEFINE_float("temperature", 1.0, "Sampling temperature.", lower_bound=0.0)
flags.DEFINE_float("top_p", 0.99, "Nucleus sampling mass.")
flags.DEFINE_integer("max_new_tokens", 128, "Request length limit (longer ones are rejected).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_list("openers", [], "Words a request starts with, in turn (steered sampling, e.g. "
                  "'Write,Pretend,Imagine'); none: the target opens the turn itself. Use its own --out.")
flags.DEFINE_float("time_budget", None, "Seconds from the program's start after which no further sample starts "
                   "(the running ones finish and are kept; a rerun resumes).", lower_bound=0)
flags.DEFINE_string("archive", None, "A gzip copy of the cache: restored from first, rewritten as the cache grows.")
flags.mark_flag_as_required("out")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    pair_flags.require_one_device("train.magpie")
    if not 0 < FLAGS.top_p <= 1:
        raise app.UsageError(f"--top_p must be in (0, 1], got {FLAGS.top_p}")
    if FLAGS.temperature <= 0:
        raise app.UsageError("--temperature must be > 0: greedy decoding writes one request over and over")
    logging.set_verbosity(logging.WARNING)
    t0 = time.time()
    deadline = None if FLAGS.time_budget is None else t0 + FLAGS.time_budget

    def log(msg: str) -> None:
        print(f"[magpie {time.time() - t0:8.1f}s] {msg}", flush=True)

    path = resolve_model_path(FLAGS.model)
    tokenizer = load_tokenizer(path)
    settings = magpie.MagpieSettings(target=str(FLAGS.model), temperature=FLAGS.temperature,
                                     top_p=FLAGS.top_p, max_new_tokens=FLAGS.max_new_tokens, seed=FLAGS.seed,
                                     prefix_sha256=magpie.prefix_sha256(tokenizer),
                                     openers=",".join(FLAGS.openers))
    if FLAGS.archive and os.path.exists(FLAGS.archive):
        n = magpie.restore_archive(FLAGS.archive, FLAGS.out)
        if n:
            log(f"restored {n} rows from {FLAGS.archive}")
    log(f"query prefix: {magpie.query_prefix(tokenizer)!r}"
        + (f", then one of {magpie.openers(settings)}" if FLAGS.openers else ""))
    target = load_target(path, dtype=jnp.dtype(FLAGS.dtype))
    on_write = (lambda: magpie.write_archive(FLAGS.out, FLAGS.archive)) if FLAGS.archive else None
    counts = magpie.sample_queries(target, tokenizer, FLAGS.out, num_queries=FLAGS.num_queries,
                                   settings=settings, batch_size=FLAGS.batch_size, log=log, on_write=on_write,
                                   deadline=deadline)
    rows = magpie.read_cache(FLAGS.out)
    kept = sum(bool(r.get("query")) for r in rows)
    log(f"done: {counts}; {kept} accepted of {len(rows)} sampled in {FLAGS.out}"
        + (f", archived in {FLAGS.archive}" if FLAGS.archive else ""))


if __name__ == "__main__":
    app.run(main)
