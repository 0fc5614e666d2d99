"""jax.export of tokamax functions, DISABLE_JAX_EXPORT_CHECKS and cross_compile."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import dispatch
from tokamax._src import export as tokamax_export
from tokamax._src import platform
from tokamax._src.cross_compile import cross_compile

ON_GPU = jax.default_backend() == "gpu"
OURS = set(tokamax_export.TOKAMAX_CUSTOM_CALL_TARGETS)
CUDNN = set(tokamax_export.CUDNN_ATTENTION_TARGETS)
SHAPE = (2, 64, 4, 64)  # [B, T, N, H]


def _demo():
  path = pathlib.Path(__file__).parent.parent / "scripts" / "demo.py"
  spec = importlib.util.spec_from_file_location("demo", path)
  demo = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(demo)
  return demo


def _seed_inputs():
  scale = jax.random.normal(jax.random.key(0), (SHAPE[-1],), jnp.float32)
  x = jax.random.normal(jax.random.key(1), SHAPE, jnp.bfloat16)
  return x, scale


def _specs(*arrays):
  return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def _round_trip(exported):
  return jax.export.deserialize(exported.serialize())


@pytest.fixture
def fake_cudnn(monkeypatch):
  """Lets jax.nn's cuDNN attention trace and lower for cuda on a CPU host.

  jax only refuses at trace time because no cuDNN library is loaded; the
  cuda lowering itself needs none, so the emitted targets are the real ones.
  """
  from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=g-import-not-at-top

  if ON_GPU:
    return
  monkeypatch.setattr(
      fused_attention_stablehlo, "check_cudnn_version", lambda: 91000
  )


# --- DISABLE_JAX_EXPORT_CHECKS and custom_call_targets ---------------------


def test_disable_checks_cover_triton_and_cudnn_targets():
  checks = tokamax_export.DISABLE_JAX_EXPORT_CHECKS
  assert isinstance(checks, tuple)
  assert all(isinstance(c, jax.export.DisabledSafetyCheck) for c in checks)
  assert set(checks) == {
      jax.export.DisabledSafetyCheck.custom_call(t) for t in OURS
  }
  assert len(checks) == len(OURS)
  assert "__gpu$xla.gpu.triton" in OURS
  assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= OURS
  # Mosaic GPU is on JAX's default allow-list.
  assert "mosaic_gpu_v2" not in OURS


def test_custom_call_targets_parses_mlir_text():
  text = """
    %0 = stablehlo.custom_call @__cudnn$fmhaSoftmax(%arg0) : (x) -> y
    %1 = stablehlo.custom_call @"__gpu$xla.gpu.triton"(%0) {a = 1} : (y) -> y
    %2 = "stablehlo.custom_call"(%1) {call_target_name = "mosaic_gpu_v2"}
  """
  assert tokamax_export.custom_call_targets(text) == {
      "__cudnn$fmhaSoftmax", "__gpu$xla.gpu.triton", "mosaic_gpu_v2",
  }
  assert tokamax_export.custom_call_targets("func.func @main()") == set()
  with pytest.raises(TypeError):
    tokamax_export.custom_call_targets(3)


# --- CPU exports -----------------------------------------------------------


def test_seed_flow_export_round_trip_on_cpu():
  x, scale = _seed_inputs()
  implementations = _demo().runnable_implementations(
      x, scale, log=lambda *a: None
  )
  if not ON_GPU:
    assert implementations == (None, "xla_chunked", None, None)
  loss = _demo().make_loss(implementations)
  f_grad = jax.jit(jax.grad(loss))
  exported = jax.export.export(
      f_grad, disabled_checks=tokamax_export.DISABLE_JAX_EXPORT_CHECKS
  )(*_specs(x, scale))
  assert tokamax_export.custom_call_targets(exported) <= OURS | {"mosaic_gpu_v2"}

  restored = _round_trip(exported)
  if not ON_GPU:
    assert restored.platforms == ("cpu",)
  out = restored.call(x, scale)
  expected = f_grad(x, scale)
  assert out.dtype == x.dtype and out.shape == x.shape
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def _op_case(op, impl, grad):
  """(jitted function, arrays) for one implementation, forward or gradient."""
  keys = jax.random.split(jax.random.key(2), 3)
  if op == "layer_norm":
    args = (
        jax.random.normal(keys[0], SHAPE, jnp.bfloat16),
        jax.random.normal(keys[1], SHAPE[-1:], jnp.float32),
    )
    fwd = lambda x, s: tokamax.layer_norm(x, s, implementation=impl)
  else:
    args = tuple(jax.random.normal(k, SHAPE, jnp.bfloat16) for k in keys)
    fwd = lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, implementation=impl
    )
  if grad:
    loss = lambda *a: jnp.sum(fwd(*a).astype(jnp.float32))
    fn = jax.grad(loss, argnums=tuple(range(len(args))))
  else:
    fn = fwd
  return jax.jit(fn), args


CPU_CASES = [
    (op, impl, grad)
    for op, impl in [
        ("layer_norm", "xla"),
        ("dot_product_attention", "xla"),
        ("dot_product_attention", "xla_chunked"),
    ]
    for grad in (False, True)
]


@pytest.mark.parametrize("op, impl, grad", CPU_CASES)
def test_cpu_implementation_exports_with_default_checks(op, impl, grad):
  fn, args = _op_case(op, impl, grad)
  exported = jax.export.export(fn)(*_specs(*args))
  assert tokamax_export.custom_call_targets(exported) == set()
  out = _round_trip(exported).call(*args)
  jax.tree.map(
      lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
      out, fn(*args),
  )


@pytest.mark.parametrize("op, impl, grad", CPU_CASES)
def test_cpu_implementation_exports_for_cuda_without_custom_calls(
    op, impl, grad
):
  fn, args = _op_case(op, impl, grad)
  with cross_compile("NVIDIA H200"):
    exported = jax.export.export(fn, platforms=["cuda"])(*_specs(*args))
  assert exported.platforms == ("cuda",)
  assert tokamax_export.custom_call_targets(exported) == set()


# --- cross_compile -----------------------------------------------------------


def test_cross_compile_sets_abstract_target_and_restores():
  outside = platform.current_target()
  with cross_compile("NVIDIA H200") as target:
    assert target == platform.Target(
        platform="gpu", device_kind="NVIDIA H200", compute_capability=(9, 0),
        is_abstract=True,
    )
    assert platform.current_target() == target
    device = jax.sharding.get_abstract_mesh().abstract_device
    assert (device.device_kind, device.platform, device.num_cores) == (
        "NVIDIA H200", "gpu", 132,
    )
    with cross_compile("NVIDIA A100", num_cores=108):
      inner = platform.current_target()
      assert inner.device_kind == "NVIDIA A100"
      assert inner.compute_capability == (8, 0)
      assert jax.sharding.get_abstract_mesh().abstract_device.num_cores == 108
    assert platform.current_target() == target
  assert platform.current_target() == outside
  assert jax.sharding.get_abstract_mesh().abstract_device is None
  if not ON_GPU:
    assert outside.platform == "cpu" and not outside.is_abstract


def test_cross_compile_keeps_mesh_axes():
  mesh = jax.sharding.AbstractMesh(
      (2, 4), ("data", "model"),
      axis_types=(jax.sharding.AxisType.Explicit,) * 2,
  )
  with jax.sharding.use_abstract_mesh(mesh), cross_compile():
    inner = jax.sharding.get_abstract_mesh()
    assert inner.axis_names == ("data", "model")
    assert inner.axis_sizes == (2, 4)
    assert inner.abstract_device.device_kind == "NVIDIA H200"


@pytest.mark.parametrize("kind", ["NVIDIA Z9000", "TPU v5 lite", "cpu"])
def test_cross_compile_unknown_device_kind(kind):
  with pytest.raises(ValueError, match=r"unknown device kind.*NVIDIA H200"):
    with cross_compile(kind):
      pass
  assert platform.current_target().is_abstract is False


@pytest.mark.parametrize("num_cores", [0, -1, 1.5, True])
def test_cross_compile_bad_num_cores(num_cores):
  with pytest.raises(ValueError, match="num_cores"):
    with cross_compile("NVIDIA H200", num_cores=num_cores):
      pass


def test_triton_attention_exports_for_cuda_on_cpu_host():
  """Forward and gradient of the Triton kernels export with our checks list."""
  x, _ = _seed_inputs()

  def f_grad(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(tokamax.dot_product_attention(
        q, k, v, is_causal=True, implementation="triton").astype(jnp.float32)),
        argnums=(0, 1, 2))(q, k, v)

  spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
  with cross_compile("NVIDIA H200"):
    exported = jax.export.export(
        jax.jit(f_grad), platforms=["cuda"],
        disabled_checks=tokamax_export.DISABLE_JAX_EXPORT_CHECKS,
    )(spec, spec, spec)
  assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 3
  restored = _round_trip(exported)
  assert restored.in_avals == exported.in_avals


def test_mosaic_attention_exports_for_cuda_on_cpu_host():
  """The Mosaic forward and VJP kernels (mosaic_gpu_v2, on JAX's allow-list)
  export from a CPU host; the module round-trips."""
  x, _ = _seed_inputs()

  def f_grad(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(tokamax.dot_product_attention(
        q, k, v, is_causal=True, implementation="mosaic").astype(jnp.float32)),
        argnums=(0, 1, 2))(q, k, v)

  spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
  with cross_compile("NVIDIA H200"):
    exported = jax.export.export(
        jax.jit(f_grad), platforms=["cuda"],
        disabled_checks=tokamax_export.DISABLE_JAX_EXPORT_CHECKS,
    )(spec, spec, spec)
  assert tokamax_export.custom_call_targets(exported) == {"mosaic_gpu_v2"}
  # The forward, dk/dv and dq kernels.
  assert exported.mlir_module().count("stablehlo.custom_call @mosaic_gpu_v2") == 3
  assert _round_trip(exported).in_avals == exported.in_avals


def test_mosaic_layer_norm_exports_for_cuda_on_cpu_host():
  """The Mosaic layer_norm forward (saving statistics) and the Triton
  backward export from a CPU host; the module round-trips."""
  x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)
  s = jax.ShapeDtypeStruct((1024,), jnp.float32)
  f_grad = jax.grad(lambda x, s: jnp.sum(tokamax.layer_norm(
      x, s, implementation="mosaic").astype(jnp.float32)), argnums=(0, 1))
  with cross_compile("NVIDIA H200"):
    exported = jax.export.export(
        jax.jit(f_grad), platforms=["cuda"],
        disabled_checks=tokamax_export.DISABLE_JAX_EXPORT_CHECKS,
    )(x, s)
  assert tokamax_export.custom_call_targets(exported) == {
      "mosaic_gpu_v2", "__gpu$xla.gpu.triton"}
  assert _round_trip(exported).in_avals == exported.in_avals


def test_seed_flow_lowers_and_exports_for_cuda_on_cpu_host():
  x, scale = _seed_inputs()
  demo = _demo()
  with cross_compile("NVIDIA H200"):
    reasons = []
    implementations = demo.runnable_implementations(x, scale, reasons.append)
    # Every seed call lowers for an H200 as written.
    assert implementations == ("triton", "xla_chunked", None, "mosaic")
    assert not reasons
    f_grad = jax.jit(jax.grad(demo.make_loss(implementations)))
    lowered = f_grad.trace(x, scale).lower(lowering_platforms=("cuda",))
    assert tokamax_export.custom_call_targets(lowered) <= OURS | {"mosaic_gpu_v2"}
    exported = jax.export.export(
        f_grad, platforms=["cuda"],
        disabled_checks=tokamax_export.DISABLE_JAX_EXPORT_CHECKS,
    )(*_specs(x, scale))
  assert exported.platforms == ("cuda",)
  restored = _round_trip(exported)
  assert restored.platforms == ("cuda",)
  assert restored.in_avals == exported.in_avals
  if not ON_GPU:
    # JAX refuses to run a module on a platform it was not exported for.
    with pytest.raises(ValueError, match="cuda"):
      restored.call(x, scale)


def test_jitted_function_retraces_under_cross_compile(fake_cudnn):
  del fake_cudnn
  x, _ = _seed_inputs()
  traces = []

  @jax.jit
  def f(q):
    ba = dispatch.select("dot_product_attention", None, (q, q, q), {})
    traces.append((platform.current_target().device_kind, ba.op.implementation))
    return tokamax.dot_product_attention(q, q, q)

  outside_kind = platform.current_target().device_kind
  f.trace(x).lower()
  f.trace(x).lower()
  assert len(traces) == 1
  with cross_compile("NVIDIA H200"):
    lowered = f.trace(x).lower(lowering_platforms=("cuda",))
    f.trace(x).lower(lowering_platforms=("cuda",))
  f.trace(x).lower()
  assert len(traces) == 2, traces
  if not ON_GPU:
    assert traces == [(outside_kind, "xla"), ("NVIDIA H200", "cudnn")]
    assert tokamax_export.custom_call_targets(lowered) == {
        "__cudnn$fmhaSoftmax"
    }


# --- cuDNN targets, checked on the CPU host by lowering for cuda -------------


def _cudnn_case(bias, mask, grad):
  keys = jax.random.split(jax.random.key(3), 5)
  q, k, v = (jax.random.normal(kk, SHAPE, jnp.bfloat16) for kk in keys[:3])
  b, t, n, _ = SHAPE
  arrays = [q, k, v]
  if bias:
    arrays.append(jax.random.normal(keys[3], (b, n, t, t), jnp.bfloat16))
  if mask:
    arrays.append(jax.random.bernoulli(keys[4], 0.8, (b, n, t, t)))

  def fwd(q, k, v, *rest):
    rest = list(rest)
    b_ = rest.pop(0) if bias else None
    m_ = rest.pop(0) if mask else None
    return tokamax.dot_product_attention(
        q, k, v, b_, m_, implementation="cudnn"
    )

  if grad:
    n_diff = 3 + int(bias)
    fn = jax.grad(
        lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)),
        argnums=tuple(range(n_diff)),
    )
  else:
    fn = fwd
  return jax.jit(fn), arrays


CUDNN_CASES = [
    (bias, mask, grad)
    for bias, mask in [(False, False), (True, False), (False, True)]
    for grad in (False, True)
]


@pytest.mark.skipif(ON_GPU, reason="fake cuDNN on a CPU host")
def test_cudnn_targets_match_disable_checks_when_lowering_for_cuda(fake_cudnn):
  del fake_cudnn
  seen = set()
  for bias, mask, grad in CUDNN_CASES:
    fn, arrays = _cudnn_case(bias, mask, grad)
    with cross_compile("NVIDIA H200"):
      specs = _specs(*arrays)
      with pytest.raises(ValueError, match="custom calls"):
        jax.export.export(fn, platforms=["cuda"])(*specs)
      exported = jax.export.export(
          fn, platforms=["cuda"],
          disabled_checks=tokamax_export.DISABLE_JAX_EXPORT_CHECKS,
      )(*specs)
    targets = tokamax_export.custom_call_targets(exported)
    assert targets and targets <= CUDNN, (bias, mask, grad, targets)
    assert any(t.endswith("Backward") for t in targets) == grad
    _round_trip(exported)
    seen |= targets
  # Every cuDNN target in the tuple is one jax.nn can emit.
  assert seen == CUDNN


@pytest.mark.skipif(ON_GPU, reason="fake cuDNN on a CPU host")
def test_seed_flow_with_cudnn_exports_for_cuda(fake_cudnn):
  del fake_cudnn
  x, scale = _seed_inputs()
  demo = _demo()
  with cross_compile("NVIDIA H200"):
    # The seed with its fourth call left to implementation=None (cuDNN).
    impls = demo.runnable_implementations(x, scale, lambda _: 0)[:3] + (None,)
    loss = demo.make_loss(impls)
    f_grad = jax.jit(jax.grad(loss))
    with pytest.raises(ValueError, match="custom calls"):
      jax.export.export(f_grad, platforms=["cuda"])(*_specs(x, scale))
    exported = jax.export.export(
        f_grad, platforms=["cuda"],
        disabled_checks=tokamax_export.DISABLE_JAX_EXPORT_CHECKS,
    )(*_specs(x, scale))
  targets = tokamax_export.custom_call_targets(exported)
  assert "__cudnn$fmhaSoftmaxBackward" in targets
  assert targets <= OURS | {"mosaic_gpu_v2"}


# --- GPU ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("bias, mask, grad", CUDNN_CASES)
def test_cudnn_export_round_trip_on_gpu(bias, mask, grad):
  fn, arrays = _cudnn_case(bias, mask, grad)
  specs = _specs(*arrays)
  with pytest.raises(ValueError, match="custom calls"):
    jax.export.export(fn)(*specs)
  exported = jax.export.export(
      fn, disabled_checks=tokamax_export.DISABLE_JAX_EXPORT_CHECKS
  )(*specs)
  targets = tokamax_export.custom_call_targets(exported)
  assert targets and targets <= CUDNN, targets
  out = _round_trip(exported).call(*arrays)
  jax.tree.map(
      lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
      out, fn(*arrays),
  )
