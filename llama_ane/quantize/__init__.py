"""Weight compression for exports: the schemes and where each target allows them (`schemes`), and
the numerics that produce the compressed arrays (`kmeans` for palettization LUTs, `linear` for
integer blocks). numpy and torch only: the exporter turns the arrays into Core ML constexpr ops.
"""

from .schemes import PARTS, SCHEMES, Compression, QuantizeError, QuantizeOptions, check_divides, stored_bytes

__all__ = ["PARTS", "SCHEMES", "Compression", "QuantizeError", "QuantizeOptions", "check_divides", "stored_bytes"]
