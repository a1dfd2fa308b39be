"""Build and save every package of an export, each in a short-lived worker process.

A worker reads only its package's tensors from the checkpoint (lazily, in the export dtype), builds
the package's MIL program with every function sharing those weights, writes the .mlpackage and
exits, so the memory it used goes back to the system before the next package starts. The parent
holds no weights at all. How many workers run at once is decided by the caller from cores and
memory (see budget.py); the largest jobs go first so the workers finish together.

Compressed exports first compress their weights in small units, a layer or a block of vocabulary
rows each (`compression_units`), spread over the same workers and saved into the export's scratch
folder: compression is most of their work, and a compressed package can hold many layers (all 16
of a 1B model in lut4), so compressing per package would leave all but one worker idle. Units run
in workers kept from one unit to the next (a fresh process per unit faulted in all of its working
memory again). Each package's build then reads its compressed weights back instead of the dense
ones.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import signal
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..chunks.models import vocab_splits
from ..chunks.plan import layer_shapes
from ..errors import LlamaANEError
from ..contract.plan import ExportPlan, PackageSpec
from ..contract.specs import model_kind
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


def importance_key(spec: PackageSpec, name: str) -> str | None:
    """The calibration's key (see reference.activation_importance, keyed by HF layer) of parameter
    `name` inside `spec`'s program, or None (a weight that is looked up, not multiplied)."""
    if name.startswith("layers."):
        _, j, rest = name.split(".", 2)
        return f"layers.{spec.layers[int(j)]}.{rest}"
    return "heads" if name.startswith("heads.") else None


def importance_of(spec: PackageSpec, importance: dict[str, np.ndarray] | None):
    """Parameter name inside `spec`'s program -> its input channels' importance, or None."""
    def find(name: str) -> np.ndarray | None:
        key = importance_key(spec, name)
        return importance.get(key) if importance and key else None
    return find


class SavedImportance:
    """The calibration's statistics as files in a folder, one per key, each written whole (under a
    temporary name, then renamed) as soon as the calibration finds it: the compression of a layer
    can start while later layers are still being calibrated."""

    def __init__(self, folder: Path):
        self.folder = folder

    def _file(self, key: str) -> Path:
        return self.folder / f"{key}.npy"

    def save(self, key: str, value: np.ndarray) -> None:
        self.folder.mkdir(exist_ok=True)
        part = self.folder / f".{key}.partial.npy"
        np.save(part, value)
        part.rename(self._file(key))

    def has(self, key: str | None) -> bool:
        return key is None or self._file(key).exists()

    def get(self, key: str | None) -> np.ndarray | None:
        return None if key is None else np.load(self._file(key))


@dataclass(frozen=True)
class WeightRows:
    """Rows [start, end) of weight `name` of package `spec` (its name in the package's program)."""

    spec: PackageSpec
    name: str
    start: int
    end: int
    weights: int  # how many weights

    @property
    def file(self) -> str:
        """The folder their payload is saved in (one .npy per array), inside the scratch folder."""
        return f"{self.spec.file}.{self.name}.{self.start:07d}"


@dataclass(frozen=True)
class CompressionUnit:
    """One compression job: consecutive weights (or rows of one) of a package, about UNIT_WEIGHTS
    weights in all."""

    pieces: tuple[WeightRows, ...]
    weights: int

    @property
    def spec(self) -> PackageSpec:
        return self.pieces[0].spec


UNIT_WEIGHTS = 1 << 24  # weights per compression job: a large weight is cut into row blocks, small ones grouped


def compressed_weights(plan: ExportPlan, spec: PackageSpec) -> dict[str, tuple[int, ...]]:
    """The compressed weights of package `spec` and their shapes (out, in): names as its program
    uses them ("layers.j.*" for the j-th layer of a chunk, "heads.j.weight" for vocabulary split j)."""
    cfg, kind = plan.config, model_kind(spec.model)
    if kind == "chunk":
        found = {f"layers.{j}.{name}": shape for j in range(len(spec.layers))
                 for name, shape in layer_shapes(cfg).items()}
    elif kind in ("embeddings", "embeddings_part"):
        found = {"embed_tokens.weight": (spec.rows[1] - spec.rows[0], cfg.hidden_size)}
    elif kind == "lm_head":
        splits = vocab_splits(cfg.vocab_size)
        starts = [sum(splits[:j]) for j in range(len(splits))]
        found = {f"heads.{j}.weight": (splits[j], cfg.hidden_size) for j in range(len(splits))
                 if spec.rows[0] <= starts[j] < spec.rows[1]}
    else:
        found = {}
    return {name: shape for name, shape in found.items() if plan.compression(name) is not None}


