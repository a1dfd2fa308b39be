"""Read and execute saved Core ML programs (.mlpackage, mlprogram) with numpy, on any OS.

- `package`: open a package (spec, functions, I/O, weight locations, pymil program).
- `executor`: compile each function into numpy kernels and run it (`PackageExecutor`).
- `kernels`: the op implementations; `numerics`: the fp16 / fp32 policy.
"""

from .executor import ExecutionError, PackageExecutor
from .kernels.registry import UnsupportedOpError
from .numerics import Numerics
from .package import MilPackage, PackageError, TensorDesc

__all__ = [
    "ExecutionError",
    "MilPackage",
    "Numerics",
    "PackageError",
    "PackageExecutor",
    "TensorDesc",
    "UnsupportedOpError",
]
