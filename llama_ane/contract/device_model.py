"""The device cost model: modelled time of a decode, prefill, cascade or verify step of an export on
named Apple chips, from the manifest (or from a config alone) and published chip figures.

On the Neural Engine a step is bound by streaming its bytes and by the fixed cost of each Core ML
call, so one step of S tokens takes about

    time = max(bytes / streaming bandwidth, flops / fp16 peak) + calls x per-call cost

bytes: the weights (`traffic.weight_read_bytes`), the K/V the chunks read up to the context bucket
that runs, KV-shared layers' reads of other chunks' caches among them (`traffic.kv_read_bytes`), the
writing of the new K/V (`traffic.kv_write_bytes`) and the tensors passed between the models
(`traffic.window_io_bytes`: hidden states, masks, logits);
flops: 2 per weight per token plus the attention's 4 per query channel per key (a global layer's keys
the bucket's, a sliding layer's with a ring its R slots, a conv or linear-attention layer's none), and
a linear-attention layer's delta rule (`delta_flops`: its matmuls over the window); calls: the Core ML
predictions the runtime makes for the step (`calls_per_step`). A decode step's compute is far below
its memory time, so decode tokens/s is 1 / (bytes / bandwidth + calls x per-call). Everything here
is a model (chip figures are published or assumed, see `CHIPS` and docs/device-model.md), not a
measurement: the ANE's own caches, the host's work between calls and any overlap of the
asynchronous cache updates with the next chunk are left out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..config import LlamaConfig
from ..errors import InvalidArgumentError
from ..model.functions import BRANCHES, VERIFY
from .layer_costs import ATTENTION, WINDOW_KINDS
from .manifest import decode_function, window_cascade
from .traffic import (DTYPE_BYTES, bucket_for, kv_read_bytes, kv_write_bytes, weight_read_bytes, window_io_bytes,
                      window_tokens)

if TYPE_CHECKING:
    from ..quantize import QuantizeOptions

MODELLED = "modelled from the manifest and published or assumed chip figures, not measured"

# sources of the chip figures (docs/device-model.md gives each in full)
ANEMLL_BENCH = "published (anemll-bench LM-head streaming)"
MAC_CALLS = "published (~0.1-0.23 ms per dispatch on recent Macs)"
IPHONE_CALLS = "published, one measurement (~2.3 ms per chunk round trip on an iPhone)"
PHONE_BANDWIDTH = "assumed (the same-generation base M chip's figure, below the phone's memory peak)"
APPLE_TOPS = "assumed (Apple's quoted ANE TOPS; int8 figures halved for fp16)"
FORGE_BANDWIDTH = "published (Anemll Forge: dense ANE weight streaming on M5 Max and M6)"
NEXT_TOPS = "assumed (no published ANE figure: M4's)"
# how the Neural Engine runs palettized (LUT) weights, where a source says
LUT_NATIVE = "decodes LUT weights natively (published, Anemll Forge)"
LUT_INT8 = "runs every LUT at the int8 rate (published, Anemll Forge)"


@dataclass(frozen=True)
class Chip:
    """One chip's Neural Engine, as the model sees it: ranges are (low, high)."""

    name: str
    bandwidth_gb_s: tuple[float, float]  # weight streaming, 10^9 bytes/s
    per_call_ms: tuple[float, float]  # fixed cost of one Core ML prediction
    fp16_tflops: float  # the compute bound of prefill and verify windows
    bandwidth_source: str
    per_call_source: str
    tflops_source: str = APPLE_TOPS
    luts: str | None = None  # how its Neural Engine runs LUT weights (LUT_NATIVE, LUT_INT8), None: no source

    def seconds(self, step: "StepCost", case: str = "mid") -> float:
        """Modelled seconds of `step`: case "mid" takes the middle of each range, "slow" the low
        bandwidth and the high per-call cost, "fast" the other ends."""
        (bw_lo, bw_hi), (call_lo, call_hi) = self.bandwidth_gb_s, self.per_call_ms
        bandwidth, call = {"mid": ((bw_lo + bw_hi) / 2, (call_lo + call_hi) / 2), "slow": (bw_lo, call_hi),
                           "fast": (bw_hi, call_lo)}[case]
        return max(step.bytes / (bandwidth * 1e9), step.flops / (self.fp16_tflops * 1e12)) + step.calls * call / 1e3

    def tokens_per_s(self, step: "StepCost", case: str = "mid") -> float:
        return step.tokens / self.seconds(step, case)

    def describe(self) -> dict:
        return {"bandwidth_gb_s": list(self.bandwidth_gb_s), "per_call_ms": list(self.per_call_ms),
                "fp16_tflops": self.fp16_tflops, "lut_weights": self.luts,
                "sources": {"bandwidth": self.bandwidth_source, "per_call": self.per_call_source,
                            "fp16_tflops": self.tflops_source}}


