"""Forward accuracy of the attention implementations at the benchmark shapes.

Usage: python benchmarks/attention_accuracy.py [OUT_DIR] [SHAPES]
For each shape (bf16 random inputs, fixed keys), every implementation's
output against an f32 XLA reference (jax.nn, inputs upcast): the largest
absolute error over the largest |reference| ("max"), the mean absolute error
over the mean |reference| ("mean"), and where the largest error is. The
"mosaic" rows include the kernel with its compile-time switches
(LAZY_RESCALE, SUM_UNDER_PV) off, and with lazy rescaling at smaller
thresholds (_RESCALE_TAU), to see what each costs in accuracy.
Writes attention_accuracy.json.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import common
import tokamax
from tokamax.ops.attention import mosaic as mo

SHAPES = {  # label: ((B, T, N, K, H), causal flags)
    "seed B32 T2048 N16 H64": ((32, 2048, 16, 16, 64), (False,)),
    "B8 T4096 N16 H128": ((8, 4096, 16, 16, 128), (False, True)),
}
SWITCHES = {  # label: mosaic module constants
    "mosaic": {},
    "mosaic LAZY_RESCALE=False": {"LAZY_RESCALE": False},
    "mosaic SUM_UNDER_PV=False": {"SUM_UNDER_PV": False},
    "mosaic both off": {"LAZY_RESCALE": False, "SUM_UNDER_PV": False},
    "mosaic _RESCALE_TAU=4.0": {"_RESCALE_TAU": 4.0},
    "mosaic _RESCALE_TAU=2.0": {"_RESCALE_TAU": 2.0},
    "mosaic _RESCALE_TAU=1.0": {"_RESCALE_TAU": 1.0},
    "mosaic _RESCALE_TAU=0.0": {"_RESCALE_TAU": 0.0},
}


def _errors(out, ref):
  err = jnp.abs(out.astype(jnp.float32) - ref)
  where = np.unravel_index(int(jnp.argmax(err)), err.shape)
  return dict(max=float(err.max() / jnp.abs(ref).max()),
              mean=float(err.mean() / jnp.abs(ref).mean()),
              at=[int(i) for i in where], ref_at=float(ref[where]),
              out_at=float(out[where].astype(jnp.float32)))


def main(out_dir=".", words=""):
  rows = []
  for label, ((b, t, n, kh, h), causals) in SHAPES.items():
    if not common.selected(label, words):
      continue
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kh, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kh, h), jnp.bfloat16)
    for causal in causals:
      ref = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
          is_causal=causal, implementation="xla"))(q, k, v)
      impls = {"jax.nn cudnn": lambda q, k, v: jax.nn.dot_product_attention(
                   q, k, v, is_causal=causal, implementation="cudnn"),
               "tokamax triton": lambda q, k, v: tokamax.dot_product_attention(
                   q, k, v, is_causal=causal, implementation="triton")}
      for name, fn in impls.items():
        rows.append(dict(shape=label, causal=causal, impl=name,
                         **_errors(jax.jit(fn)(q, k, v), ref)))
        print(rows[-1], flush=True)
      for name, switches in SWITCHES.items():
        previous = common.set_constants(
            mo, ",".join(f"{key}={value}" for key, value in switches.items()))
        try:  # a fresh lambda: traced again with the switches set
          out = jax.jit(lambda q, k, v: tokamax.dot_product_attention(
              q, k, v, is_causal=causal, implementation="mosaic"))(q, k, v)
          rows.append(dict(shape=label, causal=causal, impl=name, **_errors(out, ref)))
        finally:
          for key, value in previous.items():
            setattr(mo, key, value)
        print(rows[-1], flush=True)
  common.save(out_dir, "attention_accuracy", rows)
  print(common.markdown(rows, [
      ("shape", "shape", ""), ("causal", "causal", ""), ("implementation", "impl", ""),
      ("max err / max |ref|", "max", ".2e"), ("mean err / mean |ref|", "mean", ".2e"),
      ("at", "at", ""), ("ref there", "ref_at", ".4f"), ("out there", "out_at", ".4f")]))


if __name__ == "__main__":
  main(*sys.argv[1:])
