"""Layer norm / RMS norm: the XLA reference (base class of every implementation).

Canonical form: x as given (no reshape, so sharded inputs keep their
sharding) with a non-negative `axis`; scale and offset of shape [F].

  LayerNorm: y = (x - mean) * rsqrt(var + eps) * (scale + scale_offset) + offset
  RMSNorm (subtract_mean=False): y = x * rsqrt(mean(x^2) + eps) * (...) + offset

Statistics and arithmetic are in f32 (f64 for f64 inputs); y is cast to x's
dtype. `scale_offset` applies only when a scale is given.
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp

from tokamax._src import op as op_lib
from tokamax._src import validation


def compute_dtype(dtype) -> jnp.dtype:
  return jnp.promote_types(dtype, jnp.float32)


@dataclasses.dataclass(frozen=True)
class LayerNorm(op_lib.Op):
  """Layer norm over one axis of x, any leading/trailing dims."""

  op_name = "layer_norm"
  implementation = "xla"
  array_args = ("x", "scale", "offset")

  def _bind(
      self, x, scale=None, offset=None, *, axis=-1, epsilon=1e-6,
      scale_offset=0.0, subtract_mean=True,
  ):
    validation.check_float_array("layer_norm", "x", x)
    if x.ndim < 1:
      raise ValueError("layer_norm: x must have at least one dimension.")
    try:
      axis = operator.index(axis)
    except TypeError:
      raise TypeError(f"layer_norm: axis must be an int, got {axis!r}.") from None
    if not -x.ndim <= axis < x.ndim:
      raise ValueError(
          f"layer_norm: axis {axis} is out of range for x of rank {x.ndim}."
      )
    axis %= x.ndim
    features = x.shape[axis]
    for name, p in (("scale", scale), ("offset", offset)):
      if p is None:
        continue
      validation.check_float_array("layer_norm", name, p)
      if tuple(p.shape) != (features,):
        raise ValueError(
            f"layer_norm: {name} must have shape ({features},) to match x's"
            f" axis {axis}; got {tuple(p.shape)}."
        )
    epsilon = validation.check_real("layer_norm", "epsilon", epsilon, min_value=0)
    scale_offset = validation.check_real("layer_norm", "scale_offset", scale_offset)
    if not isinstance(subtract_mean, bool):
      raise TypeError(
          f"layer_norm: subtract_mean must be a bool, got {subtract_mean!r}."
      )
    arguments = dict(
        x=x, scale=scale, offset=offset, axis=axis, epsilon=epsilon,
        scale_offset=scale_offset, subtract_mean=subtract_mean,
    )
    return arguments, lambda y: y

  def _fwd(
      self, *, x, scale, offset, axis, epsilon, scale_offset, subtract_mean,
      config, return_residuals,
  ):
    del config
    cd = compute_dtype(x.dtype)
    xf = x.astype(cd)
    if subtract_mean:
      mean = jnp.mean(xf, axis=axis, keepdims=True)
      xc = xf - mean
    else:
      mean = None
      xc = xf
    rstd = jax.lax.rsqrt(jnp.mean(xc * xc, axis=axis, keepdims=True) + epsilon)
    y = xc * rstd
    if scale is not None:
      y = y * _along(scale.astype(cd) + scale_offset, x.ndim, axis)
    if offset is not None:
      y = y + _along(offset.astype(cd), x.ndim, axis)
    return y.astype(x.dtype), ((mean, rstd) if return_residuals else None)


def _along(p, ndim, axis):
  """[F] -> broadcastable along `axis` of a rank-`ndim` array."""
  shape = [1] * ndim
  shape[axis] = p.shape[0]
  return p.reshape(shape)


@dataclasses.dataclass(frozen=True)
class LayerNormVjp(op_lib.Op):
  """Gradient of LayerNorm from the saved (mean, rstd).

  With xhat = (x - mean) * rstd, g = dy * w (w the effective scale):
    LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))
    dscale = sum(dy * xhat), doffset = sum(dy) over all but the feature axis.
  """

  op_name = "layer_norm_vjp"
  implementation = "xla"
  array_args = ("residuals", "out", "dout", "x", "scale", "offset")
  is_vjp = True
  uses_out = False

  def _bind(self, residuals, out, dout, x, scale, offset, **static):
    arguments = dict(
        residuals=residuals, out=out, dout=dout, x=x, scale=scale,
        offset=offset, **static,
    )
    return arguments, lambda grads: grads

  def _fwd(
      self, *, residuals, out, dout, x, scale, offset, axis, epsilon,
      scale_offset, subtract_mean, config, return_residuals,
  ):
    del out, epsilon, config, return_residuals
    mean, rstd = residuals
    cd = compute_dtype(x.dtype)
    xf = x.astype(cd)
    dy = dout.astype(cd)
    xhat = ((xf - mean) if subtract_mean else xf) * rstd
    g = dy
    if scale is not None:
      g = dy * _along(scale.astype(cd) + scale_offset, x.ndim, axis)
    proj = jnp.mean(g * xhat, axis=axis, keepdims=True)
    if subtract_mean:
      dx = rstd * (g - jnp.mean(g, axis=axis, keepdims=True) - xhat * proj)
    else:
      dx = rstd * (g - xhat * proj)
    grads = {"x": dx.astype(x.dtype)}
    others = tuple(a for a in range(x.ndim) if a != axis)
    if scale is not None:
      grads["scale"] = jnp.sum(dy * xhat, axis=others).astype(scale.dtype)
    if offset is not None:
      grads["offset"] = jnp.sum(dy, axis=others).astype(offset.dtype)
    return grads, None


@dataclasses.dataclass(frozen=True)
class XlaLayerNorm(LayerNorm):
  """The "xla" implementation: the reference with its explicit VJP."""

  differentiable_forward = True  # jax.jvp differentiates the reference
  vjp: op_lib.Op | None = dataclasses.field(default_factory=LayerNormVjp)
