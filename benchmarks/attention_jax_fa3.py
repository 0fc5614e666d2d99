"""JAX's own FA3 example (attention_mgpu) forward vs jax.nn cuDNN, f16 (GPU).

Usage: python benchmarks/attention_jax_fa3.py. A reference point for "mosaic".
"""
import functools, sys
import jax, jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention_mgpu as am
from tokamax._src import benchmarking

def t(f, args):
  fs, flat = benchmarking.standardize_function(f, *args, mode="forward")
  return benchmarking.benchmark(fs, flat, iterations=20).median_evaluation_time_ms

for (b, T, n, kh, h) in [(32, 2048, 16, 16, 64), (8, 4096, 16, 16, 128), (4, 4096, 32, 8, 128)]:
  for causal in (False, True):
    q = jax.ShapeDtypeStruct((b, T, n, h), jnp.float16)
    kv = jax.ShapeDtypeStruct((b, T, kh, h), jnp.float16)
    fl = 4 * b * n * T * T * h / (2 if causal else 1)
    ms = t(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"), (q, kv, kv))
    print(f"{(b,T,n,kh,h)} causal={causal} cudnn {ms:.3f} ms {fl/ms/1e9:.0f} TF", flush=True)
    for bq, bkv, st in [(64, 128, 2), (64, 64, 2), (64, 128, 3), (64, 64, 3), (128, 64, 2), (128,128,2)]:
      cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=st, causal=causal)
      try:
        ms = t(lambda q, k, v: am.attention(q, k, v, cfg), (q, kv, kv))
        print(f"   mgpu bq{bq} bkv{bkv} st{st}: {ms:.3f} ms {fl/ms/1e9:.0f} TF", flush=True)
      except Exception as e:
        print(f"   mgpu bq{bq} bkv{bkv} st{st}: {type(e).__name__} {str(e)[:150]}", flush=True)
