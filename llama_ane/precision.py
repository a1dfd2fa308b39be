"""The export precisions and every name each goes by: the option and manifest "precision" ("fp16"),
the tensor dtype the manifest records and numpy knows ("float16"), the MIL dtype ("fp16"), the torch
dtype, and the bytes of one value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Precision:
    name: str  # --precision and the manifest's "precision"
    dtype: str  # the manifest's tensor dtype, numpy's name
    mil: str  # MIL's dtype name (cast's `dtype`, coremltools' types.<mil>)
    bytes: int

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def torch(self) -> Any:
        import torch

        return getattr(torch, self.dtype)


PRECISIONS = {p.name: p for p in (Precision("fp16", "float16", "fp16", 2), Precision("fp32", "float32", "fp32", 4))}


def precision_of(dtype: Any) -> Precision:
    """The precision of a name ("fp16"), a manifest dtype ("float16"), or a numpy or torch dtype."""
    if isinstance(dtype, str) and dtype in PRECISIONS:
        return PRECISIONS[dtype]
    name = str(dtype).removeprefix("torch.") if not isinstance(dtype, (type, np.dtype)) else np.dtype(dtype).name
    for p in PRECISIONS.values():
        if p.dtype == name:
            return p
    raise ValueError(f"no export precision has dtype {dtype!r}: use one of {sorted(PRECISIONS)}")


def mil_type(dtype: str) -> Any:
    """coremltools' MIL type of a manifest tensor dtype ("float16" -> types.fp16, "int32" -> types.int32)."""
    from coremltools.converters.mil.mil import types

    return types.int32 if dtype == "int32" else getattr(types, precision_of(dtype).mil)
