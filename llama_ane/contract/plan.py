"""The export plan, decided once before any weight is read: options checked, chunks, specs, packages,
and the manifest that records them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .._version import __version__
from ..model.functions import per_layer_rows
from ..model.lm_head import ROW_UNIT, vocab_splits
from .sizing import group_heads, layer_shapes, layer_weight_bytes, plan_chunks, vocab_row_ranges, weight_part
from ..config import LlamaConfig
from ..limits import BYTES_PER_WEIGHT, MAX_FUNCTIONS_PER_PACKAGE, PRECISION_DTYPES, weight_budget
from ..quantize import Compression, check_divides, stored_bytes
from ..quantize.auto import unit_of
from ..quantize.schemes import AT_LOAD
from .manifest import new_manifest
# the options live in .options, which the command line reads without importing the network; the
# names stay importable from here, where the plan that uses them lives
from .options import (COREAI, COREAI_SUFFIX, FIRST_BUCKET, FOLD_CHOICES, KV_CACHE_CHOICES, MAX_BUCKETS,
                      MULTIFUNCTION_TARGETS, TARGETS, ExportOptions, ExportOptionsError, auto_buckets, auto_kv_cache,
                      check_coreai)
from .specs import chunk_model_name, embeddings_model_name, lm_head_model_name, model_kind, model_specs, ring_length
from ..checkpoint.loader import Checkpoint, load_checkpoint


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
    weight_bytes: int  # as stored in the file (compressed weights at their packed size)
    rows: tuple[int, int] | None = None  # [start, end) vocabulary rows of an embeddings or LM head file
    dense_bytes: int = 0  # the same weights in the export precision (what building or running holds)
    read_bytes: int | None = None  # what the Neural Engine reads per pass: forms it decompresses at load count dense


@dataclass(frozen=True)
class ExportPlan:
    """Everything decided about an export before any weight is read, computed once.

    The exporter builds `packages`, the manifest records `chunks`, `specs` and `files`, and
    `inspect` and the runtime read them back from the manifest.
    """

    config: LlamaConfig
    options: ExportOptions
    chunks: list[list[int]]
    embedding_rows: list[tuple[int, int]]  # [start, end) rows of the table in each embeddings file
    head_groups: list[list[int]]  # the vocabulary splits (logits_j) each LM head file computes
    specs: dict[str, dict[str, dict]]
    packages: list[PackageSpec]
    head_folded: bool = False  # the last chunk carries the LM head (no "lm_head" model)

    @property
    def float_dtype(self) -> str:
        return PRECISION_DTYPES[self.options.precision]

    @property
    def rope_positions(self) -> int:
        return rope_positions(self.options)

    def compression(self, name: str, spec: "PackageSpec | None" = None) -> Compression | None:
        """How parameter `name` (as in the modules, e.g. "layers.0.q_proj.weight") is stored: None
        for dense weights. Inside package `spec` a chunk's "layers.j" is its j-th layer (a
        recipe compresses layers apart)."""
        part = weight_part(name)
        if part is None:
            return None
        if spec is not None and name.startswith("layers."):
            _, j, rest = name.split(".", 2)
            name = f"layers.{spec.layers[int(j)]}.{rest}"
        return self.options.quantize.compression(part, self.options.target, unit_of(name))

    def compressed_weights(self, spec: "PackageSpec") -> dict[str, tuple[int, ...]]:
        """The compressed weights of package `spec` and their shapes (out, in): names as its program
        uses them ("layers.j.*" for the j-th layer of a chunk, "heads.j.weight" for vocabulary split j)."""
        cfg, kind = self.config, model_kind(spec.model)
        if kind == "chunk":
            found = {f"layers.{j}.{name}": shape for j, n in enumerate(spec.layers)
                     for name, shape in layer_shapes(cfg, n).items()}
            if spec.rows is not None:  # the last chunk carrying the LM head
                found.update((f"heads.{j}.weight", (n, cfg.hidden_size)) for j, n in enumerate(vocab_splits(cfg.vocab_size)))
        elif kind in ("embeddings", "embeddings_part"):
            found = {"embed_tokens.weight": (spec.rows[1] - spec.rows[0], cfg.hidden_size)}
        elif kind == "lm_head":
            splits = vocab_splits(cfg.vocab_size)
            starts = [sum(splits[:j]) for j in range(len(splits))]
            found = {f"heads.{j}.weight": (splits[j], cfg.hidden_size) for j in range(len(splits))
                     if spec.rows[0] <= starts[j] < spec.rows[1]}
        else:
            found = {}
        return {name: shape for name, shape in found.items() if self.compression(name, spec) is not None}

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
                            embedding_rows=self.embedding_rows, head_groups=self.head_groups, specs=self.specs, context_length=o.context_length, prefill_length=o.prefill_length,
                            branch_width=o.branch_width, suffix_length=o.suffix_length if o.branch_width else 0,
                            verify_window=o.verify_window, context_buckets=list(o.context_buckets),
                            precision=o.precision, target=o.target, multifunction=o.multifunction,
                            quantization=o.quantize.describe(o.target),
                            weights={p.model: {"bytes": p.weight_bytes, "dense_bytes": p.dense_bytes,
                                               "read_bytes": p.weight_bytes if p.read_bytes is None else p.read_bytes}
                                     for p in self.packages},
                            tokenizer=tokenizer, files=self.files if files is None else files,
                            created_by=created_by(), kv_cache=o.kv_cache, decode_function=o.decode_function,
                            head_folded_into=chunk_model_name(len(self.chunks) - 1) if self.head_folded else None)


def per_layer_sizes(cfg: LlamaConfig, opts: ExportOptions, per_weight: int) -> tuple[int, int]:
    """Gemma 4's per-layer input weights in the embeddings files, (0, 0) for the other families:
    (bytes of a vocabulary row of the per-layer table, bytes of the projection and its norm). Each
    embeddings file holds the per-layer table's rows of its own vocabulary rows, and the last file,
    where the embedding is whole, the projection of it (model.embeddings.PerLayerInputs)."""
    if not cfg.per_layer_input_size:
        return 0, 0
    return (cfg.per_layer_channels * per_weight,
            (cfg.per_layer_channels * cfg.hidden_size + cfg.per_layer_input_size) * per_weight)


def check_vocab_rows_fit(cfg: LlamaConfig, opts: ExportOptions, row_bytes: int, fixed_bytes: int, budget: int) -> None:
    """Refuse by name an embeddings file that cannot hold even ROW_UNIT vocabulary rows (`row_bytes`
    each) beside `fixed_bytes` of other weights (the RoPE tables, Gemma 4's per-layer projection)."""
    if ROW_UNIT * row_bytes + fixed_bytes > budget:
        raise ExportOptionsError(
            f"an embeddings file cannot hold {ROW_UNIT} vocabulary rows ({ROW_UNIT * row_bytes / 2**20:.1f} MiB"
            + (", with Gemma 4's per-layer table's" if cfg.per_layer_input_size else "")
            + f") beside its other weights ({fixed_bytes / 2**20:.0f} MiB: the RoPE tables"
            + (" and the per-layer projection" if cfg.per_layer_input_size else "")
            + f") in {budget / 2**20:.0f} MiB for --target {opts.target}: use a shorter --context-length "
            "or --precision fp16")


def rope_positions(opts: ExportOptions) -> int:
    """Rows of the RoPE tables: the last position any function may read, plus one."""
    return opts.context_length + max(opts.prefill_length, opts.suffix_length + 1 if opts.branch_width else 1,
                                     opts.verify_window)


def plan_export(cfg: LlamaConfig, opts: ExportOptions) -> ExportPlan:
    """Check `opts` against `cfg` and decide the chunks, the vocabulary files, the specs and the packages.

    Every package holds at most the target's weight budget (`limits.weight_budget`), counting
    compressed weights at their stored size: decoder layers are grouped into chunks, and an
    embedding table or LM head too large for one file is cut by rows into several (at 8B,
    128256 x 4096 fp16 is 1.05 GB: two files for an iOS target). A group or block size that does
    not divide a compressed weight is refused here, before anything is read.
    """
    opts.check()
    if opts.context_length > cfg.max_position_embeddings:
        raise ExportOptionsError(
            f"--context-length {opts.context_length} exceeds the model's max_position_embeddings "
            f"{cfg.max_position_embeddings}")
    cfg.check_context_length(opts.context_length)  # a sliding window shorter than the context
    if cfg.kv_shared_layers and opts.kv_cache != "inputs":
        raise ExportOptionsError(
            f"--kv-cache {opts.kv_cache}: this {cfg.model_type} model's last {cfg.kv_shared_layers} layers attend over "
            "the K/V of earlier layers, which a chunk's states cannot hand to another chunk; export it with "
            "--kv-cache inputs")
    if cfg.wide_global and not ring_length(cfg, opts.context_length, opts.prefill_length):
        raise ExportOptionsError(
            f"--context-length {opts.context_length}: this {cfg.model_type} model's global layers have wider K/V "
            f"({cfg.global_layers.kv_channels} channels) than its sliding layers ({cfg.kv_channels}), which then keep "
            f"theirs in a ring buffer of the sliding window ({cfg.sliding_window}) and a prefill window: export it with "
            "a --context-length longer than that ring (sliding_window + --prefill-length, rounded up to 32)")
    if (cfg.conv_layers or cfg.recurrent_layers) and opts.verify_window:
        kind = "Mamba-2" if cfg.mamba_layers else "linear-attention" if cfg.delta_layers else "conv"
        raise ExportOptionsError(
            f"--verify-window {opts.verify_window}: this {cfg.model_type} model's {kind} layers keep a state that "
            "cannot go back to the tokens a speculative tree accepts; export it with --verify-window 0")
    per_weight = BYTES_PER_WEIGHT[opts.precision]
    budget, row = weight_budget(opts.target), cfg.hidden_size
    quantize, target = opts.quantize, opts.target

    def stored(name: str, shape: tuple[int, ...], read: bool = False) -> int:
        """Bytes in the package (`read`: that the Neural Engine reads, forms decompressed at load dense)."""
        part = weight_part(name)
        c = None if part is None else quantize.compression(part, target, unit_of(name))
        if c is not None:
            check_divides(name, shape, c)
        return stored_bytes(shape, None if read and c is not None and c.device_path == AT_LOAD else c, per_weight)

    def stored_rows(name: str, rows: int, read: bool = False) -> int:  # bytes of `rows` rows of a vocabulary matrix
        return stored(name, (rows, row), read)

    layer_bytes = [layer_weight_bytes(cfg, per_weight, lambda name, shape: stored(f"layers.{n}.{name}", shape), n)
                   for n in range(cfg.num_hidden_layers)]  # a recipe compresses layers apart
    layer_read = [layer_weight_bytes(cfg, per_weight, lambda name, shape: stored(f"layers.{n}.{name}", shape, True),
                                     n) for n in range(cfg.num_hidden_layers)]
    chunks = plan_chunks(cfg, opts.layers_per_chunk, target=target, layer_bytes=max(layer_bytes))
    rope_bytes = 2 * rope_positions(opts) * cfg.global_layers.head_dim * per_weight  # cos and sin tables
    table_row = -(-stored_rows("embed_tokens.weight", ROW_UNIT) // ROW_UNIT)  # bytes per row, rounded up
    per_layer_row, projection_bytes = per_layer_sizes(cfg, opts, per_weight)  # Gemma 4's, beside the table
    row_bytes, fixed_bytes = table_row + per_layer_row, rope_bytes + projection_bytes  # room for both in any file
    check_vocab_rows_fit(cfg, opts, row_bytes, fixed_bytes, budget)
    embedding_rows = vocab_row_ranges(cfg.vocab_size, row_bytes, budget, fixed_bytes=fixed_bytes)
    splits = vocab_splits(cfg.vocab_size)
    head_row = max(-(-stored_rows(f"heads.{j}.weight", n) // n) for j, n in enumerate(splits))
    head_groups = group_heads(splits, head_row, budget, fixed_bytes=row * per_weight)  # each file has the norm
    heads_start = [sum(splits[:j]) for j in range(len(splits) + 1)]
    contents = {}  # model -> (layers, rows, stored bytes, dense bytes, bytes the Neural Engine reads)
    for k, (a, b) in enumerate(embedding_rows):
        start, end = per_layer_rows(cfg, (a, b))  # Gemma 4's per-layer rows, and in the last file the projection
        fixed = ((rope_bytes if k == 0 else 0) + (end - start) * per_layer_row
                 + (projection_bytes if b == cfg.vocab_size else 0))
        contents[embeddings_model_name(k)] = ((), (a, b), stored_rows("embed_tokens.weight", b - a) + fixed,
                                              (b - a) * row * per_weight + fixed,
                                              stored_rows("embed_tokens.weight", b - a, True) + fixed)
    for i, layers in enumerate(chunks):
        contents[chunk_model_name(i)] = (tuple(layers), None, sum(layer_bytes[n] for n in layers),
                                         sum(layer_weight_bytes(cfg, per_weight, layer=n) for n in layers),
                                         sum(layer_read[n] for n in layers))
    for k, heads in enumerate(head_groups):
        a, b = heads_start[heads[0]], heads_start[heads[-1] + 1]
        norm = row * per_weight
        contents[lm_head_model_name(k)] = ((), (a, b), sum(stored_rows(f"heads.{j}.weight", splits[j]) for j in heads)
                                           + norm, (b - a) * row * per_weight + norm,
                                           sum(stored_rows(f"heads.{j}.weight", splits[j], True) for j in heads) + norm)
    contents["cache_update"] = ((), None, 0, 0, 0)
    fold = fold_head(opts, contents, chunk_model_name(len(chunks) - 1), len(head_groups), budget)
    if fold:  # the last chunk's package holds the head's weights too
        last, head = chunk_model_name(len(chunks) - 1), contents.pop(lm_head_model_name(0))
        layers, _, *sizes = contents[last]
        contents[last] = (layers, head[1], *(a + b for a, b in zip(sizes, head[2:])))
    specs = model_specs(cfg, chunks, opts.context_length, opts.prefill_length, PRECISION_DTYPES[opts.precision],
                        opts.branch_width, opts.suffix_length, len(embedding_rows), head_groups, opts.kv_cache,
                        verify_window=opts.verify_window, buckets=opts.context_buckets, fold_head=fold,
                        decode_function=opts.decode_function)
    check_function_count(opts, specs)
    packages = []
    for model, functions in specs.items():
        layers, rows, size, dense, read = contents[model]
        groups = [tuple(functions)] if opts.multifunction else [(fn,) for fn in functions]
        for fns in groups:
            suffix = COREAI_SUFFIX if opts.target == COREAI else ".mlpackage"
            file = f"{model}{suffix}" if opts.multifunction else f"{model}_{fns[0]}{suffix}"
            packages.append(PackageSpec(file, model, fns, layers, size, rows, dense, read))
    return ExportPlan(cfg, opts, chunks, embedding_rows, head_groups, specs, packages, fold)


def check_function_count(opts: ExportOptions, specs: dict[str, dict]) -> None:
    """Refuse an export whose packages of weights would hold more than MAX_FUNCTIONS_PER_PACKAGE
    functions each (the cache-update package holds no weights, only small one-hot updates)."""
    if not opts.multifunction:
        return
    for model, functions in specs.items():
        if model != "cache_update" and len(functions) > MAX_FUNCTIONS_PER_PACKAGE:
            raise ExportOptionsError(
                f"{model}.mlpackage would hold {len(functions)} functions ({', '.join(functions)}); at most "
                f"{MAX_FUNCTIONS_PER_PACKAGE}, since the device compiles and loads each one: fewer "
                f"--context-buckets (each adds a prefill and a decode function), --branches 0 or "
                f"--verify-window 0 (each adds one)")


def fold_head(opts: ExportOptions, contents: dict, last: str, head_files: int, budget: int) -> bool:
    """Whether the last chunk carries the LM head (--fold-lm-head): auto when the head is one file
    and its weights fit beside the last chunk's in one package (`budget` bytes), yes when it must
    (refused when they do not fit), no never. `contents` maps a model to (layers, rows, stored bytes, ...)."""
    if opts.fold_lm_head == "no":
        return False
    chunk_bytes = contents[last][2]
    head_bytes = sum(contents[lm_head_model_name(k)][2] for k in range(head_files))
    fits = head_files == 1 and chunk_bytes + head_bytes <= budget
    if opts.fold_lm_head == "yes" and not fits:
        raise ExportOptionsError(
            f"--fold-lm-head yes: the LM head ({head_bytes / 1e6:.0f} MB"
            + (f" in {head_files} files" if head_files > 1 else "")
            + f") does not fit beside {last} ({chunk_bytes / 1e6:.0f} MB) in one {opts.target} package "
            f"({budget / 1e6:.0f} MB of weights): use --fold-lm-head auto or no, fewer --layers-per-chunk, "
            "or --quantize-lm-head")
    return fits


def describe(ckpt: Checkpoint, opts: ExportOptions, tokenizer: dict,
             files: dict[tuple[str, str], tuple[str, str]] | None = None) -> dict:
    """The manifest of exporting `ckpt` with `opts` (hashes are added when it is written)."""
    return plan_export(ckpt.config, opts).manifest(ckpt.name, ckpt.source, tokenizer, files)


def describe_checkpoint(path: Path | None, **options) -> tuple[dict, Checkpoint, Path]:
    """For running a checkpoint with the torch backend, unexported: (manifest, checkpoint, tokenizer folder)."""
    from .tokenizer import tokenizer_info

    options.setdefault("precision", "fp32")
    opts = ExportOptions(**options)
    ckpt = load_checkpoint(path)
    info = tokenizer_info(ckpt.tokenizer_dir, ckpt.config, [])
    return describe(ckpt, opts, info, {}), ckpt, ckpt.tokenizer_dir
