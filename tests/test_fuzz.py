"""Fuzzing the kernels in interpret mode against f64 (not part of `make test`).

    TOKAMAX_FUZZ=200 JAX_PLATFORMS=cpu .venv/bin/python -m pytest -s tests/test_fuzz.py

runs each fuzzer for that many hypothesis examples (fresh random draws each
run, no example database): the "triton" and "mosaic" attention kernels with
every feature over random shapes and configs, and the "triton" layer_norm
kernels over random [pre, F, post] views and configs, forward and every
gradient, with the op test bases' checks (poisoned outputs in interpret mode,
NaN never passes). Without TOKAMAX_FUZZ the tests skip. A failure prints the
shrunk example; turn it into a base-test case (as `window_rows_past_keys`
came from the "mosaic" fuzzer, 2026-12-05).
"""

from __future__ import annotations

import os

import hypothesis
import hypothesis.strategies as st
import jax
import pytest

import tokamax
from tests import test_attention as ta
from tests import test_layer_norm as tl
from tokamax.ops.normalization import triton as triton_ln

N = int(os.environ.get("TOKAMAX_FUZZ", "0"))
pytestmark = pytest.mark.skipif(N <= 0, reason="set TOKAMAX_FUZZ=<examples> to fuzz")
SETTINGS = dict(max_examples=max(N, 1), deadline=None, database=None)

WINDOWS = [None, 3, (0, 5), (4, 0), (20, None), (None, 9), (0, 0), (1, 1)]
# bias shapes by index: none, [1, N, T, S], [B, N, T, S], [B, 1, 1, S],
# [1, N, T, 1] (constant along keys: its dbias is 0 in exact arithmetic and
# roundoff of D = rowsum(dO * O) in 16 bits, so only checked in f32)
_BIASES = 5


def _case(t, s, kh, g, h, hv, causal, window, bias, mask, lens, cap):
  n = kh * g
  kwargs = [("is_causal", causal), ("local_window_size", window)]
  if cap:
    kwargs.append(("logits_soft_cap", 5.0))
  bias_shape = [None, (1, n, t, s), (2, n, t, s), (2, 1, 1, s), (1, n, t, 1)][bias]
  mask_shape = [None, (2, 1, t, s), (1, n, t, s)][mask]
  return ta.Case(batch=(2,), t=t, s=s, n=n, kh=kh, h=h, hv=hv, kwargs=tuple(kwargs),
                 bias=bias_shape, mask=mask_shape, q_lens=lens, kv_lens=lens)


_FEATURES = dict(
    kh=st.integers(1, 2), g=st.integers(1, 3), causal=st.booleans(),
    bias=st.integers(0, _BIASES - 1), mask=st.integers(0, 2), lens=st.booleans(),
    cap=st.booleans(), hv=st.sampled_from([None, 24]),
)


class _Checker(ta.AttentionTestBase):
  """The attention base's f64 check for one pinned op (not collected)."""

  def __init__(self, implementation, op):
    self.implementation, self.op = implementation, op


@hypothesis.settings(**SETTINGS)
@hypothesis.given(
    t=st.integers(1, 70), s=st.integers(1, 70), bq=st.sampled_from([16, 32]),
    bk=st.sampled_from([16, 32]), window=st.sampled_from(WINDOWS),
    h=st.sampled_from([16, 40]), parts=st.sampled_from([1, 2]),
    dtype=st.sampled_from([ta.F32, ta.BF16]), **_FEATURES,
)
def test_fuzz_triton_attention(t, s, bq, bk, window, h, parts, dtype, kh, g, causal,
                               bias, mask, lens, cap, hv):
  if bias == _BIASES - 1:
    dtype = ta.F32
  op = ta._triton_op(
      dict(block_q=32 if parts == 2 else bq, block_k=bk, row_parts=parts),
      dict(block_k=bk, block_q=bq, dq_block_q=bq, dq_block_k=bk))
  with pytest.MonkeyPatch.context() as mp, ta.pallas_triton.interpret_mode():
    mp.setattr(ta.triton_attn, "_MIN_PART_ROWS", 16)  # halves of 16 rows
    _Checker("triton", op).check(
        _case(t, s, kh, g, h, hv, causal, window, bias, mask, lens, cap), dtype)


