"""layer_norm: one test base, run for every implementation."""

from __future__ import annotations

import dataclasses
import functools
import math
from unittest import mock
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
    # Layer norm over one feature: y = offset, dx exactly 0 (rstd = 1/sqrt(eps)
    # amplifies any roundoff in it).
    "one_feature": ((3, 1, 7), 1, True, True, 0.0, True),
    "one_feature_rows": ((5, 1), -1, True, True, 0.0, True),
}


def make_inputs(shape, axis, with_scale, with_offset, dtype, seed, param_dtype=F32):
  ks = jax.random.split(jax.random.key(seed), 4)
  f = shape[axis]
  x = (jax.random.normal(ks[0], shape, F32) * 2 + 0.5).astype(dtype)
  scale = jax.random.normal(ks[1], (f,), param_dtype) if with_scale else None
  offset = jax.random.normal(ks[2], (f,), param_dtype) if with_offset else None
  return x, scale, offset, ks[3]


def check_jumping_means(implementation, dtype, columns=False, op=None):
  """Residual mean and rstd vs f64 for rows whose means jump by up to 500
  standard deviations from one row to the next, a constant row and a row
  of tiny spread, and a row whose first 512 features sit 1000 sigma above
  the rest: statistics that cancel (one-pass sums, a poor shift) lose
  ~(mean/sigma)^2 ulps and fail this. F = 5120: a row spans a warpgroup in
  "mosaic". `columns`: the rows as the columns of a [1, F, 11] x normalised
  over axis 1 (the [pre, F, post] statistics). `op`: this pinned op instead
  of the implementation's choice."""
  mus, sigmas = [0, 200, 200, -300, 0, 7, 7, 5, 1e3, 1e3, 0], [1, 1, 1, 2, 1e-3, 0, 1, 1, 2, 2, 1]
  z = jax.random.normal(jax.random.key(4), (len(mus), 5120), F32)
  x = z * jnp.array(sigmas)[:, None] + jnp.array(mus)[:, None]
  x = x.at[-1, :512].add(1e3).astype(dtype)
  kwargs = dict(epsilon=1e-6)
  if columns:
    x, kwargs = x.T[None], dict(kwargs, axis=1)
  ba = (dispatch.select("layer_norm", implementation, (x,), kwargs) if op is None
        else op.bind(x, **kwargs))
  _, (mean, rstd) = ba.op.call_bound(ba, return_residuals=True)
  x64 = np.asarray(x[0].T if columns else x, np.float64)
  want_mean = x64.mean(axis=1)
  want_rstd = 1 / np.sqrt(((x64 - want_mean[:, None]) ** 2).mean(axis=1) + 1e-6)
  assert np.all(np.isfinite(np.asarray(rstd)))
  np.testing.assert_allclose(np.ravel(rstd), want_rstd, rtol=1e-5)
  np.testing.assert_allclose(np.ravel(mean), want_mean, rtol=1e-6, atol=1e-5)


class LayerNormTestBase:
  implementation: str = "xla"
  dtypes = (F32, BF16, F16)
  # CASES names the implementation refuses (NotImplementedError expected).
  unsupported_cases = frozenset()
  jvp_supported = False  # forward-mode autodiff runs (else: refused by name)
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
    if dtype not in self.dtypes or name in self.unsupported_cases:
      shape, axis, ws, wo, *_ = CASES[name]
      x, scale, offset, _ = make_inputs(shape, axis, ws, wo, dtype, 0)
      with pytest.raises(NotImplementedError, match=self.implementation):
        self.layer_norm(x, scale, offset, axis=axis)
      return
    self.check(name, dtype)

  def test_bf16_params(self):
    self.check("layer_norm", BF16, param_dtype=BF16)

  def test_statistics_of_rows_with_jumping_means(self):
    check_jumping_means(self.implementation, self.dtypes[0])

  def test_statistics_of_columns_with_jumping_means(self):
    """The same normalised over axis 1 of [1, F, 10] ("triton": statistics
    merged over feature chunks and split programs, 40 chunks in 8 splits in
    interpret mode)."""
    if self.unsupported_cases.intersection(NON_LAST_AXIS):
      pytest.skip(f"{self.implementation} normalises the last axis only")
    check_jumping_means(self.implementation, self.dtypes[0], columns=True)

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

  def test_forward_mode(self):
    """jax.jvp in every argument and a jvp of a grad (forward over reverse,
    as in jax.hessian) against the f64 reference. Implementations whose
    forward JAX can differentiate run it; the kernels (custom VJPs) refuse by
    name, and None falls back to one that can."""
    dtype = F32 if F32 in self.dtypes else self.dtypes[0]
    x, scale, offset, key = make_inputs((5, 3, 48), -1, True, True, dtype, 8)
    primals = (x, scale, offset)
    tangents = tuple(jax.random.normal(k, a.shape, F32).astype(a.dtype)
                     for k, a in zip(jax.random.split(key, 3), primals))

    def run(layer_norm, p, t):
      _, t_out = jax.jvp(layer_norm, p, t)
      grad = jax.grad(lambda *a: jnp.sum(jnp.sin(layer_norm(*a).astype(p[0].dtype))),
                      argnums=(0, 1, 2))
      _, hvp = jax.jvp(grad, p, t)
      return t_out, hvp

    t_ref, hvp_ref = run(reference.layer_norm, tuple(map(reference.f64, primals)),
                         tuple(map(reference.f64, tangents)))
    candidates = reference.forward_mode_candidates(
        self.layer_norm, functools.partial(tokamax.layer_norm, implementation=None),
        self.jvp_supported, self.implementation, lambda: self.layer_norm(*primals),
        lambda layer_norm: run(layer_norm, primals, tangents))
    _, grad_tol = reference.TOLERANCE[jnp.dtype(dtype)]
    for layer_norm in candidates:
      t_out, hvp = run(layer_norm, primals, tangents)
      reference.assert_close(t_out, t_ref, grad_tol, "output tangent")
      for name, h, h_ref in zip(("x", "scale", "offset"), hvp, hvp_ref):
        reference.assert_close(h, h_ref, 2 * grad_tol, f"hvp {name}")

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
  jvp_supported = True


def test_scale_offset_is_ignored_without_scale():
  x = jax.random.normal(jax.random.key(0), (4, 16))
  np.testing.assert_allclose(
      tokamax.layer_norm(x, None, None, scale_offset=1.0),
      tokamax.layer_norm(x, None, None), rtol=1e-6,
  )


# --- "triton": interpret mode on CPU, lowering for CUDA, real GPU ---------

from tokamax._src import dispatch  # noqa: E402
from tokamax._src import pallas_triton  # noqa: E402
from tokamax.ops.normalization import triton as triton_ln  # noqa: E402
from tokamax.ops.normalization import xla as xla_ln  # noqa: E402

TRITON_TARGET = "__gpu$xla.gpu.triton"
ON_GPU = jax.default_backend() == "gpu"
NON_LAST_AXIS = ("axis0", "axis_middle")


def _own_hypothesis_test(features=st.integers(1, 70)):
  """The base's test_hypothesis as a new function object per subclass.

  Hypothesis refuses one @given test run from several classes (its
  differing_executors health check), so each kernel class gets its own.
  """
  inner = LayerNormTestBase.test_hypothesis.hypothesis.inner_test

  @hypothesis.settings(max_examples=8, deadline=None)
  @hypothesis.given(
      rows=st.integers(1, 9), features=features,
      subtract_mean=st.booleans(), eps=st.sampled_from([1e-6, 1e-3, 0.1]),
  )
  def test_hypothesis(self, rows, features, subtract_mean, eps):
    inner(self, rows, features, subtract_mean, eps)

  return test_hypothesis