def weight_rows(plan: ExportPlan) -> list[WeightRows]:
    """Every compressed weight of `plan`, package by package, cut into row blocks of at most about
    UNIT_WEIGHTS weights (whole LUT groups) where its rows are compressed independently."""
    pieces = []
    for spec in plan.packages:
        for name, shape in compressed_weights(plan, spec).items():
            c = plan.compression(name)
            rows, row = shape[0], int(np.prod(shape[1:]))
            step = rows
            if c.kind == "int" or c.group_size:  # one LUT per tensor cannot be split
                align = c.group_size or 1
                step = max(align, UNIT_WEIGHTS // row // align * align)
            pieces += [WeightRows(spec, name, a, min(rows, a + step), (min(rows, a + step) - a) * row)
                       for a in range(0, rows, step)]
    return pieces


def compression_units(plan: ExportPlan) -> list[CompressionUnit]:
    """Every compression job of `plan`: consecutive pieces of one package (see weight_rows) grouped
    until they hold UNIT_WEIGHTS weights, so that a job's fixed costs (a process, reading, saving)
    stay small beside its k-means. The units of the package with the most compression work come
    first (its build, the longest, waits for all of them), then the next package's; in each, the
    largest units first."""
    units, group = [], []
    for piece in weight_rows(plan):
        if group and (group[0].spec != piece.spec or sum(p.weights for p in group) >= UNIT_WEIGHTS):
            units.append(CompressionUnit(tuple(group), sum(p.weights for p in group)))
            group = []
        group.append(piece)
    if group:
        units.append(CompressionUnit(tuple(group), sum(p.weights for p in group)))
    work = {}  # package -> its units' weights times bits: about what their k-means costs
    for u in units:
        work[u.spec.file] = work.get(u.spec.file, 0) + u.weights * plan.compression(u.pieces[0].name).bits
    return sorted(units, key=lambda u: (-work[u.spec.file], u.spec.file, -u.weights))


def compress_unit(unit: CompressionUnit, plan: ExportPlan, ckpt: Checkpoint, scratch: Path,
                  importance: dict[str, np.ndarray] | SavedImportance | None = None) -> None:
    """Read the rows of each weight of one unit, compress them (weighted by `importance`, when
    their compression uses it) and save each payload into `scratch`."""
    import torch

    from ..checkpoint.mapping import as_conv
    from .compressed import compress
    from .package_weights import PackageWeights

    for piece in unit.pieces:
        spec, name = piece.spec, piece.name
        if name.startswith("layers."):
            value = PackageWeights(ckpt, np.float16, list(spec.layers))(name)[piece.start:piece.end]
        elif name.startswith("heads."):  # rows of vocabulary split j: read only those of the output matrix
            first = sum(vocab_splits(plan.config.vocab_size)[:int(name.split(".")[1])])
            weights = PackageWeights(ckpt, np.float16, rows=(first + piece.start, first + piece.end))
            value = as_conv(torch.from_numpy(weights("lm_head_matrix"))).numpy()
        else:  # rows of this file's embedding table
            value = PackageWeights(ckpt, np.float16, rows=(spec.rows[0] + piece.start, spec.rows[0] + piece.end))(name)
        c = plan.compression(name)
        found = importance.get(importance_key(spec, name)) if importance is not None and c.weighted else None
        payload = compress(value, c, found)
        arrays = {"codes": payload.codes, "table": payload.table, "offset": payload.offset, "scale": payload.scale}
        part = scratch / (piece.file + ".partial")  # raw .npy files: no zip to checksum on either side
        part.mkdir()
        for key, array in arrays.items():
            if array is not None:
                np.save(part / f"{key}.npy", array)
        part.rename(scratch / piece.file)


def load_payloads(plan: ExportPlan, spec: PackageSpec, scratch: Path) -> dict:
    """The compressed weights of `spec` that compress_unit saved into `scratch`: name -> Payload."""
    from .compressed import Payload, join

    pieces: dict[str, list[WeightRows]] = {}
    for piece in weight_rows(plan):
        if piece.spec == spec:
            pieces.setdefault(piece.name, []).append(piece)
    found = {}
    for name, parts in pieces.items():
        payloads = []
        for piece in parts:
            folder = scratch / piece.file
            codes = np.load(folder / "codes.npy")
            offset, scale = (np.load(folder / f"{key}.npy") if (folder / f"{key}.npy").exists() else None
                             for key in ("offset", "scale"))
            payloads.append(Payload(plan.compression(name), codes, np.load(folder / "table.npy"), codes.shape,
                                    offset, scale))
        found[name] = join(payloads)
    return found


class _WithPayloads:
    """Weights of a package where those compressed beforehand come as their payloads."""

    def __init__(self, weights: Callable[[str], np.ndarray], payloads: dict):
        self.weights, self.payloads = weights, payloads

    def __call__(self, name: str):
        return self.payloads[name] if name in self.payloads else self.weights(name)


def build_package(spec: PackageSpec, plan: ExportPlan, ckpt: Checkpoint, folder: Path,
                  importance: dict[str, np.ndarray] | None = None, payloads: Path | None = None) -> Path:
    """Read `spec`'s weights, build its program and save it as `folder / spec.file`; `importance`
    weighs the LUT fits of compressed weights; `payloads`: the folder where compress_unit saved
    them (compressed here when None)."""
    import coremltools as ct

    from .compressed import fast_sub_byte_packing
    from .package_weights import PackageWeights
    from .programs import build_program, save_program

    o = plan.options
    dtype = np.float16 if o.precision == "fp16" else np.float32
    weights = PackageWeights(ckpt, dtype, list(spec.layers), plan.rope_positions, spec.rows)
    if payloads is not None:
        weights = _WithPayloads(weights, load_payloads(plan, spec, payloads))
    functions = {fn: plan.specs[spec.model][fn] for fn in spec.functions}
    with quiet_coremltools(), fast_sub_byte_packing():
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


@dataclass(frozen=True)
class _Job:
    """One piece of work for a worker: `run()` in the child, `what` for errors, `spec` for progress;
    it starts once `ready()`."""

    what: str
    spec: PackageSpec | None
    run: Callable[[], object]
    weights: int  # its size, for messages
    ready: Callable[[], bool] = lambda: True
    builds: bool = True  # builds `spec` (else compresses some of its weights, or calibrates)
    reusable: bool = False  # may run in a worker that ran jobs before it (see _reused_worker)


POLL_SECONDS = 0.2  # how often jobs waiting for the calibration look again


def _worker_setup(scratch: Path) -> None:
    """First thing in a forked worker."""
    ignore_sigint()  # the parent stops the workers on Ctrl-C
    import torch

    torch.set_num_threads(1)
    tempfile.tempdir = str(scratch)  # coremltools' temporary weight folders stay inside the export


def _fail(exc: BaseException, errors) -> None:
    """Report a job's failure through `errors` and end this worker (the parent turns it into a
    ConversionError)."""
    errors.put(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
    sys.stdout.flush()  # what the job printed (os._exit flushes nothing)
    os._exit(1)


def _worker(job: _Job, scratch: Path, errors) -> None:
    """Body of a forked worker for one job: run it, report a failure through `errors`."""
    _worker_setup(scratch)
    try:
        job.run()
    except BaseException as exc:
        _fail(exc, errors)
    sys.stdout.flush()
    os._exit(0)


def _reused_worker(jobs: list[_Job], conn, scratch: Path, errors) -> None:
    """Body of a forked worker that runs reusable jobs one after another: the index of each in
    `jobs` comes through `conn`, which gets back (index, whether the worker stays) once the job is
    done; None ends the worker. Compression units are short, and a fresh process per unit faulted in
    all of its working memory again; this one keeps the memory it frees for its next job (see
    keep_freed_memory), and leaves once its private memory has grown by more than a compression
    worker's share of the memory plan (budget.COMPRESS_BYTES)."""
    from . import budget
    from .memory import keep_freed_memory, private_bytes

    _worker_setup(scratch)
    keep_freed_memory()
    start = private_bytes(os.getpid())
    while (index := conn.recv()) is not None:
        try:
            jobs[index].run()
        except BaseException as exc:
            _fail(exc, errors)
        sys.stdout.flush()
        stays = private_bytes(os.getpid()) - start <= budget.COMPRESS_BYTES
        conn.send((index, stays))
        if not stays:
            break
    os._exit(0)


def _death(job: _Job, code: int) -> ConversionError:
    if code < 0:
        cause = (f"was killed by signal {-code}" + (" (most likely the out-of-memory killer)" if -code == 9 else ""))
    else:
        cause = f"exited with code {code}"
    return ConversionError(
        f"the worker {job.what} ({job.weights / 1e9:.2f} GB of weights) {cause}; try "
        "--workers 1, a smaller --layers-per-chunk, or closing other programs")


def convert_all(plan: ExportPlan, ckpt: Checkpoint, folder: Path, *, workers: int,
                progress: Callable[[PackageSpec], None] | None = None,
                importance: dict[str, np.ndarray] | None = None,
                compressed: Callable[[PackageSpec, int], None] | None = None,
                calibration: Callable[..., object] | None = None) -> None:
    """Build every package of `plan` into `folder`, at most `workers` jobs at a time.
    `progress(spec)` follows each package built, `compressed(spec, weights)` each compression
    unit done (see compression_units). A package with compressed weights is built once all its
    units are done; the builds fill workers that would otherwise wait for the calibration or idle
    at the end.

    LUT and int4 fits are weighted by the calibration's statistics: `importance` when they are
    known, or `calibration(on_found=...)` (api.calibrate) run as the first job, each unit starting
    as soon as the statistics of its weight are saved (the layers in order, the LM head last).

    Raises ConversionError naming the package when a worker fails or dies; the caller removes
    `folder`. Without `fork` (Windows) the jobs run one by one in this process.
    """
    with deferred_sigint() as check_interrupt:  # a Ctrl-C from here on is acted on where it is safe
        _convert_all(plan, ckpt, folder, workers, progress, importance, compressed, calibration, check_interrupt)


def _convert_all(plan: ExportPlan, ckpt: Checkpoint, folder: Path, workers: int,
                 progress: Callable[[PackageSpec], None] | None, importance: dict[str, np.ndarray] | None,
                 compressed: Callable[[PackageSpec, int], None] | None, calibration: Callable[..., object] | None,
                 check_interrupt: Callable[[], None]) -> None:
    """The body of convert_all, with `check_interrupt()` raising a deferred Ctrl-C."""
    scratch = folder / ".scratch"
    scratch.mkdir(exist_ok=True)
    units = compression_units(plan)
    jobs: list[_Job] = []
    pending = {spec.file: 0 for spec in plan.packages}  # compression units of each package not done yet
    if units:
        found = importance
        if calibration is not None:
            found = SavedImportance(scratch / "importance")
            jobs.append(_Job("calibrating", None, functools.partial(calibration, on_found=found.save), 0))

        def ready(unit: CompressionUnit) -> Callable[[], bool]:
            if not isinstance(found, SavedImportance):
                return lambda: True
            keys = [importance_key(p.spec, p.name) for p in unit.pieces if plan.compression(p.name).weighted]
            return lambda: all(found.has(key) for key in keys)

        def what(unit: CompressionUnit) -> str:
            first, last = unit.pieces[0], unit.pieces[-1]
            return f"compressing {first.name}" + (f" to {last.name}" if last.name != first.name else "") + \
                f" of {unit.spec.file}"

        for u in units:
            pending[u.spec.file] += 1
            jobs.append(_Job(what(u), u.spec, functools.partial(compress_unit, u, plan, ckpt, scratch, found),
                             u.weights, ready(u), builds=False, reusable=True))
    # a package is built as soon as its weights are compressed (builds come first once ready: the
    # largest build is the longest job, and the other workers go on compressing meanwhile)
    jobs[:0] = [_Job(f"building {spec.file}", spec,
                  functools.partial(build_package, spec, plan, ckpt, folder, importance, scratch if units else None),
                  spec.dense_bytes // 2, functools.partial(lambda file: pending[file] == 0, spec.file))
             for spec in sorted(plan.packages, key=lambda p: -p.dense_bytes)]

    def done(job: _Job) -> None:
        if job.spec is None:  # the calibration
            return
        if not job.builds:
            pending[job.spec.file] -= 1
            if compressed:
                compressed(job.spec, job.weights)
        elif progress:
            progress(job.spec)

    try:
        from .package_weights import PackageWeights  # noqa: F401 (and coremltools) imported once here, not in every worker

        check_interrupt()
        if "fork" not in multiprocessing.get_all_start_methods():
            todo = list(jobs)
            while todo:
                job = next((j for j in todo if j.ready()), None)
                if job is None:
                    raise _never_ready(todo)
                todo.remove(job)
                job.run()
                done(job)
                check_interrupt()
        else:
            _run_forked(jobs, scratch, max(1, workers), done, check_interrupt)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _never_ready(todo: list["_Job"]) -> ConversionError:
    """The error when nothing runs and none of `todo` can start: a unit waits for statistics the
    calibration never saved (and the builds wait for that unit)."""
    waiting = next((job for job in todo if not job.builds), todo[0])
    return ConversionError(f"{waiting.what}: the calibration saved no statistics for it")


def _answered(conn) -> tuple[bool, bool]:
    """(whether a kept worker sent back its job's index, whether it stays for another job); a
    worker that did not answer ended (the pipe is closed)."""
    try:
        if conn.poll():
            _, stays = conn.recv()
            return True, stays
    except EOFError:
        pass
    return False, False


@dataclass
class _Running:
    """A job under way: its process, and for a kept worker the pipe its answer comes through."""

    proc: multiprocessing.process.BaseProcess
    job: _Job
    conn: object = None

    def waits(self) -> list:
        """What `multiprocessing.connection.wait` watches for it: the process ending (a death, or
        a one-job worker done) and a kept worker's answer."""
        return [self.proc.sentinel] + ([self.conn] if self.conn is not None else [])


def _end(proc: multiprocessing.process.BaseProcess, conn=None) -> None:
    """Reap a worker that has ended or is ending, and close its pipe."""
    proc.join()
    if conn is not None:
        conn.close()


def _run_forked(jobs: list[_Job], scratch: Path, workers: int, done: Callable[[_Job], None] | None,
                check_interrupt: Callable[[], None]) -> None:
    """Run `jobs` in forked workers, at most `workers` processes at a time, each job once it is
    ready: a reusable job in a worker kept for them (started when none is idle), any other in a
    fresh process of its own, which an idle kept worker makes room for. `check_interrupt()`
    raises a deferred Ctrl-C (see deferred_sigint) between waits."""
    ctx = multiprocessing.get_context("fork")
    errors = ctx.SimpleQueue()
    index = {id(job): i for i, job in enumerate(jobs)}  # what a kept worker is sent
    todo = list(jobs)
    running: list[_Running] = []
    idle: list[tuple] = []  # kept workers waiting for a job: (process, pipe)

    def start(target, args, what: str):
        proc = ctx.Process(target=target, args=args, name=what[:60], daemon=True)
        start_without_sigint(proc)
        return proc

    def retire_idle() -> None:
        proc, conn = idle.pop()
        conn.send(None)
        _end(proc, conn)

    try:
        while todo or running:
            check_interrupt()
            while len(running) < workers and (job := next((j for j in todo if j.ready()), None)):
                todo.remove(job)
                if job.reusable:
                    while idle and not idle[-1][0].is_alive():  # gone while it waited: start another
                        _end(*idle.pop())
                    if idle:
                        proc, conn = idle.pop()
                    else:
                        conn, theirs = ctx.Pipe()
                        proc = start(_reused_worker, (jobs, theirs, scratch, errors), "compression worker")
                        theirs.close()
                    conn.send(index[id(job)])
                    running.append(_Running(proc, job, conn))
                else:
                    if len(running) + len(idle) >= workers:
                        retire_idle()
                    running.append(_Running(start(_worker, (job, scratch, errors), job.what), job))
            if not running:  # nothing runs and nothing can start: what it waits for will never come
                raise _never_ready(todo)
            # a bounded wait, so that a deferred Ctrl-C is acted on promptly
            finished = set(multiprocessing.connection.wait([w for r in running for w in r.waits()],
                                                           timeout=POLL_SECONDS))
            for r in [r for r in running if finished.intersection(r.waits())]:
                running.remove(r)
                answered, stays = _answered(r.conn) if r.conn is not None else (False, False)
                if stays:
                    idle.append((r.proc, r.conn))
                elif answered:  # done, and gone to give back what it held
                    _end(r.proc, r.conn)
                else:
                    _end(r.proc)
                    if r.proc.exitcode != 0 or r.conn is not None:
                        detail = errors.get() if r.proc.exitcode == 1 and not errors.empty() else None
                        if detail:
                            raise ConversionError(f"{r.job.what} failed: {detail}")
                        raise _death(r.job, r.proc.exitcode)
                if done:
                    done(r.job)
        while idle:
            retire_idle()
    finally:
        for proc in [r.proc for r in running] + [proc for proc, _ in idle]:
            proc.kill()
            proc.join()
