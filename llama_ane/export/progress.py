"""The export's progress bar, in bytes of the export as written."""

from __future__ import annotations

OVERHEAD_BYTES = 20_000_000  # a package's fixed work beside its weights' bytes (graph building, hashing)
COMPRESS_BYTES = 4  # a compressed weight's work in build bytes: its k-means is a few times its build


class ExportProgress:
    """A progress bar in bytes of the export as written: its total is the weights' bytes as stored
    (compressed ones at their packed size), which is about the folder's size. Each package's share
    fills as its work is done (its compression units, then its build), so the ETA follows the real
    work; a built package's share is complete."""

    def __init__(self, plan, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            from .convert import compression_units

            self.share = {p.file: p.weight_bytes for p in plan.packages}  # bytes of the bar each package fills
            self.work = {p.file: p.dense_bytes + OVERHEAD_BYTES for p in plan.packages}  # its work, in build bytes
            for u in compression_units(plan):
                self.work[u.spec.file] += COMPRESS_BYTES * u.weights
            self.filled = dict.fromkeys(self.share, 0.0)
            total = sum(self.share.values())
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="export", dynamic_ncols=True)

    def _fill(self, file: str, amount: float) -> None:
        amount = min(amount, self.share[file] - self.filled[file])
        self.filled[file] += amount
        self.bar.update(amount)

    def compressed(self, spec, weights: int) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"compressing for {spec.file}")
            self._fill(spec.file, self.share[spec.file] * COMPRESS_BYTES * weights / self.work[spec.file])

    def built(self, spec) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"built {spec.file}")
            self._fill(spec.file, self.share[spec.file])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
