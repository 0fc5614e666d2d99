"""tokamax: fast accelerator kernels for JAX with XLA fallbacks."""

from tokamax._src.op import BoundArguments, NoConfig, Op
from tokamax.ops.attention.api import dot_product_attention
from tokamax.ops.normalization.api import layer_norm

__version__ = "0.1.0"

__all__ = [
    "BoundArguments",
    "NoConfig",
    "Op",
    "dot_product_attention",
    "layer_norm",
]
