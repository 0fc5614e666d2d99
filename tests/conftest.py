"""Test setup: 8 host devices (sharding tests), f64 references, GPU marker."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)

ON_GPU = jax.default_backend() == "gpu"


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU")
  config.addinivalue_line("markers", "slow: long-running test")


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run scripts/gpu_check.sh)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
