"""Attention with a bias or a bool mask: tokamax "mosaic" and "triton"
against jax.nn (cuDNN, XLA) and a dense matmul of the same size.

Usage: python benchmarks/attention_bias_mask.py [OUT_DIR]
Writes attention_bias_mask.json to OUT_DIR (default: .). bf16 inputs; bias
[1, N, T, S] bf16 (its gradient is part of forward_and_vjp), mask [B, 1, T, S]
hiding half of the keys at random. Accelerator time, median of ITERATIONS
runs; FLOPs by the FlashAttention convention (as benchmarks/attention.py).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import attention
import common
import tokamax

SHAPES = {
    "seed B32 T2048 N16 H64": (32, 2048, 16, 16, 64),
    "B8 T4096 N16 H128": (8, 4096, 16, 16, 128),
}
# "bias, no dbias": the bias under stop_gradient (a constant additive mask):
# the kernels skip its gradient.
FEATURES = ("bias", "bias, no dbias", "mask", "bias causal")


def _candidates():
  for impl in ("mosaic", "triton"):
    yield f"tokamax {impl}", lambda impl=impl, **kw: tokamax.dot_product_attention(
        **kw, implementation=impl)
  for impl in ("cudnn", "xla"):
    yield f"jax.nn {impl}", lambda impl=impl, **kw: jax.nn.dot_product_attention(
        **kw, implementation=impl)


def main(out_dir="."):
  rows = []
  for label, shape in SHAPES.items():
    b, t, n, kh, h = shape
    q_spec = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    kv_spec = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, n, t, t), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((b, 1, t, t), jnp.bool_)
    for feature in FEATURES:
      causal = "causal" in feature
      for mode in ("forward", "forward_and_vjp"):
        for name, fn in _candidates():
          if feature == "mask":
            f = lambda q, k, v, m, fn=fn: fn(query=q, key=k, value=v, mask=m)
            specs = (q_spec, kv_spec, kv_spec, mask)
          else:
            grad_free = "no dbias" in feature
            f = lambda q, k, v, x, fn=fn, grad_free=grad_free: fn(
                query=q, key=k, value=v, is_causal=causal,
                bias=jax.lax.stop_gradient(x) if grad_free else x)
            specs = (q_spec, kv_spec, kv_spec, bias)
          row = dict(shape=label, feature=feature, mode=mode, impl=name)
          try:
            data = attention._time(f, specs, mode)
            ms = data.median_evaluation_time_ms
            row.update(ms=ms, tflops=attention._flops(shape, causal, mode) / ms / 1e9,
                       method=data.method)
          except Exception as e:  # record and go on: a peer may not support it
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
          rows.append(row)
          print(_fmt(row), flush=True)
    a = jax.ShapeDtypeStruct((b * n, t, h), jnp.bfloat16)
    c = jax.ShapeDtypeStruct((b * n, h, t), jnp.bfloat16)
    data = attention._time(lambda x, y: jnp.einsum("bth,bhs->bts", x, y), (a, c),
                           "forward")
    ms = data.median_evaluation_time_ms
    rows.append(dict(shape=label, feature="", mode="forward",
                     impl="dense matmul q@k^T (same size)", ms=ms,
                     tflops=2 * b * n * t * t * h / ms / 1e9, method=data.method))
    print(_fmt(rows[-1]), flush=True)
  for r in rows:  # throughput relative to cuDNN (jax.nn) in the same run
    peer = [p for p in rows if p["impl"] == "jax.nn cudnn" and "ms" in p
            and (p["shape"], p["feature"], p["mode"]) == (r["shape"], r["feature"], r["mode"])]
    if peer and "ms" in r and not r["impl"].startswith("dense"):
      r["vs_cudnn"] = peer[0]["ms"] / r["ms"]
  meta = common.save(out_dir, "attention_bias_mask", rows,
                     iterations=attention.ITERATIONS)
  print(f"\n{meta}")
  print(common.markdown(rows, [
      ("shape", "shape", ""), ("feature", "feature", ""), ("mode", "mode", ""),
      ("implementation", "impl", ""), ("median ms", "ms", ".3f"),
      ("TFLOP/s", "tflops", ".1f"), ("x cuDNN", "vs_cudnn", ".2f")]))


def _fmt(r):
  return attention._fmt(dict(r, causal=r["feature"]))


if __name__ == "__main__":
  main(*sys.argv[1:])
