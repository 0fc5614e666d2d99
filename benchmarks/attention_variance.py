"""Where the spread of forward+backward attention times comes from (GPU).

Usage: python benchmarks/attention_variance.py [OUT_DIR] [ROUNDS] [SHAPES] [FLAG VALUES]
For each shape (SHAPES: comma-separated words of the labels; default the
non-causal seed and H128 shapes), "mosaic" and cuDNN (jax.nn)
forward+backward are compiled once each, then timed in ROUNDS alternating
rounds (default 6), each on freshly allocated random inputs (a new seed),
20 calls per round, per kernel by CUPTI. With FLAG (a module-level constant
of tokamax.ops.attention.mosaic, or "triton.NAME" of tokamax.ops.attention.
triton, which then times "triton" instead, or "vjp.FIELD", a field of the
"mosaic" backward config, set on the shape's heuristic config, which is
also the shipped one; "vjp.F1+F2" sets several, its VALUES tuples; or
"fwd.FIELD", likewise a field of the forward config on the heuristic one,
e.g. fwd.num_stages) and
VALUES (comma-separated Python literals), the implementation is compiled
once per value and every round times each (an
A/B per kernel under the same clocks). Environment SET ("NAME=VALUE,...")
sets constants of the mosaic module for every variant first. PAUSE_S: seconds
of idle before each timed round (default 0), so that the software power
cap's clock drops hit fewer rounds. MODE: what is timed, "forward_and_vjp"
(default), "forward" (inference) or "residuals" (the training forward
alone: the primal output of jax.vjp, its kernel saving the softmax
statistics). nvidia-smi samples the SM clock,
power and throttle reasons every 50 ms meanwhile. Writes each round's
per-kernel medians and the clock samples of that round to
attention_variance.json, then prints each variant's per-round % change per
kernel against the first variant (`paired_changes`).
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

import common
from tokamax._src import benchmarking
from tokamax.ops.attention import mosaic as mosaic_attn
from tokamax.ops.attention import triton as triton_attn
import tokamax

SHAPES = {  # label: (B, T, N, K, H, causal)
    "seed B32 T2048 N16 H64": (32, 2048, 16, 16, 64, False),
    "B8 T4096 N16 H128": (8, 4096, 16, 16, 128, False),
    "seed causal B32 T2048 N16 H64": (32, 2048, 16, 16, 64, True),
    "H128 causal B8 T4096 N16": (8, 4096, 16, 16, 128, True),
    "GQA causal B4 T4096 N32 K8 H128": (4, 4096, 32, 8, 128, True),
    # Few (batch, head) pairs: the band-1 rule of triton.heavy_first_band.
    "small causal B1 T4096 N16 H128": (1, 4096, 16, 16, 128, True),
    "small causal B1 T8192 N8 H128": (1, 8192, 8, 8, 128, True),
    # 17-33 pairs: band 1 since 2026-12-05 (BAND_ONE_PER_HEAD 4), 8 before.
    "mid causal B1 T16384 N32 H128": (1, 16384, 32, 32, 128, True),
    "mid causal B2 T8192 N12 H128": (2, 8192, 12, 12, 128, True),
    # T % 192 = 64: the partial query tile of three consumers (SHIFT_CAUSAL_TILES).
    "short causal B64 T1024 N16 H64": (64, 1024, 16, 16, 64, True),
    # Small non-causal grids (16384-65536 rows): how full the persistent
    # kernels' last round of tiles is against 132 CTAs.
    "small non-causal B1 T2048 N8 H64": (1, 2048, 8, 8, 64, False),
    "small non-causal B1 T4096 N8 H64": (1, 4096, 8, 8, 64, False),
    "small non-causal B1 T4096 N16 H64": (1, 4096, 16, 16, 64, False),
    # Causal grids of one wave of 128-row dq tiles (the dq kernel is not
    # persistent causal): the longest tile sets the time.
    "small causal B1 T2048 N8 H64": (1, 2048, 8, 8, 64, True),
    "small causal B1 T1024 N16 H64": (1, 1024, 16, 16, 64, True),
    "small causal B1 T4096 N8 H64": (1, 4096, 8, 8, 64, True),  # 2 waves
    "small causal B1 T4096 N16 H64": (1, 4096, 16, 16, 64, True),  # 4 waves
}
CALLS = 20
MIN_KERNEL_MS = 0.01  # kernels shorter than this are left out of the printouts
_CONFIG_FLAGS = ("vjp.", "fwd.")  # FLAG kinds that set config fields
_SMI_FIELDS = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"


def _round(compiled, args):
  """(total ms median, {kernel: ms median}) of CALLS calls."""
  _, timings = profiler.measure(compiled, aggregate=False, iterations=CALLS)(*args)
  per_kernel = {}
  for call in timings:
    for i, (name, ms) in enumerate(call):
      per_kernel.setdefault(f"{i}:{name[:48]}", []).append(ms)
  totals = [sum(ms for _, ms in call) for call in timings]
  return statistics.median(totals), {k: statistics.median(v) for k, v in per_kernel.items()}


def _clocks(samples, start, end):
  """SM clock (MHz) min/median/max, mean power (W) and throttle reasons seen
  between two datetimes."""
  rows = [r for r in samples if start <= r[0] <= end]
  if not rows:
    return {}
  mhz = sorted(r[1] for r in rows)
  return dict(sm_mhz_min=mhz[0], sm_mhz_median=mhz[len(mhz) // 2], sm_mhz_max=mhz[-1],
              power_w=sum(r[2] for r in rows) / len(rows),
              throttle=sorted({r[3] for r in rows}))


def _parse_smi(text):
  samples = []
  for line in text.splitlines():
    parts = [p.strip() for p in line.split(",")]
    try:
      ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
      samples.append((ts, float(parts[1].split()[0]), float(parts[2].split()[0]), parts[3]))
    except (ValueError, IndexError):
      continue
  return samples


def main(out_dir=".", rounds="6", words="seed B32,H128", flag="", values=""):
  rounds = int(rounds)
  settings = os.environ.get("SET", "")
  common.set_constants(mosaic_attn, settings)
  impl_name, module = "mosaic", mosaic_attn
  if flag.startswith("triton."):
    impl_name, module, flag = "triton", triton_attn, flag.removeprefix("triton.")
  variants = {impl_name: None}
  if flag:
    default = None if flag.startswith(_CONFIG_FLAGS) else getattr(module, flag)
    variants = {f"{impl_name} {flag}={v}": v for v in ast.literal_eval(f"[{values}]")}
  log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
  smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={_SMI_FIELDS}",
                          "--format=csv,noheader", "-lms", "50"], stdout=log)
  mode = os.environ.get("MODE", "forward_and_vjp")
  if mode not in ("forward_and_vjp", "forward", "residuals"):
    raise ValueError(f"MODE {mode!r}: forward_and_vjp, forward or residuals")
  bench_mode = "forward" if mode == "residuals" else mode
  rows = []
  try:
    for label, (b, t, n, kh, h, causal) in SHAPES.items():
      if not common.selected(label, words):
        continue
      q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
      kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
      ours = lambda q, k, v: tokamax.dot_product_attention(
          q, k, v, is_causal=causal, implementation=impl_name)
      fns = {name: ours for name in variants}
      if flag.startswith(_CONFIG_FLAGS):  # explicit backward or forward configs
        vjp = flag.startswith("vjp.")
        base = (mosaic_attn.vjp_heuristic_config(t, t, h, h, 2, causal, b * kh) if vjp
                else mosaic_attn.heuristic_config(t, t, h, h, 2))
        for name, value in variants.items():
          fields = flag.split(".", 1)[1].split("+")  # vjp.A+B: tuple values
          value = value if len(fields) > 1 else (value,)
          config = dataclasses.replace(base, **dict(zip(fields, value)))
          op = (mosaic_attn.MosaicDotProductAttention(
                    vjp=mosaic_attn.MosaicDotProductAttentionVjp(config=config)) if vjp
                else mosaic_attn.MosaicDotProductAttention(config=config))
          fns[name] = functools.partial(op, is_causal=causal)
      fns["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")
      if mode == "residuals":
        fns = {name: functools.partial(lambda fn, *a: jax.vjp(fn, *a)[0], fn)
               for name, fn in fns.items()}
      compiled = {}
      for impl, fn in fns.items():
        module_flag = flag and not flag.startswith(_CONFIG_FLAGS)
        if module_flag and impl in variants:  # the module reads it while tracing
          setattr(module, flag, variants[impl])
        f_std, args = benchmarking.standardize_function(fn, q, kv, kv, mode=bench_mode)
        compiled[impl] = (f_std, jax.jit(f_std).lower(*args).compile())
        del args
        if module_flag:
          setattr(module, flag, default)
      for r in range(rounds):
        for impl, (f_std, comp) in compiled.items():
          _, args = benchmarking.standardize_function(
              fns[impl], q, kv, kv, mode=bench_mode, seed=r + 1)
          jax.block_until_ready(comp(*args))  # warm-up
          time.sleep(float(os.environ.get("PAUSE_S", "0")))
          start = datetime.datetime.now()
          total, kernels = _round(comp, args)
          rows.append(dict(shape=label, causal=causal, impl=impl, round=r, mode=mode,
                           total_ms=total, kernels_ms=kernels, start=start.isoformat(),
                           end=datetime.datetime.now().isoformat()))
          print({k: v for k, v in rows[-1].items() if k != "kernels_ms"},
                {k: round(v, 4) for k, v in kernels.items() if v > MIN_KERNEL_MS})
          del args
  finally:
    smi.terminate()
    smi.wait()
  log.seek(0)
  samples = _parse_smi(log.read())
  for row in rows:
    row.update(_clocks(samples, datetime.datetime.fromisoformat(row["start"]),
                       datetime.datetime.fromisoformat(row["end"])))
    print(row["shape"], row["impl"], row["round"], round(row["total_ms"], 4),
          {k: row.get(k) for k in ("sm_mhz_min", "sm_mhz_median", "power_w", "throttle")})
  common.save(out_dir, "attention_variance", rows, calls=CALLS, rounds=rounds,
              settings=settings)
  for line in paired_changes(rows):
    print(line)


def paired_changes(rows) -> list[str]:
  """Per shape, each variant against the first one, kernel by kernel: the %
  change in every round. Kernels a flag does not touch drift by a few % between
  the variants' calls of one round (H100, 2026-12-05), so read a kernel's change
  against theirs."""
  by = {}  # (shape, impl, round) -> {kernel: ms}
  for row in rows:
    if row["impl"] != "cudnn":
      kernels = {k.split(":", 1)[-1]: v for k, v in row["kernels_ms"].items()}
      by[(row["shape"], row["impl"], row["round"])] = kernels
  lines = []
  for shape in dict.fromkeys(s for s, _, _ in by):
    impls = list(dict.fromkeys(i for s, i, _ in by if s == shape))
    rounds = sorted({r for s, _, r in by if s == shape})
    for impl in impls[1:]:
      lines.append(f"{shape}: {impl} against {impls[0]}, % per round")
      for kernel, ms in by[(shape, impls[0], rounds[0])].items():
        if ms < MIN_KERNEL_MS:
          continue
        changes = [100 * (by[(shape, impl, r)].get(kernel, float("nan"))
                          / by[(shape, impls[0], r)][kernel] - 1) for r in rounds
                   if (shape, impl, r) in by and (shape, impls[0], r) in by]
        lines.append(f"  {kernel[:48]:48} " + " ".join(f"{c:+.1f}" for c in changes))
  return lines


if __name__ == "__main__":
  main(*sys.argv[1:])
