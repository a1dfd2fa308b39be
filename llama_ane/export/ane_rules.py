"""The ANE rules an export must follow, checked on a static summary of each program.

Each rule returns `Violation`s naming the package, function, tensor or op, and what to change.
The rules (see docs/ARCHITECTURE "ANE rules"):

- no dimension above 16384 in any tensor the ANE would process (an embedding table read only
  by a gather is exempt: the lookup itself is not an ANE op, only its output is);
- no fp32 inputs or outputs (fp16 I/O; int32 ids and positions are fine);
- no ops that make the ANE fall back: gather (or scatter) inside a block chunk, cond/while_loop,
  slicing with runtime offsets, band_part (a slice update written straight into a state is the
  exception: it is how an iOS18 program updates its KV-cache state in place);
- states (iOS18 read-write buffers, the `--kv-cache state` caches) are fp16, only on targets that
  have them, and as the manifest declares them;
- cache and state tensors: every dimension after the first (the layer axis) that is not 1 is a
  multiple of 32; for cascade suffix caches (layers*kv_heads, branches, head_dim, length) the
  branch axis is a batch axis too, and head_dim and length are checked;
- no op the Neural Engine is reported to compute wrongly: an in-graph argmax (wrong under default
  specialization on an iPhone 17 Pro), silu (~1e-3 off near 0) and softplus (0 above ~10.4 in
  fp16), each written in a form reported accurate instead (model.layers.ops.silu_mil, softplus_mil);
- package size at most 1 GB for iOS targets, 2 GB for macOS targets;
- compressed weights only in forms the target runs: grouped LUTs, blockwise and 4-bit integers
  (constexpr_blockwise_shift_scale, the iOS18 constexpr_lut_to_dense) need iOS18/macOS15.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..limits import CACHE_MULTIPLE, FILE_LIMIT_BYTES, MAX_DIM, platform_of
from ..model import names as N

IOS18_COMPRESSION = {  # constexpr op (form) -> what it is, for the message
    "constexpr_blockwise_shift_scale": "blockwise or 4-bit integer weights",
    "constexpr_lut_to_dense/iOS18": "per-grouped-channel LUT weights",
    "constexpr_lut_to_sparse": "sparse LUT weights",
    "constexpr_sparse_blockwise_shift_scale": "sparse blockwise weights",
    "constexpr_cast": "cast weights",
}
IOS18_TARGETS = ("iOS18", "macOS15")

FALLBACK_ANYWHERE = {"cond": "control flow", "while_loop": "control flow", "band_part": "in-graph band_part"}
FALLBACK_IN_CHUNKS = {"gather", "gather_along_axis", "gather_nd", "scatter", "scatter_along_axis", "scatter_nd"}
DYNAMIC_SLICE_PARAMS = {
    "slice_by_index": ("begin", "end", "stride"),
    "slice_by_size": ("begin", "size"),
    "slice_update": ("begin", "end", "stride"),
}
FLOAT32_DTYPES = {"float32", "float64"}


@dataclass
class TensorInfo:
    """A tensor of a function: I/O, op output or const; `consumers` are the op types reading it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "input" | "output" | "op" | "const"
    consumers: set[str] = field(default_factory=set)


@dataclass
class OpInfo:
    """One op: its type, name and, per parameter, whether each argument is a compile-time const."""

    op_type: str
    name: str
    const_params: dict[str, bool]


@dataclass
class FunctionSummary:
    """What the rules need to know about one function of one package."""

    package: str
    function: str
    role: str  # "embeddings" | "chunk" | "lm_head" | "cache_update" | "unknown"
    inputs: list  # TensorDesc
    outputs: list  # TensorDesc
    tensors: list[TensorInfo]
    ops: list[OpInfo]


@dataclass
class Violation:
    """One broken rule. `rule` is a stable id: max-dim, fp32-io, fallback-op, cache-multiple, file-size."""

    rule: str
    package: str
    function: str | None
    message: str

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        where = self.package if self.function is None else f"{self.package}:{self.function}"
        return f"[{self.rule}] {where}: {self.message}"


