"""A/B of the Mosaic backward's ping-pong between consumer warpgroups (GPU).

Usage: python benchmarks/attention_mosaic_pingpong_ab.py [OUT_DIR]
Forward+backward (bf16, random inputs) of cuDNN (jax.nn) and of "mosaic"
with mosaic._BWD_PINGPONG on and off, in one run at the issue #5 shapes;
writes attention_mosaic_pingpong_ab.json.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import common
from tokamax._src import benchmarking
from tokamax.ops.attention import mosaic as mo

ITERATIONS = 20
CASES = [((32, 2048, 16, 16, 64), False), ((32, 2048, 16, 16, 64), True),
         ((8, 4096, 16, 16, 128), False), ((8, 4096, 16, 16, 128), True),
         ((4, 4096, 32, 8, 128), True)]


def _time(f, specs):
  f_std, flat = benchmarking.standardize_function(f, *specs, mode="forward_and_vjp")
  return benchmarking.benchmark(f_std, flat, iterations=ITERATIONS).median_evaluation_time_ms


def main(out_dir="."):
  rows = []
  for (b, t, n, kh, h), causal in CASES:
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
    flops = 3.5 * 4 * b * n * t * t * h / (2 if causal else 1)
    row = dict(shape=(b, t, n, kh, h), causal=causal)
    row["cudnn_ms"] = _time(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"), (q, kv, kv))
    for name, on in (("mosaic_pingpong_ms", True), ("mosaic_plain_ms", False)):
      mo._BWD_PINGPONG = on
      op = mo.MosaicDotProductAttention()
      row[name] = _time(lambda q, k, v: op(q, k, v, is_causal=causal), (q, kv, kv))
    mo._BWD_PINGPONG = True
    for k in ("cudnn_ms", "mosaic_pingpong_ms", "mosaic_plain_ms"):
      row[k.replace("_ms", "_tflops")] = flops / row[k] / 1e9
    row["pingpong_vs_cudnn"] = row["cudnn_ms"] / row["mosaic_pingpong_ms"]
    row["plain_vs_cudnn"] = row["cudnn_ms"] / row["mosaic_plain_ms"]
    rows.append(row)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
  common.save(out_dir, "attention_mosaic_pingpong_ab", rows, iterations=ITERATIONS)


if __name__ == "__main__":
  main(*sys.argv[1:])
