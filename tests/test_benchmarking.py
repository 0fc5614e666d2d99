"""Tests of tokamax._src.benchmarking (on CPU)."""

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax._src import benchmarking


def _f(x, y):
  return jnp.sum(jnp.sin(x) * y)


def test_forward_with_arrays():
  x = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)
  y = jnp.ones((2, 3), jnp.float32)
  f_std, args = benchmarking.standardize_function(_f, x, y)
  assert len(args) == 2
  np.testing.assert_array_equal(args[0], x)
  np.testing.assert_array_equal(args[1], y)
  np.testing.assert_allclose(f_std(*args), _f(x, y), rtol=1e-6)
  np.testing.assert_allclose(jax.jit(f_std)(*args), _f(x, y), rtol=1e-6)


def test_numpy_arrays_become_jax_arrays():
  x = np.ones((2, 2), np.float32)
  _, args = benchmarking.standardize_function(jnp.sum, x)
  assert isinstance(args[0], jax.Array)
  np.testing.assert_array_equal(args[0], x)


def test_shape_dtype_struct_random_and_deterministic():
  spec = jax.ShapeDtypeStruct((4, 5), jnp.float32)
  _, a0 = benchmarking.standardize_function(jnp.sum, spec, seed=0)
  _, b0 = benchmarking.standardize_function(jnp.sum, spec, seed=0)
  _, a1 = benchmarking.standardize_function(jnp.sum, spec, seed=1)
  (x0,), (y0,), (x1,) = a0, b0, a1
  assert x0.shape == (4, 5) and x0.dtype == jnp.float32
  assert jnp.any(x0 != 0)
  assert len(np.unique(np.asarray(x0))) > 1
  np.testing.assert_array_equal(x0, y0)
  assert not np.array_equal(np.asarray(x0), np.asarray(x1))


def test_shape_dtype_struct_int_and_bool():
  ints = jax.ShapeDtypeStruct((64,), jnp.int32)
  bools = jax.ShapeDtypeStruct((64,), jnp.bool_)
  half = jax.ShapeDtypeStruct((8,), jnp.bfloat16)
  _, (i, b, h) = benchmarking.standardize_function(
      lambda i, b, h: i, ints, bools, half
  )
  assert i.dtype == jnp.int32 and b.dtype == jnp.bool_ and h.dtype == jnp.bfloat16
  assert jnp.all(i >= 0) and jnp.any(i > 0) and jnp.all(i < 8)
  assert jnp.any(b) and jnp.any(~b)
  assert jnp.any(h != 0)


def test_kwargs_pytrees_and_static_values():
  calls = []

  def f(x, *, params, scale, name, unused=None):
    calls.append((scale, name))
    assert unused is None
    return (x @ params["w"] + params["b"]) * scale

  x = jax.ShapeDtypeStruct((2, 3), jnp.float32)
  params = {"w": jnp.ones((3, 4), jnp.float32), "b": jnp.zeros((4,))}
  f_std, args = benchmarking.standardize_function(
      f,
      x,
      kwargs={"params": params, "scale": 2, "name": "dense", "unused": None},
  )
  assert len(args) == 3  # x, b, w: static leaves are closed over.
  out = f_std(*args)
  assert out.shape == (2, 4)
  assert calls[-1] == (2, "dense")
  # The flat order is jax.tree order of ((x,), kwargs): x, params.b, params.w.
  np.testing.assert_allclose(
      out, (args[0] @ args[2] + args[1]) * 2, rtol=1e-6
  )


def test_seed_usage_with_compile_benchmark():
  def f(x, scale):
    return x * scale

  x = jax.ShapeDtypeStruct((8,), jnp.float32)
  f_std, args = benchmarking.standardize_function(
      f, kwargs={"x": x, "scale": 3.0}
  )
  run = benchmarking.compile_benchmark(f_std, args)
  data = run(args, method="wallclock", iterations=2)
  assert len(data.evaluation_times_ms) == 2


