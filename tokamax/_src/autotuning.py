"""Autotuning: find the ops a function runs, time their configs, keep the best.

Config lookup for a call (see op.resolve_config): a pinned config, then the
active `AutotuningResult` contexts (innermost first), the user cache
(`$TOKAMAX_CACHE_DIR/<device kind>/<op>.json`), the cache shipped in
`tokamax/data/autotuning/<device kind>/<op>.json`, the nearest cached shape of
the same op, dtypes and static arguments (if its config is in this call's
search space, or the op has none, and the op's `borrows_nearest_config`),
and finally the miss policy:
"heuristics" (default; one log line per op per process), "autotune" (tune this
call now and remember it) or "error". Set the policy with
`tokamax.config.autotuning_miss_policy(...)` or `TOKAMAX_AUTOTUNING_MISS_POLICY`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib
import itertools
import json
import logging
import math
import os
import pathlib
import tempfile
import threading
from typing import Any

import jax
import tqdm

from tokamax._src import benchmarking
from tokamax._src import context
from tokamax._src import op as op_lib
from tokamax._src import platform

_LOG = logging.getLogger("tokamax")
FORMAT = "tokamax.autotuning/1"
MISS_POLICIES = ("heuristics", "autotune", "error")
_SHIPPED_DIR = pathlib.Path(__file__).resolve().parent.parent / "data" / "autotuning"


class AutotuningMissError(LookupError):
  """No tuned config for a call while the miss policy is "error"."""


def class_path(cls: type) -> str:
  return f"{cls.__module__}:{cls.__qualname__}"


def import_class(path: str) -> type:
  module_name, _, qualname = path.partition(":")
  try:
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
      obj = getattr(obj, part)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"cannot import {path!r}: {e}") from e
  if not isinstance(obj, type):
    raise ValueError(f"{path!r} is not a class.")
  return obj


def _config_to_json(config: Any) -> dict[str, Any]:
  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
  return {"class": class_path(type(config)), "fields": fields}


def _config_from_json(data: Any) -> Any:
  if not isinstance(data, dict) or set(data) != {"class", "fields"}:
    raise ValueError(f"bad config entry: {data!r}")
  cls = import_class(data["class"])
  if not dataclasses.is_dataclass(cls):
    raise ValueError(f"{data['class']} is not a dataclass config.")
  try:
    return cls(**data["fields"])
  except Exception as e:  # pydantic ValidationError, TypeError, ...
    raise ValueError(f"bad fields for {data['class']}: {e}") from e


@dataclasses.dataclass(frozen=True)
class Measurement:
  """One config's benchmark: median ms, or the error that stopped it."""

  config: Any
  median_ms: float | None = None
  error: str | None = None


@dataclasses.dataclass(frozen=True)
class Entry:
  """The tuned config of one op call.

  Attributes:
    op: "module:QualName" of the op class.
    key: `BoundArguments.key` of the call (shapes, dtypes, static args).
    config: the chosen config (the heuristic one if every config failed).
    measurements: every config tried, fastest first.
  """

  op: str
  key: str
  config: Any
  measurements: tuple[Measurement, ...] = ()


def _device_kind() -> str:
  return platform.current_target().device_kind