class TestTritonInterpret(LayerNormTestBase):
  """The whole base with the Triton kernels in interpret mode (CPU)."""

  implementation = "triton"
  dtypes = (F32, BF16, F16)
  test_hypothesis = _own_hypothesis_test()

  @pytest.fixture(autouse=True, scope="class")
  @classmethod
  def _interpret(cls):
    # Class scope: hypothesis refuses function-scoped fixtures.
    with triton_ln.interpret_mode():
      yield

  @hypothesis.settings(max_examples=10, deadline=None)
  @hypothesis.given(
      pre=st.integers(1, 3), features=st.integers(1, 100), post=st.integers(2, 40),
      subtract_mean=st.booleans(), column_forward=st.sampled_from([None, True, False]),
      programs_per_sm=st.sampled_from([1, 2, 4, 64]),
  )
  def test_hypothesis_non_last_axis(self, pre, features, post, subtract_mean,
                                    column_forward, programs_per_sm):
    """Random [pre, F, post] views (axis 1) through either forward path (or
    the shape's rule), 16-feature chunks (up to 7), the F loop unsplit, split
    evenly or with a shorter last split, vs f64: y and every gradient.
    epsilon 1e-3: at F = 1 rstd = eps^-1/2 scales the f32 roundoff of
    g - sum(g) (FMA-contracted) past the gradient tolerance at 1e-6."""
    with mock.patch.multiple(
        triton_ln, COLUMN_FORWARD=column_forward, _COLUMN_TILE_BYTES=512,
        _SPLIT_PROGRAMS_PER_SM=programs_per_sm, _num_sms=lambda: 1):
      shape = (pre, features, post)
      x, scale, offset, ct_key = make_inputs(shape, 1, True, True, F32, pre * post)
      ct = jax.random.normal(ct_key, shape, F32)
      static = dict(axis=1, subtract_mean=subtract_mean, epsilon=1e-3)
      y, pullback = jax.vjp(lambda *a: self.layer_norm(*a, **static), x, scale, offset)
      grads = pullback(ct)
    ref, ref_pullback = jax.vjp(lambda *a: reference.layer_norm(*a, **static),
                                *map(reference.f64, (x, scale, offset)))
    reference.assert_close(y, ref, 2e-5, "forward")
    for name, g, r in zip(("dx", "dscale", "doffset"), grads,
                          ref_pullback(reference.f64(ct))):
      reference.assert_close(g, r, 1e-4, name)

  def test_statistics_of_columns_with_jumping_means_in_slabs(self, monkeypatch):
    """The base's column test through the one-kernel [Fp, block] forward."""
    monkeypatch.setattr(triton_ln, "COLUMN_FORWARD", False)
    check_jumping_means(self.implementation, self.dtypes[0], columns=True)

  @pytest.mark.parametrize("subtract_mean, tile_bytes", [
      (True, 512), (False, 512), (True, 16 * 1024)])
  @pytest.mark.parametrize("shape, axis", [((7, 45, 37), 1), ((45, 3, 37), 0),
                                           ((7, 48, 37), 1)])
  @pytest.mark.parametrize("column_forward", [True, False])
  def test_non_last_axis_blocks_and_chunks(self, monkeypatch, shape, axis,
                                           subtract_mean, tile_bytes, column_forward):
    """[pre, F, post] view: column blocks not dividing post, F not a power of
    2; feature chunks of the column kernels: 16 features (512-byte tiles of 8
    f32 columns) of 45 (the last chunk partial) or 48, or one chunk of 64;
    the chunk loop split over programs: 2 at F = 45 and 48 (the last
    streaming one chunk; at 48 no feature mask stops a trip too many), 3 of
    one chunk at [45, 111]. Forward by the column kernels or by slabs."""
    monkeypatch.setattr(triton_ln, "_COLUMN_TILE_BYTES", tile_bytes)
    monkeypatch.setattr(triton_ln, "COLUMN_FORWARD", column_forward)
    # Split the chunk loop: 64 programs wanted on one "SM".
    monkeypatch.setattr(triton_ln, "_SPLIT_PROGRAMS_PER_SM", 64)
    monkeypatch.setattr(triton_ln, "_num_sms", lambda: 1)
    config = triton_ln.TritonLayerNormConfig(block_rows=8, num_warps=4)
    op = triton_ln.TritonLayerNorm(
        config=config, vjp=triton_ln.TritonLayerNormVjp(config=config))
    x, scale, offset, ct_key = make_inputs(shape, axis, True, True, F32, 5)
    ct = jax.random.normal(ct_key, x.shape, F32)
    static = dict(axis=axis, subtract_mean=subtract_mean, scale_offset=1.0)
    y = op(x, scale, offset, **static)
    reference.assert_close(
        y, reference.layer_norm(x, scale, offset, **static), 2e-5, "forward")
    grads = jax.grad(lambda *a: jnp.sum(op(*a, **static) * ct), argnums=(0, 1, 2))(
        x, scale, offset)
    ref_grads = jax.grad(
        lambda *a: jnp.sum(reference.layer_norm(*a, **static) * ct), argnums=(0, 1, 2)
    )(*map(reference.f64, (x, scale, offset)))
    for name, g, r in zip(("dx", "dscale", "doffset"), grads, ref_grads):
      reference.assert_close(g, r, 1e-4, name)

  def test_f64_params_refused(self):
    x = jnp.ones((4, 8), F32)
    with pytest.raises(NotImplementedError, match="triton.*fp64"):
      self.layer_norm(x, jnp.ones((8,), F64))

  @pytest.mark.parametrize("shape, axis, with_offset, subtract_mean, dtype", [
      ((3, 100, 5), 1, True, True, F32), ((100, 2), 0, False, False, BF16),
      ((2, 130, 3), 1, True, True, F16)])
  def test_wide_non_last_axis(self, monkeypatch, shape, axis, with_offset,
                              subtract_mean, dtype):
    """A [pre, F, post] view wider than MAX_FEATURES (here 64) runs the
    column kernels forward and backward, even where a slab would cover post
    (post 2) or COLUMN_FORWARD asks for slabs, with any config: the
    heuristic's or one pinned without feature_chunk; 100 / 130 features in
    16-feature chunks (the last partly masked), the chunk loop split over
    programs; y and every gradient vs f64."""
    monkeypatch.setattr(triton_ln, "MAX_FEATURES", 64)
    monkeypatch.setattr(triton_ln, "COLUMN_FORWARD", False)
    monkeypatch.setattr(triton_ln, "_COLUMN_TILE_BYTES", 512)
    monkeypatch.setattr(triton_ln, "_num_sms", lambda: 1)
    post = math.prod(shape[axis + 1:])
    assert triton_ln._column_forward(post, shape[axis])
    x, scale, offset, ct_key = make_inputs(shape, axis, True, with_offset, dtype, 10)
    ct = jax.random.normal(ct_key, shape, F32)
    static = dict(axis=axis, subtract_mean=subtract_mean)
    check_against_f64(self.layer_norm, (x, scale, offset), ct, **static)
    pinned = triton_ln.TritonLayerNormConfig(block_rows=4, num_warps=4)
    op = triton_ln.TritonLayerNorm(config=pinned,
                                   vjp=triton_ln.TritonLayerNormVjp(config=pinned))
    check_against_f64(op, (x, scale, offset), ct, **static)

  @pytest.mark.parametrize("with_scale, with_offset, subtract_mean, dtype", [
      (True, True, True, F32), (True, False, False, BF16), (False, True, True, F16),
      (False, False, False, F32)])
  def test_wide_rows_chunked(self, monkeypatch, with_scale, with_offset, subtract_mean,
                             dtype):
    """Rows wider than MAX_FEATURES (here 64) run the chunked forward and the
    split backward with the heuristic configs (here 32- and 16-feature
    chunks, 100 features: the last chunk partly masked; 3 row blocks of 2
    per backward program); y and every gradient vs f64."""
    monkeypatch.setattr(triton_ln, "MAX_FEATURES", 64)
    monkeypatch.setattr(triton_ln, "_WIDE_FORWARD", (1, 4, 2, 3, 32))
    monkeypatch.setattr(triton_ln, "_WIDE_BACKWARD", (2, 4, 1, 0, 3, 16))
    monkeypatch.setattr(triton_ln, "_num_sms", lambda: 3)
    x, scale, offset, ct_key = make_inputs((37, 100), -1, with_scale, with_offset, dtype, 6)
    ct = jax.random.normal(ct_key, x.shape, F32)
    op = lambda *a, **k: self.layer_norm(*a, **k)
    check_against_f64(op, (x, scale, offset), ct, subtract_mean=subtract_mean)
    fwd = triton_ln.heuristic_config(37, 100, jnp.dtype(dtype).itemsize)
    bwd = triton_ln.heuristic_config(37, 100, jnp.dtype(dtype).itemsize, backward=True)
    assert (fwd.feature_chunk, bwd.feature_chunk) == (32, 16)

  def test_wide_rows_need_feature_chunk(self, monkeypatch):
    """A pinned config without feature_chunk is refused for wide rows,
    forward and backward, naming the field."""
    monkeypatch.setattr(triton_ln, "MAX_FEATURES", 64)
    x, scale, offset, _ = make_inputs((5, 100), -1, True, True, F32, 7)
    whole = triton_ln.TritonLayerNormConfig(block_rows=1, num_warps=4)
    chunked = dataclasses.replace(whole, feature_chunk=32)
    with pytest.raises(NotImplementedError, match="triton.*feature_chunk"):
      triton_ln.TritonLayerNorm(config=whole)(x, scale, offset)
    op = triton_ln.TritonLayerNorm(config=chunked,
                                   vjp=triton_ln.TritonLayerNormVjp(config=whole))
    with pytest.raises(NotImplementedError, match="triton.*feature_chunk"):
      jax.grad(lambda x: jnp.sum(op(x, scale, offset)))(x)

  @pytest.mark.parametrize("with_scale, with_offset, subtract_mean, dtype", [
      (False, False, True, F32), (True, False, False, BF16), (False, True, True, F16)])
  def test_split_backward_params(self, monkeypatch, with_scale, with_offset,
                                 subtract_mean, dtype):
    """The split backward (feature_chunk) without scale, offset or both,
    LayerNorm and RMSNorm, 16-bit x: 3 row blocks over 2 programs, 100
    features in 32-feature chunks (the last partly masked)."""
    monkeypatch.setattr(triton_ln, "_num_sms", lambda: 1)
    config = triton_ln.TritonLayerNormConfig(block_rows=4, num_warps=4, programs_per_sm=2,
                                             prefetch=0, feature_chunk=32)
    op = triton_ln.TritonLayerNorm(vjp=triton_ln.TritonLayerNormVjp(config=config))
    x, scale, offset, ct_key = make_inputs((11, 100), -1, with_scale, with_offset, dtype, 5)
    ct = jax.random.normal(ct_key, x.shape, F32)
    check_against_f64(op, (x, scale, offset), ct, subtract_mean=subtract_mean)

  @pytest.mark.parametrize("programs_per_sm, prefetch, loop_stages, feature_chunk", [
      (0, 1, 0, 0), (2, 1, 0, 0), (3, 0, 0, 0), (3, 1, 0, 0), (3, 2, 0, 0), (3, 0, 3, 0),
      (2, 0, 0, 16), (3, 0, 3, 32)])
  @pytest.mark.parametrize("subtract_mean", [True, False])
  def test_pinned_config_masked_rows_and_loop(self, monkeypatch, subtract_mean,
                                              programs_per_sm, prefetch, loop_stages,
                                              feature_chunk):
    """block_rows not dividing R, F not a power of 2, >1 backward loop trip;
    a looping forward (programs_per_sm > 0) with trips past the last tile,
    loading 0-2 tiles ahead (config.prefetch, forward and backward), or
    with loop_stages (named kernels; interpret mode ignores the schedule);
    the backward split in two kernels over 16- or 32-feature chunks (45
    features: the last chunk partly masked)."""
    # Backward with 1 "SM" and 4 warps: at most 8 programs (programs_per_sm
    # 0): 19 row blocks of 2 rows -> 3 loop trips over 7 programs (the last
    # ones partly masked); 2 or 3 per "SM" caps them: 10 / 7 trips.
    # Forward with 3 programs per "SM": 7 trips over 3 programs (2 masked).
    monkeypatch.setattr(triton_ln, "_num_sms", lambda: 1)
    config = triton_ln.TritonLayerNormConfig(
        block_rows=2, num_warps=4, programs_per_sm=programs_per_sm, prefetch=prefetch,
        loop_stages=loop_stages, feature_chunk=feature_chunk)
    op = triton_ln.TritonLayerNorm(
        config=config, vjp=triton_ln.TritonLayerNormVjp(config=config)
    )
    x, scale, offset, ct_key = make_inputs((37, 45), -1, True, True, F32, 4)
    ct = jax.random.normal(ct_key, x.shape, F32)
    static = dict(subtract_mean=subtract_mean, scale_offset=1.0)
    y = op(x, scale, offset, **static)
    ref = reference.layer_norm(x, scale, offset, **static)
    reference.assert_close(y, ref, 2e-5, "forward")
    grads = jax.grad(lambda *a: jnp.sum(op(*a, **static) * ct), argnums=(0, 1, 2))(
        x, scale, offset
    )
    ref_grads = jax.grad(
        lambda *a: jnp.sum(reference.layer_norm(*a, **static) * ct), argnums=(0, 1, 2)
    )(*map(reference.f64, (x, scale, offset)))
    for name, g, r in zip(("dx", "dscale", "doffset"), grads, ref_grads):
      reference.assert_close(g, r, 1e-4, name)

  @pytest.mark.parametrize("chunk", [512, 2048])
  def test_chunked_forward_statistics(self, chunk):
    """The chunked forward (feature_chunk) shifts its one-pass sums by the
    first chunk's mean: rows with jumping means and a first chunk far from
    the rest keep f64's mean and rstd (10 and 3 chunks of 5120 features)."""
    config = triton_ln.TritonLayerNormConfig(block_rows=2, num_warps=1, programs_per_sm=0,
                                             feature_chunk=chunk)
    check_jumping_means("triton", F32, op=triton_ln.TritonLayerNorm(config=config))

  def test_vjp_accepts_xla_residuals(self):
    """Same residual format as the XLA forward: (mean, rstd) keepdims."""
    x, scale, offset, ct_key = make_inputs((5, 3, 40), -1, True, True, BF16, 2)
    dout = jax.random.normal(ct_key, x.shape, F32).astype(BF16)
    static = dict(axis=2, epsilon=1e-5, scale_offset=0.0, subtract_mean=True)
    xla_op = xla_ln.XlaLayerNorm()
    _, residuals = xla_op.call_bound(
        xla_op.bind(x, scale, offset, **static), return_residuals=True
    )
    tri_op = triton_ln.TritonLayerNorm()
    _, tri_residuals = tri_op.call_bound(
        tri_op.bind(x, scale, offset, **static), return_residuals=True
    )
    for a, b in zip(residuals, tri_residuals):
      assert a.shape == b.shape == (5, 3, 1) and a.dtype == b.dtype
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    outs = []
    for vjp in (triton_ln.TritonLayerNormVjp(), xla_ln.LayerNormVjp()):
      outs.append(vjp.call_bound(
          vjp.bind(residuals, None, dout, x, scale, offset, **static)
      ))
    for k in ("x", "scale", "offset"):
      reference.assert_close(outs[0][k], outs[1][k].astype(F32), 1e-2, k)


