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
    """The upper Cholesky factor U of H^-1 (U^T U = H^-1; H damped: `damping` times the mean of its
    diagonal added to it), float64. With P the reversal of H's order, P H P = L L^T gives
    U = P L^-1 P: one factorisation and one triangular solve."""
    h = hessian.to(torch.float64).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    h += damping * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype)
    low = torch.linalg.cholesky(h.flip(0, 1))
    return torch.linalg.solve_triangular(low, torch.eye(h.shape[0], dtype=h.dtype), upper=False).flip(0, 1)


def assign(weight: np.ndarray, values: np.ndarray, hessian: torch.Tensor, damping: float = DAMPING,
           factor: torch.Tensor | None = None) -> np.ndarray:
    """Codes (uint8, weight's shape (out, in)) into each row's ascending `values` (out, K), chosen
    column by column with each column's rounding error compensated in the later ones. `factor`:
    `inverse_factor(hessian, damping)` when already found."""
    wt = torch.from_numpy(np.array(np.asarray(weight, np.float32).T, order="C"))  # (in, out), a copy: float32
    # updates, a column contiguous
    grid = torch.from_numpy(np.asarray(values, np.float32))
    midpoints = ((grid[:, 1:] + grid[:, :-1]) / 2).contiguous()
    factor = (inverse_factor(hessian, damping) if factor is None else factor).to(torch.float32)
    cols, rows = wt.shape
    codes = torch.empty(cols, rows, dtype=torch.long)
    for start in range(0, cols, BLOCK):
        end = min(cols, start + BLOCK)
        block = wt[start:end].clone()
        errors = torch.zeros_like(block)
        f = factor[start:end, start:end]
        for i in range(end - start):
            column = block[i]
            code = torch.searchsorted(midpoints, column[:, None]).squeeze(1)  # each row's nearest value (left on ties)
            codes[start + i] = code
            error = (column - grid.gather(1, code[:, None]).squeeze(1)) / f[i, i]
            block[i:] -= f[i, i:, None] * error[None, :]
            errors[i] = error
        wt[end:] -= factor[start:end, end:].T @ errors
    return codes.T.numpy().astype(np.uint8)
