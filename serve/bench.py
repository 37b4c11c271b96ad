"""The acceptance benchmark: `python -m serve.bench --model DIR --draft_model DIR
--benchmarks gsm8k,humaneval,mtbench,aime26 --aime_file aime2026.jsonl`.

Greedy, concurrency 1, chat template on, official prompt counts unless `--limit`. Prints the card's
table (tok/fwd, acceptance %, prompts) and, with `--reference_draft`, the same-stack ratio table;
writes `--output_json` and the per-position acceptance plot (`--output_png`, default beside the
JSON). Omitted model flags run the demo pair. A full-count run takes hours on a CPU: with
`--journal_dir` it survives interruption (rerun the same command to continue). Multi-host: the
same command on every host with the `dspark_jax.distributed` settings and `--tp` = all devices;
process 0 prints and writes.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from absl import app, flags

from dspark_jax import distributed
from dspark_jax.decode import config as engine_config
from dspark_jax.errors import RequestError
from dspark_jax.serving import pair_flags

FLAGS = flags.FLAGS
pair_flags.define_model()
pair_flags.define_draft_model(help="Draft directory or preset (default: smollm2-135m-dspark); "
                              "'untrained[:CONFIG.json]' for a random draft.")
flags.DEFINE_string("reference_draft", None, "A second draft run on the same prompts: adds the ratio table.")
flags.DEFINE_list("benchmarks", None, "Subset of gsm8k,humaneval,mt_bench (mtbench),aime (aime26); default: all "
                  "four (AIME only when --aime_file is given).")
flags.DEFINE_string("aime_file", None, "AIME JSONL ({id, problem, answer} per line), e.g. aime2026.jsonl.")
flags.DEFINE_integer("limit", None, "First N prompts of each benchmark (default: the official counts).",
                     lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 512, "Tokens generated per turn.", lower_bound=1)
pair_flags.define_dtype()
pair_flags.define_tp()
engine_config.define_flags()    # --num_speculative_tokens, --kv_cache_dtype, --block_size, --max_model_len, ...
flags.DEFINE_integer("max_turns", None, "Turns per conversation at most (MT-Bench first turns: 1; default: all).",
                     lower_bound=1)
flags.DEFINE_string("output_json", None, "Write the results here (JSON).")
flags.DEFINE_string("output_png", None, "Per-position acceptance plot (default: beside --output_json).")
flags.DEFINE_bool("progress", True, "Show a progress bar per benchmark.")
flags.DEFINE_string("journal_dir", None, "Append each finished conversation here (one JSONL per benchmark and "
                    "draft); a rerun with the same settings resumes after them, a larger --limit extends them.")

log = logging.getLogger("dspark_jax.serving")


def main(argv) -> None:
    del argv
    from dspark_jax.data.eval_sets import OFFICIAL_COUNTS
    from dspark_jax.serving import card
    from dspark_jax.serving.pair import describe, fingerprint, load_draft_spec

    distributed.initialize_program()  # multi-host: every process runs this same program
    primary = distributed.is_primary()         # process 0 logs, prints and writes the results
    logging.getLogger("dspark_jax").setLevel(logging.INFO if primary else logging.WARNING)
    progress = FLAGS.progress and primary
    try:
        config, scheduling = engine_config.from_flags()        # checked before any model loads
    except RequestError as e:
        raise app.UsageError(str(e)) from None
    if not config.speculative:
        raise app.UsageError("the benchmark measures a draft: --num_speculative_tokens must be >= 1")
    if FLAGS.benchmarks:
        names = card.resolve_benchmarks(FLAGS.benchmarks)
        if "aime" in names and not FLAGS.aime_file:
            raise app.UsageError("AIME has no registry source: pass --aime_file (e.g. aime2026.jsonl) "
                                 "or drop it from --benchmarks")
    else:
        names = list(card.DEFAULT_BENCHMARKS if FLAGS.aime_file else card.DEFAULT_BENCHMARKS[:3])
        if not FLAGS.aime_file:
            log.warning("AIME 2026 skipped: no --aime_file given (no registry ships AIME)")
    pair = pair_flags.load_pair()
    if pair.draft is None:
        raise app.UsageError("the benchmark measures a draft: --draft_model none is not meaningful here")
    for line in describe(pair, config, scheduling):
        log.info(line)
    items = card.load_items(names, FLAGS.limit, FLAGS.aime_file)
    for n in names:
        official = OFFICIAL_COUNTS[n]
        log.info("%s: %d prompts%s", card.CARD_NAMES[n], len(items[n]),
                 "" if len(items[n]) == official else f" (official count {official})")
    scheduling = scheduling.replace(max_model_len=scheduling.max_len_for(pair.target))
    kw = dict(max_new_tokens=FLAGS.max_new_tokens, max_turns=FLAGS.max_turns)
    # what a journal's items depend on (a rerun with other values is refused)
    recorded = dict(num_speculative_tokens=config.num_speculative_tokens, max_model_len=scheduling.max_model_len,
                    kv_cache_dtype=config.kv_cache_dtype, block_size=config.page_size, **kw)

    def journal(role: str, draft_spec: str, name: str):
        if not FLAGS.journal_dir:
            return None
        settings = {"benchmark": name, "model": pair.target_name, "model_sha": fingerprint(pair.target_name),
                    "draft": draft_spec, "draft_sha": fingerprint(draft_spec), **recorded}
        # process 0 writes; the others (same file system) only read, so they skip the same items
        return card.Journal(Path(FLAGS.journal_dir) / f"{role}-{name}.jsonl", settings, writable=primary)

    runner = card.Runner(pair.target, pair.draft, pair.tokenizer, config, scheduling, **kw)
    results = {n: card.run_benchmark(runner, n, items[n], progress, journal=journal("draft", pair.draft_name, n))
               for n in names}
    reference = None
    if FLAGS.reference_draft:
        ref_draft = load_draft_spec(FLAGS.reference_draft, pair.target, pair.mesh)
        ref_runner = card.Runner(pair.target, ref_draft, pair.tokenizer, config, scheduling, **kw)
        reference = {n: card.run_benchmark(ref_runner, n, items[n], progress,
                                           desc=f"{card.CARD_NAMES[n]} (reference)",
                                           journal=journal("reference", FLAGS.reference_draft, n))
                     for n in names}
    if not primary:
        return

    print(f"\nDSpark acceptance: {pair.target_name} + {pair.draft_name}, temperature 0, concurrency 1, chat template, "
          f"{FLAGS.num_speculative_tokens} speculative tokens, max {FLAGS.max_new_tokens} new tokens\n")
    print(card.card_table(results))
    if reference is not None:
        print(f"\nSame stack, reference draft {FLAGS.reference_draft}:\n")
        print(card.ratio_table(results, reference))
    sys.stdout.flush()
    settings = {"model": pair.target_name, "draft_model": pair.draft_name, "reference_draft": FLAGS.reference_draft,
                "benchmarks": names, "limit": FLAGS.limit, "temperature": 0.0, "concurrency": 1,
                "chat_template": True, **kw}
    png = FLAGS.output_png
    if FLAGS.output_json:
        path = card.write_json(FLAGS.output_json, settings, results, reference)
        log.info("wrote %s", path)
        png = png or str(Path(FLAGS.output_json).with_suffix(".png"))
    if png:
        log.info("wrote %s", card.plot_per_position(results, png, reference))


if __name__ == "__main__":
    app.run(main)