def _mac(name: str, bandwidth: tuple[float, float], tflops: float, bandwidth_source: str = ANEMLL_BENCH,
         tflops_source: str = APPLE_TOPS, luts: str | None = None) -> Chip:
    return Chip(name, bandwidth, (0.1, 0.23), tflops, bandwidth_source, MAC_CALLS, tflops_source, luts)


def _phone(name: str, bandwidth: tuple[float, float], tflops: float) -> Chip:
    return Chip(name, bandwidth, (2.3, 2.3), tflops, PHONE_BANDWIDTH, IPHONE_CALLS)


BASE_M = (55.0, 64.0)  # base M1-M4
MAX_M = (120.0, 126.0)  # M3 Max, M4 Pro, M4 Max
NEXT_M = (155.0, 165.0)  # M5 Max, M6
CHIPS: dict[str, Chip] = {c.name: c for c in (
    _mac("M1", BASE_M, 11.0),  # 11 TOPS (fp16)
    _mac("M2", BASE_M, 15.8),  # 15.8 TOPS (fp16)
    _mac("M3", BASE_M, 18.0),  # 18 TOPS (fp16)
    _mac("M4", BASE_M, 19.0),  # 38 TOPS int8
    _mac("M3 Max", MAX_M, 18.0),
    _mac("M4 Pro", MAX_M, 19.0),
    _mac("M4 Max", MAX_M, 19.0),
    _mac("M5", (70.0, 70.0), 19.0, "published (anemll-bench, base M5; one figure)"),  # TOPS assumed as M4's
    _mac("M5 Max", NEXT_M, 19.0, FORGE_BANDWIDTH, NEXT_TOPS, LUT_INT8),
    _mac("M6", NEXT_M, 19.0, FORGE_BANDWIDTH, NEXT_TOPS, LUT_NATIVE),
    _phone("A17 Pro", (45.0, 51.0), 17.5),  # 35 TOPS int8; memory peak ~51 GB/s
    _phone("A18 Pro", (50.0, 60.0), 17.5),  # 35 TOPS int8; memory peak ~60 GB/s
    _phone("A19 Pro", (55.0, 70.0), 17.5),  # TOPS assumed as A18 Pro's
)}


def chip(name: str) -> Chip:
    """The chip called `name` (case and spaces ignored), or an error listing the known names."""
    key = name.replace(" ", "").lower()
    for c in CHIPS.values():
        if c.name.replace(" ", "").lower() == key:
            return c
    raise InvalidArgumentError(f"--chip {name!r} is not a known chip; choose one of {', '.join(CHIPS)}")


@dataclass(frozen=True)
class StepCost:
    """What one step moves and runs: `tokens` it yields (1 for decode, the branches of a cascade
    step, the prompt tokens of a prefill window), its bytes, flops and Core ML calls."""

    tokens: int
    bytes: int
    flops: float
    calls: int

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(self.tokens + other.tokens, self.bytes + other.bytes, self.flops + other.flops,
                        self.calls + other.calls)

    def times(self, n: int) -> "StepCost":
        return StepCost(self.tokens * n, self.bytes * n, self.flops * n, self.calls * n)


def calls_per_step(manifest: dict, function: str | None = None) -> int:
    """Core ML calls of one step of `function`, as the runtime's pipeline makes them: every
    embeddings file, every chunk, every LM head file (none when the last chunk carries the head),
    and the cache-update call of each chunk whose K/V it writes (none for a single-sequence step of
    an export with state caches; a verify step's are made when its accepted path is written).
    `function` defaults to the one a decoded token runs."""
    function = function or decode_function(manifest)
    return (len(manifest["embeddings"]["models"]) + len(manifest["chunks"]) + len(manifest["lm_head"]["models"])
            + sum(1 for c in manifest["chunks"] if c["cache_update"].get(function)))


def _flops(manifest: dict, function: str, tokens: int, attended: int, new: int) -> float:
    """2 flops per weight per token (Gemma 4's per-layer projection among them; a conv layer's
    C x kernel taps among them), each attention layer's over its keys (`attention_keys`,
    `layer_costs.Attention.flops`) per token, and what each layer kind keeping a fixed-size state
    runs besides its weights over the step's window (`delta_flops`)."""
    cfg = LlamaConfig.from_dict(manifest["config"])
    params = weight_read_bytes(manifest, dense=True) / DTYPE_BYTES[manifest["cache"]["dtype"]]
    keys = attention_keys(manifest, attended, new, cfg)
    attention = sum(ATTENTION.flops(cfg, n, k) for n, k in enumerate(keys))
    return tokens * (2 * params + attention) + delta_flops(manifest, function)


