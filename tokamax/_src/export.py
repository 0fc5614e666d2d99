"""Serializing functions that call tokamax kernels with `jax.export`.

Kernel calls are custom calls that `jax.export` refuses by default because
their targets carry no compatibility guarantee. Pass
`disabled_checks=DISABLE_JAX_EXPORT_CHECKS` to allow every target tokamax
implementations can emit:

* "triton" kernels (Pallas:Triton): `__gpu$xla.gpu.triton`;
* "cudnn" attention (`jax.nn.dot_product_attention(implementation='cudnn')`):
  `__cudnn$fmhaSoftmax` and `__cudnn$fmhaScaleBiasSoftmax` (a bias or a mask,
  which jax.nn folds into a bias) forward, and their `...Backward` targets.
  jax.nn never passes a dropout rate or FP8 inputs, so the `...Dropout...` and
  `...F8` variants cannot appear;
* "mosaic" kernels (Pallas:Mosaic GPU) emit `mosaic_gpu_v2`, which JAX
  allows by default. The "xla" implementations emit no custom calls.

Device guarantee: a function serialized with tokamax kernels loses the device
independence of StableHLO and runs on exactly the device kind it was
serialized for (a kernel is lowered for one GPU generation and its config is
chosen for that device). JAX itself refuses to call an `Exported` on another
platform (e.g. a "cuda" export on a CPU). JAX 0.11.2 records only the
platform, not the GPU generation or device kind, so a module serialized for
an H200 and deserialized on another NVIDIA GPU is not detected: deserialize
serialized modules only on the same device kind they were serialized for
(`cross_compile(device_kind)` in tokamax/_src/cross_compile.py names it when
exporting from a host without that device).
"""

from __future__ import annotations

import re
from typing import Any

import jax

TRITON_TARGET = "__gpu$xla.gpu.triton"

# Every target jax.nn.dot_product_attention(implementation="cudnn") can emit
# (jax/_src/cudnn/fused_attention_stablehlo.py, jax 0.11.2).
CUDNN_ATTENTION_TARGETS = (
    "__cudnn$fmhaSoftmax",
    "__cudnn$fmhaScaleBiasSoftmax",
    "__cudnn$fmhaSoftmaxBackward",
    "__cudnn$fmhaScaleBiasSoftmaxBackward",
)

TOKAMAX_CUSTOM_CALL_TARGETS = (TRITON_TARGET,) + CUDNN_ATTENTION_TARGETS

DISABLE_JAX_EXPORT_CHECKS: tuple[jax.export.DisabledSafetyCheck, ...] = tuple(
    jax.export.DisabledSafetyCheck.custom_call(target)
    for target in TOKAMAX_CUSTOM_CALL_TARGETS
)

# `stablehlo.custom_call @target(` (pretty form, bare or quoted symbol) and
# `call_target_name = "target"` (generic form).
_PRETTY = re.compile(
    r'custom_call\s+@(?:"((?:[^"\\]|\\.)*)"|([A-Za-z_][\w$.]*))'
)
_GENERIC = re.compile(r'call_target_name\s*=\s*"((?:[^"\\]|\\.)*)"')


def _module_text(exported_or_text: Any) -> str:
  if isinstance(exported_or_text, str):
    return exported_or_text
  if isinstance(exported_or_text, jax.export.Exported):
    return exported_or_text.mlir_module()
  if hasattr(exported_or_text, "as_text"):  # jax.stages.Lowered
    return exported_or_text.as_text()
  raise TypeError(
      "custom_call_targets expects a jax.export.Exported, a jax.stages.Lowered"
      f" or MLIR text; got {type(exported_or_text).__name__}."
  )


def custom_call_targets(exported_or_text: Any) -> set[str]:
  """The custom-call targets in an exported or lowered module (or MLIR text)."""
  text = _module_text(exported_or_text)
  targets = {a or b for a, b in _PRETTY.findall(text)}
  targets.update(_GENERIC.findall(text))
  return targets
