"""`export_model`: checkpoint in, a complete export folder out, or nothing at all.

The export is built in a hidden temporary folder beside OUT and renamed into place only after it
has been written, hashed and validated, so an interrupted or failed export never leaves a folder
that looks complete.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from .describe import ExportOptions, describe
from .manifest import write_manifest


class ExportError(RuntimeError):
    """The export could not be written; the message says why and what to do."""


def _progress_bar(total: int, enabled: bool) -> tuple[Callable[[str], None], Callable[[], None]]:
    if not enabled:
        return (lambda _label: None), (lambda: None)
    from tqdm import tqdm

    bar = tqdm(total=total, unit="step", desc="export", dynamic_ncols=True)

    def step(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update(1)
    return step, bar.close


def export_model(source: str | Path | None, out: str | Path, *, context_length: int = 1024,
                 prefill_length: int = 64, layers_per_chunk: int | None = None, branch_width: int = 8,
                 suffix_length: int = 256, target: str = "iOS18",
                 precision: str = "fp16", force: bool = False, verify: bool = False,
                 progress: bool = True, log: Callable[[str], None] | None = None) -> Path:
    """Export `source` (HF folder, .gguf, or None for the embedded default) to the folder `out`.

    Returns the export folder. Raises ConfigError/CheckpointError/ExportOptionsError for bad input
    (before anything is written), and ExportError for an existing OUT without `force` or an export
    that fails `verify` (then nothing is written; an existing OUT is kept).
    """
    from .convert import convert_all, jobs_for
    from .modules import build_model_set
    from .specs import model_specs
    from .tokenizer_info import tokenizer_info
    from .validate import validate_export
    from .weights import copy_tokenizer, load_checkpoint

    say = log or (lambda _m: None)
    opts = ExportOptions(context_length, prefill_length, layers_per_chunk, target, precision, branch_width,
                         suffix_length)
    opts.check()
    out = Path(out).expanduser().resolve()
    if out.exists() and not force:
        raise ExportError(f"{out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder")
    t0 = time.perf_counter()
    ckpt = load_checkpoint(source)
    draft = describe(ckpt, opts, {"files": []}, {})  # checks the plan and options against the config
    plan = [c["layers"] for c in draft["chunks"]]
    say(f"{ckpt.name}: {ckpt.config.num_hidden_layers} layers in {len(plan)} chunk(s) "
        f"{[len(p) for p in plan]}, context {context_length}, prefill window {prefill_length}, "
        f"{precision}, target {target}" + (f", {branch_width} cascade branches" if branch_width else ""))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        models = build_model_set(ckpt, plan, context_length, prefill_length, branch_width, suffix_length)
        specs = model_specs(ckpt.config, plan, context_length, prefill_length,
                            "float16" if precision == "fp16" else "float32", branch_width, suffix_length)
        jobs = jobs_for(models, specs)
        merges = len(specs) if opts.multifunction else 0
        step, close = _progress_bar(len(jobs) + merges + 1, progress)
        try:
            files = convert_all(jobs, tmp, context_length=context_length, target=target, precision=precision,
                                multifunction=opts.multifunction, progress=step)
            tok_files = copy_tokenizer(ckpt, tmp)
            manifest = describe(ckpt, opts, tokenizer_info(tmp, ckpt.config, tok_files), files)
            write_manifest(tmp, manifest)
            validate_export(tmp)
            step("validated")
        finally:
            close()
        say(f"converted in {time.perf_counter() - t0:.1f} s")
        if verify:  # the parity gate runs before the rename: a failing export is never left in place
            from .verify import verify_export

            report = verify_export(tmp, checkpoint=ckpt)
            report.export_dir = str(out)
            say(str(report))
            if not report.passed:
                raise ExportError(f"the export of {ckpt.name} failed verification (see above) and was not written; "
                                  "pass --no-verify to keep it anyway")
        if out.exists():
            old = out.parent / f".{out.name}.old-{int(time.time())}"
            out.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"exported {out} in {time.perf_counter() - t0:.1f} s")
    return out
