"""The Op core: bound arguments, config resolution and gradient wiring.

An `Op` is a frozen dataclass. Subclasses declare:

* `array_args`: names of the (possibly None) array arguments, in order;
* `config_cls`: the frozen config dataclass (plain or pydantic);
* `_bind(*args, **kwargs)`: validate user arguments and return the canonical
  arguments (arrays and static values) plus a function that restores the
  user-facing output layout;
* `_fwd(**canonical, config, return_residuals) -> (out, residuals)`;
* optionally `vjp`, another Op computing gradients from the residuals.

The XLA reference of an op is the base class; kernels override `_fwd`,
`check_supported` and the config methods.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import ad
from jax._src.interpreters import batching

from tokamax._src import platform


@dataclasses.dataclass(frozen=True)
class NoConfig:
  """Config of ops that have nothing to tune."""


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or (
      hasattr(x, "shape") and hasattr(x, "dtype")
  )


def abstractify(x: Any) -> Any:
  """Arrays to ShapeDtypeStruct (hashable); everything else unchanged."""
  if x is None or not _is_array(x):
    return x
  return jax.ShapeDtypeStruct(tuple(x.shape), jnp.dtype(x.dtype))


def _key_value(x: Any) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    return {"shape": list(x.shape), "dtype": str(x.dtype)}
  if isinstance(x, dict):
    return {str(k): _key_value(v) for k, v in sorted(x.items())}
  if isinstance(x, (tuple, list)):
    return [_key_value(v) for v in x]
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  if isinstance(x, np.generic):
    return x.item()
  return repr(x)


@dataclasses.dataclass(frozen=True, eq=False)
class BoundArguments:
  """An op with validated, canonical arguments.

  Equality and hashing use the op's class, its config and the abstract
  (shape/dtype) arguments, so a `BoundArguments` is a cache key.

  Attributes:
    op: the op the arguments are bound to.
    arguments: canonical arguments by name (arrays, None, static values).
    restore: maps the canonical output back to the user's layout.
  """

  op: "Op"
  arguments: Mapping[str, Any]
  restore: Callable[[Any], Any] = dataclasses.field(
      default=lambda out: out, repr=False
  )
  # jax.vmap levels around the call (see vmap_levels); None: read them off
  # the arguments' tracers.
  vmap: tuple | None = dataclasses.field(default=None, repr=False)

  @property
  def abstract_arguments(self) -> dict[str, Any]:
    """The arguments with every array (also inside pytrees) abstracted."""
    return jax.tree.map(abstractify, dict(self.arguments))

  @property
  def vmap_levels(self) -> tuple:
    return self.vmap if self.vmap is not None else vmap_levels(self.arguments)

  def abstract(self) -> "BoundArguments":
    """A copy holding no arrays (safe to keep after tracing)."""
    return BoundArguments(
        self.op, self.abstract_arguments, self.restore, self.vmap_levels
    )

  @property
  def key(self) -> str:
    """A stable JSON key of the abstract arguments (and vmap levels).

    A VJP op's key leaves out its residuals, output and cotangent: their
    shapes follow from the forward arguments, while which residuals exist can
    depend on the forward's config (a tuned forward must not hide the VJP's
    tuned config).
    """
    ignored = VJP_INPUTS if self.op.is_vjp else ()
    payload = {
        k: _key_value(v) for k, v in self.abstract_arguments.items()
        if k not in ignored
    }
    levels = [
        (size, [(p, a) for p, a in axes if p.split("'")[1] not in ignored])
        for size, axes in self.vmap_levels
    ]
    if levels:
      payload["__vmap__"] = [
          {"size": size, "axes": dict(axes)} for size, axes in levels
      ]
    return json.dumps(payload, sort_keys=True)

  def _identity(self):
    return (type(self.op), self.op.config, self.key)

  def __hash__(self) -> int:
    return hash(self._identity())

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, BoundArguments):
      return NotImplemented
    return self._identity() == other._identity()

  @property
  def arrays(self) -> dict[str, Any]:
    return {n: self.arguments[n] for n in self.op.array_args}

  @property
  def static(self) -> dict[str, Any]:
    return {
        n: v for n, v in self.arguments.items() if n not in self.op.array_args
    }


def vmap_levels(arguments: Mapping[str, Any]) -> tuple:
  """The jax.vmap levels a call is traced under, innermost first.

  Each level is (axis size, ((argument path, batch axis), ...)) for the
  arguments it maps; the per-example shapes are those the op sees. Read off
  the arguments' batching tracers (JAX internals; jax is pinned).
  """
  chains = {}
  for path, x in jax.tree_util.tree_flatten_with_path(dict(arguments))[0]:
    chain = []
    while isinstance(x, batching.BatchTracer):
      axis = x.batch_dim if isinstance(x.batch_dim, int) else None
      chain.append((x._trace, axis, None if axis is None else x.val.shape[axis]))
      x = x.val
    if chain:
      chains[jax.tree_util.keystr(path)] = chain
  # A trace's depth: how many vmap levels sit outside it (innermost = most).
  depth = {}
  for chain in chains.values():
    for i, (trace, _, _) in enumerate(chain):
      depth[trace] = max(depth.get(trace, 0), len(chain) - 1 - i)
  levels = []
  for trace in sorted(depth, key=lambda t: -depth[t]):
    axes, size = [], None
    for path, chain in sorted(chains.items()):
      for t, axis, n in chain:
        if t is trace and axis is not None:
          axes.append((path, axis))
          size = n
    if axes:
      levels.append((size, tuple(axes)))
  return tuple(levels)


def forward_mode(arguments: Mapping[str, Any]) -> bool:
  """Whether the call is traced under forward-mode autodiff at some level:
  jax.jvp and jax.jacfwd, also around jax.vmap or reverse mode (jax.hessian,
  a jvp of a grad). JAX cannot push tangents through a custom VJP, nor
  through our kernels. Read off the arguments' tracers (JAX internals; jax is
  pinned): through vmap's and linearize's tracers down to a jvp's. A jvp
  applied outside a jit or checkpoint around the call is not seen here (JAX
  then raises its own error), nor is jax.linearize (its tracers are
  reverse mode's).
  """
  for x in jax.tree.leaves(dict(arguments)):
    while True:
      if isinstance(x, ad.JVPTracer):
        return True
      if isinstance(x, batching.BatchTracer):
        x = x.val
      elif isinstance(x, ad.LinearizeTracer):
        x = x.primal
      else:
        break
  return False


# The leading arguments of every VJP op (see Op.call_bound).
VJP_INPUTS = ("residuals", "out", "dout")

# Config sources consulted between a pinned config and the heuristics, in
# order (autotuning contexts, caches). Each returns a config or None.
CONFIG_SOURCES: list[Callable[[BoundArguments], Any]] = []
# Called with (bound arguments, resolved config) each time an op is traced
# (autotuning records the ops a function runs this way).
CALL_OBSERVERS: list[Callable[[BoundArguments, Any], None]] = []


def resolve_config(ba: BoundArguments) -> Any:
  """Pinned config, else the first config source that answers, else heuristics."""
  if ba.op.config is not None:
    return ba.op.config
  for source in CONFIG_SOURCES:
    config = source(ba)
    if config is not None:
      return config
  return ba.op._get_heuristics_config(ba)


@dataclasses.dataclass(frozen=True)
class Op(abc.ABC):
  """Base class of every tokamax op and implementation.

  Attributes:
    config: a pinned config; None resolves one per call (see resolve_config).
    vjp: the op computing gradients from this op's residuals; None means JAX
      differentiates `_fwd` itself.
    skip_grads: for a VJP op, the forward's arrays that are not being
      differentiated (set per call by the forward's custom VJP); the op may
      skip computing their gradients and return None for them.
    inference: the op whose forward runs where no gradient is taken (set by
      `implementation=None` where another implementation is faster without
      a gradient, see `preferred_for_inference`); None: this op's.
  """

  config: Any = None
  vjp: "Op | None" = None
  skip_grads: frozenset[str] = frozenset()
  inference: "Op | None" = None

  op_name: ClassVar[str] = "op"
  implementation: ClassVar[str] = "xla"
  array_args: ClassVar[tuple[str, ...]] = ()
  config_cls: ClassVar[type] = NoConfig
  # Ops whose VJPs accept each other's residuals share a residuals_kind.
  residuals_kind: ClassVar[str | None] = None
  # For VJP ops: whether the forward output must be saved for the gradient.
  uses_out: ClassVar[bool] = True
  # VJP ops take (residuals, out, dout, *forward arguments).
  is_vjp: ClassVar[bool] = False
  # Whether a call with no cached config may take the nearest cached shape's
  # (autotuning.lookup); False where the heuristic beats borrowed configs.
  borrows_nearest_config: ClassVar[bool] = True
  # Whether JAX can differentiate `_fwd` itself (jax.numpy and lax only, no
  # kernels or custom VJPs inside). Forward-mode autodiff cannot pass the
  # custom VJP that wires `vjp`, so under jax.jvp/jax.jacfwd such an op runs
  # `_fwd` plainly and an op with a `vjp` but without this refuses the call.
  differentiable_forward: ClassVar[bool] = False

  def __post_init__(self):
    if self.config is not None and not isinstance(self.config, self.config_cls):
      raise TypeError(
          f"{type(self).__name__}.config must be a {self.config_cls.__name__},"
          f" got {type(self.config).__name__}."
      )

  # --- subclass API ------------------------------------------------------

  @abc.abstractmethod
  def _bind(
      self, *args, **kwargs
  ) -> tuple[dict[str, Any], Callable[[Any], Any]]:
    """Validates user arguments; returns (canonical arguments, restore)."""

  @abc.abstractmethod
  def _fwd(self, *, config: Any, return_residuals: bool, **kwargs):
    """Computes (out, residuals) from canonical arguments."""

  def _get_heuristics_config(self, ba: BoundArguments) -> Any:
    del ba
    return self.config_cls()

  def _get_autotuning_configs(self, ba: BoundArguments) -> set[Any]:
    """The autotuning search space (the heuristic config is always added)."""
    del ba
    return set()

  def supported_on(self, device: platform.Target | jax.Device) -> bool:
    """Whether this implementation can run on `device` at all."""
    del device
    return True

  def check_supported(self, ba: BoundArguments) -> None:
    """Raises NotImplementedError (with the reason) if `ba` is unsupported.

    For a VJP op, `ba` is the bound arguments of the forward op.
    """
    target = platform.current_target()
    if not self.supported_on(target):
      raise self.unsupported(f"does not run on {target.describe()}.")

  def preferred(self, ba: BoundArguments) -> bool:
    """Whether `implementation=None` should pick this op for `ba`.

    False where the op supports the call but was measured slower than the
    implementations after it in the default order (a named call still uses
    it). For a VJP op, `ba` is the bound arguments of the forward op.
    """
    del ba
    return True

  def preferred_for_inference(self, ba: BoundArguments) -> bool:
    """As `preferred`, for a call whose gradient is not taken (only the
    forward runs). `preferred` decides where the gradient is taken: there
    this op's forward also saves the residuals its VJP needs."""
    return self.preferred(ba)

  def describe(self) -> str:
    return f"{self.op_name} implementation {self.implementation!r}"

  def unsupported(self, reason: str) -> NotImplementedError:
    """The error for a call this implementation cannot handle."""
    return NotImplementedError(f"{self.describe()}: {reason}")

  # --- calling -----------------------------------------------------------

  def bind(self, *args, **kwargs) -> BoundArguments:
    arguments, restore = self._bind(*args, **kwargs)
    return BoundArguments(op=self, arguments=arguments, restore=restore)

  def check_forward_mode(self, ba: BoundArguments) -> None:
    """Raises NotImplementedError under forward-mode autodiff if this op's
    gradient is a custom VJP and JAX cannot differentiate its forward."""
    if (self.vjp is not None and not self.differentiable_forward
        and forward_mode(ba.arrays)):
      raise self.unsupported(
          "forward-mode autodiff (jax.jvp, jax.jacfwd, jax.hessian) cannot"
          " pass its custom VJP and kernels; implementation 'xla' supports it"
          " (None falls back to it)."
      )

  def __call__(self, *args, **kwargs):
    ba = self.bind(*args, **kwargs)
    self.check_supported(ba)
    self.check_forward_mode(ba)
    return ba.restore(self.call_bound(ba))

  def call_bound(self, ba: BoundArguments, *, return_residuals: bool = False):
    """Runs the op on canonical arguments (gradients via `self.vjp`)."""
    config = resolve_config(ba)
    for observer in CALL_OBSERVERS:
      observer(ba, config)
    static = ba.static
    if (self.vjp is None or return_residuals
        or (self.differentiable_forward and forward_mode(ba.arrays))):
      out, residuals = self._fwd(
          **ba.arrays, **static, config=config,
          return_residuals=return_residuals,
      )
      return (out, residuals) if return_residuals else out

    vjp_op = self.vjp
    # Which arrays are being differentiated, as run_fwd (always traced before
    # run_bwd) sees them: symbolic zeros mark the others.
    perturbed: dict[str, bool] = {}

    # JAX traces `run` only where no gradient is taken (else `run_fwd`):
    # there the inference op, if any, computes the output.
    @jax.custom_vjp
    def run(arrays):
      op, op_config = self, config
      if self.inference is not None:
        inference_ba = dataclasses.replace(ba, op=self.inference)
        op, op_config = self.inference, resolve_config(inference_ba)
        for observer in CALL_OBSERVERS:
          observer(inference_ba, op_config)
      out, _ = op._fwd(
          **arrays, **static, config=op_config, return_residuals=False
      )
      return out

    # A VJP that cannot read this op's residuals (e.g. the autodiff
    # fallback) gets none, and the forward runs without saving them.
    wants_residuals = vjp_op.residuals_kind == self.residuals_kind

    def run_fwd(primals):
      arrays = jax.custom_derivatives.custom_vjp_primal_tree_values(primals)
      is_primal = lambda y: isinstance(y, jax.custom_derivatives.CustomVJPPrimal)
      for n, x in primals.items():
        leaves = jax.tree.leaves(x, is_leaf=is_primal)
        if leaves:  # None (an absent optional array) has none
          perturbed[n] = any(p.perturbed for p in leaves)
      # Checked when the gradient is traced, before any kernel runs.
      vjp_op.check_supported(
          BoundArguments(op=self, arguments={**arrays, **static})
      )
      out, residuals = self._fwd(
          **arrays, **static, config=config, return_residuals=wants_residuals
      )
      return out, (residuals, out if vjp_op.uses_out else None, arrays)

    def run_bwd(saved, dout):
      residuals, out, arrays = saved
      if isinstance(dout, jax.custom_derivatives.SymbolicZero):
        return ({n: None for n in arrays},)
      skip = frozenset(n for n, p in perturbed.items() if not p)
      op = dataclasses.replace(vjp_op, skip_grads=skip) if skip else vjp_op
      grads = op.call_bound(op.bind(residuals, out, dout, **arrays, **static))
      return ({n: None if n in skip else grads.get(n) for n in arrays},)

    run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
    return run(_match_vma(ba.arrays))


def varying(a) -> frozenset:
  """Mesh axes over which `a` varies inside shard_map (empty outside)."""
  mat = getattr(jax.typeof(a), "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def vary_over(a, axes: frozenset):
  """`a` marked varying over the mesh axes `axes` too (inside shard_map)."""
  missing = tuple(sorted(axes - varying(a)))
  return jax.lax.pcast(a, missing, to="varying") if missing else a


def _match_vma(arrays: dict[str, Any]) -> dict[str, Any]:
  """Inside shard_map, makes every input vary over the same mesh axes.

  A custom VJP must return cotangents of its inputs' types; marking
  invariant inputs (e.g. a replicated scale) varying first lets JAX insert
  the psum of their cotangents outside the VJP (pcast's transpose).
  """
  leaves = [a for a in jax.tree.leaves(arrays)]
  vmas = [varying(a) for a in leaves]
  union = frozenset().union(*vmas)
  if not union:
    return arrays
  return jax.tree.map(lambda a: vary_over(a, union), arrays)


@dataclasses.dataclass(frozen=True)
class AutodiffVjp(Op):
  """VJP that differentiates the XLA reference `forward` from the primals.

  Used as the gradient fallback when a kernel's own VJP cannot handle a call;
  it ignores the residuals and recomputes the forward in XLA.
  """

  forward: Op | None = None

  @property
  def op_name(self) -> str:  # type: ignore[override]
    return self.forward.op_name

  implementation: ClassVar[str] = "xla"
  uses_out: ClassVar[bool] = False
  is_vjp: ClassVar[bool] = True

  def _bind(self, residuals, out, dout, **kwargs):
    arguments = dict(residuals=residuals, out=out, dout=dout, **kwargs)
    return arguments, lambda grads: grads

  @property
  def array_args(self) -> tuple[str, ...]:  # type: ignore[override]
    return ("residuals", "out", "dout") + tuple(self.forward.array_args)

  def _fwd(self, *, residuals, out, dout, config, return_residuals, **kwargs):
    del residuals, out, config, return_residuals
    names = self.forward.array_args
    arrays = {n: kwargs.pop(n) for n in names}
    diff = {
        n: a for n, a in arrays.items()
        if a is not None and jnp.issubdtype(a.dtype, jnp.inexact)
    }

    def f(diff_arrays):
      merged = {**arrays, **diff_arrays}
      return self.forward._fwd(
          **merged, **kwargs, config=self.forward.config_cls(),
          return_residuals=False,
      )[0]

    _, pullback = jax.vjp(f, diff)
    (grads,) = pullback(dout)
    return grads, None
