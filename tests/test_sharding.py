"""Ops compose with jit over NamedSharding inputs and with shard_map.

Runs on 8 forced host devices (see conftest.py): batch sharded 4 ways, heads
2 ways; forward and gradient compared with the unsharded call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import tokamax
from tokamax._src import pallas_triton
from tests import reference

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest)"
)

SPEC = P("data", None, "model", None)  # [B, T, N, H]: batch and heads


@functools.cache
def _mesh(axis_type):
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


def _inputs(seed, shape=(8, 24, 4, 16)):
  ks = jax.random.split(jax.random.key(seed), 4)
  q, k, v = (jax.random.normal(kk, shape, jnp.float32) for kk in ks[:3])
  ct = jax.random.normal(ks[3], shape, jnp.float32)
  return q, k, v, ct


def _attention_loss(impl):
  def loss(q, k, v, ct):
    out = tokamax.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    return jnp.sum(out * ct)
  return loss


def _layer_norm_loss(impl):
  def loss(x, scale, offset, ct):
    return jnp.sum(tokamax.layer_norm(x, scale, offset, implementation=impl) * ct)
  return loss


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("impl", ["xla", "xla_chunked", "triton"])
def test_attention_jit_with_named_sharding(impl, axis_type):
  """Triton (interpret mode here) takes Auto-sharded inputs (XLA cannot split
  its custom call: it runs on gathered arrays) and refuses explicitly sharded
  ones; per-shard kernels are what shard_map is for."""
  mesh = _mesh(axis_type)
  q, k, v, ct = _inputs(0)
  loss = _attention_loss(impl)
  with pallas_triton.interpret_mode(impl == "triton"):
    want = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, ct)
  sharding = NamedSharding(mesh, SPEC)
  args = [jax.device_put(a, sharding) for a in (q, k, v, ct)]
  with jax.set_mesh(mesh), pallas_triton.interpret_mode(impl == "triton"):
    if impl == "triton" and axis_type == jax.sharding.AxisType.Explicit:
      with pytest.raises(NotImplementedError, match="triton.*shard_map"):
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
      return
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
  if impl != "triton":  # a Triton custom call runs unpartitioned (gathered)
    assert got[1][0].sharding.is_equivalent_to(sharding, 4)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(got[1], want[1]):
    reference.assert_close(g, w, 1e-5)


@pytest.mark.parametrize("impl", ["xla", "xla_chunked", "triton"])
def test_attention_inside_shard_map(impl):
  """Per-shard kernels (Triton in interpret mode here) forward and gradient."""
  with pallas_triton.interpret_mode(impl == "triton"):
    _check_attention_inside_shard_map(impl)


def _check_attention_inside_shard_map(impl):
  mesh = _mesh(jax.sharding.AxisType.Explicit)
  q, k, v, ct = _inputs(1)
  loss = _attention_loss(impl)
  want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, ct)

  def per_shard(q, k, v, ct):
    return jax.lax.psum(loss(q, k, v, ct), ("data", "model"))

  args = [jax.device_put(a, NamedSharding(mesh, SPEC)) for a in (q, k, v, ct)]
  sharded = _shard_map(impl, per_shard, mesh, (SPEC,) * 4, args)
  got = jax.jit(jax.grad(sharded, argnums=(0, 1, 2)))(*args)
  for g, w in zip(got, want):
    reference.assert_close(g, w, 1e-5)


def _shard_map(impl, f, mesh, in_specs, args):
  """jax.shard_map(f); for "triton", checks that the gradient traces with the
  varying-axes check (the kernels declare their outputs' mesh axes) and
  returns the unchecked version: Pallas' CPU interpreter itself trips that
  check (its `pad` mixes varying and invariant values), which the compiled
  GPU kernels do not use."""
  sharded = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=P())
  if impl != "triton":
    return sharded
  argnums = tuple(range(len(in_specs)))
  jax.jit(jax.grad(sharded, argnums=argnums)).trace(*args)
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=P(),
                       check_vma=False)


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit], ids=["auto", "explicit"])
def test_layer_norm_sharded(axis_type, impl):
  """jit over sharded inputs and shard_map (Triton in interpret mode here)."""
  with pallas_triton.interpret_mode(impl == "triton"):
    _check_layer_norm_sharded(axis_type, impl)


def _check_layer_norm_sharded(axis_type, impl):
  mesh = _mesh(axis_type)
  x, _, _, ct = _inputs(2)
  scale = jax.random.normal(jax.random.key(7), (16,), jnp.float32)
  offset = jax.random.normal(jax.random.key(8), (16,), jnp.float32)
  loss = _layer_norm_loss(impl)
  want = jax.grad(loss, argnums=(0, 1, 2))(x, scale, offset, ct)
  sharding = NamedSharding(mesh, SPEC)
  replicated = NamedSharding(mesh, P())
  args = (jax.device_put(x, sharding), jax.device_put(scale, replicated),
          jax.device_put(offset, replicated), jax.device_put(ct, sharding))
  explicit = axis_type == jax.sharding.AxisType.Explicit
  with jax.set_mesh(mesh):
    if impl == "triton" and explicit:
      # One custom call over whole arrays cannot take explicitly sharded
      # inputs: a clear refusal (None falls back to XLA, tested below).
      with pytest.raises(NotImplementedError, match="triton.*shard_map"):
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
      loss_none = _layer_norm_loss(None)
      got = jax.jit(jax.grad(loss_none, argnums=(0, 1, 2)))(*args)
    else:
      got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
  for g, w in zip(got, want):
    reference.assert_close(g, w, 1e-5)

  per_shard = lambda x, s, o, c: jax.lax.psum(loss(x, s, o, c), ("data", "model"))
  sm = _shard_map(impl, per_shard, mesh, (SPEC, P(), P(), SPEC), args)
  got = jax.jit(jax.grad(sm, argnums=(0, 1, 2)))(*args)
  for g, w in zip(got, want):
    reference.assert_close(g, w, 1e-5)


def test_mosaic_attention_inside_shard_map_traces_with_varying_axes_check():
  """The Mosaic forward and VJP kernels inside shard_map, traced for an
  H200: its padding and outputs declare the inputs' mesh axes, so the
  gradient traces under shard_map's varying-axes check. (Running it needs
  the GPU: the Mosaic GPU interpreter does not support several devices.)"""
  mesh = _mesh(jax.sharding.AxisType.Explicit)

  def per_shard(q, k, v, ct):
    out = tokamax.dot_product_attention(q, k, v, is_causal=True,
                                        implementation="mosaic")
    return jax.lax.psum(jnp.sum(out.astype(jnp.float32) * ct), ("data", "model"))

  spec = jax.ShapeDtypeStruct((8, 24, 4, 64), jnp.bfloat16,
                              sharding=NamedSharding(mesh, SPEC))
  f = jax.shard_map(per_shard, mesh=mesh, in_specs=(SPEC,) * 4, out_specs=P())
  with tokamax.config.cross_compile("NVIDIA H200"):
    text = str(jax.jit(jax.grad(f, argnums=(0, 1, 2))).trace(
        spec, spec, spec, spec).jaxpr)
  # The forward, dk/dv and dq Mosaic kernels; no Triton kernel.
  assert "pallas_call" not in text and text.count("mpmd_map[") == 3


def test_mosaic_layer_norm_inside_shard_map_traces_with_varying_axes_check():
  """The Mosaic layer_norm forward (saving statistics) and the Triton
  backward inside shard_map, traced for an H200, under shard_map's
  varying-axes check (a replicated scale's cotangent is psummed)."""
  mesh = _mesh(jax.sharding.AxisType.Explicit)

  def per_shard(x, scale, ct):
    out = tokamax.layer_norm(x, scale, implementation="mosaic")
    return jax.lax.psum(jnp.sum(out.astype(jnp.float32) * ct), ("data", "model"))

  spec = jax.ShapeDtypeStruct((8, 24, 4, 1024), jnp.bfloat16,
                              sharding=NamedSharding(mesh, SPEC))
  scale = jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=NamedSharding(mesh, P()))
  f = jax.shard_map(per_shard, mesh=mesh, in_specs=(SPEC, P(), SPEC), out_specs=P())
  with tokamax.config.cross_compile("NVIDIA H200"):
    text = str(jax.jit(jax.grad(f, argnums=(0, 1))).trace(spec, scale, spec).jaxpr)
  # The Mosaic forward and the Triton backward kernel.
  assert text.count("mpmd_map[") == 1 and text.count("pallas_call[") == 1