@dataclasses.dataclass(frozen=True)
class AutotuningResult:
  """Tuned configs; a value. `with result:` makes calls use them.

  Contexts nest (innermost wins) and jitted functions retrace on entry. A
  result made for another device kind is refused on entry unless made with
  `check_device=False` (see `on_any_device`).
  """

  device_kind: str
  entries: tuple[Entry, ...] = ()
  check_device: bool = True

  # --- lookup --------------------------------------------------------------

  @functools.cached_property
  def _index(self) -> dict[tuple[str, str], Any]:
    return {(e.op, e.key): e.config for e in self.entries}

  def config_for(self, ba: op_lib.BoundArguments) -> Any:
    """The tuned config for `ba`, or None."""
    return self._index.get((class_path(type(ba.op)), ba.key))

  @functools.cached_property
  def _token(self) -> str:
    return hashlib.sha256(self.dumps().encode()).hexdigest()

  def __hash__(self) -> int:
    return hash((self._token, self.check_device))

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, AutotuningResult):
      return NotImplemented
    return (self._token, self.check_device) == (other._token, other.check_device)

  def __or__(self, other: "AutotuningResult") -> "AutotuningResult":
    """Merge; `other`'s entries win for keys present in both."""
    if not isinstance(other, AutotuningResult):
      return NotImplemented
    if other.device_kind != self.device_kind:
      raise ValueError(
          "cannot merge autotuning results for different devices:"
          f" {self.device_kind!r} and {other.device_kind!r}."
      )
    merged = {(e.op, e.key): e for e in self.entries}
    merged.update({(e.op, e.key): e for e in other.entries})
    return dataclasses.replace(self, entries=tuple(merged.values()))

  def on_any_device(self) -> "AutotuningResult":
    """A copy that may be entered on any device kind."""
    return dataclasses.replace(self, check_device=False)

  # --- context manager -----------------------------------------------------

  def __enter__(self) -> "AutotuningResult":
    here = _device_kind()
    if self.check_device and here != self.device_kind:
      raise ValueError(
          f"this AutotuningResult was made on {self.device_kind!r}, but the"
          f" current device is {here!r}; use result.on_any_device() to apply"
          " it anyway."
      )
    active = context.current().autotuning
    manager = context.updated(autotuning=active + (self,))
    manager.__enter__()
    _entered_stack().append(manager)
    return self

  def __exit__(self, *exc) -> None:
    _entered_stack().pop().__exit__(*exc)

  # --- serialization -------------------------------------------------------

  def to_json(self) -> dict[str, Any]:
    from tokamax import __version__  # pylint: disable=g-import-not-at-top

    return {
        "format": FORMAT,
        "device_kind": self.device_kind,
        "tokamax_version": __version__,
        "jax_version": jax.__version__,
        "entries": [
            {
                "op": e.op,
                "key": json.loads(e.key),
                "config": _config_to_json(e.config),
                "measurements": [
                    {
                        "config": _config_to_json(m.config),
                        "median_ms": m.median_ms,
                        "error": m.error,
                    }
                    for m in e.measurements
                ],
            }
            for e in self.entries
        ],
    }

  def dumps(self) -> str:
    return json.dumps(self.to_json(), sort_keys=True)

  @classmethod
  def loads(cls, text: str) -> "AutotuningResult":
    """Parses `dumps` output; corrupt or foreign JSON raises ValueError."""
    try:
      data = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
      raise ValueError(f"not an autotuning result (invalid JSON): {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
      raise ValueError(
          f"not an autotuning result: expected format {FORMAT!r}, got"
          f" {data.get('format') if isinstance(data, dict) else type(data).__name__!r}."
      )
    try:
      entries = []
      for e in data["entries"]:
        import_class(e["op"])  # the op must be importable
        entries.append(Entry(
            op=e["op"],
            key=json.dumps(e["key"], sort_keys=True),
            config=_config_from_json(e["config"]),
            measurements=tuple(
                Measurement(
                    config=_config_from_json(m["config"]),
                    median_ms=m["median_ms"], error=m["error"],
                )
                for m in e["measurements"]
            ),
        ))
      return cls(device_kind=str(data["device_kind"]), entries=tuple(entries))
    except (KeyError, TypeError) as e:
      raise ValueError(f"corrupt autotuning result: missing or bad {e}") from e

  def dump(self, path: str | os.PathLike) -> None:
    _atomic_write(pathlib.Path(path), self.dumps())

  @classmethod
  def load(cls, path: str | os.PathLike) -> "AutotuningResult":
    return cls.loads(pathlib.Path(path).read_text())


_THREAD = threading.local()


def _entered_stack() -> list:
  if not hasattr(_THREAD, "entered"):
    _THREAD.entered = []
  return _THREAD.entered


def _atomic_write(path: pathlib.Path, text: str) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise


# --- caches ------------------------------------------------------------------


def _kind_dir(device_kind: str) -> str:
  return "".join(c if c.isalnum() or c in "-." else "_" for c in device_kind)


def user_cache_dir() -> pathlib.Path | None:
  root = os.environ.get("TOKAMAX_CACHE_DIR")
  return pathlib.Path(root) if root else None


@functools.lru_cache(maxsize=256)
def _load_cache_file(path: str, mtime: float) -> AutotuningResult | None:
  del mtime  # part of the cache key: reload when the file changes
  try:
    return AutotuningResult.load(path)
  except (OSError, ValueError) as e:
    _LOG.warning("tokamax: ignoring unreadable autotuning cache %s: %s", path, e)
    return None


def _cache_results(op_name: str, device_kind: str) -> list[AutotuningResult]:
  roots = [user_cache_dir(), _SHIPPED_DIR]
  results = []
  for root in roots:
    if root is None:
      continue
    path = root / _kind_dir(device_kind) / f"{op_name}.json"
    if path.is_file():
      result = _load_cache_file(str(path), path.stat().st_mtime)
      if result is not None:
        results.append(result)
  return results


def write_user_cache(result: AutotuningResult) -> None:
  """Merges `result` into the user cache (one file per op name), atomically."""
  root = user_cache_dir()
  if root is None:
    return
  by_name: dict[str, list[Entry]] = {}
  for e in result.entries:
    by_name.setdefault(import_class(e.op).op_name, []).append(e)
  for name, entries in by_name.items():
    path = root / _kind_dir(result.device_kind) / f"{name}.json"
    new = AutotuningResult(result.device_kind, tuple(entries))
    if path.is_file():
      old = _load_cache_file(str(path), path.stat().st_mtime)
      if old is not None and old.device_kind == new.device_kind:
        new = old | new
    new.dump(path)


def _split_key(key: str) -> tuple[str, list[int]]:
  """(signature with shapes replaced by ranks, flat list of dims)."""
  dims: list[int] = []

  def walk(x):
    if isinstance(x, dict):
      if set(x) == {"shape", "dtype"}:
        dims.extend(x["shape"])
        return {"rank": len(x["shape"]), "dtype": x["dtype"]}
      return {k: walk(v) for k, v in x.items()}
    if isinstance(x, list):
      return [walk(v) for v in x]
    return x

  signature = walk(json.loads(key))
  return json.dumps(signature, sort_keys=True), dims


def _nearest(results, op: str, key: str, allowed=None) -> Any:
  """Config of the cached call of `op` with the closest shapes (log2 L1),
  among the configs in `allowed` (None: any)."""
  signature, dims = _split_key(key)
  best, best_distance = None, math.inf
  for result in results:
    for e in result.entries:
      if e.op != op or (allowed is not None and e.config not in allowed):
        continue
      other_signature, other_dims = _split_key(e.key)
      if other_signature != signature:
        continue
      distance = sum(
          abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))
          for a, b in zip(dims, other_dims)
      )
      if distance < best_distance:
        best, best_distance = e.config, distance
  return best