def test_triton_config_validation():
  Config = triton_ln.TritonLayerNormConfig
  assert Config(block_rows=4, num_warps=8).block_rows == 4
  for bad in (dict(block_rows=3), dict(block_rows=0), dict(num_warps=6),
              dict(num_warps=-4), dict(num_warps=64), dict(programs_per_sm=-1),
              dict(num_stages=0), dict(prefetch=-1), dict(loop_stages=1),
              dict(loop_stages=-2), dict(feature_chunk=8), dict(feature_chunk=48)):
    with pytest.raises(Exception, match="block_rows|num_warps|programs_per_sm|num_stages|prefetch|loop_stages|feature_chunk"):
      Config(**bad)
  assert Config(feature_chunk=2048).feature_chunk == 2048


@pytest.mark.parametrize("rows, features, itemsize, expected", [
    (8192, 8192, 2, (2, 8, 1, 3)),
    (3, 5000, 2, (2, 8, 1, 3)),
    (16384, 4096, 2, (2, 16, 2, 3)),
    (1, 4096, 2, (1, 16, 2, 3)),
    (4096, 16384, 2, (1, 8, 1, 3)),
    (8192, 8192, 4, (2, 16, 1, 0)),
    (16384, 4096, 4, (1, 16, 2, 0)),
    (32768, 2000, 4, (1, 8, 4, 0)),
    (131072, 512, 4, (4, 4, 0, 0)),
    (65536, 1024, 2, (1, 1, 32, 3)),
    (32768, 2000, 2, (1, 1, 16, 3)),
    (131072, 512, 2, (1, 1, 16, 3)),
    (65536, 1024, 4, (1, 1, 32, 3)),
    (65536, 256, 4, (16, 4, 0, 0)),
    (4096, 256, 2, (16, 4, 0, 0)),
    (100, 256, 2, (16, 4, 0, 0)),
    (132, 96, 4, (32, 4, 0, 0)),
    (3, 77, 2, (4, 4, 0, 0)),
    (7, 16384, 4, (1, 16, 1, 0)),
])
def test_triton_heuristics_and_search_space(rows, features, itemsize, expected):
  """(block_rows, warps, programs_per_sm, loop_stages): the forward loops
  over row tiles where the f32 scale/offset outweigh a tile of x (1-row
  tiles) and for 16-bit and f32 x at Fp = 512-16384 (measured configs;
  loads pipelined by Triton, without register prefetch, where loop_stages)."""
  h = triton_ln.heuristic_config(rows, features, itemsize)
  assert (h.block_rows, h.num_warps, h.programs_per_sm, h.loop_stages) == expected
  assert h.prefetch == (0 if h.loop_stages else None)
  space = triton_ln.search_space(rows, features, itemsize)
  assert h in space
  assert all(c.block_rows <= max(1, 2 * rows) for c in space)
  one_warp = {c.programs_per_sm for c in space if c.num_warps == 1}
  assert one_warp == ({16, 32} if 128 <= triton_ln._next_pow2(features) <= 2048 else set())
  assert {c.programs_per_sm for c in space if c.num_warps > 1} == {0, 1, 2, 4, 8}
  if h.num_warps == 1:  # multi-warp candidates around the rule's rows
    rule = triton_ln._rule_block_rows(rows, triton_ln._next_pow2(features), itemsize)
    assert rule in {c.block_rows for c in space if c.num_warps > 1}
  # Loop stages only for looping programs, without register prefetch.
  assert {c.loop_stages for c in space} == {0, 3}
  assert all(c.programs_per_sm and c.prefetch == 0 for c in space if c.loop_stages)
  hb = triton_ln.heuristic_config(rows, features, itemsize, backward=True)
  space_b = triton_ln.search_space(rows, features, itemsize, backward=True)
  assert hb in space_b
  assert {c.programs_per_sm for c in space_b} == {0, 1, 2, 4}
  assert {(c.prefetch, c.loop_stages) for c in space_b} >= {(0, 0), (1, 0), (0, 3)}
  if rows >= 64:
    assert len(space) >= 3


