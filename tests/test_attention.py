"""dot_product_attention: one test base, run for every implementation."""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import pydantic

import tokamax
from tokamax.ops.attention import xla_chunked
from tests import reference

F32, BF16, F16, F64 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64


@dataclasses.dataclass(frozen=True)
class Case:
  """Shapes and features of one attention call (user layout)."""

  batch: tuple[int, ...] = (2,)
  t: int = 40
  s: int = 40
  n: int = 2
  kh: int = 2
  h: int = 32
  hv: int | None = None
  bias: tuple[int, ...] | None = None  # shape; "full" uses [*B, N, T, S]
  mask: tuple[int, ...] | None = None
  q_lens: bool = False
  kv_lens: bool = False
  kwargs: tuple = ()  # static keyword arguments as (name, value) pairs


def _full(c):
  return (*c.batch, c.n, c.t, c.s)


FEATURES = {
    "plain": Case(),
    "causal": Case(kwargs=(("is_causal", True),)),
    "bias_full": Case(bias=("full",)),
    "bias_broadcast": Case(bias=(1, 2, 1, 40)),
    "bias_rank2": Case(bias=(40, 40)),
    "mask": Case(mask=("full",)),
    "mask_broadcast": Case(mask=(2, 1, 40, 40)),
    "q_lens": Case(q_lens=True),
    "kv_lens": Case(kv_lens=True),
    "window": Case(kwargs=(("local_window_size", 5),)),
    "window_left_right": Case(kwargs=(("local_window_size", (7, 3)),)),
    "window_left_causal": Case(
        kwargs=(("local_window_size", (6, None)), ("is_causal", True))
    ),
    "soft_cap": Case(kwargs=(("logits_soft_cap", 2.0), ("scale", 0.5))),
    "scale": Case(kwargs=(("scale", 0.3),)),
    "gqa": Case(n=4, kh=2),
    "mqa": Case(n=4, kh=1),
    "t_ne_s": Case(t=24, s=56),
    "t_ne_s_causal": Case(t=56, s=24, kwargs=(("is_causal", True),)),
    # Rows from ~20 on see no key; with 64- or 128-key blocks their first
    # visible block (row - 3) // block_kv passes the last block, which
    # "mosaic"'s dbias zero-fill once wrote past (2026-12-05, fuzzing).
    "window_rows_past_keys": Case(t=400, s=8, bias=("full",),
                                  kwargs=(("local_window_size", 3),)),
    "odd_sizes": Case(batch=(1,), t=77, s=130, h=80),
    "value_head_dim": Case(h=32, hv=48),
    "no_batch": Case(batch=()),
    "two_batch_dims": Case(batch=(2, 3), t=24, s=24),
    "combined": Case(
        n=4, kh=2, t=48, s=64, bias=("full",), mask=("full",), q_lens=True,
        kv_lens=True,
        kwargs=(
            ("is_causal", True), ("local_window_size", (20, 0)),
            ("logits_soft_cap", 3.0),
        ),
    ),
    "combined_positional": Case(
        n=4, kh=2, t=48, s=64, q_lens=True, kv_lens=True,
        kwargs=(
            ("is_causal", True), ("local_window_size", (20, 0)),
            ("logits_soft_cap", 3.0),
        ),
    ),
    "combined_no_batch": Case(
        batch=(), bias=(2, 1, 40), mask=(40, 40),
        kwargs=(("local_window_size", (9, 4)), ("logits_soft_cap", 1.5)),
    ),
}


def make_inputs(c: Case, dtype, seed: int):
  """Random inputs (never zeros); masks hide ~30% and one full query row."""
  ks = jax.random.split(jax.random.key(seed), 8)
  hv = c.hv or c.h
  q = jax.random.normal(ks[0], (*c.batch, c.t, c.n, c.h), dtype)
  k = jax.random.normal(ks[1], (*c.batch, c.s, c.kh, c.h), dtype)
  v = jax.random.normal(ks[2], (*c.batch, c.s, c.kh, hv), dtype)
  args = dict(query=q, key=k, value=v)
  if c.bias is not None:
    shape = _full(c) if c.bias == ("full",) else c.bias
    args["bias"] = jax.random.normal(ks[3], shape, dtype)
  if c.mask is not None:
    shape = _full(c) if c.mask == ("full",) else c.mask
    mask = np.array(jax.random.uniform(ks[4], shape) > 0.3)
    mask[..., min(3, shape[-2] - 1), :] = False  # a query row that sees nothing
    args["mask"] = jnp.asarray(mask)
  if c.q_lens:
    args["query_seq_lengths"] = jax.random.randint(ks[5], c.batch, 1, c.t + 1)
  if c.kv_lens:
    lens = np.array(jax.random.randint(ks[6], c.batch, 1, c.s + 1))
    if lens.size > 1:
      lens.reshape(-1)[0] = 0  # a batch element that sees no key at all
    args["key_value_seq_lengths"] = jnp.asarray(lens, jnp.int32)
  return args, dict(c.kwargs), ks[7]


def _split(args):
  diff = {n: a for n, a in args.items() if n in ("query", "key", "value", "bias")}
  rest = {n: a for n, a in args.items() if n not in diff}
  return diff, rest


