"""The "triton" implementation of layer_norm: Pallas:Triton kernels.

Canonical view: x is reshaped (free, normalised axis last) to [R, F]. One
program of the forward grid handles `block_rows` consecutive rows; its tile is
[block_rows, Fp] with Fp = next_pow2(F) (Triton blocks are powers of two);
columns >= F and rows >= R are masked. Statistics and arithmetic are in f32.

Forward (per row): mean = sum(x)/F, xc = x - mean (x for RMS norm),
rstd = rsqrt(sum(xc^2)/F + eps), y = xc * rstd * (scale + scale_offset) + offset.
Residuals are those of the XLA reference: (mean or None, rstd), f32, keepdims
shapes x.shape[:-1] + (1,), so either VJP reads either forward's residuals.

Backward: a grid of G programs; program p handles row blocks p, p + G, ...
computing dx (formula in xla.LayerNormVjp) and accumulating the per-column
partial sums dscale_p = sum(dy * xhat), doffset_p = sum(dy) over its rows in
f32 registers; they are written to [G, F] f32 buffers and summed over G by XLA
(no atomics, deterministic). G is capped near the number of resident programs
so the partial buffers stay small next to x.

Supported: NVIDIA sm_80+ (or interpret mode, see `interpret_mode`), bf16/f16/
f32 inputs and parameters, the last axis only, F <= 16384.
"""

from __future__ import annotations

import dataclasses
import functools

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


MAX_FEATURES = 16384
# Heuristic targets: bytes a forward program moves (x read + y written), and
# f32 values per thread in one [block_rows, Fp] tile (register budget; the
# backward keeps ~4 such tiles live).
_TARGET_BYTES = 32 * 1024
_VALUES_PER_THREAD = 32





@pydantic.dataclasses.dataclass(frozen=True)
class TritonLayerNormConfig:
  """Rows per program (a power of 2) and warps per program (4, 8, ...)."""

  block_rows: pydantic.PositiveInt = 1
  num_warps: pydantic.PositiveInt = 4

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


def _rows_features(ba: op_lib.BoundArguments) -> tuple[int, int, int]:
  """(R, F, itemsize of x) of the canonical [R, F] view."""
  x = ba.arguments["x"]
  f = x.shape[ba.arguments["axis"]]
  rows = 1
  for i, d in enumerate(x.shape):
    if i != ba.arguments["axis"]:
      rows *= d
  return rows, f, jnp.dtype(x.dtype).itemsize


def _warps_for(fp: int) -> int:
  return 4 if fp < 1024 else 8 if fp < 8192 else 16


