"""Running a check on eight devices whatever this process was started with."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax


def on_eight_devices(check, module: str) -> None:
    """`check()` here when eight devices are visible, else `module.<check>()` in a subprocess where
    XLA fakes eight CPU devices (`module`: a test module's name, importable from tests/)."""
    if jax.device_count() >= 8:
        check()
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, "tests")
        import {module}; {module}.{check.__name__}()
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
