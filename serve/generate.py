"""One-shot generation: `python -m serve.generate --model DIR --draft_model DIR --prompt "..."`.

Prints the generated text, then the request's `[MTP Stats]` line. Omitted model flags use the demo
pair, SmolLM2-135M-Instruct with the shipped draft `smollm2-135m-dspark` (`make demo` runs this with
no flags). Multi-host: the same command on every host with the
`dspark_jax.distributed` settings and `--tp` = all devices; process 0 prints.
"""

from __future__ import annotations

import logging

from absl import app, flags

from dspark_jax import distributed
from dspark_jax.decode import config as engine_config
from dspark_jax.serving import pair_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("prompt", "Explain in two sentences why the sky is blue.",
                    "The prompt (a user turn when --chat).")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate at most.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples (lossless speculative sampling).", lower_bound=0.0)
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling threshold in (0, 1].")
flags.DEFINE_bool("chat", True, "Render the prompt with the target's chat template.")
flags.DEFINE_list("stop", None, "Stop strings.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
pair_flags.define_flags()       # --model, --draft_model, --dtype, --tp
engine_config.define_flags()    # --num_speculative_tokens, --kv_cache_dtype, --block_size, --max_model_len, ...

log = logging.getLogger("dspark_jax.serving")


def main(argv) -> None:
    del argv
    from dspark_jax.decode.generate import generate
    from dspark_jax.errors import RequestError
    from dspark_jax.serving.pair import describe
    from dspark_jax.serving.worker import format_mtp_stats

    try:
        config, scheduling = engine_config.from_flags()        # checked before any model loads
    except RequestError as e:
        raise app.UsageError(str(e)) from None
    distributed.initialize_program()  # multi-host: every process runs this same program
    primary = distributed.is_primary()         # process 0 logs and prints
    logging.getLogger("dspark_jax").setLevel(logging.INFO if primary else logging.WARNING)
    pair = pair_flags.load_pair()
    for line in describe(pair, config, scheduling):
        log.info(line)
    res = generate(pair.target, pair.draft, [FLAGS.prompt], max_new_tokens=FLAGS.max_new_tokens,
                   temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                   num_speculative_tokens=config.num_speculative_tokens, stop=FLAGS.stop, seed=FLAGS.seed,
                   chat=FLAGS.chat, tokenizer=pair.tokenizer, max_model_len=scheduling.max_model_len,
                   kv_cache_dtype=config.kv_cache_dtype, page_size=config.page_size,
                   speculative_length=scheduling.speculative_length,
                   max_num_batched_tokens=scheduling.max_num_batched_tokens)
    if not primary:
        return
    out = res.outputs[0]
    print(out.text)
    print(format_mtp_stats(out.stats, f"{len(out.token_ids)} tokens, finish reason {out.finish_reason}"))


if __name__ == "__main__":
    app.run(main)
