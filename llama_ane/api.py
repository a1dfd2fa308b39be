"""`export_model`: checkpoint in, a complete, verified export folder out, or nothing at all.

It drives the layers below it: the export plan (`contract`), the exporter that writes the packages
(`export`) and the parity gate that runs them (`verify`, through the runtime). The export is built in a hidden temporary folder beside OUT and renamed into place only after it
has been written, hashed and validated, so an interrupted or failed export never leaves a folder
that looks complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import getpass
import inspect
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from .errors import LlamaANEError
from .contract.manifest import write_manifest
from .contract.options import COREAI, EXPORT_OPTIONS, ExportOptions, ExportOptionsError, Option, export_settings
from .quantize import PARTS, QuantizeOptions


class ExportError(LlamaANEError, RuntimeError):
    """The export could not be written; the message says why and what to do."""


class _Progress:
    """A progress bar in bytes of the export as written: its total is the weights' bytes as stored
    (compressed ones at their packed size), which is about the folder's size. Each package's share
    fills as its work is done (its compression units, then its build), so the ETA follows the real
    work; a built package's share is complete."""

    def __init__(self, plan, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            from .export.convert import compression_units

            self.share = {p.file: p.weight_bytes for p in plan.packages}  # bytes of the bar each package fills
            self.work = {p.file: p.dense_bytes + OVERHEAD_BYTES for p in plan.packages}  # its work, in build bytes
            for u in compression_units(plan):
                self.work[u.spec.file] += COMPRESS_BYTES * u.weights
            self.filled = dict.fromkeys(self.share, 0.0)
            total = sum(self.share.values())
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="export", dynamic_ncols=True)

    def _fill(self, file: str, amount: float) -> None:
        amount = min(amount, self.share[file] - self.filled[file])
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


OVERHEAD_BYTES = 20_000_000  # a package's fixed work beside its weights' bytes (graph building, hashing)
COMPRESS_BYTES = 4  # a compressed weight's work in build bytes: its k-means is a few times its build


@contextlib.contextmanager
def no_inductor_leftover() -> Iterator[None]:
    """Remove the empty `torchinductor_<user>` folder that importing transformers' Llama modules makes
    in the temporary directory, if it was not there before: an export leaves nothing in /tmp."""
    try:
        folder = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    except (KeyError, OSError):  # no user name to build it from: torch cannot make it either
        yield
        return
    existed = folder.exists()
    try:
        yield
    finally:
        if not existed and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def check_writable_parent(out: Path) -> None:
    """Refuse an OUT whose parent folder cannot be created or written, before any work."""
    parent = out.parent
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {out}: {existing} is not a writable folder; choose another -o/--out")


def check_not_source(out: Path, source: str | Path | None) -> None:
    """Refuse an OUT that is the checkpoint, lies inside it or contains it, --force or not: the
    export would replace or write into the model it reads."""
    from .export.out_folder import overlap

    if source is None or not Path(source).expanduser().exists():
        return
    how = overlap(out, Path(source).expanduser())
    if how is not None:
        raise ExportError(f"-o/--out {out} {how} the checkpoint {Path(source).expanduser().resolve()}, which the "
                          "export would overwrite; choose an output folder outside the checkpoint")


def _silent(_message: str) -> None:
    """The default log: nothing. (A function, not a lambda: it travels to spawned workers.)"""


def _pickles(obj: object) -> bool:
    import pickle

    try:
        pickle.dumps(obj)
        return True
    except Exception:  # what pickling raises differs by object (PicklingError, TypeError, AttributeError)
        return False


def calibration_text() -> str:
    """Prose shipped to calibrate compression on (neither the verify text nor the eval text)."""
    return _shipped_text("calibration_text.txt")


def _shipped_text(name: str) -> str:
    from importlib import resources

    return resources.files("llama_ane").joinpath(name).read_text(encoding="utf-8")


