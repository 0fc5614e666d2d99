"""Is the seed f_grad deterministic, and is its export round trip identical?

Usage: python benchmarks/export_determinism.py  (run once with default
XLA_FLAGS and once with XLA_FLAGS=--xla_gpu_deterministic_ops=true).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import export

import common
import tokamax

demo = common.load_demo()


def main():
  x, scale = common.seed_inputs(demo)
  impls = demo.runnable_implementations(x, scale, log=lambda *_: None)
  f_grad = jax.jit(jax.grad(demo.make_loss(impls)))
  a, b = f_grad(x, scale), f_grad(x, scale)
  exported = export.export(f_grad, disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(
      jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(scale.shape, scale.dtype))
  c = export.deserialize(exported.serialize()).call(x, scale)
  diff = float(jnp.max(jnp.abs(c.astype(jnp.float32) - a.astype(jnp.float32))))
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} implementations={impls}:"
        f" f_grad run to run identical: {bool(jnp.array_equal(a, b))};"
        f" exported identical: {bool(jnp.array_equal(a, c))}; max |diff| {diff:.3g}")


if __name__ == "__main__":
  main()