def check_max_dim(fn: FunctionSummary) -> list[Violation]:
    out = []
    for t in fn.tensors:
        if not t.shape or max(t.shape) <= MAX_DIM:
            continue
        if t.kind == "const" and t.consumers and t.consumers <= FALLBACK_IN_CHUNKS:
            continue  # a lookup table read only by gather: only the gathered rows reach the ANE
        out.append(Violation(
            "max-dim", fn.package, fn.function,
            f"{t.kind} tensor {t.name!r} has shape {list(t.shape)}: a dimension above {MAX_DIM} makes the "
            "ANE reject the op; split it (e.g. the LM head over the vocabulary)",
        ))
    return out


def check_fp32_io(fn: FunctionSummary) -> list[Violation]:
    out = []
    for kind, descs in (("input", fn.inputs), ("output", fn.outputs)):
        for d in descs:
            if d.dtype in FLOAT32_DTYPES:
                out.append(Violation(
                    "fp32-io", fn.package, fn.function,
                    f"{kind} {d.name!r} is {d.dtype}: ANE programs take and give fp16; export with "
                    "fp16 I/O (no fp32 casts at the boundary)",
                ))
    return out


def check_fallback_ops(fn: FunctionSummary) -> list[Violation]:
    out = []
    consumers = {t.name: t.consumers for t in fn.tensors}
    for op in fn.ops:
        if op.op_type in FALLBACK_ANYWHERE:
            out.append(Violation(
                "fallback-op", fn.package, fn.function,
                f"op {op.op_type!r} ({op.name}): {FALLBACK_ANYWHERE[op.op_type]} is not run by the ANE; "
                "use static masks/shapes instead",
            ))
        elif op.op_type in FALLBACK_IN_CHUNKS and fn.role == "chunk":
            out.append(Violation(
                "fallback-op", fn.package, fn.function,
                f"op {op.op_type!r} ({op.name}) inside a block chunk makes the ANE fall back; do lookups "
                "in the embeddings model and write caches with masks or one-hot matmuls",
            ))
        elif op.op_type in DYNAMIC_SLICE_PARAMS:
            dynamic = [p for p in DYNAMIC_SLICE_PARAMS[op.op_type] if op.const_params.get(p) is False]
            if dynamic and not (op.op_type == "slice_update" and consumers.get(op.name) == {"write_state"}):
                out.append(Violation(
                    "fallback-op", fn.package, fn.function,
                    f"op {op.op_type!r} ({op.name}) slices at runtime offsets ({', '.join(dynamic)}): dynamic "
                    "slicing makes the ANE fall back; use static slices or one-hot matmuls",
                ))
    return out


def _is_cache(desc) -> bool:
    name = desc.name.lower()
    return getattr(desc, "is_state", False) or "cache" in name or ("suffix" in name and "mask" not in name)


def _first_checked_axis(desc) -> int:
    """Leading batch-like axes are exempt: layers, and for suffix caches also branches."""
    name = desc.name.lower()
    return 2 if "suffix" in name and "cache" not in name else 1


# what sets a cache's axes, for the fix a cache-multiple violation names
CACHE_HINTS = {None: "pick a context length (and kv channels) that are",
               N.DELTA_STATE: "a linear-attention layer's state is linear_num_value_heads * linear_key_head_dim "
                              "x linear_value_head_dim: the checkpoint's sizes must be"}


def check_cache_multiple(fn: FunctionSummary) -> list[Violation]:
    out = []
    seen = set()
    for kind, descs in (("input", fn.inputs), ("output", fn.outputs)):
        for d in descs:
            if not _is_cache(d) or d.name in seen:
                continue
            seen.add(d.name)
            first = _first_checked_axis(d)
            bad = [(axis, n) for axis, n in enumerate(d.shape) if axis >= first and n != 1 and n % CACHE_MULTIPLE]
            if bad:
                dims = ", ".join(f"axis {axis} = {n}" for axis, n in bad)
                out.append(Violation(
                    "cache-multiple", fn.package, fn.function,
                    f"{'state' if d.is_state else kind} {d.name!r} {list(d.shape)}: {dims} not a multiple of "
                    f"{CACHE_MULTIPLE}; {CACHE_HINTS.get(d.name, CACHE_HINTS[None])}",
                ))
    return out


