"""Measuring an export where it runs, beside what the device cost model predicts for it.

`run_bench` loads an export with one backend and times what `contract/device_model.py` models:
the time to first token and prefill tokens/s of prompts of given lengths, decode tokens/s after
given numbers of cached positions (each in the context bucket that holds them), cascade steps of B
branches over those prefixes, the Core ML calls each step makes (counted at the backend's
`predict`) and the process's peak memory. Each measurement runs its warm-up samples first (timed
and reported apart, never in the median) and then `repeats` samples; the median is the number.

The backend runs as a device runs the export: a torch backend is loaded with `direct_cache=False`,
so the cache-update model writes the K/V in the background and a step makes the calls the device
makes. Only the coreml backend (macOS) measures a device; the result says so in "device", and
with Core ML it also carries the compute plan: where Core ML plans to run each op of each package
and function (Neural Engine, GPU or CPU). Prompts are random token ids: a step's cost depends on
the shapes, not on the tokens.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from .._version import __version__
from ..contract import device_model as dm
from ..contract import resident as rs
from ..contract.manifest import context_buckets, kv_cache_kind, model_names, read_manifest
from ..contract.specs import BRANCHES, bucket_function
from ..contract.traffic import bucket_for
from ..errors import InvalidArgumentError
from ..memory import PeakMemory, wired_bytes
from .backends.base import Backend
from .model import LlamaANEModel, make_backend

BENCH_FORMAT = 1  # the version of the JSON `run_bench` returns
NOT_DEVICE = ("Not device numbers: the {backend} backend ran the export on the host's CPU, not on an Apple "
              "Neural Engine; run `llama-ane bench` on a Mac (backend coreml) for device numbers")
DEVICE = "Device numbers: Core ML ran the export with compute units {units}"
DECODE_TOKENS = 8  # decode tokens per timed sample (fewer where the context bucket ends sooner)
MEMORY_INTERVAL_S = 0.05  # how often the peak-memory sampler looks


@dataclass(frozen=True)
class BenchOptions:
    """What to measure. `branches` None: the export's cascade width (none without a cascade); 0: none."""

    prompt_lengths: tuple[int, ...] = ()
    filled: tuple[int, ...] = ()
    branches: int | None = None
    repeats: int = 5
    warmup: int = 1
    decode_tokens: int = DECODE_TOKENS

    def check(self) -> None:
        """Refuse option values that need no export to judge, each by its flag."""
        for flag, values, low in (("--prompt-lengths", self.prompt_lengths, 1), ("--filled", self.filled, 0)):
            bad = [v for v in values if v < low]
            if bad:
                raise InvalidArgumentError(f"{flag} values must be at least {low}, got {bad[0]}")
        for flag, value, low in (("--repeats", self.repeats, 1), ("--warmup", self.warmup, 0),
                                 ("--branches", self.branches, 0), ("--decode-tokens", self.decode_tokens, 1)):
            if value is not None and value < low:
                raise InvalidArgumentError(f"{flag} must be at least {low}, got {value}")

    def resolved(self, manifest: dict) -> "BenchOptions":
        """These options checked against the export, defaults filled in: a prompt of 128 tokens (or
        the context), decode after 0 positions, after each context bucket's first position and at
        the full context, and the export's cascade width."""
        self.check()
        ctx = manifest["context_length"]
        prompts = self.prompt_lengths or (min(128, ctx),)
        filled = self.filled or tuple(sorted({0, *context_buckets(manifest)[:-1], ctx - 1}))
        for p in prompts:
            if p > ctx:
                raise InvalidArgumentError(f"--prompt-lengths {p} does not fit the exported context of {ctx} tokens; "
                                           f"give 1..{ctx}")
        for f in filled:
            dm.check_filled(manifest, f)
        width = manifest.get("branch_width") or 0
        if self.branches and not width:
            raise InvalidArgumentError("--branches needs a cascade function, which this export lacks (exported with "
                                       "--branches 0): drop --branches or re-export with --branches 8")
        branches = (self.branches if self.branches is not None else width) or None
        return BenchOptions(tuple(prompts), tuple(sorted(set(filled))), branches, self.repeats, self.warmup,
                            self.decode_tokens)


# ---- what the numbers ran on ---------------------------------------------------------------------------------------

