"""What machine a kernel will run on: platform, device kind, GPU generation."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax

# Compute capability of NVIDIA device kinds we know by name (used when the
# device is abstract, e.g. while cross-compiling on a CPU host).
_KNOWN_CAPABILITIES = {
    "H100": (9, 0),
    "H200": (9, 0),
    "H800": (9, 0),
    "H20": (9, 0),
    "GH200": (9, 0),
    "A100": (8, 0),
    "A800": (8, 0),
    "A10": (8, 6),
    "A40": (8, 6),
    "L4": (8, 9),
    "L40": (8, 9),
    "V100": (7, 0),
    "T4": (7, 5),
    "B200": (10, 0),
    "GB200": (10, 0),
}


@dataclasses.dataclass(frozen=True)
class Target:
  """The device a call is compiled for.

  Attributes:
    platform: "gpu", "cpu" or "tpu".
    device_kind: e.g. "NVIDIA H200" or "cpu".
    compute_capability: (major, minor) for NVIDIA GPUs, else None.
    is_abstract: True when cross-compiling (no such device is attached).
  """

  platform: str
  device_kind: str
  compute_capability: tuple[int, int] | None = None
  is_abstract: bool = False

  @property
  def is_nvidia_gpu(self) -> bool:
    return self.platform == "gpu" and self.compute_capability is not None

  def describe(self) -> str:
    cc = self.compute_capability
    cc_txt = f", sm_{cc[0]}{cc[1]}" if cc else ""
    return f"{self.device_kind} ({self.platform}{cc_txt})"


def capability_from_kind(device_kind: str) -> tuple[int, int] | None:
  """Compute capability for an NVIDIA device kind string, if known."""
  if "NVIDIA" not in device_kind.upper():
    return None
  for token in re.split(r"[\s\-_]+", device_kind.upper()):
    if token in _KNOWN_CAPABILITIES:
      return _KNOWN_CAPABILITIES[token]
  return None


@functools.cache
def _attached_target() -> Target:
  device = jax.devices()[0]
  platform = device.platform
  kind = device.device_kind
  cc = None
  if platform == "gpu":
    raw = getattr(device, "compute_capability", None)
    if raw:
      major, minor = str(raw).split(".")[:2]
      cc = (int(major), int(minor))
    else:
      cc = capability_from_kind(kind)
  return Target(platform=platform, device_kind=kind, compute_capability=cc)


def current_target() -> Target:
  """The cross-compilation target if one is set, else the first device."""
  from tokamax._src import context  # pylint: disable=g-import-not-at-top

  target = context.current().target
  return target if target is not None else _attached_target()
