"""The seed flow of SEED_USAGE.md, end to end.

On an NVIDIA GPU it runs exactly as written (seed shape). Elsewhere it uses a
smaller shape. An implementation the machine cannot run is replaced by
`implementation=None` (automatic choice), and the demo prints which and why.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

import tokamax

SEED_IMPLEMENTATIONS = ("triton", "xla_chunked", None, "mosaic")
SEED_SHAPE = (64, 2048, 32, 16)  # channels, seq_len, batch_size, num_heads
SMALL_SHAPE = (64, 128, 2, 4)


def make_loss(implementations):
  ln1, at1, ln2, at2 = implementations

  def loss(x, scale):
    x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=ln1)
    x = tokamax.dot_product_attention(x, x, x, implementation=at1)
    x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=ln2)
    x = tokamax.dot_product_attention(x, x, x, implementation=at2)
    return jnp.sum(x)

  return loss


def _single_op(index, implementation):
  if index % 2 == 0:
    return lambda x, s: tokamax.layer_norm(
        x, scale=s, offset=None, implementation=implementation
    )
  return lambda x, s: tokamax.dot_product_attention(
      x, x, x, implementation=implementation
  )


def runnable_implementations(x, scale, log=print):
  """The seed's implementations, each replaced by None where it cannot run."""
  chosen = []
  for i, impl in enumerate(SEED_IMPLEMENTATIONS):
    op = _single_op(i, impl)
    try:
      # Tracing is enough: selection happens before any kernel runs.
      jax.eval_shape(jax.grad(lambda a, b: jnp.sum(op(a, b))), x, scale)
      chosen.append(impl)
    except NotImplementedError as e:
      log(f"  call {i + 1}: implementation={impl!r} cannot run here -> None.")
      log(f"    reason: {e}")
      chosen.append(None)
  return tuple(chosen)


def main(shape=None, log=print):
  on_gpu = jax.default_backend() == "gpu"
  if shape is None:
    shape = SEED_SHAPE if on_gpu else SMALL_SHAPE
  channels, seq_len, batch_size, num_heads = shape
  device = jax.devices()[0]
  log(f"tokamax {tokamax.__version__} on {device.device_kind} ({device.platform}),"
      f" jax {jax.__version__}")
  log(f"seed flow: x [{batch_size}, {seq_len}, {num_heads}, {channels}] bf16")

  scale = jax.random.normal(jax.random.key(0), (channels,), dtype=jnp.float32)
  x = jax.random.normal(
      jax.random.key(1), (batch_size, seq_len, num_heads, channels),
      dtype=jnp.bfloat16,
  )
  implementations = runnable_implementations(x, scale, log)
  loss = make_loss(implementations)
  f_grad = jax.jit(jax.grad(loss))

  start = time.perf_counter()
  out = jax.block_until_ready(f_grad(x, scale))
  first = time.perf_counter() - start
  start = time.perf_counter()
  out = jax.block_until_ready(f_grad(x, scale))
  second = time.perf_counter() - start

  grad = jnp.asarray(out, jnp.float32)
  finite = bool(jnp.all(jnp.isfinite(grad)))
  log(f"implementations used: {list(implementations)}")
  log(f"loss: {float(jax.jit(loss)(x, scale)):.4f}")
  log(f"gradient: shape {tuple(out.shape)} {out.dtype}, |g| ="
      f" {float(jnp.linalg.norm(grad)):.4f}, finite: {finite}")
  log(f"f_grad wall time: first call {first:.2f} s (with compile),"
      f" second {second * 1e3:.1f} ms")
  if not finite:
    raise SystemExit("gradient is not finite")
  return out


if __name__ == "__main__":
  main()