def cpu_name() -> str:
    """The processor's name: the Apple chip on a Mac ("Apple M4 Max"), the CPU model elsewhere."""
    if platform.system() == "Darwin":
        import subprocess

        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=10, check=False)
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def detected_chip(name: str) -> "dm.Chip | None":
    """The cost model's chip for a processor name such as "Apple M4 Max" (None if it has none)."""
    if not name.startswith("Apple "):
        return None
    try:
        return dm.chip(name.removeprefix("Apple "))
    except InvalidArgumentError:
        return None


def machine_info() -> dict:
    """The platform, processor, memory and OS the numbers come from."""
    import psutil

    info = {"platform": platform.system(), "os": platform.platform(), "architecture": platform.machine(),
            "cpu": cpu_name(), "cpu_count": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total}
    if platform.system() == "Darwin":
        info["macos"] = platform.mac_ver()[0]
    return info


def versions() -> dict:
    """Versions of llama-ane, Python and the libraries that run an export."""
    out = {"llama_ane": __version__, "python": platform.python_version()}
    for package in ("numpy", "torch", "coremltools"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def export_summary(manifest: dict) -> dict:
    """What the manifest says of the export's shape, enough to tell two shared results apart."""
    c = manifest["config"]
    quantization = {part: d["scheme"] for part, d in manifest.get("quantization", {}).items()
                    if isinstance(d, dict) and "scheme" in d}
    return {"name": manifest["name"], "format_version": manifest["format_version"],
            "created_by": manifest.get("created_by", {}),
            "config": {k: c.get(k) for k in ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                                              "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")},
            "context_length": manifest["context_length"], "prefill_length": manifest["prefill_length"],
            "context_buckets": context_buckets(manifest), "precision": manifest["precision"],
            "deployment_target": manifest["deployment_target"], "multifunction": manifest["multifunction"],
            "kv_cache": kv_cache_kind(manifest), "branch_width": manifest.get("branch_width") or 0,
            "suffix_length": manifest.get("suffix_length") or 0, "verify_window": manifest.get("verify_window") or 0,
            "models": len(model_names(manifest)), "chunks": len(manifest["chunks"]),
            "weight_bytes": sum(w["bytes"] for w in manifest.get("weights", {}).values()),
            "quantization": quantization}


# ---- counting and sampling ------------------------------------------------------------------------------------------

class CallCounter:
    """Counts the backend's predictions (from every thread: cache updates run in the background)
    while installed over its `predict`."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.count = 0
        self._lock = threading.Lock()
        self._predict = backend.predict

    def _counting(self, model: str, function: str, inputs):
        with self._lock:
            self.count += 1
        return self._predict(model, function, inputs)

    def __enter__(self) -> "CallCounter":
        self.backend.predict = self._counting
        return self

    def __exit__(self, *exc) -> None:
        self.backend.predict = self._predict


def process_peak_rss() -> int | None:
    """The process's RSS high-water mark since it started, in bytes (None where the OS keeps none)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if platform.system() == "Darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def timings(samples: Sequence[float], warmup: Sequence[float]) -> dict:
    """Seconds of the warm-up samples and the measured ones, and the measured median."""
    return {"median_s": statistics.median(samples), "samples_s": list(samples), "warmup_s": list(warmup)}


def _timed(run: Callable[[], None], before: Callable[[], None], opts: BenchOptions) -> dict:
    """`run` timed `warmup` times, then `repeats` times (each after an untimed `before`)."""
    times = []
    for _ in range(opts.warmup + opts.repeats):
        before()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return timings(times[opts.warmup:], times[:opts.warmup])


# ---- the measurements -----------------------------------------------------------------------------------------------

def _ids(rng: np.random.Generator, vocab: int, n: int) -> np.ndarray:
    return rng.integers(0, vocab, size=n, dtype=np.int32)


def _modelled(chip: "dm.Chip | None", step: "dm.StepCost", **extra) -> dict | None:
    if chip is None:
        return None
    return {"tokens_per_s": chip.tokens_per_s(step),
            "tokens_per_s_range": [chip.tokens_per_s(step, "slow"), chip.tokens_per_s(step, "fast")],
            "seconds": chip.seconds(step), "bytes": step.bytes, "calls": step.calls, **extra}


