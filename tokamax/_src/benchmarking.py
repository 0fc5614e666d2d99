"""Benchmarking of JAX functions on accelerators.

Typical use:

  f_std, args = standardize_function(f, kwargs={"x": x, "scale": scale})
  data = benchmark(f_std, args)  # or: run = compile_benchmark(f_std, args)
  print(data.median_evaluation_time_ms)

`standardize_function` turns a function of arbitrary pytrees (arrays,
`jax.ShapeDtypeStruct`s and static values) into a function of a flat tuple of
arrays, optionally wrapped in its VJP. `compile_benchmark` compiles that
function ahead of time and returns a runner measuring it either with CUPTI
(kernel time on NVIDIA GPUs) or with synchronised host wall-clock time.
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("forward", "vjp", "forward_and_vjp")
METHODS = ("cupti", "wallclock")

# Random integer arguments are drawn from [0, _INT_MAXVAL): small and
# non-negative, so they are usable as indices or lengths of small dimensions.
_INT_MAXVAL = 8


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or (
      hasattr(x, "shape") and hasattr(x, "dtype")
  )


def _is_float(x: Any) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def _random_array(
    key: jax.Array, spec: Any, with_sharding: bool = True
) -> jax.Array:
  """A random array of `spec`'s shape and dtype (see standardize_function)."""
  shape = tuple(spec.shape)
  dtype = jax.dtypes.canonicalize_dtype(spec.dtype)
  if jnp.issubdtype(dtype, jnp.bool_):
    out = jax.random.bernoulli(key, 0.5, shape)
  elif jnp.issubdtype(dtype, jnp.integer):
    out = jax.random.randint(key, shape, 0, _INT_MAXVAL, dtype=dtype)
  elif jnp.issubdtype(dtype, jnp.complexfloating):
    out = jax.random.normal(key, shape, dtype)
  elif jnp.issubdtype(dtype, jnp.floating):
    # Draw in (at least) float32: low-precision types (e.g. fp8) are cast.
    draw_dtype = jnp.promote_types(dtype, jnp.float32)
    out = jax.random.normal(key, shape, draw_dtype).astype(dtype)
  else:
    raise TypeError(f"Cannot generate random values of dtype {dtype}.")
  sharding = getattr(spec, "sharding", None) if with_sharding else None
  if sharding is not None:
    out = jax.device_put(out, sharding)
  return out


def _concrete(key: jax.Array, x: Any) -> jax.Array:
  if isinstance(x, jax.ShapeDtypeStruct):
    return _random_array(key, x)
  if isinstance(x, jax.Array):
    return x
  return jax.device_put(x)  # NumPy arrays and other array-likes.


def _positional(f, args, kwargs):
  """Passes keyword arguments positionally where f's signature allows.

  `jax.grad(f)` differentiates positional arguments only, so
  `standardize_function(jax.grad(loss), kwargs={"x": x})` must call it as
  `grad(x)`.
  """
  try:
    bound = inspect.signature(f).bind(*args, **kwargs)
  except (TypeError, ValueError):
    return [args, kwargs]
  return [bound.args, bound.kwargs]


