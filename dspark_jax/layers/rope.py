"""Rotary position embeddings: plain RoPE and DeepSeek-flavour YaRN (docs/architecture.md §3.4), and
the llama family's scaled variants (`llama_inv_freq_and_scale`: linear, Llama 3, YaRN).

Two pairings of the rotary lanes exist and must not be confused (docs/architecture.md §3.4):
- interleaved / GPT-J (`interleaved=True`): pairs (x[2i], x[2i+1]); DeepSeek MLA and the DSpark
  draft. The output keeps the interleaved layout, so cached `k_pe` rows match ATOM's
  (`is_neox_style=False`).
- half-split / NeoX (`interleaved=False`): pairs (x[i], x[i+R/2]); the Llama target.

The frequency table is a static numpy constant (never a Param, never trained or checkpointed);
angles, cos/sin and the rotation are computed in fp32 and the result is cast back (in float64 for
a float64 input: parity tests under x64, where the float32 table values are used as they are).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from dspark_jax.config.keys import yarn_mscale
from dspark_jax.config.draft import RopeScaling
from dspark_jax.config.llama import LlamaRope
from dspark_jax.numerics import acc_dtype


def _is_yarn(rope: RopeScaling) -> bool:
    return rope.rope_type == "yarn" and rope.factor > 1.0


def _base_frequencies(theta: float, rotary_dim: int) -> np.ndarray:
    """theta ** (2i / R) for i < R/2, in float32 as the torch references compute it."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    return np.power(np.float32(theta), exponents, dtype=np.float32)


def yarn_correction_range(rope: RopeScaling, rotary_dim: int) -> tuple[int, int]:
    """(low, high) rotary-pair indices between which YaRN ramps from original to interpolated
    frequencies: pairs below `low` rotate more than `beta_fast` times over the original context
    (kept), pairs above `high` fewer than `beta_slow` times (fully interpolated)."""

    def dim_for(num_rotations: float) -> float:
        wavelengths = rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return rotary_dim * math.log(wavelengths) / (2 * math.log(rope.rope_theta))

    low = max(math.floor(dim_for(rope.beta_fast)), 0)
    high = min(math.ceil(dim_for(rope.beta_slow)), rotary_dim - 1)
    return low, high


def yarn_inv_freq_and_mscale(rope: RopeScaling, rotary_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rotary_dim // 2] (float32) and the cos/sin multiplier.

    For a non-YaRN `rope` this is plain RoPE with multiplier 1. The multiplier follows DeepSeek /
    vLLM: yarn_mscale(s, mscale) / yarn_mscale(s, mscale_all_dim) (1.0 for the K3 draft; the
    attention temperature then lives entirely in `softmax_scale`).
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    pos_freqs = _base_frequencies(rope.rope_theta, rotary_dim)
    extrapolation = np.float32(1.0) / pos_freqs
    if not _is_yarn(rope):
        return extrapolation, 1.0
    interpolation = np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)
    low, high = yarn_correction_range(rope, rotary_dim)
    span = (high - low) if high != low else 0.001  # degenerate range: a step instead of a ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / np.float32(span), 0, 1)
    keep = (np.float32(1.0) - ramp).astype(np.float32)  # 1 -> original (extrapolated) frequency
    inv_freq = (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)
    attn_factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return inv_freq, float(attn_factor)


