"""Helpers shared by the Pallas:Mosaic GPU kernels (`ops/*/mosaic.py`).

Interpret mode: `INTERPRET` runs every tokamax Mosaic GPU kernel in the Mosaic
GPU interpreter (`plgpu.InterpretGPUParams`: shared memory, barriers, TMA and
warpgroup threads simulated on the CPU; uninitialised memory reads as NaN) and
skips the platform check. Part of JAX's jit key. Thread-local inside
`interpret_mode()`; process-wide with TOKAMAX_MOSAIC_INTERPRET=1 or
jax.config.update("tokamax_mosaic_interpret", True).
The interpreter can hang (warpgroups blocked in barrier waits) in a process
with a single CPU device; give it several, e.g.
XLA_FLAGS=--xla_force_host_platform_device_count=8 (as the tests do).

Tracing: inside `trace_kernels(directory)` the kernels are compiled with
Mosaic GPU's in-kernel profiler: every warpgroup records the begin and end of
the `jax.named_scope` regions of the kernel code (clock reads, a few cycles
each), and each call writes a Perfetto JSON trace into `directory`
(`benchmarks/trace_mosaic.py` summarises them). GPU only; part of the jit key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax.numpy as jnp
from jax._src import config as jax_config
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax._src import op as op_lib
from tokamax._src import platform

INTERPRET = jax_config.bool_state(
    "tokamax_mosaic_interpret",
    default=False,
    help="Run tokamax's Pallas:Mosaic GPU kernels in the GPU interpreter (tests).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)

TRACE_DIR = jax_config.string_or_object_state(
    "tokamax_mosaic_trace_dir",
    default="",
    help="Folder for in-kernel traces of tokamax's Mosaic GPU kernels ('' = off).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)
# Regions each warpgroup may record while tracing (later ones are dropped);
# the buffer lives in shared memory, 16 bytes per region and warpgroup.
TRACE_RANGES = 320

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Shared memory per block (opt-in) on sm90; what Mosaic GPU checks against.
SMEM_BYTES = 227 * 1024


@contextlib.contextmanager
def interpret_mode(enabled: bool = True) -> Iterator[None]:
  """Runs tokamax's Mosaic GPU kernels in the GPU interpreter inside."""
  with INTERPRET(enabled):
    yield


@contextlib.contextmanager
def trace_kernels(directory: str) -> Iterator[None]:
  """Compiles tokamax's Mosaic GPU kernels with the in-kernel profiler inside:
  each call writes a Perfetto JSON trace of its warpgroups' named regions to
  `directory`."""
  with TRACE_DIR(str(directory)):
    yield


def compiler_params(**kwargs) -> plgpu.CompilerParams:
  """plgpu.CompilerParams(**kwargs), with the profiler when tracing (GPU)."""
  if TRACE_DIR.value and not INTERPRET.value:
    kwargs.update(profile_space=TRACE_RANGES, profile_dir=TRACE_DIR.value,
                  profile_bounds_check=True)
  return plgpu.CompilerParams(**kwargs)


def interpret_params():
  """`interpret=` for plgpu.kernel: interpreter parameters or None."""
  if not INTERPRET.value:
    return None
  return plgpu.InterpretGPUParams(out_of_bounds_reads="raise")


def supported_on(device) -> bool:
  """NVIDIA sm_90 (Hopper), a `platform.Target` or an attached jax device."""
  if isinstance(device, platform.Target):
    return device.is_nvidia_gpu and device.compute_capability == (9, 0)
  if device.platform != "gpu":
    return False
  cc = getattr(device, "compute_capability", None)
  return cc is None or str(cc).startswith("9.0")


def check_platform(op: op_lib.Op) -> None:
  """Raises op.unsupported(...) unless the target is Hopper (or interpret)."""
  if INTERPRET.value:
    return
  target = platform.current_target()
  if not supported_on(target):
    raise op.unsupported(
        "requires an NVIDIA GPU of the Hopper generation (sm_90: wgmma, TMA),"
        f" but the target is {target.describe()}."
    )


def check_dtype(op: op_lib.Op, name: str, dtype) -> None:
  dtype = jnp.dtype(dtype)
  if dtype not in SUPPORTED_DTYPES:
    raise op.unsupported(
        f"{name} must be bf16 or f16 for the mosaic kernels (16-bit wgmma and TMA tiles),"
        f" got {dtype.name}."
    )