def measure_prefill(model: LlamaANEModel, length: int, opts: BenchOptions, rng: np.random.Generator,
                    chip: "dm.Chip | None") -> dict:
    """Time to first token of a `length`-token prompt into an empty cache: every window, the
    cache updates landed and the first token picked from the last logits."""
    pipeline = model.pipeline
    ids = _ids(rng, model.manifest["config"]["vocab_size"], length)

    def run() -> None:
        int(np.argmax(pipeline.prefill(ids)))
        pipeline.wait()

    counter = CallCounter(model.backend)
    with counter:
        t = _timed(run, pipeline.reset, opts)
    pipeline.reset()
    predicted = dm.prefill_cost(model.manifest, length)
    modelled = _modelled(chip, predicted)
    if modelled is not None:
        modelled["ttft_ms"] = modelled["seconds"] * 1e3
    return {"prompt_length": length, "ttft_ms": t["median_s"] * 1e3, "tokens_per_s": length / t["median_s"],
            "calls": counter.count / (opts.warmup + opts.repeats), "timings": t, "modelled": modelled}


def fill_to(model: LlamaANEModel, filled: int, rng: np.random.Generator) -> None:
    """Make the cache hold `filled` tokens: prefill the ones it lacks, or forget the extra ones."""
    pipeline = model.pipeline
    if pipeline.position > filled:
        pipeline.rewind(filled)  # a ring buffer may keep nothing (Pipeline.rewind): then prefill again
    if pipeline.position < filled:
        pipeline.prefill(_ids(rng, model.manifest["config"]["vocab_size"], filled - pipeline.position))
    pipeline.wait()


def measure_decode(model: LlamaANEModel, filled: int, opts: BenchOptions, rng: np.random.Generator,
                   chip: "dm.Chip | None") -> dict:
    """Decode tokens/s after `filled` cached positions: each sample decodes a few tokens one at a
    time (staying in the context bucket of the first, so the overlap of one token's cache updates
    with the next token's chunks is in the time, as in generation) and goes back to `filled`."""
    pipeline = model.pipeline
    fill_to(model, filled, rng)
    bucket = pipeline.bucket(filled + 1)
    steps = max(1, min(opts.decode_tokens, bucket - filled))
    tokens = _ids(rng, model.manifest["config"]["vocab_size"], steps)

    def run() -> None:
        for token in tokens:
            pipeline.run_window(token.reshape(1))
        pipeline.wait()

    counter = CallCounter(model.backend)
    with counter:
        t = _timed(run, lambda: fill_to(model, filled, rng), opts)
    fill_to(model, filled, rng)
    per_token = t["median_s"] / steps
    predicted = dm.decode_step(model.manifest, filled)
    modelled = _modelled(chip, predicted, attended_positions=bucket_for(model.manifest, filled + 1))
    return {"filled": filled, "bucket": bucket, "function": bucket_function(pipeline.decode_function, bucket, pipeline.context_length),
            "tokens_per_sample": steps, "tokens_per_s": 1 / per_token, "ms_per_token": per_token * 1e3,
            "calls_per_token": counter.count / ((opts.warmup + opts.repeats) * steps), "timings": t,
            "modelled": modelled}


def measure_cascade(model: LlamaANEModel, prefix: int, branches: int, opts: BenchOptions,
                    rng: np.random.Generator, chip: "dm.Chip | None") -> dict:
    """Tokens/s of `branches` branches decoding over a `prefix`-token shared prefix: groups of the
    exported width, each a few steps (one token per branch each, through "decode_branches" or the
    prefill window, as the export cascades), as `generate_branches` runs them."""
    from .cascade import CascadeDecoder

    fill_to(model, prefix, rng)
    decoder = CascadeDecoder(model.pipeline, None, [])
    width = decoder.width
    groups = math.ceil(branches / width)
    steps = max(1, min(opts.decode_tokens, decoder.suffix_length))
    while steps > 1 and not decoder.fits(prefix, 0, steps, width):  # through the window: the context bounds it
        steps -= 1
    tokens = _ids(rng, model.manifest["config"]["vocab_size"], width)

    def run() -> None:
        for _ in range(groups):
            state = decoder.new_state()
            for s in range(steps):
                decoder.step(tokens, np.full(width, s, np.int32), prefix, state)
        model.pipeline.wait()

    counter = CallCounter(model.backend)
    with counter:
        t = _timed(run, lambda: None, opts)
    per_step = t["median_s"] / steps  # every branch's next token
    predicted = dm.cascade_cost(model.manifest, prefix, branches)
    return {"prefix": prefix, "branches": branches, "width": width, "groups": groups, "steps_per_sample": steps,
            "function": "prefill" if decoder.in_window else BRANCHES, "tokens_per_s": branches / per_step, "ms_per_step": per_step * 1e3,
            "calls_per_step": counter.count / ((opts.warmup + opts.repeats) * steps), "timings": t,
            "modelled": _modelled(chip, predicted)}


