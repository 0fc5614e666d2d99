"""The layer_norm "triton" [pre, F, post] forward and forward+backward per
kernel, under variants of the module's constants (GPU).

Usage: [VARIANTS="NAME=VALUE,...;NAME=VALUE,..."] [PASSES=2] python benchmarks/layer_norm_column_vjp_ab.py [OUT_DIR] [SHAPES]
x bf16 "PRExFxPOST" normalised over axis 1 (default: SHAPES), f32 scale
and offset, with the heuristic config. Modes (MODES, default
"forward,forward_and_vjp"): benchmarking.standardize_function's; its "vjp"
mode runs the forward too (jax.vjp), without using y. Each variant
(";"-separated sets of constants of tokamax.ops.normalization.triton;
default: the one-slab and the two-kernel column forward) is timed PASSES times,
alternating, for each of IMPLS (default "xla,triton"; "none": the choice
of implementation=None) with XLA once in the same process: the summed
kernel time (cupti, median of 20) and each kernel's median. TB/s (forward
only) counts x read + y written once.
Writes layer_norm_column_vjp_ab.json (2026-12-03: `_COLUMN_PREFETCH`, a
one-trip prefetch in the backward's sums loop, since removed).
"""

from __future__ import annotations

import itertools
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
SHAPES = ("16x1024x4096,64x4096x256,4x16384x512,3x4099x1000,8x4096x1024,"
          "1024x1024x8,256x512x64,512x1024x32,64x8192x16,128x2048x64,64x256x1024")


def _per_kernel(f, specs, mode):
  """(total ms, {kernel name: ms}) medians over ITERATIONS calls."""
  f_std, flat = benchmarking.standardize_function(f, *specs, mode=mode)
  compiled = jax.jit(f_std).lower(*flat).compile()
  _, timings = profiler.measure(compiled, aggregate=False, iterations=ITERATIONS)(*flat)
  totals = [sum(ms for _, ms in call) for call in timings]
  kernels = {}
  for i, (name, _) in enumerate(timings[0]):
    kernels[f"{i}:{name}"] = statistics.median(call[i][1] for call in timings)
  return statistics.median(totals), kernels


def main(out_dir=".", shapes=SHAPES):
  variants = os.environ.get("VARIANTS", "COLUMN_FORWARD=False;COLUMN_FORWARD=True").split(";")
  modes = os.environ.get("MODES", "forward,forward_and_vjp").split(",")
  passes = int(os.environ.get("PASSES", "2"))
  impls = [None if i == "none" else i
           for i in os.environ.get("IMPLS", "xla,triton").split(",")]
  rows = []

  def record(**r):
    rows.append(r)
    print({k: v for k, v in r.items() if k != "kernels"}, flush=True)

  for shape in shapes.split(","):
    dims = tuple(map(int, shape.split("x")))
    x = jax.ShapeDtypeStruct(dims, jnp.bfloat16)
    p = jax.ShapeDtypeStruct((dims[1],), jnp.float32)
    for mode, impl in itertools.product(modes, impls):
      tb = lambda ms: 2 * math.prod(dims) * 2 / ms / 1e9 if mode == "forward" else None
      for _ in range(passes if impl != "xla" else 1):
        for variant in (variants if impl != "xla" else [""]):
          previous = common.set_constants(tr, variant)
          jax.clear_caches()
          try:
            ms, kernels = _per_kernel(
                lambda x, s, o: tokamax.layer_norm(x, s, o, axis=1, implementation=impl),
                (x, p, p), mode)
            record(shape=shape, mode=mode, impl=str(impl), variant=variant, ms=ms,
                   tbps=tb(ms), kernels=kernels)
          except Exception as e:  # pylint: disable=broad-except
            record(shape=shape, mode=mode, impl=str(impl), variant=variant, error=str(e)[:300])
          finally:
            for name, value in previous.items():
              setattr(tr, name, value)
  common.save(out_dir, "layer_norm_column_vjp_ab", rows)


if __name__ == "__main__":
  main(*sys.argv[1:])
