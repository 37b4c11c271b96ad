"""OpenAI-compatible server: `python -m serve.server --model DIR --draft_model DIR --port 8000`.

Flags mirror ATOM's (`--num_speculative_tokens`, `--kv_cache_dtype`, `--tp`, `--max_model_len`,
`--max_num_seqs`, `--block_size`). Endpoints: /v1/chat/completions, /v1/completions (SSE with
"stream": true), /v1/models, /health, /debug/mtp_stats, /metrics. Omitted model flags serve the
demo pair.
"""

from __future__ import annotations

import logging

from absl import app, flags

from dspark_jax import distributed  # also defines --coordinator_address, --num_processes, --process_id

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Target: HF-layout or Orbax directory, or a preset (default: smollm2-135m).")
flags.DEFINE_string("draft_model", None, "DSpark draft directory or preset (default: smollm2-135m-dspark); "
                    "'none' for plain decoding, 'untrained[:CONFIG.json]' for a random draft.")
flags.DEFINE_integer("num_speculative_tokens", 7, "Drafts per verify step (the block width); 0 = plain decoding.",
                     lower_bound=0)
flags.DEFINE_string("kv_cache_dtype", "auto", "Paged cache storage: auto (model dtype), bf16, fp32 or fp8.")
flags.DEFINE_integer("tp", 1, "Tensor-parallel degree (devices in the mesh).", lower_bound=1)
flags.DEFINE_integer("max_model_len", None, "Tokens per sequence (prompt + output); default "
                     "min(max_position_embeddings, 4096).", lower_bound=16)
flags.DEFINE_integer("max_num_seqs", 8, "Cache slots: sequences decoded together.", lower_bound=1)
flags.DEFINE_integer("block_size", 16, "Tokens per page of the paged cache.", lower_bound=1)
flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0 exposes the server to the network).")
flags.DEFINE_integer("port", 8000, "TCP port.", lower_bound=0)
flags.DEFINE_string("api_key", None, "If set, /v1 requests need 'Authorization: Bearer <key>'.")
flags.DEFINE_string("served_model_name", None, "Model id in /v1/models and responses (default: --model's name).")
flags.DEFINE_integer("max_queue_len", 256, "Requests allowed to wait for a slot; beyond it: HTTP 503.",
                     lower_bound=1)
flags.DEFINE_float("stats_interval", 10.0, "Seconds between [MTP Stats] log lines.", lower_bound=0.1)
flags.DEFINE_integer("seed", 0, "Sampling seed of the engine (requests with temperature > 0).")
flags.DEFINE_bool("warmup", True, "Compile the decode step before accepting requests.")

log = logging.getLogger("dspark_jax.serving")


def main(argv) -> None:
    del argv
    import uvicorn

    from dspark_jax.generate import Batcher, Engine, Request, SpecStats, eos_ids
    from dspark_jax.serving.app import ServerConfig, create_app
    from dspark_jax.serving.models import describe, load_pair
    from dspark_jax.serving.worker import EngineWorker

    try:
        settings = distributed.resolve_settings()
    except distributed.DistributedError as e:
        raise app.UsageError(str(e)) from None
    if settings.multi_process:
        # every process would have to run the engine loop in lockstep with process 0's admissions;
        # a replica fits one node (--tp up to its devices): run one server per node instead
        raise app.UsageError(f"serve.server runs in one process (got {settings.num_processes} processes from "
                             "--num_processes / $DSPARK_NUM_PROCESSES): start one server per node, each "
                             "with --tp <its device count>, behind a load balancer (docs/scaling.md)")
    logging.getLogger("dspark_jax").setLevel(logging.INFO)
    pair = load_pair(FLAGS.model, FLAGS.draft_model, tp=FLAGS.tp)
    if pair.tokenizer is None:
        raise app.UsageError(f"{pair.target_name}: no tokenizer found beside the model")
    t = FLAGS.num_speculative_tokens if pair.draft is not None else 0
    draft = pair.draft if t else None
    engine = Engine(pair.target, draft, t, kv_cache_dtype=FLAGS.kv_cache_dtype, page_size=FLAGS.block_size)
    limit = int(getattr(pair.target.cfg, "max_position_embeddings", 0) or 4096)
    max_model_len = FLAGS.max_model_len or min(limit, 4096)
    for line in describe(pair, num_speculative_tokens=t, kv_cache_dtype=FLAGS.kv_cache_dtype,
                         store_dtype=engine.store_dtype, block_size=FLAGS.block_size,
                         max_num_seqs=FLAGS.max_num_seqs, max_model_len=max_model_len):
        log.info(line)
    batcher = Batcher(engine, FLAGS.max_num_seqs, max_model_len, seed=FLAGS.seed)
    if FLAGS.warmup:
        log.info("warming up (compiling prefill and the decode step) ...")
        batcher.run([Request([0] * 4, 2)])
        batcher.stats, batcher.num_steps = SpecStats(t), 0      # warm-up steps are not served traffic
    worker = EngineWorker(batcher, max_queue=FLAGS.max_queue_len, stats_interval=FLAGS.stats_interval)
    names = [FLAGS.served_model_name or pair.target_name]
    cfg = ServerConfig(model_names=names, max_model_len=max_model_len, num_speculative_tokens=t,
                       vocab_size=pair.target.cfg.vocab_size,
                       eos_ids=frozenset(eos_ids(pair.target, pair.tokenizer)), api_key=FLAGS.api_key)
    application = create_app(worker, pair.tokenizer, cfg, on_startup=worker.start, on_shutdown=worker.stop)
    log.info("serving %s on http://%s:%d (max_num_seqs %d, max_model_len %d)", names[0], FLAGS.host, FLAGS.port,
             FLAGS.max_num_seqs, max_model_len)
    uvicorn.run(application, host=FLAGS.host, port=FLAGS.port, log_level="info")


if __name__ == "__main__":
    app.run(main)
