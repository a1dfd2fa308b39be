"""The export options, each declared once: its name, type, default, range or choices, help text and
command-line flag live on a field of `ExportOptions` (or, for the quantization flags, of
`QuantizeRequest`). `EXPORT_OPTIONS` lists them in order; `llama-ane export` builds its flags from
it and `llama_ane.export_model` its keywords, so the two cannot drift apart.

Light on purpose: nothing here imports torch or coremltools, so the command line can read the
table to answer `--help` or refuse a mistyped value at once.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..errors import LlamaANEError
from ..precision import PRECISIONS as PRECISION_FORMS
from ..model.functions import DECODE_FUNCTIONS, KV_CACHE_KINDS
from ..quantize.auto import DEFAULT_BUDGET_PCT
from ..quantize.schemes import DEFAULT_GROUP_SIZE, SCHEMES, QuantizeError, QuantizeOptions

if TYPE_CHECKING:
    from ..quantize.auto import Recipe

TARGETS = ("iOS16", "iOS17", "iOS18", "macOS13", "macOS14", "macOS15", "coreai")
MULTIFUNCTION_TARGETS = ("iOS18", "macOS15")
COREAI = "coreai"  # Core AI .aimodel assets (export/coreai.py) instead of Core ML packages
COREAI_SUFFIX = ".aimodel"
COREAI_INSTALL_HINT = 'install the Core AI packages with pip install -e ".[coreai]" (Python >= 3.11)'
FIRST_BUCKET = 512  # the smallest default context bucket: a short chat's first turns
MAX_BUCKETS = 6  # 512 .. 16384
KV_CACHE_CHOICES = ("auto", *KV_CACHE_KINDS)  # what --kv-cache accepts; auto resolves to one of the kinds
DECODE_CHOICES = ("auto", *DECODE_FUNCTIONS)  # what --decode-function accepts; auto resolves to one of them
FOLD_CHOICES = ("auto", "yes", "no")  # --fold-lm-head
PRECISIONS = tuple(PRECISION_FORMS)  # "fp16", "fp32"

OPTION = "llama_ane.option"  # the key of a field's metadata that declares it an export option


@dataclass(frozen=True)
class Option:
    """One export option: the keyword of `export_model` and the flag of `llama-ane export`.

    `type` is the Python type of a value (int, float, str or Path); `choices` (if any) are the only
    values allowed; `minimum` (`min_open`: excluded) bounds a number, `unit` names what it counts.
    `metavar` is how --help shows the value."""

    name: str
    default: Any
    type: type
    help: str
    flag: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    min_open: bool = False
    unit: str = ""
    metavar: str | None = None


def option(default: Any, help: str = "", *, type: type | None = None, flag: str | None = None,
           choices: tuple[str, ...] = (), minimum: float | None = None, min_open: bool = False, unit: str = "",
           metavar: str | None = None) -> Any:
    """A dataclass field that is an export option (see `Option`); `type` defaults to the default's,
    `flag` to the name with dashes."""
    if type is None:
        if default is None:
            raise TypeError("an option whose default is None needs its type")
        type = default.__class__
    spec = dict(help=help, type=type, flag=flag, choices=choices, minimum=minimum, min_open=min_open, unit=unit,
                metavar=metavar)
    return field(default=default, metadata={OPTION: spec})


def options_of(cls: type) -> tuple[Option, ...]:
    """The options that the fields of the dataclass `cls` declare, in field order; a field whose
    metadata names another dataclass (`expands`) stands for that class's options."""
    found = []
    for f in fields(cls):
        if "expands" in f.metadata:
            found.extend(options_of(f.metadata["expands"]))
            continue
        spec = dict(f.metadata[OPTION])
        flag = spec.pop("flag") or "--" + f.name.replace("_", "-")
        found.append(Option(f.name, f.default if f.default is not MISSING else None, flag=flag, **spec))
    return tuple(found)


class ExportOptionsError(LlamaANEError, ValueError):
    """Export options that cannot work together; the message says which and why."""


