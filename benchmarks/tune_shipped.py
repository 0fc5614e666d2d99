"""Autotunes the benchmark shapes and writes the shipped cache.

Usage: TOKAMAX_CACHE_DIR=tokamax/data/autotuning python benchmarks/tune_shipped.py
(on the device the shipped cache is for). Shapes: the seed flow's f_grad;
layer_norm x 8192x8192 and 65536x1024 bf16 with f32 scale and offset; the
seed attention shape, causal and not, with "xla_chunked"; the "mosaic"
forward at the attention benchmark shapes (TUNE=mosaic: only those;
TUNE=mosaic_seed: only the seed shape, causal and not; TUNE=layer_norm: only
the two layer_norm shapes).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp

import common
import tokamax

demo = common.load_demo()


def _tune(name, f, *args, iterations=5):
  start = time.perf_counter()
  result = tokamax.autotune(f, *args, progress_bar=False, iterations=iterations)
  print(f"{name}: {len(result.entries)} ops in {time.perf_counter() - start:.1f} s")
  for e in result.entries:
    print(f"  {e.op.split(':')[1]}: {e.config} {e.measurements[0].median_ms:.4f} ms"
          f" ({len(e.measurements)} configs)")


# The attention benchmark shapes (B, T, N, K, H) and causal flags.
MOSAIC_SHAPES = [((32, 2048, 16, 16, 64), (False, True)),
                 ((8, 4096, 16, 16, 128), (False, True)),
                 ((4, 4096, 32, 8, 128), (True,))]


def tune_mosaic(shapes=MOSAIC_SHAPES):
  for (b, t, n, kh, h), causals in shapes:
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
    for causal in causals:
      # The gradient: the forward op (its key leaves out the residuals, so
      # the entry serves forward-only calls too) and the VJP op.
      loss = lambda q, k, v, causal=causal: jnp.sum(tokamax.dot_product_attention(
          q, k, v, is_causal=causal, implementation="mosaic").astype(jnp.float32))
      f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      _tune(f"mosaic {(b, t, n, kh, h)} causal={causal}", f, q, kv, kv, iterations=20)


def main():
  assert os.environ.get("TOKAMAX_CACHE_DIR"), "set TOKAMAX_CACHE_DIR"
  if os.environ.get("TUNE") == "mosaic":
    tune_mosaic()
    return
  if os.environ.get("TUNE") == "mosaic_seed":  # the seed shape
    tune_mosaic(MOSAIC_SHAPES[:1])
    return
  on_gpu = jax.default_backend() == "gpu"
  if os.environ.get("TUNE") == "layer_norm":
    tune_layer_norm(on_gpu)
    return
  x, scale = common.seed_inputs(demo)
  impls = demo.runnable_implementations(x, scale, log=lambda *_: None)
  _tune("seed f_grad", jax.jit(jax.grad(demo.make_loss(impls))), x, scale)

  def attention_grad(causal):
    def loss(q, k, v):
      out = tokamax.dot_product_attention(
          q, k, v, is_causal=causal, implementation="xla_chunked")
      return jnp.sum(out.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  _tune("attention causal", attention_grad(True), x, x, x)
  tune_layer_norm(on_gpu)
  if on_gpu:
    tune_mosaic()


def tune_layer_norm(on_gpu):
  rows = 1 if on_gpu else 64
  for shape in ((8192 // rows, 8192), (65536 // rows, 1024)):
    ln_x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    p = jax.ShapeDtypeStruct(shape[1:], jnp.float32)
    impl = "triton" if on_gpu else "xla"
    ln_loss = lambda x, s, o: jnp.sum(
        tokamax.layer_norm(x, s, o, implementation=impl).astype(jnp.float32))
    _tune(f"layer_norm {shape}", jax.jit(jax.grad(ln_loss, argnums=(0, 1, 2))), ln_x, p, p,
          iterations=20)


if __name__ == "__main__":
  main()
