"""Sweeps "mosaic" attention backward configs at the benchmark shapes (GPU).

Usage: python benchmarks/attention_mosaic_vjp_sweep.py [OUT_DIR] [SHAPES] [CONFIGS]
For each shape and causal flag: cuDNN (jax.nn) forward+backward, the Mosaic
forward (its heuristic/shipped config) with the "triton" backward, and with
the Mosaic backward under each config of CONFIGS in its search space.
Prints times and writes attention_mosaic_vjp_sweep.json. VJP_CONFIGS=heuristic
times only the heuristic backward config (the default of a plain call).
SHAPES: comma-separated words matched against the shape labels ("" = all);
CONFIGS: "64.128.3.64.128.3,64.64.2.64.64.2.3" (MosaicAttentionVjpConfig's
fields in order; the last, dq_consumers, may be left out), timed whether or
not in the search space.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

import common
from attention_mosaic_sweep import ITERATIONS, SHAPES, _time
from tokamax.ops.attention import mosaic as mo
from tokamax.ops.attention import triton as tr

# (block_kv, block_q, num_stages, dq_block_q, dq_block_kv, dq_num_stages)
CONFIGS = [(64, 64, 2, 64, 64, 2), (64, 128, 2, 64, 128, 2), (64, 64, 2, 64, 128, 2),
           (64, 128, 2, 64, 64, 2), (64, 64, 3, 64, 64, 3)]


def main(out_dir=".", words="", explicit=""):
  rows = []

  def record(**r):
    rows.append(r)
    print(r, flush=True)

  for label, ((b, t, n, kh, h), causals) in SHAPES.items():
    if not common.selected(label, words):
      continue
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
    for causal in causals:
      flops = 3.5 * 4 * b * n * t * t * h / (2 if causal else 1)

      def run(name, f):
        try:
          ms = _time(f, (q, kv, kv), "forward_and_vjp")
        except Exception as e:  # a config may not compile (registers)
          record(shape=label, causal=causal, impl=name, error=str(e)[:300])
          return None
        record(shape=label, causal=causal, impl=name, fwdbwd_ms=ms,
               fwdbwd_tflops=flops / ms / 1e9)
        return ms

      c_ms = run("jax.nn cudnn", lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn"))
      op = mo.MosaicDotProductAttention(vjp=tr.TritonDotProductAttentionVjp())
      if not explicit:
        run("mosaic fwd + triton bwd", lambda q, k, v: op(q, k, v, is_causal=causal))
      space = mo.vjp_search_space(t, t, h, h, 2, causal, b * kh)
      configs = CONFIGS
      if os.environ.get("VJP_CONFIGS") == "heuristic":
        c = mo.vjp_heuristic_config(t, t, h, h, 2, causal, b * kh)
        configs = [(c.block_kv, c.block_q, c.num_stages, c.dq_block_q, c.dq_block_kv,
                    c.dq_num_stages, c.dq_consumers)]
      if explicit:
        configs = [tuple(map(int, c.split("."))) for c in explicit.split(",")]
      for c in configs:
        cfg = mo.MosaicAttentionVjpConfig(*c)
        # The search space's member with these tile fields (dq persistent or not).
        cfg = next((x for x in space if dataclasses.replace(
            x, dq_persistent=False, dkdv_persistent=False) == cfg), cfg)
        if cfg not in space and not explicit:
          continue
        op = mo.MosaicDotProductAttention(vjp=mo.MosaicDotProductAttentionVjp(config=cfg))
        ms = run(f"mosaic fwd + mosaic bwd {c}", lambda q, k, v: op(q, k, v, is_causal=causal))
        if ms is not None and c_ms is not None:
          rows[-1]["vs_cudnn"] = c_ms / ms
          print(f"  vs cudnn {c_ms / ms:.3f}", flush=True)
  common.save(out_dir, "attention_mosaic_vjp_sweep", rows, iterations=ITERATIONS)


if __name__ == "__main__":
  main(*sys.argv[1:])
