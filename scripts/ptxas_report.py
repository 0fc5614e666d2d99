"""Compiles the "mosaic" attention forward (and, with VJP set, its gradient)
with Mosaic GPU's ptxas report switched on: registers, spills and warnings
such as C7513 (wgmma instructions serialised). Usage:
  [VJP=BLOCK_KV.BLOCK_Q.STAGES.DQ_BLOCK_Q.DQ_BLOCK_KV.DQ_STAGES] \
      python scripts/ptxas_report.py [B T N H [BLOCK_Q BLOCK_KV STAGES [CONSUMERS]]]
SET="NAME=VALUE,..." sets module constants of the mosaic attention module first
(e.g. SET=_PRODUCER_REGS=24).

On the GPU machine it compiles as a jitted call does. On a CPU-only machine
it lowers for an H200 (cross-compile) and hands each Mosaic GPU module to
MosaicGpuCompile of jax's CUDA PJRT plugin, the entry point XLA's custom
call uses: Mosaic GPU's passes, LLVM's NVPTX backend and ptxas run for
sm_90a, and only loading the cubin then fails (no GPU). What that needs
(plugin download, ptxas, a driver stand-in) is in scripts/cpu_cuda.py.
The reports and the PTX go to DUMP (default a temporary folder, printed);
with nvdisasm on PATH (pip `nvidia-cuda-nvdisasm`), SASS=1 also writes each
kernel's SASS there (ptxas then nvdisasm on the dumped PTX).
"""

import glob
import os
import pathlib
import subprocess
import sys
import tempfile

DUMP = os.environ.setdefault("MOSAIC_GPU_DUMP_TO", os.environ.get("DUMP") or tempfile.mkdtemp())
os.makedirs(DUMP, exist_ok=True)  # (without it the dumps go to stdout)
os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")
os.environ.setdefault("MOSAIC_GPU_DUMP_PTX", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.mosaic.gpu import core as mgpu_core  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402 (benchmarks/common.py)
import cpu_cuda  # noqa: E402 (scripts/cpu_cuda.py)
import tokamax  # noqa: E402
from tokamax.ops.attention import mosaic as mo  # noqa: E402

_SEEN = set()  # ptxas reports already printed


def _compile(f, q, cpu_compile):
  """Compiles f(q) (GPU) or its Mosaic GPU kernels (CPU), then prints the
  new ptxas reports."""
  if cpu_compile is None:
    jax.jit(f).lower(q).compile()
  else:
    mgpu_core.KNOWN_KERNELS.clear()
    with tokamax.config.cross_compile("NVIDIA H200"):
      jax.jit(f).trace(q).lower(lowering_platforms=("cuda",))
    for asm in mgpu_core.KNOWN_KERNELS.values():
      cpu_compile(asm, len(asm))  # the cubin cannot load here: reports only
  for log in glob.glob(os.path.join(DUMP, "*.mlir-passes.log")):
    os.remove(log)  # ~150 MB per kernel, every pass's IR
  for path in sorted(set(glob.glob(os.path.join(DUMP, "*.ptxas"))) - _SEEN):
    _SEEN.add(path)
    print(f"--- {os.path.basename(path)}\n{pathlib.Path(path).read_text()}", flush=True)
    if os.environ.get("SASS"):
      ptx = path[:-len(".ptxas")] + ".ptx"
      cubin = path[:-len(".ptxas")] + ".cubin"
      ptxas = os.path.join(cpu_cuda.CUDA_ROOT, "bin", "ptxas")
      subprocess.run([ptxas, "-arch=sm_90a", ptx, "-o", cubin], check=True)
      with open(path[:-len(".ptxas")] + ".sass", "w") as out:
        subprocess.run(["nvdisasm", "-c", cubin], stdout=out, check=True)


def main():
  common.set_constants(mo, os.environ.get("SET", ""))
  b, t, n, h = map(int, sys.argv[1:5]) if len(sys.argv) > 4 else (1, 1024, 2, 64)
  config = None
  if len(sys.argv) > 7:
    bq, bk, stages = map(int, sys.argv[5:8])
    consumers = int(sys.argv[8]) if len(sys.argv) > 8 else 2
    config = mo.MosaicAttentionConfig(block_q=bq, block_kv=bk, num_stages=stages,
                                      consumers=consumers)
  extra = {}
  if os.environ.get("VJP"):  # also compile the gradient with this backward config
    vjp_config = mo.MosaicAttentionVjpConfig(*map(int, os.environ["VJP"].split(".")))
    extra["vjp"] = mo.MosaicDotProductAttentionVjp(config=vjp_config)
  cpu_compile = None if jax.default_backend() == "gpu" else cpu_cuda.mosaic_compiler()
  print(f"dumps in {DUMP}", flush=True)
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  for causal in (False, True):
    print(f"===== B{b} T{t} N{n} H{h} causal={causal} {config} {extra} =====", flush=True)
    op = mo.MosaicDotProductAttention(config=config, **extra)
    f = lambda q: op(q, q, q, is_causal=causal)
    if extra:
      f = jax.grad(lambda q: jnp.sum(op(q, q, q, is_causal=causal).astype(jnp.float32)))
    _compile(f, q, cpu_compile)


if __name__ == "__main__":
  main()
