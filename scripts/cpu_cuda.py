"""Compiling GPU kernels for an H200 on a CPU-only machine (scripts only).

Two routes, both through jax's CUDA PJRT plugin of this jax version
(`jax-cuda13-pjrt`, ~130 MB, downloaded by pip without dependencies into
TOOLCHAIN, default ~/.cache/tokamax_cpu_cuda):
- `mosaic_compiler()`: the plugin's MosaicGpuCompile, which compiles one
  Mosaic GPU module (Mosaic passes, LLVM NVPTX, ptxas) and then fails to load
  it (scripts/ptxas_report.py);
- `h200_sharding()`: XLA's deviceless compilation. A PJRT topology made from
  a GPU target config gives compile-only "NVIDIA H200" devices; `jax.jit`
  with inputs placed there compiles the whole program, Pallas:Triton
  kernels included, with XLA's own Triton pipeline
  (scripts/triton_ptxas_report.py). Mosaic GPU calls are compiled only when
  first run, so not by this route.
Both need ptxas and libdevice (CUDA_ROOT, default /usr/local/cuda) and a C
compiler: the plugin asks the driver for the device and its compute
capability, so a four-function stand-in for libcuda.so.1 (device 0, sm_90)
is built and loaded first. docs/notes_mosaic_gpu_api.md §14.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import subprocess
import sys

# What the plugin asks the driver before it compiles (attributes 75/76:
# CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR/MINOR) and on errors.
_DRIVER_STUB = r"""
typedef int CUresult;
CUresult cuCtxGetDevice(int* d) { *d = 0; return 0; }
CUresult cuDeviceGetAttribute(int* v, int attrib, int dev) {
  *v = attrib == 75 ? 9 : 0;
  return 0;
}
CUresult cuGetErrorString(int e, const char** s) { *s = "no GPU (stub driver)"; return 0; }
CUresult cuGetErrorName(int e, const char** s) { *s = "CUDA_ERROR_NO_DEVICE"; return 0; }
"""

# stream_executor.GpuTargetConfigProto of an H200 SXM (public specs: 132 SMs,
# 228 KiB shared memory per SM, 227 KiB per block opt-in, 50 MiB L2, 4.8 TB/s).
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150323855360
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200"
"""

CUDA_ROOT = os.environ.get("CUDA_ROOT", "/usr/local/cuda")


def plugin_path() -> pathlib.Path:
  """The CUDA PJRT plugin of this jax version, with the driver stand-in loaded."""
  import jax  # noqa: PLC0415 (callers set environment variables first)

  root = pathlib.Path(os.environ.get("TOOLCHAIN", "~/.cache/tokamax_cpu_cuda")).expanduser()
  root.mkdir(parents=True, exist_ok=True)
  plugin = root / "jax_plugins" / "xla_cuda13" / "xla_cuda_plugin.so"
  if not plugin.exists():
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(root),
                    f"jax-cuda13-pjrt=={jax.__version__}"], check=True)
    [wheel] = root.glob("jax_cuda13_pjrt-*.whl")
    subprocess.run([sys.executable, "-m", "zipfile", "-e", str(wheel), str(root)], check=True)
  stub = root / "libcuda.so.1"
  if not stub.exists():
    (root / "cuda_stub.c").write_text(_DRIVER_STUB)
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub),
                    str(root / "cuda_stub.c")], check=True)
  # Loaded first under its soname, it is what the plugin's dlopen finds.
  ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)
  return plugin


def mosaic_compiler():
  """MosaicGpuCompile(module_bytes, length) of the plugin."""
  os.environ.setdefault("MOSAIC_GPU_CUDA_ROOT", CUDA_ROOT)
  fn = ctypes.CDLL(str(plugin_path())).MosaicGpuCompile
  fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
  fn.restype = ctypes.c_void_p
  return fn


def h200_sharding():
  """A sharding on one compile-only H200 (run with JAX_PLATFORMS=cpu so that
  jax does not try to start a CUDA client)."""
  import jax  # noqa: PLC0415
  from jax._src import xla_bridge  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415

  xla_bridge.register_plugin("cuda", library_path=str(plugin_path()))
  topology = topologies.get_topology_desc("", "cuda", topology="1x1x1",
                                          target_config=H200_TARGET_CONFIG)
  mesh = topologies.make_mesh(topology, (1,), ("x",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
