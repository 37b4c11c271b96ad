"""Caches for generation (docs/architecture.md §5.2, §5.3, §5.4).

`PagedPool`: ONE paged pool of attention rows `[rows, num_pages, page_size, width]` addressed
through one block table per sequence. For the kimi family, rows are the target's MLA layers then
the draft's layers, each row 576 wide (`[c_kv | k_pe]`); the draft binds into the target's pages
(same block table, same positions). For the llama family a row holds `[k | v]` of one layer.
Optional fp8 storage (e4m3fn, static scale 1.0: `store = fp8(x / 1.0)`, `load = fp8 * 1.0`).
On CPU, bf16 and fp8 pages are kept as their bit patterns (`bits_storage`): XLA:CPU runs a
scatter into a 16- or 8-bit float array on an f32 copy of the whole array, so every cache write
would convert the whole pool; an unsigned-integer scatter writes just the rows.

`KDAStates`: per KDA layer the conv window and the fp32 SSM state of every sequence. Verify steps
compute one snapshot per forwarded token; after acceptance the sequence keeps snapshot n, so
rejecting drafts is an index choice, never a recomputation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FP8 = jnp.float8_e4m3fn
FP8_SCALE = 1.0   # ATOM's static per-tensor scale (docs/architecture.md §5.4)


# the unsigned integers that hold a narrow float's bit pattern, and back
_BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16), jnp.dtype(FP8): jnp.dtype(jnp.uint8)}
_VALUES = {bits: value for value, bits in _BITS.items()}


def bits_storage(dtype) -> jnp.dtype:
    """The pool's storage dtype for values of `dtype`: bf16 and fp8 as same-width unsigned integers
    (their bit patterns), anything else as itself."""
    return _BITS.get(jnp.dtype(dtype), jnp.dtype(dtype))


def value_dtype(storage) -> jnp.dtype:
    """The dtype of the values a pool of `storage` dtype holds (inverse of `bits_storage`)."""
    return _VALUES.get(jnp.dtype(storage), jnp.dtype(storage))


def as_values(pages: jax.Array) -> jax.Array:
    """Pages as the values they hold (a bitcast of bit-pattern storage; free)."""
    value = value_dtype(pages.dtype)
    return pages if value == pages.dtype else jax.lax.bitcast_convert_type(pages, value)


def storage_dtype(kv_cache_dtype: str, compute_dtype) -> jnp.dtype:
    if kv_cache_dtype in ("auto", "bf16", "bfloat16", "model"):
        return jnp.dtype(compute_dtype)
    if kv_cache_dtype in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        return jnp.dtype(FP8)
    if kv_cache_dtype in ("fp32", "float32"):
        return jnp.dtype(jnp.float32)
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: expected auto, bf16, fp32 or fp8")


class PagedPool(NamedTuple):
    pages: jax.Array          # [R, P, page_size, W]
    block_table: jax.Array    # [B, max_pages_per_seq] int32, physical page of each logical page

    @property
    def page_size(self) -> int:
        return self.pages.shape[2]

    @property
    def max_len(self) -> int:
        return self.block_table.shape[1] * self.page_size

    @staticmethod
    def create(rows: int, batch: int, max_len: int, page_size: int, width: int, dtype,
               num_pages: int | None = None, block_table: np.ndarray | None = None) -> "PagedPool":
        """A pool with a default block table giving sequence b the pages [b*n, (b+1)*n).
        A scheduler (the server) passes its own table to share/reuse pages."""
        per_seq = -(-max_len // page_size)
        num_pages = num_pages or batch * per_seq
        if block_table is None:
            block_table = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
        if block_table.max() >= num_pages:
            raise ValueError(f"block table addresses page {block_table.max()} of a {num_pages}-page pool")
        return PagedPool(jnp.zeros((rows, num_pages, page_size, width), dtype),
                         jnp.asarray(block_table, jnp.int32))

    def logical_axes(self) -> "PagedPool":
        """Replicated: every position's row may be read by any device's heads."""
        return PagedPool((None,) * 4, (None, None))

    def slots(self, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(physical page, offset) of each (sequence, position)."""
        ps = self.page_size
        logical = jnp.clip(positions_BT // ps, 0, self.block_table.shape[1] - 1)
        page = jnp.take_along_axis(self.block_table, logical, axis=1)
        return page, positions_BT % ps

    def write(self, row: int | jax.Array, positions_BT: jax.Array, values_BTW: jax.Array,
              valid_BT: jax.Array | None = None) -> "PagedPool":
        """Store rows at their positions; invalid tokens (padding) are dropped. Rows narrower than
        the pool (a draft whose latent is narrower than the target's rows) are zero-padded."""
        pad = self.pages.shape[-1] - values_BTW.shape[-1]
        if pad:
            values_BTW = jnp.pad(values_BTW, [(0, 0)] * (values_BTW.ndim - 1) + [(0, pad)])
        page, off = self.slots(positions_BT)
        keep = positions_BT < self.max_len             # never wrap past the table into real rows
        if valid_BT is not None:
            keep = keep & valid_BT
        page = jnp.where(keep, page, self.pages.shape[1])                # out of range -> dropped
        value = value_dtype(self.pages.dtype)
        vals = (values_BTW.astype(jnp.float32) / FP8_SCALE).astype(value) \
            if value == FP8 else values_BTW.astype(value)
        if value != self.pages.dtype:
            vals = jax.lax.bitcast_convert_type(vals, self.pages.dtype)
        pages = self.pages.at[row, page, off].set(vals, mode="drop")
        return self._replace(pages=pages)

    def read(self, row: int | jax.Array, dtype, width: int | None = None) -> jax.Array:
        """Every sequence's rows in logical order: `[B, max_len, width]` (position i at index i).
        One gather of the table's pages of `row` (slicing the row out first would copy it, the
        whole pool's worth of that row on every read); page numbers past the pool (padding rows,
        `engine.rows_table`) read the last page."""
        return self._read_pages(row, jnp.asarray(self.block_table), dtype, width)

    def fold_keys(self, row: int | jax.Array, dtype, width: int, limit: jax.Array, chunk: int, body, init, *,
                  start: int | jax.Array = 0):
        """`body(carry, rows_BCW, start)` over the rows of `row` in chunks of `chunk` positions
        (positions start.. start+chunk-1, in logical order), for the chunks from position `start`
        (a multiple of `chunk`) below `limit` (traced: the positions the longest query reads).
        The loop's trip count follows the data, so one program serves every length where a
        gather of the whole table would cost `max_len`."""
        if chunk % self.page_size:
            raise ValueError(f"key chunk {chunk} is not a multiple of the page size {self.page_size}")
        per = chunk // self.page_size
        table = jnp.asarray(self.block_table)
        pad = -table.shape[1] % per
        if pad:     # page numbers past the pool: read clamped, always masked (beyond max_len)
            table = jnp.pad(table, ((0, 0), (0, pad)), constant_values=self.pages.shape[1])
        trips = (jnp.clip(limit, 0, self.max_len) + chunk - 1) // chunk

        def one(i, carry):
            pages_BP = jax.lax.dynamic_slice_in_dim(table, i * per, per, axis=1)
            return body(carry, self._read_pages(row, pages_BP, dtype, width), i * chunk)

        return jax.lax.fori_loop(start // chunk, trips, one, init)

    def _read_pages(self, row, table_BP, dtype, width):
        pages = jnp.asarray(self.pages)      # a numpy pool (tests) has no .at
        rows = as_values(pages.at[row, table_BP].get(mode="clip"))  # [B, pages, page, W]
        b, n, ps, w = rows.shape
        rows = rows.reshape(b, n * ps, w)[..., :width or w]
        if rows.dtype == FP8:
            return (rows.astype(jnp.float32) * FP8_SCALE).astype(dtype)
        return rows.astype(dtype)


class KDAStates(NamedTuple):
    conv: jax.Array    # [n_kda, B, K-1, 3P] raw pre-conv q|k|v inputs
    ssm: jax.Array     # [n_kda, B, H, K, V] fp32

    @staticmethod
    def create(n_layers: int, batch: int, conv_width: int, kernel: int, heads: int, head_dim: int,
               dtype) -> "KDAStates":
        return KDAStates(jnp.zeros((n_layers, batch, kernel - 1, conv_width), dtype),
                         jnp.zeros((n_layers, batch, heads, head_dim, head_dim), jnp.float32))

    def take(self, slots_B: jax.Array) -> "KDAStates":
        """The states of slots `slots_B` (a slot out of range reads a real slot's state: such a
        padding row must stay inactive)."""
        return KDAStates(jnp.take(self.conv, slots_B, axis=1, mode="clip"),
                         jnp.take(self.ssm, slots_B, axis=1, mode="clip"))

    def put(self, slots_B: jax.Array, rows: "KDAStates") -> "KDAStates":
        """These states with `rows` written into slots `slots_B` (slots out of range are dropped)."""
        return KDAStates(self.conv.at[:, slots_B].set(rows.conv.astype(self.conv.dtype), mode="drop"),
                         self.ssm.at[:, slots_B].set(rows.ssm, mode="drop"))

    def logical_axes(self) -> "KDAStates":
        """Channels / heads on the tensor axis, as the KDA layers' projections are."""
        return KDAStates((None, None, None, "heads"), (None, None, "heads", None, None))


class TargetCaches(NamedTuple):
    """Everything a target's cached forward reads and writes."""
    pool: PagedPool                  # attention rows (target attention layers, then draft layers)
    kda: KDAStates | None            # linear-attention states (kimi family only)

