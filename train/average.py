"""Average a run's exported drafts (dspark_jax/checkpoint/average.py).

    python -m train.average --drafts 'runs/demo/distill-v6/export/step_*' --last 5 --out runs/demo/v6-avg

`--drafts` takes directories and globs, comma-separated (a glob's matches sorted by name, which
orders `step_NNNNNNN` exports by step); `--last N` keeps the last N of them. Keep the exports to
average with `train.distill --keep_exports N`.
"""

from __future__ import annotations

import glob
import time

from absl import app, flags

from dspark_jax.checkpoint.average import average_torch_drafts

FLAGS = flags.FLAGS
flags.DEFINE_string("drafts", None, "torch-layout draft directories and globs, comma-separated", required=True)
flags.DEFINE_integer("last", None, "average only the last N of them", lower_bound=1)
flags.DEFINE_string("out", None, "directory to write (must not exist, or be empty)", required=True)


def _expand(spec: str) -> list[str]:
    out = []
    for part in (x.strip() for x in spec.split(",")):
        if not part:
            continue
        found = sorted(glob.glob(part)) if any(c in part for c in "*?[") else [part]
        if not found:
            raise app.UsageError(f"--drafts: nothing matches {part!r}")
        out += found
    return out


def main(argv):
    del argv
    paths = _expand(FLAGS.drafts)
    if FLAGS.last is not None:
        paths = paths[-FLAGS.last:]
    if not paths:
        raise app.UsageError("--drafts: no drafts")
    t0 = time.time()
    average_torch_drafts(paths, FLAGS.out, log=lambda m: print(f"[average {time.time() - t0:6.1f}s] {m}", flush=True))


if __name__ == "__main__":
    app.run(main)
