"""Thread-local settings that change what a trace of a tokamax op produces.

They are part of JAX's jit key (a private JAX config state; jax is pinned), so
a jitted function retraces when they change: entering an AutotuningResult,
cross-compiling, or recording ops for autotuning.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from jax._src import config as jax_config


@dataclasses.dataclass(frozen=True)
class Settings:
  """Attributes:
    autotuning: active AutotuningResults (innermost last).
    recording: a token while `autotune` records the ops a function runs.
    miss_policy: what a config-cache miss does (None: env var / default).
    target: the cross-compilation target (a platform.Target) or None.
  """

  autotuning: tuple[Any, ...] = ()
  recording: int | None = None
  miss_policy: str | None = None
  target: Any = None


_STATE = jax_config.string_or_object_state(
    "tokamax_settings",
    default=Settings(),
    help="tokamax settings that affect tracing (internal).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


def current() -> Settings:
  value = _STATE.value
  return value if isinstance(value, Settings) else Settings()


@contextlib.contextmanager
def updated(**changes):
  """Temporarily replaces some settings (thread-local)."""
  with _STATE(dataclasses.replace(current(), **changes)):
    yield
