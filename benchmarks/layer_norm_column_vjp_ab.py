"""The layer_norm "triton" [pre, F, post] backward per kernel, under variants
of the module's constants (GPU).

Usage: [VARIANTS="NAME=VALUE,...;NAME=VALUE,..."] [PASSES=2] python benchmarks/layer_norm_column_vjp_ab.py [OUT_DIR] [SHAPES]
x bf16 "PRExFxPOST" normalised over axis 1 (default 16x1024x4096,
64x4096x256,1024x1024x8), f32 scale and offset, the VJP alone (dx, dscale,
doffset from the saved statistics) with the heuristic config. Each variant
(";"-separated sets of constants of tokamax.ops.normalization.triton; the
default A/Bs `_COLUMN_PREFETCH`) is timed PASSES times, alternating, with
XLA's VJP in the same process: the summed kernel time (cupti, median of 20)
and each kernel's median. TB/s counts x and dy read + dx written once.
Writes layer_norm_column_vjp_ab.json.
"""

from __future__ import annotations

import math
import os
import statistics
import sys

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

import common
import tokamax
from tokamax._src import benchmarking
from tokamax.ops.normalization import triton as tr

ITERATIONS = 20
SHAPES = "16x1024x4096,64x4096x256,1024x1024x8"


def _per_kernel(f, specs):
  """(total ms, {kernel name: ms}) medians over ITERATIONS calls."""
  f_std, flat = benchmarking.standardize_function(f, *specs, mode="vjp")
  compiled = jax.jit(f_std).lower(*flat).compile()
  _, timings = profiler.measure(compiled, aggregate=False, iterations=ITERATIONS)(*flat)
  totals = [sum(ms for _, ms in call) for call in timings]
  kernels = {}
  for i, (name, _) in enumerate(timings[0]):
    kernels[f"{i}:{name}"] = statistics.median(call[i][1] for call in timings)
  return statistics.median(totals), kernels


def main(out_dir=".", shapes=SHAPES):
  variants = os.environ.get("VARIANTS", "_COLUMN_PREFETCH=0;_COLUMN_PREFETCH=1").split(";")
  passes = int(os.environ.get("PASSES", "2"))
  rows = []

  def record(**r):
    rows.append(r)
    print(r, flush=True)

  for shape in shapes.split(","):
    dims = tuple(map(int, shape.split("x")))
    x = jax.ShapeDtypeStruct(dims, jnp.bfloat16)
    p = jax.ShapeDtypeStruct((dims[1],), jnp.float32)
    tb = lambda ms: 3 * math.prod(dims) * 2 / ms / 1e9
    for impl in ("xla", "triton"):
      for _ in range(passes if impl == "triton" else 1):
        for variant in (variants if impl == "triton" else [""]):
          previous = common.set_constants(tr, variant)
          jax.clear_caches()
          try:
            ms, kernels = _per_kernel(
                lambda x, s, o: tokamax.layer_norm(x, s, o, axis=1, implementation=impl),
                (x, p, p))
            record(shape=shape, impl=impl, variant=variant, ms=ms, tbps=tb(ms),
                   kernels=kernels)
          except Exception as e:  # pylint: disable=broad-except
            record(shape=shape, impl=impl, variant=variant, error=str(e)[:300])
          finally:
            for name, value in previous.items():
              setattr(tr, name, value)
  common.save(out_dir, "layer_norm_column_vjp_ab", rows)


if __name__ == "__main__":
  main(*sys.argv[1:])
