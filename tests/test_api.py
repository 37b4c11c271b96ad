"""The library entry points' `dtype` argument: "auto" (the default), "checkpoint", a dtype name."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest

from dspark_jax import api, load_draft, numerics
from dspark_jax.hostinfo import describe_cpu
from dspark_jax.serving.pair import resolve_dtype as flag_dtype
from tests.serve_utils import write_tiny_draft


def _auto_is_bf16() -> bool:
    return not numerics.on_cpu() or numerics.native_bf16_gemm()


def test_auto_is_bfloat16_exactly_where_it_runs_fast():
    chosen, why = api.auto_dtype()
    if _auto_is_bf16():
        assert chosen == jnp.bfloat16 and why.startswith("bfloat16")
    else:
        assert chosen is None and "checkpoint" in why
    if numerics.on_cpu():
        assert describe_cpu() in why          # the log names the CPU it decided for


def test_dtype_names(caplog):
    assert api.resolve_dtype("checkpoint") is None and api.resolve_dtype(None) is None
    assert api.resolve_dtype("float32") == jnp.float32 and api.resolve_dtype(jnp.bfloat16) == jnp.bfloat16
    with caplog.at_level(logging.INFO, logger="dspark_jax"):
        api.resolve_dtype("auto", "target dtype")
    assert any(r.getMessage().startswith("target dtype auto -> ") for r in caplog.records)
    with pytest.raises(ValueError, match="'float33'"):
        api.resolve_dtype("float33")
    with pytest.raises(ValueError, match="--dtype 'half'"):
        flag_dtype("half")
    assert flag_dtype("auto") == api.auto_dtype()[0]


def test_load_draft_defaults_to_auto(tmp_path):
    """A float32 checkpoint loads as bfloat16 under auto where bf16 runs fast, as stored elsewhere;
    "checkpoint" keeps float32 everywhere."""
    path = write_tiny_draft(tmp_path / "draft")
    default = load_draft(path).context_proj.weight.get_value().dtype
    assert default == (jnp.bfloat16 if _auto_is_bf16() else jnp.float32)
    assert load_draft(path, dtype="checkpoint").context_proj.weight.get_value().dtype == jnp.float32


def test_a_cpu_model_without_a_number_is_told_apart_by_family_and_model():
    """Virtual machines often report "AMD EPYC" for parts of different generations: the step-cost
    tables are keyed by this description, so it carries the family and model numbers there."""
    from dspark_jax.hostinfo import parse_cpuinfo

    guest = "processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 26\nmodel\t\t: 2\nflags\t\t: fpu avx512_bf16 avx2\n"
    assert parse_cpuinfo(guest) == ("AMD EPYC (family 26, model 2)", ("avx512_bf16",))
    assert parse_cpuinfo(guest.replace(": 26", ": 25"))[0] == "AMD EPYC (family 25, model 2)"
    named = "model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\ncpu family\t: 6\nmodel\t\t: 143\n" \
            "flags\t\t: amx_tile amx_bf16 avx512_bf16\n"
    assert parse_cpuinfo(named) == ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", ("avx512_bf16", "amx_bf16",
                                                                                      "amx_tile"))
    assert parse_cpuinfo("") == ("unknown CPU", ())


def test_read_bandwidth_probe_is_in_gb_per_s():
    """The probe sums an array and reports GB/s: any real memory system lies between 0.1 and 10,000
    (a bytes/s or MB/s slip lands outside); one thread and two both run."""
    from dspark_jax.hostinfo import read_bandwidth_gb_s

    for threads in (1, 2):
        assert 0.1 < read_bandwidth_gb_s(8 << 20, threads=threads, repeats=2) < 10_000
