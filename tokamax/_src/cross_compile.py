"""Tracing and lowering GPU implementations on a host without that GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

from tokamax._src import context
from tokamax._src import platform


def known_device_kinds() -> list[str]:
  """Device kinds `cross_compile` accepts (those with a known capability)."""
  # pylint: disable-next=protected-access
  return [f"NVIDIA {name}" for name in platform._KNOWN_CAPABILITIES]


@contextlib.contextmanager
def cross_compile(
    device_kind: str = "NVIDIA H200", num_cores: int = 132
) -> Iterator[platform.Target]:
  """Makes tokamax trace and lower for `device_kind`, e.g. on a CPU host.

  Inside, `platform.current_target()` is that (abstract) GPU, so
  implementation choice, configs and kernels are those for the device, and an
  abstract GPU device is set on the current abstract mesh (its axes are kept)
  for Pallas lowering. The target is part of JAX's jit key: jitted functions
  retrace inside. Lower with `jax.jit(f).trace(*args).lower(
  lowering_platforms=("cuda",))` or `jax.export.export(f, platforms=["cuda"],
  disabled_checks=DISABLE_JAX_EXPORT_CHECKS)`. Nestable (innermost wins).

  Args:
    device_kind: the device kind as JAX reports it, e.g. "NVIDIA H200".
    num_cores: the device's streaming multiprocessors (132 on an H200).

  Yields:
    The abstract `platform.Target`.

  Raises:
    ValueError: unknown device kind or non-positive `num_cores`.
  """
  capability = platform.capability_from_kind(device_kind)
  if capability is None:
    raise ValueError(
        f"cross_compile: unknown device kind {device_kind!r}; known:"
        f" {known_device_kinds()}."
    )
  if isinstance(num_cores, bool) or not isinstance(num_cores, int) or (
      num_cores <= 0
  ):
    raise ValueError(
        f"cross_compile: num_cores must be a positive int, got {num_cores!r}."
    )
  target = platform.Target(
      platform="gpu", device_kind=device_kind,
      compute_capability=capability, is_abstract=True,
  )
  device = jax.sharding.AbstractDevice(
      device_kind=device_kind, platform="gpu", num_cores=num_cores
  )
  mesh = jax.sharding.get_abstract_mesh().update(abstract_device=device)
  with context.updated(target=target), jax.sharding.use_abstract_mesh(mesh):
    yield target
