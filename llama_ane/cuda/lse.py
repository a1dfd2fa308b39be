"""Log-sum-exp conventions: the CUDA path uses natural log; FlashInfer writes base 2.

FlashInfer's kernels keep scores in base 2 and return ``lse2 = log2(sum_i 2^(s_i log2 e))``, which is
``lse / ln 2``. vLLM and this package use ``lse = log(sum_i exp(s_i))``. Mixing the two in a merge
silently weights the states wrong, so every crossing goes through these two functions.
"""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def lse_base2_to_natural(lse2: torch.Tensor) -> torch.Tensor:
    """FlashInfer's base-2 LSE to natural log (multiply by ln 2). Any shape; float32 kept."""
    return lse2 * LN2


def lse_natural_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """Natural-log LSE to FlashInfer's base-2 convention (multiply by log2 e). Any shape."""
    return lse * LOG2E
