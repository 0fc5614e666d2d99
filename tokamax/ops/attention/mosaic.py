"""The "mosaic" implementation of dot_product_attention: Pallas:Mosaic GPU (sm90).

Forward: FlashAttention-3 (arXiv:2407.08608) with `plgpu.kernel`. A CTA of
C + 1 warpgroups (WGs; C = `consumers`, 2 or 3) owns C * block_q query rows
of one (batch, head):
  * WG C, the producer (Sec. 3.1, warp specialisation), streams the key and
    value blocks of the CTA's kv head into a ring of `num_stages` shared
    memory slots with TMA; `k_ready`/`v_ready` barriers complete when a copy
    lands, `k_free`/`v_free` when every consumer is done with a slot.
  * WGs 0 .. C-1, the consumers, own block_q rows each: S = Q K^T and
    O += P V run on the tensor cores (wgmma, Q and K/V from shared memory, P
    from registers), the online softmax (FlashAttention-2, Sec. 3.1.1) in
    base 2 on registers. The consumers take turns on the tensor cores so that
    one WG's softmax overlaps the others' matmuls: with C = 2 a two-party
    `sched` barrier offsets them by half a step ("ping-pong", Sec. 3.1); with
    C = 3 a token passes round (each softmax runs under two WGs' matmuls,
    which at head dim 64, where the softmax is as long as the matmuls, is
    what hides it; 152 registers per consumer, so only for small O tiles).
Every feature is applied in registers: causal/local windows and query/key
lengths by positions (key blocks no row sees are never loaded; blocks every
row sees in full run without the positional mask; a consumer's last block
seen only in its first half runs as a half-width step), bias and bool mask by
tiles read from global memory one step ahead, soft cap by tanh, GQA by
reading kv head n // G (k/v never repeated).
Saves lse = m + log(l) (f32 [B, N, T]) as the residual.

Backward (FlashAttention-2 Alg. 2 / FlashAttention-3 Sec. 3.3 without the
atomic dq), two kernels of the same three-WG shape from the lse residual:
  * dk/dv: a CTA owns 2 * block_kv keys of one kv head (block_kv per
    consumer, held in SMEM with dk, dv in registers); the producer streams
    (q, do, lse, D) tiles of the G query heads and of the query blocks that
    see the keys. Key-major: s^T = k q^T, p^T = exp2(s^T - lse),
    dv += p^T do, dp^T = v do^T, ds^T = p^T (dp^T - D), dk += ds^T q.
    Head dims 256 run it twice (dk, then dv) to fit the registers.
  * dq: the forward's ring over key blocks; dq += ds k per step (a last
    block seen only in its first half as a half step, like the forward),
    and dbias = ds written per block when the bias is differentiated.

Grids are flat; under a causal or right window the heaviest CTAs of all
heads start first (`triton.grid_position`, HEAVY_FIRST_BAND). Each of the
three kernels can run persistent (by its config): one CTA per SM takes the
flat grid's tiles round by round (`_persistent_tiles`), its ring running on
across tiles and the next tile's rows (keys, for dk/dv) loading under the
current one.

Shapes: head dims are padded to multiples of 64 (wgmma/TMA tiles; a copy,
only when H or Hv is not already one). Sequences shorter than a block are
padded; otherwise rows and keys past the ends are zero-filled by TMA on load,
masked (keys) and clipped by TMA on store (rows).

Mosaic GPU interpreter (tests on CPU): it cannot run a wgmma with a register
operand nor accumulate into an initialised accumulator, so with
`pallas_mosaic.INTERPRET` P goes through shared memory and P V is added in
registers. Everything else (TMA, barriers, warpgroups, masks) is the GPU path.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import arith, scf, vector
# nvvm (warp vote) is not re-exported by jax.extend.
from jax._src.lib.mlir.dialects import nvvm

from tokamax._src import op as op_lib
from tokamax._src import pallas_mosaic
from tokamax._src import pallas_triton
from tokamax.ops.attention import triton
from tokamax.ops.attention import xla as base

LOG2E = triton.LOG2E
LN2 = triton.LN2
MAX_HEAD_DIM = 256
_CONSUMERS = 2  # consumer warpgroups per CTA (dk/dv; forward and dq: config)
_M_INIT = -1e30  # finite running-max start: exp2(m_old - m_new) never NaN
# Forward, value head dims >= 128: add the step's row sums of P to l while
# the P V wgmma runs (off the softmax's critical path) instead of before it.
# H200: 1.1-1.5 % faster at H128, 4 % slower at H64 (docs/benchmarks.md).
# GPU path only; benchmarks/attention_mosaic_flag_ab.py flips it.
SUM_UNDER_PV = True
# Forward, value head dims >= 128: exponentials against the previous running
# max while the tile's row max is reduced; a warp whose rows' max grew by more
# than _RESCALE_TAU (log2 units, so P <= 2^8) recomputes them and rescales O,
# the others skip the O rescale (lazy rescaling, FA4). The interpreter runs
# the same math branch-free. H200: 0.6-1.6 % faster at H128, 2-4 % slower at
# H64 (docs/benchmarks.md), so H64 keeps the plain step. Accuracy: P up to
# 2^tau raises the H128 mean output error by 3 % (2.16e-3 vs 2.10e-3 of the
# mean |O|, cuDNN 2.10e-3); tau 0 restores it at 24 % of the forward's time
# (benchmarks/attention_accuracy.py, H200 2026-12-03).
LAZY_RESCALE = True
_RESCALE_TAU = 8.0
# Registers per thread (64 Ki per SM shared by 128-thread WGs, so the
# warpgroups' counts sum to <= 512, multiples of 8): the producer only issues
# TMA; the consumers split the rest (S, P, the O or dk/dv accumulators).
_PRODUCER_REGS = 40
# dk/dv kernel: issue dv += p^T do and compute ds^T while it runs (one wait
# for dv and dk) when H + Hv (padded) is at most this. H200, 2026-12-01:
# faster at head dim 64, slower at 128 (register pressure at 232 registers);
# 2026-12-02 with _PRODUCER_REGS = 24 (240 per consumer): no gain at 128
# (within the run's spread, docs/benchmarks.md 20:12).
FUSE_DKDV_MAX_WIDTH = 128
# The heuristic's persistent dk/dv kernel (`vjp_heuristic_config`): where
# H + Hv (padded) is at most this, and under a causal mask or a window only
# with at least this many key tiles per CTA. H100, 2026-12-05 (medians of
# 3 rounds): at head dim 64 the dk/dv kernel 8.2 % faster non-causal,
# 3.3 % causal (62 tiles per CTA); at 128 1.2 % faster non-causal, 2.1 %
# slower causal (31 tiles per CTA) and 15.7 % slower for GQA (7.8 tiles
# per CTA). Not imbalance (a
# list-scheduling model puts the static rounds at the lower bound): at 128
# the persistent kernel spills more (DKDV_PREFETCH_AT_TILE_START below).
DKDV_PERSISTENT_MAX_WIDTH = 128
# Persistent dk/dv: load the next key tile's K/V at the start of a tile
# (after the previous tile's dk/dv stores have read the buffer) instead of
# after the tile's first step. ptxas (sm_90a, 2026-12-05), B8 T4096 N16 H128
# spill stores/loads: non-causal 136/276 bytes after the first step, 76/148
# at the start (per-tile kernel 16/48); causal 184/332, 64/116 (120/196).
# None at head dim 64. GPU-tested (H100, H200), not timed on its own; with it
# (and dk issued before dv) the persistent kernel at H128 was no clear gain
# over the per-tile one (H100, docs/benchmarks.md 2026-12-05 17:32).
DKDV_PREFETCH_AT_TILE_START = False
DKDV_PERSISTENT_MIN_BANDED_ROUNDS = 32
# Backward kernels named here ("dkdv", "dq"): wait for s = q k^T alone, then
# issue dp = do v^T and compute p's exponentials while it runs (cuDNN's H128
# bprop does this, H100 SASS 2026-12-05), instead of one wait for both
# products. H100, 2026-12-05 (20:20), per-kernel A/B, 4 rounds, against the
# unchanged dq kernel of the same round: dk/dv 4.6-8.6 % faster at the seed
# shape, 5.6-6.9 % causal, 0.4-4.3 % at B8 T4096 N16 H128 causal and not,
# 0.6-1.7 % GQA (20 of 20 rounds); the dq kernel 3-12 % slower with it, so
# dk/dv only (docs/benchmarks.md 2026-12-05 20:20).
EXP_UNDER_DP: tuple[str, ...] = ("dkdv",)
# dk/dv kernel, H + Hv (padded) at most this: each consumer loads its keys
# and values into registers once per key tile (16-bit, 32 registers per
# thread at head dim 64) and issues s^T = k q^T and dp^T = v do^T with them
# as the register operand, so a step's four products read 3 tiles from
# shared memory instead of 5 (the seed-shape step needs ~110 of the SM's
# 128 bytes per clock of shared memory at the tensor cores' peak otherwise).
# GPU path only (the interpreter takes no register operand). H100,
# 2026-12-06, per-kernel A/B (7 rounds per shape): the dk/dv kernel 4.5 %
# faster at the seed shape causal (every round), 0.7-2.6 % (medians) non-
# causal, where the 2 rounds that were not faster also had the unchanged
# forward kernel 4-7 % slower (docs/benchmarks.md 2026-12-06). Not timed on
# an H200. 0 turns it off.
DKDV_KV_REGS_MAX_WIDTH = 128
# Forward: each consumer loads its Q tile into registers once per query tile
# and issues s = q k^T with it as the register operand (K alone read from
# shared memory). ptxas, seed shape, three consumers: no spills non-causal,
# 56 bytes causal (16 without). GPU path only. H100, 2026-12-06: forward
# kernel 1.6-2.4 % slower causal (every round), -7.3 to +3.9 % non-causal,
# so off (docs/benchmarks.md 2026-12-06).
FWD_Q_REGS = False
# Forward and dq kernel without bias/mask tiles: a consumer's last key block
# whose visible keys all lie in its first half (the causal diagonal of every
# other 64-row consumer at 128-key blocks, a key length just past a block
# edge) runs as a half-width step over block_kv / 2 keys (forward: Q K^T and
# P V; dq: Q K^T, dO V^T and dS K, at 128-key steps, which the heuristic no
# longer takes: its head-dim-64 dq runs three consumers over 64-key steps).
# Causal seed shape: 3 % fewer block products; H200 forward 0.709 -> 0.699
# ms (seed causal), 0.904 -> 0.899 (H128 causal), 0.900 -> 0.895 (GQA),
# non-causal unchanged
# (docs/benchmarks.md, 2026-12-02 22:20); with the dq half step too, seed
# causal forward+backward 2.817 -> 2.782 ms (2026-12-03). Needs block_kv >=
# 128 (a wgmma contraction is a multiple of 64).
HALF_LAST_BLOCK = True
# Causal/right-window grids (every kernel) of few CTAs per SM: CTAs start in
# bands of HEAVY_FIRST_BAND blocks per (batch, head), heaviest band first over
# all (batch, head), so the last wave holds short CTAs (longest-processing-
# time-first). A grid in (batch, head) order starts the last heads' longest
# CTAs at the very end; in a list-scheduling model (132 SMs, a CTA's time
# proportional to its blocks) that tail was 13 % of the GQA dk/dv kernel
# (1024 CTAs of 4 query heads each), 3 % at B8 T4096 N16. Bands keep that
# many CTAs of a head running together (its tiles shared in L2), but a head's
# tiles are still read once per band, so with many CTAs per SM (a short
# tail) the order costs more than it saves. H200, 2026-12-04, band 8 against
# (batch, head) order, forward+backward median: B8 T4096 N16 H128 causal
# 3.894 vs 3.997 ms, GQA B4 T4096 N32 K8 causal 3.847 vs 3.963 (31 CTAs per
# SM, 8 in the GQA dk/dv kernel, which gains 4 %); seed causal 2.726 vs
# 2.676 (43-62 CTAs per SM),
# so bands only below HEAVY_FIRST_MAX_WAVES CTAs per SM. None: never.
# Bands of 4 against 8 (2026-12-05): B8 T4096 N16 H128 causal 4.037 vs
# 3.967 ms (forward 0.946 vs 0.919), GQA 3.815 vs 3.869, all of it from the
# dk/dv grid's 32 kv heads, which then took a band of 1; so 8, with the
# band-1 rule of `triton.heavy_first_band` at up to 33 heads.
HEAVY_FIRST_BAND = 8
HEAVY_FIRST_MAX_WAVES = 36
# Band 1 when a wave holds at least min(HEAVY_FIRST_BAND, this) CTAs of every
# (batch, head): 4 (up to 33 heads), from the GQA dk/dv grid above; it was
# 8 (16 heads) before 2026-12-05.
BAND_ONE_PER_HEAD = 4
# ... and only up to this many CTAs per SM. H200, 2026-12-05 (09:50),
# band 1 (BAND_ONE_PER_HEAD 4) against bands of 8 (8), causal H128, per
# kernel forward / dk,dv / dq ms: B2 T8192 N12 (24 heads, 11.6 CTAs per SM)
# 0.641 / 1.214 / 0.822 against 0.635 / 1.238 / 0.838 (band 1 1.3 % faster
# in all); B1 T16384 N32 (32 heads, 31 per SM) 3.709 / 7.405 / 4.948
# against 3.641 / 7.159 / 4.856 (band 1 2.5 % slower): with many waves the
# tail is short and 8 CTAs of a head per wave share its k/v in L2 (8 MB per
# head at T16384) where band 1 runs 4. The GQA dk/dv grid (7.8 per SM)
# gains from band 1 (note above).
BAND_ONE_MAX_WAVES = 16
# CTAs of a persistent kernel (`MosaicAttentionConfig.persistent`): one per
# SM of the target GPU (a CTA takes a whole SM's registers; more than the
# SMs would leave the extra CTAs a second wave of their own). None: the
# GPU's SM count (`triton.sms`); tests set a number.
PERSISTENT_CTAS: int | None = None


def _persistent_cta_limit() -> int:
  return PERSISTENT_CTAS or triton.sms()

# Time per query row with two consumers against three at head dim 64, for
# `_consumers_by_rounds`. Forward: seed shape 1.265 against 1.135 ms (H200,
# 2026-12-03), both many rounds deep; with it the count picks the faster of
# the two at 9 small grids, 4 of them causal (H100, 2026-12-07). dq kernel:
# 1.13-1.17 fitted to three small non-causal grids; at 1.17 it picks the
# faster at those and at 4 causal ones (H100, 2026-12-07). Causal tiles are
# unequal, but at 1-2 rounds the longest tile sets the time either way.
TWO_CONSUMERS_ROW_COST = 1.12
DQ_TWO_CONSUMERS_ROW_COST = 1.17
# Kernels ("fwd", "dq") whose causal/right-window query tiles start
# `_row_shift` rows before row 0, so that the tile left partial by
# T % (consumers x block_q) rows is the first (1-2 key blocks) instead of
# the last (every key block); the consumers of rows < 0 only take their
# turns (skip steps). Rounds of key blocks per (batch, head) at three
# 64-row consumers: 101 -> 96 at T 2048 (forward, 128-key steps), 197 ->
# 187 (dq, 64-key steps), 32 -> 27 at T 1024. Not with bias/mask tiles
# (their loads and dbias stores index rows). H100, 2026-12-06, per kernel,
# 4 rounds: forward 8.4-9.0 % faster at the seed shape causal, 16.2-16.9 %
# at B64 T1024 N16 H64 causal; dq 2.9-3.7 % slower at the seed shape
# (0.5-1.3 % faster at T1024), so the forward only.
SHIFT_CAUSAL_TILES = ("fwd",)
# The dq kernel (which runs first) computes D = rowsum(dO * O) for its query
# rows from an O tile it loads beside dO (one f32 row sum per tile, at the
# tile's start) and writes D out with dq for the dk/dv kernel. Without it
# (or where the O tiles do not fit shared memory: head dims 256) XLA computes
# D in a kernel of its own, reading dO and O once more: 0.093 ms at the seed
# shape and at B8 T4096 N16 H128. H100, 2026-12-06, per-kernel A/B: the dq
# kernel is 0.06 ms (8 %) slower at the seed shape causal (one tile per CTA:
# the O tiles' bytes land before the first step), 0.03-0.05 ms (3 %) non-
# causal and 0.06-0.08 at H128 (persistent: O is loaded a tile ahead), so
# forward+backward gains 0.02-0.04 ms (1 %) at the seed shape causal (6 of 6
# rounds), about 0.04 non-causal and 0.01-0.03 at H128 by the kernels' sums
# (docs/benchmarks.md 2026-12-06 09:47).
DQ_DELTA = True
# Forward under a causal/right window without bias/mask tiles: each tile's
# key blocks stream last (diagonal) block first, as FlashAttention-3 orders
# its masked iterations. In 128-key order the tile's last block is seen by
# one 64-row consumer only (the others skip it), so its Q K^T, softmax and
# P V run alone at the end of the tile with the tensor cores idle, and the
# next tile waits for them; first, that lone step overlaps the other
# consumers' first products instead. The consumer counts it applies to:
# three (the 192-row tiles, where the skip happens). H100, 2026-12-07,
# forward, 2 rounds each: seed shape causal 0.660 / 0.658 -> 0.639 / 0.636
# ms (3.3 % faster); with two consumers (no skip steps at 128-key blocks)
# it was -3 to +3 % on small head-dim-64 grids and +0.1 to +0.6 % at head
# dim 128 causal (docs/benchmarks.md 2026-12-07 19:20).
REVERSE_CAUSAL_KEYS = (3,)
# Whether the forward that saves the softmax statistics for the VJP
# reverses too. Per-kernel A/B on an H100, 2026-12-07 23:09 (4 alternating
# rounds, 3 consumers): the inference forward gained 3.2 % at the seed shape
# causal and 7 % at B64 T1024, but the forward that also stores lse lost
# 1.4 % at the seed shape (gained 3.2 % at B64 T1024), with the same
# registers and spills; unexplained, so training keeps key order.
REVERSE_WITH_RESIDUALS = False


def _consumer_regs(consumers: int) -> int:
  """setmaxnreg count of each of `consumers` warpgroups (232 for 2, 152 for 3)."""
  return (512 - _PRODUCER_REGS) // consumers // 8 * 8


# MosaicAttentionConfig's discrete fields: allowed values and why.
_CONFIG_CHOICES = {
    "block_q": ((64, 128), " (wgmma rows)"),
    "block_kv": ((64, 128, 192, 256), ""),
    "consumers": ((2, 3), ""),
}


@pydantic.dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
  """Query rows per consumer WG, key rows per step, ring depth, consumer WGs
  per CTA (CTA: consumers x block_q rows).

  Two consumers take turns on the tensor cores in a ping-pong (one's
  softmax under the other's matmuls, FA3 Sec. 3.1); three pass a token
  round (each WG's softmax runs under the other two's matmuls).
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  consumers: int = 2
  # One CTA per SM (`_persistent_cta_limit`) looping over the query tiles
  # instead of one CTA per tile (`_persistent_tiles`).
  persistent: bool = False

  @pydantic.field_validator("block_q", "block_kv", "consumers")
  @classmethod
  def _one_of(cls, v, info):
    allowed, why = _CONFIG_CHOICES[info.field_name]
    if v not in allowed:
      raise ValueError(f"{info.field_name} must be one of {allowed}{why}, got {v}")
    return v

  @pydantic.field_validator("num_stages")
  @classmethod
  def _stages(cls, v):
    if not 1 <= v <= 4:
      raise ValueError(f"num_stages must be 1..4, got {v}")
    return v


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def smem_bytes(config: MosaicAttentionConfig, hp: int, hvp: int, itemsize: int,
               residuals: bool = True) -> int:
  """Shared memory of the forward kernel (each buffer 1 KiB aligned)."""
  bq, bk, st = config.block_q, config.block_kv, config.num_stages
  nc = config.consumers
  q = nc * bq * hp * itemsize
  # O goes out through Q's buffer unless Q is prefetched under the epilogue.
  o = 0 if hvp == hp and not config.persistent else nc * bq * hvp * itemsize
  kv = st * bk * (hp + hvp) * itemsize
  lse = nc * bq * 4 if residuals else 0
  bufs = [q, o, kv // 2, kv // 2, lse]
  # + barriers and Pallas' own scratch: ~2.2 KiB over the 1 KiB-rounded
  # buffers (test_mosaic_smem_estimate_bounds_the_kernel).
  return sum(_round_up(x, 1024) for x in bufs if x) + 2560


def _pad(x, axis: int, size: int):
  """x zero-padded at the end of `axis` to at least `size` (a copy if so)."""
  if x.shape[axis] >= size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _limits(sp, q_len_ref, kv_len_ref, b):
  q_lim, kv_lim = jnp.int32(sp.t), jnp.int32(sp.s)
  if q_len_ref is not None:
    q_lim = jnp.maximum(jnp.minimum(q_lim, q_len_ref[b]), 0)
  if kv_len_ref is not None:
    kv_lim = jnp.maximum(jnp.minimum(kv_lim, kv_len_ref[b]), 0)
  return q_lim, kv_lim


def _cta_grid(bsz: int, heads: int, blocks: int, ctas: int = 0):
  """`plgpu.kernel` grid arguments of a flat grid read by `_cta_coords`, or
  of `ctas` persistent CTAs (`_persistent_tiles`)."""
  return dict(grid=(ctas or bsz * heads * blocks,), grid_names=("cta",))


def _persistent_ctas(tiles: int, persistent: bool) -> int:
  """CTAs of a persistent grid over `tiles` tiles, 0 for one CTA per tile."""
  return min(tiles, _persistent_cta_limit()) if persistent else 0


def _cta_coords(sp, bsz: int, heads: int, blocks: int, p=None):
  """(batch, head, rank) of tile p (default: this CTA's) of a flat grid of
  bsz * heads * blocks (`triton.grid_position`: rank bands, rank 0 the
  heaviest block)."""
  band = triton.heavy_first_band(sp, bsz * heads, blocks, HEAVY_FIRST_BAND,
                                 HEAVY_FIRST_MAX_WAVES, BAND_ONE_PER_HEAD,
                                 BAND_ONE_MAX_WAVES)
  if p is None:
    p = lax.axis_index("cta")
  return triton.grid_position(p, bsz, heads, blocks, band)


def _persistent_tiles(total: int, ctas: int):
  """This CTA's share of `total` flat-grid tiles among `ctas` persistent
  CTAs: (tile count, i -> flat index of its i-th tile). Tiles go out round
  by round in flat-grid order (heaviest first under causal masking), odd
  rounds in reverse CTA order, so the CTA that took a round's heaviest tile
  takes the next round's lightest (boustrophedon)."""
  c = lax.axis_index("cta")

  def tile(i):
    i = jnp.asarray(i, jnp.int32)
    return i * ctas + jnp.where(lax.rem(i, jnp.int32(2)) == 0, c, ctas - 1 - c)

  rounds = total // ctas
  count = rounds + (tile(jnp.int32(rounds)) < total).astype(jnp.int32)
  return count, tile


def _row_shift(kernel: str, sp, tq: int, bq: int, nc: int, tiles: bool) -> int:
  """Rows (a multiple of bq) before row 0 where the first of the
  cdiv(tq, nc * bq) query tiles of `kernel` starts (SHIFT_CAUSAL_TILES):
  the rows the last tile would hold past T, under a causal/right window
  without bias/mask tiles; else 0."""
  if kernel not in SHIFT_CAUSAL_TILES or sp.right is None or tiles:
    return 0
  return (pl.cdiv(tq, nc * bq) * nc * bq - sp.t) // bq * bq


def _live(r0, shift: int):
  """Whether a WG's rows [r0, r0 + bq) exist (None: always): the WG of a
  shifted tile's rows < 0 loads and stores nothing."""
  return r0 >= 0 if shift else None


def _wg_rows(r0, q_lim, shift: int):
  """(`_live`, the WG's row limit): rows < 0 see no key (limit r0)."""
  live = _live(r0, shift)
  return live, q_lim if live is None else jnp.where(live, q_lim, r0)


def _when(cond, fn):
  """fn() under pl.when(cond), or unconditionally when cond is None."""
  if cond is None:
    fn()
  else:
    pl.when(cond)(fn)


def _query_cta(sp, q_ref, q_len_ref, kv_len_ref, bq: int, bk: int,
               nc: int = _CONSUMERS, p=None, shift: int = 0):
  """Ids and ranges of a CTA of nc * bq query rows on the flat grid of
  `_cta_grid` (q_ref [B, T, N, H] of T padded to CTAs; p: the tile, default
  this CTA's; the first tile starts at row -shift): (b, n, wg, kv head,
  q_lim, kv_lim, first row, key blocks [lo, hi))."""
  bsz, t, heads, _ = q_ref.shape
  nq = pl.cdiv(t, nc * bq)
  b, n, qi = _cta_coords(sp, bsz, heads, nq, p)
  if sp.right is not None:  # causal/right window: rank 0 = the last rows
    qi = nq - 1 - qi
  wg = lax.axis_index("wg")
  kh = lax.div(n, jnp.int32(sp.groups))
  q_lim, kv_lim = _limits(sp, q_len_ref, kv_len_ref, b)
  cta0 = qi * (nc * bq) - shift
  lo, _, _, hi = triton.blocks_seen(
      cta0, nc * bq, bk, q_lim, kv_lim, sp.left, sp.right, strict=False)
  return b, n, wg, kh, q_lim, kv_lim, cta0, lo, hi


def _query_tiles(sp, q_ref, q_len_ref, kv_len_ref, bq: int, bk: int, nc: int,
                 ctas: int, shift: int):
  """(this WG's index, the CTA's tile count, i -> `_query_cta` of its i-th
  tile) for the query-tile kernels: `ctas` persistent CTAs
  (`_persistent_tiles`), or (ctas = 0) one tile per CTA, computed once."""
  if ctas:
    bsz, tq, heads, _ = q_ref.shape
    count, tile = _persistent_tiles(bsz * heads * pl.cdiv(tq, nc * bq), ctas)
    return lax.axis_index("wg"), count, lambda i: _query_cta(
        sp, q_ref, q_len_ref, kv_len_ref, bq, bk, nc, tile(i), shift)
  cta = _query_cta(sp, q_ref, q_len_ref, kv_len_ref, bq, bk, nc, shift=shift)
  return cta[2], 1, lambda i: cta


def _ring(lo, k0, stages: int):
  """j -> key block j's ring slot for a tile whose blocks start at lo; k0:
  the blocks streamed for the CTA's earlier tiles (None: a one-tile CTA)."""
  start = lo if k0 is None else lo - k0
  return lambda j: lax.rem(j - start, jnp.int32(stages))


def _key_order(lo, hi, reverse: bool):
  """t -> the key block a tile streams t-th (t in [lo, hi), ring slot t):
  block t, or with `reverse` block lo + hi - 1 - t (last block first)."""
  return (lambda t: lo + hi - 1 - t) if reverse else (lambda t: t)


def _reversed_segments(segments, lo, hi):
  """(start, stop, mode) block ranges of [lo, hi) as `_key_order(reverse=
  True)` positions: the last range first."""
  return [(lo + hi - stop, lo + hi - start, mode) for start, stop, mode in
          reversed(segments)]


def _run_producer(query_tile, count, ctas: int, stages: int, issue, drain,
                  interpret: bool, reverse: bool = False):
  """The producer WG: its registers lowered, every key block of the CTA's
  tiles through issue(b, kv head, j, slot, wait_free), in the order of
  `_key_order(reverse)`; the ring's first `stages` blocks (over all tiles)
  go into empty slots. Then drain(slot) for the last `stages` blocks (the
  interpreter checks that every waiter saw every barrier phase; on the GPU
  this only idles the producer)."""
  if not interpret:
    plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")

  def tile_fn(i, k0):
    b, _, _, kh, _, _, _, lo, hi = query_tile(i)
    slot_of, block = _ring(lo, k0, stages), _key_order(lo, hi, reverse)
    step = lambda t, wait: issue(b, kh, block(t), slot_of(t), wait)
    fill = stages if k0 is None else jnp.maximum(stages - k0, 0)
    first = jnp.minimum(lo + fill, hi)
    pl.loop(lo, first)(lambda j: step(j, False))
    pl.loop(first, hi)(lambda j: step(j, True))
    return (lo, hi) if k0 is None else k0 + jnp.maximum(hi - lo, 0)

  if ctas:
    lo, start = jnp.int32(0), jnp.int32(0)
    hi = lax.fori_loop(0, count, tile_fn, jnp.int32(0))
  else:
    lo, hi = tile_fn(0, None)
    start = lo
  slot_of = _ring(start, None, stages)
  pl.loop(jnp.maximum(lo, hi - stages), hi)(lambda j: drain(slot_of(j)))


def _tile_rows(query_tile, count, wg, bq: int, load):
  """Persistent consumers: (load the first tile's rows, i -> prefetch tile
  i + 1's rows if there is one); load(b, n, the WG's first row) issues a
  consumer's row copies."""

  def rows_of(i):
    b, n, _, _, _, _, cta0, _, _ = query_tile(i)
    load(b, n, cta0 + wg * bq)

  return lambda: rows_of(0), lambda i: pl.when(i + 1 < count)(lambda: rows_of(i + 1))


def _run_consumer(tile_fn, count, ctas: int, load_first, nc: int, interpret: bool):
  """Consumer of nc: its registers raised, tile_fn(i, k0) over the CTA's
  tiles; persistent, its first rows loaded first (later ones prefetched by
  tile_fn) and its last stores waited for at the end."""
  if not interpret:
    plgpu.set_max_registers(_consumer_regs(nc), action="increase")
  if not ctas:
    tile_fn(0, None)
    return
  load_first()
  lax.fori_loop(0, count, tile_fn, jnp.int32(0))
  plgpu.wait_smem_to_gmem(0)


def _clamp_ranges(wg_ranges, lo, hi):
  """A WG's (lo, a, c, hi) inside the CTA's [lo, hi): rows (or keys) past
  the limits give empty ranges that may start anywhere."""
  lo_w, a_w, c_w, hi_w = wg_ranges
  lo_w = jnp.minimum(jnp.maximum(lo_w, lo), hi)
  hi_w = jnp.minimum(jnp.maximum(hi_w, lo_w), hi)
  a_w = jnp.minimum(jnp.maximum(a_w, lo_w), hi_w)
  c_w = jnp.minimum(jnp.maximum(c_w, a_w), hi_w)
  return ((lo, lo_w, "skip"), (lo_w, a_w, "masked"), (a_w, c_w, "full"),
          (c_w, hi_w, "masked"), (hi_w, hi, "skip"))


def _split_last_half(sp, segments, r0, bq: int, bk: int, q_lim, kv_lim):
  """`_clamp_ranges` segments with the WG's last masked block as a "half"
  segment when no row of [r0, r0 + bq) sees a key in its second half (keys
  past min(kv_lim, last row + right)); otherwise the half segment is empty."""
  *head, (c_w, hi_w, masked), tail = segments
  end = jnp.minimum(r0 + bq, q_lim)  # rows >= q_lim see nothing
  keys_end = kv_lim if sp.right is None else jnp.minimum(kv_lim, end + sp.right)
  half = (c_w < hi_w) & (keys_end <= (hi_w - 1) * bk + bk // 2)
  split = jnp.where(half, hi_w - 1, hi_w)
  return (*head, (c_w, split, masked), (split, hi_w, "half"), tail)


def _ts_operand(x, t: int, s: int, rows: int, cols: int, transpose=False):
  """A bias or mask [b, n, t|1, s|1] as the kernels read it: broadcast to
  [b, n, t, s], zero-padded to at least [rows, cols] (the tiles are read
  straight from global memory, without bounds checks), a mask as int8 (0 =
  hidden), [b, n, cols, rows] if `transpose` (the key-major dk/dv kernel)."""
  if x is None:
    return None
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.int8)
  x = jnp.broadcast_to(x, (*x.shape[:2], t, s))
  x = _pad(_pad(x, 2, rows), 3, cols)
  return jnp.swapaxes(x, 2, 3) if transpose else x


def _ts_tile(ref, dims, b, n, r0, c0, shape):
  """Tile [R, C] at (r0, c0) of a `_ts_operand` ref in registers (WGMMA
  layout), loaded straight from global memory; None without the operand."""
  if ref is None:
    return None
  idx = (b if dims[0] else 0, n if dims[1] else 0, pl.ds(r0, shape[0]),
         pl.ds(c0, shape[1]))
  return plgpu.load(ref.at[idx], layout=plgpu.Layout.WGMMA, optimized=False)


def _tile_loader(sp, bias_ref, mask_ref, b, r0, block: int, last: int, shape):
  """load(n, i, ahead=0) -> (bias, mask) tiles (None where absent) of head n
  at (r0, (i + ahead) * block) of the `_ts_operand`s, the block clamped to
  `last`.

  The kernels load a step's tiles one step ahead and hold them in registers
  (the carry), so the global-memory latency hides behind a whole step: 1.1-
  1.2x faster forward than loading them in their own step (H200,
  docs/benchmarks.md). The prefetch past the last block stays in bounds."""

  def load(n, i, ahead: int = 0):  # block i + ahead
    if bias_ref is None and mask_ref is None:
      return None, None
    c0 = jnp.minimum(i + ahead if ahead else i, last) * block
    return tuple(_ts_tile(ref, dims, b, n, r0, c0, shape) for ref, dims in
                 ((bias_ref, sp.bias_dims), (mask_ref, sp.mask_dims)))

  return load


def _row_band(sp, r0, c0, shape, q_lim, kv_lim, key_major: bool = False):
  """Bool tile (WGMMA layout) of the positional rules (lengths, causal/window;
  `triton.positional`) for the block of query rows r0.. and keys c0..:
  [rows, keys] (query-major), or [keys, rows] if `key_major` (dk/dv).

  The rules are folded into per-row bounds on the key offset first, so a
  tile element costs one compare (two with a left window) against a
  broadcast bound instead of two position tiles and three compares: at 128
  rows per warpgroup the latter spilled registers in the forward's masked
  steps (H200 ptxas, docs/benchmarks.md)."""
  q_axis, k_axis = (1, 0) if key_major else (0, 1)
  rows = r0 + plgpu.broadcasted_iota(
      jnp.int32, shape[q_axis:q_axis + 1], 0,
      layout=plgpu.Layout.WGMMA.reduce(k_axis))
  last = kv_lim - 1  # the last visible key of a row
  if sp.right is not None:
    last = jnp.minimum(last, rows + sp.right)
  last = jnp.where(rows < q_lim, last, -1) - c0
  offsets = plgpu.broadcasted_iota(jnp.int32, shape, k_axis, layout=plgpu.Layout.WGMMA)
  vis = offsets <= lax.broadcast_in_dim(last, shape, [q_axis])
  if sp.left is not None:
    first = rows - (sp.left + c0)
    vis = vis & (offsets >= lax.broadcast_in_dim(first, shape, [q_axis]))
  return vis


def _visible(band, mask):
  """Bool tile of the visible (row, key) pairs, or None if all are: the
  positional `band` ("masked" blocks; None elsewhere) and the bool mask
  tile."""
  if mask is None:
    return band
  return (mask != 0) if band is None else band & (mask != 0)


# --- the kernel ------------------------------------------------------------------


def _lazy_softmax(z, m, l, acc, raw, interpret: bool):
  """One forward step's softmax with lazy rescaling (FA4's threshold rule).

  z [bq, bk]: base-2 logits, or raw q.k when `raw` (log2(e) * scale) is
  given; m, l [bq]: running max and sum; acc [bq, hvp]: the O accumulator.
  Returns (p, m', l', acc'): m' is m unless the tile's row max exceeds it by
  more than _RESCALE_TAU, then the new max; p = exp2(c z - m') <= 2^tau;
  l', acc' are l, acc times exp2(m - m') (this step's row sums not added).
  On the GPU, p is first computed against the old m, overlapping the row-max
  reduction, and a warp recomputes its rows only when one of them grew past
  the threshold (rows of a WGMMA tile belong to one warp).
  """
  c = 1.0 if raw is None else raw
  if interpret:  # the same math without the branch (no inline_mgpu there)
    m_new = jnp.maximum(m, z.max(axis=1) * c)
    m_use = jnp.where(m_new > m + _RESCALE_TAU, m_new, m)
    p = jnp.exp2(z * c - lax.broadcast_in_dim(m_use, z.shape, [0]))
    alpha = jnp.exp2(m - m_use)
    return p, m_use, l * alpha, acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

  wgmma, row = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
  out_types = tuple(
      plgpu.ShapeDtypeStruct(x.shape, jnp.float32, layout)
      for x, layout in ((z, wgmma), (m, row), (l, row), (acc, wgmma)))

  @plgpu.inline_mgpu(arg_types=(wgmma, row, row, wgmma), return_type=out_types)
  def run(_, z, m, l, acc):
    def probs(ref):
      ref = ref.broadcast_in_dim(z.shape, (0,), z.layout)
      return ((z * c if raw is not None else z) - ref).exp2(approx=True)

    p_fast = probs(m)  # needs no row max: overlaps its reduction below
    z_max = z.reduce("max", 1)
    m_new = m.max(z_max * c if raw is not None else z_max)
    grow = m_new > m + _RESCALE_TAU
    m_use = grow.select(m_new, m)
    flag = None
    for reg in grow.registers.flat:
      for i in range(ir.VectorType(reg.type).shape[0]):
        e = vector.extract(reg, dynamic_position=[], static_position=[i])
        flag = e if flag is None else arith.ori(flag, e)
    flag = nvvm.vote_sync(mgpu.utils.c(0xFFFFFFFF, ir.IntegerType.get_signless(32)),
                          flag, "any")
    keep = (p_fast, l, acc)
    regs = [r for x in keep for r in x.registers.flat]
    branch = scf.IfOp(flag, [r.type for r in regs], has_else=True)
    with ir.InsertionPoint(branch.then_block):
      alpha = (m - m_use).exp2(approx=True)
      redo = (probs(m_use), l * alpha,
              acc * alpha.broadcast_in_dim(acc.shape, (0,), acc.layout))
      scf.yield_([r for x in redo for r in x.registers.flat])
    with ir.InsertionPoint(branch.else_block):
      scf.yield_(regs)
    results, out = list(branch.results), []
    for x in keep:
      n = x.registers.size
      out.append(mgpu.FragmentedArray(
          _registers=np.array(results[:n], dtype=object).reshape(x.registers.shape),
          _layout=x.layout, _is_signed=x.is_signed))
      results = results[n:]
    p, l, acc = out
    return p, m_use, l, acc

  return run(z, m, l, acc)


def _fwd_kernel(*refs, sp, bq: int, bk: int, stages: int, hp: int, hvp: int,
                nc: int, save_lse: bool, ctas: int, interpret: bool):
  """ctas: 0 for one CTA per query tile, else the number of persistent CTAs
  (`_persistent_tiles`): the K/V ring runs on across tiles (the producer
  fills the next tile's slots under this tile's last steps) and each
  consumer prefetches its next Q tile under its epilogue."""
  it = iter(refs)
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  bias_ref = next(it) if sp.bias_dims is not None else None
  mask_ref = next(it) if sp.mask_dims is not None else None
  q_len_ref = next(it) if sp.has_q_len else None
  kv_len_ref = next(it) if sp.has_kv_len else None
  o_ref, lse_ref = next(it), next(it)
  (q_smem, o_smem, k_smem, v_smem, lse_smem, p_smem, q_ready, k_ready, v_ready,
   k_free, v_free, sched) = it
  if o_smem is None:
    o_smem = q_smem
  dtype = q_ref.dtype
  no_tiles = bias_ref is None and mask_ref is None
  shift = _row_shift("fwd", sp, q_ref.shape[1], bq, nc, not no_tiles)
  wg, count, query_tile = _query_tiles(
      sp, q_ref, q_len_ref, kv_len_ref, bq, bk, nc, ctas, shift)
  reverse = (nc in REVERSE_CAUSAL_KEYS and sp.right is not None and no_tiles
             and (REVERSE_WITH_RESIDUALS or not save_lse))

  # Tensor-core turns. A turn issues a step's P V and the next step's Q K^T.
  # Two consumers: a rendezvous barrier (2 arrivals) after each Q K^T issue
  # and before each P V, which makes them alternate. Three: a token ring
  # (`sched` holds one 1-arrival barrier per WG): a WG waits for its token
  # before its turn and passes it on after issuing its Q K^T.
  def schedule():
    plgpu.barrier_arrive(sched)
    plgpu.barrier_wait(sched)

  def pass_turn():  # after issuing Q K^T
    if nc == 2:
      schedule()
    else:
      plgpu.barrier_arrive(sched.at[lax.rem(wg + 1, jnp.int32(nc))])

  def take_turn(slot):  # softmax done: wait for V and for the tensor cores
    if nc == 2:
      plgpu.barrier_arrive(sched)  # the other WG may issue
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_wait(sched)  # the tensor cores are ours again
    else:
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_wait(sched.at[wg])

  def load_q(b, n, r0):
    _when(_live(r0, shift), lambda: plgpu.copy_gmem_to_smem(
        q_ref.at[b, pl.ds(r0, bq), n], q_smem.at[wg], q_ready.at[wg]))

  # Persistent: tile i + 1's Q goes out once this WG's last Q K^T has run.
  load_first, prefetch_q = _tile_rows(query_tile, count, wg, bq, load_q)

  def consumer_tile(i, k0):
    b, n, _, kh, q_lim, kv_lim, cta0, lo, hi = query_tile(i)
    slot_of = _ring(lo, k0, stages)
    r0 = cta0 + wg * bq
    live, rows_lim = _wg_rows(r0, q_lim, shift)
    segments = _clamp_ranges(triton.blocks_seen(
        r0, bq, bk, rows_lim, kv_lim, sp.left, sp.right, strict=False), lo, hi)
    # (P V's contraction must stay a multiple of 64: bk >= 128.)
    if HALF_LAST_BLOCK and bk % 128 == 0 and no_tiles:
      segments = _split_last_half(sp, segments, r0, bq, bk, rows_lim, kv_lim)
    # Steps t in [lo, hi) in stream order: ring slot t holds key block(t).
    block = _key_order(lo, hi, reverse)
    if reverse:
      segments = _reversed_segments(segments, lo, hi)
    q_tile = q_smem.at[wg]
    if not ctas:
      load_q(b, n, r0)
    with jax.named_scope("q_wait"):  # named regions: trace_kernels() traces
      _when(live, lambda: plgpu.barrier_wait(q_ready.at[wg]))
    q_op = q_tile
    if FWD_Q_REGS and not interpret:
      q_op = plgpu.load(q_tile, layout=plgpu.Layout.WGMMA)

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((bq,), _M_INIT, jnp.float32), row_layout)
    l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
    acc = plgpu.layout_cast(jnp.zeros((bq, hvp), jnp.float32), plgpu.Layout.WGMMA)
    raw = triton.raw_scale(sp)

    def logits(qk, j, masked, bias, mask):
      """Base-2 logits (or raw q.k when `raw`), -inf where not visible; qk
      [bq, bk] or [bq, bk / 2] (a half step)."""
      if raw is None:
        z = qk * sp.scale
        if bias is not None:
          z = z + bias.astype(jnp.float32)
        if sp.cap is not None:
          z = sp.cap * jnp.tanh(z / sp.cap)
        z = z * LOG2E
      else:
        z = qk
      band = _row_band(sp, r0, j * bk, qk.shape, q_lim, kv_lim) if masked else None
      vis = _visible(band, mask)
      if vis is not None:
        z = jnp.where(vis, z, -jnp.inf)
      return z

    def wait_next_k(t):
      # Step t + 1's keys: waited while step t's P V runs (FA3, Sec. 3.1).
      @pl.when(t + 1 < hi)
      def _():
        plgpu.barrier_wait(k_ready.at[slot_of(t + 1)])

    def last_qk_done(t):
      if ctas:
        pl.when(t == hi - 1)(lambda: prefetch_q(i))

    load_tiles = _tile_loader(sp, bias_ref, mask_ref, b, r0, bk,
                              pl.cdiv(sp.s, bk) - 1, (bq, bk))

    def step(t, carry, mode):
      m, l, acc, tiles = carry
      slot, j = slot_of(t), block(t)
      if mode == "skip":  # a block only the other consumer sees
        with jax.named_scope("skip"):
          last_qk_done(t)
          tiles = load_tiles(n, j, 1)
          plgpu.barrier_arrive(k_free.at[slot])
          pass_turn()
          take_turn(slot)
          wait_next_k(t)
          plgpu.barrier_arrive(v_free.at[slot])
        return m, l, acc, tiles

      # A half step: the first bk / 2 keys of the block (the rest unseen).
      width = bk // 2 if mode == "half" else bk
      k_tile = k_smem.at[slot] if width == bk else k_smem.at[slot, pl.ds(0, width)]
      v_tile = v_smem.at[slot] if width == bk else v_smem.at[slot, pl.ds(0, width)]

      def qk_product(acc_ref):
        with jax.named_scope("qk_issue"):
          plgpu.wgmma(acc_ref, q_op, k_tile.T)
          # The next step's bias/mask tiles load meanwhile.
          nxt = load_tiles(n, j, 1)
        with jax.named_scope("rendezvous_qk"):
          pass_turn()  # the other consumers' softmax runs meanwhile
        with jax.named_scope("qk_wait"):
          s = acc_ref[...]
        return s, nxt

      qk, nxt = pl.run_scoped(qk_product, plgpu.ACC((bq, width), jnp.float32))
      last_qk_done(t)
      bias, mask = tiles
      with jax.named_scope("softmax"):
        plgpu.barrier_arrive(k_free.at[slot])
        z = logits(qk, j, mode != "full", bias, mask)
        if LAZY_RESCALE and hvp >= 128:
          p, m_new, l, acc = _lazy_softmax(z, m, l, acc, raw, interpret)
        else:
          z_max = z.max(axis=1)
          m_new = jnp.maximum(m, z_max * raw if raw is not None else z_max)
          m_b = lax.broadcast_in_dim(m_new, z.shape, [0])
          p = jnp.exp2(z * raw - m_b) if raw is not None else jnp.exp2(z - m_b)
          alpha = jnp.exp2(m - m_new)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          l = l * alpha
        p16 = p.astype(dtype)
      # Instruction order matters for overlap (the ordering of JAX's FA3
      # example): with small accumulators finish the softmax before
      # releasing the tensor cores, with large ones after.
      sum_under_pv = SUM_UNDER_PV and hvp >= 128 and not interpret
      if hvp <= 128:
        with jax.named_scope("softmax"):
          if not sum_under_pv:
            l = l + p.sum(axis=1)
          acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
        with jax.named_scope("rendezvous_pv"):
          take_turn(slot)
      else:
        with jax.named_scope("rendezvous_pv"):
          take_turn(slot)
        if not sum_under_pv:
          with jax.named_scope("softmax"):
            l = l + p.sum(axis=1)
      if interpret:
        p_tile = p_smem.at[wg] if width == bk else p_smem.at[wg, :, pl.ds(0, width)]
        p_tile[...] = p16
        plgpu.commit_smem()

        def pv_product(acc_ref):
          plgpu.wgmma(acc_ref, p_tile, v_tile)
          wait_next_k(t)
          return acc_ref[...]

        acc = acc + pl.run_scoped(pv_product, plgpu.ACC((bq, hvp), jnp.float32))
      else:
        def pv_product(refs):
          acc_ref, l_ref = refs
          plgpu.wgmma(acc_ref, p16, v_tile)
          if sum_under_pv:  # issued after the async wgmma, before its wait
            l_ref[...] = l_ref[...] + p.sum(axis=1)
          wait_next_k(t)

        with jax.named_scope("pv"):
          acc, l_out = pl.run_state(pv_product)(
              (plgpu.ACC.init(acc), l if sum_under_pv else None))
          l = l_out if sum_under_pv else l
      plgpu.barrier_arrive(v_free.at[slot])
      return m_new, l, acc, nxt

    carry = (m, l, acc, load_tiles(n, lo))

    @pl.when(lo < hi)
    def _():
      plgpu.barrier_wait(k_ready.at[slot_of(lo)])

    if nc == 2:
      pl.when(wg == 1)(schedule)
    else:  # WG 0 starts with the token; each WG's first turn issues Q K_0^T
      pl.when(wg == 0)(lambda: plgpu.barrier_arrive(sched.at[0]))
      plgpu.barrier_wait(sched.at[wg])
    for start, stop, mode in segments:
      carry = lax.fori_loop(start, stop, functools.partial(step, mode=mode), carry)
    if nc == 2:
      pl.when(wg == 0)(schedule)
    else:  # pass the last turn on; WG 0 takes the token's final phase
      pass_turn()
      pl.when(wg == 0)(lambda: plgpu.barrier_wait(sched.at[0]))
    if ctas:  # a tile without key blocks: Q is not in use
      pl.when(lo >= hi)(lambda: prefetch_q(i))
    m, l, acc, _ = carry

    # Rows that saw no key (l = 0) and rows >= q_lim output 0 with lse = 0.
    with jax.named_scope("epilogue"):
      seen = l > 0
      inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
      rows = r0 + plgpu.broadcasted_iota(
          jnp.int32, (bq, hvp), 0, layout=plgpu.Layout.WGMMA)
      out = jnp.where(rows < q_lim, acc * lax.broadcast_in_dim(inv, acc.shape, [0]), 0.0)
      if ctas:  # the previous tile's stores have read O's buffer
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      o_tile = o_smem.at[wg]
      o_tile[...] = out.astype(dtype)
      if save_lse:
        lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * LN2, 0.0)
        lse_smem.at[wg][...] = lse
      plgpu.commit_smem()

      def store():
        plgpu.copy_smem_to_gmem(o_tile, o_ref.at[b, pl.ds(r0, bq), n])
        if save_lse:
          plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, n, pl.ds(r0, bq)])

      _when(live, store)
      if not ctas:
        plgpu.wait_smem_to_gmem(0)
    if ctas:
      return k0 + jnp.maximum(hi - lo, 0)

  pl.when(wg < nc)(lambda: _run_consumer(
      consumer_tile, count, ctas, load_first, nc, interpret))

  def issue(b, kh, j, slot, barrier_wait):
    rows = (b, pl.ds(j * bk, bk), kh)
    if barrier_wait:
      with jax.named_scope("k_free_wait"):
        plgpu.barrier_wait(k_free.at[slot])
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
    if barrier_wait:
      with jax.named_scope("v_free_wait"):
        plgpu.barrier_wait(v_free.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

  def drain(slot):
    plgpu.barrier_wait(k_free.at[slot])
    plgpu.barrier_wait(v_free.at[slot])

  pl.when(wg == nc)(lambda: _run_producer(
      query_tile, count, ctas, stages, issue, drain, interpret, reverse))


def attention_forward(args, config: MosaicAttentionConfig, return_residuals: bool):
  """(out [B, T, N, Hv], lse [B, N, T] f32 or None) by the forward kernel."""
  sp = triton.Spec.of(args)
  q, k, v = args["query"], args["key"], args["value"]
  bsz, t, n, h = q.shape
  hv = v.shape[3]
  hp, hvp = _round_up(h, 64), _round_up(hv, 64)
  bq, bk, stages = config.block_q, config.block_kv, config.num_stages
  nc = config.consumers
  cta_rows = nc * bq
  # TMA into swizzled tiles of 8 rows needs row counts that are multiples of
  # 8, and boxes may not exceed short arrays: pad (a copy) only then.
  tq_min = max(cta_rows, _round_up(t, 8))
  s_min = max(bk, _round_up(sp.s, 8))
  q = _pad(_pad(q, 3, hp), 1, tq_min)
  k = _pad(_pad(k, 3, hp), 1, s_min)
  v = _pad(_pad(v, 3, hvp), 1, s_min)
  tq = q.shape[1]
  nq = pl.cdiv(tq, cta_rows)
  interpret = pallas_mosaic.INTERPRET.value
  dtype = q.dtype
  scratch = [
      plgpu.SMEM((nc, bq, hp), dtype),
      None if hvp == hp and not config.persistent else plgpu.SMEM((nc, bq, hvp), dtype),
      plgpu.SMEM((stages, bk, hp), dtype),
      plgpu.SMEM((stages, bk, hvp), dtype),
      plgpu.SMEM((nc, bq), jnp.float32) if return_residuals else None,
      plgpu.SMEM((nc, bq, bk), dtype) if interpret else None,
      plgpu.Barrier(num_barriers=nc),  # q_ready
      plgpu.Barrier(num_barriers=stages),  # k_ready
      plgpu.Barrier(num_barriers=stages),  # v_ready
      plgpu.Barrier(num_arrivals=nc, num_barriers=stages),  # k_free
      plgpu.Barrier(num_arrivals=nc, num_barriers=stages),  # v_free
      # sched: the rendezvous (2 consumers) or one token per consumer
      plgpu.Barrier(num_arrivals=2) if nc == 2 else plgpu.Barrier(num_barriers=nc),
  ]
  lengths = [
      x.astype(jnp.int32) for x in
      (args["query_seq_lengths"], args["key_value_seq_lengths"]) if x is not None
  ]
  # Bias/mask tiles: rows up to the last CTA's, keys up to the last block's.
  tiles = [_ts_operand(args[name], t, sp.s, nq * cta_rows, _round_up(sp.s, bk))
           for name in ("bias", "mask") if args[name] is not None]
  out_type = [
      jax.ShapeDtypeStruct((bsz, tq, n, hvp), dtype),
      jax.ShapeDtypeStruct((bsz, n, nq * cta_rows), jnp.float32)
      if return_residuals else None,
  ]
  ctas = _persistent_ctas(bsz * n * nq, config.persistent)
  kernel = plgpu.kernel(
      functools.partial(
          _fwd_kernel, sp=sp, bq=bq, bk=bk, stages=stages, hp=hp, hvp=hvp,
          nc=nc, save_lse=return_residuals, ctas=ctas, interpret=interpret),
      out_type=out_type,
      scratch_types=scratch,
      # CTAs running together are query tiles of a few heads and share their
      # K/V blocks in L2 (`_cta_coords`).
      **_cta_grid(bsz, n, nq, ctas),
      num_threads=nc + 1,
      thread_name="wg",
      compiler_params=pallas_mosaic.compiler_params(approx_math=True),
      interpret=pallas_mosaic.interpret_params(),
      kernel_name="tokamax_attention_fwd_mosaic",
  )
  out, lse = kernel(q, k, v, *tiles, *lengths)
  out = out[:, :t, :, :hv]
  if return_residuals:
    lse = lse[:, :, :t]
  return out, lse


# --- backward ----------------------------------------------------------------


@pydantic.dataclasses.dataclass(frozen=True)
class MosaicAttentionVjpConfig:
  """dk/dv kernel: key rows per consumer WG (CTA: 2x), query rows per step,
  ring depth; dq kernel: query rows per consumer WG, key rows per step, ring
  depth, consumer WGs per CTA (2 or 3)."""

  block_kv: int = 64
  block_q: int = 64
  num_stages: int = 2
  dq_block_q: int = 64
  dq_block_kv: int = 64
  dq_num_stages: int = 2
  dq_consumers: int = 2
  # The dq kernel on one CTA per SM looping over the query tiles (as the
  # forward's `persistent`).
  dq_persistent: bool = False
  # The dk/dv kernel on one CTA per SM looping over the key tiles, its K/V
  # double buffered (`_dkdv_kernel`).
  dkdv_persistent: bool = False

  @pydantic.field_validator("block_kv", "block_q", "dq_block_q", "dq_block_kv")
  @classmethod
  def _blocks(cls, v, info):
    if v not in (64, 128):
      raise ValueError(f"{info.field_name} must be 64 or 128, got {v}")
    return v

  @pydantic.field_validator("num_stages", "dq_num_stages")
  @classmethod
  def _stages(cls, v, info):
    if not 1 <= v <= 4:
      raise ValueError(f"{info.field_name} must be 1..4, got {v}")
    return v

  @pydantic.field_validator("dq_consumers")
  @classmethod
  def _consumers(cls, v):
    if v not in (2, 3):
      raise ValueError(f"dq_consumers must be 2 or 3, got {v}")
    return v


# f32 accumulator values per consumer thread that the dk/dv kernel keeps for
# dk and dv together; above it (head dims 256) it runs twice, dk then dv.
_DKDV_ACC_REGS = 128


def dkdv_passes(config: MosaicAttentionVjpConfig, hp: int, hvp: int):
  """((want_dk, want_dv), ...): one fused pass when both fit in registers."""
  if config.block_kv * (hp + hvp) // 128 <= _DKDV_ACC_REGS:
    return ((True, True),)
  return ((True, False), (False, True))


def vjp_smem_bytes(config: MosaicAttentionVjpConfig, hp: int, hvp: int,
                   itemsize: int, interpret: bool = False,
                   dq_delta: bool = False) -> tuple[int, int]:
  """Shared memory of the (dk/dv, dq) kernels (each buffer 1 KiB aligned);
  `dq_delta`: the dq kernel with its O tiles (`DQ_DELTA`)."""
  r = lambda *xs: sum(_round_up(x, 1024) for x in xs if x) + 2560
  bk, bq, st = config.block_kv, config.block_q, config.num_stages
  kv_bufs = 2 if config.dkdv_persistent else 1
  dkdv = r(kv_bufs * _CONSUMERS * bk * hp * itemsize,
           kv_bufs * _CONSUMERS * bk * hvp * itemsize,
           st * bq * hp * itemsize, st * bq * hvp * itemsize, st * bq * 4,
           st * bq * 4, interpret and _CONSUMERS * bk * bq * itemsize)
  bq, bk, st = config.dq_block_q, config.dq_block_kv, config.dq_num_stages
  nc = config.dq_consumers
  dq = r(nc * bq * hp * itemsize, nc * bq * hvp * itemsize,
         nc * bq * 4, nc * bq * 4, st * bk * hp * itemsize,
         st * bk * hvp * itemsize, interpret and nc * bq * bk * itemsize,
         config.dq_persistent and nc * bq * hp * itemsize,
         dq_delta and nc * bq * hvp * itemsize)
  return dkdv, dq


def dq_computes_delta(config: MosaicAttentionVjpConfig, hp: int, hvp: int,
                      itemsize: int, interpret: bool = False) -> bool:
  """Whether the dq kernel computes D itself (`DQ_DELTA`): its O tiles fit
  shared memory on top of `config`'s buffers (which do not count them, so
  configs and their persistence are chosen as without)."""
  _, dq = vjp_smem_bytes(config, hp, hvp, itemsize, interpret, dq_delta=True)
  return DQ_DELTA and dq <= pallas_mosaic.SMEM_BYTES


def _products(pairs, shape):
  """[a @ b for (a, b) in pairs] (b an SMEM ref, a an SMEM ref or 16-bit
  registers in the WGMMA layout) in fresh f32 accumulators, all issued
  before the first is read (one wait)."""

  def run(*acc_refs):
    for acc_ref, (a, b) in zip(acc_refs, pairs):
      plgpu.wgmma(acc_ref, a, b)
    return tuple(acc_ref[...] for acc_ref in acc_refs)

  return pl.run_scoped(run, *[plgpu.ACC(shape, jnp.float32) for _ in pairs])


def _product_under(pair, shape, work):
  """(work(), a @ b) for pair = (a, b) (as in `_products`): work runs while the
  product does, in a fresh f32 accumulator read after it (EXP_UNDER_DP)."""

  def run(acc_ref):
    plgpu.wgmma(acc_ref, *pair)
    out = work()
    return out, acc_ref[...]

  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _accumulate(acc, lhs, rhs, lhs_smem, interpret: bool):
  """acc + lhs @ rhs: lhs 16-bit registers (WGMMA layout), rhs an SMEM ref.

  The interpreter takes neither register operands nor initialised
  accumulators: there lhs goes through the WG's SMEM tile and the product is
  added in registers.
  """
  if interpret:
    lhs_smem[...] = lhs
    plgpu.commit_smem()
    return acc + _products([(lhs_smem, rhs)], acc.shape)[0]

  def run(acc_ref):
    plgpu.wgmma(acc_ref, lhs, rhs)

  return pl.run_state(run)(plgpu.ACC.init(acc))


def _bwd_probabilities(sp, qk, lse2, band, bias, mask):
  """(p, tanh or None) from q.k, the base-2 lse broadcast like qk, the
  positional band, bias and mask tiles (or None) oriented like qk."""
  raw = triton.raw_scale(sp)
  tanh = None
  if raw is not None:
    p = jnp.exp2(qk * raw - lse2)
  else:
    z = qk * sp.scale
    if bias is not None:
      z = z + bias.astype(jnp.float32)
    if sp.cap is not None:
      tanh = jnp.tanh(z / sp.cap)
      z = sp.cap * tanh
    p = jnp.exp2(z * LOG2E - lse2)
  vis = _visible(band, mask)
  if vis is not None:
    p = jnp.where(vis, p, 0.0)
  return p, tanh


def _key_cta(sp, k_ref, q_len_ref, kv_len_ref, bk: int, bq: int, p=None):
  """Ids and ranges of a CTA of 2 * bk keys on the flat grid of `_cta_grid`
  (p: the tile, default this CTA's): (b, kv head, q_lim, kv_lim, first key,
  query blocks [lo, hi) that see the keys)."""
  bsz, tk, kv_heads, _ = k_ref.shape
  nk = pl.cdiv(tk, _CONSUMERS * bk)
  # Causal/right window: key CTA 0 sees the most query rows (rank 0).
  b, kh, ki = _cta_coords(sp, bsz, kv_heads, nk, p)
  q_lim, kv_lim = _limits(sp, q_len_ref, kv_len_ref, b)
  cta0 = ki * (_CONSUMERS * bk)
  # Query blocks seeing the keys; "full" ones have every row < q_lim seeing
  # every key (see triton._query_blocks: the transposed ranges).
  lo, _, _, hi = triton.blocks_seen(
      cta0, _CONSUMERS * bk, bq, kv_lim, q_lim, sp.right, sp.left, strict=True)
  return b, kh, q_lim, kv_lim, cta0, lo, hi


def _dkdv_kernel(*refs, sp, bk: int, bq: int, stages: int, want_dk: bool,
                 want_dv: bool, ctas: int, interpret: bool):
  """dk, dv for 2 * bk keys of one (batch, kv head) (FlashAttention-2 Alg. 2,
  key-major): WG 2 streams (q, do, lse, delta) tiles of the G query heads
  and the query blocks that see the keys; WGs 0/1 keep their bk keys and
  values in SMEM and dk, dv in registers. ctas > 0: persistent
  (`_persistent_tiles`); the ring runs on across key tiles, K/V are double
  buffered (a consumer loads tile i + 1's once tile i's first step has run,
  or as tile i starts: DKDV_PREFETCH_AT_TILE_START) and dk/dv leave through
  the K/V buffer under the next tile."""
  it = iter(refs)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = (next(it) for _ in range(6))
  bias_ref = next(it) if sp.bias_dims is not None else None  # [b, n, S, T]
  mask_ref = next(it) if sp.mask_dims is not None else None  # [b, n, S, T]
  q_len_ref = next(it) if sp.has_q_len else None
  kv_len_ref = next(it) if sp.has_kv_len else None
  dk_ref, dv_ref = next(it), next(it)
  # k_smem, v_smem: [K/V buffers (2 if persistent), consumers, bk, H];
  # kv_ready: one per (buffer, consumer).
  (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, t_smem, kv_ready,
   ready, free) = it
  dtype = q_ref.dtype
  fuse_dkdv = k_smem.shape[-1] + v_smem.shape[-1] <= FUSE_DKDV_MAX_WIDTH
  kv_regs = (not interpret
             and k_smem.shape[-1] + v_smem.shape[-1] <= DKDV_KV_REGS_MAX_WIDTH)
  bsz, tk, kv_heads, _ = k_ref.shape
  wg = lax.axis_index("wg")
  key_cta = functools.partial(_key_cta, sp, k_ref, q_len_ref, kv_len_ref, bk, bq)
  if ctas:
    count, tile = _persistent_tiles(bsz * kv_heads * pl.cdiv(tk, _CONSUMERS * bk), ctas)
    key_tile = lambda i: key_cta(tile(i))
  else:
    cta, count = key_cta(), 1
    key_tile = lambda i: cta

  def slot_of(step):
    return lax.rem(step, jnp.int32(stages))

  def kv_ready_of(buf):
    return kv_ready.at[buf * _CONSUMERS + wg] if ctas else kv_ready.at[wg]

  def load_kv(i, buf):  # this WG's keys and values of tile i into buffer buf
    b, kh, _, _, cta0, _, _ = key_tile(i)
    rows = (b, pl.ds(cta0 + wg * bk, bk), kh)
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[buf, wg], kv_ready_of(buf))
    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[buf, wg], kv_ready_of(buf))

  def consumer_tile(ti, k0):  # ti: the CTA's tile, k0: its earlier steps
    b, kh, q_lim, kv_lim, cta0, lo, hi = key_tile(ti)
    per_head = hi - lo
    buf = lax.rem(ti, jnp.int32(2)) if ctas else 0
    k0_wg = cta0 + wg * bk
    segments = _clamp_ranges(triton.blocks_seen(
        k0_wg, bk, bq, kv_lim, q_lim, sp.right, sp.left, strict=True), lo, hi)
    k_tile, v_tile = k_smem.at[buf, wg], v_smem.at[buf, wg]
    t_tile = t_smem.at[wg] if interpret else None
    rows = (b, pl.ds(k0_wg, bk), kh)
    if not ctas:
      load_kv(ti, buf)
    plgpu.barrier_wait(kv_ready_of(buf))
    col_layout = plgpu.Layout.WGMMA.reduce(0)  # one value per query column
    k_op, v_op = k_tile, v_tile  # the A operands of s^T and dp^T
    if kv_regs:
      k_op = plgpu.load(k_tile, layout=plgpu.Layout.WGMMA)
      if want_dk:
        v_op = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)

    def prefetch_kv():  # tile ti + 1's K/V into the other buffer, once the
      # stores of tile ti - 1's dk/dv have read it
      @pl.when(ti + 1 < count)
      def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        load_kv(ti + 1, 1 - buf)

    at_start = DKDV_PREFETCH_AT_TILE_START

    def first_step_done(g, i):
      if ctas and not at_start:
        pl.when((g == 0) & (i == lo))(prefetch_kv)

    if ctas and at_start:
      prefetch_kv()

    # Bias/mask tiles [bk, bq] of the transposed operands.
    load_tiles = _tile_loader(sp, bias_ref, mask_ref, b, k0_wg, bq,
                              pl.cdiv(sp.t, bq) - 1, (bk, bq))

    no_tiles = bias_ref is None and mask_ref is None

    def tiles_after(g, i):  # the next step's: block i + 1 or the next head's lo
      if no_tiles:
        return None
      more = i + 1 < hi
      g_next = jnp.where(more, g, jnp.minimum(g + 1, sp.groups - 1))
      return load_tiles(kh * sp.groups + g_next, jnp.where(more, i + 1, lo))

    def step(i, carry, g, mode):
      dk, dv, tiles = carry
      tiles = tiles or (None, None)
      step_in_tile = g * per_head + i - lo
      slot = slot_of(step_in_tile if k0 is None else k0 + step_in_tile)
      nxt = tiles_after(g, i)
      plgpu.barrier_wait(ready.at[slot])
      if mode != "skip":
        q_t, do_t = q_smem.at[slot], do_smem.at[slot]
        bias_t, mask_t = tiles
        # Key-major blocks [bk, bq]: s^T = k q^T, dp^T = v do^T.
        exp_under_dp = "dkdv" in EXP_UNDER_DP and want_dk
        pairs = [(k_op, q_t.T)] + ([(v_op, do_t.T)] if want_dk else [])
        prods = _products(pairs[:1] if exp_under_dp else pairs, (bk, bq))
        first_step_done(g, i)

        def probabilities():
          lse2 = plgpu.load(lse_smem.at[slot], layout=col_layout)
          band = None
          if mode == "masked":
            band = _row_band(sp, i * bq, k0_wg, (bk, bq), q_lim, kv_lim, key_major=True)
          return _bwd_probabilities(
              sp, prods[0], lax.broadcast_in_dim(lse2, (bk, bq), [1]), band,
              bias_t, mask_t)

        if exp_under_dp:  # p^T's exponentials while dp^T = v do^T runs
          (pt, tanh), dpt = _product_under(pairs[1], (bk, bq), probabilities)
          prods = (prods[0], dpt)
        else:
          pt, tanh = probabilities()

        def ds_t():  # ds^T = p^T (dp^T - D), times 1 - tanh^2 under a cap
          delta = plgpu.load(delta_smem.at[slot], layout=col_layout)
          dst = pt * (prods[1] - lax.broadcast_in_dim(delta, (bk, bq), [1]))
          if tanh is not None:
            dst = dst * (1.0 - tanh * tanh)
          return dst.astype(dtype)

        if want_dk and want_dv and not interpret and fuse_dkdv:
          # dv += p^T do runs on the tensor cores while ds^T is computed;
          # then dk += ds^T q, one wait for both (FUSE_DKDV_MAX_WIDTH).
          def both(refs):
            dv_ref, dk_ref = refs
            plgpu.wgmma(dv_ref, pt.astype(dtype), do_t)
            plgpu.wgmma(dk_ref, ds_t(), q_t)

          dv, dk = pl.run_state(both)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
        else:
          if want_dv:
            dv = _accumulate(dv, pt.astype(dtype), do_t, t_tile, interpret)
          if want_dk:
            dk = _accumulate(dk, ds_t(), q_t, t_tile, interpret)
      else:
        first_step_done(g, i)
      plgpu.barrier_arrive(free.at[slot])
      return dk, dv, nxt

    def head(g, carry):
      for start, stop, mode in segments:
        carry = lax.fori_loop(
            start, stop, functools.partial(step, g=g, mode=mode), carry)
      return carry

    acc = lambda w: plgpu.layout_cast(jnp.zeros((bk, w), jnp.float32),
                                      plgpu.Layout.WGMMA)
    carry = (acc(k_tile.shape[1]) if want_dk else None,
             acc(v_tile.shape[1]) if want_dv else None,
             None if no_tiles else load_tiles(kh * sp.groups, lo))
    if sp.groups == 1:
      dk, dv, _ = head(jnp.int32(0), carry)
    else:
      dk, dv, _ = lax.fori_loop(jnp.int32(0), jnp.int32(sp.groups), head, carry)
    if ctas and not at_start:  # a tile that no query block sees runs no step
      pl.when(lo >= hi)(prefetch_kv)
    # The tiles are free: every wgmma reading them has been waited for.
    if want_dk:
      k_tile[...] = (dk * sp.scale).astype(dtype)
    if want_dv:
      v_tile[...] = dv.astype(dtype)
    plgpu.commit_smem()
    if want_dk:
      plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[rows])
    if want_dv:
      plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[rows])
    if not ctas:
      plgpu.wait_smem_to_gmem(0)
      return None
    return k0 + jnp.maximum(per_head, 0) * sp.groups

  pl.when(wg < _CONSUMERS)(lambda: _run_consumer(
      consumer_tile, count, ctas, lambda: load_kv(jnp.int32(0), 0),
      _CONSUMERS, interpret))

  @pl.when(wg == _CONSUMERS)
  def _producer():
    if not interpret:
      plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")

    def producer_tile(i, k0):  # k0: the steps of the CTA's earlier tiles
      b, kh, _, _, _, lo, hi = key_tile(i)
      per_head = jnp.maximum(hi - lo, 0)
      total = per_head * sp.groups

      def issue(step, wait):
        slot = slot_of(k0 + step)
        i = lo + lax.rem(step, per_head)
        n = kh * sp.groups + lax.div(step, per_head)
        if wait:
          plgpu.barrier_wait(free.at[slot])
        rows = (b, pl.ds(i * bq, bq), n)
        stats = (b, n, pl.ds(i * bq, bq))
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(
            delta_ref.at[stats], delta_smem.at[slot], ready.at[slot])

      first = jnp.minimum(jnp.maximum(stages - k0, 0), total)
      pl.loop(jnp.int32(0), first)(lambda s: issue(s, False))
      pl.loop(first, total)(lambda s: issue(s, True))
      return k0 + total

    if ctas:
      steps = lax.fori_loop(0, count, producer_tile, jnp.int32(0))
    else:
      steps = producer_tile(0, jnp.int32(0))
    # The last phases of `free` (the interpreter checks every waiter saw them).
    pl.loop(jnp.maximum(steps - stages, 0), steps)(
        lambda s: plgpu.barrier_wait(free.at[slot_of(s)]))


