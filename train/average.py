"""Average a run's exported drafts (dspark_jax/checkpoint/average.py).

    python -m train.average --drafts 'runs/demo/distill-v6/export/step_*' --last 5 --out runs/demo/v6-avg

`--drafts` takes directories and globs, comma-separated (a glob's matches sorted by name, which
orders `step_NNNNNNN` exports by step); `--last N` keeps the last N of them. Keep the exports to
average with `train.distill --keep_exports N`. `--draft_vocab vocab.json` (a `train.vocab` file)
first moves every draft to that vocabulary, so drafts with different maps average (for example a
shipped 8,192-id draft with a run trained at 16,384 ids):

    python -m train.average --drafts runs/demo/s26k16-last5,dspark_jax/drafts/smollm2-135m-dspark \
        --draft_vocab runs/demo/vocab-s22-16384.json --out runs/demo/s26k16-soup
"""

from __future__ import annotations

import time
from pathlib import Path

from absl import app, flags

from dspark_jax.checkpoint.average import average_torch_drafts
from dspark_jax.train.vocab import read_choice
from train.paths import expand

FLAGS = flags.FLAGS
flags.DEFINE_string("drafts", None, "torch-layout draft directories and globs, comma-separated", required=True)
flags.DEFINE_integer("last", None, "average only the last N of them", lower_bound=1)
flags.DEFINE_string("out", None, "directory to write (must not exist, or be empty)", required=True)
flags.DEFINE_string("draft_vocab", None, "a vocabulary file (train.vocab): move every draft to it first "
                    "(Markov output rows of the ids a draft holds, zero rows for the ids it lacks)")


def main(argv):
    del argv
    paths = expand(FLAGS.drafts, flag="drafts", what="draft directory", exists=Path.is_dir)
    if FLAGS.last is not None:
        paths = paths[-FLAGS.last:]
    if not paths:
        raise app.UsageError("--drafts: no drafts")
    kept = None
    if FLAGS.draft_vocab:
        try:
            kept = read_choice(FLAGS.draft_vocab)
        except (OSError, ValueError) as e:
            raise app.UsageError(f"--draft_vocab {FLAGS.draft_vocab}: {e}") from None
    t0 = time.time()
    average_torch_drafts(paths, FLAGS.out, draft_vocab=kept,
                         log=lambda m: print(f"[average {time.time() - t0:6.1f}s] {m}", flush=True))


if __name__ == "__main__":
    app.run(main)