# ops the Neural Engine is reported to get wrong -> (what goes wrong, the source, what to write instead)
WRONG_ON_ANE = {
    "reduce_argmax": ("an in-graph argmax was wrong under default specialization on an iPhone 17 Pro "
                      "(apple/coreai-torch issue 116)", "take the argmax of the logits on the host"),
    "silu": ("the Neural Engine's silu is ~1e-3 off near 0 (Anemll Forge)", "write 0.5 x (1 + tanh(x / 2))"),
    "softplus": ("fp16 softplus collapses to 0 above ~10.4 (coremltools issue 2687)",
                 "write max(x, 0) + log(1 + exp(-|x|))"),
}


def check_numerics_ops(fn: FunctionSummary) -> list[Violation]:
    return [Violation("ane-numerics", fn.package, fn.function,
                      f"op {op.op_type!r} ({op.name}): {WRONG_ON_ANE[op.op_type][0]}; {WRONG_ON_ANE[op.op_type][1]}")
            for op in fn.ops if op.op_type in WRONG_ON_ANE]


FUNCTION_RULES = (check_max_dim, check_fp32_io, check_fallback_ops, check_cache_multiple, check_numerics_ops)

STATE_DTYPE = "float16"


def check_states(fn: FunctionSummary, target: str, declared: list[dict] | None = None) -> list[Violation]:
    """The function's states: fp16 (the only state type Core ML runs), on a target that has states
    (iOS18/macOS15), and, given the manifest's `declared` states of this function, exactly those
    (names, shapes, dtypes)."""
    states = [d for d in fn.inputs if getattr(d, "is_state", False)]
    out = []
    for d in states:
        if d.dtype != STATE_DTYPE:
            out.append(Violation("state-dtype", fn.package, fn.function,
                                 f"state {d.name!r} is {d.dtype}: Core ML states are {STATE_DTYPE}; export with "
                                 "--precision fp16"))
    if states and target not in IOS18_TARGETS:
        out.append(Violation("state-target", fn.package, fn.function,
                             f"states ({', '.join(d.name for d in states)}) need iOS18/macOS15, the target is "
                             f"{target}; export with --target iOS18 (or macOS15), or with --kv-cache inputs"))
    if declared is not None:
        found = {d.name: (list(d.shape), d.dtype) for d in states}
        wanted = {t["name"]: (list(t["shape"]), t["dtype"]) for t in declared}
        if found != wanted:
            out.append(Violation("state-manifest", fn.package, fn.function,
                                 f"the package's states {found or 'none'} are not the manifest's {wanted or 'none'}; "
                                 "the package and manifest.json disagree: re-export"))
    return out


def compression_form(op: OpInfo) -> str:
    """The constexpr op's form: its type, with "/iOS18" for the iOS18 signature of
    constexpr_lut_to_dense (its indices and LUT are inputs; the iOS16 one holds them, and a
    `shape`, as attributes)."""
    if op.op_type == "constexpr_lut_to_dense" and "indices" in op.const_params:
        return "constexpr_lut_to_dense/iOS18"
    return op.op_type


def check_compression(fn: FunctionSummary, target: str) -> list[Violation]:
    """Compressed weights the target cannot decompress: a Core ML load error on the device."""
    if target in IOS18_TARGETS:
        return []
    platform = "macOS15" if platform_of(target) == "macOS" else "iOS18"
    out = []
    for op in fn.ops:
        what = IOS18_COMPRESSION.get(compression_form(op))
        if what:
            out.append(Violation(
                "compression-op", fn.package, fn.function,
                f"op {op.op_type!r} ({op.name}): {what} need {platform} or later, the target is {target}; "
                f"export with --target {platform}, or with a scheme {target} runs (int8, lutN without --group-size)",
            ))
    return out


def check_function(fn: FunctionSummary) -> list[Violation]:
    """Every per-function rule on `fn`."""
    return [v for rule in FUNCTION_RULES for v in rule(fn)]


def check_file_size(package: str, size_bytes: int, target: str) -> list[Violation]:
    limit = FILE_LIMIT_BYTES[platform_of(target)]
    if size_bytes <= limit:
        return []
    return [Violation(
        "file-size", package, None,
        f"{size_bytes / 1e9:.2f} GB is over the {limit / 1e9:g} GB a {platform_of(target)} device loads "
        "comfortably; use fewer layers per chunk (or compress the weights)",
    )]
