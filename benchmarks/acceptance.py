"""Acceptance (tok/fwd) of one or more drafts on held-out prompts, side by side.

    python -m benchmarks.acceptance --drafts smollm2-135m-dspark,untrained
    python -m benchmarks.acceptance --drafts runs/demo/smollm2-135m-dspark,runs/demo/smollm2-135m-dflash-ablation \
        --gsm8k 60 --mt_bench 20 --output_json runs/demo/acceptance.json

temperature 0 by default, chat template on, MT-Bench first turns only. Prompts run in batches through
`generate()`: greedy speculative output equals the target's own greedy output token for token, so
tok/fwd does not depend on the batch size (the server's concurrency-1 figure is the same number; the
`serve.bench` card table measures it that way). `--temperature T` samples instead (rejection
sampling keeps the target's distribution; the draws come from `--seed`, so a run repeats exactly at
the same `--batch_size`), where a draft token is accepted with probability min(1, p/q) rather than
when the argmaxes agree. `untrained` is a random draft of the demo config.
"in draft vocab" is the fraction of the generated tokens a reduced-vocabulary draft could propose
at all (its kept ids; 100 % at full vocabulary): a ceiling on what any training of it accepts.

Is a draft better than another, or is it noise on 20 prompts? Each draft after the first gets its
difference from the first with a paired bootstrap 95 % interval: the prompts resampled with
replacement, the same ones for both drafts, each time the aggregate tok/fwd (accepted drafts over
verify steps, summed over the prompts) of both. At temperature 0 both drafts generate the target's own
tokens, so the pairing leaves only the drafts' difference. `--compare A.json,B.json` does the same
for results written by separate runs (for example one per core), without loading a model:

    python -m benchmarks.acceptance --compare runs/demo/acceptance-v23.json,runs/demo/acceptance-new.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from absl import app, flags

from dspark_jax.decode.stats import paired_difference
from dspark_jax.serving import pair_flags

_MODEL = pair_flags.define_model("smollm2-135m")
_DRAFTS = flags.DEFINE_list("drafts", ["smollm2-135m-dspark", "untrained"],
                            "Drafts: directories, presets, or `untrained[:CONFIG.json]`.")
_GSM8K = flags.DEFINE_integer("gsm8k", 60, "GSM8K test prompts (the first N).", lower_bound=0)
_MT = flags.DEFINE_integer("mt_bench", 20, "MT-Bench first turns (the first N questions).", lower_bound=0)
_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Tokens generated per prompt.", lower_bound=1)
_T = flags.DEFINE_integer("num_speculative_tokens", 7, "Drafts per verify step.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 8, "Prompts per generate() call.", lower_bound=1)
_TEMP = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0: greedy).", lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed (with --temperature > 0).")
_DTYPE = pair_flags.define_dtype("float32", ("float32", "bfloat16"), "Target dtype.")
pair_flags.define_tp()
_JSON = flags.DEFINE_string("output_json", None, "Write the results here.")
_COMPARE = flags.DEFINE_list("compare", None, "Result files (--output_json) to compare, the first as the "
                             "baseline; loads no model.")


def _print_table(results: list[dict], names: list[str]) -> None:
    print("\n| draft | " + " | ".join(f"{n} tok/fwd | {n} in draft vocab" for n in names) + " |")
    print("|---|" + "---|---|" * len(names))
    for row in results:
        print(f"| {row['draft']} | " + " | ".join(f"{row[n]['tok_per_fwd']:.3f} | {row[n]['draft_vocab_coverage']:.1%}"
                                                  for n in names) + " |")
    if len(results) < 2:
        return
    print(f"\n| draft - {results[0]['draft']} | " + " | ".join(f"{n} (paired bootstrap 95 %)" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for row in results[1:]:
        cells = []
        for n in names:
            d, lo, hi = paired_difference(results[0][n], row[n])
            cells.append(f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]")
        print(f"| {row['draft']} | " + " | ".join(cells) + " |")


def _compare(files: list[str]) -> None:
    docs = []
    for f in files:
        try:
            docs.append(json.loads(Path(f).read_text()))
        except (OSError, ValueError) as e:
            raise app.UsageError(f"--compare {f}: {e}") from None
    results = [row for d in docs for row in d["results"]]
    names = [n for n in results[0] if n != "draft" and all(n in r for r in results)]
    for f, d in zip(files, docs):
        for row in d["results"]:
            for n in names:
                if "per_prompt_verify_steps" not in row[n]:
                    raise app.UsageError(f"--compare {f}: {row['draft']} {n} has no per_prompt_verify_steps "
                                         f"(written before the benchmark recorded it); rerun it")
                if row[n]["prompts"] != results[0][n]["prompts"]:
                    raise app.UsageError(f"--compare {f}: {n} has {row[n]['prompts']} prompts, {files[0]} "
                                         f"{results[0][n]['prompts']}")
    settings = {(d["model"], d["max_new_tokens"], d["num_speculative_tokens"], d.get("temperature", 0.0))
                for d in docs}
    if len(settings) > 1:
        raise app.UsageError(f"--compare: the files differ in model, max_new_tokens, drafts or temperature: {settings}")
    _print_table(results, names)


def main(argv):
    del argv
    if _COMPARE.value:
        return _compare(_COMPARE.value)
    pair_flags.require_one_device("benchmarks.acceptance")
    import jax.numpy as jnp
    import numpy as np

    from dspark_jax import load_target
    from dspark_jax.data.eval_sets import load_gsm8k, load_mt_bench
    from dspark_jax.decode.acceptance import measure_acceptance
    from dspark_jax.serving.pair import load_draft_spec

    target = load_target(_MODEL.value, dtype=jnp.dtype(_DTYPE.value))
    sets = {}
    if _GSM8K.value:
        sets["gsm8k"] = [it.conversation() for it in load_gsm8k(limit=_GSM8K.value)]
    if _MT.value:
        sets["mt_bench_turn1"] = [it.conversation() for it in load_mt_bench(limit=_MT.value)]
    results = []
    for spec in _DRAFTS.value:
        draft = load_draft_spec(spec, target)
        # a reduced-vocabulary draft can never propose a token outside its kept ids
        kept = draft.draft_token_ids()
        in_vocab = np.ones(target.cfg.vocab_size, bool)
        if kept is not None:
            in_vocab[:] = False
            in_vocab[np.asarray(kept)] = True
        row = {"draft": spec}
        for name, prompts in sets.items():
            t0 = time.time()

            def progress(done: int, run) -> None:     # after every batch: called inside this loop
                print(f"  {spec} {name}: {done}/{len(prompts)} prompts, tok/fwd so far "
                      f"{run.stats.to_dict()['average_tokens_per_forward']:.3f}", flush=True)
            run = measure_acceptance(target, draft, prompts, max_new_tokens=_NEW.value,
                                     num_speculative_tokens=_T.value, batch_size=_BATCH.value,
                                     temperature=_TEMP.value, seed=_SEED.value, on_batch=progress)
            st = run.stats.to_dict()
            produced = run.generated_tokens
            covered = sum(int(in_vocab[np.asarray(o.token_ids, np.int64)].sum()) for o in run.outputs)
            row[name] = {"prompts": len(prompts), "generated_tokens": produced, "wall_s": time.time() - t0,
                         "num_verify_steps": st["num_verify_steps"], "tok_per_fwd": st["average_tokens_per_forward"],
                         "acceptance_rate": st["acceptance_rate"],
                         "draft_vocab_coverage": covered / produced,
                         "per_position_acceptance": st["per_position_acceptance"],
                         # each prompt's tok/fwd (where the draft fails) and its counts (paired comparisons)
                         "per_prompt_tok_per_fwd": [o.stats["average_tokens_per_forward"] for o in run.outputs],
                         "per_prompt_verify_steps": [o.stats["num_verify_steps"] for o in run.outputs],
                         "per_prompt_accepted": [o.stats["total_accepted_tokens"] for o in run.outputs]}
        results.append(row)
    _print_table(results, list(sets))
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps({"model": _MODEL.value, "max_new_tokens": _NEW.value,
                                                 "num_speculative_tokens": _T.value, "temperature": _TEMP.value,
                                                 "seed": _SEED.value, "results": results}, indent=2))


if __name__ == "__main__":
    app.run(main)