_LOGGED: set[tuple[str, str]] = set()


def _log_once(op: str, what: str, message: str) -> None:
  if (op, what) not in _LOGGED:
    _LOGGED.add((op, what))
    _LOG.info(message)


def miss_policy() -> str:
  policy = context.current().miss_policy
  if policy is None:
    policy = os.environ.get("TOKAMAX_AUTOTUNING_MISS_POLICY", "heuristics")
  if policy not in MISS_POLICIES:
    raise ValueError(
        f"unknown autotuning miss policy {policy!r}; use one of {MISS_POLICIES}."
    )
  return policy


_TUNED_NOW: dict[tuple[str, str, str], Any] = {}


def lookup(ba: op_lib.BoundArguments) -> Any:
  """Config source for op.resolve_config (see the module docstring)."""
  if ba.op.config_cls is op_lib.NoConfig:
    return None
  op = class_path(type(ba.op))
  key = ba.key
  for result in reversed(context.current().autotuning):
    config = result.config_for(ba)
    if config is not None:
      return config
  device_kind = _device_kind()
  cached = _cache_results(ba.op.op_name, device_kind)
  for result in cached:
    config = result.config_for(ba)
    if config is not None:
      return config
  if (op, key, device_kind) in _TUNED_NOW:
    return _TUNED_NOW[(op, key, device_kind)]
  # A shape's config can be a poor one elsewhere (at head dim 128 the head-dim
  # 64 attention config with three consumer warpgroups spills: 5x slower), so
  # the nearest shape's config is taken only where it is in this call's
  # search space; ops without a search space take it as it is.
  config = None
  if ba.op.borrows_nearest_config and any(
      e.op == op for result in cached for e in result.entries):
    candidates = _candidates(ba)
    config = _nearest(cached, op, key, set(candidates) if len(candidates) > 1 else None)
  if config is not None:
    _log_once(op, "nearest", f"tokamax: {op}: no tuned config for this shape on"
              f" {device_kind}; using the nearest cached shape's.")
    return config
  policy = miss_policy()
  if policy == "error":
    raise AutotuningMissError(
        f"{ba.op.describe()}: no tuned config on {device_kind} for {key}"
        " (autotuning miss policy is 'error')."
    )
  if policy == "autotune":
    entry = tune(ba.abstract(), progress=None)
    _TUNED_NOW[(op, key, device_kind)] = entry.config
    write_user_cache(AutotuningResult(device_kind, (entry,)))
    return entry.config
  _log_once(op, "miss", f"tokamax: {op}: no tuned config on {device_kind};"
            " using heuristics (logged once per op).")
  return None


