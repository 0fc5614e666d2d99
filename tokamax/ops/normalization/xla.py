"""Layer norm / RMS norm: the XLA reference (base class of every implementation).

Canonical form: x viewed as [pre, F, post] (a free reshape), normalised over
axis 1; scale and offset of shape [F].

  LayerNorm: y = (x - mean) * rsqrt(var + eps) * (scale + scale_offset) + offset
  RMSNorm (subtract_mean=False): y = x * rsqrt(mean(x^2) + eps) * (...) + offset

Statistics and arithmetic are in f32 (f64 for f64 inputs); y is cast to x's
dtype. `scale_offset` applies only when a scale is given.
"""

from __future__ import annotations

import dataclasses
import math
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
    shape = tuple(x.shape)
    pre = math.prod(shape[:axis])
    post = math.prod(shape[axis + 1:])
    x3 = jnp.reshape(x, (pre, features, post))
    arguments = dict(
        x=x3, scale=scale, offset=offset, epsilon=epsilon,
        scale_offset=scale_offset, subtract_mean=subtract_mean,
    )
    return arguments, lambda y: jnp.reshape(y, shape)

  def _fwd(
      self, *, x, scale, offset, epsilon, scale_offset, subtract_mean,
      config, return_residuals,
  ):
    del config
    cd = compute_dtype(x.dtype)
    xf = x.astype(cd)
    if subtract_mean:
      mean = jnp.mean(xf, axis=1, keepdims=True)
      xc = xf - mean
    else:
      mean = None
      xc = xf
    rstd = jax.lax.rsqrt(jnp.mean(xc * xc, axis=1, keepdims=True) + epsilon)
    y = xc * rstd
    if scale is not None:
      y = y * (scale.astype(cd) + scale_offset)[None, :, None]
    if offset is not None:
      y = y + offset.astype(cd)[None, :, None]
    return y.astype(x.dtype), ((mean, rstd) if return_residuals else None)


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
  uses_out = False

  def _bind(self, residuals, out, dout, x, scale, offset, **static):
    arguments = dict(
        residuals=residuals, out=out, dout=dout, x=x, scale=scale,
        offset=offset, **static,
    )
    return arguments, lambda grads: grads

  def _fwd(
      self, *, residuals, out, dout, x, scale, offset, epsilon, scale_offset,
      subtract_mean, config, return_residuals,
  ):
    del out, epsilon, config, return_residuals
    mean, rstd = residuals
    cd = compute_dtype(x.dtype)
    xf = x.astype(cd)
    dy = dout.astype(cd)
    xhat = ((xf - mean) if subtract_mean else xf) * rstd
    g = dy
    if scale is not None:
      g = dy * (scale.astype(cd) + scale_offset)[None, :, None]
    proj = jnp.mean(g * xhat, axis=1, keepdims=True)
    if subtract_mean:
      dx = rstd * (g - jnp.mean(g, axis=1, keepdims=True) - xhat * proj)
    else:
      dx = rstd * (g - xhat * proj)
    grads = {"x": dx.astype(x.dtype)}
    if scale is not None:
      grads["scale"] = jnp.sum(dy * xhat, axis=(0, 2)).astype(scale.dtype)
    if offset is not None:
      grads["offset"] = jnp.sum(dy, axis=(0, 2)).astype(offset.dtype)
    return grads, None


@dataclasses.dataclass(frozen=True)
class XlaLayerNorm(LayerNorm):
  """The "xla" implementation: the reference with its explicit VJP."""

  vjp: op_lib.Op | None = dataclasses.field(default_factory=LayerNormVjp)
