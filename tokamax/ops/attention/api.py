"""Public dot_product_attention and its implementation registry."""

from __future__ import annotations

from typing import Any

from tokamax._src import dispatch
from tokamax._src import platform
from tokamax.ops.attention import cudnn, mosaic, triton, xla, xla_chunked

_OP = "dot_product_attention"
dispatch.register(_OP, "xla", xla.DotProductAttention)
dispatch.register(_OP, "xla_chunked", xla_chunked.ChunkedDotProductAttention)
dispatch.register(_OP, "cudnn", cudnn.CudnnDotProductAttention)
dispatch.register(_OP, "triton", triton.TritonDotProductAttention)
dispatch.register(_OP, "mosaic", mosaic.MosaicDotProductAttention)


def _default_order(target: platform.Target) -> list[str]:
  # Measured on the H200 (docs/benchmarks.md): cuDNN is fastest where it runs
  # (it steps aside for "mosaic" where that was measured faster, see
  # `CudnnDotProductAttention.preferred`); "mosaic" (Hopper only, bf16/f16) is
  # faster than "triton", which takes the rest (f32, GPUs other than Hopper).
  if target.is_nvidia_gpu:
    return ["cudnn", "mosaic", "triton", "xla"]
  return ["xla"]


dispatch.set_default_order(_OP, _default_order)


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    precision=None,
    implementation: Any = None,
):
  """Scaled dot-product attention, layout `[*B, T, N, H]` like jax.nn.

  Args:
    query: [*B, T, N, H].
    key: [*B, S, K, H] with N a multiple of K (GQA/MQA).
    value: [*B, S, K, Hv].
    bias: float, broadcastable to [*B, N, T, S]; added to the scaled logits.
    mask: bool, broadcastable to [*B, N, T, S]; True means visible.
    scale: logits scale, default 1/sqrt(H).
    is_causal: key j visible to query i only if j <= i (top-left aligned).
    query_seq_lengths: int [*B]; queries at positions >= length see nothing.
    key_value_seq_lengths: int [*B]; keys at positions >= length are hidden.
    local_window_size: w or (left, right): key j visible to query i only if
      i - left <= j <= i + right; None on a side means unbounded.
    logits_soft_cap: c; logits become c * tanh(logits / c) after scale and
      bias.
    precision: matmul precision (jax.lax.Precision), XLA implementations.
    implementation: None (best available, falls back to "xla"), a name
      ("xla", "xla_chunked", "cudnn", "triton", "mosaic") or a list of names.
      Under None a call whose output is not differentiated may run another
      forward kernel than the same call under jax.grad (the faster one for
      each mode; README, "Default order under implementation=None").

  Returns:
    [*B, T, N, Hv] in query's dtype. Softmax statistics are f32; a query row
    that sees no key outputs 0 (and gets 0 gradient).
  """
  return dispatch.call(
      _OP, implementation, (query, key, value, bias, mask),
      dict(
          scale=scale, is_causal=is_causal,
          query_seq_lengths=query_seq_lengths,
          key_value_seq_lengths=key_value_seq_lengths,
          local_window_size=local_window_size,
          logits_soft_cap=logits_soft_cap, precision=precision,
      ),
  )
