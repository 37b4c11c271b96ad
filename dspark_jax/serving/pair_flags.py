"""The model-pair flags, declared once for every program: `--model`, `--draft_model`, `--dtype`,
`--tp` (as `engine_config.define_flags()` declares the engine's).

`define_flags()` declares all four with the serving programs' defaults (`serve.generate`,
`serve.server`, `serve.bench`); a program that loads only part of a pair, or keeps other defaults
(benchmarks measured at float32, the training programs' `--target`), declares the parts it needs
with `define_model`, `define_draft_model`, `define_dtype` and `define_tp`. `load_pair()` loads what
the flags name (dspark_jax/serving/pair.py). A program that cannot place a model on several
devices yet declares `--tp` all the same and calls `require_one_device`, so `--tp 2` is refused
rather than ignored.
"""

from __future__ import annotations

from absl import app, flags

from dspark_jax.decode.config import DTYPE_CHOICES, DTYPE_HELP

FLAGS = flags.FLAGS

DRAFT_HELP = ("Draft directory or preset (default: smollm2-135m-dspark); 'none' for plain decoding, "
              "'untrained[:CONFIG.json]' for a random draft.")


def define_model(default: str | None = None, name: str = "model", help: str | None = None) -> flags.FlagHolder:
    return flags.DEFINE_string(name, default, help or "Target: HF-layout or Orbax directory, or a preset"
                               + (" (default: smollm2-135m)." if default is None else "."))


def define_draft_model(default: str | None = None, help: str = DRAFT_HELP) -> flags.FlagHolder:
    return flags.DEFINE_string("draft_model", default, help)


def define_dtype(default: str = "auto", choices=DTYPE_CHOICES, help: str = DTYPE_HELP) -> flags.FlagHolder:
    return flags.DEFINE_enum("dtype", default, list(choices), help)


def define_tp() -> flags.FlagHolder:
    return flags.DEFINE_integer("tp", 1, "Tensor-parallel degree (devices in the mesh).", lower_bound=1)


def define_flags() -> None:
    """--model, --draft_model, --dtype and --tp with the serving programs' defaults."""
    define_model()
    define_draft_model()
    define_dtype()
    define_tp()


def require_one_device(program: str, placement: str = "runs its models on one device") -> None:
    """Refuse --tp > 1 in a program that does not split a model over devices (yet)."""
    if FLAGS.tp != 1:
        raise app.UsageError(f"--tp {FLAGS.tp}: {program} {placement}; tensor parallelism is not supported "
                             "there yet (pass --tp 1)")


def load_pair():
    """The target and draft the flags name (`serving.pair.load_pair`)."""
    from dspark_jax.serving.pair import load_pair as load
    return load(FLAGS.model, FLAGS.draft_model, tp=FLAGS.tp, dtype=FLAGS.dtype)
