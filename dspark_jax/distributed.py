"""Multi-host runs with JAX's own runtime: the same program on every host, one global mesh.

Every process calls `initialize_from_flags_or_env()` before touching devices; afterwards
`jax.devices()` lists the devices of ALL processes and `global_mesh()` (= `sharding.make_mesh`
over them) is the one mesh every jitted step, loader and Orbax restore uses. Each process feeds
the same global batch (or its own slice through `jax.make_array_from_process_local_data`) and
reads only its devices' shards of a checkpoint.

Settings, first found wins: explicit arguments, the absl flags `--coordinator_address`,
`--num_processes`, `--process_id` (defined here, so every entry point importing this module
accepts them), the environment `DSPARK_COORDINATOR`, `DSPARK_NUM_PROCESSES`,
`DSPARK_PROCESS_ID`. One process (the default) is a no-op. On CPU, cross-process collectives
use gloo; on GPUs (ROCm, CUDA) JAX's default (NCCL/RCCL).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import jax
from absl import app, flags
from jax.sharding import Mesh

from dspark_jax import sharding as sharding_lib

ENV_COORDINATOR = "DSPARK_COORDINATOR"
ENV_NUM_PROCESSES = "DSPARK_NUM_PROCESSES"
ENV_PROCESS_ID = "DSPARK_PROCESS_ID"

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, f"host:port of process 0's coordinator (multi-host; env {ENV_COORDINATOR}).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, f"Processes in the run, one per host (env {ENV_NUM_PROCESSES}; default 1).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, f"This process's index, 0..num_processes-1 (env {ENV_PROCESS_ID}).")


class DistributedError(ValueError):
    """Inconsistent multi-host settings; the message names the flag / variable."""


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def _flag(holder: flags.FlagHolder):
    return holder.value if flags.FLAGS.is_parsed() else None


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"${name}={raw!r} is not an integer") from None


def resolve_settings(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, environ: Mapping[str, str] | None = None
                     ) -> DistributedSettings:
    """Arguments, else absl flags, else environment; validated."""
    env = os.environ if environ is None else environ
    pick = lambda *xs: next((x for x in xs if x is not None), None)
    coord = pick(coordinator_address, _flag(_COORDINATOR), env.get(ENV_COORDINATOR) or None)
    n = pick(num_processes, _flag(_NUM_PROCESSES), _env_int(env, ENV_NUM_PROCESSES), 1)
    pid = pick(process_id, _flag(_PROCESS_ID), _env_int(env, ENV_PROCESS_ID), 0)
    if n < 1:
        raise DistributedError(f"--num_processes / ${ENV_NUM_PROCESSES} must be >= 1, got {n}")
    if not 0 <= pid < n:
        raise DistributedError(f"--process_id / ${ENV_PROCESS_ID} = {pid} is not in 0..{n - 1}")
    if n > 1 and not coord:
        raise DistributedError(f"{n} processes need --coordinator_address / ${ENV_COORDINATOR} "
                               "(host:port of process 0)")
    if coord and ":" not in coord:
        raise DistributedError(f"--coordinator_address / ${ENV_COORDINATOR} = {coord!r}: expected host:port")
    return DistributedSettings(coord, n, pid)


def initialize_from_flags_or_env(coordinator_address: str | None = None, num_processes: int | None = None,
                                 process_id: int | None = None) -> DistributedSettings:
    """Join the multi-process run the settings describe (before any device is touched); a no-op
    for a single process. Returns the settings used."""
    settings = resolve_settings(coordinator_address, num_processes, process_id)
    if not settings.multi_process:
        return settings
    # CPU collectives across processes (tests, CPU clusters); GPUs use NCCL/RCCL regardless
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(settings.coordinator_address, settings.num_processes, settings.process_id)
    return settings


def initialize_program() -> DistributedSettings:
    """`initialize_from_flags_or_env` for an absl program: bad settings are a usage error."""
    try:
        return initialize_from_flags_or_env()
    except DistributedError as e:
        raise app.UsageError(str(e)) from None


def global_mesh(tensor: int | None = None, fsdp: int = 1, data: int | None = None) -> Mesh:
    """`sharding.make_mesh` over every process's devices. The device order groups each process's
    devices together, so a "tensor" axis no larger than a host's device count stays inside a host."""
    return sharding_lib.make_mesh(tensor=tensor, fsdp=fsdp, data=data, devices=jax.devices())


def is_primary() -> bool:
    """Process 0: the one that logs, writes metrics and exports."""
    return jax.process_index() == 0
