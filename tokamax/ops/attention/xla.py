"""Dot-product attention: the XLA reference (base class of every implementation).

User layout is `[*B, T, N, H]` like `jax.nn.dot_product_attention`. `bind`
validates and canonicalises to:

  query [B, T, N, H], key [B, S, K, H], value [B, S, K, Hv]  (N = K * G)
  bias [b, n, t, s] float and mask [b, n, t, s] bool, each dim 1 or full
  query_seq_lengths, key_value_seq_lengths: int32 [B] or None
  scale: float; is_causal: bool; local_window_size: (left, right) or None,
  where a side of None is unbounded; logits_soft_cap: float or None.

Semantics (identical in every implementation):
  logits = scale * q.k + bias;  logits = cap * tanh(logits / cap) if capped;
  key j is visible to query i iff mask, (j <= i if causal: top-left aligned),
  (i - left <= j <= i + right if windowed), i < q_len, j < kv_len;
  out = softmax over visible keys (f32 statistics) @ value.
A query row with no visible key outputs 0 and gets 0 gradient.

The residuals of every flash-style implementation are a dict holding "lse",
the log-sum-exp of the visible logits, f32 [B, N, T] (FlashAttention-2,
arXiv:2307.08691, Sec. 3.1); an implementation may add entries its own VJP
uses (others ignore them).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import op as op_lib
from tokamax._src import validation

_NAME = "dot_product_attention"


def stats_dtype(dtype) -> jnp.dtype:
  """f32 softmax statistics (f64 for f64 inputs)."""
  return jnp.promote_types(dtype, jnp.float32)


def _canonical_window(window) -> tuple[int | None, int | None] | None:
  if window is None:
    return None
  if isinstance(window, numbers.Integral) and not isinstance(window, bool):
    window = (int(window), int(window))
  if not (isinstance(window, (tuple, list)) and len(window) == 2):
    raise TypeError(
        f"{_NAME}: local_window_size must be an int, a (left, right) pair or"
        f" None; got {window!r}."
    )
  sides = []
  for side in window:
    if side is None:
      sides.append(None)
      continue
    if isinstance(side, bool) or not isinstance(side, numbers.Integral):
      raise TypeError(
          f"{_NAME}: local_window_size entries must be ints or None; got"
          f" {window!r}."
      )
    if side < 0:
      raise ValueError(
          f"{_NAME}: local_window_size must be non-negative; got {window!r}."
      )
    sides.append(int(side))
  return None if sides == [None, None] else tuple(sides)


def _canonical_broadcast(name, x, batch, n, t, s, num_heads):
  """x broadcastable to [*batch, N, T, S] -> [b, n, t, s] (dims 1 or full)."""
  full = (*batch, num_heads, t, s)
  if x.ndim > len(full):
    raise ValueError(
        f"{_NAME}: {name} has rank {x.ndim}, more than [*B, N, T, S] ="
        f" {full} allows."
    )
  shape = (1,) * (len(full) - x.ndim) + tuple(x.shape)
  for got, want in zip(shape, full):
    if got not in (1, want):
      raise ValueError(
          f"{_NAME}: {name} of shape {tuple(x.shape)} is not broadcastable to"
          f" [*B, N, T, S] = {full}."
      )
  x = jnp.reshape(x, shape)
  nb = len(batch)
  bshape = shape[:nb]
  if all(d == 1 for d in bshape):
    b = 1
  else:
    if bshape != tuple(batch):
      x = jnp.broadcast_to(x, (*batch, *shape[nb:]))
    b = math.prod(batch)
  return jnp.reshape(x, (b, *shape[nb:]))


@dataclasses.dataclass(frozen=True)
class DotProductAttention(op_lib.Op):
  """Multi-head dot-product attention; this class is the "xla" reference."""

  op_name = "dot_product_attention"
  implementation = "xla"
  array_args = (
      "query", "key", "value", "bias", "mask", "query_seq_lengths",
      "key_value_seq_lengths",
  )
  residuals_kind = "attention_lse"

  def _bind(
      self, query, key, value, bias=None, mask=None, *, scale=None,
      is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
      local_window_size=None, logits_soft_cap=None, precision=None,
  ):
    for name, x in (("query", query), ("key", key), ("value", value)):
      validation.check_float_array(_NAME, name, x)
    if not query.dtype == key.dtype == value.dtype:
      raise TypeError(
          f"{_NAME}: query, key and value must share a dtype; got"
          f" {query.dtype}, {key.dtype}, {value.dtype}."
      )
    if query.ndim < 3:
      raise ValueError(
          f"{_NAME}: query must have shape [*B, T, N, H] (rank >= 3); got"
          f" {tuple(query.shape)}."
      )
    if key.ndim != query.ndim or value.ndim != query.ndim:
      raise ValueError(
          f"{_NAME}: query, key and value must have the same rank; got shapes"
          f" {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}."
      )
    *batch, t, n, h = query.shape
    *kbatch, s, kh, kd = key.shape
    *vbatch, vs, vh, _ = value.shape
    if tuple(kbatch) != tuple(batch) or tuple(vbatch) != tuple(batch):
      raise ValueError(
          f"{_NAME}: batch dims differ: query {tuple(batch)}, key"
          f" {tuple(kbatch)}, value {tuple(vbatch)}."
      )
    if kd != h:
      raise ValueError(
          f"{_NAME}: query and key head dims differ ({h} vs {kd})."
      )
    if (vs, vh) != (s, kh):
      raise ValueError(
          f"{_NAME}: value must have key's sequence length and heads"
          f" ({s}, {kh}); got ({vs}, {vh})."
      )
    if kh == 0 or n % kh != 0:
      raise ValueError(
          f"{_NAME}: the number of query heads ({n}) must be a multiple of the"
          f" number of key/value heads ({kh})."
      )
    if min(t, s, h) == 0:
      raise ValueError(f"{_NAME}: T, S and H must be non-zero.")
    bsz = math.prod(batch)
    if bias is not None:
      validation.check_float_array(_NAME, "bias", bias)
      bias = _canonical_broadcast("bias", bias, batch, n, t, s, n)
    if mask is not None:
      validation.check_array(_NAME, "mask", mask)
      if mask.dtype != jnp.bool_:
        raise TypeError(f"{_NAME}: mask must be bool, got {mask.dtype}.")
      mask = _canonical_broadcast("mask", mask, batch, n, t, s, n)
    lengths = {}
    for name, x in (
        ("query_seq_lengths", query_seq_lengths),
        ("key_value_seq_lengths", key_value_seq_lengths),
    ):
      if x is None:
        lengths[name] = None
        continue
      validation.check_int_array(_NAME, name, x)
      if tuple(x.shape) != tuple(batch):
        raise ValueError(
            f"{_NAME}: {name} must have the batch shape {tuple(batch)}; got"
            f" {tuple(x.shape)}."
        )
      lengths[name] = jnp.reshape(x, (bsz,)).astype(jnp.int32)
    if scale is None:
      scale = 1.0 / math.sqrt(h)
    else:
      scale = validation.check_real(_NAME, "scale", scale)
    if not isinstance(is_causal, (bool, np.bool_)):
      raise TypeError(f"{_NAME}: is_causal must be a bool, got {is_causal!r}.")
    if logits_soft_cap is not None:
      logits_soft_cap = validation.check_real(
          _NAME, "logits_soft_cap", logits_soft_cap, positive=True
      )
    try:
      hash(precision)
    except TypeError:
      precision = tuple(precision)
    arguments = dict(
        query=jnp.reshape(query, (bsz, t, n, h)),
        key=jnp.reshape(key, (bsz, s, kh, h)),
        value=jnp.reshape(value, (bsz, s, kh, value.shape[-1])),
        bias=bias,
        mask=mask,
        **lengths,
        scale=scale,
        is_causal=bool(is_causal),
        local_window_size=_canonical_window(local_window_size),
        logits_soft_cap=logits_soft_cap,
        precision=precision,
    )
    out_shape = (*batch, t, n, value.shape[-1])
    return arguments, lambda out: jnp.reshape(out, out_shape)

  def _fwd(
      self, *, query, key, value, bias, mask, query_seq_lengths,
      key_value_seq_lengths, scale, is_causal, local_window_size,
      logits_soft_cap, precision, config, return_residuals,
  ):
    del config
    t, s = query.shape[1], key.shape[1]
    qg, kt, vt = to_head_major(query, key, value)
    logits, _ = block_logits(
        qg, kt, bias, scale=scale, logits_soft_cap=logits_soft_cap,
        precision=precision,
    )
    valid = visible(
        jnp.arange(t), jnp.arange(s), mask=heads_view(mask, key.shape[2]),
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, is_causal=is_causal,
        local_window_size=local_window_size,
    )
    m, p, l = softmax_parts(logits, valid)
    o = jnp.einsum(
        "bkgts,bksh->bkgth", p.astype(value.dtype), vt,
        preferred_element_type=p.dtype, precision=precision,
    )
    out = from_head_major(normalize(o, l)).astype(query.dtype)
    if not return_residuals:
      return out, None
    return out, {"lse": lse_residual(m, l)}


@dataclasses.dataclass(frozen=True)
class DotProductAttentionVjp(op_lib.Op):
  """Base of the attention VJP ops.

  Called with (residuals, out, dout, **forward's canonical arguments); returns
  the gradients {query, key, value[, bias]} in the canonical shapes.
  """

  op_name = "dot_product_attention_vjp"
  array_args = ("residuals", "out", "dout") + DotProductAttention.array_args
  is_vjp = True
  residuals_kind = "attention_lse"

  def _bind(self, residuals, out, dout, **arguments):
    return dict(residuals=residuals, out=out, dout=dout, **arguments), (
        lambda grads: grads
    )


# --- building blocks shared by the XLA implementations ----------------------
# Inside the kernels arrays are head-major so every matmul is a plain batched
# matmul over (batch, kv head): q [B, K, G, T, H], k and v [B, K, S, H].


def to_head_major(q, k, v):
  """q [B, T, N, H] -> [B, K, G, T, H]; k, v [B, S, K, H] -> [B, K, S, H]."""
  bsz, t, n, h = q.shape
  kv_heads = k.shape[2]
  qg = q.reshape(bsz, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)
  return qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def from_head_major(o):
  """[B, K, G, T, H] -> [B, T, N, H]."""
  bsz, kv_heads, g, t, h = o.shape
  return o.transpose(0, 3, 1, 2, 4).reshape(bsz, t, kv_heads * g, h)


def heads_view(x, num_kv_heads):
  """[b, n, t, s] -> [b, K or 1, G or 1, t, s] (grouped-query view)."""
  if x is None:
    return None
  b, n, t, s = x.shape
  if n == 1:
    return x.reshape(b, 1, 1, t, s)
  return x.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


def block_logits(qg, kt, bias, *, scale, logits_soft_cap, precision):
  """Capped logits [B, K, G, tq, sk] of a query block and a key block.

  qg: [B, K, G, tq, H], kt: [B, K, sk, H], bias: [b, n, tq|1, sk|1] or None.
  Returns (logits, tanh_of_capped) where the second is None without a cap
  (d logits_capped / d logits = 1 - tanh^2).
  """
  cd = stats_dtype(qg.dtype)
  logits = jnp.einsum(
      "bkgth,bksh->bkgts", qg, kt, preferred_element_type=cd,
      precision=precision,
  ).astype(cd) * scale
  if bias is not None:
    logits = logits + heads_view(bias, kt.shape[1]).astype(cd)
  tanh = None
  if logits_soft_cap is not None:
    tanh = jnp.tanh(logits / logits_soft_cap)
    logits = logits_soft_cap * tanh
  return logits, tanh


def visible(
    q_pos, kv_pos, *, mask=None, query_seq_lengths=None,
    key_value_seq_lengths=None, is_causal=False, local_window_size=None,
    kv_limit=None,
):
  """Bool [B|1, K|1, G|1, tq, sk]: which keys each query sees (None = all).

  q_pos: [tq] and kv_pos: [sk] absolute positions; mask: heads_view'd block;
  kv_limit: keys at positions >= kv_limit are padding.
  """
  parts = []
  qi, kj = q_pos[:, None], kv_pos[None, :]
  if is_causal:
    parts.append(kj <= qi)
  if local_window_size is not None:
    left, right = local_window_size
    if left is not None:
      parts.append(kj >= qi - left)
    if right is not None:
      parts.append(kj <= qi + right)
  if kv_limit is not None:
    parts.append(jnp.broadcast_to(kj < kv_limit, (q_pos.shape[0], kv_pos.shape[0])))
  valid = None
  for p in parts:
    valid = p if valid is None else valid & p
  if valid is not None:
    valid = valid[None, None, None]
  if query_seq_lengths is not None:
    qv = (q_pos[None, :] < query_seq_lengths[:, None])[:, None, None, :, None]
    valid = qv if valid is None else valid & qv
  if key_value_seq_lengths is not None:
    kv = (kv_pos[None, :] < key_value_seq_lengths[:, None])[:, None, None, None, :]
    valid = kv if valid is None else valid & kv
  if mask is not None:
    valid = mask if valid is None else valid & mask
  return valid


def softmax_parts(logits, valid):
  """Row max m, unnormalised probabilities p and row sums l over visible keys.

  Rows without a visible key get m = 0, p = 0, l = 0 (no NaN, no gradient).
  """
  if valid is None:
    m = jnp.max(logits, axis=-1)
    p = jnp.exp(logits - m[..., None])
  else:
    m = jnp.max(jnp.where(valid, logits, -jnp.inf), axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    # The inner where keeps masked (possibly -inf) logits out of exp's
    # gradient; the outer one zeroes them.
    safe = jnp.where(valid, logits, m[..., None])
    p = jnp.where(valid, jnp.exp(safe - m[..., None]), 0.0)
  return m, p, jnp.sum(p, axis=-1)


def normalize(o, l):
  """o [B, K, G, t, H] / l [B, K, G, t], with 0 for empty rows."""
  return o / jnp.where(l == 0, 1.0, l)[..., None]


def lse_residual(m, l):
  """log-sum-exp [B, N, T] (f32) from m, l [B, K, G, T]; empty rows -> 0."""
  lse = m + jnp.log(jnp.where(l == 0, 1.0, l))
  bsz, kh, g, t = lse.shape
  return lse.reshape(bsz, kh * g, t)
