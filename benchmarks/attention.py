"""Attention benchmark: tokamax implementations against jax.nn and a matmul.

Usage: python benchmarks/attention.py [OUT_DIR] [ONLY] [SHAPES]
Prints a markdown table and writes attention.json to OUT_DIR (default: .).
ONLY (comma-separated) keeps the implementations whose label contains one of
its words, e.g. "triton,jax.nn" (the matmul peers always run); SHAPES
(comma-separated) keeps the shapes whose label contains one of its words.
Times are accelerator time (cupti on GPU, wallclock elsewhere), median of
ITERATIONS runs, bf16 random inputs; FLOPs by the FlashAttention convention:
4*B*N*T*S*H forward, 2.5x that backward, half of both when causal.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import common
import tokamax
from tokamax._src import benchmarking
from tokamax.ops.attention import xla_chunked

ITERATIONS = 20
# label: ((B, T, N, K, H), causal flags, with the slow XLA variants)
SHAPES = {
    "seed B32 T2048 N16 H64": ((32, 2048, 16, 16, 64), (False, True), True),
    "B8 T4096 N16 H128": ((8, 4096, 16, 16, 128), (False, True), False),
    "GQA B4 T4096 N32 K8 H128": ((4, 4096, 32, 8, 128), (True,), False),
}
CHUNK_CONFIGS = [(2048, 512), (2048, 1024), (1024, 1024)]


def _candidates(slow_xla):
  # cuDNN right after "mosaic" and before the slow XLA runs, so the pair is
  # timed side by side (cuDNN's own H128 forward+backward reads 6.3-7.2 ms
  # between processes on the H200; docs/benchmarks.md, 2026-12-02).
  yield "tokamax mosaic (shipped cache)", lambda **kw: tokamax.dot_product_attention(
      **kw, implementation="mosaic")
  yield "jax.nn cudnn", lambda **kw: jax.nn.dot_product_attention(
      **kw, implementation="cudnn")
  yield "tokamax triton (heuristic)", lambda **kw: tokamax.dot_product_attention(
      **kw, implementation="triton")
  if slow_xla:
    yield "tokamax xla", lambda **kw: tokamax.dot_product_attention(
        **kw, implementation="xla")
    yield "tokamax xla_chunked (heuristic)", lambda **kw: tokamax.dot_product_attention(
        **kw, implementation="xla_chunked")
    for tq, sk in CHUNK_CONFIGS:
      op = xla_chunked.ChunkedDotProductAttention(
          config=xla_chunked.ChunkedAttentionConfig(q_chunk_size=tq, kv_chunk_size=sk))
      yield f"tokamax xla_chunked q{tq} kv{sk}", lambda op=op, **kw: op(**kw)
  yield "tokamax cudnn", lambda **kw: tokamax.dot_product_attention(
      **kw, implementation="cudnn")
  yield "jax.nn xla", lambda **kw: jax.nn.dot_product_attention(
      **kw, implementation="xla")


def _time(f, args, mode):
  f_std, flat = benchmarking.standardize_function(f, *args, mode=mode)
  return benchmarking.benchmark(f_std, flat, iterations=ITERATIONS)


def main(out_dir=".", only="", shapes=""):
  rows = []
  words = [w for w in only.split(",") if w]
  for label, (shape, causals, slow_xla) in SHAPES.items():
    if not common.selected(label, shapes):
      continue
    b, t, n, kh, h = shape
    spec = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    kv_spec = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
    for causal in causals:
      for mode in ("forward", "forward_and_vjp"):
        for name, fn in _candidates(slow_xla):
          if words and not any(w in name for w in words):
            continue
          f = lambda q, k, v, fn=fn: fn(query=q, key=k, value=v, is_causal=causal)
          try:
            data = _time(f, (spec, kv_spec, kv_spec), mode)
            ms = data.median_evaluation_time_ms
            tflops = common.attention_flops(shape, causal, mode) / ms / 1e9
            rows.append(dict(shape=label, causal=causal, mode=mode, impl=name,
                             ms=ms, tflops=tflops, method=data.method))
          except Exception as e:  # record and go on: a peer may not support it
            rows.append(dict(shape=label, causal=causal, mode=mode, impl=name,
                             error=f"{type(e).__name__}: {str(e)[:200]}"))
          print(_fmt(rows[-1]), flush=True)
    peers = [(label, "dense matmul q@k^T (same size)", common.qk_matmul(b, n, t, h))]
    if label == list(SHAPES)[-1]:
      peers.append(("8192^3", "dense matmul 8192^3", common.dense_matmul()))
    for shape_label, name, (fn, specs, flops) in peers:
      try:  # record a failure and go on (its 4 GiB output once ran an H100 out of memory)
        data = _time(fn, specs, "forward")
        ms = data.median_evaluation_time_ms
        rows.append(dict(shape=shape_label, causal=False, mode="forward", impl=name,
                         ms=ms, tflops=flops / ms / 1e9, method=data.method))
      except Exception as e:
        rows.append(dict(shape=shape_label, causal=False, mode="forward", impl=name,
                         error=f"{type(e).__name__}: {str(e)[:200]}"))
      print(_fmt(rows[-1]), flush=True)
  for r in rows:  # throughput relative to cuDNN (jax.nn) in the same run
    peer = [p for p in rows if p["impl"] == "jax.nn cudnn" and "ms" in p
            and (p["shape"], p["causal"], p["mode"]) == (r["shape"], r["causal"], r["mode"])]
    if peer and "ms" in r and not r["impl"].startswith("dense"):
      r["vs_cudnn"] = peer[0]["ms"] / r["ms"]
  meta = common.save(out_dir, "attention", rows, iterations=ITERATIONS)
  print(f"\n{meta}")
  print(markdown(rows))


def _fmt(r):
  if "error" in r:
    return f"{r['shape']} causal={r['causal']} {r['mode']:16s} {r['impl']:34s} {r['error']}"
  return (f"{r['shape']} causal={r['causal']} {r['mode']:16s} {r['impl']:34s}"
          f" {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s")


def markdown(rows):
  return common.markdown(rows, [
      ("shape", "shape", ""), ("causal", "causal", ""), ("mode", "mode", ""),
      ("implementation", "impl", ""), ("median ms", "ms", ".3f"),
      ("TFLOP/s", "tflops", ".1f"), ("x cuDNN", "vs_cudnn", ".2f")])


if __name__ == "__main__":
  main(*sys.argv[1:])
