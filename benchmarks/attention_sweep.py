"""Sweeps "triton" attention configs at the benchmark shapes (GPU).

Usage: python benchmarks/attention_sweep.py [OUT_DIR] [SHAPE_WORD] [fwd] [NAME=VALUE,...] [PARTS]
For each shape and causal flag: cuDNN (jax.nn) forward and forward+backward,
then every forward config of a short list, then every backward config with
the best forward config (unless "fwd" is given). SHAPE_WORD keeps the shapes
whose label contains it; NAME=VALUE sets constants of the triton module
(an experiment's switch) for the whole run. PARTS: the forward configs'
row_parts values to try, comma-separated (default 1; 2 only where
block_q >= 128). Prints times and writes
attention_sweep.json.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import common
from tokamax._src import benchmarking
from tokamax.ops.attention import triton as tr

ITERATIONS = 10
# (B, T, N, K, H)
SHAPES = {
    "seed B32 T2048 N16 H64": ((32, 2048, 16, 16, 64), (False, True)),
    "B8 T4096 N16 H128": ((8, 4096, 16, 16, 128), (False, True)),
    "GQA B4 T4096 N32 K8 H128": ((4, 4096, 32, 8, 128), (True,)),
}
FWD = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 4, 2),
       (128, 128, 8, 3), (64, 64, 4, 4), (128, 64, 4, 4), (64, 128, 4, 3),
       (128, 128, 8, 2), (128, 64, 8, 2), (128, 32, 4, 3),
       # fewer stages: less shared memory, more programs per SM
       (128, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 1), (128, 32, 4, 2),
       (64, 32, 4, 2), (256, 64, 8, 2)]
BWD = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (128, 32, 4, 3),
       (64, 64, 8, 2), (128, 64, 4, 2), (64, 128, 8, 2), (128, 128, 8, 2)]


def _time(f, specs, mode):
  f_std, flat = benchmarking.standardize_function(f, *specs, mode=mode)
  return benchmarking.benchmark(f_std, flat, iterations=ITERATIONS).median_evaluation_time_ms


def main(out_dir=".", shape_word="", only_fwd="", constants="", parts="1"):
  rows = []
  common.set_constants(tr, constants)

  def record(**r):
    rows.append(r)
    print(r, flush=True)

  for label, ((b, t, n, kh, h), causals) in SHAPES.items():
    if shape_word not in label:
      continue
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
    for causal in causals:
      flops = 4 * b * n * t * t * h / (2 if causal else 1)
      cud = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")
      c_f, c_fb = _time(cud, (q, kv, kv), "forward"), _time(cud, (q, kv, kv), "forward_and_vjp")
      record(shape=label, causal=causal, impl="cudnn", fwd_ms=c_f, fwdbwd_ms=c_fb,
             fwd_tflops=flops / c_f / 1e9, fwdbwd_tflops=3.5 * flops / c_fb / 1e9)
      best = None
      fwd = [(*c, p) for c in FWD for p in map(int, parts.split(","))
             if p == 1 or c[0] >= 128]
      for bq, bk, w, st, p in fwd:
        cfg = tr.TritonAttentionConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st,
                                       row_parts=p)
        op = tr.TritonDotProductAttention(config=cfg)
        try:
          ms = _time(lambda q, k, v: op(q, k, v, is_causal=causal), (q, kv, kv), "forward")
        except Exception as e:  # a config may not compile (smem, registers)
          record(shape=label, causal=causal, fwd=str(cfg), error=str(e)[:200])
          continue
        record(shape=label, causal=causal, fwd=(bq, bk, w, st, p), fwd_ms=ms,
               vs_cudnn=c_f / ms)
        if best is None or ms < best[1]:
          best = (cfg, ms)
      for bk, bq, w, st in ([] if only_fwd == "fwd" else BWD):
        vcfg = tr.TritonAttentionVjpConfig(block_k=bk, block_q=bq, dq_block_q=bk,
                                           dq_block_k=bq, num_warps=w, num_stages=st)
        op = tr.TritonDotProductAttention(
            config=best[0], vjp=tr.TritonDotProductAttentionVjp(config=vcfg))
        try:
          ms = _time(lambda q, k, v: op(q, k, v, is_causal=causal), (q, kv, kv),
                     "forward_and_vjp")
        except Exception as e:
          record(shape=label, causal=causal, bwd=str(vcfg), error=str(e)[:200])
          continue
        record(shape=label, causal=causal, bwd=(bk, bq, w, st), fwdbwd_ms=ms,
               vs_cudnn=c_fb / ms)
  common.save(out_dir, "attention_sweep", rows, iterations=ITERATIONS,
              constants=constants, parts=parts)


if __name__ == "__main__":
  main(*sys.argv[1:])
