"""Helpers shared by the Pallas:Triton kernels (`ops/*/triton.py`).

Interpret mode: `INTERPRET` runs every tokamax Triton kernel with
`interpret=True` (any backend) and skips the platform check. It is part of
JAX's jit key, so jitted functions retrace when it changes. Thread-local inside
`interpret_mode()`; set it process-wide (e.g. for autotuning, which benchmarks
in worker threads) with TOKAMAX_TRITON_INTERPRET=1 or
jax.config.update("tokamax_triton_interpret", True).
"""

from __future__ import annotations

import contextlib
import functools
import re
import struct
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering as triton_lowering
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from tokamax._src import op as op_lib
from tokamax._src import platform

INTERPRET = jax_config.bool_state(
    "tokamax_triton_interpret",
    default=False,
    help="Run tokamax's Pallas:Triton kernels in interpret mode (tests).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)

_DEFAULT_SMS = 132  # H200; used when the device does not say.
SUPPORTED_DTYPES = (
    jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
)


@contextlib.contextmanager
def interpret_mode(enabled: bool = True) -> Iterator[None]:
  """Runs tokamax's Triton kernels in interpret mode inside."""
  with INTERPRET(enabled):
    yield


def is_pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def prev_pow2(n: int) -> int:
  return 1 << (max(1, n).bit_length() - 1)


def i32(v):
  """An int32 scalar (slice starts must share one dtype, also under x64)."""
  return jnp.asarray(v, jnp.int32)


def exp2_fma(x, scale: float, shift):
  """2 ** (x * scale - shift) for f32 x [..., n]; shift broadcasts to x.

  Inside a Triton kernel on the GPU this is one FFMA and one MUFU.EX2 per
  element (PTX fma.rn.ftz + ex2.approx.ftz). jnp.exp2 lowers to
  ex2.approx.f32 without ftz, which ptxas wraps in a range test and two
  multiplies, and x * scale - shift stays an FMUL and an FADD: six
  instructions instead of two per logit, in kernels whose softmax is
  issue-bound (H200 profile, docs/benchmarks.md). Results below 2**-126
  flush to zero. Interpret mode: plain jnp.
  """
  neg = jnp.broadcast_to(-jnp.asarray(shift, jnp.float32), x.shape)
  if INTERPRET.value:
    return jnp.exp2(x * scale + neg)
  bits = struct.unpack("<I", struct.pack("<f", scale))[0]
  asm = ("{ .reg .f32 t; fma.rn.ftz.f32 t, $1, 0f%08X, $2; "
         "ex2.approx.ftz.f32 $0, t; }" % bits)
  [y] = pltr.elementwise_inline_asm(
      asm, args=[x, neg], constraints="=f,f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return y


def num_sms() -> int:
  """SMs of the (abstract or attached) GPU, else the H200's."""
  dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  n = getattr(dev, "num_cores", None)
  if not n:
    d = jax.devices()[0]
    n = getattr(d, "core_count", None) if d.platform == "gpu" else None
  return int(n) if n else _DEFAULT_SMS


def supported_on(device) -> bool:
  """NVIDIA sm_80+ (a `platform.Target` or an attached jax device)."""
  if isinstance(device, platform.Target):
    return device.is_nvidia_gpu and device.compute_capability >= (8, 0)
  return device.platform == "gpu"


def check_platform(op: op_lib.Op) -> None:
  """Raises op.unsupported(...) unless the target runs Triton (or interpret)."""
  if INTERPRET.value:
    return
  target = platform.current_target()
  if not supported_on(target):
    raise op.unsupported(
        "requires an NVIDIA GPU (sm_80 or newer), but the target is"
        f" {target.describe()}."
    )


def check_not_explicitly_sharded(op: op_lib.Op, ba: op_lib.BoundArguments) -> None:
  """Refuses arrays sharded over Explicit mesh axes (outside shard_map).

  A Triton kernel is one custom call over whole arrays; XLA cannot split it,
  and explicit sharding forbids the implicit gathers. Inside jax.shard_map
  the kernel sees per-shard arrays and runs.
  """
  for name, a in ba.arrays.items():
    for leaf in jax.tree.leaves(a):
      sharding = getattr(jax.typeof(leaf), "sharding", None)
      spec = getattr(sharding, "spec", None)
      if spec is not None and any(axis is not None for axis in spec):
        raise op.unsupported(
            f"{name} is sharded over explicit mesh axes ({spec}); call the"
            " kernel inside jax.shard_map (it then sees one shard) or use"
            " implementation='xla'."
        )


def check_dtype(op: op_lib.Op, name: str, dtype) -> None:
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float64:
    raise op.unsupported("fp64 is not supported by the triton kernels.")
  if dtype not in SUPPORTED_DTYPES:
    raise op.unsupported(
        f"{name} must be bf16, f16 or f32 for the triton kernels, got"
        f" {dtype.name}."
    )


# Kernel names ending in this tag and a number n get Triton's loop attribute
# `tt.num_stages = n` on every loop (`pallas_call(loop_stages=n)`).
_LOOP_STAGES_TAG = "_loop_stages"


def _loop_stages(name: str) -> int | None:
  m = re.search(_LOOP_STAGES_TAG + r"(\d+)$", name)
  return int(m.group(1)) if m else None


def _set_loop_stages(module: ir.Module, stages: int) -> None:
  """Sets `tt.num_stages` on every scf.for of a Triton module.

  With the attribute on a loop, Triton's software pipeliner also pipelines
  loads that feed no dot: it copies them into a shared-memory ring
  (cp.async) stages - 1 trips ahead, without holding them in registers.
  Without it only loads that feed a tt.dot are pipelined (CompilerParams'
  num_stages sets their depth). The attribute changes the schedule, never
  the result.
  """
  with module.context:
    attr = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), stages)

    def walk(op):
      for region in op.regions:
        for block in region.blocks:
          for child in block.operations:
            if child.operation.name == "scf.for":
              child.operation.attributes["tt.num_stages"] = attr
            walk(child.operation)

    walk(module.operation)