op_lib.CONFIG_SOURCES.append(lookup)


# --- discovery and tuning ----------------------------------------------------

_RECORDINGS: dict[int, list[op_lib.BoundArguments]] = {}
_TOKENS = itertools.count(1)


def _record(ba: op_lib.BoundArguments, config: Any) -> None:
  del config
  token = context.current().recording
  if token in _RECORDINGS:
    _RECORDINGS[token].append(ba.abstract())


op_lib.CALL_OBSERVERS.append(_record)


def find_ops(f, *args, **kwargs) -> list[op_lib.BoundArguments]:
  """Every tunable op call `f(*args, **kwargs)` traces (VJP ops included when
  `f` takes a gradient), each once, as abstract bound arguments."""
  token = next(_TOKENS)
  _RECORDINGS[token] = []
  try:
    with context.updated(recording=token):
      jax.eval_shape(f, *args, **kwargs)
    found = _RECORDINGS[token]
  finally:
    del _RECORDINGS[token]
  unique: dict[tuple[str, str], op_lib.BoundArguments] = {}
  for ba in found:
    if ba.op.config_cls is op_lib.NoConfig:
      continue
    unique.setdefault((class_path(type(ba.op)), ba.key), ba)
  return list(unique.values())


def _candidates(ba: op_lib.BoundArguments) -> list[Any]:
  op = dataclasses.replace(ba.op, config=None)
  heuristic = op._get_heuristics_config(ba)
  others = set(op._get_autotuning_configs(ba)) - {heuristic}
  return [heuristic] + sorted(others, key=repr)


def _batched(ba: op_lib.BoundArguments) -> dict[str, Any]:
  """Abstract arguments with the vmapped axes inserted (innermost first)."""
  flat, tree = jax.tree_util.tree_flatten_with_path(dict(ba.arguments))
  leaves = []
  for path, x in flat:
    if isinstance(x, jax.ShapeDtypeStruct):
      shape = list(x.shape)
      for size, axes in ba.vmap_levels:
        axis = dict(axes).get(jax.tree_util.keystr(path))
        if axis is not None:
          shape.insert(axis, size)
      x = jax.ShapeDtypeStruct(tuple(shape), x.dtype)
    leaves.append(x)
  return jax.tree_util.tree_unflatten(tree, leaves)