def _dq_kernel(*refs, sp, bq: int, bk: int, stages: int, nc: int, ctas: int,
               interpret: bool):
  """dq for nc * bq query rows of one (batch, head): WG nc streams the key
  and value blocks the rows see (the forward's ring); WGs 0 .. nc-1 recompute
  p = exp(logits - lse) and ds = p (dp - D) for bq rows each, dq += ds k.
  The consumers run unsynchronised (no turns): each waits for a block, uses
  it and frees it. ctas > 0: persistent, as the forward (`_fwd_kernel`):
  the ring runs on across tiles, a consumer prefetches its next Q, dO, lse
  and D (or O) once its last step's products have run, dq leaves through
  its own buffer. With `o_smem` (`DQ_DELTA`) the sixth input is O [B, T, N,
  Hv], not D: a consumer computes D = rowsum(dO * O) of its rows and writes
  it to the third output (f32 [B, N, T rounded up to whole tiles]) for the
  dk/dv kernel."""
  it = iter(refs)
  q_ref, k_ref, v_ref, do_ref, lse_ref, rows_ref = (next(it) for _ in range(6))
  bias_ref = next(it) if sp.bias_dims is not None else None
  mask_ref = next(it) if sp.mask_dims is not None else None
  q_len_ref = next(it) if sp.has_q_len else None
  kv_len_ref = next(it) if sp.has_kv_len else None
  # dbias: f32 [B, N, T, S] or None; delta_out: D, f32 [B, N, T] or None
  dq_ref, dbias_ref, delta_out_ref = next(it), next(it), next(it)
  (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, t_smem, dq_smem,
   o_smem, q_ready, ready, free) = it
  dtype = q_ref.dtype
  shift = _row_shift("dq", sp, q_ref.shape[1], bq, nc,
                     bias_ref is not None or mask_ref is not None)
  wg, count, query_tile = _query_tiles(
      sp, q_ref, q_len_ref, kv_len_ref, bq, bk, nc, ctas, shift)

  q_t, do_t = q_smem.at[wg], do_smem.at[wg]

  def load_rows(b, n, r0, q_part=True, o_part=True):
    """The WG's Q, dO, lse (and D) rows, and/or its O rows, all arriving on
    q_ready (4 copies per phase, whichever part goes first)."""
    rows, stats = (b, pl.ds(r0, bq), n), (b, n, pl.ds(r0, bq))

    def load():
      if q_part:
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_t, q_ready.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_t, q_ready.at[wg])
        plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[wg], q_ready.at[wg])
        if o_smem is None:
          plgpu.copy_gmem_to_smem(rows_ref.at[stats], delta_smem.at[wg], q_ready.at[wg])
      if o_part and o_smem is not None:
        plgpu.copy_gmem_to_smem(rows_ref.at[rows], o_smem.at[wg], q_ready.at[wg])

    _when(_live(r0, shift), load)

  # Persistent: tile i + 1's Q, dO, lse (D) go out once this WG's last
  # products have run; its O as soon as tile i's D is computed, so that it
  # lands under a whole tile (loaded with the rows, O made the persistent dq
  # kernel 3.3-6.6 % slower at H128, a tile ahead 2.4-3.5 %; H100 2026-12-06).
  early_o = bool(ctas) and o_smem is not None
  first_rows, prefetch_rows = _tile_rows(
      query_tile, count, wg, bq, functools.partial(load_rows, o_part=not early_o))
  first_o, prefetch_o = _tile_rows(
      query_tile, count, wg, bq, functools.partial(load_rows, q_part=False))

  def load_first():
    first_rows()
    if early_o:
      first_o()

  def consumer_tile(i, k0):
    b, n, _, kh, q_lim, kv_lim, cta0, lo, hi = query_tile(i)
    slot_of = _ring(lo, k0, stages)
    r0 = cta0 + wg * bq
    live, rows_lim = _wg_rows(r0, q_lim, shift)
    segments = _clamp_ranges(triton.blocks_seen(
        r0, bq, bk, rows_lim, kv_lim, sp.left, sp.right, strict=False), lo, hi)
    # As in the forward: a last block seen only in its first half is a
    # half step (ds k's contraction stays a multiple of 64: bk >= 128).
    if HALF_LAST_BLOCK and bk % 128 == 0 and bias_ref is None and mask_ref is None:
      segments = _split_last_half(sp, segments, r0, bq, bk, rows_lim, kv_lim)
    rows = (b, pl.ds(r0, bq), n)
    if not ctas:
      load_rows(b, n, r0)
    _when(live, lambda: plgpu.barrier_wait(q_ready.at[wg]))
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    lse_rows = plgpu.load(lse_smem.at[wg], layout=row_layout)
    if o_smem is None:
      delta_rows = plgpu.load(delta_smem.at[wg], layout=row_layout)
    else:  # D = rowsum(dO * O) (FlashAttention-2 Alg. 2, line 4); out with dq
      wgmma = plgpu.Layout.WGMMA
      do_o = (plgpu.load(do_t, layout=wgmma).astype(jnp.float32)
              * plgpu.load(o_smem.at[wg], layout=wgmma).astype(jnp.float32))
      delta_rows = jnp.sum(do_o, axis=1)
      if early_o:  # every thread has read O's buffer (the barrier in commit)
        plgpu.commit_smem()
        prefetch_o(i)
    lse2 = lax.broadcast_in_dim(lse_rows, (bq, bk), [0])
    delta = lax.broadcast_in_dim(delta_rows, (bq, bk), [0])

    def dbias_tile(j):  # d bias = ds (the logits' gradient), 0 where unseen
      return dbias_ref.at[b, n, pl.ds(r0, bq), pl.ds(j * bk, bk)]

    def write_zeros(j):
      dbias_tile(j)[...] = plgpu.layout_cast(
          jnp.zeros((bq, bk), jnp.float32), plgpu.Layout.WGMMA)

    def last_products_done(j):
      if ctas:
        pl.when(j == hi - 1)(lambda: prefetch_rows(i))

    load_tiles = _tile_loader(sp, bias_ref, mask_ref, b, r0, bk,
                              pl.cdiv(sp.s, bk) - 1, (bq, bk))

    def step(j, carry, mode):
      dq, tiles = carry
      nxt = load_tiles(n, j, 1)
      slot = slot_of(j)
      plgpu.barrier_wait(ready.at[slot])
      if mode != "skip":
        k_t, v_t = k_smem.at[slot], v_smem.at[slot]
        t_tile = t_smem.at[wg] if interpret else None
        lse_b, delta_b = lse2, delta
        if mode == "half":  # the first bk / 2 keys (no bias, mask or dbias)
          w = bk // 2
          k_t, v_t = k_smem.at[slot, pl.ds(0, w)], v_smem.at[slot, pl.ds(0, w)]
          t_tile = t_smem.at[wg, :, pl.ds(0, w)] if interpret else None
          lse_b = lax.broadcast_in_dim(lse_rows, (bq, w), [0])
          delta_b = lax.broadcast_in_dim(delta_rows, (bq, w), [0])
        shape = lse_b.shape
        bias, mask = tiles

        def probabilities(qk):
          band = None
          if mode != "full":
            band = _row_band(sp, r0, j * bk, shape, q_lim, kv_lim)
          return _bwd_probabilities(sp, qk, lse_b, band, bias, mask)

        if "dq" in EXP_UNDER_DP:  # p's exponentials while dp = do v^T runs
          (qk,) = _products([(q_t, k_t.T)], shape)
          (p, tanh), dp = _product_under((do_t, v_t.T), shape,
                                         lambda: probabilities(qk))
          last_products_done(j)  # (after dp: the next rows overwrite do_t)
        else:
          qk, dp = _products([(q_t, k_t.T), (do_t, v_t.T)], shape)
          last_products_done(j)
          p, tanh = probabilities(qk)
        ds = p * (dp - delta_b)
        if tanh is not None:
          ds = ds * (1.0 - tanh * tanh)
        if dbias_ref is not None:
          dbias_tile(j)[...] = ds
        dq = _accumulate(dq, ds.astype(dtype), k_t, t_tile, interpret)
      else:
        last_products_done(j)
        if dbias_ref is not None:
          write_zeros(j)
      plgpu.barrier_arrive(free.at[slot])
      return dq, nxt

    carry = (plgpu.layout_cast(jnp.zeros(q_t.shape, jnp.float32), plgpu.Layout.WGMMA),
             load_tiles(n, lo))
    for start, stop, mode in segments:
      carry = lax.fori_loop(start, stop, functools.partial(step, mode=mode), carry)
    if ctas:  # a tile without key blocks: the rows' buffers are not in use
      pl.when(lo >= hi)(lambda: prefetch_rows(i))
    dq, _ = carry
    if dbias_ref is not None:  # zeros in the key blocks the rows never see
      # lo (= hi) passes the last key block for rows past every key (a left
      # window with T > S): the stores are unchecked, so clamp both loops.
      blocks = jnp.int32(dbias_ref.shape[3] // bk)
      pl.loop(jnp.int32(0), jnp.minimum(lo, blocks))(write_zeros)
      pl.loop(jnp.minimum(hi, blocks), blocks)(write_zeros)
    # Rows >= q_lim (lse = +inf there) get 0.
    qrows = r0 + plgpu.broadcasted_iota(
        jnp.int32, dq.shape, 0, layout=plgpu.Layout.WGMMA)
    if ctas:  # the previous tile's stores have read dq's (and D's) buffer
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    out_t = dq_smem.at[wg] if ctas else q_t
    out_t[...] = jnp.where(qrows < q_lim, dq * sp.scale, 0.0).astype(dtype)
    if o_smem is not None:
      delta_smem.at[wg][...] = delta_rows
    plgpu.commit_smem()

    def store():
      plgpu.copy_smem_to_gmem(out_t, dq_ref.at[rows])
      if o_smem is not None:
        plgpu.copy_smem_to_gmem(delta_smem.at[wg], delta_out_ref.at[b, n, pl.ds(r0, bq)])

    _when(live, store)
    if not ctas:
      plgpu.wait_smem_to_gmem(0)
      return None
    return k0 + jnp.maximum(hi - lo, 0)

  pl.when(wg < nc)(lambda: _run_consumer(
      consumer_tile, count, ctas, load_first, nc, interpret))

  def issue(b, kh, j, slot, wait):
    if wait:
      plgpu.barrier_wait(free.at[slot])
    rows = (b, pl.ds(j * bk, bk), kh)
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], ready.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], ready.at[slot])

  pl.when(wg == nc)(lambda: _run_producer(
      query_tile, count, ctas, stages, issue,
      lambda slot: plgpu.barrier_wait(free.at[slot]), interpret))


