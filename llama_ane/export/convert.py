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

Workers fork where that is safe and spawn where it is not (macOS: see start_method), so what a
worker runs is plain data that pickles: a function of this module named as a string, and its
arguments, the checkpoint among them by reference. However the export ends, its workers end with
it: a stop signal is acted on between waits and stops them, and a worker whose export died
(SIGKILL included) ends itself (see _Lifeline).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..model.lm_head import vocab_splits
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


def importance_key(spec: PackageSpec, name: str) -> str | None:
    """The calibration's key (see reference.activation_importance, keyed by HF layer) of parameter
    `name` inside `spec`'s program, or None (a weight that is looked up, not multiplied)."""
    if name.startswith("layers."):
        _, j, rest = name.split(".", 2)
        return f"layers.{spec.layers[int(j)]}.{rest}"
    return "heads" if name.startswith("heads.") else None


def statistics_key(spec: PackageSpec, name: str, c) -> str | None:
    """The calibration's key a fit of parameter `name` as `c` reads: its importance, or its inputs'
    second moments (KEY.gram) for error-compensated codes; None for what has no inputs (a table)."""
    from ..quantize.fit import statistics_key as fitted_key

    return fitted_key(importance_key(spec, name), c)


def importance_of(spec: PackageSpec, importance: dict[str, np.ndarray] | None, compressions=lambda name: None):
    """Parameter name inside `spec`'s program -> its input channels' importance (or, for a form
    `compressions(name)` that is compensated, its inputs' second moments), or None."""
    def find(name: str) -> np.ndarray | None:
        c = compressions(name)
        key = statistics_key(spec, name, c) if c is not None else importance_key(spec, name)
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


