"""Peak memory of an export, foreseen from its plan before any weight is read, and the number of
workers that fit.

The estimate is a model fitted to measurements on this exporter (benchmarks/export_scale.py
prints the measured peak beside it): a parent process that holds no weights, plus for each
running worker the package it builds, held about twice (the arrays, and the weight blob as it is
serialized), plus the parity gate, which streams one package at a time but holds its weights in
fp16 and float32 side by side. A compressed package is built from codes of one byte per weight
(half its fp16 weights); before the builds, compression workers hold one unit of weights and the
k-means working set each (see convert.compression_units).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..errors import LlamaANEError
from ..contract.sizing import layer_weight_bytes
from ..contract.plan import ExportPlan, PackageSpec

GIB = 1 << 30
PARENT_BYTES = int(0.9 * GIB)  # python, torch, coremltools and the tokenizer, before any weight
WORKER_BYTES = int(0.25 * GIB)  # a forked worker's own pages beyond those it shares with the parent
SPAWNED_WORKER_BYTES = int(0.4 * GIB)  # a spawned worker (macOS) imports torch and coremltools itself
BUILD_FACTOR = 2.0  # peak bytes of building a package, per byte of its weights
VERIFY_FACTOR = 3.5  # peak bytes of verifying a package, per byte of its weights


class MemoryBudgetError(LlamaANEError, RuntimeError):
    """The export would not fit in memory; the message says what would."""


@dataclass(frozen=True)
class MemoryPlan:
    """The chosen worker count and the peaks it implies (bytes, estimates)."""

    workers: int
    build_peak: int
    verify_peak: int
    budget: int | None  # None: the available memory could not be read

    @property
    def peak(self) -> int:
        return max(self.build_peak, self.verify_peak)

    def describe(self) -> str:
        room = f" of {self.budget / GIB:.1f} GiB" if self.budget else ""
        return (f"{self.workers} worker(s), estimated peak {self.peak / GIB:.1f} GiB{room} "
                f"(build {self.build_peak / GIB:.1f}, verify {self.verify_peak / GIB:.1f})")


COMPRESS_BYTES = int(0.45 * GIB)  # a compression worker: one unit's fp16 weights and its k-means batch


def held_bytes(plan: ExportPlan, package: PackageSpec) -> int:
    """Bytes of weights a package's build holds: fp16 (or fp32) weights, compressed ones as their
    one-byte codes."""
    codes = sum(math.prod(shape) for shape in plan.compressed_weights(package).values())
    return package.dense_bytes - codes  # 2 bytes per fp16 weight, 1 per code


def worker_bytes(method: str) -> int:
    """A worker's own memory besides the weights it holds, by how workers start ("fork", "spawn")."""
    return WORKER_BYTES if method == "fork" else SPAWNED_WORKER_BYTES


def build_peak(plan: ExportPlan, workers: int, method: str = "fork") -> int:
    """Estimated peak while `workers` packages are built at once (the largest ones first), or
    while they compress weights, whichever is higher; workers started by `method`."""
    own = worker_bytes(method)
    sizes = sorted((held_bytes(plan, p) for p in plan.packages), reverse=True)[:max(1, workers)]
    build = PARENT_BYTES + sum(own + int(BUILD_FACTOR * s) for s in sizes)
    if not plan.options.quantize.active:
        return build
    return max(build, PARENT_BYTES + max(1, workers) * (own + COMPRESS_BYTES))


def verify_peak(plan: ExportPlan, verify: bool) -> int:
    """Estimated peak of the streamed parity gate (0 without it): one package at a time
    (Pipeline.score_streamed)."""
    if not verify:
        return 0
    return PARENT_BYTES + int(VERIFY_FACTOR * max(p.dense_bytes for p in plan.packages))


def _fits_chunk(plan: ExportPlan, budget: int, verify: bool, method: str) -> int | None:
    """The largest --layers-per-chunk whose packages fit `budget` with one worker, if any."""
    cfg, per_weight = plan.config, 2 if plan.options.precision == "fp16" else 4
    other = max((p.dense_bytes for p in plan.packages if not p.layers), default=0)
    factor = max(BUILD_FACTOR, VERIFY_FACTOR if verify else 0)
    for k in range(max(len(c) for c in plan.chunks) - 1, 0, -1):
        if PARENT_BYTES + worker_bytes(method) + factor * max(other, k * layer_weight_bytes(cfg, per_weight)) <= budget:
            return k
    return None


def plan_memory(plan: ExportPlan, *, available: int | None, max_memory: int | None = None,
                workers: int | None = None, verify: bool = True, cores: int | None = None,
                method: str = "fork") -> MemoryPlan:
    """Choose the worker count from cores and memory, or refuse with what would fit.

    `max_memory` (bytes) replaces the memory this machine reports as available; `workers` fixes
    the count instead of choosing it; `method` is how workers start (convert.start_method).
    Raises MemoryBudgetError before anything is converted.
    """
    budget = max_memory if max_memory is not None else (int(available * 0.9) if available else None)
    cores = cores or os.cpu_count() or 1
    limit = workers if workers is not None else min(cores, len(plan.packages))
    chosen = max(1, limit)
    if budget is not None and workers is None:
        while chosen > 1 and build_peak(plan, chosen, method) > budget:
            chosen -= 1
    result = MemoryPlan(chosen, build_peak(plan, chosen, method), verify_peak(plan, verify), budget)
    if budget is None or result.peak <= budget:
        return result
    where = "--max-memory" if max_memory is not None else "available memory"
    hints = []
    if chosen > 1:
        hints.append(f"--workers 1 (estimated {max(build_peak(plan, 1, method), result.verify_peak) / GIB:.1f} GiB)")
    if verify and result.verify_peak > budget and build_peak(plan, chosen, method) <= budget:
        hints.append(f"--no-verify (estimated {build_peak(plan, chosen, method) / GIB:.1f} GiB; run "
                     "`llama-ane verify` later on a larger machine)")
    k = _fits_chunk(plan, budget, verify, method)
    if k is not None:
        hints.append(f"--layers-per-chunk {k}")
    if max_memory is None:
        hints.append("--max-memory GiB to proceed with a budget you set")
    raise MemoryBudgetError(
        f"this export needs about {result.peak / GIB:.1f} GiB ({result.describe()}) but the {where} is "
        f"{budget / GIB:.1f} GiB; nothing was converted. What would fit: " + ("; ".join(hints) or
                                                                           "a machine with more memory"))