def attention_backward(args, residuals, out, dout, config: MosaicAttentionVjpConfig,
                       want_dbias: bool = True):
  """Gradients {query, key, value[, bias]} from the forward's lse (f32
  [B, N, T]); the bias's only if there is one and `want_dbias`."""
  sp = triton.Spec.of(args)
  q, k, v = args["query"], args["key"], args["value"]
  bsz, t, n, h = q.shape
  s, kv_heads, hv = k.shape[1], k.shape[2], v.shape[3]
  hp, hvp = _round_up(h, 64), _round_up(hv, 64)
  dtype = q.dtype
  interpret = pallas_mosaic.INTERPRET.value
  itemsize = jnp.dtype(dtype).itemsize
  dq_delta = dq_computes_delta(config, hp, hvp, itemsize, interpret)
  # lse in base 2, f32 [B, N, T]; rows past the query length get lse = +inf,
  # so p = 0 there in every block. D = rowsum(do * o), f32 [B, N, T], by the
  # dq kernel (`DQ_DELTA`) or here.
  lse2 = residuals["lse"].astype(jnp.float32) * LOG2E
  q_len, kv_len = args["query_seq_lengths"], args["key_value_seq_lengths"]
  if q_len is not None:
    lse2 = jnp.where(jnp.arange(t) < q_len[:, None, None], lse2, jnp.inf)
  # Row counts: multiples of 8 (TMA into 8-row tiles), at least one block.
  dq_nc = config.dq_consumers
  tq = max(dq_nc * config.dq_block_q, config.block_q, _round_up(t, 8))
  tk = max(_CONSUMERS * config.block_kv, config.dq_block_kv, _round_up(s, 8))
  q = _pad(_pad(q, 3, hp), 1, tq)
  do = _pad(_pad(dout.astype(dtype), 3, hvp), 1, tq)
  k = _pad(_pad(k, 3, hp), 1, tk)
  v = _pad(_pad(v, 3, hvp), 1, tk)
  lse2 = _pad(lse2, 2, tq)
  if dq_delta:
    rows_in = _pad(_pad(out.astype(dtype), 3, hvp), 1, tq)
  else:
    rows_in = _pad(jnp.swapaxes(jnp.sum(
        dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), 1, 2), 2, tq)
  lengths = [x.astype(jnp.int32) for x in (q_len, kv_len) if x is not None]
  # Bias/mask tiles: the dq kernel reads [rows, keys] up to its last CTA's
  # rows and last key block, the dk/dv kernel [keys, rows] (transposed).
  rows = max(_round_up(tq, dq_nc * config.dq_block_q),
             _round_up(t, config.block_q))
  cols = max(_round_up(s, config.dq_block_kv),
             _round_up(tk, _CONSUMERS * config.block_kv))
  tiles = [_ts_operand(args[name], t, s, rows, cols)
           for name in ("bias", "mask") if args[name] is not None]
  dkdv_tiles = [jnp.swapaxes(x, 2, 3) for x in tiles]
  inputs = (q, k, v, do, lse2, rows_in, *tiles, *lengths)
  common = dict(thread_name="wg",
                compiler_params=pallas_mosaic.compiler_params(approx_math=True),
                interpret=pallas_mosaic.interpret_params())
  grads = {}

  bq, bk, st = config.dq_block_q, config.dq_block_kv, config.dq_num_stages
  nq = pl.cdiv(tq, dq_nc * bq)
  dq_ctas = _persistent_ctas(bsz * n * nq, config.dq_persistent)
  dq, dbias, delta = plgpu.kernel(
      functools.partial(_dq_kernel, sp=sp, bq=bq, bk=bk, stages=st, nc=dq_nc,
                        ctas=dq_ctas, interpret=interpret),
      out_type=[
          jax.ShapeDtypeStruct((bsz, tq, n, hp), dtype),
          jax.ShapeDtypeStruct((bsz, n, nq * dq_nc * bq, _round_up(s, bk)),
                               jnp.float32)
          if sp.bias_dims is not None and want_dbias else None,
          # Whole tiles of rows: a TMA store of a contiguous row slice is a
          # plain bulk copy, clipped only at the buffer's end, so a partial
          # last tile would write into the next head's rows.
          jax.ShapeDtypeStruct((bsz, n, nq * dq_nc * bq), jnp.float32)
          if dq_delta else None,
      ],
      scratch_types=[
          plgpu.SMEM((dq_nc, bq, hp), dtype),
          plgpu.SMEM((dq_nc, bq, hvp), dtype),
          plgpu.SMEM((dq_nc, bq), jnp.float32),
          plgpu.SMEM((dq_nc, bq), jnp.float32),
          plgpu.SMEM((st, bk, hp), dtype),
          plgpu.SMEM((st, bk, hvp), dtype),
          plgpu.SMEM((dq_nc, bq, bk), dtype) if interpret else None,
          plgpu.SMEM((dq_nc, bq, hp), dtype) if dq_ctas else None,  # dq out
          plgpu.SMEM((dq_nc, bq, hvp), dtype) if dq_delta else None,  # O
          plgpu.Barrier(num_arrivals=4, num_barriers=dq_nc),  # q_ready
          plgpu.Barrier(num_arrivals=2, num_barriers=st),  # ready
          plgpu.Barrier(num_arrivals=dq_nc, num_barriers=st),  # free
      ],
      **_cta_grid(bsz, n, nq, dq_ctas),
      num_threads=dq_nc + 1,
      kernel_name="tokamax_attention_bwd_dq_mosaic",
      **common,
  )(*inputs)
  grads["query"] = dq[:, :t, :, :h]
  if dbias is not None:  # summed over the bias's broadcast dims
    axes = tuple(a for a, full in enumerate(sp.bias_dims) if not full)
    dbias = jnp.sum(dbias[:, :, :t, :s], axis=axes, keepdims=True)
    grads["bias"] = dbias.astype(args["bias"].dtype)
  if delta is None:
    delta = rows_in

  bk, bq, st = config.block_kv, config.block_q, config.num_stages
  nk = pl.cdiv(tk, _CONSUMERS * bk)
  dkdv_ctas = _persistent_ctas(bsz * kv_heads * nk, config.dkdv_persistent)
  kv_bufs = 2 if dkdv_ctas else 1
  for want_dk, want_dv in dkdv_passes(config, hp, hvp):
    dk, dv = plgpu.kernel(
        functools.partial(_dkdv_kernel, sp=sp, bk=bk, bq=bq, stages=st,
                          want_dk=want_dk, want_dv=want_dv, ctas=dkdv_ctas,
                          interpret=interpret),
        out_type=[
            jax.ShapeDtypeStruct((bsz, tk, kv_heads, hp), dtype) if want_dk else None,
            jax.ShapeDtypeStruct((bsz, tk, kv_heads, hvp), dtype) if want_dv else None,
        ],
        scratch_types=[
            plgpu.SMEM((kv_bufs, _CONSUMERS, bk, hp), dtype),
            plgpu.SMEM((kv_bufs, _CONSUMERS, bk, hvp), dtype),
            plgpu.SMEM((st, bq, hp), dtype),
            plgpu.SMEM((st, bq, hvp), dtype),
            plgpu.SMEM((st, bq), jnp.float32),
            plgpu.SMEM((st, bq), jnp.float32),
            plgpu.SMEM((_CONSUMERS, bk, bq), dtype) if interpret else None,
            plgpu.Barrier(num_arrivals=2, num_barriers=kv_bufs * _CONSUMERS),  # kv_ready
            plgpu.Barrier(num_arrivals=4, num_barriers=st),  # ready
            plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=st),  # free
        ],
        # CTAs in flight share a head's q/do tiles in L2 (`_cta_coords`).
        **_cta_grid(bsz, kv_heads, nk, dkdv_ctas),
        num_threads=_CONSUMERS + 1,
        kernel_name="tokamax_attention_bwd_dkdv_mosaic",
        **common,
    )(q, k, v, do, lse2, delta, *dkdv_tiles, *lengths)
    if want_dk:
      grads["key"] = dk[:, :s, :, :h]
    if want_dv:
      grads["value"] = dv[:, :s, :, :hv]
  # Inside shard_map the kernels' outputs carry no mesh axes: declare that
  # each gradient varies like its primal (a custom VJP must match types).
  union = frozenset().union(*(op_lib.varying(x) for x in inputs))
  return {name: op_lib.vary_over(g, union) for name, g in grads.items()}


