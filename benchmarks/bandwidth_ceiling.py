"""What read+write bandwidth a Pallas:Triton streaming kernel reaches (GPU).

Usage: python benchmarks/bandwidth_ceiling.py [OUT_DIR]
x bf16 8192x8192 and 65536x1024: a Pallas:Triton copy y = x (tiles of
`rows` x F, `warps` warps, eviction hint none or evict_first on the load and
the store), XLA's copy (x + 1), and the "triton" layer_norm forward (f32
scale and offset, shipped config). TB/s of x read + y written (cupti,
median of 20). Writes bandwidth_ceiling.json: the ceiling against which
layer_norm's 3.9 TB/s target (issue #4) is judged.
"""

from __future__ import annotations

import functools
import itertools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

import common
import tokamax
from tokamax._src import benchmarking
from tokamax._src import pallas_triton

SHAPES = {(8192, 8192): ((1, 2, 4), (4, 8, 16)), (65536, 1024): ((4, 8, 16, 32), (4, 8, 16))}


def _time(f, args):
  f_std, flat = benchmarking.standardize_function(f, *args, mode="forward")
  return benchmarking.benchmark(f_std, flat, iterations=20).median_evaluation_time_ms


def _copy_kernel(x_ref, y_ref, *, rows: int, hint):
  r0 = pallas_triton.i32(pl.program_id(0) * rows)
  tile = (pl.ds(r0, rows), slice(None))
  pltr.store(y_ref.at[tile], pltr.load(x_ref.at[tile], eviction_policy=hint),
             eviction_policy=hint)


def pallas_copy(x, *, rows: int, warps: int, hint):
  """y = x by [rows, F] tiles (F a power of two, R a multiple of rows)."""
  kernel = functools.partial(_copy_kernel, rows=rows, hint=hint)
  return pallas_triton.pallas_call(
      kernel, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
      grid=(x.shape[0] // rows,), num_warps=warps, name="bandwidth_copy")(x)[0]


def main(out_dir="."):
  rows_out = []

  def record(**r):
    rows_out.append(r)
    print(r, flush=True)

  for (r, f), (blocks, warps) in SHAPES.items():
    x = jax.ShapeDtypeStruct((r, f), jnp.bfloat16)
    p = jax.ShapeDtypeStruct((f,), jnp.float32)
    tb = lambda ms: 2 * r * f * 2 / ms / 1e9
    ms = _time(lambda x: x + 1, (x,))
    record(shape=f"{r}x{f}", impl="xla copy (x + 1)", ms=ms, tbps=tb(ms))
    ms = _time(lambda x, s, o: tokamax.layer_norm(x, s, o, implementation="triton"),
               (x, p, p))
    record(shape=f"{r}x{f}", impl="layer_norm triton", ms=ms, tbps=tb(ms))
    for rows, w, hint in itertools.product(blocks, warps, (None, "evict_first")):
      if not 8 <= rows * f // (32 * w) <= 256:  # elements per thread
        continue
      ms = _time(functools.partial(pallas_copy, rows=rows, warps=w, hint=hint), (x,))
      record(shape=f"{r}x{f}", impl="pallas copy", rows=rows, warps=w, hint=hint,
             ms=ms, tbps=tb(ms))
  common.save(out_dir, "bandwidth_ceiling", rows_out)


if __name__ == "__main__":
  main(*sys.argv[1:])
