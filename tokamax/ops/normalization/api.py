"""Public layer_norm and its implementation registry."""

from __future__ import annotations

from typing import Any

from tokamax._src import dispatch
from tokamax.ops.normalization import mosaic, triton, xla

dispatch.register("layer_norm", "xla", xla.XlaLayerNorm)
dispatch.register("layer_norm", "triton", triton.TritonLayerNorm)
dispatch.register("layer_norm", "mosaic", mosaic.MosaicLayerNorm)
# "mosaic" refuses GPUs other than Hopper (and x that is not 16-bit, other
# axes, feature counts it cannot tile) and steps aside below 2048 features
# ("triton" as fast or faster there, docs/benchmarks.md), so it leads where
# it wins.
dispatch.set_default_order("layer_norm", lambda target: ["mosaic", "triton", "xla"])


def layer_norm(
    x,
    scale=None,
    offset=None,
    *,
    axis: int = -1,
    epsilon: float = 1e-6,
    scale_offset: float = 0.0,
    subtract_mean: bool = True,
    implementation: Any = None,
):
  """Layer norm (or RMS norm with `subtract_mean=False`) over `axis` of x.

  Args:
    x: float array of any shape.
    scale: optional [x.shape[axis]] multiplier; `scale + scale_offset` is used.
    offset: optional [x.shape[axis]] added after scaling.
    axis: the normalised axis.
    epsilon: added to the variance (mean square for RMS norm).
    scale_offset: constant added to scale (e.g. 1.0 for Gemma's 1 + scale).
    subtract_mean: False computes RMS norm.
    implementation: None (best available, falls back to "xla"), a name
      ("xla", "triton", "mosaic") or a list of names to try in order.

  Returns:
    Array of x's shape and dtype, computed in f32 (f64 for f64 inputs).
  """
  return dispatch.call(
      "layer_norm", implementation, (x, scale, offset),
      dict(axis=axis, epsilon=epsilon, scale_offset=scale_offset,
           subtract_mean=subtract_mean),
  )
