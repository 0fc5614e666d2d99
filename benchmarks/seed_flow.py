"""Seed-flow numbers for docs: autotune wall time, cupti vs wallclock.

Usage: python benchmarks/seed_flow.py [OUT_DIR]; writes seed_flow.json.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

import tokamax

_DEMO = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "demo.py"
_spec = importlib.util.spec_from_file_location("demo", _DEMO)
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)


def main(out_dir="."):
  on_gpu = jax.default_backend() == "gpu"
  channels, seq_len, batch, heads = demo.SEED_SHAPE if on_gpu else demo.SMALL_SHAPE
  scale = jax.random.normal(jax.random.key(0), (channels,), jnp.float32)
  x = jax.random.normal(jax.random.key(1), (batch, seq_len, heads, channels), jnp.bfloat16)
  impls = demo.runnable_implementations(x, scale, log=lambda *_: None)
  loss = demo.make_loss(impls)
  f_grad = jax.jit(jax.grad(loss))
  rows = {"implementations": list(impls)}
  for name, f in (("loss", loss), ("f_grad", f_grad)):
    start = time.perf_counter()
    result = tokamax.autotune(f, x, scale, progress_bar=False)
    rows[f"autotune_{name}_s"] = time.perf_counter() - start
    rows[f"autotune_{name}_ops"] = [
        dict(op=e.op, config=repr(e.config), configs_tried=len(e.measurements),
             best_ms=e.measurements[0].median_ms) for e in result.entries]
  f_std, args = tokamax.benchmarking.standardize_function(
      f_grad, kwargs={"x": x, "scale": scale})
  run = tokamax.benchmarking.compile_benchmark(f_std, args)
  methods = ["cupti", "wallclock"] if on_gpu else ["wallclock"]
  for method in methods:
    for iterations in (5, 10, 50):
      data = run(args, method=method, iterations=iterations)
      rows[f"f_grad_{method}_{iterations}_median_ms"] = data.median_evaluation_time_ms
  rows["f_grad_compile_ms"] = data.compile_time_ms
  rows["f_grad_lowering_ms"] = data.lowering_time_ms
  rows["peak_memory_bytes"] = data.peak_memory_bytes
  meta = dict(date=datetime.date.today().isoformat(),
              device=jax.devices()[0].device_kind, jax=jax.__version__,
              shape=[batch, seq_len, heads, channels])
  text = json.dumps(dict(meta=meta, rows=rows), indent=1)
  (pathlib.Path(out_dir) / "seed_flow.json").write_text(text)
  print(text)


if __name__ == "__main__":
  main(*sys.argv[1:])
