"""OpenAI-compatible server: `python -m serve.server --model DIR --draft_model DIR --port 8000`.

Flags mirror ATOM's (`--num_speculative_tokens`, `--kv_cache_dtype`, `--tp`, `--max_model_len`,
`--max_num_seqs`, `--block_size`). Endpoints: /v1/chat/completions, /v1/completions (SSE with
"stream": true), /v1/models, /health, /debug/mtp_stats, /metrics. Omitted model flags serve the
demo pair.

If the engine thread dies of an error, every request it held fails (500), /health answers 503 and
the process exits with status 1 for its supervisor to restart it (the loop is not restarted in
place: the caches and compiled state it left are not trusted). SIGTERM / Ctrl-C stop accepting,
let running requests finish for up to --shutdown_timeout seconds, then exit 0.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import sys

from absl import app, flags

from dspark_jax import distributed
from dspark_jax.decode import config as engine_config
from dspark_jax.serving import pair_flags

FLAGS = flags.FLAGS
pair_flags.define_flags()       # --model, --draft_model, --dtype, --tp
engine_config.define_flags()    # --num_speculative_tokens, --kv_cache_dtype, --block_size, --max_num_seqs, ...
flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0 exposes the server to the network).")
flags.DEFINE_integer("port", 8000, "TCP port.", lower_bound=0)
API_KEY_ENV = "DSPARK_API_KEY"
flags.DEFINE_string("api_key", None, "If set, /v1 requests need 'Authorization: Bearer <key>' (default: "
                    f"${API_KEY_ENV}, which keeps the key out of the process list).")
flags.DEFINE_bool("metrics_auth", True, "With an API key, /metrics and /debug/mtp_stats need it too.")
flags.DEFINE_list("allowed_hosts", None, "Host header names accepted ('*': any; default: localhost, 127.0.0.1 "
                  "and ::1 when --host is a loopback address, else any), against DNS rebinding.")
flags.DEFINE_list("allowed_origins", [], "Browser origins allowed to call the server (CORS), e.g. "
                  "http://localhost:3000; '*': any. Default none: a request with an Origin header gets 403.")
flags.DEFINE_bool("allow_special_tokens", False, "Special-token text in a /v1/completions prompt string becomes "
                  "control tokens (else it is text; chat content is always text; token-id prompts pass as given).")
flags.DEFINE_float("request_timeout", None, "Seconds a request may take from arrival to its last token "
                   "(queueing included); past it: 504 and its slot is freed. Default: no limit.", lower_bound=0.001)
flags.DEFINE_float("body_timeout", 60.0, "Seconds to receive a request body; past it: 408.", lower_bound=0.001)
flags.DEFINE_float("step_hang_timeout", 600.0, "/health answers 503 while one engine step has run longer than this "
                   "many seconds (a hung device or collective), for a supervisor to restart the server.",
                   lower_bound=0.001)
flags.DEFINE_integer("timeout_keep_alive", 5, "Seconds an idle keep-alive connection stays open.", lower_bound=1)
flags.DEFINE_integer("shutdown_timeout", 30, "On SIGTERM, seconds running requests may take to finish before "
                     "they are cut.", lower_bound=0)
flags.DEFINE_integer("max_request_bytes", 8 * 1024 * 1024,
                     "Largest request body accepted, in bytes (default 8 MiB); a larger one gets HTTP 413 "
                     "before it is read.", lower_bound=1)
flags.DEFINE_string("served_model_name", None, "Model id in /v1/models and responses (default: --model's name).")
flags.DEFINE_integer("max_queue_len", 256, "Requests allowed to wait for a slot; beyond it: HTTP 503.",
                     lower_bound=1)
flags.DEFINE_float("stats_interval", 10.0, "Seconds between [MTP Stats] log lines.", lower_bound=0.1)
flags.DEFINE_integer("seed", 0, "Sampling seed of the engine (requests with temperature > 0).")
flags.DEFINE_bool("warmup", True, "Compile the programs requests can meet (prefill: batch x chunk buckets; "
                  "steps: batch buckets x speculation lengths; greedy and sampling: one program serves every "
                  "temperature and top_p) before accepting requests.")
flags.DEFINE_integer("warmup_max_programs", 64, "Compile at most this many programs at warm-up, the cheapest "
                     "shapes first (the rest compile on first use, once per compilation cache; the demo pair's "
                     "list at the defaults is 58); unset: all.",
                     lower_bound=0)
flags.DEFINE_string("compilation_cache_dir", None, "JAX's persistent compilation cache, so a restart compiles "
                    "nothing (default: $DSPARK_COMPILATION_CACHE, else ~/.cache/dspark_jax/xla; 'off' disables).")

log = logging.getLogger("dspark_jax.serving")


def main(argv) -> None:
    del argv
    import uvicorn

    from dspark_jax.decode import warmup
    from dspark_jax.decode.engine import Engine
    from dspark_jax.decode.requests import eos_ids
    from dspark_jax.decode.scheduler import Scheduler
    from dspark_jax.errors import RequestError
    from dspark_jax.serving.app import ServerConfig, create_app
    from dspark_jax.serving.pair import describe
    from dspark_jax.serving.worker import EngineWorker

    api_key = FLAGS.api_key or os.environ.get(API_KEY_ENV) or None

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
    try:
        config, scheduling = engine_config.from_flags()        # checked before any model loads
    except RequestError as e:
        raise app.UsageError(str(e)) from None
    logging.getLogger("dspark_jax").setLevel(logging.INFO)
    warmup.enable_compilation_cache(warmup.compilation_cache_dir(FLAGS.compilation_cache_dir))
    pair = pair_flags.load_pair()
    if pair.tokenizer is None:
        raise app.UsageError(f"{pair.target_name}: no tokenizer found beside the model")
    draft, config = config.for_pair(pair.draft)
    t = config.num_speculative_tokens
    engine = Engine(pair.target, draft, config)
    scheduling = scheduling.replace(max_model_len=scheduling.max_len_for(pair.target))
    max_model_len = scheduling.max_model_len
    for line in describe(pair, config, scheduling, store_dtype=engine.store_dtype, pool=True):
        log.info(line)
    scheduler = Scheduler(engine, scheduling, seed=FLAGS.seed)
    if FLAGS.warmup:
        warmup.warm_up(scheduler, max_programs=FLAGS.warmup_max_programs, sampled=True, progress=warmup.ProgressBar())
        # the adaptive speculation length's step costs, once per host and model (then from disk)
        warmup.measure_step_costs(scheduler, progress=lambda i, n, rows: log.info(
            "measuring step costs: batch bucket %d (%d/%d)", rows, i + 1, n))
    worker = EngineWorker(scheduler, max_queue=FLAGS.max_queue_len, stats_interval=FLAGS.stats_interval)
    names = [FLAGS.served_model_name or pair.target_name]
    cfg = ServerConfig(model_names=names, max_model_len=max_model_len, num_speculative_tokens=t,
                       vocab_size=pair.target.cfg.vocab_size,
                       eos_ids=frozenset(eos_ids(pair.target, pair.tokenizer)), api_key=api_key,
                       max_request_bytes=FLAGS.max_request_bytes, allow_special_tokens=FLAGS.allow_special_tokens,
                       request_timeout=FLAGS.request_timeout, metrics_auth=FLAGS.metrics_auth,
                       allowed_hosts=allowed_hosts(FLAGS.host, FLAGS.allowed_hosts),
                       allowed_origins=tuple(FLAGS.allowed_origins), body_timeout=FLAGS.body_timeout,
                       step_hang_timeout=FLAGS.step_hang_timeout)
    application = create_app(worker, pair.tokenizer, cfg, on_startup=worker.start, on_shutdown=worker.stop)
    log.info("serving %s on http://%s:%d (max_num_seqs %d, max_model_len %d)", names[0], FLAGS.host, FLAGS.port,
             scheduling.max_num_seqs, max_model_len)
    server = uvicorn.Server(uvicorn.Config(application, host=FLAGS.host, port=FLAGS.port, log_level="info",
                                           timeout_keep_alive=FLAGS.timeout_keep_alive,
                                           timeout_graceful_shutdown=FLAGS.shutdown_timeout))

    def fatal(error: BaseException) -> None:      # the engine thread died: stop serving, exit non-zero
        server.should_exit = True
    worker.on_fatal = fatal
    # uvicorn drains on SIGTERM / SIGINT, then re-raises the signal to the handler it found: with
    # these no-op ones the drained server exits 0 (default handlers would end it by the signal)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if worker.error is not None:
        log.error("exiting: the engine failed (%s: %s)", type(worker.error).__name__, worker.error)
        sys.exit(1)


def allowed_hosts(host: str, names: list[str] | None) -> tuple[str, ...] | None:
    """The Host names to accept: the flag's, else the loopback names for a loopback bind (a page
    elsewhere cannot pass itself off as localhost), else any (None)."""
    if names:
        return tuple(names)
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return ("localhost", "127.0.0.1", "::1") if loopback else None


if __name__ == "__main__":
    app.run(main)
