"""Ours against upstream Tokamax (the PyPI `tokamax` package), out of the box.

Usage:
  python benchmarks/upstream.py run OUT_DIR LABEL [GROUPS] [small]  # times the `tokamax` that imports
  python benchmarks/upstream.py compare OUT_DIR    # table from the two runs' JSON

Both libraries are called `tokamax`, so each is timed in its own process with
its own sys.path (`bash scripts/gpu_check.sh upstream`), writing
OUT_DIR/upstream_LABEL.json. Every process also times cuDNN (jax.nn, before
and after the library's implementations: their mean is the reference) and
XLA, so each library is read against peers from its own process, and the
two processes' absolute times can be checked against each other through the
peers. GROUPS (comma-separated, default "attention,layer_norm"; "autotuned"
adds "mosaic" attention after `tokamax.autotune` of forward+backward at
AUTOTUNE_SHAPES, timed under the result). Other calls use each library's
defaults (its shipped or heuristic configs, no autotuning), bf16 random inputs,
accelerator time (cupti), median of ITERATIONS. Before timing, each output
is compared with an f32 XLA reference (jax.nn attention, a jnp layer norm): the largest
absolute difference over the largest |reference| is recorded as `err`.
The timer is ours (tokamax/_src/benchmarking.py, loaded by path: it imports
only jax and numpy), so both libraries are timed by the same code.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

import common

ITERATIONS = 20
ATTENTION_SHAPES = {  # label: ((B, T, N, K, H), causal flags)
    "seed B32 T2048 N16 H64": ((32, 2048, 16, 16, 64), (False, True)),
    "B8 T4096 N16 H128": ((8, 4096, 16, 16, 128), (False, True)),
    "GQA B4 T4096 N32 K8 H128": ((4, 4096, 32, 8, 128), (True,)),
}
AUTOTUNE_SHAPES = ["seed B32 T2048 N16 H64", "B8 T4096 N16 H128"]
LAYER_NORM_SHAPES = {"8192x8192": (8192, 8192), "65536x1024": (65536, 1024)}
MODES = ("forward", "forward_and_vjp")


def _timer():
  path = pathlib.Path(__file__).resolve().parent.parent / "tokamax/_src/benchmarking.py"
  spec = importlib.util.spec_from_file_location("timer", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules["timer"] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def _rel_err(out, ref):
  out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
  return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))


def _layer_norm_ref(x, scale, offset):
  x = x.astype(jnp.float32)
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale + offset


def _cases(tokamax):
  """(group, shape label, flags, arg specs, FLOPs or bytes per mode, reference,
  [(name, fn)]) for every benchmark case."""
  impls = ["mosaic", "triton", None]
  for label, (shape, causals) in ATTENTION_SHAPES.items():
    b, t, n, kh, h = shape
    specs = (jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16),
             jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16),
             jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16))
    for causal in causals:
      cudnn = lambda q, k, v, c=causal: jax.nn.dot_product_attention(
          q, k, v, is_causal=c, implementation="cudnn")
      fns = [("jax.nn cudnn", cudnn)]
      fns += [(f"tokamax {i}", lambda q, k, v, i=i, c=causal:
               tokamax.dot_product_attention(q, k, v, is_causal=c, implementation=i))
              for i in impls]
      fns += [("jax.nn cudnn (again)", cudnn)]
      if not causal and h == 64:
        fns.append(("jax.nn xla", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="xla")))
      work = {m: common.attention_flops(shape, causal, m) for m in MODES}
      ref = lambda q, k, v, c=causal: jax.nn.dot_product_attention(
          *(x.astype(jnp.float32) for x in (q, k, v)), is_causal=c, implementation="xla")
      yield "attention", label, dict(causal=causal), specs, work, ref, fns
      if label in AUTOTUNE_SHAPES and not causal:
        tuned = ("tokamax mosaic (autotuned)", lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, implementation="mosaic"))
        yield ("autotuned", label, dict(causal=causal), specs, work, ref,
               [fns[0], tuned, fns[-2 if fns[-1][0] == "jax.nn xla" else -1]])
  for label, (rows, cols) in LAYER_NORM_SHAPES.items():
    specs = (jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16),
             jax.ShapeDtypeStruct((cols,), jnp.bfloat16),
             jax.ShapeDtypeStruct((cols,), jnp.bfloat16))
    fns = [(f"tokamax {i}", lambda x, s, o, i=i: tokamax.layer_norm(x, s, o, implementation=i))
           for i in ("triton", "mosaic", None, "xla")]
    fns.append(("jnp x + 1 (copy)", lambda x, s, o: x + 1))
    # Bytes: x read + y written forward; x, dy read and dx written backward.
    size = rows * cols * 2
    work = {"forward": 2 * size, "forward_and_vjp": 5 * size}
    yield "layer_norm", label, {}, specs, work, _layer_norm_ref, fns


def _autotune(tokamax, fn, args, row):
  """tokamax.autotune of fn's forward+backward on args; the seconds it took
  go to row["tune_s"]."""
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32))
  grad = jax.grad(loss, argnums=tuple(range(len(args))))
  start = time.perf_counter()
  result = tokamax.autotune(grad, *args)
  row["tune_s"] = time.perf_counter() - start
  return result


def run(out_dir, label, groups="attention,layer_norm", small=""):
  """`small`: tiny shapes (a CPU smoke run of the script itself)."""
  import tokamax  # whichever the process's sys.path finds first

  if small:
    ATTENTION_SHAPES.clear()
    ATTENTION_SHAPES["tiny H64"] = ((1, 128, 2, 2, 64), (False, True))
    ATTENTION_SHAPES["tiny GQA"] = ((1, 128, 4, 2, 64), (True,))
    LAYER_NORM_SHAPES.clear()
    LAYER_NORM_SHAPES["256x384"] = (256, 384)
    AUTOTUNE_SHAPES[:] = ["tiny H64"]

  timer = _timer()
  rows = []
  for group, shape, flags, specs, work, ref_fn, fns in _cases(tokamax):
    if group not in groups.split(","):
      continue
    args = [timer._random_array(jax.random.key(i), s) for i, s in enumerate(specs)]
    ref = jax.jit(ref_fn)(*args)
    results = {}  # autotuning results, one per implementation
    for mode in MODES:
      for name, fn in fns:
        row = dict(group=group, shape=shape, mode=mode, impl=name, **flags)
        try:
          if name.endswith("(autotuned)") and name not in results:
            results[name] = _autotune(tokamax, fn, args, row)
          context = results.get(name, contextlib.nullcontext())
          with context:
            if mode == "forward" and "copy" not in name:
              row["err"] = _rel_err(jax.jit(fn)(*args), ref)
            f_std, flat = timer.standardize_function(fn, *specs, mode=mode)
            data = timer.benchmark(f_std, flat, iterations=ITERATIONS)
          row["ms"] = data.median_evaluation_time_ms
          row["rate"] = work[mode] / row["ms"] / 1e9  # TFLOP/s or TB/s
        except Exception as e:  # recorded: an implementation may refuse
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        # Saved after every row: a run cut by a time limit keeps what it timed.
        common.save(out_dir, f"upstream_{label}", rows, iterations=ITERATIONS,
                    library=tokamax.__file__)
  matmul_shape = (1, 2, 128, 64) if small else (8, 16, 4096, 128)
  matmul = common.qk_matmul(*matmul_shape)
  f_std, flat = timer.standardize_function(matmul[0], *matmul[1])
  data = timer.benchmark(f_std, flat, iterations=ITERATIONS)
  rows.append(dict(group="matmul", shape=f"q.k^T of B, N, T, H = {matmul_shape}", mode="forward",
                   impl="jnp.einsum", ms=data.median_evaluation_time_ms,
                   rate=matmul[2] / data.median_evaluation_time_ms / 1e9))
  print(json.dumps(rows[-1]))
  common.save(out_dir, f"upstream_{label}", rows, iterations=ITERATIONS,
              library=tokamax.__file__)


def _peer(rows, r):
  """The same-process reference: mean of the two cuDNN runs, or XLA's layer_norm."""
  names = (("jax.nn cudnn", "jax.nn cudnn (again)") if r["group"] != "layer_norm"
           else ("tokamax xla",))
  ms = [p["ms"] for p in rows if p["impl"] in names and "ms" in p and all(
      p.get(k) == r.get(k) for k in ("group", "shape", "mode", "causal"))]
  return sum(ms) / len(ms) if ms else None


def compare(out_dir):
  out = pathlib.Path(out_dir)
  runs = {f.stem.removeprefix("upstream_"): json.loads(f.read_text())
          for f in sorted(out.glob("upstream_*.json"))}
  table = []
  for label, run_data in runs.items():
    for r in run_data["rows"]:
      peer = _peer(run_data["rows"], r)
      table.append(dict(r, library=label, vs_peer=peer / r["ms"] if peer and "ms" in r else None))
  print(json.dumps({k: v["meta"] for k, v in runs.items()}, indent=1))
  print(common.markdown(table, [
      ("library", "library", ""), ("op", "group", ""), ("shape", "shape", ""),
      ("causal", "causal", ""), ("mode", "mode", ""), ("implementation", "impl", ""),
      ("median ms", "ms", ".3f"), ("TFLOP/s or TB/s", "rate", ".2f"),
      ("x same-process peer", "vs_peer", ".2f"), ("err", "err", ".1e")]))


if __name__ == "__main__":
  {"run": run, "compare": compare}[sys.argv[1]](*sys.argv[2:])
