"""Kimi MoE (`block_sparse_moe`, docs/architecture.md §1.5.5): sigmoid `noaux_tc` router, routed experts (optionally
in a latent width and MXFP4-packed), shared experts.

Routed experts are stored STACKED over experts in the torch layout (`experts.w1.weight [E, I, Din]`,
w1 = gate, w3 = up, w2 = down); the loader maps checkpoint `experts.{e}.w1.*` onto row e. Packed
MXFP4 experts stay packed and are decoded one expert at a time inside the expert loop.

Expert compute is exact and dense per expert: every expert sees every token and is weighted by the
(mostly zero) combine weight; an expert no token picked is skipped at run time. With a "tensor"
mesh axis > 1 that divides E, experts are sharded (EP) and a `shard_map` runs each device's local
experts, then `psum`s the partial outputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dspark_jax.config import KimiConfig
from dspark_jax.layers.linear import Linear
from dspark_jax.layers.mlp import GLUMLP, glu
from dspark_jax.layers.mxfp4 import E2M1_CODE_RMS, mxfp4_dequantize
from dspark_jax.layers.norms import RMSNorm
from dspark_jax.numerics import acc_dtype
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


def combine_matrix(idx_NK: jax.Array, weights_NK: jax.Array, num_experts: int) -> jax.Array:
    """Dense `[N, E]` combine weights (zero where an expert was not chosen)."""
    rows = jnp.arange(idx_NK.shape[0])[:, None]
    return jnp.zeros((idx_NK.shape[0], num_experts), acc_dtype(weights_NK)).at[rows, idx_NK].add(weights_NK)


def _expert_matrix(arrays: tuple[jax.Array, ...], e: jax.Array, dtype) -> jax.Array:
    """Row e of a stacked expert weight, `[out, in]` in `dtype`; MXFP4 is decoded here, per expert."""
    rows = [jax.lax.dynamic_index_in_dim(a, e, axis=0, keepdims=False) for a in arrays]
    return mxfp4_dequantize(*rows, dtype) if len(rows) == 2 else rows[0].astype(dtype)


def expert_mixture(z_ND: jax.Array, combine_NE: jax.Array, w1: tuple[jax.Array, ...],
                   w3: tuple[jax.Array, ...], w2: tuple[jax.Array, ...], *, act: str,
                   beta: float = 4.0, linear_beta: float = 25.0, ep_axis: str | None = None) -> jax.Array:
    """`sum_e combine[:, e] * down_e(act(gate_e(z), up_e(z)))` in fp32 (float64 for float64 `z`),
    one expert at a time.

    `w1`/`w3` (`[E, I, Din]`) and `w2` (`[E, Din, I]`) are `(weight,)` or MXFP4
    `(weight_packed, weight_scale)`; E is the local expert count under EP. Matmuls run in the
    dtype of `z`. Experts with an all-zero combine column are skipped (`lax.cond`), so decode
    steps only touch the experts their tokens picked. `ep_axis`: the shard_map axis the local
    experts are split over, when called inside one.
    """
    dtype = z_ND.dtype
    acc_t = acc_dtype(z_ND)

    def one_expert(e, acc_ND):
        w_N = combine_NE[:, e]

        def run(acc):
            gate_NI = jnp.einsum("nd,id->ni", z_ND, _expert_matrix(w1, e, dtype))
            up_NI = jnp.einsum("nd,id->ni", z_ND, _expert_matrix(w3, e, dtype))
            h_NI = glu(gate_NI, up_NI, act, beta, linear_beta)
            out_ND = jnp.einsum("ni,di->nd", h_NI, _expert_matrix(w2, e, dtype))
            return acc + w_N[:, None].astype(acc_t) * out_ND.astype(acc_t)

        return jax.lax.cond(jnp.any(w_N != 0), run, lambda acc: acc, acc_ND)

    acc = jnp.zeros(z_ND.shape, acc_t)
    if ep_axis is not None:
        # inside shard_map the local experts' outputs vary over the EP axis; the carry must too
        acc = jax.lax.pcast(acc, ep_axis, to="varying")
    return jax.lax.fori_loop(0, combine_NE.shape[1], one_expert, acc)


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

    def routed(self, x_ND: jax.Array) -> jax.Array:
        """Routed-expert output `[N, D]` (in the param dtype) for flat tokens."""
        cfg = self.cfg
        idx_NK, w_NK = route(self.gate(x_ND), self.gate.e_score_correction_bias.get_value(), cfg)
        combine_NE = combine_matrix(idx_NK, w_NK, cfg.num_experts)
        z_ND = self.routed_expert_down_proj(x_ND) if self.latent else x_ND.astype(self.dtype)
        ws = (self.experts.w1.arrays(), self.experts.w3.arrays(), self.experts.w2.arrays())
        mix = functools.partial(expert_mixture, act=cfg.hidden_act, beta=cfg.situ_beta,
                                linear_beta=cfg.situ_linear_beta)
        mesh = _ep_mesh(ws[0][0], cfg.num_experts)
        if mesh is None:
            y_ND = mix(z_ND, combine_NE, *ws)
        else:
            # only "tensor" is manual: a data/fsdp split of the tokens stays with the compiler
            y_ND = jax.shard_map(
                lambda *args: jax.lax.psum(mix(*args, ep_axis=EP_AXIS), EP_AXIS),
                mesh=mesh, in_specs=(P(), P(None, EP_AXIS), *jax.tree.map(lambda _: P(EP_AXIS), ws)),
                out_specs=P(), axis_names={EP_AXIS})(z_ND, combine_NE, *ws)
        y_ND = y_ND.astype(self.dtype)
        if self.latent:
            if cfg.latent_moe_use_norm:
                y_ND = self.routed_expert_norm(y_ND)
            y_ND = self.routed_expert_up_proj(y_ND)
        return y_ND

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        y_ND = self.routed(x_ND)
        if self.cfg.num_shared_experts > 0:
            y_ND = y_ND + self.shared_experts(x_ND)
        return y_ND.reshape(*x_BTD.shape[:-1], y_ND.shape[-1])