def calibrate(ckpt, say: Callable[[str], None], on_found: Callable[[str, object], None] | None = None) -> dict:
    """The activation statistics LUT fits and int4 ranges are weighted by: the checkpoint run in
    float32, one layer at a time, on the first `calibration_tokens(config)` tokens of
    `calibration_text`.
    `on_found(key, array)` gets each layer's as soon as it is known (see activation_importance).
    The exporter runs it as one of its worker jobs, beside the compression it feeds."""
    from transformers import AutoTokenizer

    from .reference import activation_importance

    t0 = time.perf_counter()
    ids = AutoTokenizer.from_pretrained(str(ckpt.tokenizer_dir))(calibration_text()).input_ids[:calibration_tokens(ckpt.config)]
    ids = [i for i in ids if i < ckpt.config.vocab_size]
    importance = activation_importance(ckpt, ids, on_found)
    say(f"calibrated on {len(ids)} tokens in {time.perf_counter() - t0:.1f} s")
    return importance


def text_ids(ckpt, text: str, tokens: int) -> list[int]:
    """The first `tokens` token ids of `text` (those inside the model's vocabulary)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(ckpt.tokenizer_dir))(text).input_ids[:tokens]
    return [i for i in ids if i < ckpt.config.vocab_size]


def _unmeasured(ckpt) -> bool:
    """Whether the quality model (transformers' decoder layers on the checkpoint's weights) is not
    this family's whole network (families/: `Family.quality_model`)."""
    return not ckpt.config.family.quality_model


def quality_model(ckpt):
    """The checkpoint as a float32 quantize.sensitivity.Float32Model, every layer in memory (own
    copies: the measurements swap weights in place)."""
    import torch

    from .quantize.sensitivity import Float32Model
    from .reference import _with_weights, family_classes, hf_config

    hf, (DecoderLayer, RMSNorm, Rotary) = hf_config(ckpt.config), family_classes(ckpt.config.model_type)
    layers = []
    for n in range(hf.num_hidden_layers):
        with torch.device("meta"):
            layer = DecoderLayer(hf, n)
        layer = _with_weights(ckpt, layer, f"model.layers.{n}.")
        for p in layer.parameters():
            p.data = p.data.clone()
        layers.append(layer)
    with torch.device("meta"):
        norm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
    table = ckpt.tensor("model.embed_tokens.weight").to(torch.float32).clone()
    head = table.clone() if hf.tie_word_embeddings else ckpt.tensor("lm_head.weight").to(torch.float32).clone()
    return Float32Model(table, layers, _with_weights(ckpt, norm, "model.norm."), head, Rotary(config=hf))


def auto_recipe(ckpt, budget_pct: float, say: Callable[[str], None]):
    """`--quantize auto`: the recipe of fewest bytes within `budget_pct` (quantize.auto), measured
    on the calibration text and checked on the eval text."""
    from .quantize.auto import CHECK_TOKENS, SENSITIVITY_TOKENS
    from .quantize.schemes import QuantizeError

    if _unmeasured(ckpt):
        raise QuantizeError(f"--quantize auto cannot measure a {ckpt.config.model_type} checkpoint yet; choose a "
                            "scheme (e.g. --quantize lut6) and check it with llama-ane eval")
    from .quantize.sensitivity import choose_recipe

    importance = calibrate(ckpt, say)
    return choose_recipe(quality_model(ckpt), text_ids(ckpt, calibration_text(), SENSITIVITY_TOKENS),
                         text_ids(ckpt, _shipped_text("eval_text.txt"), CHECK_TOKENS), importance, budget_pct,
                         "the eval text", say)


def check_quality(ckpt, quantize: QuantizeOptions, target: str, say: Callable[[str], None]) -> float:
    """Measure a fixed scheme of 4 bits or fewer on the eval text and say the perplexity change;
    beyond WARN_PCT, say so plainly and what to use instead."""
    if _unmeasured(ckpt):
        say(f"quality: not measured for {ckpt.config.model_type} checkpoints; check it with llama-ane eval")
        return float("nan")
    from .quantize.auto import CHECK_TOKENS, WARN_PCT, part_of_unit, units
    from .quantize.sensitivity import perplexity_change

    forms = {u: quantize.compression(part_of_unit(u), target, None if quantize.recipe is None else u)
             for u in units(ckpt.config.num_hidden_layers)}
    ids = text_ids(ckpt, _shipped_text("eval_text.txt"), CHECK_TOKENS)
    change = perplexity_change(quality_model(ckpt), forms, ids, calibrate(ckpt, say))
    say(f"quality: perplexity {change:+.2f}% against fp16 on {len(ids)} tokens of the eval text")
    if change > WARN_PCT:
        say(f"warning: these weights lose {change:.0f}% perplexity (more than {WARN_PCT:g}%). Use --quantize auto "
            "(the fewest bytes within --quantize-budget, default 5%), a larger scheme, or, for a GPU deployment "
            "on macOS, a LUT scaled per block (--lut-block-size 32, or the block size of a GGUF source)")
    return change


