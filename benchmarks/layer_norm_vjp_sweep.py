"""Sweeps the layer_norm "triton" backward ([R, F] views) on the GPU.

Usage: [X_DTYPE=float32] [PPS=0,2] [PREFETCH=0,1] [ONLY_SHIPPED=1] python benchmarks/layer_norm_vjp_sweep.py [OUT_DIR] [SHAPES]
x bf16 (or X_DTYPE), f32 scale and offset, the VJP alone (mode "vjp": dx,
dscale, doffset from the saved statistics), TB/s of x and dy read + dx
written, for every (block_rows, warps, programs_per_sm, prefetch) with 4-64
values per thread and prefetch in PREFETCH (default 0,1: blocks loaded 0 or
1 loop trips ahead) (none with ONLY_SHIPPED=1); the shipped config ("triton
shipped": heuristic or shipped cache entry) and XLA in the same run.
SHAPES: comma-separated "8192x8192,65536x1024" (default both); a shape of
three dims "PRExFxPOST" is normalised over axis 1 (the [pre, F, post]
backward: block_rows is then the column block). Writes
layer_norm_vjp_sweep.json.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import sys

import jax
import jax.numpy as jnp

import common
import tokamax
from tokamax.ops.normalization import triton as tr

SHAPES = ("8192x8192", "65536x1024", "16384x4096", "32768x2048", "131072x512", "4096x16384")
BLOCKS = (1, 2, 4, 8, 16, 32)
WARPS = (4, 8, 16)
PPS = (0, 1, 2, 4)  # 0: 32 // warps programs per SM
_vjp_ms = functools.partial(common.median_ms, mode="vjp")


def main(out_dir=".", shapes="8192x8192,65536x1024"):
  x_dtype = jnp.dtype(os.environ.get("X_DTYPE", "bfloat16"))
  pps_values = [int(v) for v in os.environ.get("PPS", ",".join(map(str, PPS))).split(",")]
  prefetch_values = [int(v) for v in os.environ.get("PREFETCH", "0,1").split(",")]
  rows = []

  def record(**r):
    rows.append(dict(r, x_dtype=x_dtype.name))
    print(rows[-1], flush=True)

  for shape in shapes.split(","):
    dims = tuple(map(int, shape.split("x")))
    axis = 1 if len(dims) == 3 else -1
    f = dims[axis]
    r = math.prod(dims) // f  # normalised vectors
    vectors = dims[2] if len(dims) == 3 else r  # per tile: rows, or columns of post
    x = jax.ShapeDtypeStruct(dims, x_dtype)
    p = jax.ShapeDtypeStruct((f,), jnp.float32)
    tb = lambda ms: 3 * r * f * x_dtype.itemsize / ms / 1e9
    ms = _vjp_ms(lambda x, s, o: tokamax.layer_norm(x, s, o, axis=axis, implementation="xla"),
                 (x, p, p))
    record(shape=shape, impl="xla", ms=ms, tbps=tb(ms))
    ms = _vjp_ms(lambda x, s, o: tokamax.layer_norm(x, s, o, axis=axis, implementation="triton"),
               (x, p, p))
    record(shape=shape, impl="triton shipped", ms=ms, tbps=tb(ms))
    configs = () if os.environ.get("ONLY_SHIPPED") else itertools.product(
        BLOCKS, WARPS, pps_values, prefetch_values)
    for block, w, pps, prefetch in configs:
      if not 4 <= block * f / (32 * w) <= 64 or block > vectors:
        continue
      cfg = tr.TritonLayerNormConfig(block_rows=block, num_warps=w, programs_per_sm=pps,
                                     prefetch=prefetch)
      op = tr.TritonLayerNorm(vjp=tr.TritonLayerNormVjp(config=cfg))
      try:
        ms = _vjp_ms(lambda x, s, o: op(x, s, o, axis=axis), (x, p, p))
      except Exception as e:  # a config may not compile (shared memory)
        record(shape=shape, config=str(cfg), error=str(e)[:200])
        continue
      record(shape=shape, block_rows=block, warps=w, programs_per_sm=pps,
             vjp_prefetch=prefetch, ms=ms, tbps=tb(ms))
  common.save(out_dir, "layer_norm_vjp_sweep", rows)


if __name__ == "__main__":
  main(*sys.argv[1:])
