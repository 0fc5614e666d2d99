"""The "triton" implementation of layer_norm: Pallas:Triton kernels.

Canonical views (free reshapes, no copies): normalising the last axis (or one
followed only by size-1 dims) x is [R, F]; any other axis gives [pre, F,
post]. One program of the [R, F] forward grid handles a tile [block_rows, Fp]
of consecutive rows (Fp = next_pow2(F): Triton blocks are powers of two;
features >= F and rows out of range are masked). Statistics and arithmetic
are in f32.

Forward of [pre, F, post]: where one [Fp, block] slab of columns holds all
of post (a contiguous block of x) or F <= 512, one kernel over such slabs;
otherwise two kernels over [chunk, block] tiles whose rows are `block`
contiguous columns (coalesced whatever F is): per-column mean and M2 merged
over chunks (Chan et al.), then y. Narrow slabs at large F read rows of a
few bytes and ran up to 10x slower (`_column_forward`).

Forward (per row): mean = sum(x)/F, xc = x - mean (x for RMS norm),
rstd = rsqrt(sum(xc^2)/F + eps), y = xc * rstd * (scale + scale_offset) + offset.
Residuals are those of the XLA reference: (mean or None, rstd), f32, keepdims
shapes (x's shape with 1 on the normalised axis), so either VJP reads either
forward's residuals.

Backward of [R, F]: a grid of G programs; program p handles row blocks p,
p + G, ... computing dx (formula in xla.LayerNormVjp) and accumulating the
per-column partial sums dscale_p = sum(dy * xhat), doffset_p = sum(dy) over
its rows in f32 registers; they are written to [G, F] f32 buffers and summed
over G by XLA (no atomics, deterministic). G is capped near the number of
resident programs so the partial buffers stay small next to x.

Backward of [pre, F, post]: two kernels over [chunk, block] tiles (rows of
`block` contiguous columns, so loads coalesce whatever F is). The first
streams each column's features once for the sums over F of g * xhat and g
(g = dy * scale) and per-feature partials of dscale/doffset; the second
writes dx from them. x and dy are read twice: about 5 bytes moved per 3 of
a one-pass kernel, which would need a whole [F, block] slab in registers
and so blocks too narrow to coalesce (8-byte rows at F = 4096).

Rows wider than MAX_FEATURES (16384, what a program holds in registers)
run chunked kernels (config.feature_chunk): the forward streams each row
block twice in chunks (shifted sums for the statistics, then y), the
backward is the split one with its row sums also by chunks. A [pre, F,
post] view wider than that always takes the two column kernels, which
stream F in chunks anyway.

Supported: NVIDIA sm_80+ (or interpret mode, see `interpret_mode`), bf16/f16/
f32 inputs and parameters, any axis, any F.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import pydantic
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from tokamax._src import op as op_lib
from tokamax._src import pallas_triton
from tokamax._src.pallas_triton import (  # noqa: F401 (public re-exports)
    INTERPRET, interpret_mode,
)
from tokamax.ops.normalization import xla

_is_pow2 = pallas_triton.is_pow2
_next_pow2 = pallas_triton.next_pow2
_prev_pow2 = pallas_triton.prev_pow2
_i32 = pallas_triton.i32


# Widest rows a program holds whole in registers. Wider [R, F] rows run the
# chunked kernels (config.feature_chunk: the chunked forward and the split
# backward), wider [pre, F, post] views the column kernels (forward and
# backward); neither has a width limit. Above MAX_FEATURES `implementation=
# None` takes XLA's VJP for rows (`preferred`).
MAX_FEATURES = 16384
# Heuristic configs above MAX_FEATURES (not swept; timed on the H200 against
# XLA, see `preferred`):
# forward one row per program of 4 warps, 4 programs per SM, 2048-feature
# chunks; backward as at 16384 features.
_WIDE_FORWARD = (1, 4, 4, 3, 2048)  # block_rows, warps, programs_per_sm, loop_stages, chunk
_WIDE_BACKWARD = (1, 8, 1, 0, 3, 2048)  # as _VJP_CONFIGS entries
# Loop trips loaded ahead when a config leaves `prefetch` None. Looping
# forward: tiles loaded this many trips ahead of the one normalised (so
# depth + 1 tiles in flight per program; num_stages does not make Triton
# pipeline these loads). H200: 8192^2 3.24 -> 3.48 TB/s, 65536x1024 3.67 ->
# 3.81 at depth 1 (docs/benchmarks.md); benchmarks/layer_norm_loop_sweep.py
# sweeps it. Backward: blocks of x and dy loaded this many trips ahead of the
# one differentiated; 0 by default, 1 in the measured configs where it is
# faster (F = 8192; docs/benchmarks.md 2026-12-03 18:24).
LOOP_PREFETCH = 1
VJP_PREFETCH = 0
# None: heuristic configs as measured (tables below); n: every heuristic
# config takes loop_stages n (n >= 2: Triton pipelines the loops' loads
# through shared memory, no register prefetch; 0: off, the module's
# register prefetch). For A/B runs.
HEURISTIC_LOOP_STAGES: int | None = None
# Heuristic targets: bytes a forward program moves (x read + y written), and
# f32 values per thread in one [block_rows, Fp] tile (register budget; the
# backward keeps ~4 such tiles live).
_TARGET_BYTES = 32 * 1024
_VALUES_PER_THREAD = 32
# [pre, F, post] backward: bytes of x per [chunk, block] tile of its two
# kernels (the feature chunk follows from the block's width), the
# heuristic's columns per tile (256-byte rows of 16-bit x) and warps, and
# the first kernel's programs per SM (its F loop is split to reach them).
# The fastest of 16-128 columns x 4/8/16 warps x 8-32 KiB tiles on the H200
# at [16, 1024, 4096] and [64, 4096, 256] (docs/benchmarks.md 2026-12-03 21:00).
_COLUMN_TILE_BYTES = 8 * 1024
_COLUMN_BLOCK = 128
_COLUMN_WARPS = 4
_SPLIT_PROGRAMS_PER_SM = 4
# f32 values per thread of the one-kernel [pre, F, post] forward's slabs.
_SLAB_VALUES_PER_THREAD = 128
# [pre, F, post] forward by two kernels over the backward's [chunk, block]
# tiles (statistics, then y) instead of one holding [Fp, block] slabs: None
# chooses by shape (`_column_forward`), True / False force either.
COLUMN_FORWARD: bool | None = None
# Forward of [R, F] views: (block_rows, warps, programs_per_sm[,
# loop_stages]) by the itemsize of x and Fp, the fastest configs on the H200
# (benchmarks/layer_norm_loop_sweep.py, docs/benchmarks.md 2026-12-03 and
# 2026-12-04). Without loop_stages the program loads its next tile ahead in
# registers (LOOP_PREFETCH); with it Triton pipelines the loads through
# shared memory (no register prefetch).
# 16-bit x, 2026-12-04 (05:30) sweeps, TB/s, f32 parameters, against the
# register-prefetch config used before, timed in the same run: 1024 3.84
# against 3.79 (that sweep's best with register prefetch); 2048 3.82
# against 3.74; 4096 3.78 against 3.62; 8192 3.77 against 3.44; 16384 3.71
# against 3.45; 512 unchanged (3.80; with loop_stages 3.81).
# Earlier (2026-12-03 13:33 sweeps), register prefetch against the rule
# below (f32 / bf16 parameters): 512 3.82 / 3.83 against 3.74 / 3.78.
# f32 x (15:40 sweeps, three runs, f32 parameters; loop_stages not yet
# measured), medians against the rule: 512 3.92 against 3.90; 1024 3.90
# against 3.87; 2048 3.92 against 3.83; 4096 3.90 against 3.35; 8192 3.81
# against 3.72; 16384 the rule's (3.42).
# One-warp programs (2026-12-04 10:00 sweeps, two or three runs each): a
# row's sums stay within a warp (shuffles, no barrier); 32 programs per SM
# at 1024 features (3.88-3.90 against 3.74-3.80 for the entry before), 16
# at 512 (3.89-3.92 against 3.78-3.82) and 2048 (3.86 against 3.81-3.82).
# At 4096 and above a row holds too many values for one warp's registers
# (16384x4096 one warp 1.6-1.9 TB/s, 2 warps at most 3.68 against 3.73).
# f32 x: one warp at 1024 features, 3.98-4.01 against 3.94-3.95 (two runs);
# at 512 and 2048 slower or on par with the entries below.
_LOOP_CONFIGS = {
    2: {512: (1, 1, 16, 3), 1024: (1, 1, 32, 3), 2048: (1, 1, 16, 3), 4096: (2, 16, 2, 3),
        8192: (2, 8, 1, 3), 16384: (1, 8, 1, 3)},
    4: {512: (4, 4, 0), 1024: (1, 1, 32, 3), 2048: (1, 8, 4), 4096: (1, 16, 2),
        8192: (2, 16, 1), 16384: (1, 16, 1)},
}
# Backward of [R, F] views, the same keys, (block_rows, warps,
# programs_per_sm, prefetch[, loop_stages[, feature_chunk]]) (programs_per_sm: at most that
# many programs per SM, 0 = 32 // warps). The fastest in H200 sweeps
# (benchmarks/layer_norm_vjp_sweep.py), vjp-mode ms (the forward included)
# against the best without loop_stages in the same run:
# 16-bit x (2026-12-04 05:40): 512 0.178 against 0.195; 1024 0.175 against
# 0.187; 2048 0.174 against 0.189; 4096 0.178 against 0.197; 8192 0.184
# against 0.203; 16384 0.368 against 0.403.
# f32 x (2026-12-03 15:40 and 18:24, TB/s of x, dy read + dx written,
# against the rule below): 512 2.26 against 2.18; 1024 2.14 against 1.86;
# 2048 2.30 against 2.22; 4096 2.27 against 2.21; 8192 2.18 against 1.94;
# 16384 the rule's. With loop_stages (2026-12-04 05:40, vjp-mode ms against
# the entries before): 1024 0.355 against 0.371 (65536 rows); 8192 0.346
# against 0.367 (8192 rows).
# 16384 features (2026-12-04 10:45, vjp-mode ms at 4096x16384): the
# backward split in two kernels over 2048-feature chunks (6th element,
# feature_chunk), bf16 0.251 against 0.381 in one kernel, f32 0.493 against
# 1.746 (XLA 0.530 / 0.737): one kernel cannot hold a row of x, dy, scale
# and the program's dscale/doffset sums in registers there.
_VJP_CONFIGS = {
    2: {512: (32, 8, 1, 0, 3), 1024: (4, 4, 2, 0, 3), 2048: (2, 4, 2, 0, 3),
        4096: (1, 4, 2, 0, 3), 8192: (1, 8, 1, 0, 3), 16384: (1, 8, 1, 0, 3, 2048)},
    4: {512: (2, 4, 0, 0), 1024: (4, 4, 1, 0, 3), 2048: (1, 8, 0, 0),
        4096: (1, 16, 0, 0), 8192: (1, 8, 1, 0, 3), 16384: (1, 8, 1, 0, 2, 2048)},
}
# Loop stages of the [pre, F, post] column kernels' heuristic (statistics,
# backward sums): H200 2026-12-04, forward+backward 2-10 % faster at 5 of 6
# shapes measured (docs/benchmarks.md).
_COLUMN_LOOP_STAGES = 3
# Programs per SM of the split [R, F] backward's second kernel (feature_chunk).
_CHUNK_PROGRAMS_PER_SM = 8


@pydantic.dataclasses.dataclass(frozen=True)
class TritonLayerNormConfig:
  """Rows per program (a power of 2) and warps per program (4, 8, ...).

  programs_per_sm (forward, [R, F] views): 0 launches one program per tile;
  n > 0 launches about n programs per SM that loop over the tiles, loading
  scale/offset once and the next tile while a tile is normalised.
  Backward: at most programs_per_sm programs per SM (0: 32 // num_warps),
  each looping over row blocks and writing one row of partial sums.
  prefetch: loop trips loaded ahead in registers (forward tiles of a looping
  program, backward blocks of x and dy); None takes 0 with loop_stages,
  else the module default (LOOP_PREFETCH forward, VJP_PREFETCH backward).
  loop_stages: 0, or n >= 2: Triton's pipeliner copies the loads of every
  loop into a shared-memory ring n - 1 trips ahead (cp.async; see
  pallas_triton.pallas_call). It leaves loads made a trip ahead by
  `prefetch` (loop-carried values) alone.
  feature_chunk ([R, F] views; [pre, F, post] views chunk by their own rule):
  0 keeps whole rows in registers. Backward: n splits it in two kernels:
  the rows' sums of g * xhat and g, then dx and the dscale/doffset partials
  over n-feature chunks (reads x and dy twice). Forward: each row block is
  streamed twice in n-feature chunks, for the statistics, then for y
  (`_fwd_chunked_kernel`; reads x twice, the second time from L2). For F
  too wide for one program's registers.
  """

  block_rows: pydantic.PositiveInt = 1
  num_warps: pydantic.PositiveInt = 4
  programs_per_sm: pydantic.NonNegativeInt = 0
  num_stages: pydantic.PositiveInt = 2
  prefetch: pydantic.NonNegativeInt | None = None
  loop_stages: pydantic.NonNegativeInt = 0
  feature_chunk: pydantic.NonNegativeInt = 0

  @pydantic.field_validator("feature_chunk")
  @classmethod
  def _chunk(cls, v: int) -> int:
    if v and (v < 16 or not _is_pow2(v)):
      raise ValueError(f"feature_chunk must be 0 (off) or a power of 2 >= 16, got {v}")
    return v

  @pydantic.field_validator("loop_stages")
  @classmethod
  def _stages(cls, v: int) -> int:
    if v == 1:
      raise ValueError("loop_stages must be 0 (off) or at least 2, got 1")
    return v

  @pydantic.field_validator("block_rows", "num_warps")
  @classmethod
  def _power_of_two(cls, v: int) -> int:
    if not _is_pow2(v):
      raise ValueError(f"must be a power of 2, got {v}")
    return v

  @pydantic.field_validator("num_warps")
  @classmethod
  def _max_warps(cls, v: int) -> int:
    if v > 32:
      raise ValueError(f"at most 32 warps (1024 threads), got {v}")
    return v


def _rows_features(ba: op_lib.BoundArguments) -> tuple[int, int, int, int]:
  """(vectors R, F, itemsize of x, post) of the canonical view."""
  x = ba.arguments["x"]
  axis = ba.arguments["axis"]
  f = x.shape[axis]
  rows = math.prod(d for i, d in enumerate(x.shape) if i != axis)
  return rows, f, jnp.dtype(x.dtype).itemsize, math.prod(x.shape[axis + 1:])


def _warps_for(fp: int) -> int:
  return 4 if fp < 1024 else 8 if fp < 8192 else 16


def heuristic_config(rows: int, features: int, itemsize: int, post: int = 1,
                     backward: bool = False) -> TritonLayerNormConfig:
  """Warps by feature size; rows so a program moves ~32 KiB (see module doc);
  measured configs for 16-bit and f32 x at Fp = 512-16384.

  For the [pre, F, post] view: backward, and forward where `_column_forward`,
  [chunk, block] tiles of _COLUMN_BLOCK columns, _COLUMN_WARPS warps (the
  fastest measured on the H200, docs/benchmarks.md 2026-12-03); the one-slab
  forward `_slab_columns` columns and the fewest warps that keep <= 128 f32
  values per thread.
  """
  config = _heuristic_config(rows, features, itemsize, post, backward)
  if HEURISTIC_LOOP_STAGES is not None:
    config = dataclasses.replace(
        config, loop_stages=HEURISTIC_LOOP_STAGES,
        prefetch=0 if HEURISTIC_LOOP_STAGES else None)
  return config


def _heuristic_config(rows, features, itemsize, post, backward):
  fp = _next_pow2(features)
  if _column_tiles(post, features, backward):
    return TritonLayerNormConfig(block_rows=min(_COLUMN_BLOCK, _next_pow2(post)),
                                 num_warps=_COLUMN_WARPS, loop_stages=_COLUMN_LOOP_STAGES)
  if post > 1:
    block = _slab_columns(post, features)
    threads = fp * block // _SLAB_VALUES_PER_THREAD
    warps = 4 if threads <= 128 else 8 if threads <= 256 else 16
    return TritonLayerNormConfig(block_rows=block, num_warps=warps)
  table = (_VJP_CONFIGS if backward else _LOOP_CONFIGS).get(itemsize, {})
  if fp > MAX_FEATURES:
    table = {fp: _WIDE_BACKWARD if backward else _WIDE_FORWARD[:4]}
  if fp in table:
    # Missing trailing fields are 0 (no loop stages, no split).
    if backward:
      block_rows, warps, programs_per_sm, prefetch, stages, chunk = (*table[fp], 0, 0)[:6]
    else:
      block_rows, warps, programs_per_sm, stages = (*table[fp], 0)[:4]
      prefetch = 0 if stages else None
      chunk = _WIDE_FORWARD[4] if fp > MAX_FEATURES else 0
    return TritonLayerNormConfig(
        block_rows=min(block_rows, _next_pow2(rows)), num_warps=warps,
        programs_per_sm=programs_per_sm, prefetch=prefetch, loop_stages=stages,
        feature_chunk=chunk)
  warps = _warps_for(fp)
  block_rows = _rule_block_rows(rows, fp, itemsize)
  return TritonLayerNormConfig(
      block_rows=block_rows, num_warps=warps,
      programs_per_sm=0 if backward else _programs_per_sm(block_rows, itemsize),
      prefetch=0 if backward else None)


def _rule_block_rows(rows: int, fp: int, itemsize: int) -> int:
  """Rows per tile by the rule: ~_TARGET_BYTES moved per program, at most
  _VALUES_PER_THREAD f32 values per thread at _warps_for(fp) warps."""
  block_rows = _prev_pow2(_TARGET_BYTES // (2 * fp * itemsize))
  block_rows = min(block_rows, _prev_pow2(_VALUES_PER_THREAD * 32 * _warps_for(fp) // fp))
  return max(1, min(block_rows, _next_pow2(rows)))


def _slab_columns(post: int, features: int) -> int:
  """Columns per [Fp, block] slab of the one-kernel [pre, F, post] forward:
  up to 32, at most _SLAB_VALUES_PER_THREAD f32 values per thread at 16
  warps."""
  fp = _next_pow2(features)
  per_slab = _SLAB_VALUES_PER_THREAD * 32 * 16 // fp
  return min(32, _next_pow2(post), _prev_pow2(max(1, per_slab)))


def _column_forward(post: int, features: int) -> bool:
  """Whether the [pre, F, post] forward takes the two column kernels: unless
  one slab holds all of post (a contiguous [F, post] block of x) or F <= 512
  (slabs of 32 columns). The rule that matched all 11 shapes measured on the
  H200 (docs/benchmarks.md 2026-12-04); slabs of fewer columns, or of 32 at
  larger F, were up to 10x slower (1.30 ms against 0.13 at [64, 4096, 256]).
  Always above MAX_FEATURES."""
  if features > MAX_FEATURES:  # no slab of Fp features fits in registers
    return True
  if COLUMN_FORWARD is not None:
    return COLUMN_FORWARD
  covers = _slab_columns(post, features) == _next_pow2(post)
  return not (covers or _next_pow2(features) <= 512)


def _column_tiles(post: int, features: int, backward: bool) -> bool:
  """Whether a [pre, F, post] pass runs the [chunk, block] column kernels
  (the backward always, the forward where `_column_forward`)."""
  return post > 1 and (backward or _column_forward(post, features))


def _programs_per_sm(block_rows: int, itemsize: int) -> int:
  """Forward [R, F] outside `_LOOP_CONFIGS`: loop (1 program per SM)
  where the f32 scale and offset (8 bytes per feature) outweigh a tile of x,
  as for 1-row tiles at F = 8192 (bf16 x, 1 row, 16 warps on the H200: 3.28
  TB/s, 2 per SM 3.20, one program per tile 2.22; docs/benchmarks.md)."""
  return 1 if block_rows * itemsize < 8 else 0


def search_space(rows: int, features: int, itemsize: int, post: int = 1,
                 backward: bool = False) -> set[TritonLayerNormConfig]:
  """block_rows in [h/2, 4h] of the heuristic h (of the rule's where h has one
  warp), warps 4/8/16; 4-64 values/thread;
  the [R, F] forward also one-warp programs (1-2 rows, 16 or 32 per SM), the
  [R, F] backward above 8192 features also split (feature_chunk 2048);
  above MAX_FEATURES only chunked configs (512-2048-feature chunks);
  backward [R, F]: programs_per_sm 0/1/2/4 and prefetch 0/1; loops (looping
  forward programs, the backward) with and without loop_stages 3; the
  [pre, F, post] column kernels (backward, and forward where
  `_column_forward`): 16-128 columns per tile, 4/8/16 warps, loop_stages 0/3."""
  if _column_tiles(post, features, backward):
    return {TritonLayerNormConfig(block_rows=min(b, _next_pow2(post)), num_warps=w,
                                  loop_stages=s)
            for b, w, s in itertools.product((16, 32, 64, 128), (4, 8, 16), (0, 3))}
  h = heuristic_config(rows, features, itemsize, post, backward)
  fp = _next_pow2(features)
  limit = _next_pow2(post if post > 1 else rows)
  if fp > MAX_FEATURES:  # rows wider than registers: chunked kernels only
    return {h} | {
        TritonLayerNormConfig(block_rows=b, num_warps=w, programs_per_sm=pps, prefetch=0,
                              loop_stages=stages, feature_chunk=chunk)
        for b, w, pps, stages, chunk in itertools.product(
            (1, 2, 4), (4, 8, 16) if backward else (1, 4, 8), (1, 2, 4, 8),
            (0, 3) if backward else (3,), (512, 1024, 2048))
        if b <= limit and 8 <= b * chunk // (32 * w) <= 64}
  # (prefetch, loop_stages): register prefetch, or loads pipelined by Triton.
  loads = [(0, 0), (1, 0), (0, 3)] if backward else [(None, 0), (0, 3)]
  configs = set()
  if post == 1 and not backward:
    # One-warp programs, 16 or 32 per SM (a row within one warp).
    configs |= {TritonLayerNormConfig(block_rows=b, num_warps=1, programs_per_sm=pps,
                                      prefetch=0, loop_stages=3)
                for b, pps in itertools.product((1, 2), (16, 32))
                if 4 <= b * fp / 32 <= 64 and b <= limit}
  # Multi-warp candidates around the heuristic's rows (the rule's where the
  # heuristic runs one-warp programs).
  anchor = h.block_rows if h.num_warps > 1 else _rule_block_rows(rows, fp, itemsize)
  for block_rows in (anchor // 2, anchor, 2 * anchor, 4 * anchor):
    if block_rows < 1 or block_rows > limit:
      continue
    for warps, pps, (prefetch, stages) in itertools.product(
        (4, 8, 16), (0,) if post > 1 else (0, 1, 2, 4) if backward else (0, 1, 2, 4, 8),
        loads):
      per_thread = block_rows * fp / (32 * warps)
      if stages and not (pps or backward):
        continue  # forward, one tile per program: no loop to pipeline
      if 4 <= per_thread <= 64:
        configs.add(TritonLayerNormConfig(block_rows=block_rows, num_warps=warps,
                                          programs_per_sm=pps, prefetch=prefetch,
                                          loop_stages=stages))
  if backward and post == 1 and fp > 8192:  # the split backward too
    configs |= {dataclasses.replace(c, feature_chunk=2048) for c in configs}
  configs.add(h)  # (the [pre, F, post] forward's holds up to 128 values/thread)
  return configs


def _prefetch(config: TritonLayerNormConfig, default: int) -> int:
  """Loop trips loaded ahead in registers: config.prefetch, else 0 with
  loop_stages (a tile loaded ahead is loop-carried, and Triton does not
  pipeline loop-carried loads), else the module default."""
  if config.prefetch is not None:
    return config.prefetch
  return 0 if config.loop_stages else default


def _num_sms() -> int:
  return pallas_triton.num_sms()


def check_supported(op: op_lib.Op, ba: op_lib.BoundArguments) -> None:
  """Shared by the forward and the VJP (`ba`: the forward's arguments)."""
  pallas_triton.check_platform(op)
  pallas_triton.check_not_explicitly_sharded(op, ba)
  args = ba.arguments
  for name in ("x", "scale", "offset"):
    if args[name] is not None:
      pallas_triton.check_dtype(op, name, args[name].dtype)


def _check_wide_rows(op: op_lib.Op, view: "_View", config: TritonLayerNormConfig) -> None:
  """[R, F] rows wider than MAX_FEATURES need the chunked kernels (a [pre, F,
  post] view that wide runs the column kernels, whatever the config)."""
  if not view.is_3d and view.features > MAX_FEATURES and not config.feature_chunk:
    raise op.unsupported(
        f"rows of {view.features} features (> {MAX_FEATURES}) do not fit a program's"
        f" registers; set config.feature_chunk (got {config})."
    )


def _pallas_call(kernel, *, out_shape, grid, config, name, num_stages=None):
  return pallas_triton.pallas_call(
      kernel, out_shape=out_shape, grid=grid, num_warps=config.num_warps,
      num_stages=num_stages, name=name, loop_stages=config.loop_stages,
  )


def _load_param(ref, fp, features, add=0.0, f0=None):
  """[fp] f32 parameter of features f0.. (default 0; masked features 0), plus
  `add` on valid features."""
  col_ok = (jnp.arange(fp) if f0 is None else f0 + jnp.arange(fp)) < features
  start = _i32(0) if f0 is None else f0
  p = pltr.load(ref.at[pl.ds(start, fp)], mask=col_ok, other=0.0).astype(jnp.float32)
  return jnp.where(col_ok, p + add, 0.0) if add else p


@dataclasses.dataclass(frozen=True)
class _View:
  """The canonical view of x: [R, F] (`post` == 1) or [pre, F, post].

  A "vector" is one normalised vector (a row of [R, F], a column of
  [pre, F, post]); a tile holds `block` vectors next to each other: [block,
  Fp] for [R, F] (feature axis 1), [Fp, block] for [pre, F, post] (feature
  axis 0, contiguous loads along `post`).
  """

  pre: int
  features: int
  post: int
  block: int
  fp: int

  @property
  def is_3d(self) -> bool:
    return self.post > 1

  @property
  def vectors(self) -> int:  # per `pre` index (all of them for [R, F])
    return self.post if self.is_3d else self.pre

  @property
  def fa(self) -> int:  # feature axis of a tile
    return 0 if self.is_3d else 1

  def tile(self, p, v0, p_ok=None):
    """(index, vector mask [block], tile mask) of vectors v0.. (at pre p)."""
    vec_ok = v0 + jnp.arange(self.block) < self.vectors
    if p_ok is not None:
      vec_ok = vec_ok & p_ok
    f_ok = jnp.arange(self.fp) < self.features
    feats = pl.ds(_i32(0), self.fp)
    if self.is_3d:
      return (p, feats, pl.ds(v0, self.block)), vec_ok, f_ok[:, None] & vec_ok[None, :]
    return (pl.ds(v0, self.block), feats), vec_ok, vec_ok[:, None] & f_ok[None, :]

  def stat(self, p, v0):
    """Index of the statistics ([R] or [pre, post]) of vectors v0.."""
    return (p, pl.ds(v0, self.block)) if self.is_3d else (pl.ds(v0, self.block),)

  def per_vector(self, v):
    """[block] -> broadcastable against a tile."""
    return v[None, :] if self.is_3d else v[:, None]

  def per_feature(self, w):
    """[fp] -> broadcastable against a tile."""
    return w[:, None] if self.is_3d else w[None, :]


def _fwd_refs(refs, has_scale, has_offset, save_stats, subtract_mean):
  """A forward kernel's refs: (x, scale, offset, y, mean, rstd), None where
  absent."""
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  offset_ref = refs.pop(0) if has_offset else None
  y_ref = refs.pop(0)
  mean_ref = refs.pop(0) if save_stats and subtract_mean else None
  rstd_ref = refs.pop(0) if save_stats else None
  return x_ref, scale_ref, offset_ref, y_ref, mean_ref, rstd_ref


def _fwd_kernel(*refs, view: _View, epsilon, scale_offset, subtract_mean,
                has_scale, has_offset, save_stats, prefetch, loop=None):
  """One program: `block` vectors of x -> y (+ mean, rstd); with `loop` =
  (programs G, trips) ([R, F] only) the tiles g, g + G, ... of program g,
  each loaded `prefetch` trips ahead."""
  x_ref, scale_ref, offset_ref, y_ref, mean_ref, rstd_ref = _fwd_refs(
      refs, has_scale, has_offset, save_stats, subtract_mean)
  fa, f = view.fa, view.features

  def scale():
    return _load_param(scale_ref, view.fp, f, scale_offset) if has_scale else None

  def offset():
    return _load_param(offset_ref, view.fp, f) if has_offset else None

  def load_x(p, v0):
    tile, _, mask = view.tile(p, v0)
    return pltr.load(x_ref.at[tile], mask=mask, other=0.0)

  def normalise(p, v0, w_bias=None, x=None):
    """One tile; scale/offset loaded where used unless given (`w_bias`), x
    loaded here unless given."""
    tile, vec_ok, mask = view.tile(p, v0)
    x = (load_x(p, v0) if x is None else x).astype(jnp.float32)
    if subtract_mean:
      mean = jnp.sum(x, axis=fa) / f
      # Masked features must not contribute (x - mean) to the variance.
      xc = jnp.where(mask, x - view.per_vector(mean), 0.0)
    else:
      xc = x
    rstd = lax.rsqrt(jnp.sum(xc * xc, axis=fa) / f + epsilon)
    y = xc * view.per_vector(rstd)
    if has_scale:
      y = y * view.per_feature(scale() if w_bias is None else w_bias[0])
    if has_offset:
      y = y + view.per_feature(offset() if w_bias is None else w_bias[1])
    pltr.store(y_ref.at[tile], y.astype(y_ref.dtype), mask=mask)
    if mean_ref is not None:
      pltr.store(mean_ref.at[view.stat(p, v0)], mean, mask=vec_ok)
    if rstd_ref is not None:
      pltr.store(rstd_ref.at[view.stat(p, v0)], rstd, mask=vec_ok)

  if view.is_3d:
    normalise(_i32(pl.program_id(0)), _i32(pl.program_id(1) * view.block))
  elif loop is None:
    normalise(None, _i32(pl.program_id(0) * view.block))
  else:
    programs, trips = loop
    g = _i32(pl.program_id(0))  # read outside the loop (interpret mode)
    # scale/offset once per program: at F = 8192 they are 4x a 1-row bf16
    # tile, re-read per tile otherwise.
    w_bias = scale(), offset()

    v0 = lambda k: (g + k * programs) * view.block

    def body(k, ahead):  # ahead: tiles k .. k + prefetch - 1, loaded
      # Tile k + prefetch first (past the end: masked, no traffic).
      xs = (*ahead, load_x(None, v0(k + prefetch)))
      normalise(None, v0(k), w_bias, xs[0])
      return xs[1:]

    first = tuple(load_x(None, v0(_i32(i))) for i in range(prefetch))
    lax.fori_loop(_i32(0), _i32(trips), body, first)


def _chunk_tile(v0, rows_ok, f0, chunk: int, features: int):
  """(index, mask) of the [block, chunk] tile of an [R, F] array at rows
  v0.. (rows_ok: their mask [block]), features f0.."""
  mask = rows_ok[:, None] & (f0 + jnp.arange(chunk) < features)[None, :]
  return (pl.ds(v0, rows_ok.shape[0]), pl.ds(f0, chunk)), mask


def _fwd_chunked_kernel(*refs, view: _View, chunk: int, epsilon, scale_offset,
                        subtract_mean, has_scale, has_offset, save_stats, loop=None):
  """[R, F] forward by [block, chunk] tiles (config.feature_chunk): for rows
  wider than a program's registers. Per row block, a first loop over the
  chunks sums d = x - shift and d^2 elementwise, a second re-reads x (from
  L2, just read) and writes y; scale/offset are read per chunk.

  shift is the mean of the row's first chunk (the shifted-data algorithm):
  var = E[d^2] - E[d]^2 then cancels at most E[d]^2 / var <= chunks - 1
  (the first chunk's mean lies within that of the row's spread), a few bits
  of f32, where plain sums of x^2 cancel without bound. With `loop` =
  (programs G, trips), program g takes row blocks g, g + G, ...
  """
  x_ref, scale_ref, offset_ref, y_ref, mean_ref, rstd_ref = _fwd_refs(
      refs, has_scale, has_offset, save_stats, subtract_mean)
  f, block = view.features, view.block
  chunks = pl.cdiv(f, chunk)

  def load(v0, c):
    """(x tile [block, chunk] f32 (masked: 0), its mask, its index)."""
    rows_ok = v0 + jnp.arange(block) < view.vectors
    idx, mask = _chunk_tile(v0, rows_ok, c * chunk, chunk, f)
    return pltr.load(x_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32), mask, idx

  def row_block(v0):
    x0, mask0, _ = load(v0, _i32(0))
    if subtract_mean:
      shift = jnp.sum(x0, axis=1) / min(chunk, f)
      d0 = jnp.where(mask0, x0 - shift[:, None], 0.0)
      sums0 = (d0, d0 * d0)
    else:
      sums0 = (x0 * x0,)

    def add_chunk(c, sums):
      x, mask, _ = load(v0, c)
      if not subtract_mean:
        return (sums[0] + x * x,)
      d = jnp.where(mask, x - shift[:, None], 0.0)
      return sums[0] + d, sums[1] + d * d

    sums = lax.fori_loop(_i32(1), _i32(chunks), add_chunk, sums0)
    if subtract_mean:
      m1 = jnp.sum(sums[0], axis=1) / f
      mean = shift + m1
      var = jnp.maximum(jnp.sum(sums[1], axis=1) / f - m1 * m1, 0.0)
    else:
      mean, var = None, jnp.sum(sums[0], axis=1) / f
    rstd = lax.rsqrt(var + epsilon)

    def write_chunk(c, carry):
      x, mask, idx = load(v0, c)
      y = (x - mean[:, None] if subtract_mean else x) * rstd[:, None]
      if has_scale:
        y = y * _load_param(scale_ref, chunk, f, scale_offset, c * chunk)[None, :]
      if has_offset:
        y = y + _load_param(offset_ref, chunk, f, 0.0, c * chunk)[None, :]
      pltr.store(y_ref.at[idx], y.astype(y_ref.dtype), mask=mask)
      return carry

    lax.fori_loop(_i32(0), _i32(chunks), write_chunk, ())
    rows_ok = v0 + jnp.arange(block) < view.vectors
    if mean_ref is not None:
      pltr.store(mean_ref.at[pl.ds(v0, block)], mean, mask=rows_ok)
    if rstd_ref is not None:
      pltr.store(rstd_ref.at[pl.ds(v0, block)], rstd, mask=rows_ok)

  g = _i32(pl.program_id(0))  # read outside the loop (interpret mode)
  if loop is None:
    row_block(g * block)
  else:
    programs, trips = loop

    def next_block(k, carry):  # past the last row block: masked, no traffic
      row_block((g + k * programs) * block)
      return carry

    lax.fori_loop(_i32(0), _i32(trips), next_block, ())


def _bwd_inputs(refs, subtract_mean: bool, has_scale: bool):
  """(x, dy, mean or None, rstd, scale or None) refs of a backward kernel,
  popped from the front of the list `refs` (its outputs stay)."""
  x_ref, dy_ref = refs.pop(0), refs.pop(0)
  mean_ref = refs.pop(0) if subtract_mean else None
  rstd_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  return x_ref, dy_ref, mean_ref, rstd_ref, scale_ref


def _xhat(x, mean, rstd, mask):
  """(x - mean) * rstd, 0 where masked (x * rstd without mean); mean and
  rstd broadcast against the tile."""
  return x * rstd if mean is None else jnp.where(mask, (x - mean) * rstd, 0.0)


def _dx(rstd, centred, xhat, proj, features: int, subtract_mean: bool):
  """dx = rstd * (centred - xhat * proj), centred = g - mean(g) (g without
  the mean for RMS norm). Exactly 0 for a layer norm over one feature: y
  does not depend on x there, but computed, g - mean(g) contracts into an
  FMA whose rounding error rstd = 1/sqrt(eps) multiplies (~1e-5)."""
  if subtract_mean and features == 1:
    return jnp.zeros_like(centred)
  return rstd * (centred - xhat * proj)


def _stat_loader(view: _View, stat, vec_ok):
  """ref -> its statistics ([R] or [pre, post]) of the tile's vectors at
  `stat`, broadcastable against the tile; 0 for vectors out of range (so
  rstd = 0 gives xhat = dx = 0 there)."""
  return lambda ref: view.per_vector(pltr.load(ref.at[stat], mask=vec_ok, other=0.0))


def _bwd_kernel(*refs, view: _View, num_programs, iters, scale_offset,
                subtract_mean, has_scale, has_offset, prefetch):
  """[R, F] views: dx and per-program partial dscale/doffset; x and dy loaded
  `prefetch` loop trips ahead of their use.

  Program g handles row blocks g, g + G, ...; its partial sums go to row g
  of the [programs, F] buffers.
  """
  refs = list(refs)
  x_ref, dy_ref, mean_ref, rstd_ref, scale_ref = _bwd_inputs(refs, subtract_mean, has_scale)
  dx_ref = refs.pop(0)
  dscale_ref = refs.pop(0) if has_scale else None
  doffset_ref = refs.pop(0) if has_offset else None

  fa, f = view.fa, view.features
  # Read outside the loop (interpret mode cannot lower program_id in a body).
  g_id = _i32(pl.program_id(0))
  w = _load_param(scale_ref, view.fp, f, scale_offset) if has_scale else None

  def block(k):
    """(p, v0, tile, vec_ok, mask) of loop trip k (past the end: all masked)."""
    p, v0 = None, _i32((g_id + k * num_programs) * view.block)
    return (p, v0, *view.tile(p, v0))

  def load_x_dy(blk, dtype=None):
    """x and dy of a block, in their dtype or widened to `dtype`."""
    _, _, tile, _, mask = blk
    widen = lambda v: v if dtype is None else v.astype(dtype)
    return (widen(pltr.load(x_ref.at[tile], mask=mask, other=0.0)),
            widen(pltr.load(dy_ref.at[tile], mask=mask, other=0.0)))

  def body(k, carry):
    (acc_ds, acc_db), ahead = carry  # ahead: x, dy of trips k .. k + prefetch - 1
    p, v0, tile, vec_ok, mask = blk = block(k)
    stat = view.stat(p, v0)
    if prefetch:  # Trip k + prefetch's loads first (past the end: masked).
      loaded = (*ahead, load_x_dy(block(k + prefetch)))
      ahead = loaded[1:]
      x, dy = (v.astype(jnp.float32) for v in loaded[0])
    else:
      x, dy = load_x_dy(blk, jnp.float32)
    # Vectors out of range get rstd = 0, hence xhat = dx = 0.
    stat_of = _stat_loader(view, stat, vec_ok)
    rstd = stat_of(rstd_ref)
    xhat = _xhat(x, stat_of(mean_ref) if subtract_mean else None, rstd, mask)
    g = dy * view.per_feature(w) if has_scale else dy
    proj = view.per_vector(jnp.sum(g * xhat, axis=fa) / f)
    if subtract_mean:
      centred = g - view.per_vector(jnp.sum(g, axis=fa) / f)
    else:
      centred = g
    dx = _dx(rstd, centred, xhat, proj, f, subtract_mean)
    pltr.store(dx_ref.at[tile], dx.astype(dx_ref.dtype), mask=mask)
    if has_scale:
      acc_ds = acc_ds + jnp.sum(dy * xhat, axis=1 - fa)
    if has_offset:
      acc_db = acc_db + jnp.sum(dy, axis=1 - fa)
    return (acc_ds, acc_db), ahead

  zeros = jnp.zeros((view.fp,), jnp.float32)
  first = tuple(load_x_dy(block(_i32(i))) for i in range(prefetch))
  (acc_ds, acc_db), _ = lax.fori_loop(_i32(0), _i32(iters), body, ((zeros, zeros), first))
  col = (g_id, pl.ds(_i32(0), view.fp))
  col_ok = jnp.arange(view.fp) < f
  if has_scale:
    pltr.store(dscale_ref.at[col], acc_ds, mask=col_ok)
  if has_offset:
    pltr.store(doffset_ref.at[col], acc_db, mask=col_ok)


def _bwd_row_sums_kernel(*refs, view: _View, num_programs, iters, scale_offset,
                         subtract_mean, has_scale, chunk=None):
  """Split [R, F] backward, kernel 1: per row, sum(g * xhat) / F and sum(g) /
  F (g = dy * (scale + scale_offset), dy without scale), f32 [R] each.

  Program g handles row blocks g, g + G, ...; x, dy and scale are read once,
  whole rows, or with `chunk` (rows wider than MAX_FEATURES) in [block,
  chunk] tiles summed elementwise (scale read per chunk).
  """
  refs = list(refs)
  x_ref, dy_ref, mean_ref, rstd_ref, scale_ref = _bwd_inputs(refs, subtract_mean, has_scale)
  proj_ref = refs.pop(0)
  gmean_ref = refs.pop(0) if subtract_mean else None
  f = view.features
  g_id = _i32(pl.program_id(0))  # outside the loop (interpret mode)
  if chunk is not None:
    return _row_sums_by_chunks(x_ref, dy_ref, mean_ref, rstd_ref, scale_ref, proj_ref,
                               gmean_ref, g_id, view=view, chunk=chunk,
                               num_programs=num_programs, iters=iters,
                               scale_offset=scale_offset)
  w = _load_param(scale_ref, view.fp, f, scale_offset) if has_scale else None

  def body(k, carry):
    v0 = _i32((g_id + k * num_programs) * view.block)
    tile, vec_ok, mask = view.tile(None, v0)
    stat = view.stat(None, v0)
    x = pltr.load(x_ref.at[tile], mask=mask, other=0.0).astype(jnp.float32)
    dy = pltr.load(dy_ref.at[tile], mask=mask, other=0.0).astype(jnp.float32)
    row = _stat_loader(view, stat, vec_ok)
    rstd = row(rstd_ref)
    xhat = _xhat(x, row(mean_ref) if subtract_mean else None, rstd, mask)
    g = dy * w[None, :] if has_scale else dy
    pltr.store(proj_ref.at[stat], jnp.sum(g * xhat, axis=1) / f, mask=vec_ok)
    if subtract_mean:
      pltr.store(gmean_ref.at[stat], jnp.sum(g, axis=1) / f, mask=vec_ok)
    return carry

  lax.fori_loop(_i32(0), _i32(iters), body, _i32(0))


def _row_sums_by_chunks(x_ref, dy_ref, mean_ref, rstd_ref, scale_ref, proj_ref, gmean_ref,
                        g_id, *, view: _View, chunk: int, num_programs, iters,
                        scale_offset):
  """`_bwd_row_sums_kernel` over [block, chunk] tiles of each row block."""
  f, block = view.features, view.block

  def row_block(k, carry):
    v0 = _i32((g_id + k * num_programs) * block)
    vec_ok = v0 + jnp.arange(block) < view.pre
    stat = (pl.ds(v0, block),)
    row = _stat_loader(view, stat, vec_ok)
    rstd = row(rstd_ref)
    mean = row(mean_ref) if mean_ref is not None else None

    def add_chunk(c, sums):
      f0 = c * chunk
      idx, mask = _chunk_tile(v0, vec_ok, f0, chunk, f)
      x = pltr.load(x_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
      dy = pltr.load(dy_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
      xhat = _xhat(x, mean, rstd, mask)
      g = dy
      if scale_ref is not None:
        g = dy * _load_param(scale_ref, chunk, f, scale_offset, f0)[None, :]
      return (sums[0] + g * xhat, *((sums[1] + g,) if gmean_ref is not None else ()))

    zeros = jnp.zeros((block, chunk), jnp.float32)
    sums = lax.fori_loop(_i32(0), _i32(pl.cdiv(f, chunk)), add_chunk,
                         (zeros,) * (1 + (gmean_ref is not None)))
    pltr.store(proj_ref.at[stat], jnp.sum(sums[0], axis=1) / f, mask=vec_ok)
    if gmean_ref is not None:
      pltr.store(gmean_ref.at[stat], jnp.sum(sums[1], axis=1) / f, mask=vec_ok)
    return carry

  lax.fori_loop(_i32(0), _i32(iters), row_block, _i32(0))


def _bwd_chunk_kernel(*refs, view: _View, chunk: int, num_programs, iters,
                      scale_offset, subtract_mean, has_scale, has_offset):
  """Split [R, F] backward, kernel 2: program (c, g) writes dx of features
  [c * chunk, (c + 1) * chunk) of row blocks g, g + G, ..., with the row sums
  of kernel 1: dx = rstd * (g - sum(g)/F - xhat * sum(g * xhat)/F), and those
  features' dscale/doffset partial sums to row g of the [G, F] buffers."""
  refs = list(refs)
  x_ref, dy_ref, mean_ref, rstd_ref, scale_ref = _bwd_inputs(refs, subtract_mean, has_scale)
  proj_ref = refs.pop(0)
  gmean_ref = refs.pop(0) if subtract_mean else None
  dx_ref = refs.pop(0)
  dscale_ref = refs.pop(0) if has_scale else None
  doffset_ref = refs.pop(0) if has_offset else None
  f, block = view.features, view.block
  c, g_id = _i32(pl.program_id(0)), _i32(pl.program_id(1))
  f0 = c * chunk
  col_ok = f0 + jnp.arange(chunk) < f
  w = _load_param(scale_ref, chunk, f, scale_offset, f0) if has_scale else None

  def body(k, carry):
    acc_ds, acc_db = carry
    v0 = _i32((g_id + k * num_programs) * block)
    vec_ok = v0 + jnp.arange(block) < view.pre
    mask = vec_ok[:, None] & col_ok[None, :]
    idx = (pl.ds(v0, block), pl.ds(f0, chunk))
    stat = (pl.ds(v0, block),)
    x = pltr.load(x_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
    dy = pltr.load(dy_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
    row = _stat_loader(view, stat, vec_ok)
    rstd = row(rstd_ref)
    xhat = _xhat(x, row(mean_ref) if subtract_mean else None, rstd, mask)
    g = dy * w[None, :] if has_scale else dy
    centred = g - row(gmean_ref) if subtract_mean else g
    dx = rstd * (centred - xhat * row(proj_ref))
    pltr.store(dx_ref.at[idx], dx.astype(dx_ref.dtype), mask=mask)
    if has_scale:
      acc_ds = acc_ds + jnp.sum(dy * xhat, axis=0)
    if has_offset:
      acc_db = acc_db + jnp.sum(dy, axis=0)
    return acc_ds, acc_db

  zeros = jnp.zeros((chunk,), jnp.float32)
  acc_ds, acc_db = lax.fori_loop(_i32(0), _i32(iters), body, (zeros, zeros))
  part = (g_id, pl.ds(f0, chunk))
  if has_scale:
    pltr.store(dscale_ref.at[part], acc_ds, mask=col_ok)
  if has_offset:
    pltr.store(doffset_ref.at[part], acc_db, mask=col_ok)


def _feature_chunk(block: int, features: int, itemsize: int) -> int:
  """Features per tile of the [pre, F, post] backward (a power of 2 >= 16)."""
  chunk = _prev_pow2(max(1, _COLUMN_TILE_BYTES // (block * itemsize)))
  return max(16, min(chunk, _next_pow2(features)))


def _column_tile(p, f0, v0, chunk: int, block: int, features: int, post: int):
  """(index, mask or None) of the [chunk, block] tile of [pre, F, post] at
  (p, f0, v0); the mask only where F or post is not a multiple of the tile."""
  mask = None
  if features % chunk:
    mask = (f0 + jnp.arange(chunk) < features)[:, None]
  if post % block:
    cols = (v0 + jnp.arange(block) < post)[None, :]
    mask = cols if mask is None else mask & cols
  return (p, pl.ds(f0, chunk), pl.ds(v0, block)), mask


def _load_masked(ref, idx, mask, dtype=jnp.float32):
  if mask is None:
    return pltr.load(ref.at[idx]).astype(dtype)
  return pltr.load(ref.at[idx], mask=mask, other=0.0).astype(dtype)


def _load_columns(ref, p, v0, block: int, post: int):
  """[block] f32 of a [pre, post] ref: columns v0.. at pre p (0 past post)."""
  ok = v0 + jnp.arange(block) < post if post % block else None
  return _load_masked(ref, (p, pl.ds(v0, block)), ok)


def _column_terms(x_ref, dy_ref, scale_ref, mean, rstd, p, f0, v0, *, features,
                  post, chunk, block, scale_offset):
  """(index, mask, dy, xhat, g) of the [chunk, block] tile at (p, f0, v0),
  f32, with g = dy * (scale + scale_offset) (dy without scale)."""
  idx, mask = _column_tile(p, f0, v0, chunk, block, features, post)
  x, dy = _load_masked(x_ref, idx, mask), _load_masked(dy_ref, idx, mask)
  xhat = (x if mean is None else x - mean[None, :]) * rstd[None, :]
  g = dy
  if scale_ref is not None:
    g = dy * _load_param(scale_ref, chunk, features, scale_offset, f0)[:, None]
  return idx, mask, dy, xhat, g


def _bwd_sums_kernel(*refs, features, post, chunk, block, trips, chunks,
                     scale_offset, subtract_mean, has_scale, has_offset):
  """[pre, F, post] backward, pass 1. Program (p, c, s) streams `trips`
  feature chunks (s * trips, ...) of columns v0 = c * block.. at pre index p
  and writes their column sums of g * xhat and of g (g = dy * (scale +
  scale_offset)) to row s of [splits, pre, post] f32 (summed over s by XLA),
  and its part of the per-feature partials sum_cols(dy * xhat), sum_cols(dy)
  ([pre * column blocks, F] f32, summed over rows by XLA). Reads x and dy
  once; masked elements load dy = 0, so they add nothing."""
  refs = list(refs)
  x_ref, dy_ref, mean_ref, rstd_ref, scale_ref = _bwd_inputs(refs, subtract_mean, has_scale)
  sum_gx_ref = refs.pop(0)
  sum_g_ref = refs.pop(0) if subtract_mean else None
  part_ds_ref = refs.pop(0) if has_scale else None
  part_db_ref = refs.pop(0) if has_offset else None
  p, c, split = (_i32(pl.program_id(a)) for a in range(3))
  v0 = c * block
  row = p * pl.num_programs(1) + c
  mean = _load_columns(mean_ref, p, v0, block, post) if subtract_mean else None
  rstd = _load_columns(rstd_ref, p, v0, block, post)
  tile = dict(features=features, post=post, chunk=chunk, block=block,
              scale_offset=scale_offset)

  def body(k, carry):
    s_gx, s_g = carry
    f0 = (split * trips + k) * chunk
    _, _, dy, xhat, g = _column_terms(x_ref, dy_ref, scale_ref, mean, rstd, p, f0, v0,
                                      **tile)
    s_gx = s_gx + jnp.sum(g * xhat, axis=0)
    if subtract_mean:
      s_g = s_g + jnp.sum(g, axis=0)
    part = (row, pl.ds(f0, chunk))
    f_ok = f0 + jnp.arange(chunk) < features if features % chunk else None
    if has_scale:
      pltr.store(part_ds_ref.at[part], jnp.sum(dy * xhat, axis=1), mask=f_ok)
    if has_offset:
      pltr.store(part_db_ref.at[part], jnp.sum(dy, axis=1), mask=f_ok)
    return s_gx, s_g

  zeros = jnp.zeros((block,), jnp.float32)
  s_gx, s_g = lax.fori_loop(_i32(0), _split_trips(split, trips, chunks), body,
                            (zeros, zeros))
  ok = v0 + jnp.arange(block) < post if post % block else None
  pltr.store(sum_gx_ref.at[split, p, pl.ds(v0, block)], s_gx, mask=ok)
  if subtract_mean:
    pltr.store(sum_g_ref.at[split, p, pl.ds(v0, block)], s_g, mask=ok)


def _bwd_dx_kernel(*refs, features, post, chunk, block, scale_offset,
                   subtract_mean, has_scale):
  """[pre, F, post] backward, pass 2: program (p, c, k) writes dx of the
  [chunk, block] tile (p, k * chunk, c * block): dx = rstd * (g - sum(g)/F -
  xhat * sum(g * xhat)/F) with the sums of pass 1."""
  refs = list(refs)
  x_ref, dy_ref, mean_ref, rstd_ref, scale_ref = _bwd_inputs(refs, subtract_mean, has_scale)
  sum_gx_ref = refs.pop(0)
  sum_g_ref = refs.pop(0) if subtract_mean else None
  dx_ref = refs.pop(0)
  p, c, k = (_i32(pl.program_id(a)) for a in range(3))
  v0, f0 = c * block, k * chunk
  mean = _load_columns(mean_ref, p, v0, block, post) if subtract_mean else None
  rstd = _load_columns(rstd_ref, p, v0, block, post)
  tile = dict(features=features, post=post, chunk=chunk, block=block,
              scale_offset=scale_offset)
  s_gx = _load_columns(sum_gx_ref, p, v0, block, post)
  idx, mask, _, xhat, g = _column_terms(x_ref, dy_ref, scale_ref, mean, rstd, p, f0, v0,
                                        **tile)
  centred = g
  if subtract_mean:
    s_g = _load_columns(sum_g_ref, p, v0, block, post)
    centred = g - (s_g / features)[None, :]
  dx = _dx(rstd[None, :], centred, xhat, (s_gx / features)[None, :], features, subtract_mean)
  pltr.store(dx_ref.at[idx], dx.astype(dx_ref.dtype), mask=mask)


def _column_splits(pre: int, blocks: int, chunks: int) -> tuple[int, int]:
  """(splits, trips): programs sharing one column block's F loop in the first
  kernel of the [pre, F, post] forward and backward, and the most chunks one
  of them streams. Splits double until about _SPLIT_PROGRAMS_PER_SM programs
  per SM run ([pre, blocks] alone can be a few dozen programs of long serial
  loops: 24 at [3, 4099, 1000]); the last split may stream fewer chunks."""
  splits = 1
  while splits < chunks and pre * blocks * splits < _SPLIT_PROGRAMS_PER_SM * _num_sms():
    splits *= 2
  trips = pl.cdiv(chunks, splits)
  return pl.cdiv(chunks, trips), trips  # no split left without a chunk


def _column_layout(view: _View, dtype):
  """(chunk, column blocks, chunks, splits, trips) of the [pre, F, post]
  column kernels for x of `dtype`."""
  chunk = _feature_chunk(view.block, view.features, jnp.dtype(dtype).itemsize)
  blocks, chunks = pl.cdiv(view.post, view.block), pl.cdiv(view.features, chunk)
  return (chunk, blocks, chunks, *_column_splits(view.pre, blocks, chunks))


def _split_trips(split, trips: int, chunks: int):
  """Chunks streamed by split program `split` (trips; fewer in the last)."""
  if chunks % trips == 0:
    return _i32(trips)
  return jnp.minimum(_i32(trips), _i32(chunks) - split * trips)


def _fwd_stats_kernel(x_ref, *out_refs, features, post, chunk, block, trips,
                      chunks, subtract_mean):
  """[pre, F, post] forward, pass 1. Program (p, c, s) streams `trips` feature
  chunks (s * trips, ...) of columns v0 = c * block.. at pre index p and
  writes, per column, to row s of [splits, pre, post] f32 buffers: the mean
  and M2 = sum((x - mean)^2) of its features (layer norm), or sum(x^2) (RMS
  norm). Each chunk's mean and M2 come from the tile in registers (two exact
  passes) and are merged into the running pair by the pairwise update of
  Chan, Golub & LeVeque (1979, eq. 2.1), so no E[x^2] - E[x]^2 cancellation."""
  p, c, split = (_i32(pl.program_id(a)) for a in range(3))
  v0 = c * block

  def body(k, carry):
    f0 = (split * trips + k) * chunk
    idx, mask = _column_tile(p, f0, v0, chunk, block, features, post)
    x = _load_masked(x_ref, idx, mask)
    if not subtract_mean:
      return (carry[0] + jnp.sum(x * x, axis=0),)
    mean, m2 = carry
    # Chunks before k in this split are full; only F's last one is partial.
    n_a = (k * chunk).astype(jnp.float32)
    n_b = jnp.minimum(chunk, features - f0).astype(jnp.float32)
    mean_b = jnp.sum(x, axis=0) / n_b
    d = x - mean_b[None, :]
    if features % chunk:  # features past F loaded 0: no (0 - mean_b)^2
      d = jnp.where((f0 + jnp.arange(chunk) < features)[:, None], d, 0.0)
    delta = mean_b - mean
    n = n_a + n_b
    return mean + delta * (n_b / n), m2 + jnp.sum(d * d, axis=0) + delta * delta * (n_a * n_b / n)

  zeros = jnp.zeros((block,), jnp.float32)
  carry = lax.fori_loop(_i32(0), _split_trips(split, trips, chunks), body,
                        (zeros, zeros) if subtract_mean else (zeros,))
  ok = v0 + jnp.arange(block) < post if post % block else None
  for ref, v in zip(out_refs, carry):
    pltr.store(ref.at[split, p, pl.ds(v0, block)], v, mask=ok)


def _fwd_apply_kernel(*refs, features, post, chunk, block, scale_offset,
                      subtract_mean, has_scale, has_offset):
  """[pre, F, post] forward, pass 2: program (p, c, k) writes y of the
  [chunk, block] tile (p, k * chunk, c * block) from pass 1's statistics."""
  refs = list(refs)
  x_ref = refs.pop(0)
  mean_ref = refs.pop(0) if subtract_mean else None
  rstd_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  offset_ref = refs.pop(0) if has_offset else None
  y_ref = refs.pop(0)
  p, c, k = (_i32(pl.program_id(a)) for a in range(3))
  v0, f0 = c * block, k * chunk
  idx, mask = _column_tile(p, f0, v0, chunk, block, features, post)
  y = _load_masked(x_ref, idx, mask)
  if subtract_mean:
    y = y - _load_columns(mean_ref, p, v0, block, post)[None, :]
  y = y * _load_columns(rstd_ref, p, v0, block, post)[None, :]
  if has_scale:
    y = y * _load_param(scale_ref, chunk, features, scale_offset, f0)[:, None]
  if has_offset:
    y = y + _load_param(offset_ref, chunk, features, 0.0, f0)[:, None]
  pltr.store(y_ref.at[idx], y.astype(y_ref.dtype), mask=mask)


def _fwd_columns(x, scale, offset, view: _View, config, epsilon, scale_offset,
                 subtract_mean):
  """(y, mean or None, rstd) of the [pre, F, post] forward ([pre, post] f32
  statistics): two kernels streaming coalesced [chunk, block] tiles (any F; x
  read twice, y written once)."""
  pre, f, post, block = view.pre, view.features, view.post, view.block
  chunk, blocks, chunks, splits, trips = _column_layout(view, x.dtype)
  part = jax.ShapeDtypeStruct((splits, pre, post), jnp.float32)
  parts = _pallas_call(
      functools.partial(_fwd_stats_kernel, features=f, post=post, chunk=chunk,
                        block=block, trips=trips, chunks=chunks,
                        subtract_mean=subtract_mean),
      out_shape=[part] * (2 if subtract_mean else 1), grid=(pre, blocks, splits),
      config=config, name="tokamax_layer_norm_fwd_stats",
  )(x)
  # Merge the splits' (count, mean, M2) exactly: M2 = sum_s M2_s + n_s *
  # (mean_s - mean)^2 (Chan et al. 1979, eq. 2.1 for several parts).
  counts = jnp.asarray([min(f, (s + 1) * trips * chunk) - s * trips * chunk
                        for s in range(splits)], jnp.float32)[:, None, None]
  if subtract_mean:
    mean = jnp.sum(counts * parts[0], axis=0) / f
    m2 = jnp.sum(parts[1] + counts * jnp.square(parts[0] - mean), axis=0)
  else:
    mean, m2 = None, jnp.sum(parts[0], axis=0)
  rstd = lax.rsqrt(m2 / f + epsilon)
  inputs = [x, *([mean] if subtract_mean else []), rstd]
  inputs += [v for v in (scale, offset) if v is not None]
  y = _pallas_call(
      functools.partial(_fwd_apply_kernel, features=f, post=post, chunk=chunk,
                        block=block, scale_offset=float(scale_offset),
                        subtract_mean=subtract_mean, has_scale=scale is not None,
                        has_offset=offset is not None),
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)], grid=(pre, blocks, chunks),
      config=config, name="tokamax_layer_norm_fwd_apply",
  )(*inputs)[0]
  return y, mean, rstd


def _bwd_columns(x, dout, mean, rstd, scale, view: _View, config, scale_offset,
                 subtract_mean, has_offset):
  """dx [pre, F, post] and the dscale/doffset partials of the [pre, F, post]
  backward: two kernels, each streaming coalesced [chunk, block] tiles (any
  F; x and dy read twice, dx written once)."""
  pre, f, post, block = view.pre, view.features, view.post, view.block
  chunk, blocks, chunks, splits, trips = _column_layout(view, x.dtype)
  statics = dict(features=f, post=post, chunk=chunk, block=block,
                 scale_offset=float(scale_offset), subtract_mean=subtract_mean,
                 has_scale=scale is not None)
  stats = ([mean.reshape(pre, post).astype(jnp.float32)] if subtract_mean else [])
  stats.append(rstd.reshape(pre, post).astype(jnp.float32))
  inputs = [x, dout, *stats, *([scale] if scale is not None else [])]
  col_sum = jax.ShapeDtypeStruct((splits, pre, post), jnp.float32)
  partial = jax.ShapeDtypeStruct((pre * blocks, f), jnp.float32)
  sums_shape = [col_sum] + ([col_sum] if subtract_mean else [])
  parts_shape = ([partial] if scale is not None else []) + ([partial] if has_offset else [])
  outs = _pallas_call(
      functools.partial(_bwd_sums_kernel, has_offset=has_offset, trips=trips,
                        chunks=chunks, **statics),
      out_shape=sums_shape + parts_shape, grid=(pre, blocks, splits),
      config=config, name="tokamax_layer_norm_bwd_sums",
  )(*inputs)
  sums = [jnp.sum(v, axis=0) for v in outs[:len(sums_shape)]]
  parts = list(outs[len(sums_shape):])
  dx = _pallas_call(
      functools.partial(_bwd_dx_kernel, **statics),
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
      grid=(pre, blocks, chunks), config=config,
      name="tokamax_layer_norm_bwd_dx",
  )(*inputs, *sums)[0]
  return dx, parts


def _view(x, axis, block) -> _View:
  """The view of x normalised along `axis`, with `block` vectors per tile."""
  features = x.shape[axis]
  pre = math.prod(x.shape[:axis])
  post = math.prod(x.shape[axis + 1:])
  vectors = post if post > 1 else pre
  block = max(1, min(block, _next_pow2(vectors)))
  return _View(pre=pre, features=features, post=post, block=block,
               fp=_next_pow2(features))


def _stat_shape(x, axis):
  """keepdims shape of the statistics (the XLA reference's residuals)."""
  return x.shape[:axis] + (1,) + x.shape[axis + 1:]


def _statistics(x, axis, epsilon, subtract_mean):
  """(mean or None, rstd) over `axis` in f32, keepdims (XLA)."""
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=axis, keepdims=True) if subtract_mean else None
  xc = xf - mean if subtract_mean else xf
  return mean, lax.rsqrt(jnp.mean(xc * xc, axis=axis, keepdims=True) + epsilon)


def _array_shape(view: _View):
  """Shapes of x and of the statistics in the kernels' view."""
  if view.is_3d:
    return (view.pre, view.features, view.post), (view.pre, view.post)
  return (view.pre, view.features), (view.pre,)


class _TritonLayerNormMixin:
  """Support checks, config and search space shared by forward and VJP."""

  config_cls = TritonLayerNormConfig
  # The heuristics hold configs measured per feature size (_LOOP_CONFIGS,
  # _VJP_CONFIGS); the nearest cached shape's ran slower (forward at
  # 16384x4096, 32768x2048, 131072x512: 3.24-3.45 TB/s on the H200 against
  # 3.62-3.82; backward up to 14 %; docs/benchmarks.md, 2026-12-03).
  borrows_nearest_config = False

  def supported_on(self, device) -> bool:
    return pallas_triton.supported_on(device)

  def check_supported(self, ba):
    check_supported(self, ba)

  def _get_heuristics_config(self, ba):
    return heuristic_config(*_rows_features(ba), backward=self.is_vjp)

  def preferred(self, ba):
    # Above MAX_FEATURES (H200, 2026-12-05, bf16, docs/benchmarks.md): the
    # forwards beat XLA (4096x18432 0.118 vs 0.210 ms, 1024x65536 0.117 vs
    # 0.160, 16x32768x64 axis 1 0.065 vs 0.090), and so does the column
    # backward (forward+VJP 0.169 vs 0.199 ms), but the rows' split backward
    # does not (VJP alone ~0.27 vs 0.21 ms at 18432 features, 0.23 vs 0.15
    # at 65536): `None` pairs the "triton" forward with XLA's VJP there.
    _, features, _, post = _rows_features(ba)
    return features <= MAX_FEATURES or not self.is_vjp or post > 1

  def _get_autotuning_configs(self, ba):
    return search_space(*_rows_features(ba), backward=self.is_vjp)


@dataclasses.dataclass(frozen=True)
class TritonLayerNormVjp(_TritonLayerNormMixin, xla.LayerNormVjp):
  """dx by a Triton kernel; dscale/doffset from per-program partial sums."""

  implementation = "triton"

  def _fwd(
      self, *, residuals, out, dout, x, scale, offset, axis, epsilon,
      scale_offset, subtract_mean, config, return_residuals,
  ):
    if residuals is None:  # A forward that saved nothing: recompute in XLA.
      residuals = _statistics(x, axis, epsilon, subtract_mean)
    if x.size == 0:  # No rows (or no features): nothing for a kernel to do.
      return super()._fwd(
          residuals=residuals, out=out, dout=dout, x=x, scale=scale,
          offset=offset, axis=axis, epsilon=epsilon,
          scale_offset=scale_offset, subtract_mean=subtract_mean,
          config=config, return_residuals=return_residuals,
      )
    mean, rstd = residuals
    view = _view(x, axis, config.block_rows)
    if view.is_3d:
      x_shape, _ = _array_shape(view)
      dx, parts = _bwd_columns(
          x.reshape(x_shape), dout.reshape(x_shape), mean, rstd, scale, view,
          config, scale_offset, subtract_mean, offset is not None)
    else:
      _check_wide_rows(self, view, config)
      dx, parts = self._bwd_rows(x, dout, mean, rstd, scale, offset, view,
                                 config, scale_offset, subtract_mean)
    grads = {"x": dx.reshape(x.shape)}
    if scale is not None:
      grads["scale"] = jnp.sum(parts.pop(0), axis=0).astype(scale.dtype)
    if offset is not None:
      grads["offset"] = jnp.sum(parts.pop(0), axis=0).astype(offset.dtype)
    return grads, None

  @staticmethod
  def _bwd_rows(x, dout, mean, rstd, scale, offset, view, config, scale_offset,
                subtract_mean):
    """dx [R, F] and the dscale/doffset partials of the [R, F] backward."""
    x_shape, stat_shape = _array_shape(view)
    # Each program writes a row of dscale/doffset partial sums: more programs
    # hide more latency but write (and jnp.sum reads) more partials.
    per_sm = config.programs_per_sm or max(1, 32 // config.num_warps)
    work = pl.cdiv(view.vectors, view.block)
    # Fewest programs that still use `iters` loop trips (balanced work).
    iters = pl.cdiv(work, min(work, _num_sms() * per_sm))
    num_programs = pl.cdiv(work, iters)
    inputs = [x.reshape(x_shape), dout.reshape(x_shape)]
    if subtract_mean:
      inputs.append(mean.reshape(stat_shape).astype(jnp.float32))
    inputs.append(rstd.reshape(stat_shape).astype(jnp.float32))
    if scale is not None:
      inputs.append(scale)
    if config.feature_chunk:
      return _bwd_split(inputs, view, config, num_programs, iters, per_sm, scale_offset,
                        subtract_mean, scale is not None, offset is not None, x.dtype)
    out_shape = [jax.ShapeDtypeStruct(x_shape, x.dtype)]
    partial = jax.ShapeDtypeStruct((num_programs, view.features), jnp.float32)
    out_shape += [partial] * ((scale is not None) + (offset is not None))
    kernel = functools.partial(
        _bwd_kernel, view=view, num_programs=num_programs, iters=iters,
        scale_offset=float(scale_offset), subtract_mean=subtract_mean,
        has_scale=scale is not None, has_offset=offset is not None,
        prefetch=_prefetch(config, VJP_PREFETCH),
    )
    outs = list(_pallas_call(
        kernel, out_shape=out_shape, grid=(num_programs,), config=config,
        name="tokamax_layer_norm_bwd",
    )(*inputs))
    return outs[0], outs[1:]


def _bwd_split(inputs, view, config, num_programs, iters, per_sm, scale_offset,
               subtract_mean, has_scale, has_offset, dtype):
  """The [R, F] backward by two kernels (config.feature_chunk): the rows'
  sums, then dx and the partials over [block_rows, feature_chunk] tiles;
  (dx, partials [G, F] f32)."""
  flags = dict(scale_offset=float(scale_offset), subtract_mean=subtract_mean,
               has_scale=has_scale)
  row_sum = jax.ShapeDtypeStruct((view.pre,), jnp.float32)
  chunk = min(config.feature_chunk, view.fp)
  sums = _pallas_call(
      functools.partial(_bwd_row_sums_kernel, view=view, num_programs=num_programs,
                        iters=iters, chunk=chunk if view.features > MAX_FEATURES else None,
                        **flags),
      out_shape=[row_sum] * (1 + subtract_mean), grid=(num_programs,), config=config,
      name="tokamax_layer_norm_bwd_row_sums",
  )(*inputs)
  chunks = pl.cdiv(view.features, chunk)
  # Row groups: about _CHUNK_PROGRAMS_PER_SM programs per SM over all chunks
  # (a program holds one [block_rows, chunk] tile: few registers).
  work = pl.cdiv(view.pre, view.block)
  programs = _num_sms() * max(per_sm, _CHUNK_PROGRAMS_PER_SM)
  iters2 = pl.cdiv(work, min(work, max(1, programs // chunks)))
  groups = pl.cdiv(work, iters2)
  out_shape = [jax.ShapeDtypeStruct((view.pre, view.features), dtype)]
  partial = jax.ShapeDtypeStruct((groups, view.features), jnp.float32)
  out_shape += [partial] * (has_scale + has_offset)
  outs = list(_pallas_call(
      functools.partial(_bwd_chunk_kernel, view=view, chunk=chunk, num_programs=groups,
                        iters=iters2, has_offset=has_offset, **flags),
      out_shape=out_shape, grid=(chunks, groups), config=config,
      name="tokamax_layer_norm_bwd_chunks",
  )(*inputs, *sums))
  return outs[0], outs[1:]


@dataclasses.dataclass(frozen=True)
class TritonLayerNorm(_TritonLayerNormMixin, xla.LayerNorm):
  """Fused layer norm / RMS norm forward in one Triton kernel."""

  implementation = "triton"
  vjp: op_lib.Op | None = dataclasses.field(default_factory=TritonLayerNormVjp)

  def _fwd(
      self, *, x, scale, offset, axis, epsilon, scale_offset, subtract_mean,
      config, return_residuals,
  ):
    if x.size == 0:  # No rows (or no features): nothing for a kernel to do.
      return super()._fwd(
          x=x, scale=scale, offset=offset, axis=axis, epsilon=epsilon,
          scale_offset=scale_offset, subtract_mean=subtract_mean,
          config=config, return_residuals=return_residuals,
      )
    view = _view(x, axis, config.block_rows)
    _check_wide_rows(self, view, config)
    x_shape, stat_shape = _array_shape(view)
    if view.is_3d and _column_forward(view.post, view.features):
      y, mean, rstd = _fwd_columns(
          x.reshape(x_shape), scale, offset, view, config, float(epsilon),
          scale_offset, subtract_mean)
      stats = None
      if return_residuals:
        stats = tuple(None if v is None else v.reshape(_stat_shape(x, axis))
                      for v in (mean, rstd))
      return y.reshape(x.shape), stats
    inputs = [x.reshape(x_shape)]
    inputs += [p for p in (scale, offset) if p is not None]
    out_shape = [jax.ShapeDtypeStruct(x_shape, x.dtype)]
    stat = jax.ShapeDtypeStruct(stat_shape, jnp.float32)
    if return_residuals:
      out_shape += [stat, stat] if subtract_mean else [stat]
    blocks = pl.cdiv(view.vectors, view.block)
    grid = (view.pre, blocks) if view.is_3d else (blocks,)
    loop, num_stages = None, None
    if config.programs_per_sm and not view.is_3d:
      # Fewest programs that still use `trips` loop trips; tiles past the
      # last are masked (vectors out of range). (Programs_per_sm on every
      # SM, some one trip short, ran 0-3 % slower on the H200 at 6 shapes,
      # docs/benchmarks.md 2026-12-04 10:00.)
      trips = pl.cdiv(blocks, min(blocks, _num_sms() * config.programs_per_sm))
      grid = (pl.cdiv(blocks, trips),)
      loop, num_stages = (grid[0], trips), config.num_stages
    flags = dict(
        view=view, epsilon=float(epsilon), scale_offset=float(scale_offset),
        subtract_mean=subtract_mean, has_scale=scale is not None,
        has_offset=offset is not None, save_stats=return_residuals, loop=loop)
    if config.feature_chunk and not view.is_3d:
      kernel = functools.partial(_fwd_chunked_kernel, chunk=min(config.feature_chunk, view.fp),
                                 **flags)
    else:
      kernel = functools.partial(_fwd_kernel, prefetch=_prefetch(config, LOOP_PREFETCH),
                                 **flags)
    outs = _pallas_call(
        kernel, out_shape=out_shape, grid=grid, config=config,
        name="tokamax_layer_norm_fwd", num_stages=num_stages,
    )(*inputs)
    y = outs[0].reshape(x.shape)
    if not return_residuals:
      return y, None
    rstd = outs[-1].reshape(_stat_shape(x, axis))
    mean = outs[1].reshape(_stat_shape(x, axis)) if subtract_mean else None
    return y, (mean, rstd)
