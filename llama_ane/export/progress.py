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
            self.filled = dict.fromkeys(self.share, 0)
            total = sum(self.share.values())
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="export", dynamic_ncols=True)

    def _fill(self, file: str, amount: float) -> None:
        amount = min(int(amount), self.share[file] - self.filled[file])  # whole bytes: the bar ends at its total
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


LINE_EVERY_S = 5.0  # off a terminal: a progress line at most this often (and the first and last step's)


def duration(seconds: float) -> str:
    """"8 s", "3 min 05 s", "1 h 02 min"."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class StepProgress:
    """A phase of `total` counted steps with its ETA: a bar on a terminal (stderr), elsewhere a log
    line through `say` on the first and the last step and at most every LINE_EVERY_S seconds between,
    "auto: measuring 12/62 units, 40 s, ETA 2 min 47 s". Disabled: it shows nothing."""

    def __init__(self, desc: str, total: int, *, enabled: bool, say, unit: str = "step", stream=None):
        import sys
        import time

        self.desc, self.total, self.unit, self.say, self.enabled = desc, max(total, 1), unit, say, enabled
        self.done, self.t0, self.last = 0, time.perf_counter(), float("-inf")
        self.bar = None
        stream = sys.stderr if stream is None else stream
        if enabled and getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=desc, unit=unit, dynamic_ncols=True, leave=False, file=stream)

    def advance(self, note: str = "", count: int = 1) -> None:
        """`count` more steps done; `note` says which (shown beside the bar, or at the line's end)."""
        import time

        self.done = min(self.done + count, self.total)
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note)
            self.bar.update(count)
            return
        now = time.perf_counter()
        if not self.enabled or (now - self.last < LINE_EVERY_S and self.done not in (1, self.total)):
            return
        self.last = now
        spent = now - self.t0
        eta = spent / self.done * (self.total - self.done)
        self.say(f"{self.desc}: {self.done}/{self.total} {self.unit}s, {duration(spent)}, ETA {duration(eta)}"
                 + (f" ({note})" if note else ""))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