def standardize_function(
    f: Callable[..., Any],
    *args: Any,
    kwargs: Mapping[str, Any] | None = None,
    mode: str = "forward",
    seed: int = 0,
) -> tuple[Callable[..., Any], tuple[jax.Array, ...]]:
  """Turns `f(*args, **kwargs)` into a function of a flat tuple of arrays.

  Array leaves of `args` and `kwargs` (arbitrary pytrees) become the inputs of
  the returned function; every other leaf (Python scalars, strings, ...) is
  static and closed over. `jax.ShapeDtypeStruct` leaves are replaced by random
  arrays drawn from `seed`: standard normal for floating-point dtypes, integers
  in [0, 8) for integer dtypes, fair coin flips for bools (placed on the
  struct's sharding if it has one). Concrete arrays are used as they are.

  Modes:

  * "forward": `f_std(*arrays)` returns `f`'s output.
  * "vjp": `f_std(*arrays, *cotangent)` returns the tuple of gradients of `f`
    with respect to its floating-point array leaves (in the order they have in
    `arrays`), pulled back from a fixed random cotangent. The cotangent (one
    normal array per floating-point output leaf, drawn from `seed`) is passed
    as trailing inputs so that XLA cannot constant-fold it. Non-floating
    outputs get no cotangent. The timed call includes the forward pass that
    produces the residuals (jax.vjp); only the output is left unused.
  * "forward_and_vjp": as "vjp", but returns `(output, gradients)`.

  Args:
    f: the function to standardize.
    *args: positional arguments of `f`.
    kwargs: keyword arguments of `f`.
    mode: "forward", "vjp" or "forward_and_vjp".
    seed: seed of the random arguments and cotangent.

  Returns:
    `(f_std, args_std)` such that `f_std(*args_std)` computes the requested
    quantity. In the VJP modes `args_std` ends with the cotangent arrays.

  Raises:
    ValueError: for an unknown mode, or a VJP mode without any floating-point
      array argument.
  """
  if mode not in MODES:
    raise ValueError(f"Unknown mode {mode!r}; expected one of {MODES}.")
  kwargs = dict(kwargs or {})
  leaves, treedef = jax.tree.flatten((args, kwargs))
  array_pos = [i for i, x in enumerate(leaves) if _is_array(x)]
  keys = jax.random.split(jax.random.key(seed), len(leaves) + 1)
  cotangent_key = keys[-1]
  arrays = tuple(_concrete(keys[i], leaves[i]) for i in array_pos)
  n_arrays = len(arrays)

  def call(*flat_arrays):
    full = list(leaves)
    for pos, x in zip(array_pos, flat_arrays, strict=True):
      full[pos] = x
    a, kw = jax.tree.unflatten(treedef, full)
    a, kw = _positional(f, a, kw)
    return f(*a, **kw)

  if mode == "forward":
    return call, arrays

  float_idx = [i for i, x in enumerate(arrays) if _is_float(x)]
  if not float_idx:
    raise ValueError(
        f"mode={mode!r} needs at least one floating-point array argument."
    )

  def split_out(out):
    out_leaves, out_treedef = jax.tree.flatten(out)
    is_f = tuple(_is_array(o) and _is_float(o) for o in out_leaves)
    float_out = [o for o, b in zip(out_leaves, is_f) if b]
    other_out = [o for o, b in zip(out_leaves, is_f) if not b]
    return float_out, (other_out, out_treedef, is_f)

  def merge_out(float_out, aux):
    other_out, out_treedef, is_f = aux
    float_it, other_it = iter(float_out), iter(other_out)
    out_leaves = [next(float_it) if b else next(other_it) for b in is_f]
    return jax.tree.unflatten(out_treedef, out_leaves)

  out_shape = jax.eval_shape(call, *arrays)
  float_out_shape, _ = split_out(out_shape)
  ct_keys = jax.random.split(cotangent_key, max(len(float_out_shape), 1))
  # The output shardings of eval_shape may be abstract: leave placement of
  # the cotangent to the default device.
  cotangent = tuple(
      _random_array(k, s, with_sharding=False)
      for k, s in zip(ct_keys, float_out_shape)
  )

  def vjp_fn(*flat):
    primals, ct = flat[:n_arrays], flat[n_arrays:]

    def g(*float_primals):
      full = list(primals)
      for i, x in zip(float_idx, float_primals, strict=True):
        full[i] = x
      float_out, aux = split_out(call(*full))
      # Aux must hold JAX types only: keep the structure out of it.
      return float_out, aux[0]

    float_primals = [primals[i] for i in float_idx]
    float_out, pullback, other_out = jax.vjp(g, *float_primals, has_aux=True)
    grads = tuple(pullback(list(ct)))
    if mode == "vjp":
      return grads
    _, aux = split_out(out_shape)
    out = merge_out(float_out, (other_out, *aux[1:]))
    return out, grads

  return vjp_fn, arrays + cotangent