# ---- the compute plan (Core ML on macOS) ----------------------------------------------------------------------------

DEVICE_NAMES = {"MLNeuralEngineComputeDevice": "ANE", "MLGPUComputeDevice": "GPU", "MLCPUComputeDevice": "CPU"}


def _operations(block) -> Iterator:
    """Every operation of an ML program block, nested blocks' too."""
    for op in block.operations:
        yield op
        for inner in op.blocks:
            yield from _operations(inner)


def plan_summary(plan, function) -> dict:
    """Where `plan` (an MLComputePlan) runs each op of `function` (an MLModelStructureProgramFunction):
    op counts per device (its preferred one), the estimated cost's share per device where Core ML
    gives one, and the op types that run off the Neural Engine. Ops without a planned device (constants)
    are counted apart."""
    ops = {"ANE": 0, "GPU": 0, "CPU": 0}
    cost = {"ANE": 0.0, "GPU": 0.0, "CPU": 0.0}
    unplanned, costed = 0, False
    off_ane: dict[str, int] = {}
    for op in _operations(function.block):
        usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
        if usage is None:
            unplanned += 1
            continue
        device = DEVICE_NAMES.get(type(usage.preferred_compute_device).__name__, "CPU")
        ops[device] += 1
        if device != "ANE":
            off_ane[op.operator_name] = off_ane.get(op.operator_name, 0) + 1
        estimate = plan.get_estimated_cost_for_mlprogram_operation(op)
        if estimate is not None:
            cost[device] += float(estimate.weight)
            costed = True
    planned = sum(ops.values())
    total_cost = sum(cost.values())
    return {"ops": ops, "unplanned_ops": unplanned,
            "ane_op_share": ops["ANE"] / planned if planned else None,
            "cost": cost if costed else None,
            "ane_cost_share": cost["ANE"] / total_cost if costed and total_cost > 0 else None,
            "off_ane_ops": dict(sorted(off_ane.items(), key=lambda kv: -kv[1]))}


def compute_plan(backend: Backend, manifest: dict) -> dict:
    """The compute plan of every package and function of the export as Core ML loads it on this Mac
    (with the backend's compute units), summarised by `plan_summary`, and the totals over all of them.
    macOS only: it reads the packages the coreml backend compiled."""
    from coremltools.models.compute_plan import MLComputePlan

    packages: dict[str, dict] = {}
    files = sorted({entry["file"] for model in manifest["models"].values() for entry in model["functions"].values()})
    for file in files:
        compiled = backend._compiled(file)  # the backend's compiled .mlmodelc, compiled once
        plan = MLComputePlan.load_from_path(str(compiled), compute_units=backend.compute_units)
        program = plan.model_structure.program
        if program is None:
            continue
        packages[file] = {name: plan_summary(plan, fn) for name, fn in program.functions.items()}
    ops = {"ANE": 0, "GPU": 0, "CPU": 0}
    for functions in packages.values():
        for s in functions.values():
            for device, n in s["ops"].items():
                ops[device] += n
    planned = sum(ops.values())
    return {"packages": packages, "ops": ops, "ane_op_share": ops["ANE"] / planned if planned else None}


# ---- the whole run --------------------------------------------------------------------------------------------------

def measure_loads(backend: Backend, manifest: dict, read_wired: Callable[[], int | None] = wired_bytes) -> dict | None:
    """Each function of the load plan loaded on its own, in the plan's order: its first-load
    seconds and the machine's wired memory after it, beside what the resident-memory model gives
    for it (contract/resident.py). None where the backend cannot load a function apart or no wired
    memory can be read (off macOS)."""
    before = read_wired()
    plan = rs.load_plan(manifest)
    if before is None or not plan:
        return None
    runtime, loaded, rows = rs.runtime_of(manifest), {}, []
    for f in plan:
        t0 = time.perf_counter()
        if not backend.load_function(f.model, f.function):
            return None
        seconds = time.perf_counter() - t0
        wired = read_wired()
        n = loaded[f.file] = loaded.get(f.file, 0) + 1  # the function's place among its package's
        rows.append({"model": f.model, "function": f.function, "file": f.file, "load_s": seconds,
                     "wired_bytes": wired, "wired_delta_bytes": None if wired is None else wired - before,
                     "modelled_bytes": round(f.weight_bytes * (runtime.factor(n) - runtime.factor(n - 1)))})
    wired, model = rows[-1]["wired_bytes"], rs.resident(manifest, plan)
    return {"modelled": rs.MODELLED, "runtime": runtime.name, "wired_before_bytes": before,
            "wired_delta_bytes": None if wired is None else wired - before,
            "modelled_resident_bytes": model.bytes, "first_load_s": sum(r["load_s"] for r in rows),
            "modelled_first_load_s": model.first_load_s, "functions": rows}


