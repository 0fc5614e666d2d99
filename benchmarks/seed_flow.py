"""Seed-flow numbers for docs: autotune wall time, cupti vs wallclock.

Usage: python benchmarks/seed_flow.py [OUT_DIR]; writes seed_flow.json.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp

import common
import tokamax

demo = common.load_demo()


def main(out_dir="."):
  on_gpu = jax.default_backend() == "gpu"
  x, scale = common.seed_inputs(demo)
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
  meta = common.save(out_dir, "seed_flow", rows, shape=list(x.shape))
  text = json.dumps(dict(meta=meta, rows=rows), indent=1)
  print(text)


if __name__ == "__main__":
  main(*sys.argv[1:])
