"""Kimi MoE (`block_sparse_moe`, docs/architecture.md §1.5.5): sigmoid `noaux_tc` router, routed experts (optionally
in a latent width and MXFP4-packed), shared experts.

Routed experts are stored STACKED over experts in the torch layout (`experts.w1.weight [E, I, Din]`,
w1 = gate, w3 = up, w2 = down); the loader maps checkpoint `experts.{e}.w1.*` onto row e. Packed
MXFP4 experts stay packed and are decoded one expert at a time, only for experts a token picked.

Expert compute is routed (`expert_mixture`): the (token, expert) pairs are sorted by expert and
each touched expert multiplies only its own token rows, so the work is the routed pairs, whatever
the expert count. With a "tensor" mesh axis > 1 that divides E, experts are sharded (EP) and a
`shard_map` runs each device's local experts on the pairs routed to them, then `psum`s the partial
outputs. `dense_expert_mixture` (every touched expert over every token) is the reference.

Memory: one expert's weights are decoded at a time. At Kimi-K3's widths (Din 3584, I 3072) that is
3 x 3072 x 3584 values, 63 MiB in bf16 (126 MiB in float32), beside the [N, Din] float32
accumulator and the N*K sorted pair indices; a grouped GEMM over all 112 local experts of an EP-8
device at once would hold 6.9 GiB of decoded bf16 weights per layer. `jax.lax.ragged_dot` is not
used: besides needing every group's weights decoded at once, JAX lowers it on CPU to a dense product
over all groups (benchmarks/moe_routed.py prints its FLOPs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dspark_jax.config.kimi import KimiConfig
from dspark_jax.layers.linear import Linear
from dspark_jax.layers.mlp import GLUMLP, glu
from dspark_jax.layers.mxfp4 import E2M1_CODE_RMS, mxfp4_planes
from dspark_jax.layers.norms import RMSNorm
from dspark_jax.numerics import acc_dtype, einsum_acc
from dspark_jax.params import param

EP_AXIS = "tensor"


def route(logits_f32: jax.Array, bias: jax.Array, cfg: KimiConfig) -> tuple[jax.Array, jax.Array]:
    """`noaux_tc` routing: `[..., E]` router logits -> (expert ids `[..., K]` int32, combine weights
    `[..., K]` fp32; float64 for float64 logits).

    Selection uses `sigmoid(logits) + bias`; with `num_expert_group > 1` only the `topk_group`
    groups with the largest sum of their top-2 biased scores compete (others masked to -inf, as
    transformers does). The weights are the UNBIASED scores of the chosen experts, renormalised
    (`+1e-20`) if `moe_renormalize`, times `routed_scaling_factor`.
    """
    acc = acc_dtype(logits_f32)
    scores = jax.nn.sigmoid(logits_f32.astype(acc))
    choice = scores + bias.astype(acc)
    n_group, n_exp = cfg.num_expert_group, scores.shape[-1]
    if n_group > 1:
        grouped = choice.reshape(*choice.shape[:-1], n_group, n_exp // n_group)
        group_score = jax.lax.top_k(grouped, min(2, n_exp // n_group))[0].sum(-1)      # [..., G]
        _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
        keep = jnp.any(top_groups[..., None] == jnp.arange(n_group), axis=-2)           # [..., G]
        choice = jnp.where(jnp.repeat(keep, n_exp // n_group, axis=-1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_token)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.moe_renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return idx, weights * cfg.routed_scaling_factor


def _expert_matrices(w1: tuple[jax.Array, ...], w3: tuple[jax.Array, ...], w2: tuple[jax.Array, ...],
                     e: jax.Array, dtype) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Expert e's weights in `dtype`, decoded here (MXFP4), one expert at a time: gate and up
    stacked `[2I, Din]` (one product for both), and down `[Din, I]`. Each is `(W,)`, or for MXFP4
    the decoded planes `(W[:, 0::2], W[:, 1::2])` (layers/mxfp4.py `mxfp4_planes`)."""
    row = lambda a: jax.lax.dynamic_index_in_dim(a, e, axis=0, keepdims=False)
    gate_up = [jnp.concatenate([row(a1), row(a3)], axis=0) for a1, a3 in zip(w1, w3)]
    down = [row(a) for a in w2]
    decode = lambda arrays: mxfp4_planes(*arrays, dtype) if len(arrays) == 2 else (arrays[0].astype(dtype),)
    return decode(gate_up), decode(down)


