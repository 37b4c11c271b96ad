"""Routed MoE (dspark_jax/layers/moe.py `expert_mixture`) in float64 (tests/float64.py): equal to a numpy
per-pair sum and to the dense per-expert loop it replaced (`dense_expert_mixture`), with float and
MXFP4 experts, tile sizes that split an expert's rows into full tiles and power-of-two sub-tiles, an
expert no token picked, every token on one expert, a single token, and expert parallelism over 8
fake devices (including devices with no pairs at all). The rows the experts multiply are counted at
run time: they are the routed (token, expert) pairs, not experts x tokens."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.layers import moe as moe_lib
from dspark_jax.layers.moe import MoE, dense_expert_mixture, expert_mixture
from dspark_jax.layers.mxfp4 import mxfp4_dequantize
from tests.device_utils import on_eight_devices
from tests.float64 import assert_close, x64
from tests.moe_utils import MXFP4, k3_cfg, np_situ, randomize

DIN, INTER = 32, 32        # MXFP4 groups are 32 wide: both input widths are one group


def np_ffn(z, gate, up, down, act):
    g, u = gate @ z, up @ z
    h = np_situ(g, u) if act == "situ" else g / (1 + np.exp(-g)) * u
    return down @ h


def np_mixture(z, idx, wts, mats, act, experts=None):
    """sum over pairs of weight * expert(z), for the pairs whose expert is in `experts` (all if None)."""
    y = np.zeros_like(z)
    for n in range(z.shape[0]):
        for e, we in zip(idx[n], wts[n]):
            if experts is None or e in experts:
                y[n] += we * np_ffn(z[n], *(m[e] for m in mats), act)
    return y


def expert_weights(rng, num_experts: int, quantized: bool):
    """(w1, w3, w2) as the layer passes them, and the float64 matrices they stand for."""
    shapes = ((num_experts, INTER, DIN), (num_experts, INTER, DIN), (num_experts, DIN, INTER))
    arrays, mats = [], []
    for shape in shapes:
        if quantized:
            packed = rng.integers(0, 256, (*shape[:2], shape[2] // 2), dtype=np.uint8)
            scale = rng.integers(120, 126, (*shape[:2], shape[2] // 32), dtype=np.uint8)
            arrays.append((jnp.asarray(packed), jnp.asarray(scale)))
            mats.append(np.asarray(mxfp4_dequantize(packed, scale, jnp.float32), np.float64))
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[2])
            arrays.append((jnp.asarray(w),))          # float64 under x64
            mats.append(w)
    return arrays, mats


def routing(rng, n_tok: int, top_k: int, num_experts: int, skip=()):
    """Distinct experts per token, skewed (low ids picked more), never any of `skip`."""
    allowed = np.array([e for e in range(num_experts) if e not in skip])
    p = 1.0 / (1.0 + np.arange(len(allowed)))
    idx = np.stack([rng.choice(allowed, top_k, replace=False, p=p / p.sum()) for _ in range(n_tok)])
    return idx.astype(np.int32), rng.uniform(0.1, 1.0, idx.shape)


@functools.partial(jax.jit, static_argnames=("act", "tile_rows", "dense"))
def mix(z, idx, wts, ws, act, tile_rows=moe_lib.TILE_ROWS, dense=False):
    if dense:
        return dense_expert_mixture(z, idx, wts, *ws, act=act)
    return expert_mixture(z, idx, wts, *ws, act=act, tile_rows=tile_rows)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("tile_rows", [1, 4, 128])
def test_routed_equals_numpy_and_dense(quantized, tile_rows):
    """3 of 8 experts for 24 tokens, expert 5 never picked; tile 4 splits the busy experts into
    full tiles plus 2- and 1-row sub-tiles, tile 1 runs one row at a time."""
    rng = np.random.default_rng(0)
    with x64():
        ws, mats = expert_weights(rng, 8, quantized)
        idx, wts = routing(rng, 24, 3, 8, skip=(5,))
        counts = np.bincount(idx.ravel(), minlength=8)
        assert counts[5] == 0 and counts.max() > 8 and (counts[counts > 0] % 4 != 0).any()
        z = rng.standard_normal((24, DIN))
        for act in ("situ", "silu"):
            want = np_mixture(z, idx, wts, mats, act)
            got = mix(jnp.asarray(z), jnp.asarray(idx), jnp.asarray(wts), ws, act, tile_rows)
            assert got.dtype == jnp.float64 and np.abs(want).max() > 0.1
            assert_close(np.asarray(got), want, f"routed {act} vs numpy")
            dense = mix(jnp.asarray(z), jnp.asarray(idx), jnp.asarray(wts), ws, act, dense=True)
            assert_close(np.asarray(got), np.asarray(dense), f"routed {act} vs dense loop")


@pytest.mark.parametrize("n_tok,top_k,experts", [(37, 1, (6,)), (37, 2, (2, 6)), (1, 3, (0, 4, 7))])
def test_all_tokens_on_the_same_experts(n_tok, top_k, experts):
    """Every token picks the same experts (one expert holding all 37 rows: 4 full 8-row tiles
    and a 5-row rest), and a single decode token."""
    rng = np.random.default_rng(1)
    with x64():
        ws, mats = expert_weights(rng, 8, quantized=True)
        idx = np.tile(np.array(experts, np.int32), (n_tok, 1))
        wts = rng.uniform(0.1, 1.0, idx.shape)
        z = rng.standard_normal((n_tok, DIN))
        got = mix(jnp.asarray(z), jnp.asarray(idx), jnp.asarray(wts), ws, "situ", 8)
        assert_close(np.asarray(got), np_mixture(z, idx, wts, mats, "situ"), "routed vs numpy")


def test_tile_rows_must_be_a_power_of_two():
    z, idx, wts = jnp.zeros((4, DIN)), jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2))
    ws, _ = expert_weights(np.random.default_rng(0), 4, quantized=False)
    with pytest.raises(ValueError, match="tile_rows must be a power of two, got 6"):
        expert_mixture(z, idx, wts, *ws, act="silu", tile_rows=6)


def _count_rows(monkeypatch) -> list[int]:
    """Record, at run time, how many token rows each expert FFN call multiplies."""
    rows: list[int] = []
    ffn = moe_lib._expert_ffn

    def counting(x_RD, *args):
        jax.debug.callback(lambda n: rows.append(int(n)), jnp.int32(x_RD.shape[0]))
        return ffn(x_RD, *args)

    monkeypatch.setattr(moe_lib, "_expert_ffn", counting)
    return rows


@pytest.mark.parametrize("tile_rows", [4, 128])
def test_rows_multiplied_are_the_routed_pairs(monkeypatch, tile_rows):
    """The routed path multiplies each (token, expert) pair's row once and nothing else (no
    padding); the dense loop multiplies every token for every touched expert."""
    rows = _count_rows(monkeypatch)
    rng = np.random.default_rng(2)
    ws, _ = expert_weights(rng, 16, quantized=True)
    idx, wts = routing(rng, 40, 2, 16)
    z = jnp.asarray(rng.standard_normal((40, DIN)), jnp.float32)
    jax.block_until_ready(expert_mixture(z, jnp.asarray(idx), jnp.asarray(wts, jnp.float32), *ws,
                                         act="situ", tile_rows=tile_rows))
    assert sum(rows) == idx.size and max(rows) <= tile_rows
    rows.clear()
    jax.block_until_ready(dense_expert_mixture(z, jnp.asarray(idx), jnp.asarray(wts, jnp.float32), *ws,
                                               act="situ"))
    assert sum(rows) == len(np.unique(idx)) * 40


@nnx.jit(static_argnames="dense_reference")
def apply(module, x, dense_reference=False):
    return module(x, dense_reference=dense_reference)


@pytest.mark.parametrize("quantized", [False, True])
def test_moe_layer_routed_equals_dense(quantized):
    """The whole K3 layer (router, latent projections and norm, shared experts) in float64."""
    with x64():
        over = dict(num_experts=16, num_experts_per_token=4)
        if quantized:
            over["quantization_config"] = MXFP4
        moe = MoE(k3_cfg(**over), dtype=jnp.float64, rngs=nnx.Rngs(0))
        randomize(moe, seed=3, std=0.4)
        x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 11, 32)))
        y, y_dense = apply(moe, x), apply(moe, x, dense_reference=True)
        assert y.dtype == jnp.float64 and np.abs(np.asarray(y_dense)).max() > 1.0
        assert_close(np.asarray(y), np.asarray(y_dense), "routed vs dense MoE layer")


# ------------------------------------------------------------------------------------------------
# expert parallelism over 8 fake devices


def _ep_check():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dspark_jax import sharding

    assert jax.device_count() >= 8
    mesh = sharding.make_mesh(tensor=8)
    with x64():
        # the layer: routed EP (2 experts per device) == the single-device dense reference
        for quantized in (False, True):
            over = dict(num_experts=16, num_experts_per_token=4)
            if quantized:
                over["quantization_config"] = MXFP4
            ref = MoE(k3_cfg(**over), dtype=jnp.float64, rngs=nnx.Rngs(0))
            randomize(ref, seed=5, std=0.4)
            x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 9, 32)))
            graphdef, state = nnx.split(ref)
            fwd = jax.jit(lambda st, x, dense: nnx.merge(graphdef, st)(x, dense_reference=dense),
                          static_argnums=2)
            y_ref = np.asarray(fwd(state, x, True))
            sharded = nnx.state(sharding.shard_module(nnx.merge(graphdef, state), mesh))
            assert "shard_map" in str(jax.make_jaxpr(fwd, static_argnums=2)(sharded, x, False))
            assert_close(np.asarray(fwd(sharded, x, False)), y_ref, f"EP routed layer (mxfp4={quantized})")

        # the mixture itself, with whole devices left without pairs
        rng = np.random.default_rng(7)
        ws, mats = expert_weights(rng, 16, quantized=True)
        ep_ws = jax.device_put(ws, NamedSharding(mesh, P("tensor")))
        z = rng.standard_normal((21, DIN))
        run = jax.jit(jax.shard_map(
            lambda z, idx, wts, *ws: jax.lax.psum(
                expert_mixture(z, idx, wts, *ws, act="situ", ep_axis="tensor", tile_rows=4), "tensor"),
            mesh=mesh, in_specs=(P(), P(), P(), *jax.tree.map(lambda _: P("tensor"), ws)), out_specs=P()))
        for name, idx in (("devices 0 and 7 only", np.tile(np.array([0, 1, 15], np.int32), (21, 1))),
                          ("one expert", np.full((21, 1), 9, np.int32)),
                          ("spread", routing(rng, 21, 4, 16)[0])):
            wts = rng.uniform(0.1, 1.0, idx.shape)
            got = run(jnp.asarray(z), jnp.asarray(idx), jnp.asarray(wts), *ep_ws)
            assert_close(np.asarray(got), np_mixture(z, idx, wts, mats, "situ"), f"EP mixture, {name}")


def test_expert_parallel_routed_equals_dense():
    on_eight_devices(_ep_check, "test_moe")


def test_e2m1_codes_decode_to_the_table_values():
    """The bit-built decode gives `E2M1_VALUES` bit for bit (negative zero included)."""
    from dspark_jax.layers.mxfp4 import E2M1_VALUES, e2m1_to_f32

    got = np.asarray(e2m1_to_f32(jnp.arange(16, dtype=jnp.int32)))
    np.testing.assert_array_equal(got.view(np.uint32), E2M1_VALUES.view(np.uint32))
