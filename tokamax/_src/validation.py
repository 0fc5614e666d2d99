"""Argument checks shared by the ops: clear errors before any computation."""

from __future__ import annotations

import numbers
from typing import Any

import jax.numpy as jnp


def check_array(op: str, name: str, x: Any) -> None:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(
        f"{op}: {name} must be an array, got {type(x).__name__}."
    )


def check_float_array(op: str, name: str, x: Any) -> None:
  check_array(op, name, x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
        f"{op}: {name} must have a floating-point dtype, got {x.dtype}."
    )


def check_int_array(op: str, name: str, x: Any) -> None:
  check_array(op, name, x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{op}: {name} must have an integer dtype, got {x.dtype}.")


def check_real(
    op: str, name: str, value: Any, *, min_value: float | None = None,
    positive: bool = False,
) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{op}: {name} must be a real number, got {value!r}.")
  value = float(value)
  if positive and not value > 0:
    raise ValueError(f"{op}: {name} must be positive, got {value}.")
  if min_value is not None and not value >= min_value:
    raise ValueError(f"{op}: {name} must be >= {min_value}, got {value}.")
  return value