@dataclass(frozen=True)
class QuantizeRequest:
    """The quantization options as the command line takes them: one scheme for every part (or
    auto, or a recipe file), overrides per part, and the group and block sizes. `recipe()` and
    `options()` turn them into the `QuantizeOptions` the plan holds."""

    quantize: str = option(
        "none", f"Compress the weights: {', '.join(SCHEMES)} (lutN: N-bit palettization, intN: N-bit integers), "
        "or auto: per part and layer, the fewest bytes within --quantize-budget.", metavar="SCHEME")
    quantize_budget: float | None = option(
        None, f"Perplexity increase --quantize auto may spend, percent [default: {DEFAULT_BUDGET_PCT:g}].",
        type=float, minimum=0, min_open=True, unit="percent")
    quantize_recipe: Path | None = option(
        None, "Compress as a recipe says: a JSON file from --quantize auto (an export's manifest.json, or its "
        "quantization.recipe saved alone).", type=Path)
    quantize_embeddings: str | None = option(None, "Scheme of the embedding table [default: --quantize].",
                                             type=str, metavar="SCHEME")
    quantize_attention: str | None = option(None, "Scheme of the q/k/v/o projections [default: --quantize].",
                                            type=str, metavar="SCHEME")
    quantize_mlp: str | None = option(None, "Scheme of the MLP projections [default: --quantize].", type=str,
                                      metavar="SCHEME")
    quantize_lm_head: str | None = option(None, "Scheme of the LM head [default: --quantize].", type=str,
                                          metavar="SCHEME")
    group_size: int | None = option(
        None, "Output channels sharing one LUT [default on iOS18/macOS15: "
        f"{', '.join(f'{n} for {s}' for s, n in DEFAULT_GROUP_SIZE.items())}; 0 = one per tensor].", type=int)
    block_size: int | None = option(
        None, "Input channels sharing one scale [default: 32 for int4, 0 (one per output channel) for int8].",
        type=int)
    lut_block_size: int | None = option(
        None, "Scale and shift LUT values per row and block of this many input channels (iOS18/macOS15; 0 = per "
        "output channel, which the Neural Engine decompresses just in time; a block is the GPU's form, "
        "decompressed at load on the Neural Engine) [default: 0 for lut4, plain LUTs otherwise].", type=int)

    @property
    def per_part(self) -> dict[str, str | None]:
        return {"embeddings": self.quantize_embeddings, "attention": self.quantize_attention,
                "mlp": self.quantize_mlp, "lm_head": self.quantize_lm_head}

    def recipe(self) -> "Recipe | None":
        """The recipe of `quantize_recipe` (None without one), after refusing options that cannot go
        with `--quantize auto` or a recipe: these give every unit its form themselves."""
        from ..quantize.auto import Recipe

        if self.quantize_budget is not None and self.quantize != "auto":
            raise QuantizeError("--quantize-budget is the budget of --quantize auto; add --quantize auto or drop it")
        if self.quantize_budget is not None and self.quantize_budget <= 0:
            raise QuantizeError(f"--quantize-budget must be a positive percentage, got {self.quantize_budget:g}")
        if self.quantize != "auto" and self.quantize_recipe is None:
            return None
        sizes = (self.group_size, self.block_size, self.lut_block_size)
        if any(o is not None for o in (*self.per_part.values(), *sizes)):
            what = "--quantize-recipe" if self.quantize_recipe is not None else "--quantize auto"
            raise QuantizeError(f"{what} gives every part and layer its form; drop --quantize-embeddings/-attention/"
                                "-mlp/-lm-head, --group-size, --block-size and --lut-block-size")
        if self.quantize_recipe is None:
            return None
        if self.quantize not in ("none", "auto"):
            raise QuantizeError(f"--quantize-recipe gives every part and layer its form; drop --quantize {self.quantize}")
        return Recipe.load(self.quantize_recipe)

    def options(self, recipe: "Recipe | None") -> QuantizeOptions:
        """The compression to plan with: the recipe's, none yet for `--quantize auto` (its recipe is
        chosen from the checkpoint), else the schemes and sizes given."""
        if recipe is not None:
            return QuantizeOptions.from_recipe(recipe)
        if self.quantize == "auto":
            return QuantizeOptions(auto=True)
        return QuantizeOptions.from_cli(self.quantize, **self.per_part, group_size=self.group_size,
                                        block_size=self.block_size, lut_block_size=self.lut_block_size)


