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
