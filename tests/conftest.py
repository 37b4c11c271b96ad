"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dspark_jax import presets


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by all xdist workers; the preset's file lock serialises them
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSPARK_CACHE", str(root / "dspark_cache"))
        return presets.resolve_model_path("smollm2-135m")


@pytest.fixture(autouse=True)
def _float64_stays_inside_its_test():
    """Float64 parity tests enable JAX x64 only inside a `with` block (tests/float64.py); a test
    that leaked it would silently change the dtypes of every later test in the worker."""
    import jax

    before = jax.config.jax_enable_x64
    yield
    assert jax.config.jax_enable_x64 == before, "this test changed jax_enable_x64 for the tests after it"
