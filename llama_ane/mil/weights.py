"""The weights stored in a saved package, read back by name: dense consts as they are, compressed
weights (constexpr ops) decompressed the way Core ML defines them.

This is what lets other code run exactly the weights an export ships (the torch backend builds its
modules from them), compressed or not, without the checkpoint they came from.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np

from .executor import _function_program, _young_collections
from .package import MilPackage, PackageError


def read_weights(path: Path, function: str, names: list[str]) -> dict[str, np.ndarray]:
    """The values of the ops named `names` in `function` of the package at `path`.

    A const gives its value; a constexpr op (a palettized or quantized weight) gives the dense
    weight its value inference computes, in the op's output dtype. Raises PackageError naming any
    name the function does not hold as a const or constexpr op.
    """
    package = MilPackage(Path(path))
    wanted = set(names)
    found: dict[str, np.ndarray] = {}
    with _young_collections():
        program = _function_program(package, function)
        for op in program.functions[function].operations:
            out = op.outputs[0].name if op.outputs else None
            if out not in wanted:
                continue
            if op.op_type == "const":
                found[out] = np.asarray(op.outputs[0].val)
            elif op.op_type.startswith("constexpr_"):
                found[out] = np.asarray(op.materialized_val_inference())
        del program
        gc.collect()  # a pymil program is a graph of reference cycles: free its copies of the weights now
    missing = sorted(wanted - set(found))
    if missing:
        raise PackageError(f"{package.name} ({function}) has no weights named {missing[:4]}"
                           + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    return found
