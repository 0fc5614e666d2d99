"""Runs one layer_norm forward a few times, for a profiler (Nsight Compute) to catch.

Usage: python benchmarks/profile_layer_norm.py IMPL RxF [NAME=VALUE,...]
  IMPL: mosaic | triton | xla; x bf16 [R, F] from random normals, f32
  scale and offset; NAME=VALUE sets constants of the implementation's
  module (tokamax.ops.normalization.IMPL) first; lower-case names
  (mosaic only) replace fields of the heuristic config, e.g. stages=4.
The kernels are named tokamax_layer_norm_*; profile the third launch (the
first two are warm-ups), e.g.
  ncu --clock-control none --set full -k regex:tokamax_layer_norm
      --launch-skip 2 --launch-count 1 -o OUT python3 benchmarks/profile_layer_norm.py mosaic 8192x8192
"""

from __future__ import annotations

import dataclasses
import importlib
import sys

import jax
import jax.numpy as jnp

import common
import tokamax

CALLS = 3


def main(impl: str, shape: str, constants: str = ""):
  module = importlib.import_module(f"tokamax.ops.normalization.{impl}")
  pairs = [a for a in constants.split(",") if a]
  fields = dict(a.split("=") for a in pairs if a[0].islower())
  if fields and impl != "mosaic":
    raise ValueError(f"config fields {sorted(fields)} apply to IMPL mosaic only, not {impl}")
  common.set_constants(module, ",".join(a for a in pairs if not a[0].islower()))
  r, f = (int(d) for d in shape.split("x"))
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (r, f), jnp.bfloat16)
  s, o = (jax.random.normal(k, (f,), jnp.float32) for k in keys[1:])
  if fields:
    config = dataclasses.replace(module.heuristic_config(r, f, 2),
                                 **{k: int(v) for k, v in fields.items()})
    fn = jax.jit(module.MosaicLayerNorm(config=config))
  else:
    fn = jax.jit(lambda x, s, o: tokamax.layer_norm(x, s, o, implementation=impl))
  for _ in range(CALLS):
    jax.block_until_ready(fn(x, s, o))
  print(f"profiled {impl} {shape} {constants}: {CALLS} calls")


if __name__ == "__main__":
  main(*sys.argv[1:])