@pytest.mark.parametrize("rows, features, itemsize, expected", [
    (8192, 8192, 2, (1, 8, 1, 0, 3)),
    (8192, 8192, 4, (1, 8, 1, 0, 3)),
    (65536, 1024, 2, (4, 4, 2, 0, 3)),
    (32768, 2048, 2, (2, 4, 2, 0, 3)),
    (131072, 512, 2, (32, 8, 1, 0, 3)),
    (65536, 1000, 4, (4, 4, 1, 0, 3)),
    (4096, 16384, 4, (1, 8, 1, 0, 2, 2048)),
    (4096, 16384, 2, (1, 8, 1, 0, 3, 2048)),
    (100, 10000, 4, (1, 8, 1, 0, 2, 2048)),
    (100, 256, 2, (16, 4, 0, 0, 0)),
])
def test_triton_backward_heuristics(rows, features, itemsize, expected):
  """(block_rows, warps, programs_per_sm, prefetch, loop_stages[,
  feature_chunk]) of the [R, F] backward: measured configs at Fp =
  512-16384 (split in two kernels at 16384), the rule elsewhere; its search
  space tries prefetch 0 and 1, loop stages 0 and 3, and the split above
  8192 features."""
  h = triton_ln.heuristic_config(rows, features, itemsize, backward=True)
  got = (h.block_rows, h.num_warps, h.programs_per_sm, h.prefetch, h.loop_stages)
  assert got + ((h.feature_chunk,) if h.feature_chunk else ()) == expected
  space = triton_ln.search_space(rows, features, itemsize, backward=True)
  assert h in space and {c.prefetch for c in space} == {0, 1}
  assert {c.loop_stages for c in space} >= {0, 3}
  chunks = {c.feature_chunk for c in space}
  assert chunks == ({0, 2048} if features > 8192 else {0})
  assert triton_ln.heuristic_config(rows, features, itemsize).feature_chunk == 0


def test_triton_heuristic_loop_stages_switch(monkeypatch):
  """HEURISTIC_LOOP_STAGES forces loop_stages on every heuristic config (A/B
  runs): n >= 2 without register prefetch, 0 off (the module's prefetch)."""
  monkeypatch.setattr(triton_ln, "HEURISTIC_LOOP_STAGES", 4)
  for args in ((8192, 8192, 2), (131072, 512, 2), (100, 256, 4), (64, 4096, 2, 256)):
    for backward in (False, True):
      h = triton_ln.heuristic_config(*args, backward=backward)
      assert (h.loop_stages, h.prefetch) == (4, 0)
  monkeypatch.setattr(triton_ln, "HEURISTIC_LOOP_STAGES", 0)
  h = triton_ln.heuristic_config(8192, 8192, 2)
  assert (h.block_rows, h.num_warps, h.loop_stages, h.prefetch) == (2, 8, 0, None)


def test_triton_column_splits(monkeypatch):
  """The first column kernel's F loop: splits double until ~4 programs per
  SM, none left without a chunk; the last may stream fewer."""
  monkeypatch.setattr(triton_ln, "_num_sms", lambda: 132)
  assert triton_ln._column_splits(16, 32, 32) == (2, 16)  # [16, 1024, 4096]
  assert triton_ln._column_splits(64, 2, 128) == (8, 16)  # [64, 4096, 256]
  assert triton_ln._column_splits(3, 8, 129) == (26, 5)  # [3, 4099, 1000]
  assert triton_ln._column_splits(1000, 8, 3) == (1, 3)
  assert triton_ln._column_splits(1, 1, 3) == (3, 1)


def test_triton_backward_preference():
  """implementation=None takes the Triton VJP everywhere it runs (f32 x
  above 8192 features too, since the split backward: H200 2026-12-04)."""
  vjp = triton_ln.TritonLayerNormVjp()
  def bind(shape, dtype, axis=-1):
    x = jax.ShapeDtypeStruct(shape, dtype)
    return triton_ln.TritonLayerNorm().bind(x, None, None, axis=axis)
  assert vjp.preferred(bind((64, 8192), F32))
  assert vjp.preferred(bind((64, 16384), BF16))
  assert vjp.preferred(bind((64, 16384), F32))
  assert vjp.preferred(bind((64, 10000), F32))
  assert vjp.preferred(bind((4, 64, 32), BF16, axis=1))
  assert vjp.preferred(bind((4, 16384, 32), F32, axis=1))
  # Above MAX_FEATURES (H200 2026-12-05): every forward and the column
  # backward, not the rows' split backward (XLA's VJP is faster there).
  fwd = triton_ln.TritonLayerNorm()
  for shape, axis in (((64, 16385), -1), ((8, 65536), -1), ((4, 32768, 64), 1)):
    assert fwd.preferred(bind(shape, BF16, axis))
  assert not vjp.preferred(bind((64, 16385), BF16))
  assert not vjp.preferred(bind((8, 65536), F32))
  assert not vjp.preferred(bind((4, 65536, 1), BF16, axis=1))  # rows, too
  assert vjp.preferred(bind((4, 32768, 64), BF16, axis=1))


@pytest.mark.parametrize("shape, axis, vjp_kernels", [
    ((64, 20000), -1, 0), ((4, 20000, 64), 1, 2), ((64, 4096), -1, 1)])
def test_triton_wide_dispatch_lowering(shape, axis, vjp_kernels):
  """implementation=None for an H200: the "triton" forward at any width;
  above MAX_FEATURES rows take XLA's VJP (no backward kernel), [pre, F,
  post] views the two column kernels."""
  x = jax.ShapeDtypeStruct(shape, BF16)
  p = jax.ShapeDtypeStruct((shape[axis],), F32)
  f = lambda *a: tokamax.layer_norm(*a, axis=axis)
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(F32)), argnums=(0, 1, 2))
  with tokamax.config.cross_compile("NVIDIA H200"):
    fwd_text = _lower_text(f, x, p, p)
    grad_text = _lower_text(grad, x, p, p)
  if shape[-1] == 4096:  # "mosaic" leads at 2048..8192 features
    assert TRITON_TARGET not in fwd_text
    assert grad_text.count(TRITON_TARGET) == vjp_kernels
    return
  fwd_kernels = fwd_text.count(TRITON_TARGET)
  assert fwd_kernels >= 1
  assert grad_text.count(TRITON_TARGET) == fwd_kernels + vjp_kernels


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("features, post, slab, forward, backward_config", [
    (1024, 4096, False, (128, 4), (128, 4)), (4096, 4096, False, (128, 4), (128, 4)),
    (16384, 64, False, (64, 4), (64, 4)), (77, 1000, True, (32, 4), (128, 4)),
    (20000, 2, False, (2, 4), (2, 4)),  # > MAX_FEATURES: columns, though 2 fit a slab
    (72, 5, True, (8, 4), (8, 4)), (1024, 8, True, (8, 4), (8, 4)),
    (4096, 16, True, (16, 16), (16, 4)),  # slab: 4096 * 16 / 128 = 512 threads
    (512, 64, True, (32, 4), (64, 4)), (8192, 16, False, (16, 4), (16, 4)),
])
def test_triton_heuristics_non_last_axis(features, post, slab, forward,
                                         backward_config, backward):
  """[pre, F, post] view: [chunk, block] tiles 128 columns wide (fewer if
  post is smaller), any F, for the backward and for the forward unless one
  [Fp, block] slab holds all of post or F <= 512 (`slab`; up to 32 columns,
  <= 128 values/thread). The column kernels' loops are pipelined by Triton
  (loop_stages 3; the slab kernel has no loop)."""
  assert triton_ln._column_forward(post, features) == (not slab)
  h = triton_ln.heuristic_config(16 * post, features, 2, post, backward)
  assert (h.block_rows, h.num_warps) == (backward_config if backward else forward)
  columns = backward or not slab
  assert h.loop_stages == (3 if columns else 0)
  space = triton_ln.search_space(16 * post, features, 2, post, backward)
  assert h in space
  assert all(c.block_rows <= pallas_triton.next_pow2(post) for c in space)
  if columns:
    assert {c.num_warps for c in space} == {4, 8, 16}
    assert {c.loop_stages for c in space} == {0, 3}
  else:
    assert {c.loop_stages for c in space} == {0}