# --- configs -----------------------------------------------------------------


def _shape(ba):
  q, k, v = ba.arguments["query"], ba.arguments["key"], ba.arguments["value"]
  return (q.shape[1], k.shape[1], _round_up(q.shape[3], 64),
          _round_up(v.shape[3], 64), jnp.dtype(q.dtype).itemsize)


def _fits(c: MosaicAttentionConfig, hp: int, hvp: int, itemsize: int) -> bool:
  return smem_bytes(c, hp, hvp, itemsize) <= pallas_mosaic.SMEM_BYTES


def _rounds(t: int, grid: int, nc: int) -> int:
  """Rounds of query tiles (nc x 64 rows) of `grid` (batch, head) pairs of
  T rows over one persistent CTA per SM."""
  return -(-grid * -(-t // (nc * 64)) // _persistent_cta_limit())


def _consumers_by_rounds(t: int, grid: int, row_cost: float) -> int:
  """2 where two consumers' smaller tiles fill the last round of tiles
  enough to win, else 3. Cost: rounds x rows per tile, times `row_cost` (a
  row's time with two consumers against three) for two. grid: batch x query
  heads, 0 unknown (3). Causal/windowed tiles too (measured up to 4 rounds)."""
  if grid and _rounds(t, grid, 2) * 2 * row_cost < _rounds(t, grid, 3) * 3:
    return 2
  return 3


def _forward_consumers(t: int, hvp: int, tiles: bool, grid: int) -> int:
  """Three consumers where the O accumulator is small (value head dims <=
  64) and no bias/mask `tiles` ride along, else two; but two also where
  their smaller tiles fill the last round enough to win
  (`_consumers_by_rounds`)."""
  if hvp > 64 or tiles:
    return 2
  return _consumers_by_rounds(t, grid, TWO_CONSUMERS_ROW_COST)


def heuristic_config(t: int, s: int, hp: int, hvp: int, itemsize: int,
                     tiles: bool = False, grid: int = 0) -> MosaicAttentionConfig:
  """The fastest H200 configs (docs/benchmarks.md): 64 rows per consumer,
  128-key steps and a 2-deep ring where shared memory allows; three
  consumers where the O accumulator is small (value head dims <= 64: seed
  shape 1.27 -> 1.14 ms), two above (at 152 registers a third spills) and
  with bias/mask `tiles` (held in registers a step ahead; three consumers
  not measured there) or where few tiles leave the last round part empty
  (`_forward_consumers`; grid: batch x query heads, 0 unknown); persistent
  where its O buffer fits (H200, 2026-12-05: forward 1.4-4.5 % faster at
  every benchmark shape)."""
  del s
  nc = _forward_consumers(t, hvp, tiles, grid)
  for bk, persistent in itertools.product((128, 64), (True, False)):
    c = MosaicAttentionConfig(block_q=64, block_kv=bk, num_stages=2, consumers=nc,
                              persistent=persistent)
    if _fits(c, hp, hvp, itemsize):
      return c
  return MosaicAttentionConfig(block_q=64, block_kv=64, num_stages=1)


def search_space(t: int, s: int, hp: int, hvp: int, itemsize: int,
                 tiles: bool = False) -> set[MosaicAttentionConfig]:
  del t, s
  configs = set()
  for bq, bk, stages, nc in itertools.product(
      (64, 128), (64, 128, 256), (2, 3, 4), (2,) if tiles else (2, 3)):
    # f32 values per consumer thread: S block plus the O accumulator (232
    # registers with 2 consumers, 152 with 3).
    if bq * (bk + hvp) // 128 > (192 if nc == 2 else 96):
      continue
    # Persistent (faster at every shape measured) where its O buffer fits.
    for persistent in (True, False):
      c = MosaicAttentionConfig(block_q=bq, block_kv=bk, num_stages=stages,
                                consumers=nc, persistent=persistent)
      if _fits(c, hp, hvp, itemsize):
        configs.add(c)
        break
  return configs


def _vjp_fits(c: MosaicAttentionVjpConfig, hp: int, hvp: int, itemsize: int) -> bool:
  interpret = pallas_mosaic.INTERPRET.value
  return max(vjp_smem_bytes(c, hp, hvp, itemsize, interpret)) <= pallas_mosaic.SMEM_BYTES


def _vjp_regs_ok(c: MosaicAttentionVjpConfig, hp: int, hvp: int) -> bool:
  """f32 values per consumer thread: accumulators plus the two [M, N] blocks
  (s and dp) of each kernel, within what a consumer's registers hold (232
  with 2 consumers, 152 with 3; 40 left for the rest). It rules out three
  dq consumers at head dim 128 (128 values), measured 12-21 % slower there
  (H200 2026-12-03)."""
  dkdv_acc = max(c.block_kv * (w_dk * hp + w_dv * hvp) // 128
                 for w_dk, w_dv in dkdv_passes(c, hp, hvp))
  dkdv = dkdv_acc + 2 * c.block_kv * c.block_q // 128
  dq = c.dq_block_q * hp // 128 + 2 * c.dq_block_q * c.dq_block_kv // 128
  return (dkdv <= _consumer_regs(_CONSUMERS) - 40
          and dq <= _consumer_regs(c.dq_consumers) - 40)


def _dkdv_persistent(c: MosaicAttentionVjpConfig, s: int, hp: int, hvp: int,
                     banded: bool, kv_pairs: int) -> bool:
  """Whether the heuristic runs the dk/dv kernel persistent (with c's key
  tiles over kv_pairs (batch, kv head) pairs; DKDV_PERSISTENT_MAX_WIDTH)."""
  if hp + hvp > DKDV_PERSISTENT_MAX_WIDTH:
    return False
  tiles = kv_pairs * pl.cdiv(s, _CONSUMERS * c.block_kv)
  return not banded or tiles >= DKDV_PERSISTENT_MIN_BANDED_ROUNDS * _persistent_cta_limit()


def _with_persistence(c: MosaicAttentionVjpConfig, s: int, hp: int, hvp: int,
                      itemsize: int, banded: bool, kv_pairs: int):
  """c with its kernels persistent where the heuristic rules say so and the
  buffers fit (dq first, then dk/dv), or None if c itself does not fit."""
  want = dict(dq_persistent=not banded,
              dkdv_persistent=_dkdv_persistent(c, s, hp, hvp, banded, kv_pairs))
  for field in ("dq_persistent", "dkdv_persistent"):
    if want[field]:
      trial = dataclasses.replace(c, **{field: True})
      if _vjp_fits(trial, hp, hvp, itemsize):
        c = trial
  return c if _vjp_fits(c, hp, hvp, itemsize) else None


def vjp_heuristic_config(t: int, s: int, hp: int, hvp: int, itemsize: int,
                         banded: bool = True, kv_pairs: int = 1,
                         q_pairs: int = 0) -> MosaicAttentionVjpConfig:
  """64-row tiles with the deepest ring (up to 2) that fits shared memory;
  at head dim 64 the dq kernel runs three consumers over 64-key steps (seed
  shape forward+backward 2.78 -> 2.70 ms causal, 4.86 -> 4.68-4.75 ms not,
  H200 2026-12-03, docs/benchmarks.md); above, two (a third would spill).
  The dq kernel is persistent unless a causal mask or a window makes its
  tiles `banded` (H200 2026-12-05: dq 5 % faster at the seed shape, 2 % at
  H128, non-causal; 1-4 % slower causal) and its dq buffer fits; the dk/dv
  kernel at head dims up to 64 (`_dkdv_persistent`; kv_pairs: batch x kv
  heads). Two dq consumers also where, on few equal tiles, their smaller
  tiles fill the last round enough to win (`_consumers_by_rounds`; q_pairs:
  batch x query heads, 0 unknown; H100 2026-12-07: dq 23-25 % faster at
  B1 N8 T2048/T4096, 17-20 % causal at B1 T2048 N8 and T1024 N16)."""
  dq_nc = 3 if hp + hvp <= 128 else 2
  if dq_nc == 3:
    dq_nc = _consumers_by_rounds(t, q_pairs, DQ_TWO_CONSUMERS_ROW_COST)
  for stages in (2, 1):
    c = _with_persistence(
        MosaicAttentionVjpConfig(num_stages=stages, dq_num_stages=stages,
                                 dq_consumers=dq_nc),
        s, hp, hvp, itemsize, banded, kv_pairs)
    if c is not None:
      return c
  return MosaicAttentionVjpConfig(num_stages=1, dq_num_stages=1)


def vjp_search_space(t: int, s: int, hp: int, hvp: int, itemsize: int,
                     banded: bool = True, kv_pairs: int = 1
                     ) -> set[MosaicAttentionVjpConfig]:
  """Rings of 2-3 stages (1 was 1.4x slower on the H200), 2 or 3 dq
  consumers, and the tiles that fit the registers, each once: its kernels
  persistent by the heuristic's rules where their buffers fit. The
  heuristic config (1 stage at head dim 256) is in too."""
  configs = {vjp_heuristic_config(t, s, hp, hvp, itemsize, banded, kv_pairs)}
  for bk, bq, st, dbk, dst, dnc in itertools.product(
      (64, 128), (64, 128), (2, 3), (64, 128), (2, 3), (2, 3)):
    c = MosaicAttentionVjpConfig(block_kv=bk, block_q=bq, num_stages=st,
                                 dq_block_q=64, dq_block_kv=dbk, dq_num_stages=dst,
                                 dq_consumers=dnc)
    if _vjp_regs_ok(c, hp, hvp):
      c = _with_persistence(c, s, hp, hvp, itemsize, banded, kv_pairs)
      if c is not None:
        configs.add(c)
  return configs


# --- ops ---------------------------------------------------------------------


def check_supported(op: op_lib.Op, ba: op_lib.BoundArguments) -> None:
  pallas_mosaic.check_platform(op)
  pallas_triton.check_not_explicitly_sharded(op, ba)
  args = ba.arguments
  pallas_mosaic.check_dtype(op, "query", args["query"].dtype)
  h, hv = args["query"].shape[3], args["value"].shape[3]
  if max(h, hv) > MAX_HEAD_DIM:
    raise op.unsupported(
        f"head dims up to {MAX_HEAD_DIM} (wgmma tile widths); got H={h}, Hv={hv}."
    )
  if not _fits(heuristic_config(*_shape(ba)), *_shape(ba)[2:]):
    raise op.unsupported("the head dims do not fit in shared memory.")


def _kv_pairs(ba: op_lib.BoundArguments) -> int:
  """(batch, kv head) pairs: the dk/dv kernel's grid is these x key tiles."""
  k = ba.arguments["key"]
  return k.shape[0] * k.shape[2]


def _grid(ba: op_lib.BoundArguments) -> int:
  """(batch, query head) pairs: the forward's grid is these x query tiles."""
  q = ba.arguments["query"]
  return q.shape[0] * q.shape[2]


def _banded(ba: op_lib.BoundArguments) -> bool:
  """Whether a causal mask or a window bounds the keys each row sees (tiles
  of unequal work)."""
  return bool(ba.arguments["is_causal"]) or ba.arguments["local_window_size"] is not None


def _has_tiles(ba: op_lib.BoundArguments) -> bool:
  """Whether the forward reads bias or mask tiles."""
  return ba.arguments["bias"] is not None or ba.arguments["mask"] is not None


class _MosaicAttentionMixin:
  """Support checks and config lookup (shared by the forward and the VJP)."""

  # The heuristics are per shape (consumers by rounds, persistence by tile
  # counts) and equal the shipped H200 configs at their shapes, so an
  # uncached shape takes its heuristic, not the nearest cached shape's: at
  # B1 T4096 N8 H64 that would be the seed shape's three consumers, 0.71x
  # cuDNN against 0.94x with two (H100 2026-12-07, docs/benchmarks.md).
  borrows_nearest_config = False

  def supported_on(self, device) -> bool:
    return pallas_mosaic.supported_on(device)

  def check_supported(self, ba):
    check_supported(self, ba)


@dataclasses.dataclass(frozen=True)
class MosaicDotProductAttentionVjp(_MosaicAttentionMixin, base.DotProductAttentionVjp):
  """dk/dv and dq kernels in Pallas:Mosaic GPU from the lse residual."""

  implementation = "mosaic"
  config_cls = MosaicAttentionVjpConfig

  def _get_heuristics_config(self, ba):
    return vjp_heuristic_config(*_shape(ba), banded=_banded(ba),
                                kv_pairs=_kv_pairs(ba), q_pairs=_grid(ba))

  def _get_autotuning_configs(self, ba):
    return vjp_search_space(*_shape(ba), banded=_banded(ba), kv_pairs=_kv_pairs(ba))

  def _fwd(self, *, residuals, out, dout, config, return_residuals, **args):
    del return_residuals
    if not _vjp_fits(config, *_shape_of_args(args)):
      raise self.unsupported(f"config {config} exceeds shared memory.")
    return attention_backward(args, residuals, out, dout, config,
                              want_dbias="bias" not in self.skip_grads), None


@dataclasses.dataclass(frozen=True)
class MosaicDotProductAttention(_MosaicAttentionMixin, base.DotProductAttention):
  """FlashAttention-3 forward in Pallas:Mosaic GPU (Hopper), Mosaic VJP."""

  implementation = "mosaic"
  config_cls = MosaicAttentionConfig
  vjp: op_lib.Op | None = dataclasses.field(
      default_factory=MosaicDotProductAttentionVjp
  )

  def _get_heuristics_config(self, ba):
    return heuristic_config(*_shape(ba), tiles=_has_tiles(ba), grid=_grid(ba))

  def _get_autotuning_configs(self, ba):
    return search_space(*_shape(ba), tiles=_has_tiles(ba))

  def _fwd(self, *, config, return_residuals, **args):
    if not _fits(config, *_shape_of_args(args)):
      raise self.unsupported(f"config {config} exceeds shared memory.")
    out, lse = attention_forward(args, config, return_residuals)
    return out, ({"lse": lse} if return_residuals else None)


def _shape_of_args(args):
  q, v = args["query"], args["value"]
  return _round_up(q.shape[3], 64), _round_up(v.shape[3], 64), jnp.dtype(q.dtype).itemsize