def llama_inv_freq_and_scale(rope: LlamaRope, rotary_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rotary_dim // 2] (float32) and cos/sin multiplier of a llama-family
    `rope`, as transformers' modeling_rope_utils computes them in float32: `linear` divides every
    frequency by `factor`; `llama3` divides those whose wavelength exceeds
    original_max_position_embeddings / low_freq_factor, keeps those below .../ high_freq_factor and
    blends in between; `yarn` ramps between the original and the interpolated frequency (the
    draft's YaRN table) and multiplies cos/sin by `attention_factor`."""
    if rope.rope_type == "yarn":
        inv_freq, _ = yarn_inv_freq_and_mscale(RopeScaling(
            rope_type="yarn", rope_theta=rope.rope_theta, factor=rope.factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
            beta_fast=rope.beta_fast, beta_slow=rope.beta_slow), rotary_dim)
        return inv_freq, rope.attention_factor
    inv_freq = np.float32(1.0) / _base_frequencies(rope.rope_theta, rotary_dim)
    factor = np.float32(rope.factor)
    if rope.rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope.rope_type == "llama3":
        context = np.float32(rope.original_max_position_embeddings)
        low, high = np.float32(rope.low_freq_factor), np.float32(rope.high_freq_factor)
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        blended = (np.float32(1) - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= context / high) & (wavelen <= context / low)
        return np.where(medium, blended, scaled).astype(np.float32), 1.0
    if rope.rope_type != "default":
        raise ValueError(f"rope_type {rope.rope_type!r} has no frequency table here")
    return inv_freq, 1.0


def softmax_scale(qk_head_dim: int, rope: RopeScaling | None) -> float:
    """qk_head_dim**-0.5 times YaRN's attention temperature mscale(s, mscale_all_dim)**2
    (0.13086080 for the K3 draft; omitting the mscale² collapses acceptance, docs/architecture.md §3.4)."""
    scale = qk_head_dim ** -0.5
    if rope is not None and rope.rope_type == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


@dataclass(frozen=True, eq=False)
class RotaryEmbedding:
    """A frozen rotary table: plain python, hashable by value, so NNX keeps it in the static graphdef
    (not a Param: nothing to train, shard or checkpoint)."""

    inv_freq: np.ndarray            # [R/2] float32, read-only
    attention_factor: float = 1.0   # cos/sin multiplier (YaRN mscale ratio)
    interleaved: bool = field(kw_only=True)  # True: GPT-J pairs (2i, 2i+1); False: NeoX halves (i, i+R/2)

    def __post_init__(self):
        inv_freq = np.array(self.inv_freq, dtype=np.float32)
        inv_freq.setflags(write=False)
        object.__setattr__(self, "inv_freq", inv_freq)
        object.__setattr__(self, "attention_factor", float(self.attention_factor))
        object.__setattr__(self, "interleaved", bool(self.interleaved))

    @classmethod
    def from_scaling(cls, rope: RopeScaling, rotary_dim: int, *, interleaved: bool) -> "RotaryEmbedding":
        inv_freq, attn_factor = yarn_inv_freq_and_mscale(rope, rotary_dim)
        return cls(inv_freq, attn_factor, interleaved=interleaved)

    @classmethod
    def for_llama(cls, rope: LlamaRope, rotary_dim: int) -> "RotaryEmbedding":
        """The llama family's table (NeoX halves)."""
        inv_freq, attn_factor = llama_inv_freq_and_scale(rope, rotary_dim)
        return cls(inv_freq, attn_factor, interleaved=False)

    @classmethod
    def plain(cls, rotary_dim: int, theta: float, *, interleaved: bool) -> "RotaryEmbedding":
        return cls.from_scaling(RopeScaling(rope_theta=theta), rotary_dim, interleaved=interleaved)

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def _key(self):
        return self.inv_freq.tobytes(), self.attention_factor, self.interleaved

    def __eq__(self, other) -> bool:
        return isinstance(other, RotaryEmbedding) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"RotaryEmbedding(rotary_dim={self.rotary_dim}, attention_factor={self.attention_factor}, "
                f"interleaved={self.interleaved})")

    def cos_sin(self, positions: jnp.ndarray, dtype=jnp.float32) -> tuple[jnp.ndarray, jnp.ndarray]:
        """cos/sin [..., R/2] of the per-pair angles in `dtype` (fp32, or float64), multiplier applied."""
        angles = positions.astype(dtype)[..., None] * jnp.asarray(self.inv_freq).astype(dtype)
        return jnp.cos(angles) * self.attention_factor, jnp.sin(angles) * self.attention_factor

    def __call__(self, x: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
        """Rotate x [..., T, R] or [..., T, N, R] at positions [..., T]."""
        if x.shape[-1] != self.rotary_dim:
            raise ValueError(f"last dim {x.shape[-1]} != rotary_dim {self.rotary_dim}")
        acc = acc_dtype(x)
        cos, sin = self.cos_sin(positions, acc)
        extra = x.ndim - positions.ndim - 1       # 1 when x carries a heads axis
        if extra not in (0, 1):
            raise ValueError(f"x {x.shape} does not match positions {positions.shape}")
        if extra:
            cos, sin = cos[..., None, :], sin[..., None, :]
        xf = x.astype(acc)
        if self.interleaved:
            a, b = xf[..., 0::2], xf[..., 1::2]
            out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(xf.shape)
        else:
            half = self.rotary_dim // 2
            a, b = xf[..., :half], xf[..., half:]
            out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
        return out.astype(x.dtype)