def weight_rows(plan: ExportPlan) -> list[WeightRows]:
    """Every compressed weight of `plan`, package by package, cut into row blocks of at most about
    UNIT_WEIGHTS weights (whole LUT groups) where its rows are compressed independently."""
    pieces = []
    for spec in plan.packages:
        for name, shape in plan.compressed_weights(spec).items():
            c = plan.compression(name, spec)
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
        work[u.spec.file] = work.get(u.spec.file, 0) + u.weights * plan.compression(u.pieces[0].name, u.spec).bits
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
        c = plan.compression(name, spec)
        found = importance.get(statistics_key(spec, name, c)) if importance is not None and c.weighted else None
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
            payloads.append(Payload(plan.compression(name, spec), codes, np.load(folder / "table.npy"), codes.shape,
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
    weights = PackageWeights(ckpt, dtype, list(spec.layers), plan.rope_positions, spec.rows, o.context_length)
    if payloads is not None:
        weights = _WithPayloads(weights, load_payloads(plan, spec, payloads))
    functions = {fn: plan.specs[spec.model][fn] for fn in spec.functions}
    with quiet_coremltools(), fast_sub_byte_packing():
        prog = build_program(spec.model, functions, plan.config, weights, dtype=dtype,
                             opset=getattr(ct.target, o.target), layers=list(spec.layers),
                             context_length=o.context_length, suffix_length=o.suffix_length, rows=spec.rows,
                             compressions=lambda name: plan.compression(name, spec), importance=importance_of(spec, importance, lambda name: plan.compression(name, spec)),
                             multifunction=o.multifunction)
        path = folder / spec.file
        save_program(prog, path, SPECIFICATION_VERSIONS[o.target], o.multifunction)
    return path


# --- Workers: how they start, what they run, and how they die with the export ---------------------

START_METHOD_ENV = "LLAMA_ANE_START_METHOD"  # "fork" or "spawn": how workers start (default: start_method())
PDEATHSIG_ENV = "LLAMA_ANE_PDEATHSIG"  # "0": Linux workers rely on their parent watch alone, as macOS ones do
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
ORPHANED_EXIT = 70  # a worker's exit code when it finds its export gone


class Stopped(KeyboardInterrupt):
    """The export was stopped by SIGTERM or SIGHUP. A KeyboardInterrupt, so that everything that
    cleans up after Ctrl-C cleans up after it too; the command line turns it into one `Error:` line."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


def interruption(signum: int) -> KeyboardInterrupt:
    """What a stop signal raises: KeyboardInterrupt for Ctrl-C, Stopped for the others."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)


def start_method() -> str:
    """How workers start: `spawn` on macOS, where a process that has loaded torch and coremltools
    (and the system frameworks under them) cannot safely fork, and wherever fork is missing;
    `fork` elsewhere, which starts a worker in milliseconds with the parent's modules already
    imported (a spawned one imports torch and coremltools again, seconds each). The environment
    variable LLAMA_ANE_START_METHOD picks either."""
    methods = multiprocessing.get_all_start_methods()
    chosen = os.environ.get(START_METHOD_ENV) or ("fork" if sys.platform != "darwin" and "fork" in methods
                                                  else "spawn")
    if chosen not in ("fork", "spawn") or chosen not in methods:
        usable = [m for m in ("fork", "spawn") if m in methods]
        raise ConversionError(f"{START_METHOD_ENV}={chosen!r} is not a way to start workers here; "
                              f"set it to {' or '.join(usable)}, or unset it")
    return chosen


# Checkpoints hold open-file callables and do not pickle; a job names its checkpoint by where it
# came from instead. A forked worker finds the parent's opened checkpoint here (inherited); a
# spawned one opens it once from its source and keeps it for its later jobs.
_CHECKPOINTS: dict[str, Checkpoint] = {}


def _share(ckpt: Checkpoint) -> tuple[str, dict]:
    """How jobs name `ckpt` (registered here, for the workers this process forks from now on)."""
    key = f"{ckpt.source.get('kind')}:{ckpt.source.get('path')}"
    _CHECKPOINTS.setdefault(key, ckpt)
    return key, ckpt.source


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return _share(obj) if isinstance(obj, Checkpoint) else None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        from ..checkpoint.loader import load_checkpoint, source_path

        key, source = pid
        if key not in _CHECKPOINTS:
            _CHECKPOINTS[key] = load_checkpoint(source_path(source))
        return _CHECKPOINTS[key]


def pack(obj) -> bytes:
    """`obj` pickled for a worker, checkpoints by reference (see _CHECKPOINTS)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def unpack(data: bytes):
    return _Unpickler(io.BytesIO(data)).load()


@dataclass(frozen=True)
class _Task:
    """What a worker runs: a function of this module, by name, and its arguments, all data.
    By name, so that it pickles (no closures) and a forked worker calls whatever the module holds."""

    function: str
    args: tuple

    def run(self) -> None:
        globals()[self.function](*self.args)


def _calibrate(calibration: Callable[..., object], found: "SavedImportance") -> None:
    calibration(on_found=found.save)


@dataclass(frozen=True)
class _Job:
    """One piece of work for a worker: `task` in the child, `what` for errors, `spec` for progress.
    A build starts once its package's compression units are done, a compression unit once the
    statistics `keys` are saved (the parent decides: nothing here runs in a worker but `task`)."""

    what: str
    spec: PackageSpec | None
    task: _Task
    weights: int  # its size, for messages
    builds: bool = True  # builds `spec` (else compresses some of its weights, or calibrates)
    reusable: bool = False  # may run in a worker that ran jobs before it (see _reused_worker)
    keys: tuple[str, ...] = ()  # the calibration statistics it needs


POLL_SECONDS = 0.2  # how often jobs waiting for the calibration look again


@dataclass(frozen=True)
class _Lifeline:
    """What ties a worker's life to the export's. Linux: a parent-death signal (prctl), unless
    LLAMA_ANE_PDEATHSIG=0. Everywhere: a thread that blocks on the read end of a pipe whose only
    write end the export holds, and ends the worker when it reads end-of-file: the export is gone,
    however it died (macOS has no parent-death signal). A forked worker inherits that write end
    (`inherited`, its descriptor) and closes it first."""

    parent: int
    watch: multiprocessing.connection.Connection
    inherited: int | None
    pdeathsig: bool
    coremltools_log_level: int  # a spawned worker starts with logging unset

    def hold(self) -> None:
        if self.inherited is not None:
            os.close(self.inherited)
        if self.pdeathsig:
            _set_parent_death_signal()
        if os.getppid() != self.parent:  # gone before the signal was set
            os._exit(ORPHANED_EXIT)
        threading.Thread(target=self._watch, name="parent-watch", daemon=True).start()

    def _watch(self) -> None:
        try:
            self.watch.recv_bytes()  # the export never writes: this returns when its end closes
        except (EOFError, OSError):
            pass
        os._exit(ORPHANED_EXIT)


def _set_parent_death_signal() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux only; nothing elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this C library: the watch thread still works
        pass


def start_blocked(proc: multiprocessing.process.BaseProcess) -> None:
    """Start `proc` with the stop signals blocked. Ctrl-C then reaches only this process, which
    stops its children itself: a child interrupted while it starts up (a spawned one imports for
    seconds) would print a traceback of its own. The child calls `worker_signals` first thing; a
    spawned child keeps the mask across exec. (Windows has no signal masks.)"""
    if not hasattr(signal, "pthread_sigmask"):
        proc.start()
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def worker_signals() -> None:
    """In a child started by `start_blocked`: drop a pending Ctrl-C and ignore later ones (the
    export stops its workers itself); SIGTERM and SIGHUP end it as they would any process (a
    forked child would otherwise keep the export's handlers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in STOP_SIGNALS:
        if signum != signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))


@contextlib.contextmanager
def deferred_signals() -> Iterator[Callable[[], None]]:
    """Within it, Ctrl-C, SIGTERM and SIGHUP only set a flag, and the `check()` it yields raises
    KeyboardInterrupt (Ctrl-C) or Stopped at a point of the caller's choosing. Raised wherever the
    main thread happened to be, the interrupt could land in a fork hook, which swallows it, and the
    export would go on. A signal this process ignores (nohup's SIGHUP) stays ignored. (Outside the
    main thread signals cannot be handled: `check` then does nothing.)"""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    hit: list[int] = []

    def check() -> None:
        if hit:
            raise interruption(hit[0])
    with _handling(STOP_SIGNALS, lambda signum, _frame: hit.append(signum)):
        yield check
    check()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within it, SIGTERM and SIGHUP raise Stopped in the main thread, as Ctrl-C raises
    KeyboardInterrupt: what was half written is removed on the way out. For a command line; an
    ignored signal stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise Stopped(signum)
    with _handling([s for s in STOP_SIGNALS if s != signal.SIGINT], stop):
        yield


@contextlib.contextmanager
def _handling(signals, handler) -> Iterator[None]:
    """`handler` for each of `signals` that this process does not ignore; the previous handlers
    back afterwards."""
    previous = {s: signal.signal(s, handler) for s in signals if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, signal.SIG_DFL if before is None else before)


def _worker_setup(scratch: Path, lifeline: _Lifeline) -> None:
    """First thing in a worker."""
    worker_signals()
    lifeline.hold()
    logging.getLogger("coremltools").setLevel(lifeline.coremltools_log_level)
    import torch

    torch.set_num_threads(1)
    tempfile.tempdir = str(scratch)  # coremltools' temporary weight folders stay inside the export


def _fail(exc: BaseException, errors) -> None:
    """Report a job's failure through `errors` and end this worker (the parent turns it into a
    ConversionError)."""
    errors.put(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
    sys.stdout.flush()  # what the job printed (os._exit flushes nothing)
    os._exit(1)


def _worker(task: _Task | bytes, scratch: Path, errors, lifeline: _Lifeline) -> None:
    """Body of a worker for one job (`task`, packed for a spawned one): run it, report a failure
    through `errors`."""
    _worker_setup(scratch, lifeline)
    try:
        (task if isinstance(task, _Task) else unpack(task)).run()
    except BaseException as exc:
        _fail(exc, errors)
    sys.stdout.flush()
    os._exit(0)


def _reused_worker(conn, scratch: Path, errors, lifeline: _Lifeline) -> None:
    """Body of a worker that runs reusable jobs one after another: each packed task comes through
    `conn`, which gets back whether the worker stays for another once it is done; None ends the
    worker. Compression units are short, and a fresh process per unit faulted in all of its
    working memory again; this one keeps the memory it frees for its next job (see
    keep_freed_memory), and leaves once its private memory has grown by more than a compression
    worker's share of the memory plan (budget.COMPRESS_BYTES)."""
    from . import budget
    from ..memory import keep_freed_memory, private_bytes

    _worker_setup(scratch, lifeline)
    keep_freed_memory()
    start = private_bytes(os.getpid())
    while (packed := conn.recv()) is not None:
        try:
            unpack(packed).run()
        except BaseException as exc:
            _fail(exc, errors)
        sys.stdout.flush()
        stays = private_bytes(os.getpid()) - start <= budget.COMPRESS_BYTES
        conn.send(stays)
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
                calibration: Callable[..., object] | None = None, method: str | None = None) -> None:
    """Build every package of `plan` into `folder`, at most `workers` jobs at a time.
    `progress(spec)` follows each package built, `compressed(spec, weights)` each compression
    unit done (see compression_units). A package with compressed weights is built once all its
    units are done; the builds fill workers that would otherwise wait for the calibration or idle
    at the end.

    LUT and int4 fits are weighted by the calibration's statistics: `importance` when they are
    known, or `calibration(on_found=...)` (export.quality.calibrate) run as the first job, each unit starting
    as soon as the statistics of its weight are saved (the layers in order, the LM head last).

    Workers start by `method` ("fork" or "spawn"; default: start_method()); spawned ones need
    `calibration` to pickle (a module-level function or a partial of one). They stay in this
    process's process group, and die with this process however it ends (see _Lifeline). Ctrl-C,
    SIGTERM and SIGHUP stop them and raise KeyboardInterrupt (Stopped for the last two).

    Raises ConversionError naming the package when a worker fails or dies; the caller removes
    `folder`.
    """
    method = method or start_method()
    with deferred_signals() as check_interrupt:  # a stop signal from here on is acted on where it is safe
        _convert_all(plan, ckpt, folder, workers, progress, importance, compressed, calibration, check_interrupt,
                     method)


def _convert_all(plan: ExportPlan, ckpt: Checkpoint, folder: Path, workers: int,
                 progress: Callable[[PackageSpec], None] | None, importance: dict[str, np.ndarray] | None,
                 compressed: Callable[[PackageSpec, int], None] | None, calibration: Callable[..., object] | None,
                 check_interrupt: Callable[[], None], method: str) -> None:
    """The body of convert_all, with `check_interrupt()` raising a deferred stop signal."""
    scratch = folder / ".scratch"
    scratch.mkdir(exist_ok=True)
    _share(ckpt)
    units = compression_units(plan)
    jobs: list[_Job] = []
    pending = {spec.file: 0 for spec in plan.packages}  # compression units of each package not done yet
    found: dict[str, np.ndarray] | SavedImportance | None = importance
    if units:
        if calibration is not None:
            found = SavedImportance(scratch / "importance")
            jobs.append(_Job("calibrating", None, _Task("_calibrate", (calibration, found)), 0))
        for u in units:
            pending[u.spec.file] += 1
            first, last = u.pieces[0], u.pieces[-1]
            what = f"compressing {first.name}" + (f" to {last.name}" if last.name != first.name else "") + \
                f" of {u.spec.file}"
            keys = tuple(statistics_key(p.spec, p.name, c) for p in u.pieces
                         if (c := plan.compression(p.name, p.spec)).weighted)
            jobs.append(_Job(what, u.spec, _Task("compress_unit", (u, plan, ckpt, scratch, found)), u.weights,
                             builds=False, reusable=True, keys=keys))
    # a package is built as soon as its weights are compressed (builds come first once ready: the
    # largest build is the longest job, and the other workers go on compressing meanwhile)
    jobs[:0] = [_Job(f"building {spec.file}", spec,
                     _Task("build_package", (spec, plan, ckpt, folder, importance, scratch if units else None)),
                     spec.dense_bytes // 2)
                for spec in sorted(plan.packages, key=lambda p: -p.dense_bytes)]

    def ready(job: _Job) -> bool:
        if job.builds:
            return job.spec is None or pending[job.spec.file] == 0
        return not isinstance(found, SavedImportance) or all(found.has(key) for key in job.keys)

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
        if method == "fork":
            from .package_weights import PackageWeights  # noqa: F401 (and coremltools) imported once here, not in every worker
        check_interrupt()
        _run_workers(jobs, scratch, max(1, workers), ready, done, check_interrupt, method)
    finally:
        _CHECKPOINTS.clear()
        shutil.rmtree(scratch, ignore_errors=True)


def _never_ready(todo: list[_Job]) -> ConversionError:
    """The error when nothing runs and none of `todo` can start: a unit waits for statistics the
    calibration never saved (and the builds wait for that unit)."""
    waiting = next((job for job in todo if not job.builds), todo[0])
    return ConversionError(f"{waiting.what}: the calibration saved no statistics for it")


def _answered(conn) -> tuple[bool, bool]:
    """(whether a kept worker answered that its job is done, whether it stays for another job); a
    worker that did not answer ended (the pipe is closed)."""
    try:
        if conn.poll():
            return True, conn.recv()
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


def _run_workers(jobs: list[_Job], scratch: Path, workers: int, ready: Callable[[_Job], bool],
                 done: Callable[[_Job], None], check_interrupt: Callable[[], None], method: str) -> None:
    """Run `jobs` in workers started by `method`, at most `workers` processes at a time, each job
    once `ready(job)`: a reusable job in a worker kept for them (started when none is idle), any
    other in a fresh process of its own, which an idle kept worker makes room for.
    `check_interrupt()` raises a deferred stop signal (see deferred_signals) between waits."""
    ctx = multiprocessing.get_context(method)
    errors = ctx.SimpleQueue()
    watch, keep = ctx.Pipe(duplex=False)  # `keep` closes when this process dies: the workers' cue to go
    lifeline = _Lifeline(os.getpid(), watch, keep.fileno() if method == "fork" else None,
                         os.environ.get(PDEATHSIG_ENV, "1") != "0", logging.getLogger("coremltools").level)
    todo = list(jobs)
    running: list[_Running] = []
    idle: list[tuple] = []  # kept workers waiting for a job: (process, pipe)

    def start(target, args, what: str):
        proc = ctx.Process(target=target, args=args + (scratch, errors, lifeline), name=what[:60], daemon=True)
        start_blocked(proc)
        return proc

    def retire_idle() -> None:
        proc, conn = idle.pop()
        conn.send(None)
        _end(proc, conn)

    try:
        while todo or running:
            check_interrupt()
            while len(running) < workers and (job := next((j for j in todo if ready(j)), None)):
                todo.remove(job)
                if job.reusable:
                    while idle and not idle[-1][0].is_alive():  # gone while it waited: start another
                        _end(*idle.pop())
                    if idle:
                        proc, conn = idle.pop()
                    else:
                        conn, theirs = ctx.Pipe()
                        proc = start(_reused_worker, (theirs,), "compression worker")
                        theirs.close()
                    conn.send(pack(job.task))
                    running.append(_Running(proc, job, conn))
                else:
                    if len(running) + len(idle) >= workers:
                        retire_idle()
                    task = job.task if method == "fork" else pack(job.task)
                    running.append(_Running(start(_worker, (task,), job.what), job))
            if not running:  # nothing runs and nothing can start: what it waits for will never come
                raise _never_ready(todo)
            # a bounded wait, so that a deferred stop signal is acted on promptly
            finished = set(multiprocessing.connection.wait([w for r in running for w in r.waits()],
                                                           timeout=POLL_SECONDS))
            check_interrupt()  # before a worker the same signal ended is taken for a failure
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
                done(r.job)
        while idle:
            retire_idle()
    finally:
        for proc in [r.proc for r in running] + [proc for proc, _ in idle]:
            proc.kill()
            proc.join()
        keep.close()
        watch.close()
