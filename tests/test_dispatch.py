"""Implementation selection, fallback (forward and gradient) and errors."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import autotuning
from tokamax._src import dispatch
from tokamax._src import op as op_lib
from tokamax.ops.attention import xla as attention_xla
from tokamax.ops.attention import xla_chunked
from tests import reference

ON_GPU = jax.default_backend() == "gpu"


def _qkv(seed=0, shape=(2, 16, 2, 8)):
  ks = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(k, shape, jnp.float32) for k in ks]


@pytest.mark.skipif(ON_GPU, reason="CPU dispatch")
def test_none_falls_back_to_xla_on_cpu():
  q, k, v = _qkv()
  ba = dispatch.select("dot_product_attention", None, (q, k, v), {})
  assert ba.op.implementation == "xla"
  assert dispatch.select("layer_norm", None, (q,), {}).op.implementation == "xla"
  np.testing.assert_allclose(
      tokamax.dot_product_attention(q, k, v),
      tokamax.dot_product_attention(q, k, v, implementation="xla"), rtol=1e-6,
  )


@pytest.mark.skipif(ON_GPU, reason="CPU dispatch")
@pytest.mark.parametrize("op, impl", [
    ("layer_norm", "triton"), ("layer_norm", "mosaic"), ("dot_product_attention", "triton"),
    ("dot_product_attention", "mosaic"), ("dot_product_attention", "cudnn"),
])
def test_gpu_implementations_refuse_on_cpu(op, impl):
  q, k, v = _qkv()
  args = (q,) if op == "layer_norm" else (q, k, v)
  fn = getattr(tokamax, op)
  with pytest.raises(NotImplementedError, match=rf"'{impl}'.*NVIDIA GPU"):
    fn(*args, implementation=impl)


@pytest.mark.skipif(ON_GPU, reason="CPU dispatch")
def test_list_of_names_raises_exception_group_naming_each():
  q, k, v = _qkv()
  with pytest.raises(ExceptionGroup) as info:
    tokamax.dot_product_attention(q, k, v, implementation=["mosaic", "triton"])
  messages = [str(e) for e in info.value.exceptions]
  assert len(messages) == 2
  assert "'mosaic'" in messages[0] and "'triton'" in messages[1]


def test_list_uses_first_that_works():
  q, k, v = _qkv()
  out = tokamax.dot_product_attention(
      q, k, v, implementation=["mosaic", "xla_chunked", "xla"]
  )
  np.testing.assert_allclose(
      out, tokamax.dot_product_attention(q, k, v, implementation="xla"),
      rtol=1e-5, atol=1e-6,
  )


@pytest.mark.parametrize("impl", ["cuda", "XLA", ""])
def test_unknown_name_raises_value_error(impl):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="unknown implementation"):
    tokamax.dot_product_attention(q, k, v, implementation=impl)
  with pytest.raises(ValueError, match="unknown implementation"):
    tokamax.layer_norm(q, implementation=impl)


@pytest.mark.parametrize("impl", [3, [], ["xla", 2]])
def test_bad_implementation_type(impl):
  q, k, v = _qkv()
  with pytest.raises(TypeError, match="implementation"):
    tokamax.dot_product_attention(q, k, v, implementation=impl)


def test_bad_input_checked_before_implementation_support():
  with pytest.raises(TypeError, match="floating"):
    tokamax.layer_norm(jnp.ones((2, 3), jnp.int32), implementation="triton")


# --- gradient fallback, with a test implementation whose VJP refuses ---


@dataclasses.dataclass(frozen=True)
class _RefusingVjp(xla_chunked.ChunkedDotProductAttentionVjp):
  implementation = "test_refusing"

  def check_supported(self, ba):
    if ba.arguments["is_causal"]:
      raise self.unsupported("test VJP refuses causal attention.")


@dataclasses.dataclass(frozen=True)
class _KernelWithRefusingVjp(xla_chunked.ChunkedDotProductAttention):
  implementation = "test_refusing"
  vjp: op_lib.Op | None = dataclasses.field(default_factory=_RefusingVjp)


@pytest.fixture
def refusing_impl():
  op = "dot_product_attention"
  dispatch.register(op, "test_refusing", _KernelWithRefusingVjp)
  old = dispatch._DEFAULT_ORDER[op]
  dispatch.set_default_order(op, lambda target: ["test_refusing", "xla"])
  yield
  dispatch.set_default_order(op, old)
  dispatch.unregister(op, "test_refusing")


def test_none_falls_back_for_the_gradient_only(refusing_impl):
  q, k, v = _qkv(1)
  ba = dispatch.select("dot_product_attention", None, (q, k, v), dict(is_causal=True))
  assert ba.op.implementation == "test_refusing"  # the forward kernel stays
  assert isinstance(ba.op.vjp, op_lib.AutodiffVjp)  # the gradient falls back
  ba = dispatch.select("dot_product_attention", None, (q, k, v), {})
  assert isinstance(ba.op.vjp, _RefusingVjp)

  loss = lambda q, k, v: jnp.sum(jnp.sin(tokamax.dot_product_attention(
      q, k, v, is_causal=True)))
  ref_loss = lambda q, k, v: jnp.sum(jnp.sin(reference.attention(
      q, k, v, is_causal=True)))
  with jax.default_matmul_precision("highest"):  # no TF32 on GPUs
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  ref = jax.grad(ref_loss, argnums=(0, 1, 2))(*map(reference.f64, (q, k, v)))
  for g, r in zip(grads, ref):
    reference.assert_close(g, r, 1e-4)


@dataclasses.dataclass(frozen=True)
class _SlowForT1Vjp(xla_chunked.ChunkedDotProductAttentionVjp):
  implementation = "test_slow"

  def preferred(self, ba):
    return ba.arguments["query"].shape[1] != 1


@dataclasses.dataclass(frozen=True)
class _SlowKernel(xla_chunked.ChunkedDotProductAttention):
  """Not preferred for T = 3 (forward) and T = 1 (its VJP)."""

  implementation = "test_slow"
  vjp: op_lib.Op | None = dataclasses.field(default_factory=_SlowForT1Vjp)

  def preferred(self, ba):
    return ba.arguments["query"].shape[1] != 3


def test_not_preferred_is_skipped_under_none_only():
  op = "dot_product_attention"
  dispatch.register(op, "test_slow", _SlowKernel)
  old = dispatch._DEFAULT_ORDER[op]
  dispatch.set_default_order(op, lambda target: ["test_slow", "xla_chunked", "xla"])
  try:
    q = jnp.ones((1, 3, 2, 8))
    assert dispatch.select(op, None, (q, q, q), {}).op.implementation == "xla_chunked"
    assert dispatch.select(op, "test_slow", (q, q, q), {}).op.implementation == "test_slow"
    q1 = jnp.ones((1, 1, 2, 8))
    ba = dispatch.select(op, None, (q1, q1, q1), {})
    # The forward is preferred, its VJP is not: the next compatible VJP.
    assert ba.op.implementation == "test_slow"
    assert ba.op.vjp.implementation == "xla_chunked"
    ba = dispatch.select(op, "test_slow", (q1, q1, q1), {})
    assert ba.op.vjp.implementation == "test_slow"
  finally:
    dispatch.set_default_order(op, old)
    dispatch.unregister(op, "test_slow")


_RAN: list = []


@dataclasses.dataclass(frozen=True)
class _FastWithoutGradient(xla_chunked.ChunkedDotProductAttention):
  """Preferred only where no gradient is taken; records its forwards."""

  implementation = "test_inference"

  def preferred(self, ba):
    return False

  def preferred_for_inference(self, ba):
    return True

  def _fwd(self, **kwargs):
    _RAN.append((self.implementation, kwargs["return_residuals"]))
    return super()._fwd(**kwargs)


@dataclasses.dataclass(frozen=True)
class _Training(_FastWithoutGradient):
  """Preferred with a gradient, not without; records its forwards."""

  implementation = "test_training"

  def preferred(self, ba):
    return True

  def preferred_for_inference(self, ba):
    return False


@pytest.fixture
def inference_impls():
  op = "dot_product_attention"
  for name, cls in (("test_inference", _FastWithoutGradient), ("test_training", _Training)):
    dispatch.register(op, name, cls)
  old = dispatch._DEFAULT_ORDER[op]
  dispatch.set_default_order(op, lambda target: ["test_inference", "test_training", "xla"])
  yield op
  dispatch.set_default_order(op, old)
  dispatch.unregister(op, "test_inference")
  dispatch.unregister(op, "test_training")


def test_none_runs_the_inference_op_where_no_gradient_is_taken(inference_impls):
  q, k, v = _qkv(5)
  ba = dispatch.select(inference_impls, None, (q, k, v), {})
  assert ba.op.implementation == "test_training"
  assert ba.op.inference.implementation == "test_inference"
  # A named call runs what it names, with and without a gradient.
  named = dispatch.select(inference_impls, "test_training", (q, k, v), {})
  assert named.op.inference is None
  f = lambda q, impl=None: jnp.sum(jnp.sin(
      tokamax.dot_product_attention(q, k, v, is_causal=True, implementation=impl)))
  ref = lambda q: jnp.sum(jnp.sin(reference.attention(q, k, v, is_causal=True)))
  r = reference.f64(q)
  with jax.default_matmul_precision("highest"):
    _RAN.clear()
    out = jax.jit(f)(q)
    assert _RAN == [("test_inference", False)]
    _RAN.clear()
    value, grad = jax.jit(jax.value_and_grad(f))(q)
    assert _RAN == [("test_training", True)]
    _RAN.clear()
    jax.jit(f, static_argnums=1)(q, "test_training")
    assert _RAN == [("test_training", False)]
  reference.assert_close(out, ref(r), 1e-5, "inference output")
  reference.assert_close(value, ref(r), 1e-5, "training output")
  reference.assert_close(grad, jax.grad(ref)(r), 1e-4, "dq")
  # Autotuning finds the ops that run: without a gradient the inference op
  # (and the training op, so a result tuned on f also serves its gradient).
  found = {type(b.op) for b in autotuning.find_ops(f, q)}
  assert found == {_FastWithoutGradient, _Training}
  found = {type(b.op) for b in autotuning.find_ops(jax.grad(f), q)}
  assert _Training in found and _FastWithoutGradient not in found


def test_named_implementation_raises_for_unsupported_gradient(refusing_impl):
  q, k, v = _qkv(2)
  f = lambda q: jnp.sum(tokamax.dot_product_attention(
      q, k, v, is_causal=True, implementation="test_refusing"))
  f(q)  # the forward alone works
  with pytest.raises(NotImplementedError, match="'test_refusing'.*causal"):
    jax.grad(f)(q)


def test_op_direct_call_and_bound_arguments_are_hashable():
  q, k, v = _qkv(3)
  op = attention_xla.DotProductAttention()
  ba1 = op.bind(q, k, v, is_causal=True)
  ba2 = op.bind(*_qkv(4), is_causal=True)
  ba3 = op.bind(q, k, v)
  assert ba1 == ba2 and hash(ba1) == hash(ba2)
  assert ba1 != ba3
  assert len({ba1, ba2, ba3}) == 2
  np.testing.assert_allclose(
      op(q, k, v), tokamax.dot_product_attention(q, k, v, implementation="xla")
  )


def test_pinned_config_is_used_and_validated():
  q, k, v = _qkv(5, (1, 40, 2, 8))
  config = xla_chunked.ChunkedAttentionConfig(q_chunk_size=8, kv_chunk_size=16)
  op = xla_chunked.ChunkedDotProductAttention(config=config)
  ba = op.bind(q, k, v)
  assert op_lib.resolve_config(ba) is config
  jaxpr = str(jax.make_jaxpr(op)(q, k, v))
  assert "while" in jaxpr or "scan" in jaxpr  # chunked loops, not one block
  with pytest.raises(TypeError, match="ChunkedAttentionConfig"):
    xla_chunked.ChunkedDotProductAttention(config=op_lib.NoConfig())
  with pytest.raises(ValueError):
    xla_chunked.ChunkedAttentionConfig(q_chunk_size=0)


def test_config_sources_hook_between_pinned_and_heuristics():
  q, k, v = _qkv(6)
  op = xla_chunked.ChunkedDotProductAttention()
  ba = op.bind(q, k, v)
  special = xla_chunked.ChunkedAttentionConfig(q_chunk_size=4, kv_chunk_size=4)
  source = lambda b: special if b == ba else None
  op_lib.CONFIG_SOURCES.append(source)
  try:
    assert op_lib.resolve_config(ba) == special
    assert op_lib.resolve_config(op.bind(q[:, :8], k, v)) != special
  finally:
    op_lib.CONFIG_SOURCES.remove(source)
  assert op_lib.resolve_config(ba) == op._get_heuristics_config(ba)


def test_seed_flow_runs_on_this_machine():
  path = pathlib.Path(__file__).parent.parent / "scripts" / "demo.py"
  spec = importlib.util.spec_from_file_location("demo", path)
  demo = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(demo)
  lines = []
  out = demo.main(shape=(64, 64, 2, 4), log=lines.append, progress_bar=False)
  assert out.shape == (2, 64, 4, 64) and out.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  text = "\n".join(lines)
  if not ON_GPU:  # CPU runs are deterministic
    assert "dumps/loads round trip identical: True" in text
    assert "bit-identical to f_grad: True" in text
  assert "default, 10 iterations" in text
  if not ON_GPU:
    assert "implementation='triton' cannot run here" in text
    assert "implementation='mosaic' cannot run here" in text
    # The seed's explicit xla_chunked call is kept as written.
    assert "'xla_chunked'" in text.split("implementations used:")[1]


def test_mask_at_head_dim_128_prefers_mosaic_over_cudnn():
  """Measured faster on the H200 (docs/benchmarks.md); at 64 cuDNN stays."""
  from tokamax.ops.attention import cudnn  # pylint: disable=g-import-not-at-top
  op = cudnn.CudnnDotProductAttention()
  mask = jnp.ones((2, 1, 256, 256), jnp.bool_)
  q64, q128 = (jnp.ones((2, 256, 4, h), jnp.bfloat16) for h in (64, 128))
  bias = jnp.ones((1, 4, 256, 256), jnp.bfloat16)
  with tokamax.config.cross_compile("NVIDIA H200"):
    assert not op.preferred(op.bind(q128, q128, q128, mask=mask))
    assert op.preferred(op.bind(q64, q64, q64, mask=mask))
    assert op.preferred(op.bind(q128, q128, q128, mask=mask, bias=bias))
    assert op.preferred(op.bind(q128, q128, q128))
    ba = dispatch.select("dot_product_attention", None, (q128, q128, q128),
                         dict(mask=mask))
    assert ba.op.implementation == "mosaic"
  # Where "mosaic" cannot run (here: no Hopper GPU), cuDNN keeps the call.
  with tokamax.config.cross_compile("NVIDIA A100"):
    assert op.preferred(op.bind(q128, q128, q128, mask=mask))


def _on_abstract(fn, q_shape, kv_shape=None):
  """fn(q, k, v) on abstract bf16 q, k, v of these shapes (grids of millions
  of rows cost no memory); fn returns a Python value, not an array."""
  kv_shape = kv_shape or q_shape
  seen = []
  jax.eval_shape(lambda q, k, v: seen.append(fn(q, k, v)) or q,
                 *(jax.ShapeDtypeStruct(s, jnp.bfloat16)
                   for s in (q_shape, kv_shape, kv_shape)))
  return seen[0]


def _cudnn_keeps(op, q_shape, kv_shape=None, **kw):
  """(cuDNN preferred with a gradient, without one) for abstract q, k, v."""

  def keeps(q, k, v):
    ba = op.bind(q, k, v, **kw)
    return op.preferred(ba), op.preferred_for_inference(ba)

  return _on_abstract(keeps, q_shape, kv_shape)


_ROWS = 2**20  # B·N·T of the 65536-token N16 sweeps behind the length rules

# (causal, T) -> (cuDNN preferred with a gradient, without one) at 2**20 rows:
# "mosaic" was measured faster at head dim 64 where False (H100,
# docs/benchmarks.md 2026-12-06 18:43).
_H64_CUDNN_KEEPS = {
    (True, 512): (True, True), (True, 1024): (False, True),
    (True, 2048): (False, True), (True, 3072): (False, False),
    (True, 4096): (False, False), (True, 8192): (True, True),
    (False, 512): (True, True), (False, 1024): (False, True),
    (False, 2048): (False, False), (False, 3072): (True, False),
    (False, 16384): (True, False), (False, 32768): (True, True),
}


@pytest.mark.parametrize("causal, t", sorted(_H64_CUDNN_KEEPS))
def test_head_dim_64_prefers_mosaic_over_cudnn(causal, t):
  """Plain attention at head dim 64 on a large grid: where "mosaic" was
  measured faster forward+backward (`preferred`) and forward only
  (`preferred_for_inference`); cuDNN keeps every other case of this test."""
  from tokamax.ops.attention import cudnn  # pylint: disable=g-import-not-at-top
  op = cudnn.CudnnDotProductAttention()
  keeps = functools.partial(_cudnn_keeps, op, is_causal=causal)
  b = _ROWS // (4 * t)
  q, q128 = ((b, t, 4, h) for h in (64, 128))
  lens = jnp.full((b,), 100, jnp.int32)
  with tokamax.config.cross_compile("NVIDIA H200"):
    assert keeps(q) == _H64_CUDNN_KEEPS[causal, t]
    assert keeps(q, (b, t, 1, 64)) == _H64_CUDNN_KEEPS[causal, t]  # MQA
    for extra in (dict(local_window_size=(256, 0)), dict(query_seq_lengths=lens),
                  dict(key_value_seq_lengths=lens),
                  dict(bias=jnp.ones((1, 4, 1, t), jnp.bfloat16))):
      assert keeps(q, **extra) == (True, True), extra
    assert keeps(q128) == (True, True)
    if not causal:  # T != S (cuDNN refuses it causal)
      assert keeps(q, (b, 2 * t, 4, 64)) == (True, True)
  with tokamax.config.cross_compile("NVIDIA A100"):  # no "mosaic" there
    assert keeps(q) == (True, True)


# (head dim, causal, T, rows = B·N·T) -> (cuDNN preferred with a gradient,
# without one) on small grids, N8 (H100, docs/benchmarks.md 2026-12-07):
# causal "mosaic" wins up to a row bound, non-causal cuDNN wins below one;
# the causal forward at T 1024-2048 wins between two bounds (N16, 10:40).
_SMALL_GRID_CUDNN_KEEPS = {
    (64, True, 1024, 16384): (False, True),
    (64, True, 1024, 131072): (False, False),
    (64, True, 2048, 16384): (False, True),
    (64, True, 2048, 32768): (False, False),
    (64, True, 2048, 262144): (False, True),
    (64, True, 4096, 32768): (False, False),
    (64, True, 8192, 65536): (False, False),
    (64, True, 8192, 131072): (True, True),
    (64, False, 2048, 131072): (True, True),
    (64, False, 2048, 262144): (False, False),
    (64, False, 4096, 32768): (True, True),
    (64, False, 4096, 262144): (True, False),
    (128, True, 2048, 32768): (True, True),  # (T < 4096 not measured)
    (128, True, 4096, 65536): (False, False),
    (128, True, 8192, 65536): (False, False),
    (128, True, 8192, 131072): (True, False),
    (128, True, 16384, 131072): (True, False),
    (128, True, 16384, 524288): (True, True),
    (128, True, 32768, 262144): (True, True),
    (128, False, 4096, 65536): (True, True),
}


@pytest.mark.parametrize("h, causal, t, rows", sorted(_SMALL_GRID_CUDNN_KEEPS))
def test_small_grids_choose_by_rows(h, causal, t, rows):
  """Plain attention with few rows (B·N·T): causal favours "mosaic" up to a
  bound, non-causal head dim 64 needs a lower bound; extras keep cuDNN."""
  from tokamax.ops.attention import cudnn  # pylint: disable=g-import-not-at-top
  op = cudnn.CudnnDotProductAttention()
  keeps = functools.partial(_cudnn_keeps, op, is_causal=causal)
  q = (rows // (8 * t), t, 8, h)
  with tokamax.config.cross_compile("NVIDIA H200"):
    assert keeps(q) == _SMALL_GRID_CUDNN_KEEPS[h, causal, t, rows]
    assert keeps(q, local_window_size=(256, 0)) == (True, True)
    assert keeps((*q[:3], 256)) == (True, True)
  with tokamax.config.cross_compile("NVIDIA A100"):
    assert keeps(q) == (True, True)


# (causal, T) -> cuDNN preferred without a gradient for plain GQA at head
# dim 128 ("mosaic" forward measured faster where False: H200,
# docs/benchmarks.md 2026-12-06 22:41); with a gradient cuDNN keeps it on
# these large grids (2M rows).
_GQA_H128_CUDNN_KEEPS_INFERENCE = {
    (True, 1024): True, (True, 2048): False, (True, 8192): False,
    (True, 16384): True, (False, 1024): True, (False, 4096): False,
    (False, 8192): False, (False, 16384): True,
}


# (causal, T, rows = B·N·T) -> (cuDNN preferred with a gradient, without
# one) for plain GQA at head dim 128, N32 K8 (H100, docs/benchmarks.md
# 2026-12-07 10:40; the 2M-row point from the H200 run of 2026-12-06 22:41).
_GQA_SMALL_GRID_CUDNN_KEEPS = {
    (True, 1024, 32768): (True, False),
    (True, 1024, 65536): (True, False),
    (True, 1024, 131072): (True, True),
    (True, 2048, 65536): (False, False),
    (True, 4096, 524288): (False, False),  # the GQA shape
    (True, 4096, 2**21): (True, False),
    (False, 2048, 65536): (True, False),
    (False, 4096, 131072): (True, False),
}


@pytest.mark.parametrize("causal, t, rows", sorted(_GQA_SMALL_GRID_CUDNN_KEEPS))
def test_gqa_head_dim_128_small_grids_choose_by_rows(causal, t, rows):
  """Plain GQA at head dim 128 with few rows: causal T 2048-4096 trains
  with "mosaic" up to a row bound, causal T 1024 infers with it on the
  smallest grids; extras keep cuDNN."""
  from tokamax.ops.attention import cudnn  # pylint: disable=g-import-not-at-top
  op = cudnn.CudnnDotProductAttention()
  keeps = functools.partial(_cudnn_keeps, op, is_causal=causal)
  b = rows // (32 * t)
  q, kv = (b, t, 32, 128), (b, t, 8, 128)
  with tokamax.config.cross_compile("NVIDIA H200"):
    assert keeps(q, kv) == _GQA_SMALL_GRID_CUDNN_KEEPS[causal, t, rows]
    assert keeps(q, kv, local_window_size=(256, 0)) == (True, True)
    assert keeps((b, t, 32, 256), (b, t, 8, 256)) == (True, True)
  with tokamax.config.cross_compile("NVIDIA A100"):
    assert keeps(q, kv) == (True, True)


@pytest.mark.parametrize("causal, t", sorted(_GQA_H128_CUDNN_KEEPS_INFERENCE))
def test_gqa_head_dim_128_infers_with_mosaic(causal, t):
  """Plain GQA/MQA at head dim 128: "mosaic" without a gradient at the
  measured lengths; cuDNN with one, and for equal head counts on a large
  grid or extras."""
  from tokamax.ops.attention import cudnn  # pylint: disable=g-import-not-at-top
  op = cudnn.CudnnDotProductAttention()
  keeps = functools.partial(_cudnn_keeps, op, is_causal=causal)
  expected = (True, _GQA_H128_CUDNN_KEEPS_INFERENCE[causal, t])
  b = 2 * _ROWS // (4 * t)
  q = (b, t, 4, 128)
  with tokamax.config.cross_compile("NVIDIA H200"):
    for kv_heads in (2, 1):  # GQA, MQA
      assert keeps(q, (b, t, kv_heads, 128)) == expected, kv_heads
    assert keeps(q) == (True, True)  # not GQA
    kv = (b, t, 2, 128)
    lens = jnp.full((b,), 100, jnp.int32)
    for extra in (dict(local_window_size=(256, 0)), dict(key_value_seq_lengths=lens),
                  dict(bias=jnp.ones((1, 4, 1, t), jnp.bfloat16))):
      assert keeps(q, kv, **extra) == (True, True), extra
    assert keeps((b, t, 4, 256), (b, t, 2, 256)) == (True, True)
  with tokamax.config.cross_compile("NVIDIA A100"):  # no "mosaic" there
    assert keeps(q, kv) == (True, True)


def test_none_picks_per_mode_between_mosaic_and_cudnn(monkeypatch):
  """Plain head dim 64 on a large grid: causal T = 1024 trains with "mosaic"
  (1.18x) and infers with cuDNN ("mosaic" forward 0.92x); non-causal
  T = 3072 the reverse (0.99x, 1.09x); non-causal T = 2048 "mosaic" for
  both; MQA at head dim 128 trains with cuDNN and infers with "mosaic";
  a small causal head-dim-128 grid takes "mosaic" for both."""
  from tokamax.ops.attention import cudnn  # pylint: disable=g-import-not-at-top
  # cuDNN's own check asks jax.nn, which has no cuDNN on this CPU machine.
  monkeypatch.setattr(cudnn.CudnnDotProductAttention, "check_supported",
                      lambda self, ba: None)

  select = lambda q_shape, kv_shape=None, **kw: _on_abstract(
      lambda q, k, v: dispatch.select("dot_product_attention", None, (q, k, v), kw).op,
      q_shape, kv_shape)

  rows_of = lambda t: (_ROWS // (2 * t), t, 2, 64)
  with tokamax.config.cross_compile("NVIDIA H200"):
    op = select(rows_of(1024), is_causal=True)
    assert (op.implementation, op.vjp.implementation) == ("mosaic", "mosaic")
    assert op.inference.implementation == "cudnn"
    op = select(rows_of(3072))
    assert (op.implementation, op.inference.implementation) == ("cudnn", "mosaic")
    op = select(rows_of(2048))
    assert (op.implementation, op.inference) == ("mosaic", None)
    op = select(rows_of(8192), is_causal=True)
    assert (op.implementation, op.inference) == ("cudnn", None)
    op = select((1, 4096, 4, 128), (1, 4096, 1, 128))
    assert (op.implementation, op.inference.implementation) == ("cudnn", "mosaic")
    op = select((1, 4096, 8, 128), is_causal=True)
    assert (op.implementation, op.inference) == ("mosaic", None)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, t, heads, h, inference, training", [
    (True, 1024, (2, 2), 64, "cudnn", "mosaic"),
    (False, 3072, (2, 2), 64, "cudnn", "cudnn"),  # a small grid (6144 rows)
    (True, 2048, (4, 1), 128, "mosaic", "mosaic"),  # 8192 rows
    (False, 4096, (4, 1), 128, "mosaic", "cudnn"),
    (True, 4096, (32, 32), 128, "mosaic", "cudnn"),  # 131072 rows
    (True, 4096, (8, 8), 128, "mosaic", "mosaic"),  # 32768 rows
])
def test_none_runs_per_mode_kernels_on_the_gpu(causal, t, heads, h, inference, training):
  """On a Hopper GPU: the kernels each mode compiles (custom-call targets),
  and both modes' values and the gradient against the f64 reference."""
  targets = {"cudnn": "__cudnn$fmha", "mosaic": "mosaic_gpu"}
  ks = jax.random.split(jax.random.key(t), 4)
  n, kv_heads = heads
  q, dout, k, v = (jax.random.normal(key, (1, t, n_, h), jnp.bfloat16)
                   for key, n_ in zip(ks, (n, n, kv_heads, kv_heads)))
  attn = lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal)

  def train(q, k, v):
    out, pullback = jax.vjp(attn, q, k, v)
    return out, pullback(dout)

  for fn, impl in ((attn, inference), (train, training)):
    hlo = jax.jit(fn).lower(q, k, v).as_text()
    other = targets["cudnn" if impl == "mosaic" else "mosaic"]
    assert targets[impl] in hlo and other not in hlo, impl
  # The f64 reference one kv head (and its query heads) at a time: its
  # [T, T] f64 scores per head stay small on a GPU shared by test workers.
  group = n // kv_heads

  def ref_out_and_grads(j):
    qs, ks = slice(j * group, (j + 1) * group), slice(j, j + 1)
    ref = lambda q, k, v: reference.attention(q, k, v, is_causal=causal)
    out, pullback = jax.vjp(ref, *(reference.f64(x) for x in (q[:, :, qs], k[:, :, ks],
                                                               v[:, :, ks])))
    return out, pullback(reference.f64(dout[:, :, qs]))

  parts = [ref_out_and_grads(j) for j in range(kv_heads)]
  ref_out = jnp.concatenate([o for o, _ in parts], axis=2)
  ref_grads = [jnp.concatenate([g[i] for _, g in parts], axis=2) for i in range(3)]
  out, grads = jax.jit(train)(q, k, v)
  fwd_tol, grad_tol = reference.TOLERANCE[jnp.dtype(jnp.bfloat16)]
  reference.assert_close(jax.jit(attn)(q, k, v), ref_out, fwd_tol, "inference")
  reference.assert_close(out, ref_out, fwd_tol, "training")
  for g, gr, name in zip(grads, ref_grads, "qkv"):
    reference.assert_close(g, gr, grad_tol, f"d{name}")


