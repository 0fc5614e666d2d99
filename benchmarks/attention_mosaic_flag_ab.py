"""A/B of a compile-time switch of the "mosaic" (or "triton") attention module (GPU).

Usage: python benchmarks/attention_mosaic_flag_ab.py [OUT_DIR] [FLAG] [A,B] [MODES] [SHAPES] [CAUSAL]
FLAG is a module-level constant of tokamax.ops.attention.mosaic (default
SUM_UNDER_PV), or "triton.NAME" for one of tokamax.ops.attention.triton, or
several of one module, comma-separated; A,B two Python literals for it
(default False,True), tuples for several flags (e.g. FLAG
"_PRODUCER_REGS,FUSE_DKDV_MAX_WIDTH" with "(40,128),(24,256)"), MODES "forward" or
"forward,forward_and_vjp" (default), SHAPES comma-separated words matched
against the shape labels (default all), CAUSAL "causal" or "noncausal" to
run only those cases (default both). At the benchmark shapes: cuDNN
(jax.nn), then that module's implementation with FLAG = A, B, A, B (cupti,
median of 20 each), bf16 random inputs. Writes attention_mosaic_flag_ab.json.
"""

from __future__ import annotations

import ast
import sys

import jax
import jax.numpy as jnp

import common
from tokamax._src import benchmarking
from tokamax.ops.attention import mosaic as mo
from tokamax.ops.attention import triton as tr
import tokamax

SHAPES = {  # label: ((B, T, N, K, H), causal flags)
    "seed B32 T2048 N16 H64": ((32, 2048, 16, 16, 64), (False, True)),
    "B8 T4096 N16 H128": ((8, 4096, 16, 16, 128), (False, True)),
    "GQA B4 T4096 N32 K8 H128": ((4, 4096, 32, 8, 128), (True,)),
    # A small grid (32768 rows), where cuDNN wins non-causal (2026-12-07).
    "small B1 T4096 N8 H64": ((1, 4096, 8, 8, 64), (False, True)),
    # More small grids for the forward's last wave (query tiles of
    # consumers x 64 rows against 132 CTAs): 16384 to 131072 rows.
    "small B1 T2048 N8 H64": ((1, 2048, 8, 8, 64), (False, True)),
    # Causal grids of one round (<= 132 query tiles of 128 rows), where the
    # longest (last) tile sets the time.
    "small B1 T1024 N16 H64": ((1, 1024, 16, 16, 64), (True,)),
    "small B1 T4096 N16 H64": ((1, 4096, 16, 16, 64), (False, True)),
    "small B1 T8192 N8 H64": ((1, 8192, 8, 8, 64), (False,)),
    "small B2 T4096 N16 H64": ((2, 4096, 16, 16, 64), (False,)),
}


def _time(f, specs, mode):
  f_std, flat = benchmarking.standardize_function(f, *specs, mode=mode)
  return benchmarking.benchmark(f_std, flat, iterations=20).median_evaluation_time_ms


def main(out_dir=".", flag="SUM_UNDER_PV", values="False,True",
         modes="forward,forward_and_vjp", words="", causal_only=""):
  a, b = ast.literal_eval(f"[{values}]")
  rows = []
  impl, module = "mosaic", mo
  if flag.startswith("triton."):
    impl, module = "triton", tr
  names = [f.removeprefix("triton.") for f in flag.split(",")]
  if len(names) == 1:
    a, b = (a,), (b,)
  default = tuple(getattr(module, n) for n in names)

  def set_flags(values):
    for n, v in zip(names, values):
      setattr(module, n, v)
  for label, ((batch, t, n, kh, h), causals) in SHAPES.items():
    if not common.selected(label, words):
      continue
    q = jax.ShapeDtypeStruct((batch, t, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, t, kh, h), jnp.bfloat16)
    for causal in causals:
      if causal_only and causal != (causal_only == "causal"):
        continue
      row = dict(shape=label, causal=causal)
      cud = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")
      for mode in modes.split(","):
        row[f"cudnn_{mode}_ms"] = _time(cud, (q, kv, kv), mode)
        for rep, value in enumerate((a, b, a, b)):
          set_flags(value)
          f = lambda q, k, v: tokamax.dot_product_attention(
              q, k, v, is_causal=causal, implementation=impl)
          key = ",".join(f"{n}={v}" for n, v in zip(names, value))
          row[f"{key}_{mode}_ms_{rep // 2}"] = _time(f, (q, kv, kv), mode)
        set_flags(default)
      rows.append(row)
      print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
  common.save(out_dir, "attention_mosaic_flag_ab", rows)


if __name__ == "__main__":
  main(*sys.argv[1:])