def resolve_chip(name: str | None, machine: dict) -> tuple["dm.Chip | None", str | None]:
    """The chip whose modelled numbers go beside the measurements, and where its name came from:
    `name` ("--chip"), else the Mac's own chip when the model knows it ("detected"), else none."""
    if name is not None:
        return dm.chip(name), "--chip"
    if machine["platform"] == "Darwin":
        found = detected_chip(machine["cpu"])
        if found is not None:
            return found, "detected"
    return None, None


def run_bench(path: str | Path, backend: str = "auto", options: BenchOptions = BenchOptions(),
              chip: str | None = None, seed: int = 0, log: Callable[[str], None] | None = None) -> dict:
    """Measure the export in `path` with `backend` ("auto": coreml on macOS, else torch) and return
    the JSON-ready result (see docs/bench.md for every field). `chip`: the cost model's chip to
    put beside the numbers (on a Mac, by default, its own when the model knows it)."""
    say = log or (lambda message: None)
    options.check()
    manifest = read_manifest(Path(path))
    opts = options.resolved(manifest)
    machine = machine_info()
    chip_, chip_source = resolve_chip(chip, machine)
    rng = np.random.default_rng(seed)
    with PeakMemory(interval=MEMORY_INTERVAL_S) as memory:
        t0 = time.perf_counter()
        be = _backend(path, manifest, backend)
        model = LlamaANEModel(Path(path), manifest, be)
        try:
            loads = measure_loads(be, manifest)  # each function's first load and wired memory (macOS)
            model.prepare()
            load_s = time.perf_counter() - t0
            after_load = memory.sample()
            device = be.name == "coreml"
            units = getattr(getattr(be, "compute_units", None), "name", None)
            say(f"loaded in {load_s:.2f} s with the {be.name} backend")
            prefill = []
            for p in opts.prompt_lengths:
                say(f"prefill {p} tokens")
                prefill.append(measure_prefill(model, p, opts, rng, chip_))
            model.pipeline.reset()
            decode, cascade = [], []
            for f in opts.filled:
                say(f"decode after {f} positions")
                decode.append(measure_decode(model, f, opts, rng, chip_))
                if opts.branches and f >= 1:
                    say(f"cascade of {opts.branches} branches over {f} positions")
                    cascade.append(measure_cascade(model, f, opts.branches, opts, rng, chip_))
            plan = None
            if device:
                say("reading the compute plan")
                try:
                    plan = compute_plan(be, manifest)
                except Exception as e:  # no plan before macOS 14.4; the timings stand without it
                    plan = {"unavailable": f"{type(e).__name__}: {e}"}
        finally:
            model.close()
    label = (DEVICE.format(units=units) if device else NOT_DEVICE.format(backend=be.name))
    return {"format": BENCH_FORMAT, "device": device, "label": label, "backend": be.name, "compute_units": units,
            "machine": machine, "versions": versions(), "export": export_summary(manifest),
            "options": asdict(opts) | {"seed": seed},
            "chip": None if chip_ is None else {"name": chip_.name, "source": chip_source, **chip_.describe()},
            "modelled": dm.MODELLED if chip_ is not None else None,
            "load_s": load_s, "loads": loads, "prefill": prefill, "decode": decode, "cascade": cascade,
            "memory": {"kind": "pss" if memory.method == "pss-tree" else "rss", "after_load_bytes": after_load, "peak_bytes": memory.peak,
                       "process_peak_rss_bytes": process_peak_rss(), "interval_s": memory.interval},
            "compute_plan": plan}


def _backend(path: str | Path, manifest: dict, backend: str) -> Backend:
    """The backend as a device runs the export: a torch backend writes caches through the
    cache-update model (`direct_cache=False`), making the calls a device makes."""
    if backend == "auto":
        from .model import coreml_can_predict

        backend = "coreml" if coreml_can_predict() else "torch"
    return make_backend(Path(path), manifest, backend, **({"direct_cache": False} if backend == "torch" else {}))
