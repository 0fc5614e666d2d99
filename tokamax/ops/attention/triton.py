"""The "triton" implementation of dot_product_attention: Pallas:Triton kernels.

FlashAttention-2 (arXiv:2307.08691) on the canonical layout, without copies:
q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] (N = K * G), bias and mask
[b, n, t|1, s|1] read in place, per-batch lengths as int32 [B].

Forward (Alg. 1): a program per (query block, batch, query head) streams the
key blocks of its kv head (GQA reads k/v once per query head, never
repeated), keeping the running max m, sum l and output in registers (online
softmax, Sec. 3.1.1), base-2 exponentials with log2(e) folded into the logits.
Saves lse = m + log(l) (f32 [B, N, T]) as the residual.

Backward (Alg. 2), two kernels without atomics:
  dk/dv: a program per (key block, batch, kv head) loops over the G query
    heads of its group and over query blocks, recomputing
    p = exp(logits - lse); dv += p^T do; dp = do v^T; ds = p (dp - D) with
    D = rowsum(do * o); ds *= 1 - tanh^2 under a soft cap; dk += ds^T q.
    It also writes ds into a zeroed f32 dbias [B, N, T, S] when there is a bias
    (reduced to the bias's broadcast shape by XLA).
  dq: a program per (query block, batch, query head): dq += ds k.

Block skipping: for a query block the visible keys lie in [lo, hi) (causal,
window, key lengths); blocks every row sees completely run without the
positional mask ("full"), the few boundary blocks with it (Sec. 3.1.1 of
FlashAttention-2 on causal masking). The backward uses the transposed ranges.
Head dims are padded to a power of two >= 16 inside the kernel (masked loads),
sequence lengths need not be block multiples (masked loads and stores).

Grids are flat; under a causal or right window the heaviest programs of all
heads start first (`grid_position`, HEAVY_FIRST_BAND).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import pydantic
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from tokamax._src import op as op_lib
from tokamax._src import pallas_triton
from tokamax._src.pallas_triton import i32
from tokamax.ops.attention import xla as base

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_HEAD_DIM = 256
# Running-max start: finite, so exp2(m_old - m_new) is never inf - inf.
_M_INIT = -1e30
# Causal/right-window grids of at most HEAVY_FIRST_MAX_WAVES programs per SM
# start the heaviest programs of every (batch, head) first, in bands of
# HEAVY_FIRST_BAND per head (`grid_position`; the "mosaic" module's note at
# its HEAVY_FIRST_BAND has the model and the H200 numbers). None: never.
# 4 rather than the "mosaic" kernels' 8: H200 forward+backward, 2026-12-05,
# GQA B4 T4096 N32 K8 H128 causal 4.810 vs 5.027 ms (every kernel faster),
# B8 T4096 N16 H128 causal 4.959 vs 4.968.
HEAVY_FIRST_BAND = 4
HEAVY_FIRST_MAX_WAVES = 36
# Band 1 when a wave holds at least min(HEAVY_FIRST_BAND, this) programs of
# every (batch, head) in any order (`heavy_first_band`).
BAND_ONE_PER_HEAD = 4
# ... and at most this many programs per SM: no limit beyond
# HEAVY_FIRST_MAX_WAVES (the "mosaic" kernels take 16 from an H200 A/B).
# H200, 2026-12-05 (12:35), causal H128 forward+backward, 36 vs 16: B1
# T16384 N32 19.248 vs 19.174 ms (0.4 %), less than the 1.5 % between the
# identical programs of the B2 T8192 N12 control (3.465 vs 3.517).
BAND_ONE_MAX_WAVES = HEAVY_FIRST_MAX_WAVES
# SMs the grid rules plan for; None: the target GPU's (132 on an H100/H200
# SXM, 114 on an H100 PCIe; `pallas_triton.num_sms`). Tests set a number.
SMS: int | None = None


def sms() -> int:
  """SMs of the target GPU (or the `SMS` override)."""
  return SMS or pallas_triton.num_sms()

# Forward row parts (config.row_parts = 2): halves of at least this many
# rows, a warpgroup's wgmma tile; smaller (clipped) blocks run one part.
_MIN_PART_ROWS = 64


def heavy_first_band(sp: "Spec", groups: int, blocks: int, band: int | None,
                     max_waves: int, per_head: int, one_max_waves: int) -> int:
  """Programs per (batch, head) in a band of `grid_position` for a grid of
  `groups` (batch, head) pairs of `blocks` programs: `band` for causal or
  right-window grids of at most `max_waves` programs per SM (an unequal
  grid whose tail matters), else `blocks` ((batch, head) order). With at
  most sms() / min(band, per_head) heads, 1: a wave then holds that
  many programs of every head in any order, so the strict heaviest-first
  order keeps the L2 sharing (list-scheduling model, B1 T4096 N16 causal:
  tail 1.7 % against 8.7 % with bands of 8). H200, 2026-12-05, against
  (batch, head) order, forward+backward: B1 T4096 N16 H128 causal "mosaic"
  0.488 vs 0.602 ms, "triton" 0.633 vs 0.793; B1 T8192 N8 0.891 vs 1.080,
  1.169 vs 1.446; the GQA dk/dv grid (32 kv heads) 1.659 vs 1.717 ms
  ("mosaic") against bands of 8. Band 1 only up to `one_max_waves` programs
  per SM: past it the bands' L2 sharing counts for more than the tail
  (see the "mosaic" module's BAND_ONE_MAX_WAVES)."""
  n_sms = sms()
  if sp.right is None or band is None or groups * blocks > max_waves * n_sms:
    return blocks
  if groups * min(band, per_head) <= n_sms and groups * blocks <= one_max_waves * n_sms:
    return 1
  return min(band, blocks)


def grid_position(p, bsz: int, heads: int, blocks: int, band: int):
  """(batch, head, rank) of program p of a flat grid of bsz * heads * blocks.
  Programs start in rank bands: ranks [0, band) of every (batch, head) in
  (batch, head) order, then ranks [band, 2 band), ...; with band = blocks,
  plain (batch, head, rank) order. Rank 0 is the heaviest block, so the last
  wave holds light programs (longest-processing-time-first), while `band`
  programs of a head run together and share its tiles in L2."""
  groups = bsz * heads
  start = lax.div(p, jnp.int32(band * groups)) * band
  width = jnp.minimum(jnp.int32(band), blocks - start)
  within = p - start * groups
  g = lax.div(within, width)
  rank = start + lax.rem(within, width)
  return lax.div(g, jnp.int32(heads)), lax.rem(g, jnp.int32(heads)), rank


def _pow2_field(v: int, name: str, lo: int = 16) -> int:
  if not pallas_triton.is_pow2(v) or v < lo:
    raise ValueError(f"{name} must be a power of 2 >= {lo}, got {v}")
  return v


@pydantic.dataclasses.dataclass(frozen=True)
class TritonAttentionConfig:
  """Forward: query rows and key columns per block, warps, pipeline stages,
  and row_parts: 1, or 2 halves of block_q rows per program whose q.k^T
  products and softmaxes interleave (`_fwd_kernel`; a block clipped below
  2 x 64 rows runs as one part)."""

  block_q: pydantic.PositiveInt = 128
  block_k: pydantic.PositiveInt = 64
  num_warps: pydantic.PositiveInt = 4
  num_stages: pydantic.PositiveInt = 2
  row_parts: Literal[1, 2] = 1

  @pydantic.field_validator("block_q", "block_k")
  @classmethod
  def _blocks(cls, v, info):
    return _pow2_field(v, info.field_name)

  @pydantic.field_validator("num_warps")
  @classmethod
  def _warps(cls, v):
    if not pallas_triton.is_pow2(v) or v > 16:
      raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {v}")
    return v


@pydantic.dataclasses.dataclass(frozen=True)
class TritonAttentionVjpConfig:
  """Backward blocks: dk/dv kernel (key block per program, query block per
  step) and dq kernel (query block per program, key block per step)."""

  block_k: pydantic.PositiveInt = 64
  block_q: pydantic.PositiveInt = 64
  dq_block_q: pydantic.PositiveInt = 64
  dq_block_k: pydantic.PositiveInt = 64
  num_warps: pydantic.PositiveInt = 4
  num_stages: pydantic.PositiveInt = 2

  @pydantic.field_validator("block_k", "block_q", "dq_block_q", "dq_block_k")
  @classmethod
  def _blocks(cls, v, info):
    return _pow2_field(v, info.field_name)

  @pydantic.field_validator("num_warps")
  @classmethod
  def _warps(cls, v):
    if not pallas_triton.is_pow2(v) or v > 16:
      raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {v}")
    return v


# --- static description of a call -------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
  """Everything static a kernel needs (hashable, closed over by kernels)."""

  t: int
  s: int
  h: int
  hv: int
  hp: int  # head dims padded to a power of 2 >= 16
  hvp: int
  groups: int  # G = N // K
  scale: float
  cap: float | None
  causal: bool
  left: int | None  # window sides; causal folded into right
  right: int | None
  bias_dims: tuple[bool, bool, bool, bool] | None  # which of b, n, t, s are full
  mask_dims: tuple[bool, bool, bool, bool] | None
  has_q_len: bool
  has_kv_len: bool
  precision: object

  @classmethod
  def of(cls, args) -> "Spec":
    q, k, v = args["query"], args["key"], args["value"]
    window = args["local_window_size"]
    left, right = window if window is not None else (None, None)
    if args["is_causal"]:
      right = 0 if right is None else min(right, 0)
    dims = lambda x: None if x is None else tuple(d != 1 for d in x.shape)
    prec = args["precision"]
    if q.dtype == jnp.float32 and prec is None:
      prec = lax.Precision.HIGHEST  # f32 inputs get f32 matmuls by default.
    elif q.dtype != jnp.float32:
      prec = None
    return cls(
        t=q.shape[1], s=k.shape[1], h=q.shape[3], hv=v.shape[3],
        hp=max(16, pallas_triton.next_pow2(q.shape[3])),
        hvp=max(16, pallas_triton.next_pow2(v.shape[3])),
        groups=q.shape[2] // k.shape[2], scale=float(args["scale"]),
        cap=args["logits_soft_cap"], causal=args["is_causal"], left=left,
        right=right, bias_dims=dims(args["bias"]), mask_dims=dims(args["mask"]),
        has_q_len=args["query_seq_lengths"] is not None,
        has_kv_len=args["key_value_seq_lengths"] is not None,
        precision=prec,
    )


def _clip_block(block: int, length: int) -> int:
  """A block no larger than the padded length (but >= 16 for tl.dot)."""
  return max(16, min(block, pallas_triton.next_pow2(length)))


# --- in-kernel helpers --------------------------------------------------------


def _cdiv(a, b: int):
  return (a + (b - 1)) // b


def _and(a, b):
  if a is None:
    return b
  if b is None:
    return a
  return a & b


def _lengths(sp: Spec, q_len_ref, kv_len_ref, b):
  """(q_lim, kv_lim): rows >= q_lim and keys >= kv_lim see nothing."""
  q_lim = i32(sp.t)
  kv_lim = i32(sp.s)
  if q_len_ref is not None:
    q_lim = jnp.minimum(q_lim, pltr.load(q_len_ref.at[b]))
  if kv_len_ref is not None:
    kv_lim = jnp.maximum(jnp.minimum(kv_lim, pltr.load(kv_len_ref.at[b])), 0)
  return jnp.maximum(q_lim, 0), kv_lim


def _clamp(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def blocks_seen(start, size: int, other_block: int, lim_self, lim_other,
                 before: int | None, after: int | None, strict: bool):
  """Blocks of the other axis seen by positions [start, start + size).

  Position i of this axis sees j of the other iff i - before <= j <= i +
  after (None: unbounded), i < lim_self and j < lim_other. Returns
  (lo, a, c, hi): blocks [lo, hi) are seen by some position, [a, c) in full
  by every position < lim_self (with `strict`, only if every position of the
  range is < lim_self); [lo, a) and [c, hi) need the positional mask.
  """
  end = jnp.minimum(start + size, lim_self)
  hi_pos = lim_other
  if after is not None:
    hi_pos = jnp.minimum(hi_pos, end + after)
  lo_pos = i32(0)
  if before is not None:
    lo_pos = jnp.maximum(start - before, 0)
  lo = lo_pos // other_block
  hi = jnp.where(
      end > start, jnp.maximum(lo, _cdiv(jnp.maximum(hi_pos, 0), other_block)), lo
  )
  full_lo = lo
  if before is not None:
    full_lo = _cdiv(jnp.maximum(end - 1 - before, 0), other_block)
  full_hi_pos = lim_other
  if after is not None:
    full_hi_pos = jnp.minimum(full_hi_pos, start + after + 1)
  full_hi = jnp.maximum(full_hi_pos, 0) // other_block
  if strict:
    full_hi = jnp.where(start + size <= lim_self, full_hi, 0)
  a = _clamp(full_lo, lo, hi)
  c = _clamp(full_hi, a, hi)
  return lo, a, c, hi


def _key_blocks(sp: Spec, t0, bq: int, bk: int, q_lim, kv_lim):
  """Key blocks for the query rows [t0, t0 + bq) (see blocks_seen).

  Rows >= q_lim do not count (their outputs are zeroed by the caller).
  """
  return blocks_seen(t0, bq, bk, q_lim, kv_lim, sp.left, sp.right, strict=False)


def _query_blocks(sp: Spec, k0, bk: int, bq: int, q_lim, kv_lim):
  """Query blocks that see keys [k0, k0 + bk) (see blocks_seen).

  Full blocks have every row < q_lim and see every key of the block (all of
  them < kv_lim): key j is seen by row i iff j - right <= i <= j + left.
  """
  return blocks_seen(k0, bk, bq, kv_lim, q_lim, sp.right, sp.left, strict=True)


def positional(sp: Spec, r, c, q_lim, kv_lim):
  """Bool visibility by causal/window/lengths of rows r and keys c.

  r and c are broadcastable position arrays: [bq, 1] and [1, bk] for a block
  in query-major orientation, [1, bq] and [bk, 1] in key-major orientation.
  """
  vis = (c < kv_lim) & (r < q_lim)
  if sp.right is not None:
    vis = vis & (c <= r + sp.right)
  if sp.left is not None:
    vis = vis & (c >= r - sp.left)
  return vis


def _load_rows(ref, b, head, r0, n_rows, n_cols, limit, width, masked):
  """Tile [n_rows, n_cols] of ref [B, L, heads, width] at rows r0..."""
  row_ok = (r0 + jnp.arange(n_rows) < limit)[:, None] if masked else None
  col_ok = (jnp.arange(n_cols) < width)[None, :] if n_cols != width else None
  mask = _and(row_ok, col_ok)
  idx = (b, pl.ds(r0, n_rows), head, pl.ds(i32(0), n_cols))
  if mask is None:
    return pltr.load(ref.at[idx])
  return pltr.load(ref.at[idx], mask=mask, other=0.0)


def _store_rows(ref, value, b, head, r0, limit, width):
  n_rows, n_cols = value.shape
  mask = (r0 + jnp.arange(n_rows) < limit)[:, None]
  if n_cols != width:
    mask = mask & (jnp.arange(n_cols) < width)[None, :]
  pltr.store(
      ref.at[b, pl.ds(r0, n_rows), head, pl.ds(i32(0), n_cols)],
      value.astype(ref.dtype), mask=mask,
  )


def _load_ts(ref, dims, b, n, r0, c0, bq: int, bk: int, sp: Spec, other):
  """Block [bq|1, bk|1] of a bias/mask ref [b, n, t|1, s|1]."""
  fb, fn, ft, fs = dims
  mask = None
  if ft:
    rows = pl.ds(r0, bq)
    mask = (r0 + jnp.arange(bq) < sp.t)[:, None]
  else:
    rows = pl.ds(i32(0), 1)
  if fs:
    cols = pl.ds(c0, bk)
    mask = _and(mask, (c0 + jnp.arange(bk) < sp.s)[None, :])
  else:
    cols = pl.ds(i32(0), 1)
  idx = (b if fb else i32(0), n if fn else i32(0), rows, cols)
  if mask is None:
    return pltr.load(ref.at[idx])
  return pltr.load(ref.at[idx], mask=mask, other=other)


def raw_scale(sp: Spec) -> float | None:
  """log2(e) * scale when logits are a plain positive multiple of q.k.

  Then the running max can be taken on q.k itself and exp2(c qk - m) is one
  FMA per element.
  """
  if sp.bias_dims is None and sp.cap is None and sp.scale > 0:
    return sp.scale * LOG2E
  return None


def _logits2(sp: Spec, q, k, bias, key_major=False):
  """(z, c, tanh): base-2 logits are z * c = log2(e) * capped(scale q.k + bias).

  [bq, bk] from q [bq, H], k [bk, H]; key_major: [bk, bq] from k, q (bias is
  given query-major and transposed here). Without bias and cap z is q.k
  itself and c = log2(e) * scale (folded into the exponential's FMA);
  otherwise c = 1. tanh is the soft cap's tanh (or None).
  """
  if key_major:
    qk = pltr.dot(k, q, trans_b=True, precision=sp.precision)
  else:
    qk = pltr.dot(q, k, trans_b=True, precision=sp.precision)
  if bias is None and sp.cap is None:
    return qk, sp.scale * LOG2E, None
  z = qk * sp.scale
  if bias is not None:
    bias = bias.astype(jnp.float32)
    z = z + (bias.T if key_major else bias)
  tanh = None
  if sp.cap is not None:
    tanh = jnp.tanh(z / sp.cap)
    z = sp.cap * tanh
  return z * LOG2E, 1.0, tanh


def _visibility(sp, masked, rows, cols, q_lim, kv_lim, mask_ref, b, n, r0, c0,
                bq, bk, key_major=False):
  """Bool [bq, bk] ([bk, bq] if key_major), or None when all is visible."""
  if key_major:
    r, c = rows[None, :], cols[:, None]
  else:
    r, c = rows[:, None], cols[None, :]
  vis = positional(sp, r, c, q_lim, kv_lim) if masked else None
  if mask_ref is not None:
    m = _load_ts(mask_ref, sp.mask_dims, b, n, r0, c0, bq, bk, sp, 0) != 0
    if key_major:
      m = m.T
    vis = m if vis is None else vis & m
  return vis


def _run_blocks(ranges, body, carry):
  """body(j, carry, masked) over [lo, a) masked, [a, c) full, [c, hi) masked."""
  lo, a, c, hi = ranges
  carry = lax.fori_loop(lo, a, functools.partial(body, masked=True), carry)
  carry = lax.fori_loop(a, c, functools.partial(body, masked=False), carry)
  return lax.fori_loop(c, hi, functools.partial(body, masked=True), carry)


def _split_refs(refs, sp: Spec, names):
  """Kernel refs by name; optional inputs are present only when used."""
  it = iter(refs)
  out = {}
  for name in names:
    present = {
        "bias": sp.bias_dims is not None,
        "mask": sp.mask_dims is not None,
        "q_len": sp.has_q_len,
        "kv_len": sp.has_kv_len,
    }.get(name, True)
    out[name] = next(it) if present else None
  rest = list(it)
  return out, rest


# --- forward -------------------------------------------------------------------


def _fwd_kernel(*refs, sp: Spec, bq: int, bk: int, save_lse: bool, parts: int = 1):
  """FlashAttention-2 forward over the query rows [t0, t0 + bq) of one program.

  With parts = 2 the rows are two halves, each with its own running max, sum
  and accumulator; a step issues both halves' q.k^T products before the
  first half's softmax, so the second product can run under it (the only
  wait Triton places is before a product's first use), and the first half's
  P.V under the second half's softmax.
  """
  r, outs = _split_refs(refs, sp, ("q", "k", "v", "bias", "mask", "q_len", "kv_len"))
  o_ref = outs[0]
  lse_ref = outs[1] if save_lse else None
  i, b, n = _query_program(sp, r["q"], bq)
  kh = n // sp.groups
  t0 = i * bq
  part_rows = bq // parts
  # (t0 itself for the first part: with one part the kernel is op for op the
  # single-block forward verified on the H200.)
  starts = [t0] + [t0 + p_ * part_rows for p_ in range(1, parts)]
  rows_by_part = [r0 + jnp.arange(part_rows) for r0 in starts]
  q_lim, kv_lim = _lengths(sp, r["q_len"], r["kv_len"], b)
  qs = [_load_rows(r["q"], b, n, r0, part_rows, sp.hp, sp.t, sp.h, True) for r0 in starts]

  def body(j, carry, masked):
    k0 = j * bk
    cols = k0 + jnp.arange(bk)
    k = _load_rows(r["k"], b, kh, k0, bk, sp.hp, sp.s, sp.h, masked)
    v = _load_rows(r["v"], b, kh, k0, bk, sp.hvp, sp.s, sp.hv, masked)
    logits = []
    for r0, rows, q in zip(starts, rows_by_part, qs):
      vis = _visibility(sp, masked, rows, cols, q_lim, kv_lim, r["mask"], b, n,
                        r0, k0, part_rows, bk)
      bias = None
      if r["bias"] is not None:
        bias = _load_ts(r["bias"], sp.bias_dims, b, n, r0, k0, part_rows, bk, sp, 0.0)
      # Base-2 logits z * c: with c > 0 the running max is taken on z itself and
      # c folds into the exponential's FMA (one FFMA + ex2 per logit).
      z, c, _ = _logits2(sp, q, k, bias)
      if c <= 0:  # a scale <= 0 without bias or cap
        z, c = z * c, 1.0
      logits.append((z, c, vis))
    new = []
    for (m, l, acc), (z, c, vis) in zip(carry, logits):
      if vis is not None:
        z = jnp.where(vis, z, -jnp.inf)
      z_max = jnp.max(z, axis=1)
      m_new = jnp.maximum(m, z_max * c if c != 1.0 else z_max)
      p = pallas_triton.exp2_fma(z, c, m_new[:, None])
      alpha = jnp.exp2(m - m_new)
      l = l * alpha + jnp.sum(p, axis=1)
      pv = pltr.dot(p.astype(v.dtype), v, precision=sp.precision)
      new.append((m_new, l, acc * alpha[:, None] + pv))
    return tuple(new)

  init = tuple((
      jnp.full((part_rows,), _M_INIT, jnp.float32),
      jnp.zeros((part_rows,), jnp.float32),
      jnp.zeros((part_rows, sp.hvp), jnp.float32),
  ) for _ in range(parts))
  ranges = _key_blocks(sp, t0, bq, bk, q_lim, kv_lim)
  final = _run_blocks(ranges, body, init)
  for r0, rows, (m, l, acc) in zip(starts, rows_by_part, final):
    # Rows that saw no key (l = 0) and rows >= q_lim output 0 with lse = 0.
    ok = (l > 0) & (rows < q_lim)
    out = jnp.where(ok[:, None], acc / jnp.where(ok, l, 1.0)[:, None], 0.0)
    _store_rows(o_ref, out, b, n, r0, sp.t, sp.hv)
    if lse_ref is not None:
      lse = jnp.where(ok, (m + jnp.log2(jnp.where(ok, l, 1.0))) * LN2, 0.0)
      pltr.store(lse_ref.at[b, n, pl.ds(r0, part_rows)], lse, mask=rows < sp.t)


def _flat_grid(sp: Spec, bsz: int, heads: int, blocks: int):
  """(batch, head, rank) of this program on a flat grid of
  bsz * heads * blocks (`grid_position`)."""
  band = heavy_first_band(sp, bsz * heads, blocks, HEAVY_FIRST_BAND,
                          HEAVY_FIRST_MAX_WAVES, BAND_ONE_PER_HEAD,
                          BAND_ONE_MAX_WAVES)
  return grid_position(i32(pl.program_id(0)), bsz, heads, blocks, band)


def _query_program(sp: Spec, q_ref, bq: int):
  """(query block, batch, head) of this program (q_ref [B, T, N, H]); under
  a causal or right window the longest rows (the last) are rank 0."""
  bsz, t, heads, _ = q_ref.shape
  nq = pl.cdiv(t, bq)
  b, n, i = _flat_grid(sp, bsz, heads, nq)
  if sp.right is not None:
    i = nq - 1 - i
  return i, b, n


def _inputs(args):
  q_len, kv_len = args["query_seq_lengths"], args["key_value_seq_lengths"]
  mask = args["mask"]
  return [
      x for x in (
          args["query"], args["key"], args["value"], args["bias"],
          None if mask is None else mask.astype(jnp.int8), q_len, kv_len,
      ) if x is not None
  ]


def attention_forward(args, config: TritonAttentionConfig, return_residuals: bool):
  """(out [B, T, N, Hv], lse [B, N, T] f32 or None) by the forward kernel."""
  sp = Spec.of(args)
  q = args["query"]
  bsz, t, n, _ = q.shape
  bq, bk = _clip_block(config.block_q, t), _clip_block(config.block_k, sp.s)
  out_shape = [jax.ShapeDtypeStruct((bsz, t, n, sp.hv), q.dtype)]
  if return_residuals:
    out_shape.append(jax.ShapeDtypeStruct((bsz, n, t), jnp.float32))
  parts = config.row_parts if bq >= _MIN_PART_ROWS * config.row_parts else 1
  kernel = functools.partial(_fwd_kernel, sp=sp, bq=bq, bk=bk, save_lse=return_residuals,
                             parts=parts)
  outs = pallas_triton.pallas_call(
      kernel, out_shape=out_shape, grid=(bsz * n * pl.cdiv(t, bq),),
      num_warps=config.num_warps, num_stages=config.num_stages,
      name="tokamax_attention_fwd",
  )(*_inputs(args))
  return outs[0], (outs[1] if return_residuals else None)


# --- backward ------------------------------------------------------------------


def _dkdv_kernel(*refs, sp: Spec, bq: int, bk: int, want_dbias: bool):
  names = ("q", "k", "v", "bias", "mask", "q_len", "kv_len", "do", "lse", "delta")
  r, outs = _split_refs(refs, sp, names)
  if want_dbias:
    outs = outs[1:]  # the zeroed dbias input, aliased to the last output
  dk_ref, dv_ref = outs[0], outs[1]
  dbias_ref = outs[2] if want_dbias else None
  bsz, _, kv_heads, _ = r["k"].shape
  # Causal/right window: key block 0 sees the most query rows (rank 0).
  b, kh, j = _flat_grid(sp, bsz, kv_heads, pl.cdiv(sp.s, bk))
  k0 = j * bk
  cols = k0 + jnp.arange(bk)
  q_lim, kv_lim = _lengths(sp, r["q_len"], r["kv_len"], b)
  k = _load_rows(r["k"], b, kh, k0, bk, sp.hp, sp.s, sp.h, True)
  v = _load_rows(r["v"], b, kh, k0, bk, sp.hvp, sp.s, sp.hv, True)
  ranges = _query_blocks(sp, k0, bk, bq, q_lim, kv_lim)

  def head(g, carry):
    n = kh * sp.groups + g

    def body(i, carry, masked):
      dk, dv = carry
      r0 = i * bq
      rows = r0 + jnp.arange(bq)
      q = _load_rows(r["q"], b, n, r0, bq, sp.hp, sp.t, sp.h, masked)
      do = _load_rows(r["do"], b, n, r0, bq, sp.hvp, sp.t, sp.hv, masked)
      stats = (r["lse"].at[b, n, pl.ds(r0, bq)], r["delta"].at[b, n, pl.ds(r0, bq)])
      if masked:
        lse2, delta = (pltr.load(x, mask=rows < sp.t, other=0.0) for x in stats)
      else:
        lse2, delta = (pltr.load(x) for x in stats)
      bias = None
      if r["bias"] is not None:
        bias = _load_ts(r["bias"], sp.bias_dims, b, n, r0, k0, bq, bk, sp, 0.0)
      # Key-major blocks [bk, bq] (p^T, ds^T): the dk and dv products take
      # them as the left operand without a transpose in registers.
      z, c, tanh = _logits2(sp, q, k, bias, key_major=True)
      p = pallas_triton.exp2_fma(z, c, lse2[None, :])
      vis = _visibility(sp, masked, rows, cols, q_lim, kv_lim, r["mask"], b, n,
                        r0, k0, bq, bk, key_major=True)
      if vis is not None:
        p = jnp.where(vis, p, 0.0)
      dv = dv + pltr.dot(p.astype(do.dtype), do, precision=sp.precision)
      dp = pltr.dot(v, do, trans_b=True, precision=sp.precision)
      ds = p * (dp - delta[None, :])
      if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
      if dbias_ref is not None:
        ok = (rows < sp.t)[:, None] & (cols < sp.s)[None, :]
        pltr.store(dbias_ref.at[b, n, pl.ds(r0, bq), pl.ds(k0, bk)], ds.T, mask=ok)
      dk = dk + pltr.dot(ds.astype(q.dtype), q, precision=sp.precision)
      return dk, dv

    return _run_blocks(ranges, body, carry)

  init = (jnp.zeros((bk, sp.hp), jnp.float32), jnp.zeros((bk, sp.hvp), jnp.float32))
  dk, dv = lax.fori_loop(i32(0), i32(sp.groups), head, init)
  _store_rows(dk_ref, dk * sp.scale, b, kh, k0, sp.s, sp.h)
  _store_rows(dv_ref, dv, b, kh, k0, sp.s, sp.hv)


def _dq_kernel(*refs, sp: Spec, bq: int, bk: int):
  names = ("q", "k", "v", "bias", "mask", "q_len", "kv_len", "do", "lse", "delta")
  r, outs = _split_refs(refs, sp, names)
  dq_ref = outs[0]
  i, b, n = _query_program(sp, r["q"], bq)
  kh = n // sp.groups
  t0 = i * bq
  rows = t0 + jnp.arange(bq)
  q_lim, kv_lim = _lengths(sp, r["q_len"], r["kv_len"], b)
  q = _load_rows(r["q"], b, n, t0, bq, sp.hp, sp.t, sp.h, True)
  do = _load_rows(r["do"], b, n, t0, bq, sp.hvp, sp.t, sp.hv, True)
  row_ok = rows < sp.t
  lse2 = pltr.load(r["lse"].at[b, n, pl.ds(t0, bq)], mask=row_ok, other=0.0)
  delta = pltr.load(r["delta"].at[b, n, pl.ds(t0, bq)], mask=row_ok, other=0.0)

  def body(j, dq, masked):
    k0 = j * bk
    cols = k0 + jnp.arange(bk)
    k = _load_rows(r["k"], b, kh, k0, bk, sp.hp, sp.s, sp.h, masked)
    v = _load_rows(r["v"], b, kh, k0, bk, sp.hvp, sp.s, sp.hv, masked)
    bias = None
    if r["bias"] is not None:
      bias = _load_ts(r["bias"], sp.bias_dims, b, n, t0, k0, bq, bk, sp, 0.0)
    z, c, tanh = _logits2(sp, q, k, bias)
    p = pallas_triton.exp2_fma(z, c, lse2[:, None])
    vis = _visibility(sp, masked, rows, cols, q_lim, kv_lim, r["mask"], b, n,
                      t0, k0, bq, bk)
    if vis is not None:
      p = jnp.where(vis, p, 0.0)
    dp = pltr.dot(do, v, trans_b=True, precision=sp.precision)
    ds = p * (dp - delta[:, None])
    if tanh is not None:
      ds = ds * (1.0 - tanh * tanh)
    return dq + pltr.dot(ds.astype(k.dtype), k, precision=sp.precision)

  ranges = _key_blocks(sp, t0, bq, bk, q_lim, kv_lim)
  dq = _run_blocks(ranges, body, jnp.zeros((bq, sp.hp), jnp.float32))
  # Rows >= q_lim were computed against lse = 0 in full blocks: drop them.
  dq = jnp.where((rows < q_lim)[:, None], dq * sp.scale, 0.0)
  _store_rows(dq_ref, dq, b, n, t0, sp.t, sp.h)


def attention_backward(args, residuals, out, dout, config: TritonAttentionVjpConfig,
                       want_dbias: bool = True):
  """Gradients {query, key, value[, bias]} from the forward's lse; the bias's
  only if there is one and `want_dbias`."""
  sp = Spec.of(args)
  want_dbias = want_dbias and sp.bias_dims is not None
  q, k, v = args["query"], args["key"], args["value"]
  bsz, t, n, _ = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  # D = rowsum(dout * out) and lse in base 2, both f32 [B, N, T].
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = jnp.swapaxes(delta, 1, 2)
  lse2 = residuals["lse"].astype(jnp.float32) * LOG2E
  inputs = _inputs(args) + [dout.astype(q.dtype), lse2, delta]

  bk, bq = _clip_block(config.block_k, s), _clip_block(config.block_q, t)
  out_shape = [
      jax.ShapeDtypeStruct(k.shape, k.dtype),
      jax.ShapeDtypeStruct(v.shape, v.dtype),
  ]
  aliases = None
  dkdv_inputs = list(inputs)
  if want_dbias:
    out_shape.append(jax.ShapeDtypeStruct((bsz, n, t, s), jnp.float32))
    dkdv_inputs.append(jnp.zeros((bsz, n, t, s), jnp.float32))
    aliases = {len(dkdv_inputs) - 1: 2}
  outs = pallas_triton.pallas_call(
      functools.partial(_dkdv_kernel, sp=sp, bq=bq, bk=bk, want_dbias=want_dbias),
      out_shape=out_shape, grid=(bsz * kv_heads * pl.cdiv(s, bk),),
      num_warps=config.num_warps, num_stages=config.num_stages,
      name="tokamax_attention_bwd_dkdv", input_output_aliases=aliases,
  )(*dkdv_inputs)
  dqb_q, dqb_k = _clip_block(config.dq_block_q, t), _clip_block(config.dq_block_k, s)
  dq = pallas_triton.pallas_call(
      functools.partial(_dq_kernel, sp=sp, bq=dqb_q, bk=dqb_k),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
      grid=(bsz * n * pl.cdiv(t, dqb_q),),
      num_warps=config.num_warps, num_stages=config.num_stages,
      name="tokamax_attention_bwd_dq",
  )(*inputs)[0]
  grads = {"query": dq, "key": outs[0], "value": outs[1]}
  if want_dbias:
    bias = args["bias"]
    axes = tuple(a for a, full in enumerate(sp.bias_dims) if not full)
    dbias = jnp.sum(outs[2], axis=axes, keepdims=True) if axes else outs[2]
    grads["bias"] = dbias.astype(bias.dtype)
  return grads


# --- configs -----------------------------------------------------------------


def _shape(ba):
  q, k, v = ba.arguments["query"], ba.arguments["key"], ba.arguments["value"]
  return q.shape[1], k.shape[1], max(q.shape[3], v.shape[3]), jnp.dtype(q.dtype).itemsize


def _fwd_smem(bq, bk, hp, stages, itemsize):
  """Shared memory of the forward: q tile plus `stages` k and v tiles."""
  return (bq * hp + stages * 2 * bk * hp) * itemsize


def heuristic_config(t: int, s: int, h: int, itemsize: int) -> TritonAttentionConfig:
  """The fastest forward configs of the H200 sweep (docs/benchmarks.md)."""
  hp = max(16, pallas_triton.next_pow2(h))
  if hp <= 64:
    c = TritonAttentionConfig(block_q=64, block_k=64, num_warps=4, num_stages=3)
  elif hp <= 128:
    # Row halves: H200 forward 2.264 -> 2.211 ms (B8 T4096 N16 H128),
    # causal 1.206 -> 1.184, GQA 1.150 -> 1.135 (docs/benchmarks.md,
    # 2026-12-05 02:50).
    c = TritonAttentionConfig(block_q=128, block_k=64, num_warps=4, num_stages=2,
                              row_parts=2)
  else:
    c = TritonAttentionConfig(block_q=64, block_k=32, num_warps=4, num_stages=2)
  if itemsize == 4:  # f32 tiles are twice as large.
    c = dataclasses.replace(c, block_q=min(c.block_q, 64), block_k=min(c.block_k, 32))
  bq = _clip_block(c.block_q, t)
  return dataclasses.replace(c, block_q=bq, block_k=_clip_block(c.block_k, s),
                             row_parts=c.row_parts if bq >= 2 * _MIN_PART_ROWS else 1)


def search_space(t: int, s: int, h: int, itemsize: int) -> set[TritonAttentionConfig]:
  hp = max(16, pallas_triton.next_pow2(h))
  configs = set()
  for bq, bk, warps, stages in itertools.product(
      (64, 128), (32, 64, 128), (4, 8), (2, 3, 4)
  ):
    bq, bk = _clip_block(bq, t), _clip_block(bk, s)
    if _fwd_smem(bq, bk, hp, stages, itemsize) > 200 * 1024:
      continue
    # f32 values per thread of the O accumulator [bq, hp] and the logits
    # [bq, bk]: above ~192 they spill (255 registers per thread).
    if bq * (hp + bk) // (32 * warps) > 192:
      continue
    for parts in (1, 2) if bq >= 2 * _MIN_PART_ROWS else (1,):
      configs.add(TritonAttentionConfig(
          block_q=bq, block_k=bk, num_warps=warps, num_stages=stages, row_parts=parts))
  return configs


def vjp_heuristic_config(t: int, s: int, h: int, itemsize: int) -> TritonAttentionVjpConfig:
  """The fastest backward configs of the H200 sweep (docs/benchmarks.md)."""
  hp = max(16, pallas_triton.next_pow2(h))
  if hp <= 128 and itemsize < 4:
    c = TritonAttentionVjpConfig(block_k=64, block_q=64, dq_block_q=64,
                                 dq_block_k=64, num_warps=4,
                                 num_stages=3 if hp <= 64 else 2)
  else:
    c = TritonAttentionVjpConfig(block_k=32, block_q=32, dq_block_q=32,
                                 dq_block_k=32, num_warps=4, num_stages=1)
  return dataclasses.replace(
      c, block_k=_clip_block(c.block_k, s), block_q=_clip_block(c.block_q, t),
      dq_block_q=_clip_block(c.dq_block_q, t), dq_block_k=_clip_block(c.dq_block_k, s),
  )


def vjp_search_space(t: int, s: int, h: int, itemsize: int) -> set[TritonAttentionVjpConfig]:
  """dk/dv blocks (bk, bq) with the dq kernel's blocks swapped (bq'=bk, bk'=bq)."""
  configs = set()
  for big, small, warps, stages in itertools.product(
      (64, 128), (16, 32, 64), (4, 8), (1, 2, 3)
  ):
    if small > big:
      continue
    configs.add(TritonAttentionVjpConfig(
        block_k=_clip_block(big, s), block_q=_clip_block(small, t),
        dq_block_q=_clip_block(big, t), dq_block_k=_clip_block(small, s),
        num_warps=warps, num_stages=stages))
  return configs


# --- ops ---------------------------------------------------------------------


def check_supported(op: op_lib.Op, ba: op_lib.BoundArguments) -> None:
  """Shared by the forward and the VJP (`ba`: the forward's arguments)."""
  pallas_triton.check_platform(op)
  pallas_triton.check_not_explicitly_sharded(op, ba)
  args = ba.arguments
  pallas_triton.check_dtype(op, "query", args["query"].dtype)
  if args["bias"] is not None:
    pallas_triton.check_dtype(op, "bias", args["bias"].dtype)
  h, hv = args["query"].shape[3], args["value"].shape[3]
  if max(h, hv) > MAX_HEAD_DIM:
    raise op.unsupported(
        f"head dims up to {MAX_HEAD_DIM} fit the kernel's registers; got"
        f" H={h}, Hv={hv}."
    )


class _TritonAttentionMixin:
  """Support checks, heuristics and search spaces of the forward and VJP."""

  def supported_on(self, device) -> bool:
    return pallas_triton.supported_on(device)

  def check_supported(self, ba):
    check_supported(self, ba)

  def _get_heuristics_config(self, ba):
    return (vjp_heuristic_config if self.is_vjp else heuristic_config)(*_shape(ba))

  def _get_autotuning_configs(self, ba):
    return (vjp_search_space if self.is_vjp else search_space)(*_shape(ba))


@dataclasses.dataclass(frozen=True)
class TritonDotProductAttentionVjp(_TritonAttentionMixin, base.DotProductAttentionVjp):
  """FlashAttention-2 backward (dk/dv and dq kernels) from the lse residual."""

  implementation = "triton"
  config_cls = TritonAttentionVjpConfig

  def _fwd(self, *, residuals, out, dout, config, return_residuals, **args):
    del return_residuals
    return attention_backward(args, residuals, out, dout, config,
                              want_dbias="bias" not in self.skip_grads), None


@dataclasses.dataclass(frozen=True)
class TritonDotProductAttention(_TritonAttentionMixin, base.DotProductAttention):
  """FlashAttention-2 forward in Pallas:Triton."""

  implementation = "triton"
  config_cls = TritonAttentionConfig
  vjp: op_lib.Op | None = dataclasses.field(
      default_factory=TritonDotProductAttentionVjp
  )

  def _fwd(self, *, config, return_residuals, **args):
    out, lse = attention_forward(args, config, return_residuals)
    return out, ({"lse": lse} if return_residuals else None)
