"""Independent f64 references and comparison helpers for the op tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Relative L2 error allowed per input dtype (forward, gradient). bf16 has an
# 8-bit mantissa (eps 7.8e-3), f16 11 bits (9.8e-4); rounding of inputs and of
# the probabilities fed to the second matmul gives errors of a few eps.
TOLERANCE = {
    jnp.dtype(jnp.float64): (1e-10, 1e-9),
    jnp.dtype(jnp.float32): (2e-5, 1e-4),
    jnp.dtype(jnp.float16): (4e-3, 1e-2),
    jnp.dtype(jnp.bfloat16): (2e-2, 5e-2),
}


def rel_error(x, ref) -> float:
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  assert x.shape == ref.shape, (x.shape, ref.shape)
  assert np.all(np.isfinite(x)), "non-finite values"
  # An absolute floor (RMS 0.1, a tenth of the inputs' unit scale) for
  # references that are (near) zero: such results still carry the roundoff of
  # their O(1) terms, e.g. a bias gradient that is exactly 0 with one visible
  # key (ds = p (dp - D) with dp = D of order 1: f32 leaves ~1e-6).
  denom = max(np.linalg.norm(ref), 0.1 * np.sqrt(ref.size))
  return float(np.linalg.norm(x - ref) / denom)


def assert_close(x, ref, tol, what=""):
  err = rel_error(x, ref)
  assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def f64(x):
  return None if x is None else jnp.asarray(x, jnp.float64)


def attention(
    query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
    query_seq_lengths=None, key_value_seq_lengths=None,
    local_window_size=None, logits_soft_cap=None,
):
  """Attention in f64 with explicit [*B, N, T, S] visibility, layout [*B,T,N,H]."""
  q, k, v, bias = f64(query), f64(key), f64(value), f64(bias)
  *batch, t, n, h = q.shape
  s, kh = k.shape[-3], k.shape[-2]
  k = jnp.repeat(k, n // kh, axis=-2)
  v = jnp.repeat(v, n // kh, axis=-2)
  scale = 1.0 / np.sqrt(h) if scale is None else scale
  logits = jnp.einsum("...tnh,...snh->...nts", q, k) * scale
  if bias is not None:
    logits = logits + bias
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  vis = np.ones((*batch, n, t, s), bool)
  ti, sj = np.arange(t)[:, None], np.arange(s)[None, :]
  if is_causal:
    vis = vis & (sj <= ti)
  if local_window_size is not None:
    if isinstance(local_window_size, int):
      local_window_size = (local_window_size, local_window_size)
    left, right = local_window_size
    if left is not None:
      vis = vis & (sj >= ti - left)
    if right is not None:
      vis = vis & (sj <= ti + right)
  vis = jnp.asarray(vis)
  if query_seq_lengths is not None:
    vis = vis & (ti < jnp.asarray(query_seq_lengths)[..., None, None, None])
  if key_value_seq_lengths is not None:
    vis = vis & (sj < jnp.asarray(key_value_seq_lengths)[..., None, None, None])
  if mask is not None:
    vis = vis & mask
  safe = jnp.where(vis, logits, 0.0)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(vis, logits, -1e300), -1, keepdims=True))
  p = jnp.where(vis, jnp.exp(safe - m), 0.0)
  denom = jnp.sum(p, -1, keepdims=True)
  p = p / jnp.where(denom == 0, 1.0, denom)
  return jnp.einsum("...nts,...snh->...tnh", p, v)


def layer_norm(x, scale=None, offset=None, *, axis=-1, epsilon=1e-6,
               scale_offset=0.0, subtract_mean=True):
  x = f64(x)
  axis = axis % x.ndim
  shape = [1] * x.ndim
  shape[axis] = x.shape[axis]
  if subtract_mean:
    x = x - jnp.mean(x, axis=axis, keepdims=True)
  y = x / jnp.sqrt(jnp.mean(x * x, axis=axis, keepdims=True) + epsilon)
  if scale is not None:
    y = y * (f64(scale) + scale_offset).reshape(shape)
  if offset is not None:
    y = y + f64(offset).reshape(shape)
  return y


def forward_mode_candidates(named, default, jvp_supported: bool,
                            implementation: str, plain_call, run):
  """The calls a forward-mode test compares with f64: `named` (the tested
  implementation) if it supports forward mode, and always `default`
  (implementation=None, which falls back to one that does). Otherwise first
  checks that `named`, where it runs `plain_call()` at all, refuses
  `run(named)` (a jvp) by name."""
  if jvp_supported:
    return [named, default]
  try:
    plain_call()
  except NotImplementedError:
    return [default]  # refused here anyway (e.g. "cudnn" on a CPU)
  with pytest.raises(NotImplementedError, match=rf"'{implementation}'.*forward-mode"):
    run(named)
  return [default]
