"""Runs one attention call a few times, for a profiler (Nsight Compute) to catch.

Usage: python benchmarks/profile_attention.py IMPL SHAPE CAUSAL MODE
  IMPL: triton | mosaic | cudnn | xla; SHAPE: seed | h128 | gqa;
  CAUSAL: 0 | 1; MODE: forward | forward_and_vjp.
Used by `scripts/gpu_check.sh ncu`, which profiles the third launch of the
attention kernels under `ncu --set full` (the first two are warm-ups).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import tokamax
from tokamax._src import benchmarking

SHAPES = {  # (B, T, N, K, H)
    "seed": (32, 2048, 16, 16, 64),
    "h128": (8, 4096, 16, 16, 128),
    "gqa": (4, 4096, 32, 8, 128),
}
CALLS = 3


def main(impl: str, shape: str, causal: str, mode: str):
  b, t, n, kh, h = SHAPES[shape]
  is_causal = bool(int(causal))
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
  if impl in ("cudnn", "xla"):
    fn = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=is_causal, implementation=impl)
  else:
    fn = lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=is_causal, implementation=impl)
  f_std, args = benchmarking.standardize_function(fn, q, kv, kv, mode=mode)
  f_jit = jax.jit(f_std)
  for _ in range(CALLS):
    jax.block_until_ready(f_jit(*args))
  print(f"profiled {impl} {shape} causal={is_causal} {mode}: {CALLS} calls")


if __name__ == "__main__":
  main(*sys.argv[1:])
