"""GPU timing for the CUDA-path benchmarks: L2 flushed before each call, median of many.

Each repetition zeroes a buffer larger than L2 (so no input is served from cache), then spins the
GPU briefly so that the host has queued the timed call before its start event fires: host-side
launch overhead (Python, argument checks) stays out of the number, for every library alike. The
time is between CUDA events around the call alone.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

FLUSH_BYTES = 256 * 1024 * 1024
# ~0.75 ms at H100 clocks: far longer than any wrapper's host overhead, so that a host-side
# hiccup cannot open a gap between the queued call and its start event (without the spin,
# identical plans timed back to back differed by up to 2x at a few grid points)
SPIN_CYCLES = 1_500_000


class Timer:
    """Reusable flush buffer and events on the current CUDA device."""

    def __init__(self, reps: int = 30) -> None:
        if reps < 20:
            raise ValueError("take the median of at least 20 runs")
        self.reps = reps
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def median_ms(self, fn: Callable[[], object], warmup: int = 3) -> float:
        """Median milliseconds of ``fn()`` over ``self.reps`` runs, each after an L2 flush."""
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for s, e in zip(starts, ends):
            self.flush.zero_()
            torch.cuda._sleep(SPIN_CYCLES)
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
