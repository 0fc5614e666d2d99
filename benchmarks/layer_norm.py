"""layer_norm benchmark: tokamax "mosaic" and "triton" against "xla".

Usage: [SHAPES=8192x8192,...] [MODES=forward] [IMPLS=auto,xla] [REPEATS=n] \
  [PARAM_DTYPE=bfloat16] python benchmarks/layer_norm.py [OUT_DIR]
Prints a markdown table and writes layer_norm.json to OUT_DIR (default: .).
SHAPES, MODES and IMPLS pick a subset of the labels below ("auto" is
implementation=None, what dispatch picks); REPEATS times each row
n times in the same process (the spread between timings, not just one).
x is bf16 [R, F] (normalised over F) or [16, 1024, 4096] normalised over
axis 1 (the [pre, F, post] kernel), scale and offset f32 [F] (or
PARAM_DTYPE). Times are
accelerator time (cupti on GPU, wallclock elsewhere), median of ITERATIONS
runs. Effective bandwidth counts the bytes that must move at least once:
forward x read + y written (2 R F itemsize); forward_and_vjp adds the
backward's x and dy read and dx written (5 R F itemsize). Parameters and
statistics are ignored (< 0.1%). The "copy" row per shape is the ceiling
for the forward: XLA's y = x + 1 (one read of x, one write of y). Off-GPU
the shapes are shrunk 64x in R so the script stays a quick smoke test (the
mosaic and triton rows then report the refusal).
"""

from __future__ import annotations

import itertools
import os
import sys

import jax
import jax.numpy as jnp

import common
import tokamax
from tokamax._src import benchmarking

ITERATIONS = 20
# label: (shape, normalised axis)
SHAPES = {
    "8192x8192": ((8192, 8192), 1),
    "65536x1024": ((65536, 1024), 1),
    "16384x4096": ((16384, 4096), 1),
    "32768x2048": ((32768, 2048), 1),
    "131072x512": ((131072, 512), 1),
    "16x1024x4096 axis 1": ((16, 1024, 4096), 1),
    # Rows wider than triton.MAX_FEATURES: its chunked kernels against XLA.
    "4096x18432": ((4096, 18432), 1),
    "1024x65536": ((1024, 65536), 1),
    # ... and a middle axis that wide (its column kernels).
    "16x32768x64 axis 1": ((16, 32768, 64), 1),
}
IMPLEMENTATIONS = ("mosaic", "triton", "xla", "auto")
MODES = ("forward", "forward_and_vjp")
# Arrays of x's size that a mode moves at least once (see module docstring).
ARRAYS_MOVED = {"forward": 2, "forward_and_vjp": 5}


def _time(f, args, mode):
  f_std, flat = benchmarking.standardize_function(f, *args, mode=mode)
  return benchmarking.benchmark(f_std, flat, iterations=ITERATIONS)


def main(out_dir="."):

  on_gpu = jax.default_backend() == "gpu"
  shapes = _pick(SHAPES, os.environ.get("SHAPES"))
  modes = _pick(MODES, os.environ.get("MODES"))
  impls = _pick(IMPLEMENTATIONS, os.environ.get("IMPLS", "mosaic,triton,xla"))
  repeats = int(os.environ.get("REPEATS", "1"))
  param_dtype = jnp.dtype(os.environ.get("PARAM_DTYPE", "float32"))
  rows = []
  for (label, (shape, axis)), _ in itertools.product(shapes.items(), range(repeats)):
    if not on_gpu:
      shape = (shape[0] // 64 or 1,) + shape[1:]
      label = "x".join(map(str, shape)) + (f" axis {axis}" if axis != len(shape) - 1 else "")
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    p = jax.ShapeDtypeStruct((shape[axis],), param_dtype)
    size = x.size
    for mode in modes:
      for impl in impls:
        fn = lambda x, s, o, impl=impl, axis=axis: tokamax.layer_norm(
            x, s, o, axis=axis, implementation=None if impl == "auto" else impl)
        row = dict(shape=label, mode=mode, impl=impl)
        try:
          data = _time(fn, (x, p, p), mode)
          ms = data.median_evaluation_time_ms
          nbytes = ARRAYS_MOVED[mode] * size * x.dtype.itemsize
          row.update(ms=ms, tbps=nbytes / ms / 1e9, method=data.method,
                     compile_ms=data.compile_time_ms)
        except Exception as e:  # record and go on: e.g. triton off-GPU
          row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(_fmt(row), flush=True)
    data = _time(lambda x: x + 1, (x,), "forward")
    ms = data.median_evaluation_time_ms
    rows.append(dict(shape=label, mode="forward", impl="copy", ms=ms,
                     tbps=2 * size * x.dtype.itemsize / ms / 1e9, method=data.method))
    print(_fmt(rows[-1]), flush=True)
  meta = common.save(out_dir, "layer_norm", rows, iterations=ITERATIONS,
                     param_dtype=param_dtype.name)
  print(f"\n{meta}")
  print(markdown(rows))


def _pick(choices, names):
  """The entries of choices (a dict or tuple) named in the comma list names."""
  if not names:
    return choices
  wanted = set(names.split(","))
  if unknown := wanted - set(choices):
    raise ValueError(f"unknown {sorted(unknown)}; choose from {list(choices)}")
  if isinstance(choices, dict):
    return {k: v for k, v in choices.items() if k in wanted}
  return tuple(c for c in choices if c in wanted)


def _fmt(r):
  if "error" in r:
    return f"{r['shape']:11s} {r['mode']:16s} {r['impl']:7s} {r['error']}"
  return (f"{r['shape']:11s} {r['mode']:16s} {r['impl']:7s}"
          f" {r['ms']:8.3f} ms {r['tbps']:6.2f} TB/s")


def markdown(rows):
  return common.markdown(rows, [
      ("x (bf16)", "shape", ""), ("mode", "mode", ""),
      ("implementation", "impl", ""), ("median ms", "ms", ".3f"),
      ("effective TB/s", "tbps", ".2f")])


if __name__ == "__main__":
  main(*sys.argv[1:])
