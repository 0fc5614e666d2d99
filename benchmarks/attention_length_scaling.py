"""Attention throughput against sequence length at a fixed B*T (GPU).

Usage: [BATCH=B] python benchmarks/attention_length_scaling.py [OUT_DIR] [ROUNDS] [H] [LENGTHS] [MODE] [N] [K]
At B*T = 65536 tokens (or batch B at every T with BATCH), N query heads (default 16) and K key/value heads
(default N; K < N is GQA), head dim H (default 64), for each T of
LENGTHS (comma-separated, default 1024,2048,4096,8192,16384), causal and
not: "mosaic" (shipped cache or heuristic) and cuDNN (jax.nn), MODE
"forward" (default) or "forward_and_vjp" (the gradient of q, k and v too), each
compiled once and timed in ROUNDS alternating rounds (default 3) of 20
calls (cupti), fresh random bf16 inputs per round. The FLOPs of a T grow
with T at a fixed token count, while the per-query-tile costs (prologue,
epilogue, pipeline fill) stay per tile, so a kernel with a large per-tile
cost gains more throughput with T than one without. Prints median TFLOP/s
per kernel and the ratio, and a least-squares fit of "mosaic"'s non-causal
times as SMs x time = tiles x (cost per tile) + rounds x (cost per round)
(a tile: consumers x block_q query rows of the heuristic config, a round:
one block_kv key step of all its consumers; forward only); writes
attention_length_scaling.json (forward) or
attention_length_scaling_forward_and_vjp.json.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import common
import tokamax
from tokamax.ops.attention import mosaic as mosaic_attn

TOKENS = 65536
HEADS = 16


def main(out_dir=".", rounds="3", head_dim="64", lengths="1024,2048,4096,8192,16384",
         mode="forward", heads=str(HEADS), kv_heads=None):
  rounds, h, n = int(rounds), int(head_dim), int(heads)
  kh = n if kv_heads is None else int(kv_heads)
  impls = {
      "mosaic": lambda **kw: tokamax.dot_product_attention(**kw, implementation="mosaic"),
      "cudnn": lambda **kw: jax.nn.dot_product_attention(**kw, implementation="cudnn"),
  }
  rows = []
  for t in (int(x) for x in lengths.split(",")):
    b = int(os.environ.get("BATCH", 0)) or TOKENS // t
    for causal in (False, True):
      shapes = [(b, t, n, h), (b, t, kh, h), (b, t, kh, h)]
      compiled = {
          name: jax.jit(lambda q, k, v, fn=fn: fn(query=q, key=k, value=v, is_causal=causal))
          for name, fn in impls.items()}
      times = {name: [] for name in impls}
      for r in range(rounds):
        keys = jax.random.split(jax.random.key(r), 3)
        args = [jax.random.normal(key, sh, jnp.bfloat16) for key, sh in zip(keys, shapes)]
        for name, f in compiled.items():
          times[name].append(common.median_ms(f, args, mode))
      flops = common.attention_flops((b, t, n, kh, h), causal, mode)
      row = dict(b=b, t=t, n=n, k=kh, h=h, causal=causal, mode=mode)
      for name, ts in times.items():
        ms = statistics.median(ts)
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / ms / 1e9
      row["mosaic_x_cudnn"] = row["cudnn_ms"] / row["mosaic_ms"]
      rows.append(row)
      print(f"B{b} T{t} N{n} K{kh} H{h} causal={causal}: mosaic {row['mosaic_tflops']:.1f} "
            f"cudnn {row['cudnn_tflops']:.1f} TFLOP/s, x{row['mosaic_x_cudnn']:.3f}",
            flush=True)
  meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind,
              jax=jax.__version__, rounds=rounds, mode=mode,
              fit_us=_fit(rows, h) if mode == "forward" else None)
  print("mosaic per tile / per round (us):", meta["fit_us"])
  suffix = "" if mode == "forward" else f"_{mode}"
  path = pathlib.Path(out_dir) / f"attention_length_scaling{suffix}.json"
  path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


def _fit(rows, h):
  """(us per tile, us per round) of "mosaic"'s non-causal rows (module
  docstring), or None with fewer than two lengths."""
  sms = getattr(jax.devices()[0], "core_count", 132)
  counts, times = [], []
  for r in rows:
    if r["causal"]:
      continue
    c = mosaic_attn.heuristic_config(r["t"], r["t"], h, h, 2, grid=r["b"] * r["n"])
    tiles = r["b"] * r["n"] * -(-r["t"] // (c.consumers * c.block_q))
    counts.append((tiles, tiles * -(-r["t"] // c.block_kv)))
    times.append(r["mosaic_ms"] * 1e3 * sms)
  if len(times) < 2:
    return None
  fit, *_ = np.linalg.lstsq(np.array(counts, float), np.array(times), rcond=None)
  return [round(float(x), 3) for x in fit]


if __name__ == "__main__":
  main(*sys.argv[1:])