@dataclasses.dataclass(frozen=True)
class BenchmarkData:
  """The result of a benchmark.

  Attributes:
    compile_time_ms: time to compile the lowered function.
    lowering_time_ms: time to trace and lower the function.
    evaluation_times_ms: the time of each timed evaluation (one per iteration).
    method: "cupti" (accelerator kernel time) or "wallclock" (host time).
    peak_memory_bytes: XLA's estimate of the memory the compiled function
      needs (arguments + outputs + temporaries, aliased buffers counted once),
      else the device's peak memory in use, else None.
  """

  compile_time_ms: float
  lowering_time_ms: float
  evaluation_times_ms: tuple[float, ...]
  method: str
  peak_memory_bytes: int | None = None

  @property
  def median_evaluation_time_ms(self) -> float:
    return statistics.median(self.evaluation_times_ms)


def _peak_memory_bytes(compiled: Any) -> int | None:
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    stats = None
  if stats is not None:
    peak = getattr(stats, "peak_memory_in_bytes", None)
    if peak:
      return int(peak)
    sizes = [
        getattr(stats, name, None)
        for name in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "temp_size_in_bytes",
        )
    ]
    if all(s is not None for s in sizes):
      alias = getattr(stats, "alias_size_in_bytes", 0) or 0
      return max(int(sum(sizes) - alias), 0)
  try:
    mem = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    mem = None
  if mem and "peak_bytes_in_use" in mem:
    return int(mem["peak_bytes_in_use"])
  return None


def _check_iterations(iterations: Any) -> int:
  if (
      isinstance(iterations, bool)
      or not isinstance(iterations, (int, np.integer))
      or iterations < 1
  ):
    raise ValueError(f"iterations must be a positive int, got {iterations!r}.")
  return int(iterations)


def _resolve_method(method: str | None) -> str:
  backend = jax.default_backend()
  if method is None:
    return "cupti" if backend == "gpu" else "wallclock"
  if method not in METHODS:
    raise ValueError(f"Unknown method {method!r}; expected one of {METHODS}.")
  if method == "cupti" and backend != "gpu":
    raise RuntimeError(
        f"method='cupti' needs an NVIDIA GPU; the backend is {backend}."
    )
  return method


def _wallclock_times(compiled, args, iterations: int) -> list[float]:
  times = []
  for _ in range(iterations):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return times


# JAX's CUPTI profiler keeps the outputs of all the calls of one measurement
# alive until the last call has run: calls are measured in groups whose
# outputs take at most this many bytes (20 calls of a 4 GiB output, the
# seed-size q.k^T matmul peer, ran an 80 GB H100 out of memory, 2026-12-05;
# 20 forward+backward calls of the H128 attention benchmark, 10 GiB, fit).
CUPTI_OUTPUT_BYTES = 16 << 30


def _output_bytes(compiled) -> int:
  """Bytes of the outputs of one call of `compiled` (0 if unknown)."""
  try:
    outs = jax.tree.leaves(compiled.out_info)
  except (AttributeError, TypeError):
    return 0
  return sum(int(np.prod(o.shape)) * jnp.dtype(o.dtype).itemsize for o in outs)


