"""Describe an export before (or without) converting it: options checked, chunk plan, the manifest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..chunks.plan import plan_chunks
from .manifest import new_manifest
from .specs import model_specs
from .weights import Checkpoint, load_checkpoint

TARGETS = ("iOS16", "iOS17", "iOS18", "macOS13", "macOS14", "macOS15")
MULTIFUNCTION_TARGETS = ("iOS18", "macOS15")


class ExportOptionsError(ValueError):
    """Export options that cannot work together; the message says which and why."""


@dataclass(frozen=True)
class ExportOptions:
    context_length: int = 1024
    prefill_length: int = 64
    layers_per_chunk: int | None = None
    target: str = "iOS18"
    precision: str = "fp16"
    branch_width: int = 8
    suffix_length: int = 256

    def check(self) -> None:
        if self.prefill_length < 1:
            raise ExportOptionsError(f"--prefill-length must be at least 1, got {self.prefill_length}")
        if self.context_length < 1 or self.context_length % self.prefill_length:
            raise ExportOptionsError(
                f"--context-length {self.context_length} must be a positive multiple of the prefill window "
                f"{self.prefill_length}; try {max(1, round(self.context_length / self.prefill_length)) * self.prefill_length}")
        if self.context_length % 32:
            raise ExportOptionsError(f"--context-length {self.context_length} must be a multiple of 32 (ANE cache rule)")
        if self.layers_per_chunk is not None and self.layers_per_chunk < 1:
            raise ExportOptionsError(f"--layers-per-chunk must be at least 1, got {self.layers_per_chunk}")
        if self.target not in TARGETS:
            raise ExportOptionsError(f"--target {self.target!r} is not one of {', '.join(TARGETS)}")
        if self.branch_width < 0:
            raise ExportOptionsError(f"--branches must be >= 0 (0 = no cascade function), got {self.branch_width}")
        if self.branch_width and (self.suffix_length < 32 or self.suffix_length % 32):
            raise ExportOptionsError(f"--suffix-length must be a positive multiple of 32 (ANE cache rule), "
                                     f"got {self.suffix_length}")
        if self.precision not in ("fp16", "fp32"):
            raise ExportOptionsError(f"--precision must be fp16 or fp32, got {self.precision!r}")

    @property
    def multifunction(self) -> bool:
        return self.target in MULTIFUNCTION_TARGETS


def created_by() -> dict:
    import importlib.metadata as md
    versions = {"llama_ane": __version__}
    for pkg in ("coremltools", "torch", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return versions


def describe(ckpt: Checkpoint, opts: ExportOptions, tokenizer: dict,
             files: dict[tuple[str, str], tuple[str, str]]) -> dict:
    """The manifest of exporting `ckpt` with `opts` (hashes are added when it is written)."""
    opts.check()
    if opts.context_length > ckpt.config.max_position_embeddings:
        raise ExportOptionsError(
            f"--context-length {opts.context_length} exceeds the model's max_position_embeddings "
            f"{ckpt.config.max_position_embeddings}")
    plan = plan_chunks(ckpt.config, opts.layers_per_chunk, target=opts.target,
                       bytes_per_weight=2 if opts.precision == "fp16" else 4)
    float_dtype = "float16" if opts.precision == "fp16" else "float32"
    specs = model_specs(ckpt.config, plan, opts.context_length, opts.prefill_length, float_dtype,
                        opts.branch_width, opts.suffix_length)
    return new_manifest(name=ckpt.name, source=ckpt.source, config=ckpt.config.to_dict(), plan=plan, specs=specs,
                        context_length=opts.context_length, prefill_length=opts.prefill_length,
                        branch_width=opts.branch_width, suffix_length=opts.suffix_length if opts.branch_width else 0,
                        precision=opts.precision, target=opts.target, multifunction=opts.multifunction,
                        tokenizer=tokenizer, files=files, created_by=created_by())


def describe_checkpoint(path: Path | None, **options) -> tuple[dict, Checkpoint, Path]:
    """For running a checkpoint with the torch backend, unexported: (manifest, checkpoint, tokenizer folder)."""
    from .tokenizer_info import tokenizer_info

    options.setdefault("precision", "fp32")
    opts = ExportOptions(**options)
    ckpt = load_checkpoint(path)
    info = tokenizer_info(ckpt.tokenizer_dir, ckpt.config, [])
    return describe(ckpt, opts, info, {}), ckpt, ckpt.tokenizer_dir
