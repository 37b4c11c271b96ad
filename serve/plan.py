"""Will the target + DSpark draft fit the serving devices? Abstract build + AOT compile, no weights.

    python -m serve.plan --config kimi-k3 --num_devices 8 --max_model_len 16384 --max_num_seqs 8 --kv_cache_dtype fp8

Takes the serving flags of `serve.server` (same names, same defaults, except the page size and
context, ATOM's for Kimi-K3) and compiles the server's own programs for them: the largest prefill
chunk, one-token step and verify step of the server's warm-up list; counts the rest of that list
with an estimate of its compile time, and counts one MoE layer's FLOPs over the prefill chunk.
Prints per weight class the sharding and per-device bytes, the cache bytes and every compiled
program's memory; the last line is `per-device peak: X GiB of C GiB (f usable)`. Exit status 0
if the peak fits `--hbm_gib * --usable_fraction`, 1 if not. Runs on fake CPU devices (set up
here, before JAX starts), so it needs no accelerator. See dspark_jax/plan/serving.py.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

from dspark_jax.decode import config as engine_config
from dspark_jax.plan import serving as plan_lib
from dspark_jax.errors import RequestError

_CONFIG = flags.DEFINE_string("config", "kimi-k3", "Target: a packaged config name, a config.json or a model dir.")
_DRAFT = flags.DEFINE_string("draft_config", "auto",
                             "Draft config (name, file or dir); 'auto': the packaged <config>-dspark if any; 'none'.")
_DEVICES = flags.DEFINE_integer("num_devices", 8, "Devices of the serving mesh (TP = EP = all of them).")
# the serving flags of serve.server, at ATOM's page size and a K3 context (a plan is for a deployment);
# --max_num_batched_tokens (the prefill chunk) keeps the server's default: the plan checks the
# programs a server started with the same flags compiles
engine_config.define_flags(block_size=128, max_model_len=16384)
_HBM = flags.DEFINE_float("hbm_gib", 288.0, "Memory per device in GiB (MI355X: 288).")
_USABLE = flags.DEFINE_float("usable_fraction", 0.93, "Fraction of device memory the plan may use.")
_PROGRAMS = flags.DEFINE_list("programs", list(plan_lib.PROGRAMS),
                              "Programs to compile, the largest of each kind in the server's warm-up list: prefill "
                              "(a prompt chunk), step (one token), verify (T drafts).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        config = engine_config.from_flags()
    except RequestError as e:
        raise app.UsageError(str(e)) from None
    unknown = sorted(set(_PROGRAMS.value) - set(plan_lib.PROGRAMS))
    if unknown:
        raise app.UsageError(f"--programs {','.join(unknown)}: choose from {','.join(plan_lib.PROGRAMS)}")
    plan_lib.configure_cpu_devices(_DEVICES.value)
    logging.set_verbosity(logging.INFO)
    cfg, draft_cfg = plan_lib.load_plan_configs(_CONFIG.value, _DRAFT.value)
    shape = plan_lib.ServingShape(num_devices=_DEVICES.value, engine=config)
    plan = plan_lib.build_plan(cfg, draft_cfg, shape, capacity_gib=_HBM.value, usable_fraction=_USABLE.value,
                               programs=_PROGRAMS.value, progress=logging.info)
    print("\n".join(plan_lib.format_plan(plan, plan_lib.plan_title(cfg, draft_cfg, _CONFIG.value))), flush=True)
    sys.exit(0 if plan.fits else 1)


if __name__ == "__main__":
    app.run(main)
