"""Compiles the "mosaic" attention forward (and, with VJP set, its gradient)
on the GPU with Mosaic GPU's ptxas report switched on: registers, spills and
warnings such as C7513 (wgmma instructions serialised). Usage on the GPU
machine:
  [VJP=BLOCK_KV.BLOCK_Q.STAGES.DQ_BLOCK_Q.DQ_BLOCK_KV.DQ_STAGES] \
      python scripts/ptxas_report.py [B T N H [BLOCK_Q BLOCK_KV STAGES [CONSUMERS]]]
SET="NAME=VALUE,..." sets module constants of the mosaic attention module first
(e.g. SET=_PRODUCER_REGS=24)."""

import ast
import os
import sys

os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tokamax.ops.attention import mosaic as mo  # noqa: E402

for item in filter(None, os.environ.get("SET", "").split(",")):
  name, value = item.split("=")
  setattr(mo, name, ast.literal_eval(value))

b, t, n, h = map(int, sys.argv[1:5]) if len(sys.argv) > 4 else (1, 1024, 2, 64)
config = None
if len(sys.argv) > 7:
  bq, bk, stages = map(int, sys.argv[5:8])
  consumers = int(sys.argv[8]) if len(sys.argv) > 8 else 2
  config = mo.MosaicAttentionConfig(block_q=bq, block_kv=bk, num_stages=stages,
                                    consumers=consumers)
extra = {}
if os.environ.get("VJP"):  # also compile the gradient with this backward config
  vjp_config = mo.MosaicAttentionVjpConfig(*map(int, os.environ["VJP"].split(".")))
  extra["vjp"] = mo.MosaicDotProductAttentionVjp(config=vjp_config)
q = jnp.ones((b, t, n, h), jnp.bfloat16)
for causal in (False, True):
  print(f"===== B{b} T{t} N{n} H{h} causal={causal} {config} {extra} =====", flush=True)
  op = mo.MosaicDotProductAttention(config=config, **extra)
  f = lambda q: op(q, q, q, is_causal=causal)
  if extra:
    f = jax.grad(lambda q: jnp.sum(op(q, q, q, is_causal=causal).astype(jnp.float32)))
  jax.jit(f).lower(q).compile()