def _lower_text(fn, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# (shape, dtype, with scale, with offset, subtract_mean)
LOWER_CASES = {
    "8192x8192_bf16": ((8192, 8192), BF16, True, True, True),
    "65536x1024_bf16": ((65536, 1024), BF16, True, True, True),
    "odd_rms_f16": ((6, 7, 77), F16, True, False, False),
    "rank1_f32": ((130,), F32, True, True, True),
    "max_features": ((5, 16384), BF16, True, True, True),
    "wide_rows": ((1027, 20000), BF16, True, True, True),
    "wide_rms_f32": ((3, 65536), F32, True, False, False),
    "wide_axis1": ((2, 20000, 24), BF16, True, True, True, 1),
    "one_feature": ((3, 1), F32, False, True, True),
    "no_params": ((1000, 1000), BF16, False, False, True),
    "axis1_of_3": ((16, 4096, 512), BF16, True, True, True, 1),
    "axis0_odd": ((77, 3, 1000), F16, True, False, False, 0),
    "axis1_one_slab": ((1024, 1024, 8), BF16, True, True, True, 1),
    "axis1_odd_columns": ((3, 4099, 1000), BF16, True, True, True, 1),
}


@pytest.mark.parametrize("case", sorted(LOWER_CASES))
def test_triton_lowers_for_cuda(case):
  """Forward and gradient lower for an H200 with the heuristic configs."""
  shape, dtype, ws, wo, sm, *axis = LOWER_CASES[case]
  axis = axis[0] if axis else -1
  spec = lambda s, d: jax.ShapeDtypeStruct(s, d)
  x = spec(shape, dtype)
  scale = spec(shape[axis:][:1], F32) if ws else None
  offset = spec(shape[axis:][:1], F32) if wo else None

  def f(x, scale, offset):
    return tokamax.layer_norm(x, scale, offset, axis=axis, subtract_mean=sm,
                              implementation="triton")

  diff = tuple(i for i, a in enumerate((x, scale, offset)) if a is not None)
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(F32)), argnums=diff)
  with tokamax.config.cross_compile("NVIDIA H200"):
    fwd_text = _lower_text(f, x, scale, offset)
    grad_text = _lower_text(grad, x, scale, offset)
  # [pre, F, post]: two backward kernels, two forward ones (statistics, y)
  # unless one slab holds all of post or F <= 512; [R, F] above 8192
  # features: two backward kernels (the split backward).
  columns = axis not in (-1, len(shape) - 1)
  forward = 1
  if columns and triton_ln._column_forward(math.prod(shape[axis + 1:]), shape[axis]):
    forward = 2
  assert fwd_text.count(TRITON_TARGET) == forward
  backward = 2 if columns or shape[axis] > 8192 else 1
  assert grad_text.count(TRITON_TARGET) == forward + backward


def _spy_loop_stages(monkeypatch) -> list[str]:
  """The asm of every Triton module given loop stages while lowering."""
  modules = []
  set_stages = pallas_triton._set_loop_stages

  def spy(module, stages):
    set_stages(module, stages)
    modules.append(module.operation.get_asm())

  monkeypatch.setattr(pallas_triton, "_set_loop_stages", spy)
  return modules


@pytest.mark.parametrize("shape, axis", [((8192, 8192), -1), ((16, 1024, 4096), 1)])
def test_triton_loop_stages_lowering(monkeypatch, shape, axis):
  """config.loop_stages puts Triton's tt.num_stages on every loop of every
  kernel the config launches (forward and backward), and nowhere else."""
  modules = _spy_loop_stages(monkeypatch)
  config = triton_ln.TritonLayerNormConfig(
      block_rows=2 if axis == -1 else 32, num_warps=8,
      programs_per_sm=1 if axis == -1 else 0, prefetch=0, loop_stages=3)
  op = triton_ln.TritonLayerNorm(config=config,
                                 vjp=triton_ln.TritonLayerNormVjp(config=config))
  x = jax.ShapeDtypeStruct(shape, BF16)
  p = jax.ShapeDtypeStruct((shape[axis],), F32)
  grad = jax.grad(lambda *a: jnp.sum(op(*a, axis=axis).astype(F32)), argnums=(0, 1, 2))
  with tokamax.config.cross_compile("NVIDIA H200"):
    text = _lower_text(grad, x, p, p)
  kernels = 2  # [R, F]: the forward (saving statistics) and the backward
  if axis != -1:  # [pre, F, post]: two backward kernels, forward by `_column_forward`
    kernels = 2 + (2 if triton_ln._column_forward(shape[2], shape[1]) else 1)
  assert text.count(TRITON_TARGET) == kernels
  assert len(modules) == kernels
  for asm in modules:
    assert asm.count("tt.num_stages = 3 : i32") == asm.count("scf.for")
  assert sum("scf.for" in asm for asm in modules) >= 2  # a forward and a backward loop
  # Without loop_stages no loop gets the attribute.
  modules.clear()
  plain = triton_ln.TritonLayerNorm(
      config=dataclasses.replace(config, loop_stages=0),
      vjp=triton_ln.TritonLayerNormVjp(config=dataclasses.replace(config, loop_stages=0)))
  with tokamax.config.cross_compile("NVIDIA H200"):
    _lower_text(jax.grad(lambda *a: jnp.sum(plain(*a, axis=axis).astype(F32)),
                         argnums=(0, 1, 2)), x, p, p)
  assert not modules


def test_triton_split_backward_lowering(monkeypatch):
  """config.feature_chunk: the [R, F] backward lowers for CUDA as two
  kernels (rows' sums, then feature chunks), each loop with loop_stages."""
  modules = _spy_loop_stages(monkeypatch)
  config = triton_ln.TritonLayerNormConfig(block_rows=1, num_warps=16, programs_per_sm=1,
                                           prefetch=0, loop_stages=2, feature_chunk=2048)
  op = triton_ln.TritonLayerNorm(vjp=triton_ln.TritonLayerNormVjp(config=config))
  x = jax.ShapeDtypeStruct((4099, 16384), F32)
  p = jax.ShapeDtypeStruct((16384,), F32)
  with tokamax.config.cross_compile("NVIDIA H200"):
    text = _lower_text(jax.grad(lambda *a: jnp.sum(op(*a)), argnums=(0, 1, 2)), x, p, p)
  assert text.count(TRITON_TARGET) == 3  # forward, rows' sums, chunks
  assert [m.split("@")[1].split(" ")[0] for m in modules] == [
      "tokamax_layer_norm_bwd_row_sums_loop_stages2", "tokamax_layer_norm_bwd_chunks_loop_stages2"]
  for asm in modules:
    assert asm.count("tt.num_stages = 2 : i32") == asm.count("scf.for") == 1


@pytest.mark.parametrize("programs_per_sm, loops", [(0, 2), (16, 3)])
def test_triton_chunked_forward_lowering(monkeypatch, programs_per_sm, loops):
  """config.feature_chunk: the [R, F] forward lowers for CUDA as one kernel
  with a statistics loop and a y loop over the chunks (inside a loop over
  row blocks with programs_per_sm), each with loop_stages."""
  modules = _spy_loop_stages(monkeypatch)
  config = triton_ln.TritonLayerNormConfig(block_rows=1, num_warps=1,
                                           programs_per_sm=programs_per_sm,
                                           loop_stages=3, feature_chunk=1024)
  op = triton_ln.TritonLayerNorm(config=config)
  x = jax.ShapeDtypeStruct((8192, 8192), BF16)
  p = jax.ShapeDtypeStruct((8192,), F32)
  with tokamax.config.cross_compile("NVIDIA H200"):
    text = _lower_text(lambda *a: op(*a), x, p, p)
  assert text.count(TRITON_TARGET) == 1
  [asm] = modules
  assert "@tokamax_layer_norm_fwd_loop_stages3" in asm
  assert asm.count("tt.num_stages = 3 : i32") == asm.count("scf.for") == loops