def test_vjp_matches_grad():
  x = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32)
  y = jnp.linspace(0.5, 2.0, 6, dtype=jnp.float32)
  f_std, args = benchmarking.standardize_function(_f, x, y, mode="vjp")
  assert len(args) == 3  # x, y and the cotangent.
  ct = args[-1]
  assert ct.shape == () and ct.dtype == jnp.float32 and ct != 0
  gx, gy = jax.grad(_f, argnums=(0, 1))(x, y)
  grads = f_std(*args)
  assert len(grads) == 2
  np.testing.assert_allclose(grads[0], ct * gx, rtol=1e-5)
  np.testing.assert_allclose(grads[1], ct * gy, rtol=1e-5)
  jit_grads = jax.jit(f_std)(*args)
  np.testing.assert_allclose(jit_grads[0], ct * gx, rtol=1e-5)
  # The cotangent is fixed by the seed.
  _, args2 = benchmarking.standardize_function(_f, x, y, mode="vjp")
  np.testing.assert_array_equal(args2[-1], ct)


def test_forward_and_vjp():
  x = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32)
  y = jnp.linspace(0.5, 2.0, 6, dtype=jnp.float32)
  f_std, args = benchmarking.standardize_function(
      _f, x, y, mode="forward_and_vjp"
  )
  out, (gx, gy) = f_std(*args)
  ct = args[-1]
  np.testing.assert_allclose(out, _f(x, y), rtol=1e-6)
  np.testing.assert_allclose(gx, ct * jnp.cos(x) * y, rtol=1e-5)
  np.testing.assert_allclose(gy, ct * jnp.sin(x), rtol=1e-5)


def test_vjp_skips_non_float_inputs_and_outputs():
  def f(x, idx, scale):
    return {"y": x[idx] * scale, "idx": idx + 1}

  x = jax.ShapeDtypeStruct((5, 3), jnp.float32)
  idx = jax.ShapeDtypeStruct((2,), jnp.int32)
  f_std, args = benchmarking.standardize_function(
      f, x, idx, 2.0, mode="forward_and_vjp"
  )
  # x, idx and one cotangent (for the float output "y" only).
  assert len(args) == 3
  x_, idx_, ct = args
  assert ct.shape == (2, 3)
  out, grads = jax.jit(f_std)(*args)
  assert len(grads) == 1
  np.testing.assert_array_equal(out["idx"], idx_ + 1)
  np.testing.assert_allclose(out["y"], x_[idx_] * 2.0, rtol=1e-6)
  expected = jnp.zeros((5, 3)).at[idx_].add(2.0 * ct)
  np.testing.assert_allclose(grads[0], expected, rtol=1e-6)


def test_vjp_needs_float_argument():
  with pytest.raises(ValueError, match="floating-point"):
    benchmarking.standardize_function(
        lambda i: i * 2, jnp.arange(3), mode="vjp"
    )


def test_bad_mode():
  with pytest.raises(ValueError, match="mode"):
    benchmarking.standardize_function(_f, jnp.ones(2), jnp.ones(2), mode="bwd")


@pytest.fixture(name="run_and_args")
def _run_and_args():
  x = jax.ShapeDtypeStruct((16,), jnp.float32)
  f_std, args = benchmarking.standardize_function(_f, x, x, mode="vjp")
  return benchmarking.compile_benchmark(f_std, args), args


@pytest.mark.parametrize("method", ["wallclock", None])
def test_run(run_and_args, method):
  run, args = run_and_args
  data = run(args, method=method, iterations=3)
  assert isinstance(data, benchmarking.BenchmarkData)
  assert data.method == "wallclock"  # No GPU here.
  assert len(data.evaluation_times_ms) == 3
  assert all(t > 0 for t in data.evaluation_times_ms)
  assert data.median_evaluation_time_ms == statistics.median(
      data.evaluation_times_ms
  )
  assert data.compile_time_ms > 0
  assert data.lowering_time_ms > 0
  assert data.peak_memory_bytes is None or data.peak_memory_bytes > 0
  with pytest.raises(dataclasses.FrozenInstanceError):
    data.method = "cupti"  # type: ignore[misc]


