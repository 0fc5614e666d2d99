"""In-kernel timeline of the "mosaic" attention forward (GPU).

Usage: python benchmarks/trace_mosaic.py [OUT_DIR] [seed|h128] [causal 0|1]
Runs the forward once under `pallas_mosaic.trace_kernels` (Mosaic GPU's
profiler records the named regions of every warpgroup: q_wait, qk_issue,
rendezvous_qk, qk_wait, softmax, rendezvous_pv, pv, skip, epilogue for the
consumers, k_free_wait / v_free_wait for the producer), then summarises the
Perfetto trace: per warpgroup role the mean time per CTA in each region and
its share of the CTA's time, and the CTA time. Units: Mosaic GPU's profiler
stamps events with the SM's %clock relative to the CTA's start and writes
ts = (start in ns + cycles) / 1000, so times within a CTA are kilocycles
(1 kcycle = 0.5 us at 1.98 GHz); times between CTAs mix the two clocks and
are not reported. Writes trace_summary.json and the gzipped trace to OUT_DIR.
The batch is cut so that the trace stays small (a few waves of CTAs).
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import shutil
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp

import tokamax
from tokamax._src import pallas_mosaic

SHAPES = {"seed": (2, 2048, 16, 64), "h128": (1, 4096, 16, 128)}  # B, T, N, H
ROLES = ("consumer 0", "consumer 1", "producer")


def regions(events):
  """[(tid, pid, name, begin, end)] from B/E events (per tid, nested)."""
  stacks, out = collections.defaultdict(list), []
  for e in events:
    key = e["tid"]
    if e["ph"] == "B":
      stacks[key].append(e)
    elif stacks[key]:
      b = stacks[key].pop()
      out.append((key, e["pid"], b["name"], b["ts"], e["ts"]))
  return out


def summarise(events, warpgroups: int = 3) -> dict:
  """Mean per-CTA time per region and role (kilocycles), and CTA times."""
  spans = regions(events)
  per_tid = collections.defaultdict(lambda: collections.Counter())
  life = {}
  for tid, pid, name, b, e in spans:
    per_tid[tid][name] += e - b
    lo, hi, _ = life.get(tid, (b, e, pid))
    life[tid] = (min(lo, b), max(hi, e), pid)
  out = {}
  for role_idx, role in enumerate(ROLES[:warpgroups]):
    tids = [t for t in per_tid if (t - 1) % warpgroups == role_idx]
    if not tids:
      continue
    names = sorted({n for t in tids for n in per_tid[t]})
    lifetime = statistics.mean(life[t][1] - life[t][0] for t in tids)
    out[role] = {
        "traces": len(tids), "mean_span": lifetime,
        "regions": {n: {"mean": statistics.mean(per_tid[t][n] for t in tids),
                        "share": statistics.mean(per_tid[t][n] for t in tids) / lifetime}
                    for n in names}}
  # CTAs: one per `warpgroups` consecutive tids; their span (kilocycles).
  ctas = collections.defaultdict(list)
  for tid, (b, e, _) in life.items():
    ctas[(tid - 1) // warpgroups].append((b, e))
  cta_times = [max(e for _, e in s) - min(b for b, _ in s) for s in ctas.values()]
  out["ctas"] = {"count": len(cta_times), "mean_time": statistics.mean(cta_times)}
  return out


def main(out_dir=".", shape="seed", causal="0"):
  b, t, n, h = SHAPES[shape]
  x = jax.random.normal(jax.random.key(0), (b, t, n, h), jnp.bfloat16)
  f = jax.jit(lambda q: tokamax.dot_product_attention(
      q, q, q, is_causal=bool(int(causal)), implementation="mosaic"))
  trace_dir = pathlib.Path(tempfile.mkdtemp())
  with pallas_mosaic.trace_kernels(str(trace_dir)):
    jax.block_until_ready(f(x))
    jax.effects_barrier()
  files = sorted(trace_dir.glob("*trace.json"))
  if not files:
    raise RuntimeError(f"no trace written to {trace_dir}")
  events = json.loads(files[-1].read_text())["traceEvents"]
  summary = dict(shape=shape, dims=dict(B=b, T=t, N=n, H=h), causal=bool(int(causal)),
                 device=jax.devices()[0].device_kind, jax=jax.__version__,
                 units="kilocycles (SM %clock) within a CTA", **summarise(events))
  out = pathlib.Path(out_dir)
  (out / f"trace_summary_{shape}_c{causal}.json").write_text(json.dumps(summary, indent=1))
  with open(files[-1], "rb") as src, gzip.open(out / f"trace_{shape}_c{causal}.json.gz", "wb") as dst:
    shutil.copyfileobj(src, dst)
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  main(*sys.argv[1:])
