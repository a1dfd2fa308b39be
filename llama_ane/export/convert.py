"""Trace each module and convert it with coremltools to an mlprogram; merge functions into packages.

One conversion job per (model, function). On iOS18/macOS15 targets the functions of a model are
merged into one multifunction package whose functions share weights; on older targets each
function becomes its own package.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import tempfile
import warnings
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
        yield
    finally:
        ops._tqdm, pass_pipeline.tqdm = saved
        logger.setLevel(level)


def _np_dtype(name: str):
    return {"int32": np.int32, "float16": np.float16, "float32": np.float32}[name]


def convert_job(job: Job, context_length: int, target: str, precision: str, path: Path) -> None:
    """Trace `job.module` on example inputs and save the converted mlprogram at `path`."""
    import coremltools as ct

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(job.module.float().eval(), example_inputs(job.io, context_length))
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
        singles: dict[str, list[tuple[str, Path]]] = {}
        for job in jobs:
            name = package_name(job.model, job.function, False)
            path = (Path(tmp) if multifunction else out) / name
            convert_job(job, context_length, target, precision, path)
            if progress:
                progress(f"converted {job.model}/{job.function}")
            singles.setdefault(job.model, []).append((job.function, path))
            if not multifunction:
                files[(job.model, job.function)] = (name, "main")
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


def jobs_for(models, specs: dict) -> list[Job]:
    """One job per (model, function) in `specs`, with the module the torch backend also runs."""
    return [Job(model, fn, models.module(model, fn), io)
            for model, functions in specs.items() for fn, io in functions.items()]


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
