"""Test setup: 8 host devices (sharding tests), f64 references, GPU marker."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)


def _set_constants(spec: str) -> None:
  """TOKAMAX_TEST_CONSTANTS="package.module:NAME=VALUE;...": kernel switches
  (module constants, Python literals) set in every test process, so a GPU
  session can run the suite on a variant before it becomes the default."""
  import ast
  import importlib
  for item in filter(None, spec.split(";")):
    module, assignment = item.split(":")
    name, value = assignment.split("=")
    setattr(importlib.import_module(module), name, ast.literal_eval(value))


_set_constants(os.environ.get("TOKAMAX_TEST_CONSTANTS", ""))

ON_GPU = jax.default_backend() == "gpu"


# Every compiled executable keeps its code mapped until JAX's caches are
# cleared, and a Mosaic-interpreted forward+gradient compiles hundreds of
# small computations (~500 memory maps). A test process that reaches
# vm.max_map_count (65530) segfaults in its next compilation (CI,
# 2026-12-04: in TestMosaicInterpretManyBlocks after ~100 such tests), so a
# process clears the caches once it holds this many maps.
_MAX_MAPS = 20000


def _memory_maps() -> int:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return 0


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
  yield
  if _memory_maps() > _MAX_MAPS:
    jax.clear_caches()


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
