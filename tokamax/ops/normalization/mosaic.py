"""The "mosaic" implementation of layer_norm: a Pallas:Mosaic GPU forward (Hopper).

x is viewed as [R, F] (the normalised axis last, or followed only by size-1
dims; a free reshape). P CTAs of one warpgroup each (`programs_per_sm` per
SM) share the row blocks of `block_rows` rows: CTA g normalises blocks g, g +
P, g + 2P, ... Blocks stream in by TMA into a ring of `stages` shared-memory
slots, `stages` blocks ahead, so the bytes in flight wait in shared memory
rather than in registers (the limit of the Triton kernel, which holds its
prefetched tiles in registers); y leaves through `out_stages` slots by TMA
stores that complete while the next blocks are normalised. The last block
may reach past R: TMA reads zeros there and drops the stores.

Register layouts (`rows_per_step`): F <= 1024, 4 rows at a time, one per
warp (the row reductions are warp shuffles); F <= 4096, 2 rows, each across
two warps; larger F, one row across the warpgroup (`Layout.WG_STRIDED`).
Reductions across warps go through shared memory. A block's rows are read
into registers before any is normalised (`LOAD_BLOCK_FIRST`). scale and
offset are loaded once per CTA into registers, while the ring's first
blocks are in flight. Statistics and arithmetic in f32, as in the XLA
reference: mean = sum(x)/F, rstd = rsqrt(sum((x - mean)^2)/F + eps); rows
across the warpgroup get both sums in one exchange, shifted by the previous
row's mean, with the two exact passes as the fallback (`ONE_EXCHANGE`).

Residuals (mean or None, rstd; those of the XLA reference) when the gradient
is taken: each CTA collects its rows' statistics in shared-memory chunks of
256 and stores each chunk by TMA into row g of an [P, rows] f32 buffer,
which XLA puts back in row order. The gradient is the Triton backward kernel
(`triton.TritonLayerNormVjp`): the backward reads x, dy and writes dx, with
no prefetch problem for TMA to solve.

Supported: NVIDIA sm_90 (or the Mosaic GPU interpreter, see
`tokamax._src.pallas_mosaic`), bf16/f16 x, any float scale/offset (not
f64), 32 <= F <= 8192 with F a multiple of 32 (F <= 1024), 64 (<= 4096)
or 128.
H200, bf16 x, f32 scale/offset, forward: 3.89-3.93 TB/s at 8192x8192,
3.94 at 65536x1024, 3.80 at 16384x4096, 3.95 at 32768x2048, 3.90 at
131072x512, against 3.45 / 3.82 / 3.23 / 3.46 / 3.45 for "triton" in the
same run (docs/benchmarks.md, 2026-12-02 20:12).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import pydantic
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import arith, memref, scf, vector
from jax.extend.mlir.dialects import math as mlir_math

from tokamax._src import op as op_lib
from tokamax._src import pallas_mosaic
from tokamax._src import pallas_triton
from tokamax.ops.normalization import triton, xla

MAX_FEATURES = 8192
# Under implementation=None "mosaic" steps aside for "triton" below this F:
# H200 2026-12-04 (docs/benchmarks.md), the "triton" forward with one-warp
# programs is faster at 512 features (3.94 against 3.89-3.90 TB/s) and on
# par at 1024 (3.80-3.93 against 3.94-3.95), and "triton" forward+backward
# is 3-6 % faster at both; from 2048 the "mosaic" forward is 1-5 % faster.
PREFERRED_MIN_FEATURES = 2048
# Rows per statistics chunk (a TMA box is at most 256 elements along a dim).
_STAT_CHUNK = 256
_TARGET_BLOCK_BYTES = 16 * 1024
# Read a block's rows into registers before normalising any of them (a
# compile-time switch; benchmarks/layer_norm_mosaic_sweep.py A/Bs it).
LOAD_BLOCK_FIRST = True
# Rows per step whose kernels compile without Pallas' automatic warpgroup
# barriers around every shared-memory store (two per stored step): measured
# +1.5 % at F = 2048 (2 rows per step), -6 % at F = 1024 (4), neutral at
# 8192 (1) on the H200 (docs/benchmarks.md, 2026-12-02 13:30). Safe: each
# trip's wait_smem_to_gmem ends in a warpgroup barrier (the y slot and
# statistics chunk are free before any thread writes them) and commit_smem
# in another (every thread's reads of the x slot and writes of the y slot
# are done before the TMA refill and store are issued).
NO_AUTO_BARRIERS_ROWS_PER_STEP = (2,)
# Rows spanning the warpgroup (F > 4096) with a mean: both sums of the
# statistics in one cross-warp exchange (one barrier instead of four),
# shifted by the previous row's mean (`_shifted_row_sums`); a row whose mean
# lies more than SHIFT_RATIO standard deviations from that shift gets both
# statistics again in two exact passes. H200, 8192^2: +0.9 % (3.82 vs 3.79
# TB/s, same run).
ONE_EXCHANGE = True
SHIFT_RATIO = 2.0


@pydantic.dataclasses.dataclass(frozen=True)
class MosaicLayerNormConfig:
  """Rows per TMA block (a power of 2), input and output ring depths, and
  CTAs per SM (each one warpgroup)."""

  block_rows: pydantic.PositiveInt = 1
  stages: pydantic.PositiveInt = 3
  out_stages: pydantic.PositiveInt = 2
  programs_per_sm: pydantic.PositiveInt = 1

  @pydantic.field_validator("block_rows")
  @classmethod
  def _power_of_two(cls, v: int) -> int:
    if not pallas_triton.is_pow2(v) or v > _STAT_CHUNK:
      raise ValueError(f"must be a power of 2 <= {_STAT_CHUNK}, got {v}")
    return v


def rows_per_step(features: int) -> int:
  """Rows a warpgroup normalises at once: 4 (a warp each), 2, or 1."""
  return 4 if features <= 1024 else 2 if features <= 4096 else 1


def _vector(features: int, lanes: int) -> int:
  """Elements per thread per load: the largest of 8, 4, 2, 1 tiling F."""
  return next(v for v in (8, 4, 2, 1) if features % (lanes * v) == 0)


def _chunk(features: int) -> int:
  """TMA inner box width: the largest multiple of 8 <= 256 dividing F."""
  return next(c for c in range(min(256, features), 0, -8) if features % c == 0)


def _smem_bytes(config: MosaicLayerNormConfig, features: int, itemsize: int) -> int:
  """Shared memory of one CTA: the x and y rings, the statistics chunks and
  4 KiB for the cross-warp reduction scratch and 1 KiB alignment."""
  block = config.block_rows * features * itemsize
  return (config.stages + config.out_stages) * block + 4 * _STAT_CHUNK * 4 + 4096


def heuristic_config(rows: int, features: int, itemsize: int) -> MosaicLayerNormConfig:
  """~16 KiB blocks, 1 CTA per SM; 4 blocks in flight with one output slot
  when a step normalises 4 rows (F <= 1024) or 1 row (F > 4096), 4 with two
  slots at 2 rows up to F = 2048, 3 with two above: the fastest measured on
  the H200 at F = 512, 1024, 2048 and 8192 (benchmarks/layer_norm_mosaic_sweep.py;
  at 8192 (4, 1) reads 3.85-3.94 TB/s against 3.80-3.83 for (3, 2), 2026-12-02)."""
  rps = rows_per_step(features)
  block_rows = pallas_triton.prev_pow2(max(1, _TARGET_BLOCK_BYTES // (features * itemsize)))
  block_rows = max(rps, min(block_rows, pallas_triton.next_pow2(rows), 64))
  stages = 3 if rps == 2 and features > 2048 else 4
  return MosaicLayerNormConfig(block_rows=block_rows, stages=stages,
                               out_stages=2 if rps == 2 else 1)


def search_space(rows: int, features: int, itemsize: int) -> set[MosaicLayerNormConfig]:
  """block_rows in [h/2, 2h] of the heuristic h, 2-5 stages, 1-2 output
  slots, 1-2 CTAs per SM, where the shared memory fits."""
  h = heuristic_config(rows, features, itemsize)
  rps = rows_per_step(features)
  configs = set()
  for br, st, ost, pps in itertools.product(
      (h.block_rows // 2, h.block_rows, 2 * h.block_rows), (2, 3, 4, 5), (1, 2), (1, 2)):
    if br < rps or br > max(rps, pallas_triton.next_pow2(rows)):
      continue
    c = MosaicLayerNormConfig(block_rows=br, stages=st, out_stages=ost, programs_per_sm=pps)
    if pps * _smem_bytes(c, features, itemsize) <= pallas_mosaic.SMEM_BYTES:
      configs.add(c)
  return configs


def _num_sms() -> int:
  return pallas_triton.num_sms()


def _rows_features(ba: op_lib.BoundArguments) -> tuple[int, int, int]:
  rows, f, itemsize, _ = triton._rows_features(ba)
  return rows, f, itemsize


def check_supported(op: op_lib.Op, ba: op_lib.BoundArguments) -> None:
  pallas_mosaic.check_platform(op)
  pallas_triton.check_not_explicitly_sharded(op, ba)
  args = ba.arguments
  x = args["x"]
  pallas_mosaic.check_dtype(op, "x", x.dtype)
  for name in ("scale", "offset"):
    if args[name] is not None and jnp.dtype(args[name].dtype) == jnp.float64:
      raise op.unsupported(f"{name} is fp64.")
  rows, f, _, post = triton._rows_features(ba)
  if post != 1:
    raise op.unsupported(
        "normalises the last axis only (or one followed by size-1 dims); got"
        f" axis {args['axis']} of shape {x.shape}."
    )
  if not 32 <= f <= MAX_FEATURES or f % (32 * (4 // rows_per_step(f))):
    raise op.unsupported(
        f"needs 32 <= features <= {MAX_FEATURES}, a multiple of 32 (up to 1024),"
        f" 64 (up to 4096) or 128 (a row spans 32 lanes of 1, 2 or 4 warps); got {f}."
    )


def _layout(features: int, rps: int):
  """Register layout of `rps` rows of x ([rps, F] for rps > 1, [F/C, C] for 1)."""
  if rps == 1:
    return plgpu.Layout.WG_STRIDED(
        (features // _chunk(features), _chunk(features)), vec_size=_vector(features, 128))
  warps_per_row = 4 // rps
  vec = _vector(features, 32 * warps_per_row)
  if rps == 4:  # tile [4, 32 vec] -> (warp, lane, vector)
    tiling, warp_dims = ((4, 32 * vec), (vec,)), (-3,)
  else:  # tile [2, 64 vec] -> (row, column half, lane, vector): 2 x 2 warps
    tiling, warp_dims = ((2, 64 * vec), (32 * vec,), (vec,)), (-4, -3)
  return plgpu.Layout.TILED(mgpu_fa.Tiling(tiling), warp_dims=warp_dims,
                            lane_dims=(-2,), vector_dim=-1)


def _shifted_row_sums(x, shift, half, scratch, interpret: bool):
  """(sum(d), sum(d^2)) with d = x - shift over one row x [F/C, C] (f32,
  WG_STRIDED), with a single cross-warp exchange: lane 0 of each warp puts
  its two partial sums into half `half` (0 or 1) of `scratch` [16] f32, one
  barrier, every thread adds the four pairs in the same order (so the sums,
  and any branch on them, are uniform). Consecutive rows alternate halves:
  a half is rewritten only after the next row's barrier, which every thread
  reaches after reading it.

  Why shifted sums are safe here: var = sum(d^2)/F - (sum(d)/F)^2 loses
  about 1 + (mean - shift)^2 / var ulps to cancellation (the shifted
  one-pass algorithm in Chan, Golub & LeVeque, "Algorithms for computing
  the sample variance: analysis and recommendations", 1983), so the caller
  keeps it only when |mean - shift| <= SHIFT_RATIO sigma (5 ulps of f32 at
  2) and otherwise recomputes mean and variance in two exact passes.
  """
  if interpret:  # the same sums, without layouts
    d = x - shift
    return jnp.sum(d), jnp.sum(d * d)
  splat = plgpu.Layout.WG_SPLAT(())
  out = plgpu.ShapeDtypeStruct((), jnp.float32, splat)

  @plgpu.inline_mgpu(arg_types=(_layout(x.shape[0] * x.shape[1], 1), splat, splat,
                                plgpu.RefType()),
                     return_type=(out, out))
  def run(_, x, shift, half, scratch):
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    cst = lambda v: arith.constant(i32, v)
    regs = list(x.registers.flat)
    c = vector.broadcast(regs[0].type, shift.registers.item())
    ds = [arith.subf(r, c) for r in regs]
    # Per thread: the vectors' lanes are independent chains (ILP).
    vs, vq = ds[0], arith.mulf(ds[0], ds[0])
    for d in ds[1:]:
      vs = arith.addf(vs, d)
      vq = mlir_math.fma(d, d, vq)

    def lanes_sum(v):  # a tree over the vector's lanes
      parts = [vector.extract(v, dynamic_position=[], static_position=[i])
               for i in range(ir.VectorType(v.type).shape[0])]
      while len(parts) > 1:
        parts = [arith.addf(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
      return parts[0]

    ps, pq = lanes_sum(vs), lanes_sum(vq)
    for stride in (1, 2, 4, 8, 16):  # across the warp, both sums interleaved
      ps = arith.addf(ps, mgpu.utils.shfl_bfly(ps, stride))
      pq = arith.addf(pq, mgpu.utils.shfl_bfly(pq, stride))
    tid = arith.remui(mgpu.utils.thread_idx(), cst(128))
    base = arith.muli(half.registers.item(), cst(8))
    slot = arith.addi(base, arith.muli(arith.divui(tid, cst(32)), cst(2)))
    lane0 = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(tid, cst(32)), cst(0))
    write = scf.IfOp(lane0)
    with ir.InsertionPoint(write.then_block):
      index = lambda v: arith.index_cast(ir.IndexType.get(), v)
      memref.store(ps, scratch, [index(slot)])
      memref.store(pq, scratch, [index(arith.addi(slot, cst(1)))])
      scf.yield_([])
    mgpu.utils.warpgroup_barrier()
    pairs = vector.load(ir.VectorType.get((8,), f32), scratch,
                        [arith.index_cast(ir.IndexType.get(), base)])
    part = [vector.extract(pairs, dynamic_position=[], static_position=[i])
            for i in range(8)]
    add = arith.addf
    total_s = add(add(part[0], part[2]), add(part[4], part[6]))
    total_q = add(add(part[1], part[3]), add(part[5], part[7]))
    return (mgpu.FragmentedArray.splat(total_s, ()),
            mgpu.FragmentedArray.splat(total_q, ()))

  return run(x, shift, half, scratch)


def _fwd_kernel(x_gmem, *refs, rows, features, block_rows, stages, out_stages,
                programs, epsilon, scale_offset, subtract_mean, has_scale,
                has_offset, save_stats, interpret):
  """One CTA (a warpgroup): row blocks g, g + P, ... of x [R, F/C, C]."""
  refs = list(refs)
  s_gmem = refs.pop(0) if has_scale else None
  o_gmem = refs.pop(0) if has_offset else None
  y_gmem = refs.pop(0)
  mean_gmem = refs.pop(0) if save_stats and subtract_mean else None
  rstd_gmem = refs.pop(0) if save_stats else None
  x_ring, y_ring, x_bars, mean_smem, rstd_smem, sums_smem = refs
  f, rps = features, rows_per_step(features)
  nc, c = features // _chunk(features), _chunk(features)
  layout = _layout(f, rps)
  nblocks = pl.cdiv(rows, block_rows)
  g = lax.axis_index("g")
  # The first nblocks % P CTAs take one block more than the others.
  my_trips = (nblocks - g + programs - 1) // programs
  rows_of = lambda k: pl.ds((g + k * programs) * block_rows, block_rows)

  def load_param(ref, add=0.0):
    if interpret:  # the interpreter has no layouts and no reshaped refs
      p = ref[...].astype(jnp.float32)
      return (p + add).reshape(f) if rps > 1 else p + add
    if rps == 1:
      p = plgpu.load(ref, layout=layout, optimized=False)
    else:
      p = plgpu.load(ref.reshape(f), layout=layout.reduce(0), optimized=False)
    p = p.astype(jnp.float32) + add
    return p if rps == 1 else lax.broadcast_in_dim(p, (rps, f), (1,))

  # The ring's first blocks, in flight while scale/offset load.
  for k in range(stages):
    @pl.when(k < my_trips)
    def _():
      plgpu.copy_gmem_to_smem(x_gmem.at[rows_of(k)], x_ring.at[k], x_bars.at[k])

  scale = load_param(s_gmem, scale_offset) if has_scale else None
  offset = load_param(o_gmem) if has_offset else None

  one_exchange = ONE_EXCHANGE and rps == 1 and subtract_mean

  def normalise(x, shift, half):
    """x: rps rows (f32) -> (y, mean, rstd); mean/rstd [rps] or scalars.

    shift, half: the previous row's mean and this row's exchange half (used
    with one_exchange)."""
    axis = None if rps == 1 else 1
    per_row = (lambda v: v) if rps == 1 else (lambda v: lax.broadcast_in_dim(v, x.shape, (0,)))
    mean = None
    if one_exchange:
      s1, s2 = _shifted_row_sums(x, shift, half, sums_smem, interpret)
      m1 = s1 / f
      var = s2 / f - m1 * m1
      # A poor shift: both statistics again, exactly (two passes).
      def exact(x):
        mean = jnp.sum(x) / f
        d = x - mean
        return mean, jnp.sum(d * d) / f
      mean, var = lax.cond(m1 * m1 > SHIFT_RATIO**2 * var, exact,
                           lambda x: (shift + m1, var), x)
      x = x - mean
      rstd = lax.rsqrt(var + epsilon)
    else:
      if subtract_mean:
        mean = jnp.sum(x, axis=axis) / f
        x = x - per_row(mean)
      rstd = lax.rsqrt(jnp.sum(x * x, axis=axis) / f + epsilon)
    y = x * per_row(rstd)
    if has_scale:
      y = y * scale
    if has_offset:
      y = y + offset
    return y, mean, rstd

  def load(x_smem, r):
    if rps == 1:
      return plgpu.load(x_smem.at[r], layout=layout) if not interpret else x_smem[r]
    if interpret:
      return x_smem[pl.ds(r, rps)].reshape(rps, f)
    return plgpu.load(x_smem.reshape(block_rows, f).at[pl.ds(r, rps)], layout=layout)

  def block(k, x_smem, y_smem, shift):
    """Normalises block k (x_smem -> y_smem); returns its last row's mean
    (the next shift; one_exchange only, else `shift` unchanged)."""
    pos = lax.rem(k * block_rows, jnp.int32(2 * _STAT_CHUNK))  # in the 2-chunk stats ring
    steps = range(0, block_rows, rps)
    # All of the block's rows are read before any y is written: shared-memory
    # stores would otherwise order the next step's loads behind them.
    xs = [load(x_smem, r) for r in steps] if LOAD_BLOCK_FIRST else None
    for i, r in enumerate(steps):
      x = xs[i] if LOAD_BLOCK_FIRST else load(x_smem, r)
      half = lax.rem(k * block_rows + r, jnp.int32(2))
      y, mean, rstd = normalise(x.astype(jnp.float32), shift, half)
      if one_exchange:
        shift = mean
      y = y.astype(y_smem.dtype)
      if rps == 1:
        y_smem[r] = y
      elif interpret:
        y_smem[pl.ds(r, rps)] = y.reshape(rps, nc, c)
      else:
        y_smem.reshape(block_rows, f)[pl.ds(r, rps)] = y
      if save_stats:
        for ref, v in ((mean_smem, mean), (rstd_smem, rstd)):
          if v is not None:
            ref[pl.ds(pos + r, rps)] = v if rps > 1 else jnp.broadcast_to(v, (1,))
    return shift

  def trip(k, shift):
    slot, out_slot = lax.rem(k, jnp.int32(stages)), lax.rem(k, jnp.int32(out_stages))
    plgpu.barrier_wait(x_bars.at[slot])
    # The y slot (and a stats chunk) is free once its store has read it.
    plgpu.wait_smem_to_gmem(out_stages - 1, wait_read_only=True)
    shift = block(k, x_ring.at[slot], y_ring.at[out_slot], shift)
    plgpu.commit_smem()

    @pl.when(k + stages < my_trips)
    def _():
      plgpu.copy_gmem_to_smem(x_gmem.at[rows_of(k + stages)], x_ring.at[slot],
                              x_bars.at[slot])

    if save_stats:
      done = (k + 1) * block_rows
      @pl.when((lax.rem(done, jnp.int32(_STAT_CHUNK)) == 0) | (k + 1 == my_trips))
      def _():
        chunk = (done - 1) // _STAT_CHUNK
        half = pl.ds(lax.rem(chunk, jnp.int32(2)) * _STAT_CHUNK, _STAT_CHUNK)
        dst = (g, pl.ds(chunk * _STAT_CHUNK, _STAT_CHUNK))
        for src, gm in ((mean_smem, mean_gmem), (rstd_smem, rstd_gmem)):
          if gm is not None:  # committed with this trip's y store below
            plgpu.copy_smem_to_gmem(src.at[half], gm.at[dst], commit_group=False)

    plgpu.copy_smem_to_gmem(y_ring.at[out_slot], y_gmem.at[rows_of(k)])
    return shift

  lax.fori_loop(jnp.int32(0), my_trips, trip, jnp.float32(0.0))
  plgpu.wait_smem_to_gmem(0)


def layer_norm_forward(x2, scale, offset, *, epsilon, scale_offset,
                       subtract_mean, config: MosaicLayerNormConfig,
                       return_residuals: bool):
  """x2 [R, F] -> (y [R, F], mean [R] or None, rstd [R] or None)."""
  rows, f = x2.shape
  br = config.block_rows
  nblocks = pl.cdiv(rows, br)
  programs = min(nblocks, _num_sms() * config.programs_per_sm)
  trips = pl.cdiv(nblocks, programs)
  stat_cols = pl.cdiv(trips * br, _STAT_CHUNK) * _STAT_CHUNK
  nc, c = f // _chunk(f), _chunk(f)
  rps = rows_per_step(f)
  # TMA boxes are at most 256 wide: x and the parameters as [.., F/C, C].
  inputs = [x2.reshape(rows, nc, c)]
  inputs += [p.reshape(nc, c) for p in (scale, offset) if p is not None]
  stat = jax.ShapeDtypeStruct((programs, stat_cols), jnp.float32)
  out_type = [jax.ShapeDtypeStruct((rows, nc, c), x2.dtype)]
  if return_residuals:
    out_type += [stat, stat] if subtract_mean else [stat]
  interpret = pallas_mosaic.interpret_params()
  kernel = plgpu.kernel(
      functools.partial(
          _fwd_kernel, rows=rows, features=f, block_rows=br, stages=config.stages,
          out_stages=config.out_stages, programs=programs, epsilon=float(epsilon),
          scale_offset=float(scale_offset), subtract_mean=subtract_mean,
          has_scale=scale is not None, has_offset=offset is not None,
          save_stats=return_residuals, interpret=interpret is not None),
      out_type=out_type,
      scratch_types=[
          plgpu.SMEM((config.stages, br, nc, c), x2.dtype),
          plgpu.SMEM((config.out_stages, br, nc, c), x2.dtype),
          plgpu.Barrier(num_barriers=config.stages),
          plgpu.SMEM((2 * _STAT_CHUNK,), jnp.float32),
          plgpu.SMEM((2 * _STAT_CHUNK,), jnp.float32),
          plgpu.SMEM((16,), jnp.float32),  # _shifted_row_sums' two halves
      ],
      grid=(programs,),
      grid_names=("g",),
      kernel_name="tokamax_layer_norm_fwd_mosaic",
      compiler_params=pallas_mosaic.compiler_params(
          unsafe_no_auto_barriers=rps in NO_AUTO_BARRIERS_ROWS_PER_STEP),
      interpret=interpret,
  )
  outs = kernel(*inputs)
  y = outs[0].reshape(rows, f)
  if not return_residuals:
    return y, None, None

  def in_row_order(s):
    # Entry (g, k * br + i) is row (g + k * P) * br + i.
    s = s.reshape(programs, stat_cols // br, br).transpose(1, 0, 2)
    return s.reshape(-1)[:rows]

  rstd = in_row_order(outs[-1])
  mean = in_row_order(outs[1]) if subtract_mean else None
  return y, mean, rstd


@dataclasses.dataclass(frozen=True)
class MosaicLayerNorm(xla.LayerNorm):
  """Layer norm / RMS norm forward streaming x through TMA rings (Hopper);
  the gradient is the Triton backward kernel."""

  implementation = "mosaic"
  config_cls = MosaicLayerNormConfig
  vjp: op_lib.Op | None = dataclasses.field(default_factory=triton.TritonLayerNormVjp)

  def supported_on(self, device) -> bool:
    return pallas_mosaic.supported_on(device)

  def check_supported(self, ba):
    check_supported(self, ba)

  def preferred(self, ba):
    # See PREFERRED_MIN_FEATURES.
    return _rows_features(ba)[1] >= PREFERRED_MIN_FEATURES

  def _get_heuristics_config(self, ba):
    return heuristic_config(*_rows_features(ba))

  def _get_autotuning_configs(self, ba):
    return search_space(*_rows_features(ba))

  def _fwd(self, *, x, scale, offset, axis, epsilon, scale_offset,
           subtract_mean, config, return_residuals):
    if x.size == 0:
      return super()._fwd(
          x=x, scale=scale, offset=offset, axis=axis, epsilon=epsilon,
          scale_offset=scale_offset, subtract_mean=subtract_mean,
          config=config, return_residuals=return_residuals)
    f = x.shape[axis]
    if config.block_rows % rows_per_step(f):
      raise self.unsupported(
          f"block_rows must be a multiple of {rows_per_step(f)} at {f} features.")
    if _smem_bytes(config, f, x.dtype.itemsize) > pallas_mosaic.SMEM_BYTES:
      raise self.unsupported(f"config {config} exceeds shared memory at {f} features.")
    y, mean, rstd = layer_norm_forward(
        x.reshape(-1, f), scale, offset, epsilon=epsilon, scale_offset=scale_offset,
        subtract_mean=subtract_mean, config=config, return_residuals=return_residuals)
    y = y.reshape(x.shape)
    if not return_residuals:
      return y, None
    stat_shape = triton._stat_shape(x, axis)
    return y, (None if mean is None else mean.reshape(stat_shape), rstd.reshape(stat_shape))
