"""Sweeps the "mosaic" layer_norm forward's configs on the GPU.

Usage: python benchmarks/layer_norm_mosaic_sweep.py [OUT_DIR] [SHAPES] [heuristic] [FLAG=A,B ...]
x bf16 [R, F], f32 scale and offset, forward only, TB/s of x read + y
written. Per shape: "triton" and XLA, then the heuristic config and its
neighbours (stages 2-5 x output slots 1-3 at the heuristic block_rows;
block_rows halved and doubled; two CTAs per SM at 2-4 stages; only the
heuristic with the word "heuristic"), each checked against XLA's f32
result (max relative error recorded; a wrong config fails the script). With FLAG=A,B (module-level
constants of tokamax.ops.normalization.mosaic and a comma-separated list of
Python literals, e.g. NO_AUTO_BARRIERS_ROWS_PER_STEP=(2,),(1,2); several
give their product; SMS=A,B sets the CTA count per programs_per_sm instead
of the SM count) every config runs once per setting, in two passes (the
second in reverse order) so the spread between passes shows. SHAPES:
comma-separated "RxF" (default all). Writes layer_norm_mosaic_sweep.json.
"""

from __future__ import annotations

import ast
import itertools
import sys

import jax
import jax.numpy as jnp

import common
from tokamax._src import benchmarking
from tokamax.ops.normalization import mosaic as mo
import tokamax

SHAPES = ((8192, 8192), (65536, 1024), (131072, 512), (32768, 2048), (16384, 4096))


def _configs(rows, features):
  h = mo.heuristic_config(rows, features, 2)
  configs = [h]
  for st in (2, 3, 4, 5):
    for ost in (1, 2, 3):  # 3: more y stores in flight (not in the search space yet)
      configs.append(mo.MosaicLayerNormConfig(block_rows=h.block_rows, stages=st, out_stages=ost))
  for br in (h.block_rows // 2, 2 * h.block_rows):
    if br >= mo.rows_per_step(features):
      configs.append(mo.MosaicLayerNormConfig(block_rows=br, stages=h.stages))
  for st in (2, 3, 4):  # two CTAs per SM
    for ost in (1, 2):
      configs.append(mo.MosaicLayerNormConfig(block_rows=h.block_rows, stages=st,
                                              out_stages=ost, programs_per_sm=2))
  fits = lambda c: (c.programs_per_sm * mo._smem_bytes(c, features, 2)
                    <= mo.pallas_mosaic.SMEM_BYTES)
  return [c for i, c in enumerate(configs) if fits(c) and c not in configs[:i]]


def _time(f, args):
  f_std, flat = benchmarking.standardize_function(f, *args, mode="forward")
  return benchmarking.benchmark(f_std, flat, iterations=20).median_evaluation_time_ms


def main(out_dir=".", shapes="", *options):
  only_heuristic = "heuristic" in options
  flags = [o.split("=") for o in options if "=" in o]
  names = [n for n, _ in flags]
  settings = [dict(zip(names, vs)) for vs in itertools.product(
      *(ast.literal_eval(f"[{values}]") for _, values in flags))]
  passes = 2 if flags else 1
  rows_out = []

  def record(**r):
    rows_out.append(r)
    print(r, flush=True)

  for r, f in SHAPES:
    if shapes and f"{r}x{f}" not in shapes.split(","):
      continue
    keys = jax.random.split(jax.random.key(0), 3)
    x = (jax.random.normal(keys[0], (r, f), jnp.float32) * 2 + 0.5).astype(jnp.bfloat16)
    s, o = (jax.random.normal(k, (f,), jnp.float32) for k in keys[1:])
    want = tokamax.layer_norm(x.astype(jnp.float32), s, o, implementation="xla")
    spec = (jax.ShapeDtypeStruct((r, f), jnp.bfloat16),) + (jax.ShapeDtypeStruct((f,), jnp.float32),) * 2
    tbps = lambda ms: 2 * r * f * 2 / ms / 1e9
    for impl in ("triton", "xla"):
      ms = _time(lambda x, s, o, impl=impl: tokamax.layer_norm(x, s, o, implementation=impl), spec)
      record(shape=f"{r}x{f}", impl=impl, ms=ms, tbps=tbps(ms))
    configs = _configs(r, f)[:1] if only_heuristic else _configs(r, f)
    runs = list(itertools.product(configs, settings))
    for p in range(passes):
      for config, setting in (runs if p == 0 else runs[::-1]):
        previous = {n: getattr(mo, "_num_sms" if n == "SMS" else n) for n in setting}
        for n, v in setting.items():
          if n == "SMS":  # CTAs per programs_per_sm instead of the SM count
            mo._num_sms = lambda v=v: v
          else:
            setattr(mo, n, v)
        op = mo.MosaicLayerNorm(config=config)
        y = jax.jit(op)(x, s, o).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(y - want) / (jnp.abs(want) + 1)))
        if not err < 0.01:  # bf16 rounding: < 2^-8 relative
          raise AssertionError(f"{config} {setting}: max relative error {err}")
        ms = _time(op, spec)
        record(shape=f"{r}x{f}", impl="mosaic", config=str(config), passno=p,
               **{n: repr(v) for n, v in setting.items()}, ms=ms, tbps=tbps(ms),
               max_rel_error=err)
        for n, v in previous.items():
          setattr(mo, "_num_sms" if n == "SMS" else n, v)
  common.save(out_dir, "layer_norm_mosaic_sweep", rows_out, iterations=20)


if __name__ == "__main__":
  main(*sys.argv[1:])
