"""Sweeps layer_norm "triton" configs for a non-last axis (GPU).

Usage: python benchmarks/layer_norm_sweep.py [OUT_DIR]
x bf16 [16, 1024, 4096] normalised over axis 1 (the [pre, F, post] kernels),
f32 scale and offset: forward and forward+backward per (block_rows, warps),
with XLA in the same run. Writes layer_norm_sweep.json.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import common
import tokamax
from tokamax._src import benchmarking
from tokamax.ops.normalization import triton as tr

CONFIGS = [(4, 4), (8, 4), (8, 8), (16, 4), (16, 8), (16, 16), (32, 8), (32, 16)]


def _time(f, args, mode):
  f_std, flat = benchmarking.standardize_function(f, *args, mode=mode)
  return benchmarking.benchmark(f_std, flat, iterations=20).median_evaluation_time_ms


def main(out_dir="."):
  x = jax.ShapeDtypeStruct((16, 1024, 4096), jnp.bfloat16)
  p = jax.ShapeDtypeStruct((1024,), jnp.float32)
  rows = []
  for mode in ("forward", "forward_and_vjp"):
    ms = _time(lambda x, s, o: tokamax.layer_norm(x, s, o, axis=1, implementation="xla"),
               (x, p, p), mode)
    rows.append(dict(mode=mode, impl="xla", ms=ms))
    print(rows[-1], flush=True)
    for block, warps in CONFIGS:
      cfg = tr.TritonLayerNormConfig(block_rows=block, num_warps=warps)
      op = tr.TritonLayerNorm(config=cfg, vjp=tr.TritonLayerNormVjp(config=cfg))
      try:
        ms = _time(lambda x, s, o: op(x, s, o, axis=1), (x, p, p), mode)
        rows.append(dict(mode=mode, impl="triton", block_rows=block, warps=warps, ms=ms))
      except Exception as e:  # a config may not compile
        rows.append(dict(mode=mode, impl="triton", block_rows=block, warps=warps,
                         error=str(e)[:200]))
      print(rows[-1], flush=True)
  common.save(out_dir, "layer_norm_sweep", rows)


if __name__ == "__main__":
  main(*sys.argv[1:])
