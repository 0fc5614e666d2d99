"""The seed flow of SEED_USAGE.md, end to end: gradient, autotuning,
serialization and benchmarking.

On an NVIDIA GPU it runs exactly as written (seed shape). Elsewhere it uses a
smaller shape. An implementation the machine cannot run is replaced by
`implementation=None` (automatic choice), and the demo prints which and why.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax import export

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


def main(shape=None, log=print, extended=True, progress_bar=True):
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
  if not extended:
    return out

  # Autotuning: every tunable op of f_grad (VJP ops included).
  start = time.perf_counter()
  result = tokamax.autotune(f_grad, x, scale, progress_bar=progress_bar)
  tune_s = time.perf_counter() - start
  for e in result.entries:
    best = e.measurements[0]
    timing = "every config failed" if best.median_ms is None else f"{best.median_ms:.3f} ms"
    log(f"  tuned {e.op.split(':')[1]}: {e.config} ({timing},"
        f" {len(e.measurements)} configs)")
  with result:
    out_tuned = f_grad(x, scale)
  restored = tokamax.AutotuningResult.loads(result.dumps())
  assert restored == result, "dumps/loads round trip changed the result"
  with restored:
    same = f_grad(x, scale)
  # Bit-identity is only meaningful where f_grad is deterministic (cuDNN's
  # attention backward on GPUs is not, unless XLA runs deterministic ops).
  with result:
    deterministic = bool(jnp.array_equal(f_grad(x, scale), out_tuned))
  log(f"autotune: {len(result.entries)} ops in {tune_s:.1f} s; under the"
      f" result |g| = {float(jnp.linalg.norm(out_tuned.astype(jnp.float32))):.4f};"
      f" dumps/loads round trip identical: {bool(jnp.array_equal(out_tuned, same))}"
      f" (f_grad run to run: {deterministic})")

  # Serialization.
  exported = export.export(
      f_grad, disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS
  )(
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      jax.ShapeDtypeStruct(scale.shape, scale.dtype),
  )
  blob = exported.serialize()
  out_exported = export.deserialize(blob).call(x, scale)
  identical = bool(jnp.array_equal(out_exported, out))
  deterministic = bool(jnp.array_equal(f_grad(x, scale), out))
  diff = float(jnp.max(jnp.abs(out_exported.astype(jnp.float32) - out.astype(jnp.float32))))
  log(f"export: {len(blob)} bytes serialized; deserialized call bit-identical"
      f" to f_grad: {identical} (f_grad run to run: {deterministic};"
      f" max |difference| {diff:.3g})")

  # Benchmarking (accelerator time).
  f_std, args = tokamax.benchmarking.standardize_function(
      f_grad, kwargs={"x": x, "scale": scale}
  )
  run = tokamax.benchmarking.compile_benchmark(f_std, args)
  rows = [("default", run(args)), ("default, 10 iterations", run(args, iterations=10))]
  if on_gpu:
    rows.append(("wallclock, 10 iterations", run(args, method="wallclock", iterations=10)))
  log(f"{'benchmark of f_grad':28s} {'method':10s} {'n':>3s} {'median ms':>10s}")
  for name, bench in rows:
    log(f"{name:28s} {bench.method:10s} {len(bench.evaluation_times_ms):3d}"
        f" {bench.median_evaluation_time_ms:10.3f}")
  if deterministic and not identical:
    raise SystemExit("exported function differs from f_grad")
  return out


if __name__ == "__main__":
  main()