def _times_transposed(x_RK: jax.Array, w: tuple[jax.Array, ...]) -> jax.Array:
    """`x @ W.T` for a weight from `_expert_matrices` (MXFP4: the even and odd halves of the depth)."""
    if len(w) == 1:
        return jnp.einsum("rk,ok->ro", x_RK, w[0])
    # both halves accumulate in float32 and the sum is rounded once, as one product's would be
    both = einsum_acc("rk,ok->ro", x_RK[:, 0::2], w[0]) + einsum_acc("rk,ok->ro", x_RK[:, 1::2], w[1])
    return both.astype(x_RK.dtype)


def _expert_ffn(x_RD: jax.Array, gate_up: tuple[jax.Array, ...], down: tuple[jax.Array, ...], act: str,
                beta: float, linear_beta: float) -> jax.Array:
    """One expert on some token rows: `down(act(gate(x), up(x)))`, matmuls in the dtype of `x`."""
    gate_up_RJ = _times_transposed(x_RD, gate_up)
    inter = gate_up_RJ.shape[-1] // 2
    h_RI = glu(gate_up_RJ[:, :inter], gate_up_RJ[:, inter:], act, beta, linear_beta)
    return _times_transposed(h_RI, down)


def _local_experts(idx_NK: jax.Array, num_local: int, ep_axis: str | None) -> tuple[jax.Array, jax.Array]:
    """(local expert ids `[N, K]`, whether each pair is this device's): under EP device d holds
    experts `[d * num_local, (d + 1) * num_local)`."""
    offset = 0 if ep_axis is None else jax.lax.axis_index(ep_axis) * num_local
    local_NK = idx_NK - offset
    return local_NK, (local_NK >= 0) & (local_NK < num_local)


def _zeros_acc(z_ND: jax.Array, ep_axis: str | None) -> jax.Array:
    acc = jnp.zeros(z_ND.shape, acc_dtype(z_ND))
    # inside shard_map the local experts' outputs vary over the EP axis; a loop carry must too
    return acc if ep_axis is None else jax.lax.pcast(acc, ep_axis, to="varying")


# Rows of the expert-sorted (token, expert) pairs one tile multiplies at once. An expert's rows go
# in full tiles, then its remainder in power-of-two sub-tiles (one per set bit), so no row is
# padded and the matmul rows equal the routed pairs exactly; the size only trades per-tile
# overhead against matmul efficiency.
TILE_ROWS = 128


