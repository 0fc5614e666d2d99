"""Memory-efficient attention in plain XLA: online softmax over chunks.

Forward: for each query chunk (lax.map), scan over key chunks keeping the
running max m, sum l and unnormalised output (FlashAttention-2,
arXiv:2307.08691, Alg. 1). Saves the log-sum-exp residual.

Backward: a hand-written VJP (FlashAttention-2 Alg. 2): scan over key chunks,
and within each over query chunks, recomputing p = exp(logits - lse) per block:
  dv += p^T do;  dp = do v^T;  ds = p * (dp - D),  D = rowsum(do * o);
  ds *= 1 - tanh^2 under a soft cap;  dbias += ds;
  dq += scale * ds k;  dk += scale * ds^T q.
Peak memory is O(T x chunk) for both passes. When one block covers the whole
call (and there is no soft cap) the forward also saves the probabilities
(T x S = T x chunk, input dtype) so the backward skips recomputing them.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pydantic
from jax import lax

from tokamax._src import op as op_lib
from tokamax.ops.attention import xla as base


@pydantic.dataclasses.dataclass(frozen=True)
class ChunkedAttentionConfig:
  """Chunk sizes (query rows and key columns per block)."""

  q_chunk_size: pydantic.PositiveInt = 1024
  kv_chunk_size: pydantic.PositiveInt = 512


# Logits elements per block the heuristic allows (f32: 8 GiB); measured on
# the H200 (docs/benchmarks.md): fewer, larger blocks are faster in XLA.
_BLOCK_ELEMENTS = 1 << 31



def _heuristic(ba: op_lib.BoundArguments) -> ChunkedAttentionConfig:
  q = ba.arguments["query"]
  bsz, t, n, _ = q.shape
  s = ba.arguments["key"].shape[1]
  q_chunk = min(t, 4096)
  kv_chunk = _BLOCK_ELEMENTS // max(1, bsz * n * q_chunk)
  kv_chunk = max(128, 1 << max(0, kv_chunk.bit_length() - 1))
  return ChunkedAttentionConfig(q_chunk_size=q_chunk, kv_chunk_size=min(kv_chunk, s))


def _search_space(ba: op_lib.BoundArguments) -> set[ChunkedAttentionConfig]:
  """Query chunks T, T/2, T/4 (at most 4096); key chunks S down to S/8."""
  t = ba.arguments["query"].shape[1]
  s = ba.arguments["key"].shape[1]
  qs = {min(t, 4096) >> i for i in range(3)}
  ks = {s >> i for i in range(4)}
  return {
      ChunkedAttentionConfig(q_chunk_size=a, kv_chunk_size=b)
      for a, b in itertools.product(qs, ks)
      if a >= 16 and b >= 8 or (a, b) == (t, s)
  }


class _Blocks:
  """Padded arrays and per-block slicing shared by the forward and backward."""

  def __init__(self, args, config: ChunkedAttentionConfig):
    q, k = args["query"], args["key"]
    self.args = args
    self.t, self.s = q.shape[1], k.shape[1]
    self.tq = min(config.q_chunk_size, self.t)
    self.sk = min(config.kv_chunk_size, self.s)
    self.nq = -(-self.t // self.tq)
    self.nk = -(-self.s // self.sk)
    self.tp, self.sp = self.nq * self.tq, self.nk * self.sk
    self.kv_heads = k.shape[2]

  def pad_t(self, x, axis):
    return _pad(x, axis, self.tp)

  def pad_s(self, x, axis):
    return _pad(x, axis, self.sp)

  def pad_ts(self, x):
    """bias/mask [b, n, t|1, s|1]: pad the full dims."""
    if x is None:
      return None
    if x.shape[2] != 1:
      x = self.pad_t(x, 2)
    if x.shape[3] != 1:
      x = self.pad_s(x, 3)
    return x

  def ts_block(self, x, i, j):
    """Block (i, j) of a padded bias/mask, keeping broadcast dims of 1."""
    if x is None:
      return None
    if x.shape[2] != 1:
      x = lax.dynamic_slice_in_dim(x, i * self.tq, self.tq, axis=2)
    if x.shape[3] != 1:
      x = lax.dynamic_slice_in_dim(x, j * self.sk, self.sk, axis=3)
    return x

  def logits(self, qc, kc, bias, mask, i, j, *, with_tanh=False):
    a = self.args
    logits, tanh = base.block_logits(
        qc, kc, self.ts_block(bias, i, j), scale=a["scale"],
        logits_soft_cap=a["logits_soft_cap"], precision=a["precision"],
    )
    q_pos = i * self.tq + jnp.arange(self.tq)
    kv_pos = j * self.sk + jnp.arange(self.sk)
    valid = base.visible(
        q_pos, kv_pos,
        mask=base.heads_view(self.ts_block(mask, i, j), self.kv_heads),
        query_seq_lengths=a["query_seq_lengths"],
        key_value_seq_lengths=a["key_value_seq_lengths"],
        is_causal=a["is_causal"], local_window_size=a["local_window_size"],
        kv_limit=self.s if self.sp != self.s else None,
    )
    return (logits, valid, tanh) if with_tanh else (logits, valid)


def _pad(x, axis, size, value=0):
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def _loop(n, body, init):
  """fori_loop that skips the loop machinery for a single iteration."""
  if n == 1:
    return body(0, init)
  return lax.fori_loop(0, n, body, init)


def _map(n, f):
  """Stacked f(i) for i < n ([n, ...] leading axis)."""
  if n == 1:
    return jax.tree.map(lambda x: x[None], f(0))
  return lax.map(f, jnp.arange(n))


@dataclasses.dataclass(frozen=True)
class ChunkedDotProductAttentionVjp(base.DotProductAttentionVjp):
  """Chunked FlashAttention-2 backward from the lse residual."""

  implementation = "xla_chunked"
  config_cls = ChunkedAttentionConfig

  def _get_heuristics_config(self, ba):
    return _heuristic(ba)

  def _get_autotuning_configs(self, ba):
    return _search_space(ba)

  def _fwd(self, *, residuals, out, dout, config, return_residuals, **args):
    del return_residuals
    blk = _Blocks(args, config)
    q, k, v = args["query"], args["key"], args["value"]
    bias, mask = blk.pad_ts(args["bias"]), blk.pad_ts(args["mask"])
    cd = base.stats_dtype(q.dtype)
    prec = args["precision"]

    qg, kt, vt = base.to_head_major(q, k, v)
    og = base.to_head_major(out, k, k)[0]
    dog = base.to_head_major(dout, k, k)[0]
    # D = rowsum(dout * out) [B, K, G, T]; lse [B, K, G, T].
    delta = jnp.sum(dog.astype(cd) * og.astype(cd), axis=-1)
    lse = residuals["lse"].reshape(delta.shape)
    # Probabilities saved by a single-block forward fit a single-block VJP.
    single = blk.nq == 1 and blk.nk == 1
    probs = residuals.get("probs") if single else None
    qg, dog = blk.pad_t(qg, 3), blk.pad_t(dog, 3)
    # Padded query rows get lse = inf, hence p = 0.
    delta, lse = blk.pad_t(delta, 3), _pad(lse, 3, blk.tp, jnp.inf)
    kt, vt = blk.pad_s(kt, 2), blk.pad_s(vt, 2)

    def kv_step(j, carry):
      dq, dbias, dks, dvs = carry
      kc = lax.dynamic_slice_in_dim(kt, j * blk.sk, blk.sk, axis=2)
      vc = lax.dynamic_slice_in_dim(vt, j * blk.sk, blk.sk, axis=2)

      def q_step(i, inner):
        dq, dbias, dk, dv = inner
        rows = lambda x: lax.dynamic_slice_in_dim(x, i * blk.tq, blk.tq, axis=3)
        qc, doc, lse_c, dl_c = rows(qg), rows(dog), rows(lse), rows(delta)
        if probs is not None:  # single block, saved by the forward
          p, tanh = probs.astype(cd), None
        else:
          logits, valid, tanh = blk.logits(
              qc, kc, bias, mask, i, j, with_tanh=True
          )
          p = jnp.exp(logits - lse_c[..., None])
          if valid is not None:
            p = jnp.where(valid, p, 0.0)
        dv = dv + jnp.einsum(
            "bkgts,bkgth->bksh", p.astype(v.dtype), doc,
            preferred_element_type=cd, precision=prec,
        )
        dp = jnp.einsum(
            "bkgth,bksh->bkgts", doc, vc, preferred_element_type=cd,
            precision=prec,
        )
        ds = p * (dp - dl_c[..., None])
        if tanh is not None:
          ds = ds * (1.0 - tanh * tanh)
        if dbias is not None:
          dbias = _accumulate_dbias(dbias, ds, blk, i, j)
        ds_in = ds.astype(q.dtype)
        dq_c = jnp.einsum(
            "bkgts,bksh->bkgth", ds_in, kc, preferred_element_type=cd,
            precision=prec,
        )
        dq = lax.dynamic_update_slice_in_dim(
            dq, rows(dq) + dq_c, i * blk.tq, axis=3
        )
        dk = dk + jnp.einsum(
            "bkgts,bkgth->bksh", ds_in, qc, preferred_element_type=cd,
            precision=prec,
        )
        return dq, dbias, dk, dv

      init = (dq, dbias, jnp.zeros_like(kc, cd), jnp.zeros_like(vc, cd))
      dq, dbias, dk, dv = _loop(blk.nq, q_step, init)
      dks = lax.dynamic_update_slice_in_dim(dks, dk, j * blk.sk, axis=2)
      dvs = lax.dynamic_update_slice_in_dim(dvs, dv, j * blk.sk, axis=2)
      return dq, dbias, dks, dvs

    # zeros_like keeps the inputs' shardings (explicit sharding mode).
    init = (
        jnp.zeros_like(qg, cd),
        None if bias is None else jnp.zeros_like(bias, cd),
        jnp.zeros_like(kt, cd),
        jnp.zeros_like(vt, cd),
    )
    dq, dbias, dk, dv = _loop(blk.nk, kv_step, init)
    scale = args["scale"]
    grads = {
        "query": (base.from_head_major(dq[:, :, :, : blk.t]) * scale).astype(q.dtype),
        "key": (dk[:, :, : blk.s].transpose(0, 2, 1, 3) * scale).astype(k.dtype),
        "value": dv[:, :, : blk.s].transpose(0, 2, 1, 3).astype(v.dtype),
    }
    if dbias is not None:
      b = args["bias"]
      grads["bias"] = dbias[:, :, : b.shape[2], : b.shape[3]].astype(b.dtype)
    return grads, None


def _accumulate_dbias(dbias, ds, blk: _Blocks, i, j):
  """Adds block (i, j) of ds [B, K, G, tq, sk] into dbias [b, n, t|1, s|1]."""
  bsz, kh, g, tq, sk = ds.shape
  ds = ds.reshape(bsz, kh * g, tq, sk)
  b, n, t, s = dbias.shape
  axes = tuple(a for a, d in enumerate((b, n, t, s)) if d == 1 and ds.shape[a] != 1)
  if axes:
    ds = jnp.sum(ds, axis=axes, keepdims=True)
  start = (0, 0, i * blk.tq if t != 1 else 0, j * blk.sk if s != 1 else 0)
  current = lax.dynamic_slice(dbias, start, ds.shape)
  return lax.dynamic_update_slice(dbias, current + ds, start)


@dataclasses.dataclass(frozen=True)
class ChunkedDotProductAttention(base.DotProductAttention):
  """The "xla_chunked" implementation."""

  implementation = "xla_chunked"
  config_cls = ChunkedAttentionConfig
  differentiable_forward = True  # jax.jvp differentiates the chunked loop
  vjp: op_lib.Op | None = dataclasses.field(
      default_factory=ChunkedDotProductAttentionVjp
  )

  def _get_heuristics_config(self, ba):
    return _heuristic(ba)

  def _get_autotuning_configs(self, ba):
    return _search_space(ba)

  def _fwd(self, *, config, return_residuals, **args):
    blk = _Blocks(args, config)
    q, k, v = args["query"], args["key"], args["value"]
    bias, mask = blk.pad_ts(args["bias"]), blk.pad_ts(args["mask"])
    cd = base.stats_dtype(q.dtype)
    qg, kt, vt = base.to_head_major(q, k, v)
    qg = blk.pad_t(qg, 3)
    kt, vt = blk.pad_s(kt, 2), blk.pad_s(vt, 2)
    stats_shape = qg.shape[:3] + (blk.tq,)
    save_probs = (
        return_residuals and blk.nq == 1 and blk.nk == 1
        and args["logits_soft_cap"] is None
    )
    single_block = {}  # p of the only block (traced once, no loop)

    def q_block(i):
      qc = lax.dynamic_slice_in_dim(qg, i * blk.tq, blk.tq, axis=3)

      def kv_step(j, carry):
        m, l, acc = carry
        kc = lax.dynamic_slice_in_dim(kt, j * blk.sk, blk.sk, axis=2)
        vc = lax.dynamic_slice_in_dim(vt, j * blk.sk, blk.sk, axis=2)
        logits, valid = blk.logits(qc, kc, bias, mask, i, j)
        if valid is None:
          m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        else:
          m_new = jnp.maximum(
              m, jnp.max(jnp.where(valid, logits, -jnp.inf), axis=-1)
          )
        # Rows with nothing visible so far keep m = -inf; shift them by 0.
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(logits - shift[..., None])
        if valid is not None:
          p = jnp.where(valid, p, 0.0)
        alpha = jnp.exp(m - shift)
        l = alpha * l + jnp.sum(p, axis=-1)
        if save_probs:
          single_block["p"] = p
        pv = jnp.einsum(
            "bkgts,bksh->bkgth", p.astype(v.dtype), vc,
            preferred_element_type=cd, precision=args["precision"],
        )
        return m_new, l, alpha[..., None] * acc + pv

      init = (
          jnp.full(stats_shape, -jnp.inf, cd),
          jnp.zeros(stats_shape, cd),
          jnp.zeros(stats_shape + (vt.shape[-1],), cd),
      )
      m, l, acc = _loop(blk.nk, kv_step, init)
      m = jnp.where(jnp.isfinite(m), m, 0.0)
      return base.normalize(acc, l).astype(q.dtype), base.lse_residual(m, l)

    outs, lses = _map(blk.nq, q_block)
    # [nq, B, K, G, tq, Hv] -> [B, K, G, T, Hv];  [nq, B, N, tq] -> [B, N, T].
    bsz, kv_heads, g = qg.shape[:3]
    outs = jnp.moveaxis(outs, 0, 3).reshape(bsz, kv_heads, g, blk.tp, -1)
    out = base.from_head_major(outs[:, :, :, : blk.t])
    lse = jnp.moveaxis(lses, 0, 2).reshape(bsz, kv_heads * g, blk.tp)[:, :, : blk.t]
    if not return_residuals:
      return out, None
    residuals = {"lse": lse}
    if save_probs:
      # With one kv block, m is final when p is formed: p / l is softmax.
      l = jnp.sum(single_block["p"], axis=-1)
      residuals["probs"] = base.normalize(single_block["p"], l).astype(v.dtype)
    return out, residuals
