"""layer_norm: one test base, run for every implementation."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tests import reference

F32, BF16, F16, F64 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64

# (x shape, axis, with scale, with offset, scale_offset, subtract_mean)
CASES = {
    "layer_norm": ((4, 33, 96), -1, True, True, 0.0, True),
    "rms_norm": ((4, 33, 96), -1, True, False, 0.0, False),
    "no_params": ((8, 80), -1, False, False, 0.0, True),
    "offset_only": ((8, 80), -1, False, True, 0.0, True),
    "scale_offset": ((8, 80), -1, True, True, 1.0, True),
    "rms_scale_offset": ((8, 80), -1, True, False, 1.0, False),
    "axis0": ((48, 5, 3), 0, True, True, 0.0, True),
    "axis_middle": ((3, 72, 5), 1, True, True, 0.5, True),
    "rank1": ((130,), 0, True, True, 0.0, True),
    "odd_features": ((6, 7, 77), -1, True, True, 0.0, False),
}


def make_inputs(shape, axis, with_scale, with_offset, dtype, seed, param_dtype=F32):
  ks = jax.random.split(jax.random.key(seed), 4)
  f = shape[axis]
  x = (jax.random.normal(ks[0], shape, F32) * 2 + 0.5).astype(dtype)
  scale = jax.random.normal(ks[1], (f,), param_dtype) if with_scale else None
  offset = jax.random.normal(ks[2], (f,), param_dtype) if with_offset else None
  return x, scale, offset, ks[3]


class LayerNormTestBase:
  implementation: str = "xla"
  dtypes = (F32, BF16, F16)
  seed = 0

  def layer_norm(self, *args, **kwargs):
    return tokamax.layer_norm(*args, implementation=self.implementation, **kwargs)

  def check(self, name, dtype, seed=None, param_dtype=F32):
    shape, axis, ws, wo, so, sm = CASES[name]
    seed = self.seed if seed is None else seed
    x, scale, offset, ct_key = make_inputs(shape, axis, ws, wo, dtype, seed, param_dtype)
    static = dict(axis=axis, scale_offset=so, subtract_mean=sm, epsilon=1e-5)
    fwd_tol, grad_tol = reference.TOLERANCE[jnp.dtype(dtype)]

    y = jax.jit(lambda *a: self.layer_norm(*a, **static))(x, scale, offset)
    assert y.dtype == x.dtype and y.shape == x.shape
    ref = reference.layer_norm(x, scale, offset, **static)
    reference.assert_close(y, ref, fwd_tol, "forward")

    ct = jax.random.normal(ct_key, shape, F32)
    params = {"x": x, "scale": scale, "offset": offset}
    diff = {k: v for k, v in params.items() if v is not None}

    def loss(d):
      p = {**params, **d}
      out = self.layer_norm(p["x"], p["scale"], p["offset"], **static)
      return jnp.sum(out.astype(F32) * ct)

    def ref_loss(d):
      p = {**params, **d}
      return jnp.sum(reference.layer_norm(p["x"], p["scale"], p["offset"], **static) * ct)

    grads = jax.jit(jax.grad(loss))(diff)
    ref_grads = jax.grad(ref_loss)({k: reference.f64(v) for k, v in diff.items()})
    for k in diff:
      assert grads[k].dtype == diff[k].dtype
      tol = max(grad_tol, reference.TOLERANCE[jnp.dtype(diff[k].dtype)][1])
      reference.assert_close(grads[k], ref_grads[k], tol, f"d{k}")

  @pytest.mark.parametrize("name", sorted(CASES))
  @pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=lambda d: jnp.dtype(d).name)
  def test_case(self, name, dtype):
    if dtype not in self.dtypes:
      shape, axis, ws, wo, *_ = CASES[name]
      x, scale, offset, _ = make_inputs(shape, axis, ws, wo, dtype, 0)
      with pytest.raises(NotImplementedError, match=self.implementation):
        self.layer_norm(x, scale, offset, axis=axis)
      return
    self.check(name, dtype)

  def test_bf16_params(self):
    self.check("layer_norm", BF16, param_dtype=BF16)

  def test_fresh_inputs(self):
    for seed in (5, 6):
      self.check("layer_norm", self.dtypes[0], seed=seed)

  def test_vmap(self):
    x, scale, offset, _ = make_inputs((3, 4, 64), -1, True, True, self.dtypes[0], 1)
    f = lambda xi: self.layer_norm(xi, scale, offset)
    y = jax.vmap(f)(x)
    ref = reference.layer_norm(x, scale, offset)
    reference.assert_close(y, ref, reference.TOLERANCE[jnp.dtype(x.dtype)][0])
    g = jax.vmap(jax.grad(lambda xi: jnp.sum(jnp.sin(f(xi).astype(F32)))))(x)
    g_ref = jax.grad(
        lambda xr: jnp.sum(jnp.sin(reference.layer_norm(xr, scale, offset)))
    )(reference.f64(x))
    reference.assert_close(g, g_ref, reference.TOLERANCE[jnp.dtype(x.dtype)][1])

  @hypothesis.settings(max_examples=8, deadline=None)
  @hypothesis.given(
      rows=st.integers(1, 9), features=st.integers(1, 70),
      subtract_mean=st.booleans(), eps=st.sampled_from([1e-6, 1e-3, 0.1]),
  )
  def test_hypothesis(self, rows, features, subtract_mean, eps):
    x, scale, offset, _ = make_inputs((rows, features), -1, True, True, self.dtypes[0], 3)
    y = self.layer_norm(x, scale, offset, epsilon=eps, subtract_mean=subtract_mean)
    ref = reference.layer_norm(x, scale, offset, epsilon=eps, subtract_mean=subtract_mean)
    reference.assert_close(y, ref, reference.TOLERANCE[jnp.dtype(x.dtype)][0])

  @pytest.mark.parametrize(
      "args, kwargs, error, match",
      [
          ((np.ones((4, 8), np.int32),), {}, TypeError, "floating"),
          (([1.0, 2.0],), {}, TypeError, "array"),
          ((jnp.ones(()),), {}, ValueError, "at least one"),
          ((jnp.ones((4, 8)), jnp.ones((7,))), {}, ValueError, r"shape \(8,\)"),
          ((jnp.ones((4, 8)), None, jnp.ones((4, 8))), {}, ValueError, "offset"),
          ((jnp.ones((4, 8)), jnp.ones((8,), jnp.int32)), {}, TypeError, "scale"),
          ((jnp.ones((4, 8)),), dict(axis=2), ValueError, "out of range"),
          ((jnp.ones((4, 8)),), dict(axis=1.0), TypeError, "axis"),
          ((jnp.ones((4, 8)),), dict(epsilon=-1.0), ValueError, "epsilon"),
          ((jnp.ones((4, 8)),), dict(subtract_mean="yes"), TypeError, "subtract_mean"),
          ((jnp.ones((4, 8)),), dict(scale_offset=None), TypeError, "scale_offset"),
      ],
  )
  def test_bad_input(self, args, kwargs, error, match):
    with pytest.raises(error, match=match):
      self.layer_norm(*args, **kwargs)


class TestXla(LayerNormTestBase):
  implementation = "xla"
  dtypes = (F32, BF16, F16, F64)


def test_scale_offset_is_ignored_without_scale():
  x = jax.random.normal(jax.random.key(0), (4, 16))
  np.testing.assert_allclose(
      tokamax.layer_norm(x, None, None, scale_offset=1.0),
      tokamax.layer_norm(x, None, None), rtol=1e-6,
  )