def expert_mixture(z_ND: jax.Array, idx_NK: jax.Array, weights_NK: jax.Array, w1: tuple[jax.Array, ...],
                   w3: tuple[jax.Array, ...], w2: tuple[jax.Array, ...], *, act: str, beta: float = 4.0,
                   linear_beta: float = 25.0, ep_axis: str | None = None,
                   tile_rows: int = TILE_ROWS) -> jax.Array:
    """`y[n] = sum_k weights[n, k] * expert_{idx[n, k]}(z[n])` over this device's experts, in fp32
    (float64 for float64 `z`), with work proportional to the routed (token, expert) pairs.

    The pairs are sorted by expert id (stable, so each expert's tokens stay in ascending order);
    a loop over the local experts that got at least one pair decodes that expert's weights once
    (MXFP4 -> the dtype of `z`: one expert in full precision at a time) and runs its rows in
    tiles: gather the token rows, the expert FFN, scale by the router weight, scatter-add back.
    Pairs routed to other devices' experts are sorted past the local ones and never touched; the
    caller's `psum` over `ep_axis` adds the devices' partial sums. Each token's terms are added in
    ascending expert order, as `dense_expert_mixture` adds them.

    `w1`/`w3` (`[E, I, Din]`) and `w2` (`[E, Din, I]`) are `(weight,)` or MXFP4
    `(weight_packed, weight_scale)`; E is the local expert count under EP. `idx_NK` holds global
    expert ids, `weights_NK` the combine weights. `tile_rows`: a power of two.
    """
    if tile_rows < 1 or tile_rows & (tile_rows - 1):
        raise ValueError(f"tile_rows must be a power of two, got {tile_rows}")
    dtype, acc_t = z_ND.dtype, acc_dtype(z_ND)
    num_local, (n_tok, top_k) = w1[0].shape[0], idx_NK.shape
    n_pairs = n_tok * top_k
    tile = min(tile_rows, 1 << (n_pairs.bit_length() - 1))      # a slice never exceeds the pairs
    local_NK, mine_NK = _local_experts(idx_NK, num_local, ep_axis)
    key_P = jnp.where(mine_NK, local_NK, num_local).reshape(-1)   # other devices' pairs sort last
    order_P = jnp.argsort(key_P, stable=True)
    token_P = (order_P // top_k).astype(jnp.int32)
    weight_P = weights_NK.reshape(-1)[order_P]
    count_E = jnp.bincount(key_P, length=num_local + 1)[:num_local].astype(jnp.int32)
    start_E = jnp.cumsum(count_E) - count_E
    touched_E = jnp.nonzero(count_E, size=num_local, fill_value=0)[0]
    n_touched = jnp.count_nonzero(count_E)

    def one_expert(i, acc_ND):
        e = touched_E[i]
        mats = _expert_matrices(w1, w3, w2, e, dtype)
        start, count = start_E[e], count_E[e]

        def rows(acc, r0, size):
            """Pairs [r0, r0 + size) of the sorted order, all routed to expert e."""
            tok_R = jax.lax.dynamic_slice_in_dim(token_P, r0, size)
            w_R = jax.lax.dynamic_slice_in_dim(weight_P, r0, size)
            x_RD = jnp.take(z_ND, tok_R, axis=0, indices_are_sorted=True, unique_indices=True)
            out_RD = _expert_ffn(x_RD, *mats, act, beta, linear_beta)
            return acc.at[tok_R].add(w_R[:, None].astype(acc_t) * out_RD.astype(acc_t),
                                     indices_are_sorted=True, unique_indices=True)

        n_full = count // tile
        acc_ND = jax.lax.fori_loop(0, n_full, lambda j, acc: rows(acc, start + j * tile, tile), acc_ND)
        rest, rest_start = count - n_full * tile, start + n_full * tile
        for bit in reversed(range(tile.bit_length() - 1)):
            size = 1 << bit
            r0 = rest_start + ((rest >> (bit + 1)) << (bit + 1))      # after the larger sub-tiles
            acc_ND = jax.lax.cond((rest & size) > 0, functools.partial(rows, r0=r0, size=size),
                                  lambda acc: acc, acc_ND)
        return acc_ND

    return jax.lax.fori_loop(0, n_touched, one_expert, _zeros_acc(z_ND, ep_axis))


def dense_expert_mixture(z_ND: jax.Array, idx_NK: jax.Array, weights_NK: jax.Array,
                         w1: tuple[jax.Array, ...], w3: tuple[jax.Array, ...], w2: tuple[jax.Array, ...], *,
                         act: str, beta: float = 4.0, linear_beta: float = 25.0,
                         ep_axis: str | None = None) -> jax.Array:
    """The reference `expert_mixture` is tested and benchmarked against (same arguments and
    result): every local expert any token picked runs over ALL N tokens and is weighted by a dense
    `[N, E]` combine matrix (zero where not picked), one expert at a time. Work grows with the
    touched experts times N, not with the routed pairs."""
    dtype, acc_t = z_ND.dtype, acc_dtype(z_ND)
    num_local = w1[0].shape[0]
    local_NK, mine_NK = _local_experts(idx_NK, num_local, ep_axis)
    rows = jnp.arange(idx_NK.shape[0])[:, None]
    combine_NE = jnp.zeros((idx_NK.shape[0], num_local), acc_t).at[
        rows, jnp.where(mine_NK, local_NK, num_local)].add(weights_NK.astype(acc_t), mode="drop")

    def one_expert(e, acc_ND):
        w_N = combine_NE[:, e]

        def run(acc):
            mats = _expert_matrices(w1, w3, w2, e, dtype)
            return acc + w_N[:, None] * _expert_ffn(z_ND, *mats, act, beta, linear_beta).astype(acc_t)

        return jax.lax.cond(jnp.any(w_N != 0), run, lambda acc: acc, acc_ND)

    return jax.lax.fori_loop(0, num_local, one_expert, _zeros_acc(z_ND, ep_axis))


def _ep_mesh(weight: jax.Array, num_experts: int):
    """The mesh to run EP on, or None: the context mesh (`jax.set_mesh`) if any, else the mesh the
    expert weights are placed on; EP needs a "tensor" axis > 1 that divides E (and is not already
    manual, as inside a caller's own shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = getattr(getattr(jax.typeof(weight), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty or EP_AXIS not in mesh.axis_names or EP_AXIS in mesh.manual_axes:
        return None
    n = mesh.shape[EP_AXIS]
    return mesh if n > 1 and num_experts % n == 0 else None


class Router(nnx.Module):
    """`gate.weight [E, D]` and the F32 selection bias `gate.e_score_correction_bias [E]`."""

    def __init__(self, hidden: int, num_experts: int, *, dtype, rngs: nnx.Rngs):
        self.weight = param((num_experts, hidden), dtype, ("experts", "embed"), rngs)
        self.e_score_correction_bias = param((num_experts,), jnp.float32, ("experts",), rngs, init="zeros")

    def __call__(self, x: jax.Array) -> jax.Array:
        """fp32 logits `x.f32 @ W.f32.T` (elementwise-exact on every backend: HIGHEST precision);
        float64 for float64 inputs or weights."""
        w = self.weight.get_value()
        acc = acc_dtype(x, w)
        return jnp.einsum("...d,ed->...e", x.astype(acc), w.astype(acc), precision=jax.lax.Precision.HIGHEST)


class ExpertWeight(nnx.Module):
    """One stacked expert projection `[E, out, in]`: a float `weight`, or MXFP4 `weight_packed`
    `[E, out, in/2]` uint8 + `weight_scale` `[E, out, in/G]` uint8 (E8M0)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int,
                 axes: tuple[str | None, str | None, str | None], *, quantized: bool, group_size: int,
                 dtype, rngs: nnx.Rngs):
        shape = (num_experts, out_features, in_features)
        if quantized:
            self.weight_packed = param((*shape[:2], in_features // 2), jnp.uint8, axes, rngs)
            # random codes times this scale have std ~0.02, like the float init
            self.weight_scale = param((*shape[:2], in_features // group_size), jnp.uint8, axes, rngs,
                                      init="e8m0", scale=0.02 / E2M1_CODE_RMS)
        else:
            self.weight = param(shape, dtype, axes, rngs)

    def arrays(self) -> tuple[jax.Array, ...]:
        if hasattr(self, "weight_packed"):
            return self.weight_packed.get_value(), self.weight_scale.get_value()
        return (self.weight.get_value(),)


class Experts(nnx.Module):
    """Routed experts: w1 = gate, w3 = up (`[E, I, Din]`), w2 = down (`[E, Din, I]`)."""

    def __init__(self, cfg: KimiConfig, *, dtype, rngs: nnx.Rngs):
        n_exp, inter, d_in = cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_expert_in
        in_axis = "latent" if cfg.routed_expert_hidden_size else "embed"
        kw = dict(quantized=cfg.quantization == "mxfp4", group_size=cfg.quant_group_size, dtype=dtype,
                  rngs=rngs)
        self.w1 = ExpertWeight(n_exp, inter, d_in, ("experts", "expert_mlp", in_axis), **kw)
        self.w3 = ExpertWeight(n_exp, inter, d_in, ("experts", "expert_mlp", in_axis), **kw)
        self.w2 = ExpertWeight(n_exp, d_in, inter, ("experts", in_axis, "expert_mlp"), **kw)


class MoE(nnx.Module):
    """The checkpoint's `block_sparse_moe`: `x [B, T, D] -> routed + shared experts [B, T, D]`."""

    def __init__(self, cfg: KimiConfig, *, dtype, rngs: nnx.Rngs):
        d, d_in = cfg.hidden_size, cfg.moe_expert_in
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.gate = Router(d, cfg.num_experts, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        self.latent = cfg.routed_expert_hidden_size is not None
        if self.latent:
            self.routed_expert_down_proj = Linear(d, d_in, axes=("latent", "embed"), dtype=dtype, rngs=rngs)
            self.routed_expert_up_proj = Linear(d_in, d, axes=("embed", "latent"), dtype=dtype, rngs=rngs)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(d_in, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs,
                                                  axis="latent")
        if cfg.num_shared_experts > 0:
            self.shared_experts = GLUMLP(d, cfg.moe_intermediate_size * cfg.num_shared_experts,
                                         act=cfg.hidden_act, situ_beta=cfg.situ_beta,
                                         situ_linear_beta=cfg.situ_linear_beta, dtype=dtype, rngs=rngs)

    def routed(self, x_ND: jax.Array, *, dense_reference: bool = False) -> jax.Array:
        """Routed-expert output `[N, D]` (in the param dtype) for flat tokens. `dense_reference`
        runs `dense_expert_mixture` instead (what tests and benchmarks compare against)."""
        cfg = self.cfg
        idx_NK, w_NK = route(self.gate(x_ND), self.gate.e_score_correction_bias.get_value(), cfg)
        z_ND = self.routed_expert_down_proj(x_ND) if self.latent else x_ND.astype(self.dtype)
        ws = (self.experts.w1.arrays(), self.experts.w3.arrays(), self.experts.w2.arrays())
        mix = functools.partial(dense_expert_mixture if dense_reference else expert_mixture,
                                act=cfg.hidden_act, beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
        mesh = _ep_mesh(ws[0][0], cfg.num_experts)
        if mesh is None:
            y_ND = mix(z_ND, idx_NK, w_NK, *ws)
        else:
            # only "tensor" is manual: a data/fsdp split of the tokens stays with the compiler;
            # every device sees all (token, expert) pairs and keeps those of its own experts
            y_ND = jax.shard_map(
                lambda *args: jax.lax.psum(mix(*args, ep_axis=EP_AXIS), EP_AXIS),
                mesh=mesh, in_specs=(P(), P(), P(), *jax.tree.map(lambda _: P(EP_AXIS), ws)),
                out_specs=P(), axis_names={EP_AXIS})(z_ND, idx_NK, w_NK, *ws)
        y_ND = y_ND.astype(self.dtype)
        if self.latent:
            if cfg.latent_moe_use_norm:
                y_ND = self.routed_expert_norm(y_ND)
            y_ND = self.routed_expert_up_proj(y_ND)
        return y_ND

    def __call__(self, x_BTD: jax.Array, *, dense_reference: bool = False) -> jax.Array:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        y_ND = self.routed(x_ND, dense_reference=dense_reference)
        if self.cfg.num_shared_experts > 0:
            y_ND = y_ND + self.shared_experts(x_ND)
        return y_ND.reshape(*x_BTD.shape[:-1], y_ND.shape[-1])
