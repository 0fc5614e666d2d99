"""The "mosaic" implementation of dot_product_attention: Pallas:Mosaic GPU (sm90).

Forward: FlashAttention-3 (arXiv:2407.08608) with `plgpu.kernel`. A CTA of
three warpgroups (WGs) owns 2 * block_q query rows of one (batch, head):
  * WG 2, the producer (Sec. 3.1, warp specialisation), streams the key and
    value blocks of the CTA's kv head into a ring of `num_stages` shared
    memory slots with TMA; `k_ready`/`v_ready` barriers complete when a copy
    lands, `k_free`/`v_free` when both consumers are done with a slot.
  * WGs 0 and 1, the consumers, own block_q rows each: S = Q K^T and O += P V
    run on the tensor cores (wgmma, Q and K/V from shared memory, P from
    registers), the online softmax (FlashAttention-2, Sec. 3.1.1) in base 2
    on registers. A two-party `sched` barrier offsets the consumers by half a
    step ("ping-pong", Sec. 3.1) so one WG's softmax overlaps the other's
    matmuls.
Every feature but bias and mask is applied in registers: causal/local
windows and query/key lengths by positions (key blocks no row sees are never
loaded; blocks every row sees in full run without the positional mask),
soft cap by tanh, GQA by reading kv head n // G (k/v never repeated).
Saves lse = m + log(l) (f32 [B, N, T]) as the residual.

Backward: the "triton" FlashAttention-2 backward kernels (dk/dv and dq) from
the same lse residual; a Mosaic backward is not written yet (issue #5).

Shapes: head dims are padded to multiples of 64 (wgmma/TMA tiles; a copy,
only when H or Hv is not already one). Sequences shorter than a block are
padded; otherwise rows and keys past the ends are zero-filled by TMA on load,
masked (keys) and clipped by TMA on store (rows).

Mosaic GPU interpreter (tests on CPU): it cannot run a wgmma with a register
operand nor accumulate into an initialised accumulator, so with
`pallas_mosaic.INTERPRET` P goes through shared memory and P V is added in
registers. Everything else (TMA, barriers, warpgroups, masks) is the GPU path.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import pydantic
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax._src import op as op_lib
from tokamax._src import pallas_mosaic
from tokamax._src import pallas_triton
from tokamax.ops.attention import triton
from tokamax.ops.attention import xla as base

LOG2E = triton.LOG2E
LN2 = triton.LN2
MAX_HEAD_DIM = 256
_CONSUMERS = 2  # consumer warpgroups per CTA; the producer is WG 2
_M_INIT = -1e30  # finite running-max start: exp2(m_old - m_new) never NaN
# Registers per thread (of 512 per SM quadrant budget / 3 WGs): the producer
# only issues TMA; consumers hold S, P and the O accumulator.
_PRODUCER_REGS = 40
_CONSUMER_REGS = 232


@pydantic.dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
  """Query rows per consumer WG (CTA: 2x), key rows per step, ring depth."""

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2

  @pydantic.field_validator("block_q")
  @classmethod
  def _block_q(cls, v):
    if v not in (64, 128):
      raise ValueError(f"block_q must be 64 or 128 (wgmma rows), got {v}")
    return v

  @pydantic.field_validator("block_kv")
  @classmethod
  def _block_kv(cls, v):
    if v not in (64, 128, 192, 256):
      raise ValueError(f"block_kv must be 64, 128, 192 or 256, got {v}")
    return v

  @pydantic.field_validator("num_stages")
  @classmethod
  def _stages(cls, v):
    if not 1 <= v <= 4:
      raise ValueError(f"num_stages must be 1..4, got {v}")
    return v


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def smem_bytes(config: MosaicAttentionConfig, hp: int, hvp: int, itemsize: int,
               residuals: bool = True) -> int:
  """Shared memory of the forward kernel (each buffer 1 KiB aligned)."""
  bq, bk, st = config.block_q, config.block_kv, config.num_stages
  q = _CONSUMERS * bq * hp * itemsize
  o = 0 if hvp == hp else _CONSUMERS * bq * hvp * itemsize
  kv = st * bk * (hp + hvp) * itemsize
  lse = _CONSUMERS * bq * 4 if residuals else 0
  bufs = [q, o, kv // 2, kv // 2, lse]
  return sum(_round_up(x, 1024) for x in bufs if x) + 2560  # + barriers, reductions


def _pad(x, axis: int, size: int):
  """x zero-padded at the end of `axis` to at least `size` (a copy if so)."""
  if x.shape[axis] >= size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


# --- the kernel ------------------------------------------------------------------


def _fwd_kernel(*refs, sp, bq: int, bk: int, stages: int, hp: int, hvp: int,
                save_lse: bool, interpret: bool):
  it = iter(refs)
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  q_len_ref = next(it) if sp.has_q_len else None
  kv_len_ref = next(it) if sp.has_kv_len else None
  o_ref, lse_ref = next(it), next(it)
  (q_smem, o_smem, k_smem, v_smem, lse_smem, p_smem, q_ready, k_ready, v_ready,
   k_free, v_free, sched) = it
  if o_smem is None:
    o_smem = q_smem
  dtype = q_ref.dtype

  b = lax.axis_index("batch")
  n = lax.axis_index("head")
  qi = lax.axis_index("q")
  if sp.right is not None:  # causal/right window: the longest CTAs first
    qi = lax.axis_size("q") - 1 - qi
  wg = lax.axis_index("wg")
  kh = lax.div(n, jnp.int32(sp.groups))

  q_lim, kv_lim = jnp.int32(sp.t), jnp.int32(sp.s)
  if q_len_ref is not None:
    q_lim = jnp.maximum(jnp.minimum(q_lim, q_len_ref[b]), 0)
  if kv_len_ref is not None:
    kv_lim = jnp.maximum(jnp.minimum(kv_lim, kv_len_ref[b]), 0)
  cta0 = qi * (_CONSUMERS * bq)
  lo, _, _, hi = triton.blocks_seen(
      cta0, _CONSUMERS * bq, bk, q_lim, kv_lim, sp.left, sp.right, strict=False)

  def schedule():
    plgpu.barrier_arrive(sched)
    plgpu.barrier_wait(sched)

  def slot_of(j):
    return lax.rem(j - lo, jnp.int32(stages))

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    if not interpret:
      plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
    r0 = cta0 + wg * bq
    lo_w, a_w, c_w, hi_w = triton.blocks_seen(
        r0, bq, bk, q_lim, kv_lim, sp.left, sp.right, strict=False)
    # The CTA's range is the union of its rows': clamp (rows past q_lim give
    # empty ranges that may start anywhere).
    lo_w = jnp.minimum(jnp.maximum(lo_w, lo), hi)
    hi_w = jnp.minimum(jnp.maximum(hi_w, lo_w), hi)
    a_w = jnp.minimum(jnp.maximum(a_w, lo_w), hi_w)
    c_w = jnp.minimum(jnp.maximum(c_w, a_w), hi_w)
    q_tile = q_smem.at[wg]
    plgpu.copy_gmem_to_smem(
        q_ref.at[b, pl.ds(r0, bq), n], q_tile, q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((bq,), _M_INIT, jnp.float32), row_layout)
    l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
    acc = plgpu.layout_cast(jnp.zeros((bq, hvp), jnp.float32), plgpu.Layout.WGMMA)
    raw = triton.raw_scale(sp)

    def logits_and_max(qk, j, m, masked):
      """Base-2 logits (or raw q.k when `raw`) and the new running max."""
      if raw is None:
        z = qk * sp.scale
        if sp.cap is not None:
          z = sp.cap * jnp.tanh(z / sp.cap)
        z = z * LOG2E
      else:
        z = qk
      if masked:
        rows = r0 + plgpu.broadcasted_iota(
            jnp.int32, (bq, bk), 0, layout=plgpu.Layout.WGMMA)
        cols = j * bk + plgpu.broadcasted_iota(
            jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
        z = jnp.where(triton.positional(sp, rows, cols, q_lim, kv_lim), z, -jnp.inf)
      z_max = z.max(axis=1)
      if raw is not None:
        z_max = z_max * raw
      return z, jnp.maximum(m, z_max)

    def wait_next_k(j):
      # Step j + 1's keys: waited while step j's P V runs (FA3, Sec. 3.1).
      @pl.when(j + 1 < hi)
      def _():
        plgpu.barrier_wait(k_ready.at[slot_of(j + 1)])

    def end_softmax(slot):
      plgpu.barrier_arrive(sched)  # softmax done: the other WG may issue
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_wait(sched)  # the tensor cores are ours again

    def step(j, carry, mode):
      m, l, acc = carry
      slot = slot_of(j)
      if mode == "skip":  # a block only the other consumer sees
        plgpu.barrier_arrive(k_free.at[slot])
        schedule()
        end_softmax(slot)
        wait_next_k(j)
        plgpu.barrier_arrive(v_free.at[slot])
        return m, l, acc

      def qk_product(acc_ref):
        plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].T)
        schedule()  # the other consumer's softmax runs meanwhile
        return acc_ref[...]

      qk = pl.run_scoped(qk_product, plgpu.ACC((bq, bk), jnp.float32))
      plgpu.barrier_arrive(k_free.at[slot])
      z, m_new = logits_and_max(qk, j, m, mode == "masked")
      m_b = lax.broadcast_in_dim(m_new, z.shape, [0])
      p = jnp.exp2(z * raw - m_b) if raw is not None else jnp.exp2(z - m_b)
      alpha = jnp.exp2(m - m_new)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      l = l * alpha
      p16 = p.astype(dtype)
      # Instruction order matters for overlap (the ordering of JAX's FA3
      # example): with small accumulators finish the softmax before
      # releasing the tensor cores, with large ones after.
      if hvp <= 128:
        l = l + p.sum(axis=1)
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
        end_softmax(slot)
      else:
        end_softmax(slot)
        l = l + p.sum(axis=1)
      if interpret:
        p_tile = p_smem.at[wg]
        p_tile[...] = p16
        plgpu.commit_smem()

        def pv_product(acc_ref):
          plgpu.wgmma(acc_ref, p_tile, v_smem.at[slot])
          wait_next_k(j)
          return acc_ref[...]

        acc = acc + pl.run_scoped(pv_product, plgpu.ACC((bq, hvp), jnp.float32))
      else:
        def pv_product(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
          wait_next_k(j)

        acc = pl.run_state(pv_product)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_free.at[slot])
      return m_new, l, acc

    carry = (m, l, acc)

    @pl.when(lo < hi)
    def _():
      plgpu.barrier_wait(k_ready.at[slot_of(lo)])

    pl.when(wg == 1)(schedule)
    for start, stop, mode in ((lo, lo_w, "skip"), (lo_w, a_w, "masked"),
                              (a_w, c_w, "full"), (c_w, hi_w, "masked"),
                              (hi_w, hi, "skip")):
      carry = lax.fori_loop(start, stop, functools.partial(step, mode=mode), carry)
    pl.when(wg == 0)(schedule)
    m, l, acc = carry

    # Rows that saw no key (l = 0) and rows >= q_lim output 0 with lse = 0.
    seen = l > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    rows = r0 + plgpu.broadcasted_iota(
        jnp.int32, (bq, hvp), 0, layout=plgpu.Layout.WGMMA)
    out = jnp.where(rows < q_lim, acc * lax.broadcast_in_dim(inv, acc.shape, [0]), 0.0)
    o_tile = o_smem.at[wg]
    o_tile[...] = out.astype(dtype)
    if save_lse:
      lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * LN2, 0.0)
      lse_smem.at[wg][...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_tile, o_ref.at[b, pl.ds(r0, bq), n])
    if save_lse:
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, n, pl.ds(r0, bq)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _CONSUMERS)
  def _producer():
    if not interpret:
      plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")

    def issue(j, slot, barrier_wait):
      rows = (b, pl.ds(j * bk, bk), kh)
      if barrier_wait:
        plgpu.barrier_wait(k_free.at[slot])
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
      if barrier_wait:
        plgpu.barrier_wait(v_free.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

    first = jnp.minimum(lo + stages, hi)

    @pl.loop(lo, first)
    def _fill(j):
      issue(j, slot_of(j), False)

    @pl.loop(first, hi)
    def _stream(j):
      issue(j, slot_of(j), True)

    # Wait out the last phases of the free barriers (the interpreter checks
    # that every waiter saw every phase; on the GPU this only idles WG 2).
    @pl.loop(jnp.maximum(lo, hi - stages), hi)
    def _drain(j):
      plgpu.barrier_wait(k_free.at[slot_of(j)])
      plgpu.barrier_wait(v_free.at[slot_of(j)])


def attention_forward(args, config: MosaicAttentionConfig, return_residuals: bool):
  """(out [B, T, N, Hv], lse [B, N, T] f32 or None) by the forward kernel."""
  sp = triton.Spec.of(args)
  q, k, v = args["query"], args["key"], args["value"]
  bsz, t, n, h = q.shape
  hv = v.shape[3]
  hp, hvp = _round_up(h, 64), _round_up(hv, 64)
  bq, bk, stages = config.block_q, config.block_kv, config.num_stages
  cta_rows = _CONSUMERS * bq
  # TMA into swizzled tiles of 8 rows needs row counts that are multiples of
  # 8, and boxes may not exceed short arrays: pad (a copy) only then.
  tq_min = max(cta_rows, _round_up(t, 8))
  s_min = max(bk, _round_up(sp.s, 8))
  q = _pad(_pad(q, 3, hp), 1, tq_min)
  k = _pad(_pad(k, 3, hp), 1, s_min)
  v = _pad(_pad(v, 3, hvp), 1, s_min)
  tq = q.shape[1]
  nq = pl.cdiv(tq, cta_rows)
  interpret = pallas_mosaic.INTERPRET.value
  dtype = q.dtype
  scratch = [
      plgpu.SMEM((_CONSUMERS, bq, hp), dtype),
      None if hvp == hp else plgpu.SMEM((_CONSUMERS, bq, hvp), dtype),
      plgpu.SMEM((stages, bk, hp), dtype),
      plgpu.SMEM((stages, bk, hvp), dtype),
      plgpu.SMEM((_CONSUMERS, bq), jnp.float32) if return_residuals else None,
      plgpu.SMEM((_CONSUMERS, bq, bk), dtype) if interpret else None,
      plgpu.Barrier(num_barriers=_CONSUMERS),  # q_ready
      plgpu.Barrier(num_barriers=stages),  # k_ready
      plgpu.Barrier(num_barriers=stages),  # v_ready
      plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),  # k_free
      plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),  # v_free
      plgpu.Barrier(num_arrivals=_CONSUMERS),  # sched
  ]
  lengths = [
      x.astype(jnp.int32) for x in
      (args["query_seq_lengths"], args["key_value_seq_lengths"]) if x is not None
  ]
  out_type = [
      jax.ShapeDtypeStruct((bsz, tq, n, hvp), dtype),
      jax.ShapeDtypeStruct((bsz, n, nq * cta_rows), jnp.float32)
      if return_residuals else None,
  ]
  kernel = plgpu.kernel(
      functools.partial(
          _fwd_kernel, sp=sp, bq=bq, bk=bk, stages=stages, hp=hp, hvp=hvp,
          save_lse=return_residuals, interpret=interpret),
      out_type=out_type,
      scratch_types=scratch,
      # The last grid axis varies fastest: the CTAs running together are the
      # query tiles of a few heads and share their K/V blocks in L2.
      grid=(bsz, n, nq),
      grid_names=("batch", "head", "q"),
      num_threads=_CONSUMERS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=pallas_mosaic.interpret_params(),
      kernel_name="tokamax_attention_fwd_mosaic",
  )
  out, lse = kernel(q, k, v, *lengths)
  out = out[:, :t, :, :hv]
  if return_residuals:
    lse = lse[:, :, :t]
  return out, lse


# --- configs -----------------------------------------------------------------


def _shape(ba):
  q, k, v = ba.arguments["query"], ba.arguments["key"], ba.arguments["value"]
  return (q.shape[1], k.shape[1], _round_up(q.shape[3], 64),
          _round_up(v.shape[3], 64), jnp.dtype(q.dtype).itemsize)


def _fits(c: MosaicAttentionConfig, hp: int, hvp: int, itemsize: int) -> bool:
  return smem_bytes(c, hp, hvp, itemsize) <= pallas_mosaic.SMEM_BYTES


def heuristic_config(t: int, s: int, hp: int, hvp: int,
                     itemsize: int) -> MosaicAttentionConfig:
  """The fastest H200 configs (docs/benchmarks.md): 64 rows per consumer,
  128-key steps and a 2-deep ring where shared memory allows."""
  del t, s
  for bk in (128, 64):
    c = MosaicAttentionConfig(block_q=64, block_kv=bk, num_stages=2)
    if _fits(c, hp, hvp, itemsize):
      return c
  return MosaicAttentionConfig(block_q=64, block_kv=64, num_stages=1)


def search_space(t: int, s: int, hp: int, hvp: int,
                 itemsize: int) -> set[MosaicAttentionConfig]:
  del t, s
  configs = set()
  for bq, bk, stages in itertools.product((64, 128), (64, 128, 256), (2, 3, 4)):
    c = MosaicAttentionConfig(block_q=bq, block_kv=bk, num_stages=stages)
    # f32 values per consumer thread: S block plus the O accumulator.
    if bq * (bk + hvp) // 128 > 192 or not _fits(c, hp, hvp, itemsize):
      continue
    configs.add(c)
  return configs


# --- ops ---------------------------------------------------------------------


def check_supported(op: op_lib.Op, ba: op_lib.BoundArguments) -> None:
  pallas_mosaic.check_platform(op)
  pallas_triton.check_not_explicitly_sharded(op, ba)
  args = ba.arguments
  pallas_mosaic.check_dtype(op, "query", args["query"].dtype)
  for name in ("bias", "mask"):
    if args[name] is not None:
      raise op.unsupported(
          f"{name} is not implemented in the mosaic kernel yet (issue #5);"
          " 'cudnn' and 'triton' support it."
      )
  h, hv = args["query"].shape[3], args["value"].shape[3]
  if max(h, hv) > MAX_HEAD_DIM:
    raise op.unsupported(
        f"head dims up to {MAX_HEAD_DIM} (wgmma tile widths); got H={h}, Hv={hv}."
    )
  if not _fits(heuristic_config(*_shape(ba)), *_shape(ba)[2:]):
    raise op.unsupported("the head dims do not fit in shared memory.")


@dataclasses.dataclass(frozen=True)
class MosaicDotProductAttention(base.DotProductAttention):
  """FlashAttention-3 forward in Pallas:Mosaic GPU (Hopper).

  Its VJP is the "triton" FlashAttention-2 backward, fed by the same lse
  residual (no Mosaic backward yet).
  """

  implementation = "mosaic"
  config_cls = MosaicAttentionConfig
  vjp: op_lib.Op | None = dataclasses.field(
      default_factory=triton.TritonDotProductAttentionVjp
  )

  def supported_on(self, device) -> bool:
    return pallas_mosaic.supported_on(device)

  def check_supported(self, ba):
    check_supported(self, ba)

  def _get_heuristics_config(self, ba):
    return heuristic_config(*_shape(ba))

  def _get_autotuning_configs(self, ba):
    return search_space(*_shape(ba))

  def _fwd(self, *, config, return_residuals, **args):
    if not _fits(config, *_shape_of_args(args)):
      raise self.unsupported(f"config {config} exceeds shared memory.")
    out, lse = attention_forward(args, config, return_residuals)
    return out, ({"lse": lse} if return_residuals else None)


def _shape_of_args(args):
  q, v = args["query"], args["value"]
  return _round_up(q.shape[3], 64), _round_up(v.shape[3], 64), jnp.dtype(q.dtype).itemsize