def heuristic_config(rows: int, features: int, itemsize: int) -> TritonLayerNormConfig:
  """Warps by feature size; rows so a program moves ~32 KiB (see module doc)."""
  fp = _next_pow2(features)
  warps = _warps_for(fp)
  block_rows = _prev_pow2(_TARGET_BYTES // (2 * fp * itemsize))
  block_rows = min(block_rows, _prev_pow2(_VALUES_PER_THREAD * 32 * warps // fp))
  block_rows = min(block_rows, _next_pow2(rows))
  return TritonLayerNormConfig(block_rows=max(1, block_rows), num_warps=warps)


def search_space(rows: int, features: int, itemsize: int) -> set[TritonLayerNormConfig]:
  """block_rows in [h/2, 4h] of the heuristic h, warps 4/8/16; 4-64 values/thread."""
  h = heuristic_config(rows, features, itemsize)
  fp = _next_pow2(features)
  configs = set()
  for block_rows in (h.block_rows // 2, h.block_rows, 2 * h.block_rows, 4 * h.block_rows):
    if block_rows < 1 or block_rows > _next_pow2(rows):
      continue
    for warps in (4, 8, 16):
      per_thread = block_rows * fp / (32 * warps)
      if 4 <= per_thread <= 64:
        configs.add(TritonLayerNormConfig(block_rows=block_rows, num_warps=warps))
  return configs


def _num_sms() -> int:
  return pallas_triton.num_sms()


def check_supported(op: op_lib.Op, ba: op_lib.BoundArguments) -> None:
  """Shared by the forward and the VJP (`ba`: the forward's arguments)."""
  pallas_triton.check_platform(op)
  args = ba.arguments
  x = args["x"]
  for name in ("x", "scale", "offset"):
    if args[name] is not None:
      pallas_triton.check_dtype(op, name, args[name].dtype)
  if args["axis"] != x.ndim - 1:
    raise op.unsupported(
        f"the kernel normalises only the last axis (got axis {args['axis']} of"
        f" a rank-{x.ndim} array); move it last or use implementation='xla'."
    )
  if x.shape[-1] > MAX_FEATURES:
    raise op.unsupported(
        f"at most {MAX_FEATURES} features fit one program's registers; got"
        f" {x.shape[-1]}."
    )


def _pallas_call(kernel, *, out_shape, grid, config, name):
  return pallas_triton.pallas_call(
      kernel, out_shape=out_shape, grid=grid, num_warps=config.num_warps,
      name=name,
  )


def _tile_mask(r0, block_rows, rows, fp, features):
  """([block_rows] row mask, [block_rows, fp] tile mask) for rows r0...."""
  row_ok = r0 + jnp.arange(block_rows) < rows
  col_ok = jnp.arange(fp) < features
  return row_ok, row_ok[:, None] & col_ok[None, :]


def _load_param(ref, fp, features, add=0.0):
  """[fp] f32 parameter (masked columns 0), plus `add` on valid columns."""
  col_ok = jnp.arange(fp) < features
  p = pltr.load(ref.at[pl.ds(_i32(0), fp)], mask=col_ok, other=0.0).astype(jnp.float32)
  return jnp.where(col_ok, p + add, 0.0) if add else p


def _fwd_kernel(*refs, rows, features, block_rows, fp, epsilon, scale_offset,
                subtract_mean, has_scale, has_offset, save_stats):
  """One program: rows [r0, r0 + block_rows) of x [R, F] -> y (+ mean, rstd)."""
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  offset_ref = refs.pop(0) if has_offset else None
  y_ref = refs.pop(0)
  mean_ref = refs.pop(0) if save_stats and subtract_mean else None
  rstd_ref = refs.pop(0) if save_stats else None

  r0 = _i32(pl.program_id(0) * block_rows)
  row_ok, mask = _tile_mask(r0, block_rows, rows, fp, features)
  tile = (pl.ds(r0, block_rows), pl.ds(_i32(0), fp))
  x = pltr.load(x_ref.at[tile], mask=mask, other=0.0).astype(jnp.float32)
  if subtract_mean:
    mean = jnp.sum(x, axis=1) / features
    # Masked columns must not contribute (x - mean) to the variance.
    xc = jnp.where(mask, x - mean[:, None], 0.0)
  else:
    xc = x
  rstd = lax.rsqrt(jnp.sum(xc * xc, axis=1) / features + epsilon)
  y = xc * rstd[:, None]
  if has_scale:
    y = y * _load_param(scale_ref, fp, features, scale_offset)[None, :]
  if has_offset:
    y = y + _load_param(offset_ref, fp, features)[None, :]
  pltr.store(y_ref.at[tile], y.astype(y_ref.dtype), mask=mask)
  if mean_ref is not None:
    pltr.store(mean_ref.at[pl.ds(r0, block_rows)], mean, mask=row_ok)
  if rstd_ref is not None:
    pltr.store(rstd_ref.at[pl.ds(r0, block_rows)], rstd, mask=row_ok)


def _bwd_kernel(*refs, rows, features, block_rows, fp, num_programs, iters,
                scale_offset, subtract_mean, has_scale, has_offset):
  """Program p: dx for row blocks p, p+G, ...; partial dscale/doffset row p."""
  refs = list(refs)
  x_ref, dy_ref = refs.pop(0), refs.pop(0)
  mean_ref = refs.pop(0) if subtract_mean else None
  rstd_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  dx_ref = refs.pop(0)
  dscale_ref = refs.pop(0) if has_scale else None
  doffset_ref = refs.pop(0) if has_offset else None

  pid = _i32(pl.program_id(0))
  w = _load_param(scale_ref, fp, features, scale_offset) if has_scale else None

  def body(k, acc):
    acc_ds, acc_db = acc
    r0 = _i32((pid + k * num_programs) * block_rows)
    row_ok, mask = _tile_mask(r0, block_rows, rows, fp, features)
    tile = (pl.ds(r0, block_rows), pl.ds(_i32(0), fp))
    stat = pl.ds(r0, block_rows)
    x = pltr.load(x_ref.at[tile], mask=mask, other=0.0).astype(jnp.float32)
    dy = pltr.load(dy_ref.at[tile], mask=mask, other=0.0).astype(jnp.float32)
    # Rows out of range get rstd = 0, hence xhat = dx = 0.
    rstd = pltr.load(rstd_ref.at[stat], mask=row_ok, other=0.0)[:, None]
    if subtract_mean:
      mean = pltr.load(mean_ref.at[stat], mask=row_ok, other=0.0)[:, None]
      xhat = jnp.where(mask, (x - mean) * rstd, 0.0)
    else:
      xhat = x * rstd
    g = dy * w[None, :] if has_scale else dy
    proj = jnp.sum(g * xhat, axis=1, keepdims=True) / features
    if subtract_mean:
      centred = g - jnp.sum(g, axis=1, keepdims=True) / features
    else:
      centred = g
    dx = rstd * (centred - xhat * proj)
    pltr.store(dx_ref.at[tile], dx.astype(dx_ref.dtype), mask=mask)
    if has_scale:
      acc_ds = acc_ds + jnp.sum(dy * xhat, axis=0)
    if has_offset:
      acc_db = acc_db + jnp.sum(dy, axis=0)
    return acc_ds, acc_db

  zeros = jnp.zeros((fp,), jnp.float32)
  acc_ds, acc_db = lax.fori_loop(_i32(0), _i32(iters), body, (zeros, zeros))
  col = (pid, pl.ds(_i32(0), fp))
  col_ok = jnp.arange(fp) < features
  if has_scale:
    pltr.store(dscale_ref.at[col], acc_ds, mask=col_ok)
  if has_offset:
    pltr.store(doffset_ref.at[col], acc_db, mask=col_ok)


def _stat_shape(x):
  return x.shape[:-1] + (1,)


def _statistics(x, epsilon, subtract_mean):
  """(mean or None, rstd) over the last axis in f32, keepdims (XLA)."""
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True) if subtract_mean else None
  xc = xf - mean if subtract_mean else xf
  return mean, lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + epsilon)


class _TritonLayerNormMixin:
  """Support checks, config and search space shared by forward and VJP."""

  config_cls = TritonLayerNormConfig

  def supported_on(self, device) -> bool:
    return pallas_triton.supported_on(device)

  def check_supported(self, ba):
    check_supported(self, ba)

  def _get_heuristics_config(self, ba):
    return heuristic_config(*_rows_features(ba))

  def _get_autotuning_configs(self, ba):
    return search_space(*_rows_features(ba))


@dataclasses.dataclass(frozen=True)
class TritonLayerNormVjp(_TritonLayerNormMixin, xla.LayerNormVjp):
  """dx by a Triton kernel; dscale/doffset from per-program partial sums."""

  implementation = "triton"

  def _fwd(
      self, *, residuals, out, dout, x, scale, offset, axis, epsilon,
      scale_offset, subtract_mean, config, return_residuals,
  ):
    if residuals is None:  # A forward that saved nothing: recompute in XLA.
      residuals = _statistics(x, epsilon, subtract_mean)
    if x.size == 0:  # No rows (or no features): nothing for a kernel to do.
      return super()._fwd(
          residuals=residuals, out=out, dout=dout, x=x, scale=scale,
          offset=offset, axis=axis, epsilon=epsilon,
          scale_offset=scale_offset, subtract_mean=subtract_mean,
          config=config, return_residuals=return_residuals,
      )
    mean, rstd = residuals
    features = x.shape[-1]
    rows = x.size // features
    fp = _next_pow2(features)
    block_rows = config.block_rows
    num_blocks = pl.cdiv(rows, block_rows)
    max_programs = _num_sms() * max(1, 32 // config.num_warps)
    # Fewest programs that still use `iters` loop trips (balanced work).
    iters = pl.cdiv(num_blocks, min(num_blocks, max_programs))
    num_programs = pl.cdiv(num_blocks, iters)

    inputs = [x.reshape(rows, features), dout.reshape(rows, features)]
    if subtract_mean:
      inputs.append(mean.reshape(rows).astype(jnp.float32))
    inputs.append(rstd.reshape(rows).astype(jnp.float32))
    if scale is not None:
      inputs.append(scale)
    out_shape = [jax.ShapeDtypeStruct((rows, features), x.dtype)]
    partial = jax.ShapeDtypeStruct((num_programs, features), jnp.float32)
    if scale is not None:
      out_shape.append(partial)
    if offset is not None:
      out_shape.append(partial)
    kernel = functools.partial(
        _bwd_kernel, rows=rows, features=features, block_rows=block_rows,
        fp=fp, num_programs=num_programs, iters=iters,
        scale_offset=float(scale_offset), subtract_mean=subtract_mean,
        has_scale=scale is not None, has_offset=offset is not None,
    )
    outs = _pallas_call(
        kernel, out_shape=out_shape, grid=(num_programs,), config=config,
        name="tokamax_layer_norm_bwd",
    )(*inputs)
    outs = list(outs)
    grads = {"x": outs.pop(0).reshape(x.shape)}
    if scale is not None:
      grads["scale"] = jnp.sum(outs.pop(0), axis=0).astype(scale.dtype)
    if offset is not None:
      grads["offset"] = jnp.sum(outs.pop(0), axis=0).astype(offset.dtype)
    return grads, None


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
    if axis != x.ndim - 1:
      raise self.unsupported("the kernel normalises only the last axis.")
    features = x.shape[-1]
    rows = x.size // features
    block_rows = config.block_rows
    inputs = [x.reshape(rows, features)]
    inputs += [p for p in (scale, offset) if p is not None]
    out_shape = [jax.ShapeDtypeStruct((rows, features), x.dtype)]
    stat = jax.ShapeDtypeStruct((rows,), jnp.float32)
    if return_residuals:
      out_shape += [stat, stat] if subtract_mean else [stat]
    kernel = functools.partial(
        _fwd_kernel, rows=rows, features=features, block_rows=block_rows,
        fp=_next_pow2(features), epsilon=float(epsilon),
        scale_offset=float(scale_offset), subtract_mean=subtract_mean,
        has_scale=scale is not None, has_offset=offset is not None,
        save_stats=return_residuals,
    )
    outs = _pallas_call(
        kernel, out_shape=out_shape, grid=(pl.cdiv(rows, block_rows),),
        config=config, name="tokamax_layer_norm_fwd",
    )(*inputs)
    y = outs[0].reshape(x.shape)
    if not return_residuals:
      return y, None
    rstd = outs[-1].reshape(_stat_shape(x))
    mean = outs[1].reshape(_stat_shape(x)) if subtract_mean else None
    return y, (mean, rstd)
