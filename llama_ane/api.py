"""`export_model`: checkpoint in, a complete, verified export folder out, or nothing at all.

It drives the layers below it: the export plan (`contract`), the exporter that writes the packages
(`export`, which also measures what compression costs: `export.quality`) and the parity gate that
runs them (`verify`, through the runtime). The export is built in a hidden temporary folder beside
OUT and renamed into place only after it has been written, hashed and validated, so an interrupted
or failed export never leaves a folder that looks complete.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from .contract.manifest import write_manifest
from .contract.options import COREAI, ExportOptions, ExportOptionsError, export_settings, signature_with_options
from .export.out_folder import ExportError, check_not_source, check_writable_parent, no_inductor_leftover
from .export.quality import auto_recipe, calibrate, check_quality
from .quantize import PARTS, QuantizeOptions

__all__ = ["export_model", "ExportError"]


def _silent(_message: str) -> None:
    """The default log: nothing. (A function, not a lambda: it travels to spawned workers.)"""


def _pickles(obj: object) -> bool:
    import pickle

    try:
        pickle.dumps(obj)
        return True
    except Exception:  # what pickling raises differs by object (PicklingError, TypeError, AttributeError)
        return False


@no_inductor_leftover()
def export_model(source: str | Path | None, out: str | Path, *, force: bool = False, verify: bool = True,
                 with_transformers: bool = True, workers: int | None = None, max_memory_gb: float | None = None, progress: bool = True,
                 log: Callable[[str], None] | None = None, revision: str | None = None, **options: Any) -> Path:
    """Export `source` (HF folder, .gguf, or None for the embedded default) to the folder `out`.

    `options` are the export options of `llama-ane export`, by the names and with the defaults of
    `llama_ane.contract.options.EXPORT_OPTIONS` (`context_length`, `quantize`, `kv_cache`, ...; the
    help of each is its flag's in `llama-ane export --help`); `context_buckets` also takes one size
    or a sequence of sizes, `quantize_recipe` a path. A name that is no option raises TypeError.
    `source` may also be a Hugging Face repo id (`revision`: a branch, tag or commit), fetched into
    the Hub's cache.

    `verify` (default True, as on the command line) runs the parity gate on the exported programs
    before the folder is renamed into place, and measures fixed schemes of 4 bits or fewer on the
    eval text; `with_transformers=False` leaves the gate's comparison with transformers out (a partial
    gate: the conversion only), for a family whose transformers model cannot be built. Packages are built one per worker process with only their own weights in memory; the
    number of workers comes from cores and available memory (`workers` fixes it, `max_memory_gb`
    sets the memory budget). Returns the export folder. Raises ConfigError/CheckpointError/
    ExportOptionsError/MemoryBudgetError for bad input or an export that would not fit (before
    anything is written), and ExportError for an existing OUT without `force` or an export that
    fails `verify` (then nothing is written; an existing OUT is kept).
    """
    from .checkpoint.loader import load_checkpoint
    from .contract.plan import plan_export
    from .contract.tokenizer import check_tokenizer
    from .export.budget import GIB, plan_memory
    from .export.convert import start_method
    from .memory import available_bytes

    say = log or _silent
    settings, request = export_settings(options, other_keywords=("force", "verify", "with_transformers", "workers",
                                                                 "max_memory_gb", "progress", "log", "revision"))
    recipe = request.recipe()
    opts = ExportOptions(**settings, quantize=request.options(recipe))
    opts.check()
    if workers is not None and workers < 1:
        raise ExportOptionsError(f"--workers must be at least 1, got {workers}")
    if max_memory_gb is not None and max_memory_gb <= 0:
        raise ExportOptionsError(f"--max-memory must be a positive number of GiB, got {max_memory_gb}")
    out = Path(out).expanduser().resolve()
    check_not_source(out, source)
    if out.exists() and not force:
        raise ExportError(f"{out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder")
    check_writable_parent(out)
    t0 = time.perf_counter()
    ckpt = load_checkpoint(source, revision=revision)
    check_tokenizer(ckpt.tokenizer_dir, ckpt.config)  # a bad tokenizer is refused before anything is converted
    if recipe is not None:
        recipe.check(ckpt.config.num_hidden_layers)
    automatic = request.quantize == "auto" and recipe is None
    if automatic:
        from .quantize.auto import DEFAULT_BUDGET_PCT

        budget = request.quantize_budget
        chosen = auto_recipe(ckpt, DEFAULT_BUDGET_PCT if budget is None else budget, say, progress)
        opts = dataclasses.replace(opts, quantize=QuantizeOptions.from_recipe(chosen))
        opts.check()
    plan = plan_export(ckpt.config, opts)
    target = opts.target
    if verify and recipe is None and not automatic and any(c.bits <= 4 for part in PARTS
                                                           if (c := opts.quantize.compression(part, target))):
        check_quality(ckpt, opts.quantize, target, say)
    memory = plan_memory(plan, available=available_bytes(), workers=workers, verify=verify,
                         max_memory=None if max_memory_gb is None else int(max_memory_gb * GIB), method=start_method())
    say(f"{ckpt.name}: {ckpt.config.num_hidden_layers} layers in {len(plan.chunks)} chunk(s) "
        f"{[len(c) for c in plan.chunks]}, context {opts.context_length}"
        + (f" in buckets {list(opts.context_buckets)}" if len(opts.context_buckets) > 1 else "")
        + f", prefill window {opts.prefill_length}, "
        f"{opts.precision}, target {target}" + (f", {opts.branch_width} cascade branches" if opts.branch_width else "")
        + (f", KV caches in {'Core AI' if target == COREAI else 'Core ML'} states" if opts.kv_cache == "state" else "")
        + (f", verify window {opts.verify_window}" if opts.verify_window else ""))
    if opts.quantize.active:
        from .quantize.auto import weights_label

        stored, dense = sum(p.weight_bytes for p in plan.packages), sum(p.dense_bytes for p in plan.packages)
        say(f"weights: {weights_label(opts.quantize.describe(target))}; {stored / 1e6:.1f} MB in packages "
            f"({dense / 1e6:.1f} MB dense)")
    say(f"memory: {memory.describe()}")

    gate = {"with_transformers": with_transformers} if verify else None
    return _build(ckpt, out, opts, plan, memory, target, gate, progress, say, t0, force)


export_model = signature_with_options(export_model)


def _write_coreai(plan, ckpt, folder: Path, progress: Callable) -> None:
    """The plan's packages as Core AI assets, built from the reference modules the parity gate runs."""
    from .export.coreai import write_assets
    from .verify import reference_modules

    write_assets(plan, plan.manifest(ckpt.name, ckpt.source, {}), folder, functools.partial(reference_modules, ckpt),
                 progress)