# --- gradients not asked for: Op.skip_grads, symbolic zeros ------------------

_SEEN_SKIPS: list = []


@dataclasses.dataclass(frozen=True)
class _RecordingVjp(xla_chunked.ChunkedDotProductAttentionVjp):
  """Records the skip_grads it is called with."""

  def _fwd(self, **kwargs):
    _SEEN_SKIPS.append(self.skip_grads)
    return super()._fwd(**kwargs)


def test_vjp_learns_which_arrays_are_not_differentiated():
  op = xla_chunked.ChunkedDotProductAttention(vjp=_RecordingVjp())
  q, k, v = _qkv(3)
  bias = jax.random.normal(jax.random.key(9), (1, q.shape[2], q.shape[1], k.shape[1]))
  ref = lambda q, k, v, bias: jnp.sum(jnp.sin(reference.attention(q, k, v, bias=bias)))
  f = lambda q, k, v, bias: jnp.sum(jnp.sin(op(q, k, v, bias=bias)))
  _SEEN_SKIPS.clear()
  with jax.default_matmul_precision("highest"):
    g = jax.grad(f)(q, k, v, bias)  # only q: k, v and bias are constants
    g_remat = jax.vmap(jax.grad(jax.checkpoint(f)), (0, None, None, None))(
        q[None], k, v, bias)[0]  # under vmap and remat too
    g_bias = jax.grad(f, argnums=3)(q, k, v, bias)
  assert _SEEN_SKIPS == [frozenset({"key", "value", "bias"})] * 2 + [
      frozenset({"query", "key", "value"})]
  r, r_bias = (jax.grad(ref, argnums=a)(*map(reference.f64, (q, k, v, bias)))
               for a in (0, 3))
  reference.assert_close(g, r, 1e-4, "dq")
  reference.assert_close(g_remat, r, 1e-4, "dq under vmap and remat")
  reference.assert_close(g_bias, r_bias, 1e-4, "dbias")


def test_zero_output_cotangent_skips_the_vjp():
  op = xla_chunked.ChunkedDotProductAttention(vjp=_RecordingVjp())
  q, k, v = _qkv(4)
  _SEEN_SKIPS.clear()
  # The attention output reaches the loss only through stop_gradient.
  g = jax.grad(lambda q: jnp.sum(jax.lax.stop_gradient(op(q, k, v))) + jnp.sum(q))(q)
  np.testing.assert_array_equal(np.asarray(g), 1.0)
  assert not _SEEN_SKIPS
