"""Choose a reduced draft vocabulary from the target's cached answers (dspark_jax/train/vocab.py).

    python -m train.vocab --data runs/demo/regen.jsonl --vocab_size 49152 --coverage 0.995 \
        --out runs/demo/vocab.json [--heldout 0.1] [--always 2,0] [--min_size 8192]

Reports K (= the draft's `draft_vocab_size`) and the coverage of answer tokens on the training
rows and on the held-out rows (split by a hash of the row id). `--data` takes several caches,
comma-separated. The output lists the kept target ids ascending (the order of the d2t/t2d map).
"""

from __future__ import annotations

from absl import app, flags

from dspark_jax.data.answer_cache import read_cache
from dspark_jax.train.vocab import choose_from_rows, write_choice

FLAGS = flags.FLAGS
flags.DEFINE_string("data", None, "regen cache(s) (JSONL with answer_ids), comma-separated", required=True)
flags.DEFINE_integer("vocab_size", None, "the target's vocab_size", required=True)
flags.DEFINE_float("coverage", 0.995, "fraction of training answer tokens the kept set must cover")
flags.DEFINE_float("heldout", 0.1, "fraction of rows (by id hash) held out for the coverage report")
flags.DEFINE_list("always", [], "target ids always kept (eos, end of turn)")
flags.DEFINE_integer("min_size", 1, "keep at least this many ids: past the coverage set, the next most frequent "
                     "answer tokens, then (never seen in the answers) the smallest ids, which a BPE vocabulary "
                     "gives its earliest, most common merges", lower_bound=1)
flags.DEFINE_string("out", None, "vocab.json to write", required=True)


def main(argv):
    del argv
    rows = [r for path in FLAGS.data.split(",") for r in read_cache(path)]
    if not rows:
        raise app.UsageError(f"--data {FLAGS.data}: no rows")
    choice = choose_from_rows(rows, FLAGS.vocab_size, FLAGS.coverage, heldout_fraction=FLAGS.heldout,
                              always=[int(i) for i in FLAGS.always], min_size=FLAGS.min_size)
    write_choice(choice, FLAGS.out)
    held = "n/a" if choice.heldout_coverage is None else f"{choice.heldout_coverage:.4%}"
    print(f"K = {choice.k} of {choice.vocab_size} ({choice.k / choice.vocab_size:.1%}); coverage: train "
          f"{choice.train_coverage:.4%} of {choice.train_tokens} tokens, held-out {held} of "
          f"{choice.heldout_tokens} tokens -> {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