def test_triton_loop_stages_default_prefetch():
  """prefetch None with loop_stages means no register prefetch (a tile
  loaded a trip ahead is loop-carried, which Triton does not pipeline): the
  same kernels as prefetch 0, forward and backward; without loop_stages the
  module defaults."""
  Config = triton_ln.TritonLayerNormConfig
  x = jax.ShapeDtypeStruct((8192, 8192), BF16)
  p = jax.ShapeDtypeStruct((8192,), F32)

  def jaxpr(config, grad=True):
    op = triton_ln.TritonLayerNorm(config=config,
                                   vjp=triton_ln.TritonLayerNormVjp(config=config))
    f = jax.grad(lambda *a: jnp.sum(op(*a).astype(F32)), argnums=(0, 1, 2)) if grad else op
    with tokamax.config.cross_compile("NVIDIA H200"):
      return str(jax.make_jaxpr(f)(x, p, p))

  base = dict(block_rows=2, num_warps=8, programs_per_sm=1)
  pipelined = jaxpr(Config(**base, loop_stages=3))
  assert pipelined == jaxpr(Config(**base, loop_stages=3, prefetch=0))
  assert pipelined != jaxpr(Config(**base, loop_stages=3, prefetch=1))
  # Without loop_stages the forward loads LOOP_PREFETCH tiles ahead.
  plain = jaxpr(Config(**base), grad=False)
  assert plain == jaxpr(Config(**base, prefetch=triton_ln.LOOP_PREFETCH), grad=False)
  assert plain != jaxpr(Config(**base, prefetch=0), grad=False)


def test_triton_wide_rows_configs_and_preference():
  """Above MAX_FEATURES: chunked heuristic configs and search spaces
  (forward and backward); `None` takes the "triton" forward, and for rows
  XLA's VJP (faster than the split backward on the H200), for a middle
  axis the column backward."""
  wide = triton_ln.MAX_FEATURES + 2048
  for backward in (False, True):
    h = triton_ln.heuristic_config(4096, wide, 2, backward=backward)
    space = triton_ln.search_space(4096, wide, 2, backward=backward)
    assert h in space and h.feature_chunk
    assert all(c.feature_chunk and c.loop_stages in (0, 3) for c in space)
    assert all(8 <= c.block_rows * c.feature_chunk // (32 * c.num_warps) <= 64
               for c in space - {h})
  x = jax.ShapeDtypeStruct((64, wide), BF16)
  s = jax.ShapeDtypeStruct((wide,), F32)
  with tokamax.config.cross_compile("NVIDIA H200"):
    ba = dispatch.select("layer_norm", None, (x, s), {})
    assert (ba.op.implementation, ba.op.vjp.implementation) == ("triton", "xla")
    ba = dispatch.select("layer_norm", "triton", (x, s), {})
    assert ba.op.preferred(ba) and not ba.op.vjp.preferred(ba)
    assert ba.op.vjp.implementation == "triton"  # named: no fallback
    xm = jax.ShapeDtypeStruct((2, wide, 8), BF16)
    ba = dispatch.select("layer_norm", None, (xm, s), dict(axis=1))
    assert (ba.op.implementation, ba.op.vjp.implementation) == ("triton", "triton")


def test_triton_cross_compile_dispatch():
  """Under an H200 target None picks "triton", or falls back to XLA."""
  x = jax.ShapeDtypeStruct((64, 256), BF16)
  s = jax.ShapeDtypeStruct((256,), F32)
  with tokamax.config.cross_compile("NVIDIA H200"):
    ba = dispatch.select("layer_norm", None, (x, s), {})
    assert ba.op.implementation == "triton"
    assert TRITON_TARGET in _lower_text(lambda x, s: tokamax.layer_norm(x, s), x, s)
    xt = jax.ShapeDtypeStruct((256, 64), BF16)
    text = _lower_text(lambda x, s: tokamax.layer_norm(x, s, axis=0), xt, s)
    assert text.count(TRITON_TARGET) == 1  # [1, 256, 64] view: one slab
    # Its gradient: the Triton VJP's two column kernels under None and named.
    for impl, kernels in ((None, 3), ("triton", 3)):
      grad = jax.grad(lambda x, s: jnp.sum(tokamax.layer_norm(
          x, s, axis=0, implementation=impl).astype(F32)))
      assert _lower_text(grad, xt, s).count(TRITON_TARGET) == kernels
  with tokamax.config.cross_compile("NVIDIA V100"):
    with pytest.raises(NotImplementedError, match="triton.*requires an NVIDIA GPU"):
      _lower_text(lambda x, s: tokamax.layer_norm(x, s, implementation="triton"), x, s)


@pytest.mark.skipif(ON_GPU, reason="CPU platform check")
def test_triton_refuses_on_cpu_without_interpret():
  x = jnp.ones((4, 8), F32)
  with pytest.raises(NotImplementedError, match="triton.*requires an NVIDIA GPU"):
    tokamax.layer_norm(x, implementation="triton")
  assert isinstance(tokamax.layer_norm(x), jax.Array)  # None -> xla


@pytest.mark.gpu
class TestTritonGpu(LayerNormTestBase):
  """The whole base with the compiled Triton kernels on an NVIDIA GPU."""

  implementation = "triton"
  dtypes = (F32, BF16, F16)
  test_hypothesis = _own_hypothesis_test()


@pytest.mark.gpu
@pytest.mark.parametrize("shape, block_rows, warps", [
    ((8192, 8192), 2, 16), ((65536, 1024), 16, 4), ((1000, 3000), 1, 8)])
@pytest.mark.parametrize("programs_per_sm", [1, 4])
def test_triton_gpu_looped_forward(shape, block_rows, warps, programs_per_sm):
  """The looping forward (programs_per_sm > 0) at real sizes vs f64."""
  x, scale, offset, _ = make_inputs(shape, -1, True, True, BF16, 8)
  op = triton_ln.TritonLayerNorm(config=triton_ln.TritonLayerNormConfig(
      block_rows=block_rows, num_warps=warps, programs_per_sm=programs_per_sm,
      num_stages=3))
  y = jax.jit(op)(x, scale, offset)
  fwd_tol, _ = reference.TOLERANCE[jnp.dtype(BF16)]
  reference.assert_close(y, reference.layer_norm(x, scale, offset), fwd_tol, "forward")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("shape, axis", [((1024 + 3, 18432), -1), ((257, 65536), -1),
                                         ((3, 20000, 200), 1), ((32768, 2), 0)])
def test_triton_gpu_wide_rows(shape, axis, dtype):
  """Vectors wider than MAX_FEATURES at real sizes vs f64, y and every
  gradient, heuristic configs: rows (the chunked forward and split
  backward) and middle or leading axes (the column kernels)."""
  x, scale, offset, ct_key = make_inputs(shape, axis, True, True, dtype, shape[1] % 97)
  ct = jax.random.normal(ct_key, shape, F32)
  f = lambda *a, axis: tokamax.layer_norm(*a, axis=axis, implementation="triton")
  check_against_f64(f, (x, scale, offset), ct, axis=axis)


@pytest.mark.parametrize("chunk", [512, 1024, 2048])
@pytest.mark.gpu
def test_triton_gpu_chunked_forward(chunk):
  """The chunked forward (feature_chunk) at 8192^2 with one-warp programs
  vs f64, and its statistics for rows with jumping means."""
  config = triton_ln.TritonLayerNormConfig(block_rows=1, num_warps=1, programs_per_sm=16,
                                           loop_stages=3, feature_chunk=chunk)
  op = triton_ln.TritonLayerNorm(config=config)
  x, scale, offset, _ = make_inputs((8192, 8192), -1, True, True, BF16, chunk)
  fwd_tol, _ = reference.TOLERANCE[jnp.dtype(BF16)]
  reference.assert_close(jax.jit(op)(x, scale, offset),
                         reference.layer_norm(x, scale, offset), fwd_tol, "forward")
  check_jumping_means("triton", BF16, op=op)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, block_rows, warps, programs_per_sm", [
    ((8192, 8192), 2, 8, 1), ((8192, 8192), 1, 4, 2), ((65536, 1024), 4, 8, 8)])
def test_triton_gpu_looped_forward_bf16_params(shape, block_rows, warps, programs_per_sm):
  """bf16 x, scale and offset through the looping forward at real sizes vs f64."""
  x, scale, offset, _ = make_inputs(shape, -1, True, True, BF16, 9, param_dtype=BF16)
  op = triton_ln.TritonLayerNorm(config=triton_ln.TritonLayerNormConfig(
      block_rows=block_rows, num_warps=warps, programs_per_sm=programs_per_sm))
  y = jax.jit(lambda *a: op(*a, scale_offset=1.0))(x, scale, offset)
  # bf16 y: rounding alone leaves ~1.6e-3 (a 1 % error in scale fails).
  reference.assert_close(y, reference.layer_norm(x, scale, offset, scale_offset=1.0),
                         4e-3, "forward")


