"""Registers and spills of the "triton" kernels as XLA compiles them for an
H200: ptxas -v of every kernel of one jitted call. Usage:
  python scripts/triton_ptxas_report.py attention B T N H [BLOCK_Q BLOCK_K WARPS STAGES [ROW_PARTS]]
  python scripts/triton_ptxas_report.py layer_norm R F
CAUSAL=1 for causal attention; VJP=1 compiles the gradient too (heuristic
backward configs); SET="NAME=VALUE,..." sets constants of the op's triton
module first (e.g. SET=HEAVY_FIRST_BAND=8); KEEP=DIR keeps each ptxas call's PTX and cubin there (and
its SASS, with nvdisasm on PATH: pip `nvidia-cuda-nvdisasm`).

XLA is made to run ptxas as a program (not its in-process compiler) from a
folder whose `bin/ptxas` is a wrapper that logs ptxas's report. On the GPU
machine XLA compiles for the local GPU; on a CPU-only machine it compiles
for a compile-only H200 (XLA's deviceless compilation, scripts/cpu_cuda.py),
with the same Triton pipeline.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ON_GPU = shutil.which("nvidia-smi") is not None
if not ON_GPU:
  os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin only compiles here

import cpu_cuda  # noqa: E402 (scripts/cpu_cuda.py)

_WRAPPER = """#!/bin/bash
# ptxas for XLA: runs the real one (stdout and stderr kept apart: XLA reads
# the version from stdout), appends its report to $PTXAS_LOG and keeps the
# PTX and cubin in $KEEP (if set).
t=$(mktemp)
"{ptxas}" "$@" >"$t.out" 2>"$t.err"; rc=$?
cat "$t.out" "$t.err" >> "$PTXAS_LOG"; cat "$t.out"; cat "$t.err" >&2
rm -f "$t" "$t.out" "$t.err"
if [[ -n "$KEEP" ]]; then
  n=$(date +%s%N); prev=""
  for a in "$@"; do
    [[ "$prev" != "-o" && "$a" != -* && -f "$a" ]] && cp "$a" "$KEEP/$n.ptx"
    [[ "$prev" == "-o" && -f "$a" ]] && cp "$a" "$KEEP/$n.cubin"
    prev="$a"
  done
fi
exit $rc
"""


def _ptxas_root() -> str:
  """A CUDA folder like CUDA_ROOT whose bin/ptxas is the logging wrapper."""
  root = pathlib.Path(tempfile.mkdtemp())
  (root / "bin").mkdir()
  for entry in pathlib.Path(cpu_cuda.CUDA_ROOT).iterdir():
    if entry.name != "bin":
      (root / entry.name).symlink_to(entry)
  for tool in pathlib.Path(cpu_cuda.CUDA_ROOT, "bin").iterdir():
    if tool.name != "ptxas":
      (root / "bin" / tool.name).symlink_to(tool)
  wrapper = root / "bin" / "ptxas"
  wrapper.write_text(_WRAPPER.format(ptxas=os.path.join(cpu_cuda.CUDA_ROOT, "bin", "ptxas")))
  wrapper.chmod(0o755)
  return str(root)


os.environ["PTXAS_LOG"] = tempfile.mktemp(suffix=".log")
_ROOT = _ptxas_root()
os.environ["PATH"] = f"{_ROOT}/bin:{os.environ['PATH']}"  # XLA also looks there
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), "--xla_gpu_enable_libnvptxcompiler=false",
    "--xla_gpu_ptx_compiler_extra_flags=-v", f"--xla_gpu_cuda_data_dir={_ROOT}"])
if os.environ.get("KEEP"):
  os.makedirs(os.environ["KEEP"], exist_ok=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402 (benchmarks/common.py)
import tokamax  # noqa: E402
from tokamax.ops.attention import triton as triton_attn  # noqa: E402
from tokamax.ops.normalization import triton as triton_ln  # noqa: E402


def _call(argv):
  """(f, arg shapes) of the requested call."""
  if argv[0] == "layer_norm":
    r, f = map(int, argv[1:3])
    shapes = [((r, f), jnp.bfloat16), ((f,), jnp.float32), ((f,), jnp.float32)]
    return (lambda x, s, o: tokamax.layer_norm(x, s, o, implementation="triton")), shapes
  b, t, n, h = map(int, argv[1:5])
  causal = bool(os.environ.get("CAUSAL"))
  if len(argv) > 5:
    bq, bk, warps, stages, parts = map(int, (argv[5:10] + ["1"])[:5])
    config = triton_attn.TritonAttentionConfig(block_q=bq, block_k=bk, num_warps=warps,
                                               num_stages=stages, row_parts=parts)
    op = triton_attn.TritonDotProductAttention(config=config)
    return (lambda q: op(q, q, q, is_causal=causal)), [((b, t, n, h), jnp.bfloat16)]
  return (lambda q: tokamax.dot_product_attention(
      q, q, q, is_causal=causal, implementation="triton")), [((b, t, n, h), jnp.bfloat16)]


def main():
  module = triton_ln if sys.argv[1] == "layer_norm" else triton_attn
  common.set_constants(module, os.environ.get("SET", ""))
  f, shapes = _call(sys.argv[1:])
  if os.environ.get("VJP"):
    fwd = f
    f = jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)))
  sharding = None if ON_GPU else cpu_cuda.h200_sharding()
  args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
  with tokamax.config.cross_compile("NVIDIA H200"):
    jax.jit(f).trace(*args).lower().compile()
  log = pathlib.Path(os.environ["PTXAS_LOG"])
  banner = ("ptxas: NVIDIA", "Copyright", "Built on", "Cuda compilation", "Build cuda")
  lines = log.read_text().splitlines() if log.exists() else []
  print("\n".join(l for l in lines if l and not l.startswith(banner)) or "no ptxas call")
  if os.environ.get("KEEP") and shutil.which("nvdisasm"):
    for cubin in pathlib.Path(os.environ["KEEP"]).glob("*.cubin"):
      with open(cubin.with_suffix(".sass"), "w") as out:
        subprocess.run(["nvdisasm", "-c", str(cubin)], stdout=out, check=True)


if __name__ == "__main__":
  main()
