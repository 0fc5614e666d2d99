"""Compiles the "mosaic" attention forward on the GPU with Mosaic GPU's
ptxas report switched on: registers, spills and warnings such as C7513
(wgmma instructions serialised). Usage on the GPU machine:
  python scripts/ptxas_report.py [B T N H [BLOCK_Q BLOCK_KV STAGES [CONSUMERS]]] > report.txt"""

import os
import sys

os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tokamax.ops.attention import mosaic as mo  # noqa: E402

b, t, n, h = map(int, sys.argv[1:5]) if len(sys.argv) > 4 else (1, 1024, 2, 64)
config = None
if len(sys.argv) > 7:
  bq, bk, stages = map(int, sys.argv[5:8])
  consumers = int(sys.argv[8]) if len(sys.argv) > 8 else 2
  config = mo.MosaicAttentionConfig(block_q=bq, block_kv=bk, num_stages=stages,
                                    consumers=consumers)
q = jnp.ones((b, t, n, h), jnp.bfloat16)
for causal in (False, True):
  print(f"===== B{b} T{t} N{n} H{h} causal={causal} {config} =====", flush=True)
  op = mo.MosaicDotProductAttention(config=config)
  jax.jit(lambda q: op(q, q, q, is_causal=causal)).lower(q).compile()