def check_against_f64(f, args, ct, **static):
  """f(x, scale, offset, **static) (jitted) and its gradients vs the f64
  reference, with the tolerances of x's dtype; ct: the cotangent of y;
  scale and offset may be None (no gradient for them then)."""
  fwd_tol, grad_tol = reference.TOLERANCE[jnp.dtype(args[0].dtype)]
  f = functools.partial(f, **static)
  ref = functools.partial(reference.layer_norm, **static)
  reference.assert_close(jax.jit(f)(*args), ref(*args), fwd_tol, "forward")
  argnums = tuple(i for i, a in enumerate(args) if a is not None)
  grads = jax.jit(jax.grad(
      lambda *a: jnp.sum(f(*a).astype(F32) * ct), argnums=argnums))(*args)
  ref_args = [None if a is None else reference.f64(a) for a in args]
  ref_grads = jax.grad(lambda *a: jnp.sum(ref(*a) * ct), argnums=argnums)(*ref_args)
  for i, g, r in zip(argnums, grads, ref_grads):
    reference.assert_close(g, r, grad_tol, ("dx", "dscale", "doffset")[i])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, features", [
    (dtype, f) for dtype, itemsize in ((BF16, 2), (F32, 4))
    for f in sorted(triton_ln._LOOP_CONFIGS[itemsize])])
def test_triton_gpu_measured_configs(dtype, features):
  """Each measured config (forward and backward tables) at ~8M elements,
  with a ragged last tile, vs f64: y and every gradient."""
  rows = 2**23 // features + 3
  itemsize = jnp.dtype(dtype).itemsize
  x, scale, offset, ct_key = make_inputs((rows, features), -1, True, True, dtype, features)
  ct = jax.random.normal(ct_key, x.shape, F32)
  fwd, bwd = (triton_ln.heuristic_config(rows, features, itemsize, backward=b)
              for b in (False, True))
  assert fwd.block_rows == triton_ln._LOOP_CONFIGS[itemsize][features][0]
  assert bwd.programs_per_sm == triton_ln._VJP_CONFIGS[itemsize][features][2]
  assert bwd.prefetch == triton_ln._VJP_CONFIGS[itemsize][features][3]
  assert bwd.loop_stages == (triton_ln._VJP_CONFIGS[itemsize][features][4:] or (0,))[0]
  assert bwd.feature_chunk == (triton_ln._VJP_CONFIGS[itemsize][features][5:] or (0,))[0]
  op = triton_ln.TritonLayerNorm(config=fwd, vjp=triton_ln.TritonLayerNormVjp(config=bwd))
  check_against_f64(op, (x, scale, offset), ct)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, warps, chunk, loop_stages", [
    (BF16, 8, 1024, 3), (BF16, 16, 2048, 3), (BF16, 8, 2048, 3), (BF16, 16, 1024, 3),
    (F32, 8, 1024, 2), (F32, 16, 2048, 2), (F32, 8, 2048, 2), (F32, 16, 1024, 2)])
def test_triton_gpu_split_backward(dtype, warps, chunk, loop_stages):
  """The backward in two kernels (feature_chunk) at 16384 features, a
  ragged last row block, vs f64: y and every gradient."""
  shape = (4096 + 3, 16384)
  x, scale, offset, ct_key = make_inputs(shape, -1, True, True, dtype, chunk + warps)
  ct = jax.random.normal(ct_key, shape, F32)
  op = triton_ln.TritonLayerNorm(vjp=triton_ln.TritonLayerNormVjp(
      config=triton_ln.TritonLayerNormConfig(
          block_rows=1, num_warps=warps, programs_per_sm=1, prefetch=0,
          loop_stages=loop_stages, feature_chunk=chunk)))
  check_against_f64(op, (x, scale, offset), ct)


@pytest.mark.gpu
@pytest.mark.parametrize("vjp_prefetch", [1, 2])
@pytest.mark.parametrize("shape", [(8192, 8192), (65536 + 3, 1024)])
def test_triton_gpu_vjp_prefetch(shape, vjp_prefetch):
  """The backward loading x and dy 1 or 2 trips ahead (config.prefetch),
  otherwise the heuristic config, at real sizes vs f64: y and every gradient."""
  x, scale, offset, ct_key = make_inputs(shape, -1, True, True, BF16, 10 + vjp_prefetch)
  ct = jax.random.normal(ct_key, shape, F32)
  op = triton_ln.TritonLayerNorm(vjp=triton_ln.TritonLayerNormVjp(
      config=dataclasses.replace(triton_ln.heuristic_config(*shape, 2, backward=True),
                                 prefetch=vjp_prefetch)))
  check_against_f64(op, (x, scale, offset), ct)


@pytest.mark.gpu
@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("shape, block_rows, warps", [
    ((16, 1024, 4096), 64, 8), ((16, 1024, 4096), 128, 16), ((3, 4099, 1000), 64, 8),
    ((64, 4096, 256), 16, 4), ((64, 4096, 256), None, None)])
def test_triton_gpu_column_backward(shape, block_rows, warps, subtract_mean):
  """The [pre, F, post] backward (axis 1) at real sizes, ragged feature
  chunks and column blocks and the split F loop (64 x 4096 x 256) included,
  vs f64: y and every gradient."""
  x, scale, offset, ct_key = make_inputs(shape, 1, True, True, BF16, shape[2])
  ct = jax.random.normal(ct_key, shape, F32)
  config = None  # None: the heuristic's
  if block_rows is not None:
    config = triton_ln.TritonLayerNormConfig(block_rows=block_rows, num_warps=warps)
  op = triton_ln.TritonLayerNorm(vjp=triton_ln.TritonLayerNormVjp(config=config))
  check_against_f64(op, (x, scale, offset), ct, axis=1, subtract_mean=subtract_mean)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, block_rows, warps, programs_per_sm, loop_stages", [
    ((8192, 8192), 2, 8, 1, 3), ((8192, 8192), 1, 16, 1, 4),
    ((65536 + 3, 1024), 4, 8, 4, 3), ((1000, 3000), 1, 8, 2, 2)])
def test_triton_gpu_loop_stages(shape, block_rows, warps, programs_per_sm, loop_stages):
  """Loops pipelined by Triton (config.loop_stages, no register prefetch)
  at real sizes vs f64: y and every gradient."""
  x, scale, offset, ct_key = make_inputs(shape, -1, True, True, BF16, 20 + loop_stages)
  ct = jax.random.normal(ct_key, shape, F32)
  config = triton_ln.TritonLayerNormConfig(
      block_rows=block_rows, num_warps=warps, programs_per_sm=programs_per_sm,
      prefetch=0, loop_stages=loop_stages)
  op = triton_ln.TritonLayerNorm(config=config,
                                 vjp=triton_ln.TritonLayerNormVjp(config=config))
  check_against_f64(op, (x, scale, offset), ct)


def check_large_bf16(implementation, shape, seed):
  """bf16 x with f32 scale/offset vs the f64 reference, forward and every
  gradient (through the saved statistics), at a benchmark size."""
  x, scale, offset, ct_key = make_inputs(shape, -1, True, True, BF16, seed)
  ct = jax.random.normal(ct_key, shape, F32)
  check_against_f64(lambda *a: tokamax.layer_norm(*a, implementation=implementation),
                    (x, scale, offset), ct)


@pytest.mark.gpu
def test_triton_gpu_large_bf16():
  check_large_bf16("triton", (8192, 8192), 7)


# --- "mosaic": the Mosaic GPU interpreter on CPU, lowering for CUDA, GPU -----

from tokamax._src import pallas_mosaic  # noqa: E402
from tokamax.ops.normalization import mosaic as mosaic_ln  # noqa: E402

MOSAIC_TARGET = "mosaic_gpu"
# F = 80, 77, 130 do not tile into 32 lanes; other axes are not supported.
MOSAIC_UNSUPPORTED = frozenset({
    "no_params", "offset_only", "scale_offset", "rms_scale_offset",
    "rank1", "odd_features", "one_feature", "one_feature_rows", *NON_LAST_AXIS})
MOSAIC_FEATURES = st.sampled_from([32, 64, 96, 160, 1024, 1088, 4096, 4224])