@dataclass(frozen=True)
class ExportOptions:
    """What an export builds, checked by `check()`. The fields are the options of `llama-ane export`
    and `llama_ane.export_model` (see `EXPORT_OPTIONS`); `quantize` holds the compression that the
    quantization options (`QuantizeRequest`) resolve to."""

    context_length: int = option(1024, "Tokens the KV cache holds.")
    prefill_length: int = option(64, "Query length of the prefill functions.")
    layers_per_chunk: int | None = option(
        None, "Decoder layers per block-chunk file [default: from weight bytes, <= ~1 GB (iOS) / 2 GB (macOS)].",
        type=int)
    branch_width: int = option(8, "Cascade width B: branches decoded per step over a shared prefix (0 = none).",
                               flag="--branches")
    suffix_length: int = option(256, "Tokens each cascade branch may add after the shared prefix.")
    # Never with state caches: the accepted path is written by the cache-update model, which cannot
    # write a chunk's states. 0 by default because every function is compiled and loaded on the
    # device, so an app that decodes speculatively asks for one.
    verify_window: int = option(
        0, "Tokens of the token tree one speculative-decoding step verifies, e.g. 16; 0 = no verify function "
        "(generate --speculative needs one; not with --kv-cache state).")
    # "auto" (or None): powers of two from FIRST_BUCKET (or the prefill window) up to the context
    # length, on targets whose packages hold several functions; one size: one bucket, the whole
    # context. A string of comma-separated sizes is read as those sizes.
    context_buckets: tuple[int, ...] | str | int | None = option(
        "auto", "Cache lengths with prefill and decode functions of their own; a step runs the smallest that "
        "holds its positions, so it reads no more of the cache than the conversation fills. auto: powers of two "
        f"from {FIRST_BUCKET} up to --context-length (iOS18/macOS15); one size: the whole context.",
        metavar="auto|SIZE[,SIZE...]")
    target: str = option("iOS18", "Minimum deployment target; iOS18/macOS15 give multifunction packages.",
                         choices=TARGETS)
    precision: str = option("fp16", choices=PRECISIONS)
    quantize: QuantizeOptions = field(default_factory=QuantizeOptions, metadata={"expands": QuantizeRequest})
    # "auto" resolves to "state" where states work (auto_kv_cache), else "inputs"
    kv_cache: str = option(
        "auto", "Where the KV caches live: passed in and written back by the asynchronous cache-update model "
        "(inputs), or states the chunks update in place (state; iOS18/macOS15 in fp16, or --target coreai; "
        "no --verify-window). "
        "auto: state where it works (Core AI included), else inputs.", choices=KV_CACHE_CHOICES)
    fold_lm_head: str = option(
        "auto", "Compute the LM head in the last chunk: one Core ML call per token fewer. auto: where its weights "
        "fit beside the chunk's in one package.", choices=FOLD_CHOICES)
    # Each Core ML function loaded for the Neural Engine wires its own copy of its package's weights
    # (contract/resident.py): "prefill" drops the decode functions, whose tokens then run as windows
    # of one real token. Rows are nearly free on the ANE while a step stays bound by its bytes.
    decode_function: str = option(
        "auto", "What decodes a token: a function of its own per model (decode), or the prefill window's "
        "function (prefill: one function per model and bucket, one copy of the weights on the Neural Engine; the "
        "cascade's branches run as rows of that window where every layer attends over one cache; auto context "
        "buckets become one). auto: prefill on Core ML targets, decode on Core AI, whose entry points share "
        "one copy.", choices=DECODE_CHOICES)

    def __post_init__(self) -> None:
        if self.decode_function == "auto":
            object.__setattr__(self, "decode_function", auto_decode_function(self.target))
        if self.kv_cache == "auto":
            object.__setattr__(self, "kv_cache", auto_kv_cache(self.target, self.precision, self.verify_window))
        buckets = self.context_buckets
        if isinstance(buckets, str) and buckets.strip() != "auto":
            buckets = parse_sizes(buckets)
        if buckets is None or isinstance(buckets, str):  # each bucket is a copy of the weights where one is asked for
            buckets = auto_buckets(self.context_length, self.prefill_length,
                                   self.multifunction and self.decode_function == "decode")
        elif isinstance(buckets, int):
            buckets = (buckets,)
        object.__setattr__(self, "context_buckets", tuple(int(b) for b in buckets))

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
        if self.verify_window < 0 or self.verify_window == 1 or self.verify_window > self.context_length:
            raise ExportOptionsError(f"--verify-window must be 0 (no speculative decoding) or 2..{self.context_length}, "
                                     f"got {self.verify_window}")
        self._check_buckets()
        if self.precision not in PRECISIONS:
            raise ExportOptionsError(f"--precision must be fp16 or fp32, got {self.precision!r}")
        if self.quantize.active and self.precision != "fp16":
            raise ExportOptionsError("--quantize compresses fp16 weights: drop --precision fp32")
        if self.target == COREAI:
            check_coreai(self)
        else:
            self.quantize.check(self.target)
        if self.fold_lm_head not in FOLD_CHOICES:
            raise ExportOptionsError(f"--fold-lm-head must be one of {', '.join(FOLD_CHOICES)}, "
                                     f"got {self.fold_lm_head!r}")
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ExportOptionsError(f"--kv-cache must be one of {', '.join(KV_CACHE_CHOICES)}, got {self.kv_cache!r}")
        if self.kv_cache == "state" and self.target not in MULTIFUNCTION_TARGETS + (COREAI,):
            raise ExportOptionsError(f"--kv-cache state needs Core ML or Core AI states, which --target {self.target} does not "
                                     f"have: use --target {', '.join(MULTIFUNCTION_TARGETS + (COREAI,))}, or "
                                     "--kv-cache inputs")
        if self.decode_function not in DECODE_FUNCTIONS:
            raise ExportOptionsError(f"--decode-function must be one of {', '.join(DECODE_CHOICES)}, "
                                     f"got {self.decode_function!r}")
        if self.kv_cache == "state" and self.verify_window:
            raise ExportOptionsError("--kv-cache state has no speculative verify function: its accepted tokens are "
                                     "written by the cache-update model, which cannot write the chunks' states; "
                                     "drop --verify-window, or use --kv-cache inputs")
        if self.kv_cache == "state" and self.precision != "fp16" and self.target != COREAI:
            raise ExportOptionsError("--kv-cache state keeps the caches in Core ML states, which are float16: "
                                     "drop --precision fp32, or use --kv-cache inputs")

    def _check_buckets(self) -> None:
        b = self.context_buckets
        if list(b) != sorted(set(b)) or not b:
            raise ExportOptionsError(f"--context-buckets must be distinct sizes in ascending order, got "
                                     f"{','.join(map(str, b))}")
        if b[-1] != self.context_length:
            raise ExportOptionsError(f"the largest of --context-buckets ({b[-1]}) must be --context-length "
                                     f"({self.context_length}): it is the context the export holds")
        for size in b:
            if size % 32 or size < self.prefill_length:
                raise ExportOptionsError(f"context bucket {size} must be a multiple of 32 (ANE cache rule) and hold "
                                         f"a prefill window ({self.prefill_length})")
        if len(b) > 1 and not self.multifunction:
            raise ExportOptionsError(f"--context-buckets with several sizes needs packages that share weights between "
                                     f"functions, which --target {self.target} does not have: use --target "
                                     f"{' or '.join(MULTIFUNCTION_TARGETS)}, or --context-buckets {self.context_length}")
        if len(b) > MAX_BUCKETS:
            raise ExportOptionsError(f"--context-buckets has {len(b)} sizes; at most {MAX_BUCKETS} (each adds a "
                                     "prefill and a decode function that the device compiles and loads)")

    @property
    def multifunction(self) -> bool:
        return self.target in MULTIFUNCTION_TARGETS or self.target == COREAI  # an asset holds several functions


