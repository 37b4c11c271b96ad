"""Kimi-family target checkpoint: HF safetensors directory -> Orbax directory (streaming).

    python -m convert.target --src HF_DIR --dst ORBAX_DIR

Tensor by tensor (MXFP4 experts stay packed, stacked per layer), checked against config.json
first, stored in chunks that never cross an 8-way shard, written to a temp dir renamed into place
at the end. CPU only (8 CPU devices hold the shards while they are written). The result loads with
`load_target(ORBAX_DIR)` straight into any mesh's sharding. See dspark_jax/checkpoint/target_io.py.
"""

from __future__ import annotations

import jax
from absl import app, flags, logging

from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.checkpoint.target_io import STORAGE_SHARDS, convert_target
from dspark_jax.config.keys import ConfigError

_SRC = flags.DEFINE_string("src", None, "HF checkpoint directory (config.json + safetensors shards).", required=True)
_DST = flags.DEFINE_string("dst", None, "Output directory (must be absent or empty).", required=True)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.INFO)
    # host memory only: CPU devices to lay the arrays out in their 8-way shards (see target_io)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", STORAGE_SHARDS)
    try:
        convert_target(_SRC.value, _DST.value, progress=logging.info)
    except (CheckpointError, ConfigError) as e:
        logging.error("%s", e)
        raise SystemExit(1) from None
    logging.info("hf->orbax: %s -> %s", _SRC.value, _DST.value)


if __name__ == "__main__":
    app.run(main)
