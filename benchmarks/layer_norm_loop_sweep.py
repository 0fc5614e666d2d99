"""Sweeps the looping layer_norm forward (programs_per_sm > 0) on the GPU.

Usage: [X_DTYPE=float32] [PARAM_DTYPE=bfloat16] [BLOCKS=1,2] [WARPS=1,4,8] [PPS=1,2,16] (replace the defaults) [DEPTHS=1] [LOOP_STAGES=0,3] [MAX_VALUES=64] [CHUNKS=0,1024] \
  python benchmarks/layer_norm_loop_sweep.py [OUT_DIR] [FLAG=A,B,...|sweep:FLAG=A] [SHAPES]
x bf16 (or X_DTYPE) 8192x8192 and 65536x1024, scale and offset f32 (or PARAM_DTYPE),
forward only, TB/s of
x read + y written: the shipped configs (implementation="triton"; "mosaic" as a peer), one
program per tile, and programs looping over tiles (config prefetch in
DEPTHS: tiles loaded that many trips ahead of the one normalised; one
program per tile (PPS 0) runs whatever DEPTHS), with 4 to MAX_VALUES f32
values of a tile per thread;
XLA and a copy (x + 1) in the same run. CHUNKS: config.feature_chunk values
(0: whole rows; n: the chunked forward, its values per thread counted per
[block, n] chunk; PPS 0 then still loops over chunks). Writes
layer_norm_loop_sweep.json.
With FLAG=A,B,... (a module-level constant of tokamax.ops.normalization.triton
and Python literals for it) only the shipped configs are timed, once per
value, the values cycled twice (A/B of a compile-time switch); with
sweep:FLAG=A the whole sweep runs with the constant set to A. SHAPES:
comma-separated "8192x8192,65536x1024" (default both).
"""

from __future__ import annotations

import ast
import itertools
import os
import sys

import jax
import jax.numpy as jnp

import common
import tokamax
from tokamax.ops.normalization import triton as tr

SHAPES = {(8192, 8192): ((1, 2, 4), (4, 8, 16)), (65536, 1024): ((2, 4, 8, 16), (4, 8, 16)),
          # Not run by default (SHAPES argument): other rows and features.
          (1024, 8192): ((1, 2), (4, 8, 16)), (32768, 8192): ((1, 2), (4, 8, 16)),
          (4096, 16384): ((1, 2), (8, 16)), (16384, 4096): ((1, 2, 4), (4, 8, 16)),
          (32768, 2048): ((1, 2, 4, 8), (4, 8, 16)), (131072, 512): ((4, 8, 16, 32), (4, 8, 16))}
DEFAULT_SHAPES = "8192x8192,65536x1024"
LOOPS = [(0, 2), (1, 2), (2, 2), (3, 2), (4, 2), (5, 2), (6, 2), (8, 2)]
# (programs_per_sm, stages); PPS=1,16,...: any programs_per_sm (stages 2)
# 3, 5, 6: the tiles spread differently over the SMs. 65536x1024 in 4-row
# tiles is 16384 tiles, 124.1 per SM: 8 per SM gives 1024 programs of 16 tiles
# (an SM with 8 of them does 128), 5 per SM 656 programs of 25 (at most 125
# per SM). H200: no better than 4 or 8 per SM (docs/benchmarks.md, 2026-12-02).
DEPTHS = (0, 1, 2)  # prefetch depths tried for looping configs (DEPTHS=...: any)


