"""JAX's own FA3 example (attention_mgpu) forward vs "mosaic" and jax.nn cuDNN (GPU).

Usage: python benchmarks/attention_jax_fa3.py [OUT_DIR] [SHAPE_WORD]
For bf16 and f16 (the example's shared memory is f16, so it runs on f16
only), every shape whose label contains SHAPE_WORD: cuDNN, our "mosaic"
forward (heuristic config and OUR_CONFIGS) and the example at several
(block_q, block_kv, stages), all in one run, so
a gap between the two Mosaic GPU kernels is not a dtype or run artefact.
Writes attention_jax_fa3.json. A reference point for "mosaic".
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention_mgpu as am

import common
from tokamax._src import benchmarking
from tokamax.ops.attention import mosaic as mo

SHAPES = {  # label: (B, T, N, K, H)
    "seed B32 T2048 N16 H64": (32, 2048, 16, 16, 64),
    "B8 T4096 N16 H128": (8, 4096, 16, 16, 128),
    "GQA B4 T4096 N32 K8 H128": (4, 4096, 32, 8, 128),
}
# (block_q, block_kv, stages, consumers); None: the heuristic's
OUR_CONFIGS = [None, (64, 128, 2, 3), (64, 64, 2, 3), (64, 128, 3, 3), (64, 64, 3, 3)]
# The example's best configs at these shapes (2026-12-01 run with
# (64, 64, 2|3) and (64, 128, 3) too: slower everywhere).
EXAMPLE_CONFIGS = [(64, 128, 2), (128, 128, 2)]
DTYPES = ("bfloat16", "float16")  # the example runs only on f16


def _time(f, args):
  fs, flat = benchmarking.standardize_function(f, *args, mode="forward")
  return benchmarking.benchmark(fs, flat, iterations=20).median_evaluation_time_ms


def main(out_dir=".", shape_word=""):
  rows = []

  def record(**r):
    rows.append(r)
    print(r, flush=True)

  for label, (b, t, n, kh, h) in SHAPES.items():
    if shape_word not in label:
      continue
    for dtype in map(jnp.dtype, DTYPES):
      for causal in (False, True):
        q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
        kv = jax.ShapeDtypeStruct((b, t, kh, h), dtype)
        flops = 4 * b * n * t * t * h / (2 if causal else 1)
        base = dict(shape=label, dtype=jnp.dtype(dtype).name, causal=causal)
        ms = _time(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"), (q, kv, kv))
        record(**base, impl="cudnn", ms=ms, tflops=flops / ms / 1e9)
        for c in OUR_CONFIGS:
          ours = mo.MosaicDotProductAttention(config=c and mo.MosaicAttentionConfig(
              block_q=c[0], block_kv=c[1], num_stages=c[2], consumers=c[3]))
          try:
            ms = _time(lambda q, k, v: ours(q, k, v, is_causal=causal), (q, kv, kv))
          except Exception as e:  # a config may not fit shared memory
            record(**base, impl="mosaic", config=c, error=str(e)[:150])
            continue
          record(**base, impl="mosaic", config=c or "heuristic", ms=ms,
                 tflops=flops / ms / 1e9)
        for bq, bkv, st in EXAMPLE_CONFIGS:
          if dtype != jnp.float16:
            continue
          cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=st,
                                causal=causal)
          try:
            ms = _time(lambda q, k, v: am.attention(q, k, v, cfg), (q, kv, kv))
          except Exception as e:  # a config may not fit shared memory
            record(**base, impl="jax example", config=(bq, bkv, st), error=str(e)[:150])
            continue
          record(**base, impl="jax example", config=(bq, bkv, st), ms=ms,
                 tflops=flops / ms / 1e9)
  common.save(out_dir, "attention_jax_fa3", rows)


if __name__ == "__main__":
  main(*sys.argv[1:])
