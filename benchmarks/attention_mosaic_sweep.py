"""Sweeps "mosaic" attention forward configs at the benchmark shapes (GPU).

Usage: python benchmarks/attention_mosaic_sweep.py [OUT_DIR] [SHAPES] [SET]
SHAPES: comma-separated words matched against the shape labels ("" = all);
SET: "NAME=VALUE,..." module constants of the mosaic module set first.
For each shape and causal flag: cuDNN and XLA (jax.nn) forward, cuDNN
forward+backward, the forward configs below that are in the search space,
and forward+backward with the best one; then dense matmuls of q.k^T's size
and 8192^3. Prints times and writes attention_mosaic_sweep.json.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import common
from tokamax._src import benchmarking
from tokamax.ops.attention import mosaic as mo

ITERATIONS = 20
# (block_q, block_kv, num_stages) tried where they fit (search_space).
CONFIGS = [(64, 128, 2), (64, 128, 3), (128, 128, 2), (128, 64, 2), (128, 64, 4),
           (64, 256, 2), (64, 64, 2)]
SHAPES = {  # (B, T, N, K, H)
    "seed B32 T2048 N16 H64": ((32, 2048, 16, 16, 64), (False, True)),
    "B8 T4096 N16 H128": ((8, 4096, 16, 16, 128), (False, True)),
    "GQA B4 T4096 N32 K8 H128": ((4, 4096, 32, 8, 128), (True,)),
}


def _time(f, specs, mode):
  f_std, flat = benchmarking.standardize_function(f, *specs, mode=mode)
  return benchmarking.benchmark(f_std, flat, iterations=ITERATIONS).median_evaluation_time_ms


def main(out_dir=".", words="", set_flags=""):
  rows = []
  common.set_constants(mo, set_flags)

  def record(**r):
    rows.append(r)
    print(r, flush=True)

  for label, ((b, t, n, kh, h), causals) in SHAPES.items():
    if not common.selected(label, words):
      continue
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
    for causal in causals:
      flops = 4 * b * n * t * t * h / (2 if causal else 1)
      cud = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")
      c_f, c_fb = _time(cud, (q, kv, kv), "forward"), _time(cud, (q, kv, kv), "forward_and_vjp")
      record(shape=label, causal=causal, impl="cudnn", fwd_ms=c_f, fwdbwd_ms=c_fb,
             fwd_tflops=flops / c_f / 1e9, fwdbwd_tflops=3.5 * flops / c_fb / 1e9)
      xla = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="xla")
      x_f = _time(xla, (q, kv, kv), "forward")
      record(shape=label, causal=causal, impl="xla", fwd_ms=x_f,
             fwd_tflops=flops / x_f / 1e9, vs_cudnn=c_f / x_f)
      best = None
      space = mo.search_space(t, t, h, h, 2)
      for cfg in [mo.MosaicAttentionConfig(*c) for c in CONFIGS]:
        if cfg not in space:
          continue
        op = mo.MosaicDotProductAttention(config=cfg)
        try:
          ms = _time(lambda q, k, v: op(q, k, v, is_causal=causal), (q, kv, kv), "forward")
        except Exception as e:  # a config may not compile (registers)
          record(shape=label, causal=causal, fwd=str(cfg), error=str(e)[:200])
          continue
        record(shape=label, causal=causal, fwd=(cfg.block_q, cfg.block_kv, cfg.num_stages),
               fwd_ms=ms, fwd_tflops=flops / ms / 1e9, vs_cudnn=c_f / ms)
        if best is None or ms < best[1]:
          best = (cfg, ms)
      op = mo.MosaicDotProductAttention(config=best[0])
      ms = _time(lambda q, k, v: op(q, k, v, is_causal=causal), (q, kv, kv), "forward_and_vjp")
      record(shape=label, causal=causal, fwdbwd=str(best[0]), fwdbwd_ms=ms,
             fwdbwd_tflops=3.5 * flops / ms / 1e9, vs_cudnn=c_fb / ms)
    fn, specs, flops = common.qk_matmul(b, n, t, h)
    ms = _time(fn, specs, "forward")
    record(shape=label, impl="dense matmul q@k^T (same size)", fwd_ms=ms,
           fwd_tflops=flops / ms / 1e9)
  fn, specs, flops = common.dense_matmul()
  ms = _time(fn, specs, "forward")
  record(shape="8192^3", impl="dense matmul", fwd_ms=ms, fwd_tflops=flops / ms / 1e9)
  common.save(out_dir, "attention_mosaic_sweep", rows, iterations=ITERATIONS,
              set_flags=set_flags)


if __name__ == "__main__":
  main(*sys.argv[1:])