def delta_flops(manifest: dict, function: str) -> float:
    """Flops the layer kinds with recurrent states run besides their weights in one step of
    `function` (`layer_costs.WINDOW_KINDS`: the delta rule's matmuls, the Mamba-2 mixers' SSD form)."""
    tokens = window_tokens(manifest, function)
    return sum(k.flops(manifest, function, tokens) for k in WINDOW_KINDS)


def attention_keys(manifest: dict, attended: int, new: int, cfg: LlamaConfig | None = None) -> list[int]:
    """Per decoder layer, the keys a query attends over in a step with `attended` cached positions
    read (the bucket that runs) and `new` positions of its own (the window, or a cascade's suffix),
    as `layer_costs.Attention.keys` says, the ring's length from cache.sliding. `cfg`: the
    manifest's config, where the caller has read it."""
    cfg = cfg or LlamaConfig.from_dict(manifest["config"])
    ring = (manifest["cache"].get("sliding") or {}).get("length", 0)
    return [ATTENTION.keys(cfg, n, attended, new, ring) for n in range(cfg.num_hidden_layers)]


def step_cost(manifest: dict, function: str, filled: int, tokens: int | None = None, dense: bool = False) -> StepCost:
    """One step of `function` after `filled` cached positions, yielding `tokens` (default: its
    window). The cache bucket that runs holds the filled positions and the window's (a cascade
    step writes its tokens to the branches' suffix caches: its bucket holds the prefix)."""
    window = window_tokens(manifest, function)
    attended = bucket_for(manifest, filled + (0 if function == BRANCHES else window))
    new = manifest.get("suffix_length", 0) if function == BRANCHES else window
    moved = (weight_read_bytes(manifest, dense) + kv_read_bytes(manifest, attended, function)
             + kv_write_bytes(manifest, attended, function) + window_io_bytes(manifest, function))
    return StepCost(window if tokens is None else tokens, moved, _flops(manifest, function, window, attended, new),
                    calls_per_step(manifest, function))


def decode_step(manifest: dict, filled: int, dense: bool = False) -> StepCost:
    """One decode step (one token) after `filled` cached positions; `dense`: the weights read
    decompressed (a device that expands compressed weights at load). Where the prefill function
    decodes, the step computes its whole window for its one token."""
    return step_cost(manifest, decode_function(manifest), filled, tokens=1, dense=dense)


def prefill_cost(manifest: dict, prompt_length: int) -> StepCost:
    """Prefilling `prompt_length` tokens into an empty cache, as the pipeline windows them: windows
    of `prefill_length` tokens, each reading the weights once and computing the whole window
    (padding included); a last window of one token runs the decode function (`decode_step`)."""
    width = manifest["prefill_length"]
    total = StepCost(0, 0, 0.0, 0)
    for start in range(0, prompt_length, width):
        n = min(width, prompt_length - start)
        total += step_cost(manifest, "prefill", start, tokens=n) if n > 1 else decode_step(manifest, start)
    return total


def cascade_cost(manifest: dict, prefix: int, branches: int) -> StepCost:
    """One token for each of `branches` branches over a `prefix`-token shared prefix: groups of the
    exported width B, each one "decode_branches" step (the prefix read once, every branch's
    suffix cache whole) or, where the cascade steps through the prefill window (manifest
    "cascade" "window"), one prefill window of the group's rows over the cache."""
    width = manifest.get("branch_width") or 0
    groups = math.ceil(branches / width)
    function = "prefill" if window_cascade(manifest) else BRANCHES
    return step_cost(manifest, function, prefix, tokens=0).times(groups) + StepCost(branches, 0, 0.0, 0)


def verify_cost(manifest: dict, filled: int) -> StepCost:
    """One speculative-decoding step: a token tree of the export's W tokens after `filled` cached
    positions (yielding its accepted tokens, counted by the caller)."""
    return step_cost(manifest, VERIFY, filled, tokens=1)


def break_even_tokens(manifest: dict, filled: int, chip_: Chip, case: str = "mid") -> float:
    """Tokens a verify step must yield on average (accepted drafts plus the model's own next token)
    to match plain decoding: the verify step's time over a decode step's. The drafter's own cost
    is left out."""
    return chip_.seconds(verify_cost(manifest, filled), case) / chip_.seconds(decode_step(manifest, filled), case)


def check_filled(manifest: dict, filled: int, flag: str = "--filled") -> None:
    """Refuse a filled position count outside the context (a decode step needs room for its token)."""
    ctx = manifest["context_length"]
    if not 0 <= filled < ctx:
        raise InvalidArgumentError(f"{flag} must be 0..{ctx - 1} (the context holds {ctx} tokens), got {filled}")


