"""Sweeps the layer_norm "triton" backward ([R, F] views) on the GPU.

Usage: [X_DTYPE=float32] [PPS=0,2] [PREFETCH=0,1] [LOOP_STAGES=0,3] [BLOCKS=1,2] [WARPS=1,4] [FEATURE_CHUNK=0,2048] [TILE_BYTES=8192,16384] [ONLY_SHIPPED=1] python benchmarks/layer_norm_vjp_sweep.py [OUT_DIR] [SHAPES]
x bf16 (or X_DTYPE), f32 scale and offset, mode "vjp" (the forward that
saves the statistics, then dx, dscale, doffset; y unused), TB/s of x and
dy read + dx written (so below the backward's own rate), for every
(block_rows, warps, programs_per_sm, prefetch) with 4-64 values per thread and prefetch in PREFETCH (default 0,1: blocks loaded 0 or
1 loop trips ahead) and loop_stages in LOOP_STAGES (default 0; stages > 0
with prefetch 0 only) (none with ONLY_SHIPPED=1); the shipped config ("triton
shipped": heuristic or shipped cache entry) and XLA in the same run.
SHAPES: comma-separated "8192x8192,65536x1024" (default both); a shape of
three dims "PRExFxPOST" is normalised over axis 1 (the [pre, F, post]
backward: its search space, block_rows columns per tile, each with the
module's _COLUMN_TILE_BYTES set to every value of TILE_BYTES (default
8192,16384,32768)). Writes layer_norm_vjp_sweep.json.
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
  stage_values = [int(v) for v in os.environ.get("LOOP_STAGES", "0").split(",")]
  blocks = [int(v) for v in os.environ.get("BLOCKS", ",".join(map(str, BLOCKS))).split(",")]
  warps = [int(v) for v in os.environ.get("WARPS", ",".join(map(str, WARPS))).split(",")]
  chunk_values = [int(v) for v in os.environ.get("FEATURE_CHUNK", "0").split(",")]
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
    if len(dims) == 3:
      _column_sweep(record, shape, axis, x, p, tb, r, f, dims[2])
      continue
    configs = () if os.environ.get("ONLY_SHIPPED") else itertools.product(
        blocks, warps, pps_values, prefetch_values, stage_values, chunk_values)
    for block, w, pps, prefetch, ls, chunk in configs:
      if not 4 <= block * f / (32 * w) <= 64 or block > vectors or (ls and prefetch):
        continue
      cfg = tr.TritonLayerNormConfig(block_rows=block, num_warps=w, programs_per_sm=pps,
                                     prefetch=prefetch, loop_stages=ls, feature_chunk=chunk)
      op = tr.TritonLayerNorm(vjp=tr.TritonLayerNormVjp(config=cfg))
      try:
        ms = _vjp_ms(lambda x, s, o: op(x, s, o, axis=axis), (x, p, p))
      except Exception as e:  # a config may not compile (shared memory)
        record(shape=shape, config=str(cfg), error=str(e)[:200])
        continue
      record(shape=shape, block_rows=block, warps=w, programs_per_sm=pps,
             vjp_prefetch=prefetch, loop_stages=ls, feature_chunk=chunk, ms=ms, tbps=tb(ms))
  common.save(out_dir, "layer_norm_vjp_sweep", rows)


def _column_sweep(record, shape, axis, x, p, tb, r, f, post):
  """The [pre, F, post] backward's search space x TILE_BYTES."""
  if os.environ.get("ONLY_SHIPPED"):
    return
  tile_values = [int(v) for v in os.environ.get("TILE_BYTES", "8192,16384,32768").split(",")]
  default = tr._COLUMN_TILE_BYTES
  space = sorted(tr.search_space(r, f, x.dtype.itemsize, post, backward=True),
                 key=lambda c: (c.block_rows, c.num_warps))
  for tile_bytes, cfg in itertools.product(tile_values, space):
    tr._COLUMN_TILE_BYTES = tile_bytes
    op = tr.TritonLayerNorm(vjp=tr.TritonLayerNormVjp(config=cfg))
    try:
      ms = _vjp_ms(lambda x, s, o: op(x, s, o, axis=axis), (x, p, p))
    except Exception as e:  # a config may not compile (registers)
      record(shape=shape, config=str(cfg), tile_bytes=tile_bytes, error=str(e)[:200])
      continue
    finally:
      tr._COLUMN_TILE_BYTES = default
    record(shape=shape, block_rows=cfg.block_rows, warps=cfg.num_warps,
           tile_bytes=tile_bytes, ms=ms, tbps=tb(ms))


if __name__ == "__main__":
  main(*sys.argv[1:])
