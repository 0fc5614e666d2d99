"""Settings: cross-compilation and the autotuning miss policy."""

from __future__ import annotations

import contextlib

from tokamax._src import autotuning as _autotuning
from tokamax._src import context as _context
from tokamax._src.cross_compile import cross_compile

__all__ = ["autotuning_miss_policy", "cross_compile"]


@contextlib.contextmanager
def autotuning_miss_policy(policy: str):
  """What a call without a tuned config does, inside the context.

  "heuristics" (the default) uses the op's heuristic config and logs once per
  op; "autotune" tunes the call on the spot (and writes the user cache if
  TOKAMAX_CACHE_DIR is set); "error" raises AutotuningMissError. The
  TOKAMAX_AUTOTUNING_MISS_POLICY environment variable sets the default.
  """
  if policy not in _autotuning.MISS_POLICIES:
    raise ValueError(
        f"unknown autotuning miss policy {policy!r}; use one of"
        f" {_autotuning.MISS_POLICIES}."
    )
  with _context.updated(miss_policy=policy):
    yield