def main(out_dir=".", flag="", shapes=""):
  rows = []
  swept = {}  # constants the full sweep runs with ("sweep:NAME=VALUE"), previous values
  if flag.startswith("sweep:"):
    swept = common.set_constants(tr, flag.removeprefix("sweep:"))
    flag = ""
  if flag:
    flag_name, values = flag.split("=")
    values = [ast.literal_eval(v) for v in values.split(",")]

  def record(**r):
    rows.append(r)
    print(r, flush=True)

  param_dtype = jnp.dtype(os.environ.get("PARAM_DTYPE", "float32"))
  x_dtype = jnp.dtype(os.environ.get("X_DTYPE", "bfloat16"))

  def pick(env, values):  # env values replace the shape's defaults
    wanted = os.environ.get(env)
    return [int(v) for v in wanted.split(",")] if wanted else list(values)

  loops = [(p, 2) for p in pick("PPS", [])] or LOOPS
  depths = [int(d) for d in os.environ.get("DEPTHS", ",".join(map(str, DEPTHS))).split(",")]
  loop_stages = [int(s) for s in os.environ.get("LOOP_STAGES", "0").split(",")]
  chunks = [int(c) for c in os.environ.get("CHUNKS", "0").split(",")]
  dtypes = dict(param_dtype=param_dtype.name, x_dtype=x_dtype.name)
  for (r, f), (blocks, warps) in SHAPES.items():
    if f"{r}x{f}" not in (shapes or DEFAULT_SHAPES).split(","):
      continue
    x = jax.ShapeDtypeStruct((r, f), x_dtype)
    p = jax.ShapeDtypeStruct((f,), param_dtype)
    tb = lambda ms: 2 * r * f * x_dtype.itemsize / ms / 1e9
    for name, fn in (
        ("xla", lambda x, s, o: tokamax.layer_norm(x, s, o, implementation="xla")),
        ("triton shipped", lambda x, s, o: tokamax.layer_norm(x, s, o, implementation="triton")),
        ("mosaic shipped", lambda x, s, o: tokamax.layer_norm(x, s, o, implementation="mosaic")),
        ("copy", lambda x, s, o: x + 1)):
      try:
        ms = common.median_ms(fn, (x, p, p))
      except NotImplementedError as e:  # "mosaic" off Hopper
        record(shape=f"{r}x{f}", impl=name, error=str(e)[:200])
        continue
      record(shape=f"{r}x{f}", impl=name, ms=ms, tbps=tb(ms), **dtypes)
    if flag:
      default_value = getattr(tr, flag_name)
      for rep, value in itertools.product(range(2), values):
        setattr(tr, flag_name, value)
        ms = common.median_ms(lambda x, s, o: tokamax.layer_norm(x, s, o, implementation="triton"),
                   (x, p, p))
        record(shape=f"{r}x{f}", impl=f"triton shipped {flag_name}={value!r}", rep=rep,
               ms=ms, tbps=tb(ms), **dtypes)
      setattr(tr, flag_name, default_value)
      continue
    for block, w, (pps, stages), prefetch, ls, chunk in itertools.product(
        pick("BLOCKS", blocks), pick("WARPS", warps), loops, sorted({0, *depths}),
        loop_stages, chunks):
      per_thread = block * (chunk or f) / (32 * w)
      if not 4 <= per_thread <= int(os.environ.get("MAX_VALUES", "64")):
        continue
      if chunk and prefetch:  # the chunked forward has no register prefetch
        continue
      if ls:  # pipelined by Triton: looping programs without register prefetch
        if prefetch or not (pps or chunk):
          continue
      elif prefetch if not pps else prefetch not in depths:
        continue
      cfg = tr.TritonLayerNormConfig(block_rows=block, num_warps=w, programs_per_sm=pps,
                                     num_stages=stages, prefetch=prefetch, loop_stages=ls,
                                     feature_chunk=chunk)
      op = tr.TritonLayerNorm(config=cfg)
      try:
        ms = common.median_ms(lambda x, s, o: op(x, s, o), (x, p, p))
      except Exception as e:  # a config may not compile (shared memory)
        record(shape=f"{r}x{f}", config=str(cfg), error=str(e)[:200])
        continue
      record(shape=f"{r}x{f}", block_rows=block, warps=w, programs_per_sm=pps,
             stages=stages, prefetch_depth=prefetch, loop_stages=ls, feature_chunk=chunk,
             ms=ms, tbps=tb(ms),
             **dtypes,
             **{name: getattr(tr, name) for name in swept})
  for name, value in swept.items():
    setattr(tr, name, value)
  common.save(out_dir, "layer_norm_loop_sweep", rows)


if __name__ == "__main__":
  main(*sys.argv[1:])
