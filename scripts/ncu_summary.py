"""Summarises Nsight Compute exports made by `scripts/gpu_check.sh ncu`.

Usage: python scripts/ncu_summary.py DIR
DIR holds NAME_raw.csv (`ncu -i R --page raw --csv`) and NAME_sass.csv
(`ncu -i R --page source --print-source sass --csv`) per profile. Prints a
markdown table per kernel: time, pipe utilisation (tensor, MUFU "xu", FP32
"fma", "alu"), issue slots, executed warp-instructions per opcode, and the
warp-stall reasons sampled over the kernel.
"""

from __future__ import annotations

import collections
import csv
import pathlib
import sys

METRICS = [  # (column, raw metric)
    ("ms", "gpu__time_duration.sum"),
    ("SM GHz", "sm__cycles_elapsed.avg.per_second"),
    ("grid", "launch__grid_size"),
    ("regs", "launch__registers_per_thread"),
    ("tensor %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"),
    ("MUFU (xu) %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("fma %", "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"),
    ("alu %", "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active"),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("warp-instr M", "smsp__inst_executed.sum"),
]
OPCODES = ("MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "F2FP", "HGMMA")


def _num(text: str) -> float:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return 0.0


def _rows(path: pathlib.Path) -> list[list[str]]:
  return list(csv.reader(path.open()))


def raw_metrics(path: pathlib.Path) -> list[dict[str, str]]:
  """One dict per profiled kernel launch (header, units, then values)."""
  rows = _rows(path)
  return [dict(zip(rows[0], r)) for r in rows[2:]]


def sass_kernels(path: pathlib.Path) -> dict[str, list[dict[str, str]]]:
  """Per kernel name, its SASS rows (a "Kernel Name" line starts each)."""
  out, name, header = {}, None, None
  for r in _rows(path):
    if r and r[0] == "Kernel Name":
      name, header = r[1], None
      out[name] = []
    elif header is None:
      header = r
    elif name is not None:
      out[name].append(dict(zip(header, r)))
  return out


def opcode_mix(rows) -> dict[str, float]:
  """Executed warp-instructions per opcode (predicated ones included)."""
  mix = collections.Counter()
  for d in rows:
    words = d.get("Source", "").split()
    if words and words[0].startswith("@"):
      words = words[1:]
    if words:
      mix[words[0].split(".")[0]] += _num(d.get("Instructions Executed", "0"))
  return mix


def stall_mix(rows) -> dict[str, float]:
  """Fraction of warp-stall samples per reason."""
  tot = collections.Counter()
  for d in rows:
    for k, v in d.items():
      if k.startswith("stall_") and "Not Issued" not in k:
        tot[k[len("stall_"):]] += _num(v)
  s = sum(tot.values()) or 1.0
  return {k: v / s for k, v in tot.most_common()}


def main(directory: str) -> None:
  d = pathlib.Path(directory)
  table = ["| profile | kernel | " + " | ".join(c for c, _ in METRICS)
           + " | executed " + " / ".join(OPCODES) + " (M) | top stalls |",
           "|" + "---|" * (len(METRICS) + 4)]
  for raw in sorted(d.glob("*_raw.csv")):
    profile = raw.name[: -len("_raw.csv")]
    sass = sass_kernels(d / f"{profile}_sass.csv")
    for m in raw_metrics(raw):
      kernel = m.get("Kernel Name", "?")
      cells = []
      for col, key in METRICS:
        v = _num(m.get(key, ""))
        cells.append(f"{v / 1e6:.0f}" if col == "warp-instr M" else f"{v:.3g}")
      rows = sass.get(kernel, [])
      mix = opcode_mix(rows)
      ops = " / ".join(f"{mix.get(o, 0) / 1e6:.0f}" for o in OPCODES)
      stalls = ", ".join(f"{k} {v:.0%}" for k, v in list(stall_mix(rows).items())[:4])
      table.append(f"| {profile} | {kernel.replace('_mosaic_gpu_kernel', '')} | "
                   + " | ".join(cells) + f" | {ops} | {stalls} |")
  print("\n".join(table))


if __name__ == "__main__":
  main(*sys.argv[1:])