@hypothesis.settings(**SETTINGS)
@hypothesis.given(
    t=st.integers(1, 300), s=st.integers(1, 300), stages=st.sampled_from([1, 2, 3]),
    window=st.sampled_from(WINDOWS + [(0, 70), (90, 0)]), h=st.sampled_from([64, 40]),
    consumers=st.sampled_from([2, 3]), bk=st.sampled_from([64, 128]),
    dq_consumers=st.sampled_from([2, 3]), ctas=st.sampled_from([0, 1, 2, 3, 5]),
    exp_under_dp=st.sampled_from([(), ("dkdv", "dq")]),
    **_FEATURES,
)
def test_fuzz_mosaic_attention(t, s, stages, window, h, consumers, bk, dq_consumers,
                               ctas, exp_under_dp, kh, g, causal, bias, mask, lens, cap,
                               hv):
  """ctas > 0: the persistent forward, dq and dk/dv kernels on that many CTAs;
  exp_under_dp: the backward kernels' EXP_UNDER_DP step order."""
  bias = min(bias, _BIASES - 2)  # bf16 only (see _BIASES)
  op = ta._mosaic_op(
      vjp=dict(block_kv=64, block_q=64, num_stages=stages, dq_block_q=64,
               dq_block_kv=64, dq_num_stages=stages, dq_consumers=dq_consumers,
               dq_persistent=ctas > 0, dkdv_persistent=ctas > 0),
      block_q=64, block_kv=bk, num_stages=stages, consumers=consumers,
      persistent=ctas > 0)
  with pytest.MonkeyPatch.context() as mp, ta.pallas_mosaic.interpret_mode():
    mp.setattr(ta.mosaic_attn, "PERSISTENT_CTAS", max(ctas, 1))
    mp.setattr(ta.mosaic_attn, "EXP_UNDER_DP", exp_under_dp)
    _Checker("mosaic", op).check(
        _case(t, s, kh, g, h, hv, causal, window, bias, mask, lens, cap), ta.BF16)


@hypothesis.settings(**SETTINGS)
@hypothesis.given(
    pre=st.integers(1, 4), f=st.integers(1, 150), post=st.sampled_from([1, 1, 2, 7, 33]),
    with_scale=st.booleans(), with_offset=st.booleans(), subtract_mean=st.booleans(),
    scale_offset=st.sampled_from([0.0, 1.0]),
    dtype=st.sampled_from([tl.F32, tl.BF16, tl.F16]),
    block_rows=st.sampled_from([1, 2, 4, 8]), warps=st.sampled_from([1, 2, 4]),
    programs_per_sm=st.sampled_from([0, 1, 2, 64]),
    prefetch=st.sampled_from([None, 0, 1, 2]), loop_stages=st.sampled_from([0, 2, 3]),
    chunk=st.sampled_from([0, 16, 32]), vjp_block_rows=st.sampled_from([1, 2, 4]),
    vjp_warps=st.sampled_from([1, 4]), vjp_programs_per_sm=st.sampled_from([0, 1, 3]),
    vjp_chunk=st.sampled_from([0, 16]), max_features=st.sampled_from([16384, 64]),
    sms=st.integers(1, 3),
)
def test_fuzz_triton_layer_norm(pre, f, post, with_scale, with_offset, subtract_mean,
                                scale_offset, dtype, block_rows, warps, programs_per_sm,
                                prefetch, loop_stages, chunk, vjp_block_rows, vjp_warps,
                                vjp_programs_per_sm, vjp_chunk, max_features, sms):
  """Axis 1 of [pre, F] (rows) or [pre, F, post] (columns); MAX_FEATURES 64
  makes rows over 64 features wide (chunked kernels, feature_chunk needed);
  1-3 SMs make looping programs wrap. A config the kernels refuse passes;
  an input XLA's f32 also fails (ill-conditioned: F = 2, nearly equal
  features) is skipped. F = 1 included: the backward's dx is exactly 0
  there (its FMA roundoff times rstd = 1/sqrt(eps) showed as ~4e-5 before
  2026-12-05)."""
  shape = (pre, f, post) if post > 1 else (pre, f)
  x, scale, offset, key = tl.make_inputs(shape, 1, with_scale, with_offset, dtype, f)
  ct = jax.random.normal(key, shape, tl.F32)
  config = triton_ln.TritonLayerNormConfig(
      block_rows=block_rows, num_warps=warps, programs_per_sm=programs_per_sm,
      prefetch=prefetch, loop_stages=loop_stages, feature_chunk=chunk)
  vjp_config = triton_ln.TritonLayerNormConfig(
      block_rows=vjp_block_rows, num_warps=vjp_warps,
      programs_per_sm=vjp_programs_per_sm, feature_chunk=vjp_chunk)
  op = triton_ln.TritonLayerNorm(
      config=config, vjp=triton_ln.TritonLayerNormVjp(config=vjp_config))
  static = dict(axis=1, subtract_mean=subtract_mean, scale_offset=scale_offset)
  with pytest.MonkeyPatch.context() as mp, triton_ln.interpret_mode():
    mp.setattr(triton_ln, "MAX_FEATURES", max_features)
    mp.setattr(triton_ln, "_num_sms", lambda: sms)
    try:
      tl.check_against_f64(op, (x, scale, offset), ct, **static)
    except NotImplementedError:
      return  # e.g. rows wider than MAX_FEATURES without feature_chunk
    except AssertionError:
      xla = lambda *a, **k: tokamax.layer_norm(*a, implementation="xla", **k)
      try:
        tl.check_against_f64(xla, (x, scale, offset), ct, **static)
      except AssertionError:
        hypothesis.reject()  # XLA's f32 fails too: the input, not the kernel
      raise