class AttentionTestBase:
  """Subclasses set `implementation` (and optionally a pinned `op`)."""

  implementation: str = "xla"
  op: tokamax.Op | None = None
  dtypes = (F32, BF16, F16)
  unsupported: frozenset[str] = frozenset()  # features that must raise
  unsupported_grad: frozenset[str] = frozenset()  # only the gradient raises
  jvp_supported = False  # forward-mode autodiff runs (else: refused by name)
  seed = 0

  def attention(self, *args, **kwargs):
    if self.op is not None:
      return self.op(*args, **kwargs)
    return tokamax.dot_product_attention(
        *args, implementation=self.implementation, **kwargs
    )

  def check(self, case: Case, dtype, feature="", seed=None):
    seed = self.seed if seed is None else seed
    args, kwargs, ct_key = make_inputs(case, dtype, seed)
    if feature in self.unsupported:
      with pytest.raises(NotImplementedError, match=self.implementation):
        self.attention(**args, **kwargs)
      return
    diff, rest = _split(args)
    fwd_tol, grad_tol = reference.TOLERANCE[jnp.dtype(dtype)]
    loss_of = lambda d: jnp.sum(self.attention(**d, **rest, **kwargs).astype(F32))
    if feature in self.unsupported_grad:
      self.attention(**args, **kwargs)  # the forward works
      with pytest.raises(NotImplementedError, match=self.implementation):
        jax.grad(loss_of)(diff)
      return

    out = jax.jit(lambda d: self.attention(**d, **rest, **kwargs))(diff)
    ref = reference.attention(**args, **kwargs)
    assert out.dtype == jnp.dtype(dtype)
    reference.assert_close(out, ref, fwd_tol, "forward")

    ct = jax.random.normal(ct_key, out.shape, jnp.float32)

    def loss(d):
      o = self.attention(**d, **rest, **kwargs)
      return jnp.sum(o.astype(jnp.float32) * ct)

    def ref_loss(d):
      return jnp.sum(reference.attention(**d, **rest, **kwargs) * ct)

    grads = jax.jit(jax.grad(loss))(diff)
    ref_grads = jax.grad(ref_loss)({n: reference.f64(a) for n, a in diff.items()})
    for name in diff:
      assert grads[name].dtype == diff[name].dtype
      reference.assert_close(grads[name], ref_grads[name], grad_tol, f"d{name}")

  @pytest.mark.parametrize("feature", sorted(FEATURES))
  @pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=lambda d: jnp.dtype(d).name)
  def test_feature(self, feature, dtype):
    if dtype not in self.dtypes:
      with pytest.raises(NotImplementedError, match=self.implementation):
        args, kwargs, _ = make_inputs(FEATURES[feature], dtype, self.seed)
        self.attention(**args, **kwargs)
      return
    self.check(FEATURES[feature], dtype, feature)

  def test_fully_masked_rows_are_zero_with_zero_gradient(self):
    dtype = self.dtypes[0]
    c = Case(batch=(2,), t=16, s=24, q_lens=True, kv_lens=True)
    args, _, _ = make_inputs(c, dtype, self.seed + 1)
    args["query_seq_lengths"] = jnp.array([16, 5], jnp.int32)
    args["key_value_seq_lengths"] = jnp.array([0, 24], jnp.int32)
    diff, rest = _split(args)
    f = lambda d: self.attention(**d, **rest)
    out = f(diff)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(out[1, 5:], np.float32), 0.0)
    grads = jax.grad(lambda d: jnp.sum(f(d).astype(jnp.float32) ** 2))(diff)
    assert all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in grads.values())
    np.testing.assert_array_equal(np.asarray(grads["query"][0], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(grads["query"][1, 5:], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(grads["key"][0], np.float32), 0.0)

  def test_vmap(self):
    dtype = self.dtypes[0]
    c = Case(batch=(3, 2), t=32, s=32, n=4, kh=2, kwargs=(("is_causal", True),))
    args, kwargs, _ = make_inputs(c, dtype, self.seed + 2)
    diff, _ = _split(args)
    out = jax.vmap(lambda d: self.attention(**d, **kwargs))(diff)
    ref = reference.attention(**args, **kwargs)
    reference.assert_close(out, ref, reference.TOLERANCE[jnp.dtype(dtype)][0])
    grads = jax.vmap(jax.grad(
        lambda d: jnp.sum(self.attention(**d, **kwargs).astype(jnp.float32))
    ))(diff)
    ref_grads = jax.grad(
        lambda d: jnp.sum(reference.attention(**d, **kwargs))
    )({n: reference.f64(a) for n, a in diff.items()})
    for name in diff:
      reference.assert_close(
          grads[name], ref_grads[name], reference.TOLERANCE[jnp.dtype(dtype)][1],
          name,
      )

  def test_forward_mode(self):
    """jax.jvp and a jvp of a grad (forward over reverse, as in jax.hessian)
    against the f64 reference, with a bias, a mask and GQA. Implementations
    whose forward JAX can differentiate run it; the others (custom VJPs over
    kernels) refuse by name, and None falls back to one that can."""
    dtype = F32 if F32 in self.dtypes else self.dtypes[0]
    c = Case(batch=(2,), t=24, s=40, n=4, kh=2, bias=(2, 4, 24, 40),
             mask=(2, 1, 24, 40), kwargs=(("is_causal", True),))
    args, kwargs, key = make_inputs(c, dtype, self.seed + 7)
    diff, rest = _split(args)
    keys = jax.random.split(key, len(diff))
    tangents = {n: jax.random.normal(k, a.shape, F32).astype(a.dtype)
                for (n, a), k in zip(sorted(diff.items()), keys)}

    def run(attention, d, t):
      f = lambda e: attention(**e, **rest, **kwargs)
      _, t_out = jax.jvp(f, (d,), (t,))
      grad = jax.grad(lambda e: jnp.sum(jnp.sin(f(e).astype(d["query"].dtype))))
      _, hvp = jax.jvp(grad, (d,), (t,))
      return t_out, hvp

    t_ref, hvp_ref = run(reference.attention, jax.tree.map(reference.f64, diff),
                         jax.tree.map(reference.f64, tangents))
    candidates = reference.forward_mode_candidates(
        self.attention,
        functools.partial(tokamax.dot_product_attention, implementation=None),
        self.jvp_supported, self.implementation,
        lambda: self.attention(**args, **kwargs),
        lambda attention: run(attention, diff, tangents))
    _, grad_tol = reference.TOLERANCE[jnp.dtype(dtype)]
    for attention in candidates:
      # The fallback is XLA's einsums: f32 at its default precision is TF32
      # on a GPU (relative error ~4e-4 on the H200), so ask for f32 here.
      with jax.default_matmul_precision("highest"):
        t_out, hvp = run(attention, diff, tangents)
      reference.assert_close(t_out, t_ref, grad_tol, "output tangent")
      for name in diff:
        reference.assert_close(hvp[name], hvp_ref[name], 2 * grad_tol, f"hvp {name}")

  def test_bias_without_its_gradient(self):
    """Gradients of q, k, v under a bias that is not differentiated: right,
    and the kernels with a dbias output ("triton", "mosaic") skip it."""
    # bias [1, N, T, S]: a dbias buffer is [B, N, T, S] (f32, summed over B).
    args, _, ct_key = make_inputs(Case(bias=(1, 2, 40, 40)), self.dtypes[0], self.seed + 4)
    bias = args.pop("bias")
    ct = jax.random.normal(ct_key, args["query"].shape[:-1] + (args["value"].shape[-1],))
    loss = lambda d, bias: jnp.sum(self.attention(**d, bias=bias).astype(F32) * ct)
    grads = jax.jit(jax.grad(loss))(args, bias)
    ref_grads = jax.grad(lambda d: jnp.sum(reference.attention(**d, bias=bias) * ct))(
        {n: reference.f64(a) for n, a in args.items()})
    tol = reference.TOLERANCE[jnp.dtype(self.dtypes[0])][1]
    for name in args:
      reference.assert_close(grads[name], ref_grads[name], tol, f"d{name}")
    if self.implementation in ("triton", "mosaic"):
      dbias = re.compile(r"f32\[2,2,\d+,\d+\]")  # [B, N, T, S] f32 buffers
      assert not dbias.search(str(jax.make_jaxpr(jax.grad(loss))(args, bias)))
      assert dbias.search(str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(args, bias)))

  def test_row_max_jumping_along_keys(self):
    """Keys scaled up then down along S: a row's running max grows by more
    than 2^8 between key blocks for some rows and not for others (the lazy
    rescaling's two branches), then never again."""
    dtype = self.dtypes[0]
    kq, kk, kv, kc = jax.random.split(jax.random.key(self.seed + 5), 4)
    b, t, s, n, h = 1, 96, 520, 2, 128
    ramp = 1.0 + 5.0 * jnp.minimum(jnp.arange(s), s - jnp.arange(s)) / (s / 2)
    args = dict(
        query=jax.random.normal(kq, (b, t, n, h), F32).astype(dtype),
        key=(jax.random.normal(kk, (b, s, n, h), F32) * ramp[:, None, None]).astype(dtype),
        value=jax.random.normal(kv, (b, s, n, h), F32).astype(dtype),
    )
    fwd_tol, grad_tol = reference.TOLERANCE[jnp.dtype(dtype)]
    out = jax.jit(self.attention)(**args)
    reference.assert_close(out, reference.attention(**args), fwd_tol, "forward")
    ct = jax.random.normal(kc, out.shape, F32)
    grads = jax.jit(jax.grad(
        lambda d: jnp.sum(self.attention(**d).astype(F32) * ct)))(args)
    ref_grads = jax.grad(lambda d: jnp.sum(reference.attention(**d) * ct))(
        {k: reference.f64(a) for k, a in args.items()})
    for name in args:
      reference.assert_close(grads[name], ref_grads[name], grad_tol, f"d{name}")

  fresh_feature = "combined"  # the widest feature set the implementation runs

  def test_fresh_inputs_each_seed(self):
    # The same function on other random inputs (guards against lucky data).
    f = self.fresh_feature
    for seed in (11, 12):
      self.check(FEATURES[f], self.dtypes[0], f, seed=seed)

  @pytest.mark.gpu
  @pytest.mark.parametrize("causal", [False, True])
  def test_real_size(self, causal):
    c = Case(batch=(2,), t=2048, s=2048, n=4, kh=4, h=64,
             kwargs=(("is_causal", causal),))
    self.check(c, self.dtypes[0] if self.dtypes[0] != F32 else BF16)

  # --- errors: raised before any kernel, for every implementation name ---

  @pytest.mark.parametrize(
      "change, error, match",
      [
          (dict(query=np.ones((4, 2, 8), np.int32)), TypeError, "floating"),
          (dict(query=jnp.ones((4, 8))), ValueError, "rank"),
          (dict(key=jnp.ones((2, 9, 2, 8))), ValueError, "batch dims"),
          (dict(key=jnp.ones((3, 9, 2, 16))), ValueError, "head dims"),
          (dict(value=jnp.ones((3, 7, 2, 8))), ValueError, "sequence length"),
          (dict(key=jnp.ones((3, 9, 3, 8)), value=jnp.ones((3, 9, 3, 8))),
           ValueError, "multiple"),
          (dict(value=jnp.ones((3, 9, 2, 8), jnp.float16)), TypeError, "share"),
          (dict(bias=jnp.ones((3, 4, 5, 7))), ValueError, "broadcastable"),
          (dict(bias=jnp.ones((1, 3, 4, 5, 9))), ValueError, "rank"),
          (dict(bias=jnp.ones((5, 9), jnp.int32)), TypeError, "floating"),
          (dict(mask=jnp.ones((5, 9), jnp.float32)), TypeError, "bool"),
          (dict(mask=jnp.ones((5, 8), bool)), ValueError, "broadcastable"),
          (dict(query_seq_lengths=jnp.ones((4,), jnp.int32)), ValueError,
           "batch shape"),
          (dict(key_value_seq_lengths=jnp.ones((3,))), TypeError, "integer"),
          (dict(local_window_size=-1), ValueError, "non-negative"),
          (dict(local_window_size=(2, -3)), ValueError, "non-negative"),
          (dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size"),
          (dict(logits_soft_cap=0.0), ValueError, "positive"),
          (dict(scale="x"), TypeError, "scale"),
          (dict(is_causal=1), TypeError, "is_causal"),
          (dict(query=[1.0]), TypeError, "array"),
      ],
  )
  def test_bad_input(self, change, error, match):
    args = dict(
        query=jnp.ones((3, 5, 4, 8)), key=jnp.ones((3, 9, 2, 8)),
        value=jnp.ones((3, 9, 2, 8)),
    )
    args.update(change)
    with pytest.raises(error, match=match):
      self.attention(**args)


class TestXla(AttentionTestBase):
  implementation = "xla"
  dtypes = (F32, BF16, F16, F64)
  jvp_supported = True

  @hypothesis.settings(max_examples=8, deadline=None)
  @hypothesis.given(
      b=st.integers(1, 2), t=st.integers(1, 33), s=st.integers(1, 33),
      kh=st.integers(1, 2), g=st.integers(1, 3), h=st.sampled_from([8, 16, 24]),
      causal=st.booleans(),
  )
  def test_hypothesis_shapes(self, b, t, s, kh, g, h, causal):
    c = Case(batch=(b,), t=t, s=s, n=kh * g, kh=kh, h=h,
             kwargs=(("is_causal", causal),))
    self.check(c, F32)


class TestXlaChunked(AttentionTestBase):
  implementation = "xla_chunked"
  dtypes = (F32, BF16, F16, F64)
  jvp_supported = True


class TestXlaChunkedSmallChunks(AttentionTestBase):
  """Many chunks, sizes that do not divide T or S (padding paths)."""

  implementation = "xla_chunked"
  op = xla_chunked.ChunkedDotProductAttention(
      config=xla_chunked.ChunkedAttentionConfig(q_chunk_size=16, kv_chunk_size=24)
  )
  dtypes = (F32, BF16, F16, F64)
  jvp_supported = True

  @hypothesis.settings(max_examples=8, deadline=None)
  @hypothesis.given(
      t=st.integers(1, 40), s=st.integers(1, 40), tq=st.integers(1, 20),
      sk=st.integers(1, 20), kh=st.integers(1, 2), g=st.integers(1, 2),
      causal=st.booleans(), window=st.sampled_from([None, 3, (0, 5), (4, 0)]),
      bias=st.booleans(),
  )
  def test_hypothesis_chunks(self, t, s, tq, sk, kh, g, causal, window, bias):
    kwargs = (("is_causal", causal), ("local_window_size", window))
    c = Case(batch=(2,), t=t, s=s, n=kh * g, kh=kh, h=8, kwargs=kwargs,
             bias=(1, kh * g, t, s) if bias else None)
    config = xla_chunked.ChunkedAttentionConfig(q_chunk_size=tq, kv_chunk_size=sk)
    self.op = xla_chunked.ChunkedDotProductAttention(config=config)
    self.check(c, F32)


@pytest.mark.gpu
class TestCudnn(AttentionTestBase):
  implementation = "cudnn"
  dtypes = (BF16, F16)
  unsupported = frozenset({
      "soft_cap", "t_ne_s_causal", "value_head_dim", "window", "window_left_right",
      "window_rows_past_keys",
      "combined", "combined_no_batch", "combined_positional", "bias_broadcast",
  })
  unsupported_grad = frozenset({"odd_sizes"})  # cuDNN trains only even T, S


# --- "triton": interpret mode on CPU, lowering for CUDA, real GPU ---------

from tokamax._src import pallas_triton  # noqa: E402
from tokamax.ops.attention import triton as triton_attn  # noqa: E402

TRITON_TARGET = "__gpu$xla.gpu.triton"
ON_GPU = jax.default_backend() == "gpu"


def _triton_op(fwd: dict, bwd: dict | None = None):
  """A "triton" op with pinned forward and VJP configs."""
  return triton_attn.TritonDotProductAttention(
      config=triton_attn.TritonAttentionConfig(**fwd),
      vjp=triton_attn.TritonDotProductAttentionVjp(
          config=triton_attn.TritonAttentionVjpConfig(**(bwd or {}))),
  )


class _InterpretMixin:
  # Class scope: hypothesis refuses function-scoped fixtures. In interpret
  # mode Pallas fills outputs with NaN before the kernel runs, so an element
  # a kernel leaves unwritten fails the finiteness check of every comparison.
  @pytest.fixture(autouse=True, scope="class")
  @classmethod
  def _interpret(cls):
    with pallas_triton.interpret_mode():
      yield


class TestTritonInterpret(_InterpretMixin, AttentionTestBase):
  """The whole base with the Triton kernels in interpret mode (CPU).

  At these sizes every call is a single block (blocks are clipped to the
  padded lengths); TestTritonInterpretSmallBlocks covers many blocks.
  """

  implementation = "triton"
  dtypes = (F32, BF16, F16)

  def test_head_dim_too_large_refused(self):
    q = jax.ShapeDtypeStruct((1, 16, 1, 264), BF16)
    with pytest.raises(NotImplementedError, match="triton.*head dims up to 256"):
      jax.eval_shape(self.attention, q, q, q)


class TestTritonInterpretSmallBlocks(_InterpretMixin, AttentionTestBase):
  """16x16 blocks: block skipping, full/masked loops, padding of T and S."""

  implementation = "triton"
  op = _triton_op(
      dict(block_q=16, block_k=16, num_warps=4, num_stages=2),
      dict(block_k=16, block_q=16, dq_block_q=16, dq_block_k=16),
  )
  dtypes = (F32, BF16, F16)

  @pytest.mark.parametrize("feature", sorted(FEATURES))
  def test_feature(self, feature):  # f32 only: the block logic is dtype-free
    self.check(FEATURES[feature], F32, feature)

  @pytest.mark.parametrize("feature", ["causal", "window_left_right", "combined",
                                       "t_ne_s_causal"])
  @pytest.mark.parametrize("band", [1, 2])
  def test_heavy_first_bands(self, monkeypatch, feature, band):
    """Causal/right-window grids in rank bands (HEAVY_FIRST_BAND): 3-4
    blocks per (batch, head), so a band of 2 leaves a narrower last band;
    every kernel (query-block and key-block grids). Four SMs, so that bands
    apply to these few heads."""
    monkeypatch.setattr(triton_attn, "HEAVY_FIRST_BAND", band)
    monkeypatch.setattr(triton_attn, "SMS", 4)
    c = dataclasses.replace(FEATURES[feature], n=4, kh=2)
    self.check(c, F32, feature)

  @pytest.mark.parametrize("feature", sorted(FEATURES))
  def test_forward_row_parts(self, monkeypatch, feature):
    """The forward with its query rows in two halves (config.row_parts = 2;
    halves of 16 rows here, 64 on the GPU): each half's own running max,
    sum and accumulator, masks and bias rows, every feature vs f64."""
    monkeypatch.setattr(triton_attn, "_MIN_PART_ROWS", 16)
    self.op = _triton_op(dict(block_q=32, block_k=16, row_parts=2),
                         dict(block_k=16, block_q=16,
                                                           dq_block_q=16, dq_block_k=16))
    self.check(FEATURES[feature], F32, feature)

  @hypothesis.settings(max_examples=10, deadline=None)
  @hypothesis.given(
      t=st.integers(1, 70), s=st.integers(1, 70), bq=st.sampled_from([16, 32]),
      bk=st.sampled_from([16, 32]), kh=st.integers(1, 2), g=st.integers(1, 2),
      causal=st.booleans(),
      window=st.sampled_from([None, 3, (0, 5), (4, 0), (20, None), (None, 9)]),
      bias=st.booleans(), lens=st.booleans(), h=st.sampled_from([16, 40]),
  )
  def test_hypothesis_blocks(self, t, s, bq, bk, kh, g, causal, window, bias,
                             lens, h):
    kwargs = (("is_causal", causal), ("local_window_size", window))
    c = Case(batch=(2,), t=t, s=s, n=kh * g, kh=kh, h=h, kwargs=kwargs,
             bias=(1, kh * g, t, s) if bias else None, q_lens=lens, kv_lens=lens)
    self.op = _triton_op(
        dict(block_q=bq, block_k=bk),
        dict(block_k=bk, block_q=bq, dq_block_q=bq, dq_block_k=bk),
    )
    self.check(c, F32)


def _lower_text(fn, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# (B, T, S, N, K, H, Hv, dtype, features)
LOWER_CASES = {
    "seed_B32_T2048_N16_H64": ((32, 2048, 2048, 16, 16, 64, 64), BF16, {}),
    "B8_T4096_N16_H128_causal": ((8, 4096, 4096, 16, 16, 128, 128), BF16,
                                 dict(is_causal=True)),
    "gqa_H128_causal": ((1, 4096, 4096, 32, 8, 128, 128), BF16, dict(is_causal=True)),
    "H256_f16": ((2, 512, 512, 4, 4, 256, 256), F16, {}),
    "H80_Hv48_f32_window": ((2, 300, 200, 4, 2, 80, 48), F32,
                            dict(local_window_size=(64, 8))),
    "H32_all_features": ((2, 256, 384, 4, 2, 32, 32), BF16, "all"),
}


@pytest.mark.parametrize("name", sorted(LOWER_CASES))
def test_triton_lowers_for_cuda(name):
  """Forward and gradient lower for an H200 on CPU (power-of-2 blocks etc.)."""
  (b, t, s, n, kh, h, hv), dtype, kw = LOWER_CASES[name]
  spec = jax.ShapeDtypeStruct
  arrays = dict(query=spec((b, t, n, h), dtype), key=spec((b, s, kh, h), dtype),
                value=spec((b, s, kh, hv), dtype))
  if kw == "all":
    arrays.update(bias=spec((b, n, t, s), dtype), mask=spec((1, 1, t, s), jnp.bool_),
                  query_seq_lengths=spec((b,), jnp.int32),
                  key_value_seq_lengths=spec((b,), jnp.int32))
    kw = dict(is_causal=True, local_window_size=(100, None), logits_soft_cap=20.0)
  diff = [k for k in ("query", "key", "value", "bias") if k in arrays]

  def f(**a):
    return tokamax.dot_product_attention(**a, **kw, implementation="triton")

  def loss(d, rest):
    return jnp.sum(f(**d, **rest).astype(F32))

  rest = {k: v for k, v in arrays.items() if k not in diff}
  d = {k: arrays[k] for k in diff}
  with tokamax.config.cross_compile("NVIDIA H200"):
    fwd_text = _lower_text(lambda a: f(**a), arrays)
    grad_text = _lower_text(jax.grad(loss), d, rest)
  assert fwd_text.count(TRITON_TARGET) == 1
  assert grad_text.count(TRITON_TARGET) == 3  # forward, dk/dv, dq
  # The softmax exponentials are one FFMA + ex2.approx.ftz (exp2_fma), not
  # jnp.exp2's non-ftz lowering, in every kernel.
  assert "ex2.approx.ftz.f32" in fwd_text
  assert grad_text.count("ex2.approx.ftz.f32") >= 3


@pytest.mark.parametrize("causal", [False, True])
def test_triton_forward_row_parts_lowering(causal):
  """The heuristic's row halves at head dim 128 (128-row blocks: two halves
  of 64) lower for an H200: one kernel, two q.k^T and two P.V dots in each
  loop body; 64-row blocks (head dim 64) keep one part, and so does
  row_parts = 2 with a block clipped below 128 rows."""
  assert triton_attn.heuristic_config(1024, 1024, 128, 2).row_parts == 2
  assert triton_attn.heuristic_config(100, 1024, 128, 2).row_parts == 2  # 128-row block
  assert triton_attn.heuristic_config(64, 1024, 128, 2).row_parts == 1
  assert triton_attn.heuristic_config(1024, 1024, 128, 4).row_parts == 1  # f32: 64 rows
  assert triton_attn.heuristic_config(1024, 1024, 64, 2).row_parts == 1
  q = jax.ShapeDtypeStruct((2, 1024, 4, 128), BF16)
  f = lambda q: tokamax.dot_product_attention(q, q, q, is_causal=causal,
                                              implementation="triton")
  with tokamax.config.cross_compile("NVIDIA H200"):
    text = _lower_text(f, q)
    assert text.count(TRITON_TARGET) == 1
    jaxpr = str(jax.make_jaxpr(f)(q))
    # _run_blocks' three loops (masked, full, masked), each with 2 + 2 dots.
    assert jaxpr.count("dot_general") == 3 * 4
    q64 = jax.ShapeDtypeStruct((2, 1024, 4, 64), BF16)
    jaxpr64 = str(jax.make_jaxpr(f)(q64))
    assert jaxpr64.count("dot_general") == 3 * 2
    short = jax.ShapeDtypeStruct((2, 64, 4, 128), BF16)
    op = _triton_op(dict(block_q=128, block_k=64, row_parts=2), {})
    jaxpr_short = str(jax.make_jaxpr(lambda q: op(q, q, q, is_causal=causal))(short))
    assert jaxpr_short.count("dot_general") == 3 * 2
  space = triton_attn.search_space(4096, 4096, 128, 2)
  assert {c.row_parts for c in space if c.block_q == 128} == {1, 2}
  assert {c.row_parts for c in space if c.block_q == 64} == {1}
  with pytest.raises(pydantic.ValidationError):
    triton_attn.TritonAttentionConfig(row_parts=3)


def test_triton_cross_compile_dispatch():
  """Under an H200 target the default order reaches "triton" or falls back."""
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), BF16)
  with tokamax.config.cross_compile("NVIDIA H200"):
    text = _lower_text(lambda q: tokamax.dot_product_attention(
        q, q, q, implementation=["triton", "xla"]), q)
    assert TRITON_TARGET in text
    q64 = jax.ShapeDtypeStruct((2, 256, 4, 64), F64)
    with pytest.raises(NotImplementedError, match="triton.*fp64"):
      _lower_text(lambda q: tokamax.dot_product_attention(
          q, q, q, implementation="triton"), q64)
  with tokamax.config.cross_compile("NVIDIA V100"):
    with pytest.raises(NotImplementedError, match="triton.*requires an NVIDIA GPU"):
      _lower_text(lambda q: tokamax.dot_product_attention(
          q, q, q, implementation="triton"), q)


@pytest.mark.skipif(ON_GPU, reason="CPU platform check")
def test_triton_refuses_on_cpu_without_interpret():
  q = jnp.ones((1, 8, 2, 16), F32)
  with pytest.raises(NotImplementedError, match="triton.*requires an NVIDIA GPU"):
    tokamax.dot_product_attention(q, q, q, implementation="triton")


@pytest.mark.parametrize("bad", [
    dict(block_q=48), dict(block_k=8), dict(num_warps=3), dict(num_warps=32),
    dict(num_stages=0),
])
def test_triton_config_validation(bad):
  with pytest.raises(ValueError):
    triton_attn.TritonAttentionConfig(**bad)


def test_triton_heuristics_and_search_space_are_valid():
  for t, s, h, size in [(2048, 2048, 64, 2), (4096, 4096, 128, 2), (40, 70, 256, 2),
                        (7, 9, 80, 4)]:
    c = triton_attn.heuristic_config(t, s, h, size)
    assert c.block_q <= max(16, pallas_triton.next_pow2(t))
    space = triton_attn.search_space(t, s, h, size)
    assert space and all(isinstance(x, triton_attn.TritonAttentionConfig) for x in space)
    assert c in space, c  # the measured fastest configs are among those tuned
    assert triton_attn.vjp_search_space(t, s, h, size)
    triton_attn.vjp_heuristic_config(t, s, h, size)


@pytest.mark.gpu
class TestTritonGpu(AttentionTestBase):
  """The whole base with the compiled Triton kernels on an NVIDIA GPU."""

  implementation = "triton"
  dtypes = (F32, BF16, F16)

  @pytest.mark.parametrize("dtype", [F32, F16], ids=lambda d: jnp.dtype(d).name)
  @pytest.mark.parametrize("h", [32, 96, 128, 192, 256])
  def test_head_dims_and_dtypes(self, h, dtype):
    """Every heuristic branch (f32 tiles are smaller) compiles and is right."""
    self.check(Case(batch=(2,), t=300, s=260, n=4, kh=2, h=h,
                    kwargs=(("is_causal", True),)), dtype)

  @pytest.mark.parametrize("causal", [False, True])
  @pytest.mark.parametrize("shape", [(1, 4096, 16, 16, 128), (1, 1024, 32, 8, 128),
                                     (1, 1000, 4, 4, 256), (2, 777, 4, 2, 80)])
  def test_real_size_shapes(self, shape, causal):
    b, t, n, kh, h = shape
    self.check(Case(batch=(b,), t=t, s=t, n=n, kh=kh, h=h,
                    kwargs=(("is_causal", causal),)), BF16)


@pytest.mark.gpu
class TestTritonGpuSmallBlocks(AttentionTestBase):
  """Many blocks on the GPU: block skipping with every feature."""

  implementation = "triton"
  op = _triton_op(dict(block_q=16, block_k=16),
                  dict(block_k=16, block_q=16, dq_block_q=16, dq_block_k=16))
  dtypes = (F32, BF16, F16)


# --- "mosaic": GPU interpreter on CPU, lowering for CUDA, real GPU -----------

from tokamax._src import pallas_mosaic  # noqa: E402
from tokamax.ops.attention import mosaic as mosaic_attn  # noqa: E402

MOSAIC_TARGET = "mosaic_gpu_v2"


def _mosaic_op(vjp: dict | None = None, **config):
  """The "mosaic" op with forward `config` and, if given, a VJP config."""
  kwargs = {} if vjp is None else dict(vjp=mosaic_attn.MosaicDotProductAttentionVjp(
      config=mosaic_attn.MosaicAttentionVjpConfig(**vjp)))
  return mosaic_attn.MosaicDotProductAttention(
      config=mosaic_attn.MosaicAttentionConfig(**config), **kwargs)


class _MosaicInterpretMixin:
  # The forward and backward kernels in the Mosaic GPU interpreter
  # (uninitialised shared and output memory reads as NaN).
  @pytest.fixture(autouse=True, scope="class")
  @classmethod
  def _interpret(cls):
    with pallas_mosaic.interpret_mode():
      yield


class TestMosaicInterpret(_MosaicInterpretMixin, AttentionTestBase):
  """The whole base with the Mosaic forward in the GPU interpreter (CPU)."""

  implementation = "mosaic"
  dtypes = (BF16, F16)

  def test_head_dim_too_large_refused(self):
    q = jax.ShapeDtypeStruct((1, 16, 1, 264), BF16)
    with pytest.raises(NotImplementedError, match="mosaic.*head dims up to 256"):
      jax.eval_shape(self.attention, q, q, q)

  def test_head_dim_256_two_dkdv_passes(self):
    """Head dims 256 run the dk/dv kernel twice (dk, then dv)."""
    assert len(mosaic_attn.dkdv_passes(mosaic_attn.vjp_heuristic_config(
        70, 90, 256, 256, 2), 256, 256)) == 2
    self.check(Case(batch=(1,), t=70, s=90, n=2, kh=1, h=256,
                    kwargs=(("is_causal", True), ("logits_soft_cap", 10.0))), BF16)


class TestMosaicInterpretManyBlocks(_MosaicInterpretMixin, AttentionTestBase):
  """64-row tiles, 64-key steps: block skipping, the consumers' skip steps,
  the ring wrapping around, rows/keys past the ends, short sequences."""

  implementation = "mosaic"
  op = _mosaic_op(block_q=64, block_kv=64, num_stages=2)
  dtypes = (BF16,)

  @pytest.mark.parametrize("feature", ["causal", "window_left_right", "kv_lens",
                                       "combined_positional", "t_ne_s_causal",
                                       "combined", "bias_broadcast"])
  def test_feature(self, feature):
    c = dataclasses.replace(FEATURES[feature], t=300, s=260)
    if feature == "bias_broadcast":  # [1, N, 1, S]: one row for every query
      c = dataclasses.replace(c, bias=(1, c.n, 1, c.s))
    self.check(c, BF16, feature)

  @pytest.mark.parametrize("feature", ["causal", "window_left_right",
                                       "t_ne_s_causal", "combined"])
  def test_three_consumers(self, feature):
    """Three consumer WGs passing a token round (192-row CTAs): skip steps of
    some consumers, the ring wrapping, rows and keys past the ends."""
    self.op = _mosaic_op(block_q=64, block_kv=64, num_stages=2, consumers=3)
    self.check(dataclasses.replace(FEATURES[feature], t=300, s=260), BF16, feature)

  @pytest.mark.parametrize("feature, consumers", [
      ("causal", 2), ("causal", 3), ("kv_lens", 2), ("t_ne_s_causal", 3)])
  @pytest.mark.parametrize("half", [True, False])
  def test_half_last_block(self, monkeypatch, feature, consumers, half):
    """128-key steps: a consumer's last block seen only in its first half
    (every other 64-row consumer on the causal diagonal, key lengths just
    past a block edge) runs as a 64-key step (HALF_LAST_BLOCK), or in full."""
    monkeypatch.setattr(mosaic_attn, "HALF_LAST_BLOCK", half)
    self.op = _mosaic_op(block_q=64, block_kv=128, num_stages=2, consumers=consumers,
                         vjp=dict(dq_block_kv=128, dq_consumers=2))
    t, s = (320, 330) if feature != "t_ne_s_causal" else (200, 330)
    self.check(dataclasses.replace(FEATURES[feature], t=t, s=s), BF16, feature)

  @pytest.mark.parametrize("feature", ["causal", "combined_positional", "combined"])
  @pytest.mark.parametrize("band", [1, 2])
  def test_heavy_first_bands(self, monkeypatch, feature, band):
    """Causal grids in rank bands (HEAVY_FIRST_BAND): 3 query CTAs and 3 key
    CTAs per (batch, head), so a band of 2 leaves a narrower last band;
    two batch entries and kv heads, every kernel. Four SMs, so that bands
    apply to these few heads."""
    monkeypatch.setattr(mosaic_attn, "HEAVY_FIRST_BAND", band)
    monkeypatch.setattr(triton_attn, "SMS", 4)
    c = dataclasses.replace(FEATURES[feature], t=300, s=260, n=4, kh=2)
    self.check(c, BF16, feature)

  @pytest.mark.parametrize("feature, consumers, bk, ctas", [
      ("causal", 2, 64, 2), ("causal", 3, 128, 3), ("combined", 2, 64, 3),
      ("t_ne_s_causal", 2, 128, 2), ("window_left_right", 3, 64, 2),
      ("q_lens", 2, 64, 5), ("plain", 3, 64, 4), ("bias_full", 2, 64, 2)])
  def test_persistent(self, monkeypatch, feature, consumers, bk, ctas):
    """The persistent forward, dq and dk/dv kernels (config.persistent,
    dq_persistent, dkdv_persistent) on `ctas` CTAs looping over 8-24 query
    tiles and 8-12 key tiles: the ring running on across tiles (2 slots,
    tiles of 0 to 5 blocks), the next rows (K/V) prefetched, stores of one
    tile in flight under the next, tiles with no visible key (query), the
    boustrophedon rounds (a last round of 0 to 3 tiles); with heavy-first
    bands of 2 (four SMs)."""
    monkeypatch.setattr(mosaic_attn, "PERSISTENT_CTAS", ctas)
    monkeypatch.setattr(mosaic_attn, "HEAVY_FIRST_BAND", 2)
    monkeypatch.setattr(triton_attn, "SMS", 4)
    self.op = _mosaic_op(block_q=64, block_kv=bk, num_stages=2,
                         consumers=consumers, persistent=True,
                         vjp=dict(dq_block_kv=bk, dq_consumers=consumers,
                                  dq_persistent=True, dkdv_persistent=True))
    c = FEATURES[feature]
    self.check(dataclasses.replace(c, t=300, s=260 if c.bias is None else 300),
               BF16, feature)

  @pytest.mark.parametrize("feature, ctas", [
      ("causal", 3), ("combined", 2), ("q_lens", 5), ("plain", 4)])
  def test_persistent_dkdv_prefetch_at_tile_start(self, monkeypatch, feature, ctas):
    """The persistent dk/dv kernel loading the next key tile's K/V as a tile
    starts (DKDV_PREFETCH_AT_TILE_START), its previous stores still reading
    the other buffer."""
    monkeypatch.setattr(mosaic_attn, "DKDV_PREFETCH_AT_TILE_START", True)
    monkeypatch.setattr(mosaic_attn, "PERSISTENT_CTAS", ctas)
    self.op = _mosaic_op(block_q=64, block_kv=64, num_stages=2,
                         vjp=dict(dkdv_persistent=True))
    self.check(dataclasses.replace(FEATURES[feature], t=300, s=260), BF16, feature)

  @pytest.mark.parametrize("orders", [(), ("dkdv", "dq")])
  @pytest.mark.parametrize("feature, persistent", [
      ("causal", False), ("combined", True), ("soft_cap", False),
      ("window_left_right", False), ("bias_full", True)])
  def test_exp_under_dp(self, monkeypatch, feature, persistent, orders):
    """Both backward kernels computing p while dp = do v^T runs, and neither
    (EXP_UNDER_DP; the default is the dk/dv kernel only): skip, masked and
    half steps, bias, cap, persistent tiles (the dq kernel's next rows
    loaded after dp)."""
    monkeypatch.setattr(mosaic_attn, "EXP_UNDER_DP", orders)
    monkeypatch.setattr(mosaic_attn, "PERSISTENT_CTAS", 3)
    self.op = _mosaic_op(block_q=64, block_kv=64, num_stages=2,
                         vjp=dict(dkdv_persistent=persistent, dq_persistent=persistent,
                                  dq_block_kv=128 if persistent else 64))
    c = FEATURES[feature]
    self.check(dataclasses.replace(c, t=300, s=260 if c.bias is None else 300),
               BF16, feature)

  @pytest.mark.parametrize("kernels", [(), ("fwd", "dq")], ids=["none", "fwd_dq"])
  @pytest.mark.parametrize("feature, consumers, persistent", [
      ("causal", 3, False), ("causal", 2, True), ("t_ne_s_causal", 3, True),
      ("window_left_right", 3, False), ("combined_positional", 3, True)])
  def test_shift_causal_tiles(self, monkeypatch, kernels, feature, consumers,
                              persistent):
    """Causal/right-window query tiles starting before row 0
    (SHIFT_CAUSAL_TILES; default: the forward only) in the forward and dq
    kernels, and neither: WGs of rows < 0 loading and storing nothing,
    one or two of them in a tile (t = 300, 1000 at 3 consumers), query
    lengths, persistent tiles (3 CTAs)."""
    monkeypatch.setattr(mosaic_attn, "SHIFT_CAUSAL_TILES", kernels)
    monkeypatch.setattr(mosaic_attn, "PERSISTENT_CTAS", 3)
    self.op = _mosaic_op(block_q=64, block_kv=128, num_stages=2, consumers=consumers,
                         persistent=persistent,
                         vjp=dict(dq_block_kv=64, dq_consumers=consumers,
                                  dq_persistent=persistent))
    c = FEATURES[feature]
    t = 1000 if feature == "causal" and consumers == 3 else 300
    self.check(dataclasses.replace(c, t=t, s=t if c.s == c.t else 260), BF16, feature)

  @pytest.mark.parametrize("feature, consumers, bk, persistent", [
      ("causal", 3, 128, False), ("causal", 2, 64, True),
      ("t_ne_s_causal", 3, 128, True), ("window_left_right", 2, 128, False),
      ("combined_positional", 3, 64, True), ("q_lens", 2, 64, False)])
  def test_reverse_causal_keys(self, monkeypatch, feature, consumers, bk, persistent):
    """The forward streaming each tile's key blocks last block first
    (REVERSE_CAUSAL_KEYS) under causal masks and windows: skip, masked and
    half steps in reverse, the ring slots in stream order across persistent
    tiles (3 CTAs), shifted tiles; non-causal calls keep the plain order."""
    monkeypatch.setattr(mosaic_attn, "REVERSE_CAUSAL_KEYS", (2, 3))
    monkeypatch.setattr(mosaic_attn, "REVERSE_WITH_RESIDUALS", True)
    monkeypatch.setattr(mosaic_attn, "PERSISTENT_CTAS", 3)
    self.op = _mosaic_op(block_q=64, block_kv=bk, num_stages=2, consumers=consumers,
                         persistent=persistent)
    c = FEATURES[feature]
    t = 1000 if feature == "causal" and consumers == 3 else 300
    self.check(dataclasses.replace(c, t=t, s=t if c.s == c.t else 260), BF16, feature)

  @pytest.mark.parametrize("dq_delta", [True, False])
  @pytest.mark.parametrize("feature, consumers, persistent, shift", [
      ("causal", 3, True, True), ("q_lens", 2, True, False),
      ("combined", 2, False, False), ("t_ne_s_causal", 3, False, True),
      ("gqa", 2, True, False)])
  def test_dq_delta(self, monkeypatch, dq_delta, feature, consumers, persistent,
                    shift):
    """D = rowsum(dO * O) computed by the dq kernel and passed to the dk/dv
    kernel (DQ_DELTA, default), and by XLA: persistent tiles (3 CTAs, D's
    store of one tile in flight under the next), WGs of rows < 0 (shifted
    dq tiles) storing no D, rows past the query length, bias and mask."""
    monkeypatch.setattr(mosaic_attn, "DQ_DELTA", dq_delta)
    monkeypatch.setattr(mosaic_attn, "SHIFT_CAUSAL_TILES", ("fwd", "dq") if shift else ())
    monkeypatch.setattr(mosaic_attn, "PERSISTENT_CTAS", 3)
    self.op = _mosaic_op(block_q=64, block_kv=64, num_stages=2,
                         vjp=dict(dq_consumers=consumers, dq_persistent=persistent))
    c = FEATURES[feature]
    self.check(dataclasses.replace(c, t=300, s=300 if c.s == c.t else 260), BF16,
               feature)

  @pytest.mark.parametrize("feature", ["causal", "kv_lens", "combined"])
  def test_192_key_steps(self, feature):
    """192-key forward steps (three 64-key wgmma contractions; no half step):
    skip steps, key lengths inside a step, rows and keys past the ends."""
    self.op = _mosaic_op(block_q=64, block_kv=192, num_stages=2)
    self.check(dataclasses.replace(FEATURES[feature], t=300, s=400), BF16, feature)

  @pytest.mark.parametrize("feature, dq_bk", [
      ("causal", 64), ("causal", 128), ("window_left_right", 64),
      ("t_ne_s_causal", 128), ("combined", 64), ("kv_lens", 64)])
  def test_dq_three_consumers(self, feature, dq_bk):
    """The dq kernel with three consumer WGs (192-row CTAs, a ragged last
    CTA): skip steps, half steps (128-key steps), dbias, rows past the ends."""
    self.op = _mosaic_op(block_q=64, block_kv=64, num_stages=2,
                         vjp=dict(dq_consumers=3, dq_block_kv=dq_bk))
    self.check(dataclasses.replace(FEATURES[feature], t=300, s=260), BF16, feature)

  @hypothesis.settings(max_examples=6, deadline=None)
  @hypothesis.given(
      t=st.integers(1, 300), s=st.integers(1, 300), kh=st.integers(1, 2),
      g=st.integers(1, 2), causal=st.booleans(), stages=st.sampled_from([1, 2, 3]),
      window=st.sampled_from([None, 3, (0, 70), (90, 0), (None, 9)]),
      lens=st.booleans(), h=st.sampled_from([64, 40]),
  )
  def test_hypothesis_blocks(self, t, s, kh, g, causal, stages, window, lens, h):
    kwargs = (("is_causal", causal), ("local_window_size", window))
    c = Case(batch=(2,), t=t, s=s, n=kh * g, kh=kh, h=h, kwargs=kwargs,
             q_lens=lens, kv_lens=lens)
    self.op = _mosaic_op(block_q=64, block_kv=64, num_stages=stages)
    self.check(c, BF16)


MOSAIC_LOWER_CASES = {
    "seed_B32_T2048_N16_H64": ((32, 2048, 2048, 16, 16, 64, 64), {}),
    "seed_causal": ((32, 2048, 2048, 16, 16, 64, 64), dict(is_causal=True)),
    "B8_T4096_N16_H128": ((8, 4096, 4096, 16, 16, 128, 128), {}),
    "B8_T4096_N16_H128_causal": ((8, 4096, 4096, 16, 16, 128, 128),
                                 dict(is_causal=True)),
    "gqa_N32_K8_H128_causal": ((4, 4096, 4096, 32, 8, 128, 128), dict(is_causal=True)),
    "H256_window_cap": ((2, 1000, 1100, 4, 2, 256, 256),
                        dict(local_window_size=(100, 10), logits_soft_cap=20.0)),
    "H80_Hv48_lengths": ((2, 777, 301, 4, 2, 80, 48), "lengths"),
    # Bias [1, N, T, S] f32 and mask [B, 1, T, S]: tiles read from memory.
    "seed_bias_mask_causal": ((32, 2048, 2048, 16, 16, 64, 64), "bias_mask"),
    "H256_bias_mask": ((2, 1000, 1100, 4, 2, 256, 256), "bias_mask"),
}


@pytest.mark.parametrize("kernel, t, nc, causal, tiles, shift", [
    ("fwd", 2048, 3, True, False, 64), ("fwd", 1024, 3, True, False, 128),
    ("fwd", 1000, 3, True, False, 128), ("fwd", 300, 2, True, False, 64),
    ("fwd", 4096, 2, True, False, 0), ("fwd", 1500, 2, True, False, 0),
    ("fwd", 2048, 3, False, False, 0), ("fwd", 2048, 3, True, True, 0),
    ("dq", 2048, 3, True, False, 0)])
def test_mosaic_row_shift(kernel, t, nc, causal, tiles, shift):
  """The rows before row 0 where the first query tile starts: the last
  tile's rows past T in whole 64-row consumers, causal without bias/mask
  tiles, in the kernels of SHIFT_CAUSAL_TILES (the forward)."""
  x = jax.ShapeDtypeStruct((1, t, 2, 64), BF16)
  sp = triton_attn.Spec.of(dict(
      query=x, key=x, value=x, bias=None, mask=None, scale=0.125, precision=None,
      is_causal=causal, local_window_size=None, logits_soft_cap=None,
      query_seq_lengths=None, key_value_seq_lengths=None))
  tq = max(nc * 64, t)
  assert mosaic_attn._row_shift(kernel, sp, tq, 64, nc, tiles) == shift


@pytest.mark.parametrize("bsz, heads, blocks, band", [
    (2, 3, 7, 7), (2, 3, 7, 1), (2, 3, 7, 3), (1, 1, 5, 2), (3, 2, 4, 4)])
def test_mosaic_cta_order(bsz, heads, blocks, band):
  """The flat grid visits every (batch, head, rank) once, bands of ranks in
  order (all of band 0 before band 1), (batch, head) order inside a band."""
  total = bsz * heads * blocks
  b, n, r = jax.vmap(
      lambda p: triton_attn.grid_position(p, bsz, heads, blocks, band))(
          jnp.arange(total, dtype=jnp.int32))
  coords = list(zip(b.tolist(), n.tolist(), r.tolist()))
  assert sorted(coords) == [(i, j, k) for i in range(bsz) for j in range(heads)
                            for k in range(blocks)]
  bands = [k // band for _, _, k in coords]
  assert bands == sorted(bands)
  for i in range(total - 1):  # inside a band: (batch, head) then rank order
    if bands[i] == bands[i + 1]:
      assert coords[i] < coords[i + 1]


def test_mosaic_heavy_first_band_rule():
  """Bands only for causal/right-window grids of few CTAs per SM."""
  def spec(**kwargs):
    q = jnp.zeros((1, 8, 1, 64), BF16)
    return triton_attn.Spec.of(dict(
        query=q, key=q, value=q, bias=None, mask=None, query_seq_lengths=None,
        key_value_seq_lengths=None, is_causal=False, local_window_size=None,
        logits_soft_cap=None, scale=0.125, precision=None) | kwargs)
  band, per_head = mosaic_attn.HEAVY_FIRST_BAND, mosaic_attn.BAND_ONE_PER_HEAD
  waves, one_waves = mosaic_attn.HEAVY_FIRST_MAX_WAVES, mosaic_attn.BAND_ONE_MAX_WAVES
  rule = lambda sp, groups, blocks: triton_attn.heavy_first_band(
      sp, groups, blocks, band, waves, per_head, one_waves)
  few = mosaic_attn.HEAVY_FIRST_MAX_WAVES * triton_attn.sms() // 64
  assert rule(spec(is_causal=True), 64, few) == band
  assert rule(spec(is_causal=True), 65, few) == few  # many CTAs
  assert rule(spec(), 64, few) == few  # equal CTAs: no tail
  assert rule(spec(local_window_size=(4, 2)), 64, few) == band
  # Few heads: a wave holds >= min(band, per_head) CTAs of each in any
  # order (33 heads at bands of 8 or 4 with per_head 4, 66 at bands of 2,
  # 16 at bands of 8 with per_head 8).
  for b, ph, heads in ((band, per_head, 33), (4, 4, 33), (2, 4, 66), (8, 8, 16)):
    rule_b = lambda groups, blocks: triton_attn.heavy_first_band(
        spec(is_causal=True), groups, blocks, b, waves, ph, one_waves)
    assert rule_b(heads, 16) == 1
    assert rule_b(heads + 1, 16) == b
    assert rule_b(heads + 1, 3) == min(b, 3)
  # ... up to BAND_ONE_MAX_WAVES CTAs per SM (B1 T16384 N32: bands of 8).
  most = one_waves * triton_attn.sms() // 32
  assert rule(spec(is_causal=True), 32, most) == 1
  assert rule(spec(is_causal=True), 32, most + 1) == band
  assert rule(spec(is_causal=True), 32, 16384 // 128) == band
  assert rule(spec(is_causal=True), 24, 8192 // 128) == 1


@pytest.mark.parametrize("name", sorted(MOSAIC_LOWER_CASES))
def test_mosaic_lowers_for_cuda(name):
  """Forward and gradient lower for an H200 on CPU: TMA tiling, shared memory,
  wgmma shapes and layouts are checked by the Mosaic GPU lowering."""
  (b, t, s, n, kh, h, hv), kw = MOSAIC_LOWER_CASES[name]
  spec = jax.ShapeDtypeStruct
  arrays = dict(query=spec((b, t, n, h), BF16), key=spec((b, s, kh, h), BF16),
                value=spec((b, s, kh, hv), BF16))
  if kw == "lengths":
    arrays.update(query_seq_lengths=spec((b,), jnp.int32),
                  key_value_seq_lengths=spec((b,), jnp.int32))
    kw = dict(is_causal=True)
  elif kw == "bias_mask":
    arrays.update(bias=spec((1, n, t, s), F32), mask=spec((b, 1, t, s), jnp.bool_))
    kw = dict(is_causal=True)
  diff = {k: arrays[k] for k in ("query", "key", "value", "bias") if k in arrays}
  rest = {k: v for k, v in arrays.items() if k not in diff}
  f = lambda d, r: tokamax.dot_product_attention(**d, **r, **kw, implementation="mosaic")
  loss = lambda d, r: jnp.sum(f(d, r).astype(F32))
  with tokamax.config.cross_compile("NVIDIA H200"):
    fwd_text = _lower_text(f, diff, rest)
    grad_text = _lower_text(jax.grad(loss), diff, rest)
  assert fwd_text.count(MOSAIC_TARGET) == 1
  # Forward, dk/dv (twice, dk then dv, for head dims 256) and dq kernels.
  assert grad_text.count(MOSAIC_TARGET) == (4 if h == 256 else 3)
  assert TRITON_TARGET not in grad_text



def _real_size_case(feature: str, h: int = 64) -> Case:
  """A real-size case of head dim h: "plain" (with lengths), "causal",
  "gqa_bias" (T != S, 4 query heads per kv head, full bias) or
  "window_mask" (T > S, two-sided window, full mask)."""
  causal = feature == "causal"
  case = Case(batch=(2,), t=2048, s=2048, n=8, kh=8, h=h, q_lens=not causal,
              kv_lens=not causal, kwargs=(("is_causal", causal),))
  if feature == "gqa_bias":
    case = dataclasses.replace(case, t=1000, s=1100, kh=2, bias=("full",))
  if feature == "window_mask":
    case = dataclasses.replace(case, t=1100, s=1000, mask=("full",),
                               kwargs=(("local_window_size", (300, 20)),))
  return case


@pytest.mark.parametrize("orders", [(), ("dkdv", "dq")])
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_exp_under_dp_lowers_for_cuda(monkeypatch, causal, h, orders):
  """The backward kernels with and without EXP_UNDER_DP lower for an H200."""
  monkeypatch.setattr(mosaic_attn, "EXP_UNDER_DP", orders)
  q = jax.ShapeDtypeStruct((2, 1024, 4, h), BF16)
  op = _mosaic_op(block_q=64, block_kv=128, num_stages=2)
  loss = lambda q: jnp.sum(op(q, q, q, is_causal=causal).astype(F32))
  with tokamax.config.cross_compile("NVIDIA H200"):
    text = _lower_text(jax.grad(loss), q)
  assert text.count(MOSAIC_TARGET) == 3  # forward, dk/dv, dq


@pytest.mark.parametrize("width", [0, 128])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_dkdv_kv_regs_lowers_for_cuda(monkeypatch, causal, persistent, width):
  """The dk/dv kernel with K and V as register operands (DKDV_KV_REGS_MAX_WIDTH
  128, the default) and from shared memory (0) lowers for an H200 at head
  dim 64."""
  monkeypatch.setattr(mosaic_attn, "DKDV_KV_REGS_MAX_WIDTH", width)
  q = jax.ShapeDtypeStruct((4, 2048, 8, 64), BF16)
  op = _mosaic_op(block_q=64, block_kv=128, num_stages=2,
                  vjp=dict(dkdv_persistent=persistent))
  loss = lambda q: jnp.sum(op(q, q, q, is_causal=causal).astype(F32))
  with tokamax.config.cross_compile("NVIDIA H200"):
    text = _lower_text(jax.grad(loss), q)
  assert text.count(MOSAIC_TARGET) == 3  # forward, dk/dv, dq


def _forward_kernels_lowered(shape, causal, consumers, persistent):
  """Mosaic GPU calls in the forward lowered for an H200 at q = k = v of
  `shape` (64-row consumers, 128-key steps, 2 stages)."""
  q = jax.ShapeDtypeStruct(shape, BF16)
  op = _mosaic_op(block_q=64, block_kv=128, num_stages=2, consumers=consumers,
                  persistent=persistent)
  with tokamax.config.cross_compile("NVIDIA H200"):
    return _lower_text(lambda q: op(q, q, q, is_causal=causal), q).count(MOSAIC_TARGET)


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_fwd_q_regs_lowers_for_cuda(monkeypatch, causal, consumers):
  """The forward with Q as the register operand of q k^T (FWD_Q_REGS) lowers
  for an H200."""
  monkeypatch.setattr(mosaic_attn, "FWD_Q_REGS", True)
  assert _forward_kernels_lowered((4, 2048, 8, 64), causal, consumers, True) == 1


@pytest.mark.parametrize("consumers, persistent", [(3, True), (3, False), (2, True)])
def test_mosaic_reverse_causal_keys_lowers_for_cuda(monkeypatch, consumers, persistent):
  """The causal forward streaming key blocks last first (REVERSE_CAUSAL_KEYS)
  lowers for an H200 at the seed shape."""
  monkeypatch.setattr(mosaic_attn, "REVERSE_CAUSAL_KEYS", (2, 3))
  assert _forward_kernels_lowered((32, 2048, 16, 64), True, consumers, persistent) == 1


def test_mosaic_reverse_causal_keys_inference_only(monkeypatch):
  """By default only the inference forward streams key blocks last first: the
  gradient's forward (saving lse) traces as in key order unless
  REVERSE_WITH_RESIDUALS; the inference forward does not."""
  assert mosaic_attn.REVERSE_CAUSAL_KEYS == (3,) and not mosaic_attn.REVERSE_WITH_RESIDUALS
  q = jax.ShapeDtypeStruct((2, 1024, 4, 64), BF16)
  op = _mosaic_op(block_q=64, block_kv=128, num_stages=2, consumers=3, persistent=True)
  loss = lambda q: jnp.sum(op(q, q, q, is_causal=True).astype(F32))

  def traced(reverse, with_residuals):
    monkeypatch.setattr(mosaic_attn, "REVERSE_CAUSAL_KEYS", reverse)
    monkeypatch.setattr(mosaic_attn, "REVERSE_WITH_RESIDUALS", with_residuals)
    # Jaxprs with the kernel bodies (the lowered text carries a kernel hash
    # that differs between two lowerings of one function).
    with tokamax.config.cross_compile("NVIDIA H200"):
      return (str(jax.make_jaxpr(lambda q: op(q, q, q, is_causal=True))(q)),
              str(jax.make_jaxpr(jax.grad(loss))(q)))

  key_fwd, key_grad = traced((), False)
  rev_fwd, rev_grad = traced((3,), False)  # the defaults
  _, rev_grad_all = traced((3,), True)
  assert rev_fwd != key_fwd
  assert rev_grad == key_grad
  assert rev_grad_all != key_grad


@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_three_consumers_lower_for_cuda(causal):
  """The token-ring forward (4 warpgroups) lowers at the seed shape."""
  assert _forward_kernels_lowered((32, 2048, 16, 64), causal, 3, False) == 1


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape, consumers", [
    ((32, 2048, 16, 16, 64), 3), ((8, 4096, 16, 16, 128), 2),
    ((4, 4096, 32, 8, 128), 2)])
def test_mosaic_persistent_lowers_for_cuda(shape, consumers, causal):
  """The persistent forward (with the lse residual), dq and dk/dv kernels
  lower at the benchmark shapes, in a gradient."""
  b, t, n, kh, h = shape
  q = jax.ShapeDtypeStruct((b, t, n, h), BF16)
  kv = jax.ShapeDtypeStruct((b, t, kh, h), BF16)
  op = _mosaic_op(block_q=64, block_kv=128, num_stages=2, consumers=consumers,
                  persistent=True, vjp=dict(dq_consumers=consumers, dq_persistent=True,
                                            dkdv_persistent=True))
  loss = lambda q, k, v: jnp.sum(op(q, k, v, is_causal=causal).astype(F32))
  with tokamax.config.cross_compile("NVIDIA H200"):
    text = _lower_text(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
  assert text.count(MOSAIC_TARGET) == 3


def test_mosaic_search_space_lowers_for_cuda():
  for h in (64, 128, 256):
    q = jax.ShapeDtypeStruct((1, 1000, 2, h), BF16)
    kv = jax.ShapeDtypeStruct((1, 1100, 1, h), BF16)
    for config in mosaic_attn.search_space(1000, 1100, h, h, 2):
      op = mosaic_attn.MosaicDotProductAttention(config=config)
      with tokamax.config.cross_compile("NVIDIA H200"):
        text = _lower_text(lambda q, k, v: op(q, k, v, is_causal=True), q, kv, kv)
      assert text.count(MOSAIC_TARGET) == 1, config


@pytest.mark.parametrize("residuals", [False, True])
@pytest.mark.parametrize("h, config", [
    (128, (64, 128, 2, 2)), (128, (64, 128, 3, 2)), (128, (64, 64, 4, 3)),
    (64, (128, 128, 2, 3)), (64, (64, 128, 4, 2)), (64, (64, 128, 2, 3, True)),
    (128, (64, 128, 2, 2, True))])
def test_mosaic_smem_estimate_bounds_the_kernel(monkeypatch, h, config, residuals):
  """smem_bytes (what _fits and the search space go by) is at least what
  Mosaic GPU allocates for the forward, with and without the residuals of
  a gradient, and at most 3 KiB more (Pallas adds ~2.2 KiB of its own)."""
  from jax.experimental.mosaic.gpu import core as mgpu_core
  c = mosaic_attn.MosaicAttentionConfig(*config)
  monkeypatch.setattr(mosaic_attn, "_fits", lambda *a: True)
  monkeypatch.setattr(mgpu_core, "_SMEM_SIZE_BOUND", 0)  # always report the size
  q = jax.ShapeDtypeStruct((1, 512, 2, h), BF16)
  op = mosaic_attn.MosaicDotProductAttention(config=c)
  f = lambda q, k, v: op(q, k, v)
  if residuals:  # the forward of a gradient: its outputs and residuals
    f = lambda q, k, v: jax.tree.leaves(jax.vjp(lambda *a: op(*a), q, k, v))
  with tokamax.config.cross_compile("NVIDIA H200"):
    with pytest.raises(ValueError, match="smem_bytes=") as e:
      _lower_text(f, q, q, q)
  used = int(re.search(r"smem_bytes=(\d+)", str(e.value)).group(1))
  estimate = mosaic_attn.smem_bytes(c, h, h, 2, residuals=residuals)
  assert used <= estimate <= used + 3072, (used, estimate)


def test_mosaic_refusals():
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), BF16)
  mask = jax.ShapeDtypeStruct((128, 128), jnp.bool_)
  with tokamax.config.cross_compile("NVIDIA H200"):
    q32 = jax.ShapeDtypeStruct((1, 128, 2, 64), F32)
    with pytest.raises(NotImplementedError, match="mosaic.*bf16 or f16"):
      jax.eval_shape(lambda q: tokamax.dot_product_attention(
          q, q, q, implementation="mosaic"), q32)
    # implementation=None takes another kernel for what "mosaic" refuses,
    # and "mosaic" for what cuDNN refuses (a soft cap) and mosaic runs.
    text = _lower_text(lambda q: tokamax.dot_product_attention(
        q, q, q, logits_soft_cap=5.0), q32)
    assert MOSAIC_TARGET not in text and TRITON_TARGET in text
    text = _lower_text(lambda q, m: tokamax.dot_product_attention(
        q, q, q, mask=m, logits_soft_cap=5.0), q, mask)
    assert MOSAIC_TARGET in text and TRITON_TARGET not in text
  for kind in ("NVIDIA A100", "NVIDIA B200"):
    with tokamax.config.cross_compile(kind):
      with pytest.raises(NotImplementedError, match="mosaic.*Hopper"):
        jax.eval_shape(lambda q: tokamax.dot_product_attention(
            q, q, q, implementation="mosaic"), q)


@pytest.mark.parametrize("bad", [dict(block_q=32), dict(block_kv=96),
                                 dict(num_stages=0), dict(num_stages=5),
                                 dict(consumers=1), dict(consumers=4)])
def test_mosaic_config_validation(bad):
  with pytest.raises(ValueError):
    mosaic_attn.MosaicAttentionConfig(**bad)


@pytest.mark.parametrize("bad", [dict(block_q=32), dict(block_kv=256),
                                 dict(dq_block_q=96), dict(dq_block_kv=16),
                                 dict(num_stages=0), dict(dq_num_stages=5)])
def test_mosaic_vjp_config_validation(bad):
  with pytest.raises(ValueError, match=next(iter(bad))):
    mosaic_attn.MosaicAttentionVjpConfig(**bad)


@pytest.mark.parametrize("producer", [24, 40, 56])
def test_mosaic_register_split(monkeypatch, producer):
  """setmaxnreg counts: multiples of 8 in [24, 256] whose warpgroup sum fits
  the 512 per-thread slots (64 Ki registers / 128 threads); 232 / 152 shipped."""
  monkeypatch.setattr(mosaic_attn, "_PRODUCER_REGS", producer)
  for consumers in (2, 3):
    regs = mosaic_attn._consumer_regs(consumers)
    assert regs % 8 == 0 and 24 <= regs <= 256
    assert consumers * regs + producer <= 512 < consumers * (regs + 8) + producer
  monkeypatch.undo()
  assert (mosaic_attn._consumer_regs(2), mosaic_attn._consumer_regs(3)) == (232, 152)


@pytest.mark.parametrize("h, hv, fused", [(64, 64, True), (128, 128, True),
                                          (128, 64, True), (256, 256, False)])
def test_mosaic_dq_delta_rule(monkeypatch, h, hv, fused):
  """The dq kernel computes D (DQ_DELTA) where its O tiles fit shared memory
  on top of the heuristic config's buffers (not at head dim 256), never when
  switched off; the config is chosen as without them."""
  for banded in (False, True):
    c = mosaic_attn.vjp_heuristic_config(2048, 2048, h, hv, 2, banded, 512)
    assert mosaic_attn.dq_computes_delta(c, h, hv, 2) == fused
    with_o = mosaic_attn.vjp_smem_bytes(c, h, hv, 2, dq_delta=True)[1]
    assert (with_o <= pallas_mosaic.SMEM_BYTES) == fused
    assert with_o > mosaic_attn.vjp_smem_bytes(c, h, hv, 2)[1]
    monkeypatch.setattr(mosaic_attn, "DQ_DELTA", False)
    assert not mosaic_attn.dq_computes_delta(c, h, hv, 2)
    monkeypatch.undo()


def test_mosaic_heuristics_fit_shared_memory():
  for h, hv in [(64, 64), (128, 128), (256, 256), (128, 64), (256, 128)]:
    c = mosaic_attn.heuristic_config(2048, 2048, h, hv, 2)
    assert mosaic_attn.smem_bytes(c, h, hv, 2) <= pallas_mosaic.SMEM_BYTES
    assert c in mosaic_attn.search_space(2048, 2048, h, hv, 2) or h == 256
    c = mosaic_attn.vjp_heuristic_config(2048, 2048, h, hv, 2)
    assert max(mosaic_attn.vjp_smem_bytes(c, h, hv, 2)) <= pallas_mosaic.SMEM_BYTES
    assert c in mosaic_attn.vjp_search_space(2048, 2048, h, hv, 2)


def test_mosaic_consumers_by_head_dim_and_tiles():
  """Three consumers only for small O tiles without bias/mask tiles (their
  152 registers hold S, P and O; docs/benchmarks.md), in the heuristic and
  in the search space."""
  pick = lambda hv, tiles=False: mosaic_attn.heuristic_config(
      2048, 2048, 64, hv, 2, tiles=tiles).consumers
  assert (pick(64), pick(64, tiles=True), pick(128)) == (3, 2, 2)
  for hv in (64, 128):
    for tiles in (False, True):
      for c in mosaic_attn.search_space(2048, 2048, 64, hv, 2, tiles=tiles):
        if c.consumers == 3:
          assert not tiles and c.block_q == 64 and c.block_q * (c.block_kv + hv) <= 96 * 128


@pytest.mark.parametrize("t, grid, consumers", [
    (2048, 32 * 16, 3),  # seed shape: 43 rounds of 192 rows
    (4096, 8, 2),  # 176 tiles of 192 rows: 2 rounds; 256 of 128: 2
    (2048, 8, 2),  # one round either way (25 % faster, H100)
    (4096, 16, 2),  # 4 rounds of 128 rows against 3 of 192: 8.96 < 9
    (4096, 0, 3),  # grid unknown
])
def test_mosaic_forward_consumers_by_rounds(t, grid, consumers):
  """Two consumers at head dim 64 where three would leave the last round of
  tiles part empty and two cost fewer rows x time per row (causal or not:
  H100 2026-12-07, 4 causal grids and 5 not)."""
  c = mosaic_attn.heuristic_config(t, t, 64, 64, 2, grid=grid)
  assert c.consumers == consumers
  assert mosaic_attn.heuristic_config(t, t, 64, 128, 2, grid=grid).consumers == 2
  assert mosaic_attn.heuristic_config(t, t, 64, 64, 2, tiles=True,
                                      grid=grid).consumers == 2


@pytest.mark.parametrize("cores", [132, 114])
def test_persistent_ctas_and_rounds_follow_the_targets_sms(cores):
  """One persistent CTA per SM of the target GPU (132 on an H100/H200 SXM,
  114 on an H100 PCIe), not a constant: more CTAs than SMs would leave the
  extra ones a second wave. The round counts of the heuristics and the
  grid-order rules use the same count."""
  with tokamax.config.cross_compile("NVIDIA H100 PCIe", num_cores=cores):
    assert mosaic_attn._persistent_ctas(10_000, True) == cores
    assert mosaic_attn._persistent_ctas(100, True) == 100
    assert mosaic_attn._persistent_ctas(10_000, False) == 0
    assert triton_attn.sms() == cores
    # B1 T4096 N8 head dim 64: 176 tiles of 192 rows take 2 rounds on
    # either GPU; 256 tiles of 128 rows take 2 rounds on 132 SMs (two
    # consumers win) but 3 on 114 (three keep it).
    c = mosaic_attn.heuristic_config(4096, 4096, 64, 64, 2, grid=8)
    assert c.consumers == (2 if cores == 132 else 3)


@pytest.mark.parametrize("t, q_pairs, banded, consumers", [
    (2048, 32 * 16, False, 3),  # seed shape: 43 rounds of 192 rows
    (4096, 16, False, 3),  # 3 rounds of 192 rows against 4 of 128: 9 < 9.36
    (4096, 8, False, 2),  # 2 rounds either way (dq 25 % faster, H100)
    (2048, 8, False, 2),  # one round either way (dq 23 % faster, H100)
    (1024, 16, True, 2),  # causal, one wave either way (dq 17 % faster, H100)
    (4096, 16, True, 3),  # causal, 4 waves against 3: 9 < 9.36 (three 2 % faster)
    (4096, 0, False, 3),  # grid unknown
])
def test_mosaic_dq_consumers_by_rounds(t, q_pairs, banded, consumers):
  """The dq kernel: two consumers at head dim 64 where three would leave the
  last round (wave, causal) of its tiles part empty; two above head dim 64."""
  c = mosaic_attn.vjp_heuristic_config(t, t, 64, 64, 2, banded, 8, q_pairs)
  assert c.dq_consumers == consumers
  assert mosaic_attn.vjp_heuristic_config(t, t, 128, 128, 2, banded, 8,
                                          q_pairs).dq_consumers == 2


@pytest.mark.parametrize("h", [64, 128, 256])
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("kwargs, banded", [
    ({}, False), (dict(is_causal=True), True),
    (dict(local_window_size=(100, 100)), True)])
def test_mosaic_vjp_persistent_rules(h, batch, kwargs, banded):
  """The heuristic and every search-space config run the dq kernel
  persistent where no causal mask or window makes its tiles unequal, the dk/dv
  kernel at head dim 64 (banded: with at least 32 key tiles per CTA: batch
  32, not 1), each where its buffer fits (neither at head dim 256), with the
  rings as deep as without."""
  q = jnp.zeros((batch, 2048, 16, h), BF16)  # only its shape is read
  ba = mosaic_attn.MosaicDotProductAttention().bind(q, q, q, **kwargs)
  vjp = mosaic_attn.MosaicDotProductAttentionVjp()
  heuristic = vjp._get_heuristics_config(ba)
  assert heuristic.dq_persistent == (not banded and h < 256)
  assert heuristic.dkdv_persistent == (h == 64 and (not banded or batch == 32))
  assert heuristic == mosaic_attn.vjp_heuristic_config(
      2048, 2048, h, h, 2, banded, batch * 16, batch * 16)
  # Batch 1 at head dim 64: two dq consumers (2 rounds either way).
  assert (heuristic.dq_consumers == 2) == (h > 64 or batch == 1)
  assert dataclasses.replace(heuristic, dq_persistent=False, dkdv_persistent=False,
                             dq_consumers=3 if h == 64 else 2) == (
      mosaic_attn.vjp_heuristic_config(2048, 2048, h, h, 2, True))
  space = vjp._get_autotuning_configs(ba)
  assert heuristic in space
  for c in space:  # each kernel persistent by the rules, where it fits
    dq = dataclasses.replace(c, dq_persistent=True)
    assert c.dq_persistent == (not banded and mosaic_attn._vjp_fits(dq, h, h, 2)), c
    dkdv = dataclasses.replace(c, dkdv_persistent=True)
    assert c.dkdv_persistent == (
        mosaic_attn._dkdv_persistent(c, 2048, h, h, banded, batch * 16)
        and mosaic_attn._vjp_fits(dkdv, h, h, 2)), c
    assert not c.dkdv_persistent or h == 64


def test_mosaic_vjp_search_space_lowers_for_cuda():
  """Every backward candidate lowers for an H200 (shared memory, wgmma)."""
  for h in (64, 128, 256):
    q = jax.ShapeDtypeStruct((1, 1000, 2, h), BF16)
    kv = jax.ShapeDtypeStruct((1, 1100, 1, h), BF16)
    for config in mosaic_attn.vjp_search_space(1000, 1100, h, h, 2):
      op = mosaic_attn.MosaicDotProductAttention(
          vjp=mosaic_attn.MosaicDotProductAttentionVjp(config=config))
      loss = lambda q, k, v: jnp.sum(op(q, k, v, is_causal=True).astype(F32))
      with tokamax.config.cross_compile("NVIDIA H200"):
        text = _lower_text(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
      assert text.count(MOSAIC_TARGET) == (4 if h == 256 else 3), config


def test_mosaic_trace_switch():
  """trace_kernels() turns Mosaic GPU's profiler on, except when interpreted."""
  assert pallas_mosaic.compiler_params(approx_math=True).profile_space == 0
  with pallas_mosaic.trace_kernels("/tmp/somewhere"):
    params = pallas_mosaic.compiler_params(approx_math=True)
    assert params.approx_math and params.profile_dir == "/tmp/somewhere"
    assert params.profile_space == pallas_mosaic.TRACE_RANGES
    with pallas_mosaic.interpret_mode():
      assert pallas_mosaic.compiler_params().profile_space == 0
  assert pallas_mosaic.compiler_params().profile_dir == ""


@pytest.mark.gpu
def test_mosaic_trace_on_gpu(tmp_path):
  """A traced forward gives the same output and a trace of every region."""
  x = jax.random.normal(jax.random.key(0), (1, 1024, 4, 64), BF16)
  f = lambda q: tokamax.dot_product_attention(q, q, q, implementation="mosaic")
  plain = jax.jit(f)(x)
  with pallas_mosaic.trace_kernels(str(tmp_path)):
    traced = jax.jit(f)(x)
    jax.effects_barrier()
  np.testing.assert_array_equal(np.asarray(plain, F32), np.asarray(traced, F32))
  [trace] = list(tmp_path.glob("*trace.json"))
  names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
  assert {"q_wait", "qk_issue", "rendezvous_qk", "qk_wait", "softmax",
          "rendezvous_pv", "pv", "epilogue", "k_free_wait"} <= names, names


@pytest.mark.gpu
class TestMosaicGpu(AttentionTestBase):
  """The whole base with the compiled Mosaic forward on an H100/H200."""

  implementation = "mosaic"
  dtypes = (BF16, F16)

  @pytest.mark.parametrize("causal", [False, True])
  @pytest.mark.parametrize("shape", [(1, 4096, 16, 16, 128), (1, 1024, 32, 8, 128),
                                     (1, 1000, 4, 4, 256), (2, 777, 4, 2, 80),
                                     (2, 2048, 8, 8, 64), (1, 300, 4, 2, 32)])
  def test_real_size_shapes(self, shape, causal):
    b, t, n, kh, h = shape
    self.check(Case(batch=(b,), t=t, s=t, n=n, kh=kh, h=h,
                    kwargs=(("is_causal", causal),)), BF16)

  @pytest.mark.parametrize("causal", [False, True])
  @pytest.mark.parametrize("shape, consumers", [
      ((4, 2048, 8, 8, 64), 3), ((2, 4096, 8, 4, 128), 2), ((2, 1500, 6, 2, 80), 2)])
  def test_persistent_real_size(self, shape, causal, consumers):
    """The persistent forward, dq and dk/dv kernels on 132 CTAs, 2-6 query
    tiles (1-4 key tiles) each."""
    b, t, n, kh, h = shape
    self.op = _mosaic_op(block_q=64, block_kv=128, num_stages=2,
                         consumers=consumers, persistent=True,
                         vjp=dict(dq_consumers=consumers, dq_persistent=True,
                                  dkdv_persistent=True))
    self.check(Case(batch=(b,), t=t, s=t, n=n, kh=kh, h=h, q_lens=not causal,
                    kv_lens=not causal, kwargs=(("is_causal", causal),)), BF16)

  @pytest.mark.parametrize("causal", [False, True])
  @pytest.mark.parametrize("shape", [(2, 4096, 8, 4, 128), (4, 2048, 8, 8, 64)])
  def test_persistent_dkdv_prefetch_at_tile_start(self, monkeypatch, shape, causal):
    """The persistent dk/dv kernel loading the next key tile's K/V as a
    tile starts (DKDV_PREFETCH_AT_TILE_START) on 132 CTAs."""
    monkeypatch.setattr(mosaic_attn, "DKDV_PREFETCH_AT_TILE_START", True)
    b, t, n, kh, h = shape
    self.op = _mosaic_op(block_q=64, block_kv=128, num_stages=2,
                         vjp=dict(dkdv_persistent=True))
    self.check(Case(batch=(b,), t=t, s=t, n=n, kh=kh, h=h, q_lens=not causal,
                    kv_lens=not causal, kwargs=(("is_causal", causal),)), BF16)

  @pytest.mark.parametrize("feature", ["plain", "causal", "gqa_bias"])
  @pytest.mark.parametrize("h", [64, 128])
  def test_exp_under_dp_real_size(self, monkeypatch, feature, h):
    """Both backward kernels computing p while dp runs (EXP_UNDER_DP) on the
    GPU: fused (64) and separate (128) dk/dv products, GQA with bias."""
    monkeypatch.setattr(mosaic_attn, "EXP_UNDER_DP", ("dkdv", "dq"))
    self.op = _mosaic_op(block_q=64, block_kv=128, num_stages=2)
    causal = feature != "plain"
    case = Case(batch=(2,), t=2048, s=2048, n=8, kh=2 if feature == "gqa_bias" else 8,
                h=h, q_lens=not causal, kv_lens=not causal,
                kwargs=(("is_causal", causal),))
    if feature == "gqa_bias":
      case = dataclasses.replace(case, t=1000, s=1100, bias=("full",))
    self.check(case, BF16)

  @pytest.mark.parametrize("dq_delta", [True, False])
  @pytest.mark.parametrize("feature, h", [("plain", 64), ("causal", 64),
                                          ("gqa_bias", 128), ("causal", 128)])
  def test_dq_delta_real_size(self, monkeypatch, dq_delta, feature, h):
    """D computed by the dq kernel (DQ_DELTA, default) and by XLA on the GPU
    at the heuristic configs (persistent dq kernel where not causal)."""
    monkeypatch.setattr(mosaic_attn, "DQ_DELTA", dq_delta)
    self.check(_real_size_case(feature, h), BF16)

  @pytest.mark.parametrize("persistent", [False, True])
  @pytest.mark.parametrize("feature", ["plain", "causal", "gqa_bias", "window_mask"])
  def test_dkdv_kv_regs_real_size(self, monkeypatch, feature, persistent):
    """The dk/dv kernel with K and V as register operands of s^T and dp^T
    (DKDV_KV_REGS_MAX_WIDTH) on the GPU at head dim 64."""
    monkeypatch.setattr(mosaic_attn, "DKDV_KV_REGS_MAX_WIDTH", 128)
    self.op = _mosaic_op(block_q=64, block_kv=128, num_stages=2,
                         vjp=dict(dkdv_persistent=persistent))
    self.check(_real_size_case(feature), BF16)

  @pytest.mark.parametrize("consumers", [2, 3])
  @pytest.mark.parametrize("feature", ["plain", "causal", "gqa_bias", "window_mask"])
  def test_fwd_q_regs_real_size(self, monkeypatch, feature, consumers):
    """The forward with Q as the register operand of q k^T (FWD_Q_REGS) on
    the GPU at head dim 64, persistent."""
    monkeypatch.setattr(mosaic_attn, "FWD_Q_REGS", True)
    if feature in ("gqa_bias", "window_mask"):
      consumers = 2  # three consumers take no bias/mask tiles
    self.op = _mosaic_op(block_q=64, block_kv=128, num_stages=2,
                         consumers=consumers, persistent=True)
    self.check(_real_size_case(feature), BF16)

  @pytest.mark.parametrize("feature, h, consumers, persistent", [
      ("causal", 64, 3, True), ("causal", 64, 3, False), ("causal", 128, 2, True),
      ("window", 64, 2, True)])
  def test_reverse_causal_keys_real_size(self, monkeypatch, feature, h, consumers,
                                         persistent):
    """The forward streaming key blocks last first (REVERSE_CAUSAL_KEYS) on
    the GPU: causal, and a two-sided window with T > S."""
    monkeypatch.setattr(mosaic_attn, "REVERSE_CAUSAL_KEYS", (2, 3))
    monkeypatch.setattr(mosaic_attn, "REVERSE_WITH_RESIDUALS", True)
    self.op = _mosaic_op(block_q=64, block_kv=128, num_stages=2,
                         consumers=consumers, persistent=persistent)
    case = _real_size_case("causal", h)
    if feature == "window":
      case = dataclasses.replace(case, t=1100, s=1000,
                                 kwargs=(("local_window_size", (300, 20)),))
    self.check(case, BF16)

  @pytest.mark.parametrize("config", sorted(
      mosaic_attn.search_space(1024, 1024, 128, 128, 2), key=str))
  def test_search_space_configs(self, config):
    """Every autotuning candidate compiles and is right (H128, many blocks)."""
    self.op = mosaic_attn.MosaicDotProductAttention(config=config)
    self.check(Case(batch=(1,), t=1000, s=1100, n=4, kh=2, h=128, q_lens=True,
                    kv_lens=True, kwargs=(("is_causal", True),
                                          ("local_window_size", (300, None)))), BF16)

  @pytest.mark.parametrize("config", sorted(
      mosaic_attn.vjp_search_space(1024, 1024, 128, 128, 2), key=str))
  def test_vjp_search_space_configs(self, config):
    """Every backward autotuning candidate compiles and is right."""
    self.op = mosaic_attn.MosaicDotProductAttention(
        vjp=mosaic_attn.MosaicDotProductAttentionVjp(config=config))
    self.check(Case(batch=(1,), t=1000, s=1100, n=4, kh=2, h=128, q_lens=True,
                    kv_lens=True, kwargs=(("is_causal", True),
                                          ("local_window_size", (300, None)))), BF16)

  @pytest.mark.parametrize("config", sorted(
      (c for c in mosaic_attn.vjp_search_space(1024, 1024, 64, 64, 2)
       if c.dq_consumers == 3), key=str))
  def test_vjp_three_dq_consumers_configs(self, config):
    """Head dim 64 candidates with three dq consumers (none fit at 128)."""
    self.op = mosaic_attn.MosaicDotProductAttention(
        vjp=mosaic_attn.MosaicDotProductAttentionVjp(config=config))
    self.check(Case(batch=(2,), t=1000, s=1100, n=4, kh=2, h=64, q_lens=True,
                    kv_lens=True, kwargs=(("is_causal", True),)), BF16)

  @pytest.mark.parametrize("h", [64, 128])
  def test_real_size_bias_mask(self, h):
    """Bias [1, N, T, S] (with its gradient) and mask [B, 1, T, S], causal."""
    self.check(Case(batch=(2,), t=2048, s=2048, n=4, kh=2, h=h,
                    bias=(1, 4, 2048, 2048), mask=(2, 1, 2048, 2048),
                    kwargs=(("is_causal", True),)), BF16)

  def test_deterministic(self):
    """Forward and gradients are bitwise equal run to run (no atomics)."""
    args, kwargs, _ = make_inputs(Case(batch=(2,), t=2048, s=2048, n=4, kh=2, h=128,
                                       kwargs=(("is_causal", True),)), BF16, 3)
    f = jax.jit(lambda a: self.attention(**a, **kwargs))
    np.testing.assert_array_equal(np.asarray(f(args), np.float32),
                                  np.asarray(f(args), np.float32))
    loss = lambda a: jnp.sum(self.attention(**a, **kwargs).astype(F32) ** 2)
    g = jax.jit(jax.grad(loss))
    for a, b in zip(jax.tree.leaves(g(args)), jax.tree.leaves(g(args))):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
