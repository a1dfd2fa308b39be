"""Trace each module and convert it with coremltools to an mlprogram; merge functions into packages.

One conversion job per (model, function). On iOS18/macOS15 targets the functions of a model are
merged into one multifunction package whose functions share weights; on older targets each
function becomes its own package.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import tempfile
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch



@dataclass(frozen=True)
class Job:
    model: str
    function: str
    module: torch.nn.Module
    io: dict  # {"inputs": [...], "outputs": [...]} from specs


def example_inputs(io: dict, context_length: int) -> tuple[torch.Tensor, ...]:
    """Valid trace inputs for a spec: small ids and positions, random floats."""
    g = torch.Generator().manual_seed(0)
    out = []
    for t in io["inputs"]:
        if t["dtype"] == "int32":
            high = 2 if t["name"] == "input_ids" else max(2, context_length // 2)
            out.append(torch.randint(0, high, t["shape"], dtype=torch.int32, generator=g))
        else:
            out.append(torch.randn(t["shape"], generator=g) * 0.1)
    return tuple(out)


@contextlib.contextmanager
def quiet_coremltools():
    """Silence coremltools' per-op progress bars and info warnings during our own progress bar."""
    from tqdm import tqdm
    from coremltools.converters.mil.frontend.torch import ops
    from coremltools.converters.mil.mil.passes import pass_pipeline

    saved = ops._tqdm, pass_pipeline.tqdm
    logger = logging.getLogger("coremltools")
    level = logger.level
    ops._tqdm = pass_pipeline.tqdm = functools.partial(tqdm, disable=True)
    logger.setLevel(logging.ERROR)
    try:
        with validate_once_per_pipeline():
            yield
    finally:
        ops._tqdm, pass_pipeline.tqdm = saved
        logger.setLevel(level)


@contextlib.contextmanager
def validate_once_per_pipeline():
    """Validate the MIL program once after each pass pipeline instead of after each of its ~100 passes.

    coremltools re-validates the whole program after every graph pass; on a 30-layer chunk that is
    a third of the conversion time. A program a pass broke is still caught, at the end of its
    pipeline, and the saved artifact is then checked again by `validate_export` and `verify`.
    """
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager
    from coremltools.converters.mil.mil.program import Program

    real_apply, real_validate = PassPipelineManager.apply_pipeline, Program.validate

    def apply_pipeline(prog, pass_pipeline):
        Program.validate = lambda self, *args, **kwargs: None
        try:
            real_apply(prog, pass_pipeline)
        finally:
            Program.validate = real_validate
        prog.validate()

    PassPipelineManager.apply_pipeline = staticmethod(apply_pipeline)
    try:
        yield
    finally:
        PassPipelineManager.apply_pipeline = staticmethod(real_apply)


def _np_dtype(name: str):
    return {"int32": np.int32, "float16": np.float16, "float32": np.float32}[name]


def convert_job(job: Job, context_length: int, target: str, precision: str, path: Path) -> None:
    """Trace `job.module` on example inputs and save the converted mlprogram at `path`."""
    import coremltools as ct

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(job.module.float().eval(), example_inputs(job.io, context_length), check_trace=False)
    inputs = [ct.TensorType(name=t["name"], shape=t["shape"], dtype=_np_dtype(t["dtype"])) for t in job.io["inputs"]]
    outputs = [ct.TensorType(name=t["name"], dtype=_np_dtype(t["dtype"])) for t in job.io["outputs"]]
    mlmodel = ct.convert(
        traced, inputs=inputs, outputs=outputs, convert_to="mlprogram",
        minimum_deployment_target=getattr(ct.target, target),
        compute_precision=ct.precision.FLOAT16 if precision == "fp16" else ct.precision.FLOAT32,
        skip_model_load=True)
    mlmodel.save(str(path))


def package_name(model: str, function: str | None, multifunction: bool) -> str:
    return f"{model}.mlpackage" if multifunction else f"{model}_{function}.mlpackage"


def convert_all(jobs: list[Job], out: Path, *, context_length: int, target: str, precision: str,
                multifunction: bool, progress: Callable[[str], None] | None = None
                ) -> dict[tuple[str, str], tuple[str, str]]:
    """Convert every job into `out`. Returns (model, function) -> (file name, function name in file)."""
    import coremltools as ct

    files: dict[tuple[str, str], tuple[str, str]] = {}
    with quiet_coremltools(), tempfile.TemporaryDirectory(prefix="llama-ane-convert-", dir=out) as tmp:
        paths = [(Path(tmp) if multifunction else out) / package_name(j.model, j.function, False) for j in jobs]
        for i in _convert_in_parallel(jobs, paths, context_length, target, precision):
            if progress:
                progress(f"converted {jobs[i].model}/{jobs[i].function}")
        singles: dict[str, list[tuple[str, Path]]] = {}
        for job, path in zip(jobs, paths):
            singles.setdefault(job.model, []).append((job.function, path))
            if not multifunction:
                files[(job.model, job.function)] = (path.name, "main")
        if multifunction:
            for model, functions in singles.items():
                name = package_name(model, None, True)
                desc = ct.utils.MultiFunctionDescriptor()
                for fn, path in functions:
                    desc.add_function(str(path), src_function_name="main", target_function_name=fn)
                desc.default_function_name = functions[-1][0]
                ct.utils.save_multifunction(desc, str(out / name))
                if progress:
                    progress(f"merged {model} ({len(functions)} functions)")
                for fn, _ in functions:
                    files[(model, fn)] = (name, fn)
    return files


_FORKED: tuple | None = None  # the jobs, as seen by forked workers (inherited, never pickled)


def _convert_forked(i: int) -> int:
    # forked inside convert_all's quiet_coremltools(): the patched coremltools comes along
    jobs, paths, context_length, target, precision = _FORKED
    torch.set_num_threads(1)
    convert_job(jobs[i], context_length, target, precision, paths[i])
    return i


def _convert_in_parallel(jobs: list[Job], paths: list[Path], context_length: int, target: str, precision: str):
    """Convert jobs on every core (conversion is single-threaded Python); yield indices as they finish.

    Workers are forked so they inherit the modules instead of receiving pickled weights. Largest
    jobs (block chunks) go first so the cores finish together.
    """
    global _FORKED
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        for i in range(len(jobs)):
            convert_job(jobs[i], context_length, target, precision, paths[i])
            yield i
        return
    order = sorted(range(len(jobs)), key=lambda i: -sum(p.numel() for p in jobs[i].module.parameters()))
    _FORKED = (jobs, paths, context_length, target, precision)
    try:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = [pool.submit(_convert_forked, i) for i in order]
            for fut in as_completed(futures):
                yield fut.result()
    finally:
        _FORKED = None


def jobs_for(models, specs: dict) -> list[Job]:
    """One job per (model, function) in `specs`, with the module the torch backend also runs."""
    return [Job(model, fn, models.module(model, fn), io)
            for model, functions in specs.items() for fn, io in functions.items()]
