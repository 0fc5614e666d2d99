"""Shared helpers of the benchmark scripts (run as `python benchmarks/X.py`)."""

from __future__ import annotations

import ast
import datetime
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp

from tokamax._src import benchmarking

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_demo():
  """scripts/demo.py as a module (the seed flow's building blocks)."""
  spec = importlib.util.spec_from_file_location("demo", _ROOT / "scripts" / "demo.py")
  demo = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(demo)
  return demo


def seed_inputs(demo):
  """The seed's x and scale: seed shape on a GPU, the demo's small one elsewhere."""
  on_gpu = jax.default_backend() == "gpu"
  channels, seq_len, batch, heads = demo.SEED_SHAPE if on_gpu else demo.SMALL_SHAPE
  scale = jax.random.normal(jax.random.key(0), (channels,), jnp.float32)
  x = jax.random.normal(
      jax.random.key(1), (batch, seq_len, heads, channels), jnp.bfloat16)
  return x, scale


def attention_flops(shape, causal: bool, mode: str) -> float:
  """FlashAttention FLOP convention for shape (B, T, N, K, H) with S = T:
  4*B*N*T*T*H forward, 3.5x that for "forward_and_vjp", half when causal."""
  b, t, n, _, h = shape
  f = 4 * b * n * t * t * h * (3.5 if mode == "forward_and_vjp" else 1)
  return f / 2 if causal else f


def qk_matmul(b: int, n: int, t: int, h: int):
  """(fn, arg specs, FLOPs): a bf16 batched matmul of q.k^T's size,
  [B*N, T, H] @ [B*N, H, T] (the attention benchmarks' peer)."""
  a = jax.ShapeDtypeStruct((b * n, t, h), jnp.bfloat16)
  c = jax.ShapeDtypeStruct((b * n, h, t), jnp.bfloat16)
  return (lambda x, y: jnp.einsum("bth,bhs->bts", x, y), (a, c),
          2 * b * n * t * t * h)


def dense_matmul(size: int = 8192):
  """(fn, arg specs, FLOPs): a bf16 [size, size] @ [size, size] matmul."""
  m = jax.ShapeDtypeStruct((size, size), jnp.bfloat16)
  return lambda x, y: x @ y, (m, m), 2 * size**3


def selected(label: str, words: str) -> bool:
  """Whether a shape label contains one of the comma-separated `words` ("" = all)."""
  return not words or any(w in label for w in words.split(","))


def median_ms(f, args, mode="forward", iterations=20) -> float:
  """Median accelerator time (cupti) of f(*args) in ms; args: arrays or
  ShapeDtypeStructs; mode as in benchmarking.standardize_function."""
  f_std, flat = benchmarking.standardize_function(f, *args, mode=mode)
  return benchmarking.benchmark(f_std, flat, iterations=iterations).median_evaluation_time_ms


def _top_level_split(text: str) -> list[str]:
  """text split at the commas outside brackets and quotes ("A=1,B=(2, 3)")."""
  parts, depth, quote, start = [], 0, None, 0
  for i, ch in enumerate(text):
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  return parts + [text[start:]]


def set_constants(module, assignments: str) -> dict:
  """Sets module constants from "NAME=VALUE,..." (Python literals); returns
  {NAME: previous value} so the caller can restore them."""
  previous = {}
  for item in filter(None, _top_level_split(assignments)):
    name, value = item.split("=", 1)
    previous.setdefault(name, getattr(module, name))
    setattr(module, name, ast.literal_eval(value))
  return previous


def save(out_dir, name: str, rows, **meta) -> dict:
  """Writes OUT_DIR/NAME.json with date, device and jax version; returns meta."""
  meta = dict(date=datetime.date.today().isoformat(),
              device=jax.devices()[0].device_kind, jax=jax.__version__, **meta)
  path = pathlib.Path(out_dir) / f"{name}.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  return meta


def markdown(rows, columns) -> str:
  """A markdown table; columns are (header, key, format) triples."""
  lines = ["| " + " | ".join(h for h, _, _ in columns) + " |",
           "|" + "---|" * len(columns)]
  for r in rows:
    cells = []
    for _, key, fmt in columns:
      value = r.get(key)
      cells.append("n/a" if value is None else format(value, fmt))
    if "error" in r:
      cells[-1] = r["error"][:80]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
