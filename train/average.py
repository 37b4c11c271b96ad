"""Average a run's exported drafts (dspark_jax/checkpoint/average.py).

    python -m train.average --drafts 'runs/demo/distill-v6/export/step_*' --last 5 --out runs/demo/v6-avg

`--drafts` takes directories and globs, comma-separated (a glob's matches sorted by name, which
orders `step_NNNNNNN` exports by step); `--last N` keeps the last N of them. Keep the exports to
average with `train.distill --keep_exports N`.
"""

from __future__ import annotations

import time
from pathlib import Path

from absl import app, flags

from dspark_jax.checkpoint.average import average_torch_drafts
from train.paths import expand

FLAGS = flags.FLAGS
flags.DEFINE_string("drafts", None, "torch-layout draft directories and globs, comma-separated", required=True)
flags.DEFINE_integer("last", None, "average only the last N of them", lower_bound=1)
flags.DEFINE_string("out", None, "directory to write (must not exist, or be empty)", required=True)


def main(argv):
    del argv
    paths = expand(FLAGS.drafts, flag="drafts", what="draft directory", exists=Path.is_dir)
    if FLAGS.last is not None:
        paths = paths[-FLAGS.last:]
    if not paths:
        raise app.UsageError("--drafts: no drafts")
    t0 = time.time()
    average_torch_drafts(paths, FLAGS.out, log=lambda m: print(f"[average {time.time() - t0:6.1f}s] {m}", flush=True))


if __name__ == "__main__":
    app.run(main)
