"""tokamax: fast accelerator kernels for JAX with XLA fallbacks."""

from tokamax import benchmarking
from tokamax import config
from tokamax._src.autotuning import AutotuningMissError, AutotuningResult, autotune
from tokamax._src.benchmarking import BenchmarkData, benchmark, standardize_function
from tokamax._src.export import DISABLE_JAX_EXPORT_CHECKS
from tokamax._src.op import BoundArguments, NoConfig, Op
from tokamax.ops.attention.api import dot_product_attention
from tokamax.ops.normalization.api import layer_norm

__version__ = "0.1.0"

__all__ = [
    "AutotuningMissError",
    "AutotuningResult",
    "BenchmarkData",
    "BoundArguments",
    "DISABLE_JAX_EXPORT_CHECKS",
    "NoConfig",
    "Op",
    "autotune",
    "benchmark",
    "benchmarking",
    "config",
    "dot_product_attention",
    "layer_norm",
    "standardize_function",
]