def _cupti_times(compiled, args, iterations: int) -> list[float]:
  """Summed kernel time (ms) of each of `iterations` calls, through CUPTI,
  in groups of calls whose outputs fit CUPTI_OUTPUT_BYTES."""
  try:
    from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise RuntimeError(
        "method='cupti' needs jax.experimental.mosaic.gpu.profiler, which"
        f" cannot be imported: {e}"
    ) from e

  params = inspect.signature(profiler.measure).parameters
  kw = {}
  if "aggregate" in params:
    kw["aggregate"] = True
  if "mode" in params:  # Older JAX versions.
    kw["mode"] = "cupti"

  def as_ms(t) -> float:
    if t is None:  # No kernel was launched.
      return 0.0
    if isinstance(t, (list, tuple)):  # Per-kernel (name, ms) pairs.
      return float(sum(x[1] if isinstance(x, tuple) else x for x in t))
    return float(t)

  if "iterations" in params:
    out_bytes = _output_bytes(compiled)
    group = iterations
    if out_bytes:
      group = max(1, min(iterations, CUPTI_OUTPUT_BYTES // out_bytes))
    times = []
    while len(times) < iterations:
      n = min(group, iterations - len(times))
      _, timings = profiler.measure(compiled, iterations=n, **kw)(*args)
      if timings is None:
        times += [0.0] * n
      elif n == 1:
        times.append(as_ms(timings))
      else:
        times += [as_ms(t) for t in timings]
    return times
  measured = profiler.measure(compiled, **kw)
  return [as_ms(measured(*args)[1]) for _ in range(iterations)]


class CompiledBenchmark:
  """A function compiled for benchmarking; call it to measure it.

  Attributes:
    compiled: the `jax.stages.Compiled` function.
    lowering_time_ms: time to trace and lower the function.
    compile_time_ms: time to compile it.
    peak_memory_bytes: see `BenchmarkData.peak_memory_bytes`.
  """

  def __init__(self, compiled, lowering_time_ms: float, compile_time_ms: float):
    self.compiled = compiled
    self.lowering_time_ms = lowering_time_ms
    self.compile_time_ms = compile_time_ms
    self.peak_memory_bytes = _peak_memory_bytes(compiled)

  def __call__(
      self,
      args: Sequence[Any],
      *,
      method: str | None = None,
      iterations: int = 5,
  ) -> BenchmarkData:
    """Measures `iterations` evaluations of the compiled function on `args`.

    One untimed warm-up call comes first.

    Args:
      args: the flat arrays (as returned by `standardize_function`).
      method: "cupti" (sum of the kernel times of one call, measured by CUPTI;
        NVIDIA GPUs only), "wallclock" (host time of a call, synchronised with
        `jax.block_until_ready`), or None: "cupti" on GPU, else "wallclock".
      iterations: number of timed evaluations (a positive int).

    Returns:
      The compile and lowering times, the evaluation times and the method.

    Raises:
      ValueError: for an unknown method or a non-positive `iterations`.
      RuntimeError: for method="cupti" when the backend is not a GPU.
    """
    iterations = _check_iterations(iterations)
    method = _resolve_method(method)
    args = tuple(args)
    jax.block_until_ready(self.compiled(*args))  # Warm-up.
    if method == "cupti":
      times = _cupti_times(self.compiled, args, iterations)
    else:
      times = _wallclock_times(self.compiled, args, iterations)
    if len(times) != iterations:
      raise RuntimeError(
          f"Expected {iterations} timings, the profiler returned {len(times)}."
      )
    return BenchmarkData(
        compile_time_ms=self.compile_time_ms,
        lowering_time_ms=self.lowering_time_ms,
        evaluation_times_ms=tuple(float(t) for t in times),
        method=method,
        peak_memory_bytes=self.peak_memory_bytes,
    )


def compile_benchmark(
    f_std: Callable[..., Any], args: Sequence[Any]
) -> CompiledBenchmark:
  """JIT-compiles `f_std` for `args`, timing the lowering and the compilation.

  Returns a callable `run(args, *, method=None, iterations=5) -> BenchmarkData`
  (see `CompiledBenchmark.__call__`).
  """
  jitted = jax.jit(f_std)
  t0 = time.perf_counter()
  lowered = jitted.lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return CompiledBenchmark(
      compiled,
      lowering_time_ms=(t1 - t0) * 1e3,
      compile_time_ms=(t2 - t1) * 1e3,
  )


def benchmark(
    f_std: Callable[..., Any],
    args: Sequence[Any],
    *,
    method: str | None = None,
    iterations: int = 5,
) -> BenchmarkData:
  """Compiles `f_std` for `args` and measures it (see `compile_benchmark`)."""
  return compile_benchmark(f_std, args)(
      args, method=method, iterations=iterations
  )
