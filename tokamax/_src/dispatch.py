"""Implementation registry and selection, for the forward pass and the gradient.

`implementation=None` tries the op's default order for the current target
(always ending in "xla"); a name or a list of names tries only those and raises
if none can handle the call. When the chosen forward's VJP cannot handle the
call, None falls back to another VJP that accepts the same residuals, else to
differentiating the XLA reference; a named implementation raises instead (when
the gradient is traced). Where no gradient is taken, None may run another
implementation's forward (`Op.preferred_for_inference`, `Op.inference`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from tokamax._src import op as op_lib
from tokamax._src import platform

OpFactory = Callable[[], op_lib.Op]

_REGISTRY: dict[str, dict[str, OpFactory]] = {}
_DEFAULT_ORDER: dict[str, Callable[[platform.Target], list[str]]] = {}


def register(op_name: str, implementation: str, factory: OpFactory) -> None:
  """Registers `factory` as `implementation` of `op_name` (replacing any)."""
  _REGISTRY.setdefault(op_name, {})[implementation] = factory


def unregister(op_name: str, implementation: str) -> None:
  _REGISTRY.get(op_name, {}).pop(implementation, None)


def set_default_order(
    op_name: str, order: Callable[[platform.Target], list[str]]
) -> None:
  _DEFAULT_ORDER[op_name] = order


def implementations(op_name: str) -> tuple[str, ...]:
  """Names of the registered implementations of `op_name`."""
  return tuple(_REGISTRY[op_name])


def default_order(op_name: str) -> list[str]:
  """Implementations tried by `implementation=None` on the current target."""
  order = list(_DEFAULT_ORDER[op_name](platform.current_target()))
  if order[-1:] != ["xla"]:
    order.append("xla")
  return order


def _requested(op_name: str, implementation: Any) -> tuple[list[str], bool]:
  if implementation is None:
    return default_order(op_name), False
  if isinstance(implementation, str):
    names = [implementation]
  elif isinstance(implementation, Sequence) and implementation and all(
      isinstance(n, str) for n in implementation
  ):
    names = list(implementation)
  else:
    raise TypeError(
        f"{op_name}: implementation must be None, a name or a non-empty list"
        f" of names; got {implementation!r}."
    )
  known = implementations(op_name)
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(
        f"{op_name}: unknown implementation(s) {unknown}; known: {list(known)}."
    )
  return names, True


def select(
    op_name: str, implementation: Any, args: tuple, kwargs: dict
) -> op_lib.BoundArguments:
  """Validates the arguments and returns them bound to the chosen op."""
  names, named = _requested(op_name, implementation)
  # The XLA reference validates and canonicalises; every implementation of
  # an op shares its canonical arguments.
  reference = _REGISTRY[op_name]["xla"]()
  ref_ba = reference.bind(*args, **kwargs)

  errors: list[NotImplementedError] = []
  supported: dict[str, op_lib.BoundArguments | None] = {}

  def bound_if_supported(name):
    """`ref_ba` bound to `name`'s op, or None where that refuses the call."""
    if name not in supported:
      op = _REGISTRY[op_name][name]()
      ba = dataclasses.replace(ref_ba, op=op)
      try:
        op.check_supported(ba)
        op.check_forward_mode(ba)
      except NotImplementedError as e:
        errors.append(e)
        ba = None
      supported[name] = ba
    return supported[name]

  i, ba = _first_preferred(
      names, bound_if_supported,
      (lambda ba: True) if named else (lambda ba: ba.op.preferred(ba)))
  if ba is not None:
    op = ba.op
    if not named and op.vjp is not None:
      _, inference = _first_preferred(
          names, bound_if_supported, lambda ba: ba.op.preferred_for_inference(ba))
      op = dataclasses.replace(
          op, vjp=_fallback_vjp(op, ba, names[i + 1:]),
          inference=None if inference is None or type(inference.op) is type(op)
          else inference.op)
      ba = dataclasses.replace(ba, op=op)
    return ba
  if len(errors) == 1:
    raise errors[0]
  raise ExceptionGroup(
      f"No implementation of {op_name} among {names} can handle this call",
      errors,
  )


def _first_preferred(names, bound_if_supported, prefers):
  """(index, the call bound to it) of the first op of `names` that supports
  the call and that `prefers` (the last name needs only support), or
  (None, None)."""
  for i, name in enumerate(names):
    ba = bound_if_supported(name)
    if ba is not None and (i + 1 == len(names) or prefers(ba)):
      return i, ba
  return None, None


def _fallback_vjp(
    op: op_lib.Op, ba: op_lib.BoundArguments, later: list[str]
) -> op_lib.Op:
  """`op.vjp` if it supports and prefers `ba`, else a later compatible VJP
  (preferred first), else autodiff of the XLA reference."""
  candidates = [op.vjp]
  for name in later:
    other = _REGISTRY[op.op_name][name]()
    if other.vjp is not None and other.residuals_kind == op.residuals_kind:
      candidates.append(other.vjp)
  supported = []
  for vjp in candidates:
    try:
      vjp.check_supported(ba)
    except NotImplementedError:
      continue
    supported.append(vjp)
  # The first preferred one; a supported but slower one beats autodiff.
  for vjp in supported:
    if vjp.preferred(ba):
      return vjp
  if supported:
    return supported[0]
  return op_lib.AutodiffVjp(forward=_REGISTRY[op.op_name]["xla"]())


def call(op_name: str, implementation: Any, args: tuple, kwargs: dict):
  """Selects an implementation and runs it."""
  ba = select(op_name, implementation, args, kwargs)
  return ba.restore(ba.op.call_bound(ba))
