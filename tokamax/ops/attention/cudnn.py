"""The "cudnn" implementation: `jax.nn.dot_product_attention(implementation='cudnn')`.

Our canonical arguments map onto jax.nn's; what cuDNN (or jax.nn's wrapper)
cannot express raises NotImplementedError: logits soft cap, f32/f64, a value
head dim different from the key's, causal with T != S (cuDNN does not promise
our top-left alignment), windows other than (left, 0) or causal + left.
Whatever else jax.nn rejects is found by tracing it (forward in
`check_supported`, gradient in the VJP's `check_supported`).

Rows that see no key are zeroed here, so the semantics match "xla".
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from tokamax._src import op as op_lib
from tokamax._src import platform
from tokamax.ops.attention import xla as base


def _mosaic_faster_with_mask(args) -> bool:
  return (args["mask"] is not None and args["bias"] is None
          and args["query"].shape[3] >= 128)


def _plain_kind(args) -> tuple[str, int, int] | None:
  """(kind, T, rows) for plain attention (no bias, mask, lengths or window)
  with T = S: kind "h64" (head dim 64), "h128" (head dim 128, as many
  key/value heads as query heads) or "gqa_h128" (head dim 128, fewer: GQA/MQA);
  rows = B·N·T, the query rows of all heads. Else None."""
  q, k = args["query"], args["key"]
  plain = all(args[n] is None for n in (
      "mask", "bias", "query_seq_lengths", "key_value_seq_lengths",
      "local_window_size"))
  if not plain or q.shape[1] != k.shape[1]:
    return None
  b, t, n, h = q.shape
  if h == 64:
    kind = "h64"
  elif h == 128:
    kind = "gqa_h128" if k.shape[2] < n else "h128"
  else:
    return None
  return kind, t, b * n * t


_ANY_ROWS = (0, math.inf)
# Where "mosaic" was measured faster than cuDNN for plain attention with
# T = S (docs/benchmarks.md), for training (forward+backward) and inference
# (forward only): kind -> [(causal, (lowest T, highest T), (fewest rows,
# most rows))], inclusive; rows = B·N·T. Small grids (few rows) favour
# "mosaic" when causal (its heaviest-first tile order leaves a short tail)
# and cuDNN when not (its finer tiles fill the last wave).
# - "h64": N16 at 65536 tokens (1M rows), H100 2026-12-06 15:56 and 18:43,
#   H200 22:41; 32768-262144 rows, H100 2026-12-07 02:31. Causal training
#   1.04-1.28x at T 1024-4096 at any rows, 1.22x at T 8192 with 65536 rows
#   (0.96x at 1M); non-causal training 1.02x from 262144 rows, 0.78-0.99x
#   below; non-causal forward 1.04-1.05x from 262144 rows, 0.72-0.95x below.
#   Causal forward at T 1024-2048, N16 (H100 2026-12-07 10:40): 1.04-1.46x
#   at 32768-131072 rows, 0.96-1.00x at 16384 and from 262144 rows.
# - "h128": H100 2026-12-07 02:31 (B1-B4, N8-16; the 2026-12-05 H200 rows
#   agree): causal training 1.17-1.50x up to 65536 rows, 1.00-1.06x at
#   131072, 0.87x at 262144; causal forward 1.06-1.70x up to 262144 rows at
#   T 4096-16384, 1.00-1.04x at 524288; non-causal: cuDNN (forward
#   1.01-1.02x, forward+backward 0.90-0.94x).
# - "gqa_h128": N32 K8 at 65536 tokens (2M rows), H200 2026-12-06 22:41:
#   forward 1.02-1.06x at T 2048-8192, causal and not; forward+backward
#   0.90-1.01x, so training keeps cuDNN there. Small GQA grids, N32 K8
#   at B1-B4 (H100 2026-12-07 10:40, two runs): causal forward+backward
#   1.01-1.22x at T 2048-4096 up to 524288 rows (B4 T4096, the GQA
#   shape; 1.02-1.05x there on the H200, 2026-12-05 and 12-06), 0.94x and
#   1.15x at T 1024; causal forward 1.40x / 1.20x at T 1024 with 32768 /
#   65536 rows; non-causal forward+backward 0.90-1.19x, mostly 0.92-1.04x.
_MOSAIC_TRAINS_FASTER = {
    "h64": [(True, (1024, 4096), _ANY_ROWS), (True, (4096, 8192), (0, 65536)),
            (False, (1024, 2048), (262144, math.inf))],
    "h128": [(True, (4096, 8192), (0, 65536))],
    "gqa_h128": [(True, (2048, 4096), (0, 524288))],
}
_MOSAIC_INFERS_FASTER = {
    "h64": [(True, (3072, 4096), _ANY_ROWS), (True, (4096, 8192), (0, 65536)),
            (True, (1024, 2048), (32768, 131072)),
            (False, (2048, 16384), (262144, math.inf))],
    "h128": [(True, (4096, 16384), (0, 262144))],
    "gqa_h128": [(True, (2048, 8192), _ANY_ROWS), (True, (1024, 1024), (0, 65536)),
                 (False, (2048, 8192), _ANY_ROWS)],
}


def _mosaic_faster_plain(args, rules) -> bool:
  kind = _plain_kind(args)
  if kind is None:
    return False
  name, t, rows = kind
  return any(causal == bool(args["is_causal"]) and lo <= t <= hi
             and fewest <= rows <= most
             for causal, (lo, hi), (fewest, most) in rules.get(name, ()))


def _jax_nn_function(args):
  """f(query, key, value, bias) calling jax.nn with cuDNN, plus row zeroing."""
  left_right = args["local_window_size"]
  causal = args["is_causal"]
  window = None
  if left_right is not None:
    left, right = left_right
    if left is None:
      # Only (None, 0) reaches here: plain causal.
      causal = True
    else:
      window = (left, 0)
      causal = True
  mask = args["mask"]
  q_len, kv_len = args["query_seq_lengths"], args["key_value_seq_lengths"]

  def f(query, key, value, bias):
    # cuDNN's backward returns NaN for rows that see no key at all; lengths
    # of at least 1 avoid that, and the rows are zeroed below.
    out = jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=args["scale"], is_causal=causal,
        query_seq_lengths=None if q_len is None else jnp.maximum(q_len, 1),
        key_value_seq_lengths=None if kv_len is None else jnp.maximum(kv_len, 1),
        local_window_size=window, implementation="cudnn",
    )
    t, s = query.shape[1], key.shape[1]
    if mask is not None or kv_len is not None or q_len is not None:
      valid = base.visible(
          jnp.arange(t), jnp.arange(s),
          mask=base.heads_view(mask, key.shape[2]), query_seq_lengths=q_len,
          key_value_seq_lengths=kv_len, is_causal=args["is_causal"],
          local_window_size=left_right,
      )
      rows = jnp.any(valid, axis=-1)  # [B|1, K|1, G|1, T]
      rows = jnp.broadcast_to(
          rows, (rows.shape[0], key.shape[2], query.shape[2] // key.shape[2], t)
      ).reshape(rows.shape[0], query.shape[2], t)
      out = jnp.where(jnp.moveaxis(rows, -1, 1)[..., None], out, 0)
    return out

  return f


def _abstract(args):
  return {
      n: op_lib.abstractify(args[n]) for n in ("query", "key", "value", "bias")
  }


@dataclasses.dataclass(frozen=True)
class CudnnDotProductAttentionVjp(base.DotProductAttentionVjp):
  """Applies the pullback saved by the cuDNN forward."""

  implementation = "cudnn"
  residuals_kind = "cudnn_pullback"
  uses_out = False

  def check_supported(self, ba):
    args = ba.arguments
    f = _jax_nn_function(args)
    abstract = _abstract(args)
    out = jax.ShapeDtypeStruct(
        (*args["query"].shape[:3], args["value"].shape[3]), args["query"].dtype
    )

    def grads(query, key, value, bias, dout):
      return jax.vjp(f, query, key, value, bias)[1](dout)

    try:
      jax.eval_shape(grads, **abstract, dout=out)
    except Exception as e:  # jax.nn raises ValueError/RuntimeError.
      raise self.unsupported(f"cuDNN cannot differentiate this call: {e}") from e

  def _fwd(self, *, residuals, out, dout, config, return_residuals, **args):
    del out, config, return_residuals, args
    dq, dk, dv, dbias = residuals(dout)
    return {"query": dq, "key": dk, "value": dv, "bias": dbias}, None


@dataclasses.dataclass(frozen=True)
class CudnnDotProductAttention(base.DotProductAttention):
  """cuDNN flash attention through jax.nn."""

  implementation = "cudnn"
  residuals_kind = "cudnn_pullback"
  vjp: op_lib.Op | None = dataclasses.field(
      default_factory=CudnnDotProductAttentionVjp
  )

  def supported_on(self, device) -> bool:
    if isinstance(device, platform.Target):
      return device.is_nvidia_gpu and device.compute_capability >= (8, 0)
    return device.platform == "gpu"

  def check_supported(self, ba):
    target = platform.current_target()
    if not self.supported_on(target):
      raise self.unsupported(
          "requires an NVIDIA GPU (sm_80 or newer) with cuDNN, but the target"
          f" is {target.describe()}."
      )
    args = ba.arguments
    q, k, v = args["query"], args["key"], args["value"]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
      raise self.unsupported(f"cuDNN needs bf16 or f16 inputs, got {q.dtype}.")
    if args["logits_soft_cap"] is not None:
      raise self.unsupported("cuDNN has no logits soft cap.")
    if v.shape[3] != q.shape[3]:
      raise self.unsupported("value and key head dims must match for cuDNN.")
    if args["is_causal"] and q.shape[1] != k.shape[1]:
      raise self.unsupported(
          "causal attention with T != S is top-left aligned here; cuDNN does"
          " not promise that alignment."
      )
    window = args["local_window_size"]
    if window is not None:
      left, right = window
      if left is None and not (right == 0 or args["is_causal"]):
        raise self.unsupported("cuDNN needs a finite left window.")
      if left is not None and right != 0 and not args["is_causal"]:
        raise self.unsupported(
            "cuDNN supports a right window only as 0 or with is_causal."
        )
    try:
      jax.eval_shape(_jax_nn_function(args), **_abstract(args))
    except Exception as e:  # jax.nn raises ValueError/RuntimeError.
      raise self.unsupported(f"jax.nn refused the call: {e}") from e

  def preferred(self, ba):
    # cuDNN steps aside for "mosaic" where that runs and was measured faster
    # (docs/benchmarks.md): with a bool mask (no bias) at head dims >= 128
    # (H200: forward 1.38x, forward+backward 1.15x; at 64 they tie), and for
    # plain attention where `_MOSAIC_TRAINS_FASTER` says.
    return self._keeps(ba, _MOSAIC_TRAINS_FASTER)

  def preferred_for_inference(self, ba):
    # Without a gradient: the mask rule, and plain attention where
    # `_MOSAIC_INFERS_FASTER` says.
    return self._keeps(ba, _MOSAIC_INFERS_FASTER)

  def _keeps(self, ba, plain_rules) -> bool:
    args = ba.arguments
    if not (_mosaic_faster_with_mask(args) or _mosaic_faster_plain(args, plain_rules)):
      return True
    from tokamax.ops.attention import mosaic  # pylint: disable=g-import-not-at-top
    try:
      mosaic.check_supported(self, ba)
    except NotImplementedError:
      return True
    return False

  def _fwd(self, *, config, return_residuals, **args):
    del config
    f = _jax_nn_function(args)
    arrays = [args[n] for n in ("query", "key", "value", "bias")]
    if return_residuals:
      return jax.vjp(f, *arrays)
    return f(*arrays), None