def report(manifest: dict, filled: int, chips: Sequence[Chip], prompt_length: int | None = None,
           branches: int | None = None) -> dict:
    """The model at `filled` positions for `chips`, as a JSON-ready dict: the decode step's bytes
    and calls, and per chip the decode tokens/s (with the range its figures span), plus the time
    to first token of a `prompt_length` prompt, the tokens/s of `branches` cascade branches over
    `filled` prefix tokens, and the verify break-even where the export has a verify function."""
    check_filled(manifest, filled)
    if prompt_length is not None and not 1 <= prompt_length <= manifest["context_length"]:
        raise InvalidArgumentError(f"--prompt-length must be 1..{manifest['context_length']} (the context), "
                                   f"got {prompt_length}")
    if branches is not None and branches < 1:
        raise InvalidArgumentError(f"--branches must be at least 1, got {branches}")
    if branches is not None and filled < 1:
        raise InvalidArgumentError("--branches decodes over a shared prefix of --filled tokens: give --filled 1 or more")
    if branches is not None and not manifest.get("branch_width"):
        raise InvalidArgumentError("--branches needs a cascade function, which this export lacks (exported with "
                                   "--branches 0): re-export with --branches 8")
    step = decode_step(manifest, filled)
    dense = decode_step(manifest, filled, dense=True)
    attended = bucket_for(manifest, filled + 1)
    out: dict = {"modelled": MODELLED, "filled": filled, "attended_positions": attended,
                 "weight_read_bytes": weight_read_bytes(manifest),
                 "weight_read_bytes_dense": weight_read_bytes(manifest, dense=True),
                 "kv_read_bytes": kv_read_bytes(manifest, attended), "kv_write_bytes": kv_write_bytes(manifest, attended),
                 "step_bytes": step.bytes, "calls_per_token": step.calls, "chips": {}}
    extra = {}
    if prompt_length is not None:
        extra["prefill"] = prefill_cost(manifest, prompt_length)
        out["prefill"] = {"prompt_length": prompt_length, "bytes": extra["prefill"].bytes,
                          "flops": extra["prefill"].flops, "calls": extra["prefill"].calls}
    if branches is not None:
        extra["cascade"] = cascade_cost(manifest, filled, branches)
        out["cascade"] = {"branches": branches, "prefix": filled, "width": manifest["branch_width"],
                          "bytes": extra["cascade"].bytes, "calls": extra["cascade"].calls}
    if manifest.get("verify_window"):
        extra["verify"] = verify_cost(manifest, filled)
        out["verify"] = {"window": manifest["verify_window"], "bytes": extra["verify"].bytes,
                         "flops": extra["verify"].flops, "calls": extra["verify"].calls}
    for c in chips:
        row = {**c.describe(), "tokens_per_s": c.tokens_per_s(step),
               "tokens_per_s_range": [c.tokens_per_s(step, "slow"), c.tokens_per_s(step, "fast")]}
        if dense.bytes != step.bytes:
            row["tokens_per_s_dense"] = c.tokens_per_s(dense)
        if "prefill" in extra:
            row["ttft_ms"] = c.seconds(extra["prefill"]) * 1e3
        if "cascade" in extra:
            row["cascade_tokens_per_s"] = c.tokens_per_s(extra["cascade"])
        if "verify" in extra:
            row["verify_break_even_tokens"] = c.seconds(extra["verify"]) / c.seconds(step)
        out["chips"][c.name] = row
    return out


def read_config(path: Path) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face `config.json` (a file, or a folder holding one)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise InvalidArgumentError(f"--config {path}: no such file (give a config.json or a folder holding one)")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"--config {file} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"--config {file} is not a config.json (its top level is not an object)")
    return LlamaConfig.from_hf_dict(data)


def manifest_from_config(cfg: LlamaConfig, context_length: int = 1024, quantize: "str | QuantizeOptions" = "none",
                         **options) -> dict:
    """The manifest an export of `cfg` would write (no weights read, nothing written): the model's
    input for shapes not exported. `quantize` is a scheme name for every part or a
    `QuantizeOptions`; `options` are `ExportOptions` fields (target, kv_cache, branch_width, ...)."""
    from ..quantize import QuantizeOptions
    from .plan import ExportOptions, plan_export

    q = QuantizeOptions.from_cli(quantize) if isinstance(quantize, str) else quantize
    plan = plan_export(cfg, ExportOptions(context_length=context_length, quantize=q, **options))
    return plan.manifest(f"{cfg.model_type} config", {"kind": "config"}, {}, files={})