CALIBRATION_TOKENS = (128, 512)  # fewest and most
CALIBRATION_WEIGHT_TOKENS = 1.25e11  # decoder-layer weights x tokens: a 1B-shaped model gets 128


def calibration_tokens(config) -> int:
    """How many calibration tokens a model gets: its float32 pass costs layer weights x tokens, so
    larger models get fewer, down to 128 (SmolLM2-135M: 512; Llama-3.2-1B, 3B and 8B: 128).
    The statistics are per-channel mean squares, which a few hundred tokens already settle."""
    from .contract.plan import layer_weight_bytes  # (the planner sizes chunks by it)

    weights = layer_weight_bytes(config, 1) * config.num_hidden_layers
    fewest, most = CALIBRATION_TOKENS
    return max(fewest, min(most, int(CALIBRATION_WEIGHT_TOKENS // max(weights, 1))))


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
        chosen = auto_recipe(ckpt, DEFAULT_BUDGET_PCT if budget is None else budget, say)
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
        def granularity(d: dict) -> str:
            sizes = []  # the LUT's group, then the block of its scales or of the integers' scales
            if "group_size" in d:
                sizes.append("one LUT per tensor" if d["group_size"] == 0 else f"group {d['group_size']}")
            if "block_size" in d:
                sizes.append("per channel" if d["block_size"] == 0 else f"block {d['block_size']}")
            return f" ({', scaled per '.join(sizes)})" if sizes else ""
        stored, dense = sum(p.weight_bytes for p in plan.packages), sum(p.dense_bytes for p in plan.packages)
        described = opts.quantize.describe(target)
        say("weights: " + ", ".join(f"{part} {d['scheme']}{granularity(d)}" if "units" not in d else
                                    f"{part} " + " + ".join(f"{n} x {form}" for form, n in d["units"].items())
                                    for part, d in described.items() if part in PARTS)
            + f"; {stored / 1e6:.1f} MB in packages ({dense / 1e6:.1f} MB dense)")
    say(f"memory: {memory.describe()}")

    gate = {"with_transformers": with_transformers} if verify else None
    return _build(ckpt, out, opts, plan, memory, target, gate, progress, say, t0, force)


def signature_with_options(f: Callable, table: Sequence[Option] = EXPORT_OPTIONS) -> Callable:
    """`f`, its signature showing the options of `table` as keywords with their defaults in place of
    its **options (for help(), IDEs and inspect.signature)."""
    sig = inspect.signature(f)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default,
                                 annotation=o.type if o.default is not None else o.type | None)
               for o in table]
    f.__signature__ = sig.replace(parameters=params)
    return f


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
    from .export.validate import validate_export
    from .contract.plan import COREAI

    calibration = None
    if any(c.weighted for part in PARTS if (c := opts.quantize.compression(part, target))):
        # the calibration runs in a worker, which a log that does not pickle cannot reach when workers
        # spawn (macOS): that worker prints its line instead
        calibration = functools.partial(calibrate, ckpt, say if _pickles(say) else print)
    out.parent.mkdir(parents=True, exist_ok=True)
    with OutLock(out):
        if out.exists() and not force:  # written by an export that finished since the first look
            raise ExportError(f"{out} already exists; pass --force to replace it")
        for stale in remove_stale_partials(out):
            say(f"removed {stale.name}, left by an export to {out.name} that was killed")
        tmp = make_partial(out)
        try:
            with PeakMemory() as meter:
                bar = _Progress(plan, progress)
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