def test_default_iterations(run_and_args):
  run, args = run_and_args
  assert len(run(args).evaluation_times_ms) == 5


def test_median():
  data = benchmarking.BenchmarkData(
      compile_time_ms=1.0,
      lowering_time_ms=1.0,
      evaluation_times_ms=(3.0, 1.0, 2.0, 10.0),
      method="wallclock",
      peak_memory_bytes=None,
  )
  assert data.median_evaluation_time_ms == 2.5


def test_benchmark():
  f_std, args = benchmarking.standardize_function(
      _f, jnp.ones(4), jnp.ones(4)
  )
  data = benchmarking.benchmark(f_std, args, method="wallclock", iterations=2)
  assert len(data.evaluation_times_ms) == 2
  assert data.method == "wallclock"


@pytest.mark.parametrize("iterations", [0, -1, 1.5, True])
def test_bad_iterations(run_and_args, iterations):
  run, args = run_and_args
  with pytest.raises(ValueError, match="iterations"):
    run(args, iterations=iterations)


def test_cupti_needs_gpu(run_and_args):
  run, args = run_and_args
  if jax.default_backend() == "gpu":
    pytest.skip("A GPU is present.")
  with pytest.raises(RuntimeError, match="cupti.*GPU"):
    run(args, method="cupti")


def test_unknown_method(run_and_args):
  run, args = run_and_args
  with pytest.raises(ValueError, match="method"):
    run(args, method="stopwatch")


def test_keyword_arguments_reach_grad_positionally():
  # The seed passes kwargs={'x': ..., 'scale': ...} for f_grad = jit(grad(loss)).
  def loss(x, scale):
    return jnp.sum(jnp.sin(x) * scale)

  x = jnp.linspace(0.0, 1.0, 8)
  scale = jnp.full((8,), 2.0)
  f_grad = jax.jit(jax.grad(loss))
  f_std, args = benchmarking.standardize_function(
      f_grad, kwargs={"x": x, "scale": scale})
  np.testing.assert_allclose(f_std(*args), 2.0 * jnp.cos(x), rtol=1e-6)
  data = benchmarking.compile_benchmark(f_std, args)(args, iterations=3)
  assert len(data.evaluation_times_ms) == 3


@pytest.mark.parametrize("iterations, limit, groups", [
    (5, 10 << 20, [2, 2, 1]), (5, 1 << 30, [5]), (3, 1 << 20, [1, 1, 1])])
def test_cupti_groups_calls_by_output_size(monkeypatch, iterations, limit, groups):
  """CUPTI measurements hold every call's outputs (4 MiB here) until the
  last call: calls go in groups within CUPTI_OUTPUT_BYTES, and every call's
  time comes back in order (profiler.measure faked: no GPU here)."""
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top

  seen, calls = [], iter(range(100))

  def measure(f, *, aggregate=True, iterations=1):
    del aggregate
    seen.append(iterations)

    def run(*args):
      times = [float(next(calls)) for _ in range(iterations)]
      return f(*args), (times[0] if iterations == 1 else times)

    return run

  monkeypatch.setattr(profiler, "measure", measure)
  monkeypatch.setattr(benchmarking, "CUPTI_OUTPUT_BYTES", limit)
  compiled = jax.jit(lambda x: jnp.broadcast_to(x, (1024, 1024))).lower(
      jnp.float32(1)).compile()
  assert benchmarking._output_bytes(compiled) == 4 << 20
  times = benchmarking._cupti_times(compiled, (jnp.float32(1),), iterations)
  assert seen == groups
  assert times == [float(i) for i in range(iterations)]
