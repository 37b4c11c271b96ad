"""DSpark draft checkpoint: torch layout (config.json + model.safetensors) <-> Orbax layout.

    python -m convert.draft --src DIR --dst DIR [--check]

The direction follows from --src (a model.safetensors dir converts to Orbax, an Orbax dir back to
torch); torch -> Orbax -> torch is byte-identical. See dspark_jax/checkpoint/draft_io.py.
"""

from __future__ import annotations

from absl import app, flags, logging

from dspark_jax.checkpoint.draft_convert import convert_draft
from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.config.keys import ConfigError

_SRC = flags.DEFINE_string("src", None, "Draft directory to read (torch or Orbax layout).", required=True)
_DST = flags.DEFINE_string("dst", None, "Output directory (must be absent or empty).", required=True)
_CHECK = flags.DEFINE_bool("check", False, "Re-read the output and compare every tensor byte for byte.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.INFO)
    try:
        direction = convert_draft(_SRC.value, _DST.value, check=_CHECK.value, progress=logging.info)
    except (CheckpointError, ConfigError) as e:
        logging.error("%s", e)
        raise SystemExit(1) from None
    logging.info("%s: %s -> %s%s", direction, _SRC.value, _DST.value,
                 " (checked: every tensor identical)" if _CHECK.value else "")


if __name__ == "__main__":
    app.run(main)