def _random_arrays(ba: op_lib.BoundArguments) -> dict[str, Any]:
  """Random (batched, if vmapped) arrays for ba's array arguments."""
  arrays = {n: _batched(ba)[n] for n in ba.op.array_args}
  identity, flat = benchmarking.standardize_function(lambda a: a, arrays)
  return identity(*flat)


def _compile(ba: op_lib.BoundArguments, config: Any, arrays: dict[str, Any]):
  op = dataclasses.replace(ba.op, config=config)
  static = ba.static

  def run(arrays):
    return op.call_bound(op_lib.BoundArguments(op, {**arrays, **static}))

  # Recreate the vmap levels the op was called under, innermost first.
  for _, axes in ba.vmap_levels:
    axes = dict(axes)
    in_axes = jax.tree_util.tree_map_with_path(
        lambda path, _: axes.get(jax.tree_util.keystr(path)),
        {n: ba.arguments[n] for n in ba.op.array_args},
    )
    run = jax.vmap(run, in_axes=(in_axes,))

  f_std, flat = benchmarking.standardize_function(run, arrays)
  return benchmarking.compile_benchmark(f_std, flat), flat


def tune(
    ba: op_lib.BoundArguments, *, progress=None, iterations: int = 5,
    max_workers: int | None = None,
) -> Entry:
  """Benchmarks every candidate config of `ba`; failures are recorded."""
  configs = _candidates(ba)
  workers = max_workers or min(4, os.cpu_count() or 1)
  measurements = []
  # Compiling releases the GIL: compile every candidate concurrently first.
  # Timing starts only when all compiles are done: XLA's GPU compiler runs
  # its own autotuning kernels, which a concurrent CUPTI measurement would
  # count.
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    arrays = _random_arrays(ba)  # one set of inputs for every config
    futures = [pool.submit(_compile, ba, c, arrays) for c in configs]
    concurrent.futures.wait(futures)
  for config, future in zip(configs, futures):
    try:
      run, flat = future.result()
      data = run(flat, iterations=iterations)
      measurements.append(Measurement(config, data.median_evaluation_time_ms))
    except Exception as e:  # a config that fails is skipped, never fatal
      measurements.append(Measurement(config, error=f"{type(e).__name__}: {e}"[:500]))
    if progress is not None:
      progress.update(1)
  ok = [m for m in measurements if m.error is None]
  if ok:
    best = min(ok, key=lambda m: m.median_ms).config
  else:
    best = configs[0]
    _LOG.warning(
        "tokamax: every config of %s failed; keeping the heuristic config.",
        ba.op.describe(),
    )
  measurements.sort(key=lambda m: (m.median_ms is None, m.median_ms or 0.0))
  return Entry(class_path(type(ba.op)), ba.key, best, tuple(measurements))


def autotune(
    f, *args, progress_bar: bool = True, iterations: int = 5, **kwargs
) -> AutotuningResult:
  """Tunes every tokamax op that `f(*args, **kwargs)` runs.

  `f` may be a plain function, a jitted one or a jitted gradient: the ops are
  found by tracing it (the gradient's VJP ops included). Each op's search
  space (`_get_autotuning_configs` plus its heuristic config) is benchmarked
  with `tokamax.benchmarking` and the fastest median kept.
  """
  bound = find_ops(f, *args, **kwargs)
  total = sum(len(_candidates(ba)) for ba in bound)
  entries = []
  with tqdm.tqdm(
      total=total, desc="tokamax autotune", unit="config",
      disable=not progress_bar,
  ) as bar:
    for i, ba in enumerate(bound):
      bar.set_postfix_str(f"op {i + 1}/{len(bound)}: {ba.op.describe()}")
      entries.append(tune(ba, progress=bar, iterations=iterations))
  failed = [e for e in entries if not any(m.error is None for m in e.measurements)]
  for e in failed:
    _LOG.warning("tokamax: %s: every config failed to compile or run.", e.op)
  result = AutotuningResult(device_kind=_device_kind(), entries=tuple(entries))
  write_user_cache(result)
  return result
