"""numpy kernels for MIL ops, one module per family; importing this package registers them all."""

from . import elementwise, linear, reduction, tensor  # noqa: F401
from .registry import KERNELS, UnsupportedOpError

__all__ = ["KERNELS", "UnsupportedOpError"]
