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

import jax
import jax.numpy as jnp

from tokamax._src import op as op_lib
from tokamax._src import platform
from tokamax.ops.attention import xla as base


def _mosaic_faster_with_mask(args) -> bool:
  return (args["mask"] is not None and args["bias"] is None
          and args["query"].shape[3] >= 128)


def _plain_kind(args) -> tuple[str, int] | None:
  """("h64" | "gqa_h128", T) for plain attention (no bias, mask, lengths or
  window) with T = S at head dim 64, or at head dim 128 with fewer key/value
  heads than query heads (GQA/MQA); else None."""
  q, k = args["query"], args["key"]
  plain = all(args[n] is None for n in (
      "mask", "bias", "query_seq_lengths", "key_value_seq_lengths",
      "local_window_size"))
  if not plain or q.shape[1] != k.shape[1]:
    return None
  if q.shape[3] == 64:
    return "h64", q.shape[1]
  if q.shape[3] == 128 and k.shape[2] < q.shape[2]:
    return "gqa_h128", q.shape[1]
  return None


# Where "mosaic" was measured faster than cuDNN for plain attention with
# T = S (docs/benchmarks.md): kind -> causal -> (lowest T, highest T), the
# measured lengths inclusive, for training (forward+backward) and inference
# (forward only).
# - "h64": N16 at 65536 tokens, H100 2026-12-06 15:56 and 18:43; the H200
#   agreed at 22:41 within the run-to-run spread (forward+backward
#   non-causal at T 2048: 0.99 in the length sweep, 1.05 in the table).
# - "gqa_h128": N32 K8 at 65536 tokens, H200 2026-12-06 22:41: forward
#   1.02-1.06x at T 2048-8192, causal and not; forward+backward 0.90-1.01x,
#   so training keeps cuDNN.
_MOSAIC_TRAINS_FASTER = {"h64": {True: (1024, 4096), False: (1024, 2048)}}
_MOSAIC_INFERS_FASTER = {"h64": {True: (3072, 4096), False: (2048, 16384)},
                         "gqa_h128": {True: (2048, 8192), False: (2048, 8192)}}


def _mosaic_faster_plain(args, rules) -> bool:
  kind = _plain_kind(args)
  if kind is None or kind[0] not in rules:
    return False
  lo, hi = rules[kind[0]][bool(args["is_causal"])]
  return lo <= kind[1] <= hi


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
    # plain attention at head dim 64 at the lengths of
    # `_MOSAIC_TRAINS_FASTER` (H100: forward+backward 1.01-1.18x causal,
    # 1.02-1.08x not; H200: 1.04-1.12x causal).
    return self._keeps(ba, _MOSAIC_TRAINS_FASTER)

  def preferred_for_inference(self, ba):
    # Without a gradient: the mask rule, plain head dim 64 and plain GQA at
    # head dim 128 at the lengths of `_MOSAIC_INFERS_FASTER` (head dim 64,
    # H100: forward 1.03-1.04x causal, 1.05-1.14x not; GQA H128, H200:
    # 1.02-1.06x).
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
