"""The export plan, decided once before any weight is read: options checked, chunks, specs, packages,
and the manifest that records them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..chunks.plan import layer_weight_bytes, plan_chunks
from ..config import LlamaConfig
from ..limits import BYTES_PER_WEIGHT, PRECISION_DTYPES
from .manifest import new_manifest
from .specs import chunk_model_name, model_specs
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


@dataclass(frozen=True)
class PackageSpec:
    """One package the export writes: its file, manifest model, functions and weight bytes."""

    file: str
    model: str
    functions: tuple[str, ...]
    layers: tuple[int, ...]  # HF layer indices of a block chunk, () for the other models
    weight_bytes: int


@dataclass(frozen=True)
class ExportPlan:
    """Everything decided about an export before any weight is read, computed once.

    The exporter builds `packages`, the manifest records `chunks`, `specs` and `files`, and
    `inspect` and the runtime read them back from the manifest.
    """

    config: LlamaConfig
    options: ExportOptions
    chunks: list[list[int]]
    specs: dict[str, dict[str, dict]]
    packages: list[PackageSpec]

    @property
    def float_dtype(self) -> str:
        return PRECISION_DTYPES[self.options.precision]

    @property
    def rope_positions(self) -> int:
        """Rows of the RoPE tables: the last position any function may read, plus one."""
        o = self.options
        return o.context_length + max(o.prefill_length, o.suffix_length + 1 if o.branch_width else 1)

    @property
    def files(self) -> dict[tuple[str, str], tuple[str, str]]:
        """(model, function) -> (package file, function name inside it)."""
        multi = self.options.multifunction
        return {(p.model, fn): (p.file, fn if multi else "main") for p in self.packages for fn in p.functions}

    def manifest(self, name: str, source: dict, tokenizer: dict,
                 files: dict[tuple[str, str], tuple[str, str]] | None = None) -> dict:
        """The manifest of this export (hashes are added when it is written); `files={}` describes
        a checkpoint run unexported (no packages)."""
        o = self.options
        return new_manifest(name=name, source=source, config=self.config.to_dict(), plan=self.chunks,
                            specs=self.specs, context_length=o.context_length, prefill_length=o.prefill_length,
                            branch_width=o.branch_width, suffix_length=o.suffix_length if o.branch_width else 0,
                            precision=o.precision, target=o.target, multifunction=o.multifunction,
                            tokenizer=tokenizer, files=self.files if files is None else files,
                            created_by=created_by())


def model_weight_bytes(cfg: LlamaConfig, model: str, layers: list[int], bytes_per_weight: int) -> int:
    """Weight bytes of one model's package (its RoPE tables and masks are small and not counted)."""
    if model == "embeddings":
        return cfg.vocab_size * cfg.hidden_size * bytes_per_weight
    if model == "lm_head":
        return (cfg.vocab_size + 1) * cfg.hidden_size * bytes_per_weight
    return len(layers) * layer_weight_bytes(cfg, bytes_per_weight)


def plan_export(cfg: LlamaConfig, opts: ExportOptions) -> ExportPlan:
    """Check `opts` against `cfg` and decide the chunks, the specs and the packages."""
    opts.check()
    if opts.context_length > cfg.max_position_embeddings:
        raise ExportOptionsError(
            f"--context-length {opts.context_length} exceeds the model's max_position_embeddings "
            f"{cfg.max_position_embeddings}")
    per_weight = BYTES_PER_WEIGHT[opts.precision]
    chunks = plan_chunks(cfg, opts.layers_per_chunk, target=opts.target, bytes_per_weight=per_weight)
    specs = model_specs(cfg, chunks, opts.context_length, opts.prefill_length, PRECISION_DTYPES[opts.precision],
                        opts.branch_width, opts.suffix_length)
    layers_of = {chunk_model_name(i): layers for i, layers in enumerate(chunks)}
    packages = []
    for model, functions in specs.items():
        layers = layers_of.get(model, [])
        size = model_weight_bytes(cfg, model, layers, per_weight)
        groups = [tuple(functions)] if opts.multifunction else [(fn,) for fn in functions]
        for fns in groups:
            file = f"{model}.mlpackage" if opts.multifunction else f"{model}_{fns[0]}.mlpackage"
            packages.append(PackageSpec(file, model, fns, tuple(layers), size))
    return ExportPlan(cfg, opts, chunks, specs, packages)


def describe(ckpt: Checkpoint, opts: ExportOptions, tokenizer: dict,
             files: dict[tuple[str, str], tuple[str, str]] | None = None) -> dict:
    """The manifest of exporting `ckpt` with `opts` (hashes are added when it is written)."""
    return plan_export(ckpt.config, opts).manifest(ckpt.name, ckpt.source, tokenizer, files)


def describe_checkpoint(path: Path | None, **options) -> tuple[dict, Checkpoint, Path]:
    """For running a checkpoint with the torch backend, unexported: (manifest, checkpoint, tokenizer folder)."""
    from .tokenizer_info import tokenizer_info

    options.setdefault("precision", "fp32")
    opts = ExportOptions(**options)
    ckpt = load_checkpoint(path)
    info = tokenizer_info(ckpt.tokenizer_dir, ckpt.config, [])
    return describe(ckpt, opts, info, {}), ckpt, ckpt.tokenizer_dir
