"""Build and save every package of an export, each in a short-lived worker process.

A worker reads only its package's tensors from the checkpoint (lazily, in the export dtype), builds
the package's MIL program with every function sharing those weights, writes the .mlpackage and
exits, so the memory it used goes back to the system before the next package starts. The parent
holds no weights at all. How many workers run at once is decided by the caller from cores and
memory (see budget.py); the largest packages go first so the workers finish together.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..errors import LlamaANEError
from ..contract.plan import ExportPlan, PackageSpec
from ..checkpoint.loader import Checkpoint

SPECIFICATION_VERSIONS = {"iOS16": 7, "macOS13": 7, "iOS17": 8, "macOS14": 8, "iOS18": 9, "macOS15": 9}


class ConversionError(LlamaANEError, RuntimeError):
    """A package could not be built; the message names it and what to try."""


@contextlib.contextmanager
def quiet_coremltools():
    """Silence coremltools' per-pass progress bars and info logging during our own progress bar."""
    from tqdm import tqdm
    from coremltools.converters.mil.mil.passes import pass_pipeline

    saved = pass_pipeline.tqdm
    logger = logging.getLogger("coremltools")
    level = logger.level
    pass_pipeline.tqdm = functools.partial(tqdm, disable=True)
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pass_pipeline.tqdm = saved
        logger.setLevel(level)


def importance_of(spec: PackageSpec, importance: dict[str, np.ndarray] | None):
    """Parameter name inside `spec`'s program -> its input channels' importance (see
    reference.activation_importance, keyed by HF layer), or None."""
    def find(name: str) -> np.ndarray | None:
        if not importance:
            return None
        if name.startswith("layers."):
            _, j, rest = name.split(".", 2)
            return importance.get(f"layers.{spec.layers[int(j)]}.{rest}")
        return importance.get("heads") if name.startswith("heads.") else None
    return find


def build_package(spec: PackageSpec, plan: ExportPlan, ckpt: Checkpoint, folder: Path,
                  importance: dict[str, np.ndarray] | None = None) -> Path:
    """Read `spec`'s weights, build its program and save it as `folder / spec.file`; `importance`
    weighs the LUT fits of compressed weights."""
    import coremltools as ct

    from .package_weights import PackageWeights
    from .programs import build_program, save_program

    o = plan.options
    dtype = np.float16 if o.precision == "fp16" else np.float32
    weights = PackageWeights(ckpt, dtype, list(spec.layers), plan.rope_positions, spec.rows)
    functions = {fn: plan.specs[spec.model][fn] for fn in spec.functions}
    with quiet_coremltools():
        prog = build_program(spec.model, functions, plan.config, weights, dtype=dtype,
                             opset=getattr(ct.target, o.target), layers=len(spec.layers),
                             context_length=o.context_length, suffix_length=o.suffix_length, rows=spec.rows,
                             compressions=plan.compression, importance=importance_of(spec, importance),
                             multifunction=o.multifunction)
        path = folder / spec.file
        save_program(prog, path, SPECIFICATION_VERSIONS[o.target], o.multifunction)
    return path


def start_without_sigint(proc: multiprocessing.process.BaseProcess) -> None:
    """Start `proc` with SIGINT blocked. Ctrl-C then reaches only this process, which stops its
    children itself: a child interrupted while it starts up would print a traceback of its own. The
    child calls `ignore_sigint` first thing."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


@contextlib.contextmanager
def deferred_sigint() -> Iterator[Callable[[], None]]:
    """Within it, Ctrl-C only sets a flag, and the `check()` it yields raises KeyboardInterrupt at a
    point of the caller's choosing. Raised wherever the main thread happened to be, the interrupt
    could land in a fork hook, which swallows it, and the export would go on. (Outside the main
    thread signals cannot be handled: `check` then does nothing.)"""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    hit: list[int] = []

    def check() -> None:
        if hit:
            raise KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, lambda *_: hit.append(1))
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)
    check()


def ignore_sigint() -> None:
    """In a child started by `start_without_sigint`: drop a pending Ctrl-C and ignore later ones."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _worker(spec: PackageSpec, plan: ExportPlan, ckpt: Checkpoint, folder: Path, scratch: Path, errors,
            importance) -> None:
    """Body of a forked worker: build one package, report a failure through `errors`."""
    ignore_sigint()  # the parent stops the workers on Ctrl-C
    import torch

    torch.set_num_threads(1)
    tempfile.tempdir = str(scratch)  # coremltools' temporary weight folders stay inside the export
    try:
        build_package(spec, plan, ckpt, folder, importance)
    except BaseException as exc:  # the parent turns this into a ConversionError
        errors.put(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
        os._exit(1)
    os._exit(0)


def _death(spec: PackageSpec, code: int) -> ConversionError:
    if code < 0:
        cause = (f"was killed by signal {-code}" + (" (most likely the out-of-memory killer)" if -code == 9 else ""))
    else:
        cause = f"exited with code {code}"
    return ConversionError(
        f"the worker building {spec.file} ({spec.dense_bytes / 1e9:.2f} GB of weights) {cause}; try "
        "--workers 1, a smaller --layers-per-chunk, or closing other programs")


def convert_all(plan: ExportPlan, ckpt: Checkpoint, folder: Path, *, workers: int,
                progress: Callable[[PackageSpec], None] | None = None,
                importance: dict[str, np.ndarray] | None = None) -> None:
    """Build every package of `plan` into `folder`, at most `workers` at a time (`importance`:
    see build_package).

    Raises ConversionError naming the package when a worker fails or dies; the caller removes
    `folder`. Without `fork` (Windows) the packages are built one by one in this process.
    """
    scratch = folder / ".scratch"
    scratch.mkdir(exist_ok=True)
    order = sorted(plan.packages, key=lambda p: -p.dense_bytes)
    try:
        if "fork" not in multiprocessing.get_all_start_methods():
            for spec in order:
                build_package(spec, plan, ckpt, folder, importance)
                if progress:
                    progress(spec)
            return
        _run_forked(order, plan, ckpt, folder, scratch, max(1, workers), progress, importance)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_forked(order: list[PackageSpec], plan: ExportPlan, ckpt: Checkpoint, folder: Path, scratch: Path,
                workers: int, progress, importance) -> None:
    ctx = multiprocessing.get_context("fork")
    errors = ctx.SimpleQueue()
    todo, running = list(order), {}
    with deferred_sigint() as check_interrupt:
        try:
            while todo or running:
                check_interrupt()
                while todo and len(running) < workers:
                    spec = todo.pop(0)
                    proc = ctx.Process(target=_worker, args=(spec, plan, ckpt, folder, scratch, errors, importance),
                                       name=f"build {spec.file}", daemon=True)
                    start_without_sigint(proc)
                    running[proc.sentinel] = (proc, spec)
                for sentinel in multiprocessing.connection.wait(list(running), timeout=0.2):
                    proc, spec = running.pop(sentinel)
                    proc.join()
                    if proc.exitcode != 0:
                        detail = errors.get() if proc.exitcode == 1 and not errors.empty() else None
                        if detail:
                            raise ConversionError(f"building {spec.file} failed: {detail}")
                        raise _death(spec, proc.exitcode)
                    if progress:
                        progress(spec)
        finally:
            for proc, _ in running.values():
                proc.kill()
                proc.join()
