"""Error-compensating assignment of LUT codes (GPTQ's column order, with a fixed table per row).

Rounding every weight to its nearest LUT value ignores that the layer's output error is
X (W - Q): an error in one input column can be partly cancelled by moving the later columns,
through the inputs' second moments H = X^T X. GPTQ (Frantar et al., 2022) quantizes the columns
one by one and spreads each column's error over the columns not yet quantized, with the rows of
the inverse of H's Cholesky factor. Here the grid of each row is the values its LUT can take
(a grouped LUT, optionally scaled and shifted per row: any per-row set of values works), so the
codes stay what Core ML's constexpr_lut_to_dense reads.
"""

from __future__ import annotations

import numpy as np
import torch

DAMPING = 0.01  # of the mean of H's diagonal, added to it: keeps the factorisation stable
BLOCK = 128  # columns whose updates are applied to the rest at once


def inverse_factor(hessian: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """The upper Cholesky factor of H^-1 (H damped: `damping` times the mean of its diagonal
    added to it), float64."""
    h = hessian.to(torch.float64).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    h += damping * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


def assign(weight: np.ndarray, values: np.ndarray, hessian: torch.Tensor, damping: float = DAMPING,
           factor: torch.Tensor | None = None) -> np.ndarray:
    """Codes (uint8, weight's shape (out, in)) into each row's ascending `values` (out, K), chosen
    column by column with each column's rounding error compensated in the later ones. `factor`:
    `inverse_factor(hessian, damping)` when already found."""
    w = torch.from_numpy(np.array(weight, np.float32))  # float32 updates (the factor is found in float64)
    grid = torch.from_numpy(np.asarray(values, np.float32))
    midpoints = ((grid[:, 1:] + grid[:, :-1]) / 2).contiguous()
    factor = (inverse_factor(hessian, damping) if factor is None else factor).to(torch.float32)
    rows, cols = w.shape
    codes = torch.empty(rows, cols, dtype=torch.long)
    for start in range(0, cols, BLOCK):
        end = min(cols, start + BLOCK)
        block = w[:, start:end].clone()
        errors = torch.zeros_like(block)
        f = factor[start:end, start:end]
        for i in range(end - start):
            column = block[:, i]
            code = (midpoints < column[:, None]).sum(1)  # searchsorted's left index, faster for so few values
            codes[:, start + i] = code
            error = (column - grid.gather(1, code[:, None]).squeeze(1)) / f[i, i]
            block[:, i:] -= error[:, None] * f[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ factor[start:end, end:]
    return codes.numpy().astype(np.uint8)