EXPORT_OPTIONS = options_of(ExportOptions)
QUANTIZE_OPTIONS = options_of(QuantizeRequest)


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


def export_settings(given: Mapping[str, Any], caller: str = "export_model",
                    other_keywords: tuple[str, ...] = ()) -> tuple[dict[str, Any], QuantizeRequest]:
    """Split keyword options into ExportOptions' (all but `quantize`) and the QuantizeRequest, after
    refusing a name that is no option with the TypeError Python gives, naming the nearest one (of
    the options and the caller's `other_keywords`)."""
    names = [o.name for o in EXPORT_OPTIONS]
    for name in given:
        if name not in names:
            near = difflib.get_close_matches(name, [*names, *other_keywords], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; the options are {', '.join(names)}"
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}{hint}")
    quantize = {o.name for o in QUANTIZE_OPTIONS}
    plain = {k: v for k, v in given.items() if k not in quantize}
    return plain, QuantizeRequest(**{k: v for k, v in given.items() if k in quantize})


def parse_sizes(text: str) -> tuple[int, ...]:
    """--context-buckets given as comma-separated sizes, e.g. "512,1024,2048"."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ExportOptionsError(f"--context-buckets must be 'auto' or sizes such as 512,1024,2048, got {text!r}") \
            from None


def auto_decode_function(target: str) -> str:
    """What --decode-function auto becomes: "prefill" on Core ML targets, where each function loaded
    for the Neural Engine wires its own copy of the weights (contract/resident.py), so the prefill
    window serving every phase keeps one; "decode" on Core AI, whose entry points share one copy."""
    return "decode" if target == COREAI else "prefill"


def auto_kv_cache(target: str, precision: str, verify_window: int) -> str:
    """What --kv-cache auto becomes: "state" where states work (an iOS18/macOS15 target in fp16, or
    Core AI; no verify function: see `ExportOptions.check`), else "inputs". States save a call per
    chunk and decode step: each chunk writes its own K/V, with no cache-update call. On Core AI they
    also keep a long generation's memory nearly flat, since its runtime keeps every output it
    returns and the cache-update model would return the caches every step (docs/coreai.md)."""
    states = (target in MULTIFUNCTION_TARGETS and precision == "fp16" or target == COREAI) and not verify_window
    return "state" if states else "inputs"


def check_coreai(opts: ExportOptions) -> None:
    """Refuse what --target coreai does not build: compression other than one LUT scheme for every
    part (coreai-opt palettization), and scaled or blockwise forms."""
    q = opts.quantize
    if q.auto:
        raise ExportOptionsError("--target coreai compresses every part with one LUT scheme, not a form per layer: "
                                 "drop --quantize auto, use --quantize lut8, lut6 or lut4 (or an iOS18/macOS15 "
                                 "target for auto)")
    if q.recipe is not None:
        raise ExportOptionsError("--target coreai compresses every part with one LUT scheme: drop --quantize auto "
                                 "and --quantize-recipe, use --quantize lut8, lut6 or lut4")
    schemes = set(q.schemes.values()) if q.active else set()
    if schemes and (len(schemes) > 1 or not next(iter(schemes)).startswith("lut")):
        raise ExportOptionsError(f"--target coreai compresses weights with coreai-opt palettization only, one scheme "
                                 f"for every part; got {', '.join(sorted(schemes))}: use --quantize lut8, lut6 or lut4 "
                                 "without per-part overrides, or an iOS/macOS target for integer weights")
    if q.block_size or q.lut_block_size is not None:
        raise ExportOptionsError("--target coreai has plain LUTs (one per tensor, or per --group-size channels): "
                                 "drop --block-size and --lut-block-size")
    if opts.decode_function != "decode":
        raise ExportOptionsError("--target coreai: its entry points share one copy of the weights, so decode keeps "
                                 "a function of its own; drop --decode-function prefill")


def auto_buckets(context_length: int, prefill_length: int, multifunction: bool = True) -> tuple[int, ...]:
    """The default context buckets: FIRST_BUCKET (or the prefill window, when longer), doubling, up to
    `context_length`; one bucket where functions cannot share weights."""
    sizes, size = [], max(FIRST_BUCKET, prefill_length)
    while multifunction and size < context_length:
        sizes.append(size)
        size *= 2
    return (*sizes, context_length)