def _build(ckpt, out: Path, opts: ExportOptions, plan, memory, target: str, gate: dict | None, progress: bool,
           say: Callable[[str], None], t0: float, force: bool = False) -> Path:
    """Convert every package of `plan` into a hidden folder next to `out`, write the manifest,
    validate and verify it (`gate`: verify_export's keywords, None for no gate), and only then rename it to `out`; all under a lock on `out` (see
    export.out_folder), first removing what exports to `out` that were killed left."""
    from .checkpoint.loader import copy_tokenizer
    from .contract.tokenizer import tokenizer_info
    from .export.budget import GIB
    from .export.convert import convert_all
    from .memory import PeakMemory
    from .export.out_folder import OutLock, finish, make_partial, remove_stale_partials
    from .export.progress import ExportProgress
    from .export.validate import validate_export
    from .contract.plan import COREAI

    calibration = None
    if any(c.weighted for part in PARTS if (c := opts.quantize.compression(part, target))):
        # the calibration runs in a worker, which a log that does not pickle cannot reach when workers
        # spawn (macOS): that worker prints its line instead
        recipe = opts.quantize.recipe
        grams = recipe is not None and any(c is not None and c.compensated for c in recipe.forms.values())
        calibration = functools.partial(calibrate, ckpt, say if _pickles(say) else print, grams=grams)
    out.parent.mkdir(parents=True, exist_ok=True)
    with OutLock(out):
        if out.exists() and not force:  # written by an export that finished since the first look
            raise ExportError(f"{out} already exists; pass --force to replace it")
        for stale in remove_stale_partials(out):
            say(f"removed {stale.name}, left by an export to {out.name} that was killed")
        tmp = make_partial(out)
        try:
            with PeakMemory() as meter:
                bar = ExportProgress(plan, progress)
                try:
                    if opts.target == COREAI:
                        _write_coreai(plan, ckpt, tmp, bar.built)
                    else:
                        convert_all(plan, ckpt, tmp, workers=memory.workers, progress=bar.built,
                                    calibration=calibration, compressed=bar.compressed)
                finally:
                    bar.close()
                tok_files = copy_tokenizer(ckpt, tmp)
                write_manifest(tmp, plan.manifest(ckpt.name, ckpt.source,
                                                  tokenizer_info(tmp, ckpt.config, tok_files)))
                if opts.target == COREAI:
                    from .export.coreai import validate_assets

                    validate_assets(tmp)
                else:
                    validate_export(tmp)
                say(f"converted in {time.perf_counter() - t0:.1f} s")
                if gate is not None:  # the parity gate runs before the rename: a failing export is never left in place
                    from .verify import verify_export

                    report = verify_export(tmp, "coreai" if opts.target == COREAI else "mil", checkpoint=ckpt,
                                           progress=progress, **gate)
                    report.export_dir = str(out)
                    say(str(report))
                    if report.error:
                        raise ExportError(f"the parity gate of {ckpt.name} could not run, so nothing was written: "
                                          f"{report.error}")
                    if not report.passed:
                        raise ExportError(f"the export of {ckpt.name} failed verification (see above) and was "
                                          "not written; pass --no-verify to keep it anyway")
            finish(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    say(f"exported {out} in {time.perf_counter() - t0:.1f} s, peak memory {meter.peak / GIB:.2f} GiB "
        f"(summed {'PSS' if meter.method == 'pss-tree' else 'RSS'} of the process tree)")
    return out
