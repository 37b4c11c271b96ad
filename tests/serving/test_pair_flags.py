"""The model-pair flags (dspark_jax/serving/pair_flags.py), declared once: the programs that load
a pair share their names and defaults, and a program that keeps a model on one device refuses
`--tp 2` by name instead of ignoring it (the serving programs' --tp is exercised by the tests of
serve.server and serve.bench, the training programs' by tests/train/test_train_mesh.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("program, args", [
    ("train.magpie", ["--out=x.jsonl"]),
    ("benchmarks.acceptance", []),
])
def test_one_device_programs_refuse_tensor_parallelism(program, args):
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-m", program, "--tp=2", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode != 0
    assert f"--tp 2: {program} runs its models on one device; tensor parallelism is not supported" in res.stderr


def test_the_declarations_are_the_programs_flags():
    """Each program's --model / --draft_model / --dtype / --tp come from pair_flags (one text)."""
    for path in ["serve/generate.py", "serve/server.py", "serve/bench.py", "benchmarks/decode_speed.py",
                 "benchmarks/profile_steps.py", "benchmarks/acceptance.py", "benchmarks/peers.py",
                 "benchmarks/regen_batch.py", "train/distill.py", "train/regen.py", "train/teacher.py",
                 "train/magpie.py"]:
        text = (REPO / path).read_text()
        assert "pair_flags.define_" in text, path
        for name in ("model", "draft_model", "dtype", "tp"):
            assert f'flags.DEFINE_string("{name}"' not in text and f'flags.DEFINE_integer("{name}"' not in text \
                and f'flags.DEFINE_enum("{name}"' not in text, f"{path} declares --{name} itself"


def test_require_one_device_refuses_tensor_parallelism_in_process():
    from absl import app, flags
    from absl.testing import flagsaver

    from dspark_jax.serving import pair_flags

    if "tp" not in flags.FLAGS:
        pair_flags.define_tp()
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    with flagsaver.flagsaver(tp=2), pytest.raises(app.UsageError, match="--tp 2: prog runs"):
        pair_flags.require_one_device("prog")
    with flagsaver.flagsaver(tp=1):
        pair_flags.require_one_device("prog")
