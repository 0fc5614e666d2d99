"""Fixed-point fused dq (MosaicAttentionVjpConfig.fused_dq) against the two-kernel backward (GPU).

Usage: python benchmarks/attention_fused_dq.py [OUT_DIR] [SHAPES] [VARIANTS] [CONFIGS]
SHAPES: comma-separated words matched against the shape labels ("" = all).
VARIANTS: comma-separated settings of the module's A/B switches, e.g.
"rot1red1,rot0red1def0" (_FUSED_ROTATE, _FUSED_REDUCE, _FUSED_DEFER; red0 drops the dq
reduction: timing only, wrong dq). CONFIGS: "64.64.2,64.64.3" (block_kv,
block_q, num_stages). For each shape and causal flag: cuDNN (jax.nn)
forward+backward, "mosaic" with its shipped/heuristic backward, and with the
fused-dq backward per config and variant (cupti, median of 20, bf16 random
inputs); then, at batch 4 on fresh inputs, each backward's largest error
against an f32 XLA reference relative to the gradient's largest magnitude,
and whether two runs are bit-identical. Writes attention_fused_dq.json.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import common
from attention_mosaic_sweep import ITERATIONS, SHAPES, _time
from tokamax.ops.attention import mosaic as mo
import tokamax


def _grads(f, q, k, v, do):
  return jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do), argnums=(0, 1, 2)))(q, k, v)


def _set(variant):
  mo._FUSED_ROTATE = "rot1" in variant
  mo._FUSED_REDUCE = "red0" not in variant
  mo._FUSED_DEFER = "def0" not in variant


def main(out_dir=".", words="", variants="rot1red1", configs="64.64.2"):
  rows = []

  def record(**r):
    rows.append(r)
    print({k: round(x, 4) if isinstance(x, float) else x for k, x in r.items()}, flush=True)

  for label, ((b, t, n, kh, h), causals) in SHAPES.items():
    if words and not any(w in label for w in words.split(",")):
      continue
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
    for causal in causals:
      flops = 3.5 * 4 * b * n * t * t * h / (2 if causal else 1)
      ops = {"jax.nn cudnn": (None, lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")),
             "mosaic shipped": (None, lambda q, k, v: tokamax.dot_product_attention(
          q, k, v, is_causal=causal, implementation="mosaic"))}
      for c in configs.split(","):
        c = tuple(int(x) for x in c.split("."))
        cfg = mo.MosaicAttentionVjpConfig(*c, fused_dq=True)
        op = mo.MosaicDotProductAttention(vjp=mo.MosaicDotProductAttentionVjp(config=cfg))
        for var in variants.split(","):
          ops[f"mosaic fused_dq {c} {var}"] = (
              var, (lambda op: lambda q, k, v: op(q, k, v, is_causal=causal))(op))
      base = None
      for name, (var, f) in ops.items():
        _set(var or "rot1red1")
        try:
          ms = _time(f, (q, kv, kv), "forward_and_vjp")
        except Exception as e:  # a config may not compile
          record(shape=label, causal=causal, impl=name, error=str(e)[:400])
          continue
        base = base or ms
        record(shape=label, causal=causal, impl=name, fwdbwd_ms=ms,
               fwdbwd_tflops=flops / ms / 1e9, vs_cudnn=base / ms)
      # Accuracy and determinism on fresh random inputs (batch 4).
      keys = jax.random.split(jax.random.key(7), 4)
      x = [jax.random.normal(kk, (4,) + s.shape[1:], jnp.bfloat16)
           for kk, s in zip(keys, (q, kv, kv))]
      do = jax.random.normal(keys[3], (4,) + q.shape[1:], jnp.float32)
      ref = _grads(lambda q, k, v: jax.nn.dot_product_attention(
          q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
          is_causal=causal, implementation="xla"), *x, do)
      ref = [np.asarray(r) for r in ref]
      for name, (var, f) in ops.items():
        if name == "jax.nn cudnn" or (var and "red0" in var):
          continue
        _set(var or "rot1red1")
        try:
          g1 = [np.asarray(g.astype(jnp.float32)) for g in _grads(f, *x, do)]
          g2 = [np.asarray(g.astype(jnp.float32)) for g in _grads(f, *x, do)]
        except Exception as e:
          record(shape=label, causal=causal, impl=name, check=True, error=str(e)[:300])
          continue
        err = {f"err_d{w}": float(np.max(np.abs(g - r)) / np.max(np.abs(r)))
               for w, g, r in zip("qkv", g1, ref)}
        record(shape=label, causal=causal, impl=name, check=True, **err,
               finite=bool(all(np.isfinite(g).all() for g in g1)),
               bit_identical=bool(all((a == c).all() for a, c in zip(g1, g2))))
  _set("rot1red1")
  common.save(out_dir, "attention_fused_dq", rows, iterations=ITERATIONS)


if __name__ == "__main__":
  main(*sys.argv[1:])