def _lower_with_loop_stages(lower):
  """Wraps Pallas:Triton's lower_jaxpr_to_triton_module: kernels named
  `..._loop_stagesN` get `tt.num_stages = N` on their loops. Pallas exposes
  no per-loop attributes, so the kernel name carries the request (it is
  part of the jaxpr, hence of every cache and export)."""
  if getattr(lower, "_tokamax_loop_stages", False):
    return lower

  @functools.wraps(lower)
  def wrapped(jaxpr, *args, **kwargs):
    result = lower(jaxpr, *args, **kwargs)
    stages = _loop_stages(jaxpr.debug_info.func_name)
    if stages is not None:
      _set_loop_stages(result.module, stages)
    return result

  wrapped._tokamax_loop_stages = True
  return wrapped


triton_lowering.lower_jaxpr_to_triton_module = _lower_with_loop_stages(
    triton_lowering.lower_jaxpr_to_triton_module)


def pallas_call(kernel, *, out_shape, grid, num_warps, num_stages=None, name,
                input_output_aliases=None, loop_stages: int | None = None):
  """pl.pallas_call on whole arrays (kernels index refs themselves).

  loop_stages: if set, Triton pipelines every load inside the kernel's loops
  through shared memory that many stages deep (`_set_loop_stages`).

  Returns f(*inputs) -> list of outputs. Inside `jax.shard_map` (with its
  varying-axes check) the inputs are made to vary over the union of their
  mesh axes and the outputs are declared to vary over the same axes: a
  kernel's outputs depend on all of its inputs.
  """
  call = functools.partial(
      pl.pallas_call,
      kernel,
      grid=grid,
      compiler_params=pltr.CompilerParams(
          num_warps=num_warps, num_stages=num_stages
      ),
      interpret=INTERPRET.value,
      name=name if not loop_stages else f"{name}{_LOOP_STAGES_TAG}{loop_stages}",
      input_output_aliases=input_output_aliases or {},
  )

  def run(*inputs):
    shapes = list(out_shape)
    if jax_config._check_vma.value:
      union = frozenset().union(*(op_lib.varying(a) for a in inputs))
      inputs = [op_lib.vary_over(a, union) for a in inputs]
      mat = jax.sharding.ManualAxisType(varying=union)
      shapes = [
          jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat)
          for s in shapes
      ]
    return list(call(out_shape=shapes)(*inputs))

  return run
