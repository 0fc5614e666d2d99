"""A/B of "mosaic" attention forward configs, alternated (GPU).

Usage: python benchmarks/attention_mosaic_config_ab.py [OUT_DIR] [CONFIGS] [SHAPES] [ROUNDS]
CONFIGS: comma-separated "block_q.block_kv.num_stages.consumers", with
".1" appended for a persistent forward (default "64.128.2.2,64.192.2.2"); SHAPES: comma-separated words matched against the
shape labels ("" = all); ROUNDS (default 2). For each shape and causal flag:
cuDNN's forward (jax.nn), then every config's forward, the configs timed in
turn ROUNDS times (cupti, median of 20 each), bf16 random inputs, each
output checked against cuDNN's. Writes attention_mosaic_config_ab.json.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import common
from attention_mosaic_flag_ab import SHAPES
from tokamax.ops.attention import mosaic as mo


def _name(c: mo.MosaicAttentionConfig) -> str:
  return f"{c.block_q}.{c.block_kv}.{c.num_stages}.{c.consumers}" + (
      ".1" if c.persistent else "")


def main(out_dir=".", configs="64.128.2.2,64.192.2.2", words="", rounds="2"):
  cfgs = [mo.MosaicAttentionConfig(*map(int, c.split("."))) for c in configs.split(",")]
  rows = []
  for label, ((b, t, n, kh, h), causals) in SHAPES.items():
    if not common.selected(label, words):
      continue
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
    keys = jax.random.split(jax.random.key(0), 3)
    arrays = [jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, (q, kv, kv))]
    for causal in causals:
      flops = common.attention_flops((b, t, n, kh, h), causal, "forward")
      cud = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")
      ref = np.asarray(jax.jit(cud)(*arrays), np.float32)
      row = dict(shape=label, causal=causal, cudnn_ms=common.median_ms(cud, (q, kv, kv)))
      fns = {_name(c): functools.partial(mo.MosaicDotProductAttention(config=c),
                                         is_causal=causal) for c in cfgs}
      for name, f in fns.items():
        out = np.asarray(jax.jit(f)(*arrays), np.float32)
        row[f"{name}_max_err"] = float(np.max(np.abs(out - ref)))
      for rep in range(int(rounds)):
        for name, f in fns.items():
          row[f"{name}_ms_{rep}"] = common.median_ms(f, (q, kv, kv))
      row["tflops_per_ms"] = flops / 1e9
      rows.append(row)
      print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
  common.save(out_dir, "attention_mosaic_config_ab", rows)


if __name__ == "__main__":
  main(*sys.argv[1:])