class TestMosaicInterpret(LayerNormTestBase):
  """The whole base with the Mosaic GPU forward in the interpreter (CPU); the
  gradient is the Triton kernel (interpret mode)."""

  implementation = "mosaic"
  dtypes = (BF16, F16)
  unsupported_cases = MOSAIC_UNSUPPORTED
  test_hypothesis = _own_hypothesis_test(MOSAIC_FEATURES)

  @pytest.fixture(autouse=True, scope="class")
  @classmethod
  def _interpret(cls):
    with pallas_mosaic.interpret_mode(), triton_ln.interpret_mode():
      yield

  @pytest.mark.parametrize("features, block_rows, programs_per_sm, out_stages", [
      (64, 4, 1, 1), (96, 8, 2, 2), (2048, 2, 1, 2), (5120, 1, 1, 1), (5120, 2, 1, 2)])
  @pytest.mark.parametrize("params", ["none", "scale", "offset", "both"])
  @pytest.mark.parametrize("subtract_mean", [True, False])
  def test_blocks_trips_and_statistics(self, monkeypatch, features, block_rows,
                                       programs_per_sm, out_stages, params, subtract_mean):
    """One "SM": CTAs loop over several blocks (the last past R), 1/2/4 rows
    per step; the saved statistics (>256 rows per CTA at F = 64: two chunks)
    and the gradient through the Triton VJP vs f64."""
    monkeypatch.setattr(mosaic_ln, "_num_sms", lambda: 1)
    rows = 301 if features <= 96 else 7
    config = mosaic_ln.MosaicLayerNormConfig(
        block_rows=block_rows, stages=2, out_stages=out_stages,
        programs_per_sm=programs_per_sm)
    op = mosaic_ln.MosaicLayerNorm(config=config)
    ws, wo = params in ("scale", "both"), params in ("offset", "both")
    x, scale, offset, ct_key = make_inputs((rows, features), -1, ws, wo, BF16, 9)
    static = dict(subtract_mean=subtract_mean, scale_offset=0.5, epsilon=1e-5)
    y, (mean, rstd) = op.call_bound(op.bind(x, scale, offset, **static),
                                    return_residuals=True)
    fwd_tol, grad_tol = reference.TOLERANCE[jnp.dtype(BF16)]
    reference.assert_close(y, reference.layer_norm(x, scale, offset, **static),
                           fwd_tol, "forward")
    want_mean, want_rstd = triton_ln._statistics(
        reference.f64(x), 1, 1e-5, subtract_mean)
    reference.assert_close(rstd, want_rstd, 1e-5, "rstd")
    if subtract_mean:
      reference.assert_close(mean, want_mean, 1e-5, "mean")
    else:
      assert mean is None
    ct = jax.random.normal(ct_key, x.shape, F32)
    diff = [a for a in (x, scale, offset) if a is not None]
    args = lambda d: (d[0], *([d[1]] if ws else [None]), *([d[-1]] if wo else [None]))
    grads = jax.grad(lambda d: jnp.sum(op(*args(d), **static).astype(F32) * ct))(diff)
    ref_grads = jax.grad(lambda d: jnp.sum(reference.layer_norm(*args(d), **static) * ct))(
        [reference.f64(a) for a in diff])
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
      reference.assert_close(g, r, grad_tol, f"grad {i}")

  def test_statistics_shift_carried_across_rows(self, monkeypatch):
    """One CTA normalises every row, each shifted by the previous row's mean."""
    monkeypatch.setattr(mosaic_ln, "_num_sms", lambda: 1)
    check_jumping_means("mosaic", BF16)

  def test_refusals(self):
    for shape, dtype, match in (((4, 80), BF16, "multiple of 32"),
                                ((4, 2080), BF16, "multiple of 32"),
                                ((2, 16384), BF16, "8192"),
                                ((4, 64), F32, "bf16 or f16")):
      with pytest.raises(NotImplementedError, match=f"mosaic.*{match}"):
        jax.eval_shape(self.layer_norm, jax.ShapeDtypeStruct(shape, dtype))
    with pytest.raises(NotImplementedError, match="mosaic.*last axis"):
      jax.eval_shape(functools.partial(self.layer_norm, axis=0),
                     jax.ShapeDtypeStruct((64, 3), BF16))


def test_mosaic_config_heuristics_and_search_space():
  Config = mosaic_ln.MosaicLayerNormConfig
  for bad in (dict(block_rows=3), dict(block_rows=512), dict(stages=0),
              dict(out_stages=0), dict(programs_per_sm=0)):
    with pytest.raises(Exception, match="block_rows|stages|programs_per_sm"):
      Config(**bad)
  # The configs measured fastest on the H200 (docs/benchmarks.md, 2026-12-02).
  assert mosaic_ln.heuristic_config(8192, 8192, 2) == Config(
      block_rows=1, stages=4, out_stages=1)
  assert mosaic_ln.heuristic_config(16384, 4096, 2) == Config(block_rows=2, stages=3)
  assert mosaic_ln.heuristic_config(65536, 1024, 2) == Config(
      block_rows=8, stages=4, out_stages=1)
  assert mosaic_ln.heuristic_config(131072, 512, 2) == Config(
      block_rows=16, stages=4, out_stages=1)
  assert mosaic_ln.heuristic_config(32768, 2048, 2) == Config(block_rows=4, stages=4)
  assert mosaic_ln.heuristic_config(3, 2048, 2).block_rows == 4
  for rows, f in ((8192, 8192), (65536, 1024), (100, 4096), (3, 64)):
    space = mosaic_ln.search_space(rows, f, 2)
    assert mosaic_ln.heuristic_config(rows, f, 2) in space
    assert all(c.block_rows % mosaic_ln.rows_per_step(f) == 0 for c in space)
    assert all(c.programs_per_sm * mosaic_ln._smem_bytes(c, f, 2)
               <= pallas_mosaic.SMEM_BYTES for c in space)


@pytest.mark.parametrize("shape, subtract_mean", [
    ((8192, 8192), True), ((65536, 1024), True), ((4096, 4096), False),
    ((1000, 2048), True), ((100, 96), False)])
def test_mosaic_lowers_for_cuda(shape, subtract_mean):
  """Forward (Mosaic GPU) and gradient (Mosaic forward saving statistics +
  the Triton backward) lower for an H200 on CPU: shared memory, TMA boxes
  and register layouts are checked there."""
  x = jax.ShapeDtypeStruct(shape, BF16)
  p = jax.ShapeDtypeStruct(shape[-1:], F32)
  f = lambda x, s, o: tokamax.layer_norm(x, s, o, subtract_mean=subtract_mean,
                                         implementation="mosaic")
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(F32)), argnums=(0, 1, 2))
  with tokamax.config.cross_compile("NVIDIA H200"):
    fwd_text = _lower_text(f, x, p, p)
    grad_text = _lower_text(grad, x, p, p)
  assert MOSAIC_TARGET in fwd_text and TRITON_TARGET not in fwd_text
  assert MOSAIC_TARGET in grad_text and grad_text.count(TRITON_TARGET) == 1


def test_mosaic_cross_compile_dispatch():
  """Under an H200 target None picks "mosaic" from 2048 features (faster
  there), "triton" below and for other axes or f32."""
  p = lambda f: jax.ShapeDtypeStruct((f,), F32)
  with tokamax.config.cross_compile("NVIDIA H200"):
    for shape, dtype, axis, want in (((64, 2048), BF16, -1, "mosaic"),
                                     ((8, 8192), F16, -1, "mosaic"),
                                     ((64, 1024), BF16, -1, "triton"),
                                     ((64, 512), BF16, -1, "triton"),
                                     ((64, 256), BF16, -1, "triton"),
                                     ((64, 1024), F32, -1, "triton"),
                                     ((1024, 64), BF16, 0, "triton")):
      x = jax.ShapeDtypeStruct(shape, dtype)
      ba = dispatch.select("layer_norm", None, (x, p(shape[axis])), dict(axis=axis))
      assert ba.op.implementation == want, (shape, dtype, axis)
    x = jax.ShapeDtypeStruct((64, 2048), BF16)
    text = _lower_text(jax.grad(lambda x, s: jnp.sum(tokamax.layer_norm(x, s).astype(F32))),
                       x, p(2048))
    assert MOSAIC_TARGET in text and text.count(TRITON_TARGET) == 1


@pytest.mark.skipif(ON_GPU, reason="CPU platform check")
def test_mosaic_refuses_on_cpu():
  x = jax.ShapeDtypeStruct((64, 256), BF16)
  with pytest.raises(NotImplementedError, match="mosaic.*Hopper"):
    jax.eval_shape(lambda x: tokamax.layer_norm(x, implementation="mosaic"), x)


def test_mosaic_refuses_off_hopper_when_cross_compiling():
  x = jax.ShapeDtypeStruct((64, 256), BF16)
  with tokamax.config.cross_compile("NVIDIA A100"):
    with pytest.raises(NotImplementedError, match="mosaic.*Hopper"):
      _lower_text(lambda x: tokamax.layer_norm(x, implementation="mosaic"), x)
    assert dispatch.select("layer_norm", None, (x,), {}).op.implementation == "triton"


@pytest.mark.gpu
class TestMosaicGpu(LayerNormTestBase):
  """The whole base with the compiled Mosaic GPU forward on the H200."""

  implementation = "mosaic"
  dtypes = (BF16, F16)
  unsupported_cases = MOSAIC_UNSUPPORTED
  test_hypothesis = _own_hypothesis_test(MOSAIC_FEATURES)
  test_statistics_shift_carried_across_rows = (
      TestMosaicInterpret.test_statistics_shift_carried_across_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 8192), (65536, 1024), (4099, 4096), (3000, 96)])
def test_mosaic_gpu_large_bf16(shape):
  check_large_bf16("mosaic", shape, 11)
