"""Weight compression schemes, which part of the model gets which, and what each target can run.

A scheme is a name: "none", "int8", "int4" (linear quantization: integers times a scale), or
"lut8", "lut6", "lut4" (palettization: indices into a look-up table of 2^bits values).

Granularity, and the Core ML ops each becomes:

    iOS18 / macOS15    lutN: one LUT per group of `group_size` output channels
                             (constexpr_lut_to_dense, per-grouped-channel); with a
                             `lut_block_size`, the LUT's values are also scaled and shifted per
                             row and block of input channels (the LUT op's output feeds a
                             constexpr_blockwise_shift_scale: dense = scale * (lut[code] - offset))
                       intN: unsigned integers with a scale and an offset per row and block of
                             `block_size` input channels (constexpr_blockwise_shift_scale);
                             block_size 0 = per output channel
    iOS16-17 /         lutN: one LUT per tensor (constexpr_lut_to_dense of iOS16); --group-size
    macOS13-14               and --lut-block-size are refused
                       int8: symmetric, one scale per output channel (constexpr_affine_dequantize);
                             int4 and blocks are refused (they need iOS18 / macOS15)

Device path (`Compression.device_path`, sources in docs/quantization.md): whether the Neural Engine
reads the compressed form and decompresses it just in time ("just-in-time": fewer bytes per token)
or the form is expanded to fp16 when the model loads ("at-load": a smaller package, the bytes per
token of fp16). LUTs per tensor, per grouped channels and with a per-channel scale, and int8 per
output channel, are just in time; integers in blocks, int4, and LUTs scaled per block (forms
Apple's guide points at the GPU) are counted at load.

Parts: "embeddings" (the token table), "attention" (q/k/v/o projections), "mlp" (gate/up/down
projections), "lm_head" (the vocabulary projection). Norm weights and the RoPE tables are never
compressed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import LlamaANEError

if TYPE_CHECKING:
    from .auto import Recipe

SCHEMES = ("none", "int8", "int4", "lut8", "lut6", "lut4")
PARTS = ("embeddings", "attention", "mlp", "lm_head")
GROUPED_TARGETS = ("iOS18", "macOS15")  # grouped LUTs, blockwise and 4-bit integers
DEFAULT_GROUP_SIZE = {"lut8": 16, "lut6": 8, "lut4": 16}  # output channels sharing one LUT: lut6 gets 8,
# which keeps SmolLM2 within 2% of fp16 perplexity (16: +2.11%) for 2% more bytes (benchmarks/quantize_smollm2.py)
DEFAULT_BLOCK_SIZE = {"int4": 32, "int8": 0}  # input channels sharing one scale (0: the whole row)
DEFAULT_LUT_BLOCK_SIZE = {"lut4": 0}  # lut4's values scaled and shifted per output channel (a form the ANE
# decompresses just in time): SmolLM2 +48% instead of +90% on the eval text, for 4 bytes a row
JUST_IN_TIME, AT_LOAD = "just-in-time", "at-load"  # Compression.device_path


class QuantizeError(LlamaANEError, ValueError):
    """A compression option that cannot work; the message says which and what to use instead."""


def kind(scheme: str) -> str:
    """"lut", "int" or "none"."""
    return "none" if scheme == "none" else scheme[:3]


def bits(scheme: str) -> int:
    """Bits per weight of a compressed scheme (16 for "none", meaning fp16)."""
    return 16 if scheme == "none" else int(scheme[3:])


@dataclass(frozen=True)
class Compression:
    """How one weight is compressed: the scheme and its granularity."""

    scheme: str
    group_size: int = 0  # LUT: output channels per LUT (0: one LUT for the whole tensor)
    block_size: int = 0  # int, scaled LUT: input channels per scale (0: one scale per output channel)
    symmetric: bool = False  # int: no offset (before iOS18), else a scale and an offset per block
    scaled: bool = False  # LUT: its values times a scale and shifted by an offset per row and block
    compensated: bool = False  # LUT: codes chosen to cancel each other's output error (quantize.gptq),
    # against the calibration's input second moments; the same ops and bytes as plain codes

    @property
    def kind(self) -> str:
        return kind(self.scheme)

    @property
    def bits(self) -> int:
        return bits(self.scheme)

    @property
    def weighted(self) -> bool:
        """Whether fitting it uses the calibration's input importance: LUTs and int4 ranges."""
        return self.kind == "lut" or self.kind == "int" and self.bits < 8 and not self.symmetric

    @property
    def device_path(self) -> str:
        """How the Neural Engine runs this form: JUST_IN_TIME (it reads the compressed bytes) or
        AT_LOAD (expanded to fp16 when the model loads). Palettization is decompressed just in
        time on the Neural Engine, per tensor, per grouped channel and with a per-channel scale;
        per-block scales are the GPU's form (Apple recommends per-channel scales on the Neural
        Engine), and linear int4 is not relied on there (see docs/quantization.md)."""
        if self.kind == "lut":
            return AT_LOAD if self.scaled and self.block_size else JUST_IN_TIME
        return JUST_IN_TIME if self.bits == 8 and self.block_size == 0 else AT_LOAD

    def to_dict(self) -> dict:
        out = {"scheme": self.scheme}
        if self.kind == "lut":
            out["group_size"] = self.group_size
            if self.scaled:
                out["block_size"] = self.block_size
            if self.compensated:
                out["compensated"] = True
        elif self.kind == "int":
            out["block_size"] = self.block_size
            out["symmetric"] = self.symmetric
        return out


@dataclass(frozen=True)
class QuantizeOptions:
    """The scheme of each part, and the group and block sizes; `None` sizes mean the defaults
    (`lut_block_size` None: LUTs without scales). A `recipe` (quantize.auto.Recipe: `--quantize
    auto` or `--quantize-recipe`) instead gives every layer's attention and MLP, the embeddings
    and the LM head a form of their own. `auto`: `--quantize auto` before its recipe is chosen,
    checked against the target like the forms it chooses from (quantize.auto.CANDIDATES)."""

    schemes: dict[str, str] = field(default_factory=lambda: {p: "none" for p in PARTS})
    group_size: int | None = None
    block_size: int | None = None
    lut_block_size: int | None = None
    recipe: "Recipe | None" = None
    auto: bool = False

    @classmethod
    def from_cli(cls, quantize: str = "none", *, embeddings: str | None = None, attention: str | None = None,
                 mlp: str | None = None, lm_head: str | None = None, group_size: int | None = None,
                 block_size: int | None = None, lut_block_size: int | None = None) -> "QuantizeOptions":
        """`--quantize SCHEME` for every part, each `--quantize-PART` overriding its part."""
        given = {"embeddings": embeddings, "attention": attention, "mlp": mlp, "lm_head": lm_head}
        schemes = {part: given[part] if given[part] is not None else quantize for part in PARTS}
        for name, scheme in [("--quantize", quantize)] + [(f"--quantize-{p.replace('_', '-')}", s)
                                                          for p, s in given.items() if s is not None]:
            if scheme not in SCHEMES:
                raise QuantizeError(f"{name} {scheme!r} is not a scheme; choose one of {', '.join(SCHEMES)}, or auto")
        return cls(schemes, group_size, block_size, lut_block_size)

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "QuantizeOptions":
        return cls(recipe=recipe)

    @property
    def active(self) -> bool:
        if self.auto:
            return True
        if self.recipe is not None:
            return any(c is not None for c in self.recipe.forms.values())
        return any(s != "none" for s in self.schemes.values())

    def compression(self, part: str, target: str, unit: str | None = None) -> Compression | None:
        """The compression of `part` for `target` (of its `unit`, e.g. "layers.3.mlp", under a
        recipe; without one, the part's most lossy form), or None for fp16 weights."""
        if self.recipe is not None:
            return self.recipe.compression(unit) if unit is not None else self.recipe.part_form(part)
        scheme = self.schemes[part]
        if scheme == "none":
            return None
        grouped = target in GROUPED_TARGETS
        if kind(scheme) == "lut":
            size = self.group_size if self.group_size is not None else (DEFAULT_GROUP_SIZE[scheme] if grouped else 0)
            block = self.lut_block_size if self.lut_block_size is not None else \
                DEFAULT_LUT_BLOCK_SIZE.get(scheme) if grouped else None
            if block is not None:
                return Compression(scheme, group_size=size, block_size=block, scaled=True)
            return Compression(scheme, group_size=size)
        size = self.block_size if self.block_size is not None else DEFAULT_BLOCK_SIZE[scheme]
        return Compression(scheme, block_size=size, symmetric=not grouped)

    def check(self, target: str) -> None:
        """Refuse what `target` cannot run, naming the target to use instead."""
        if any(size is not None and size < 0 for size in (self.group_size, self.block_size, self.lut_block_size)):
            raise QuantizeError("--group-size, --block-size and --lut-block-size must be >= 0")
        if target in GROUPED_TARGETS or not self.active:
            return
        platform = "macOS15" if target.startswith("macOS") else "iOS18"
        if self.auto:
            raise QuantizeError(f"--quantize auto chooses LUTs per group of channels (lut4 also scaled per channel), "
                                f"which need --target {platform}: {target} has one LUT per tensor; use --target "
                                f"{platform}, or a scheme such as --quantize lut6 on {target}")
        if self.recipe is not None:
            for unit, c in self.recipe.forms.items():
                if c is not None and (c.group_size or c.scaled or c.kind == "int" and (c.bits < 8 or c.block_size
                                                                                       or not c.symmetric)):
                    raise QuantizeError(f"the recipe's {unit} ({c.scheme} grouped, scaled, blockwise or asymmetric) "
                                        f"needs --target {platform}: {target} has per-tensor LUTs and per-channel "
                                        "symmetric int8 only")
            return
        for part, scheme in self.schemes.items():
            if scheme == "int4":
                raise QuantizeError(f"int4 weights ({part}) need --target {platform} or later: {target} has no "
                                    "4-bit integer weights; use int8 or lut4 there")
        if self.group_size:
            raise QuantizeError(f"--group-size (one LUT per group of channels) needs --target {platform}: {target} "
                                "has one LUT per tensor; drop --group-size")
        if self.block_size:
            raise QuantizeError(f"--block-size (one scale per block) needs --target {platform}: {target} has one "
                                "scale per output channel; drop --block-size")
        if self.lut_block_size is not None and any(kind(s) == "lut" for s in self.schemes.values()):
            raise QuantizeError(f"--lut-block-size (scaled LUT values) needs --target {platform}: {target} has "
                                "plain LUTs only; drop --lut-block-size")

    def describe(self, target: str) -> dict[str, dict]:
        """What the manifest records: the compression of each part ({"scheme": "none"} for fp16),
        with its device path; under a recipe, each part's most lossy form with "units" counting
        the forms of its units, and the recipe itself under "recipe"."""
        out = {}
        for part in PARTS:
            c = self.compression(part, target)
            out[part] = {"scheme": "none"} if c is None else {**c.to_dict(), "device_path": c.device_path}
            if self.recipe is not None:
                out[part]["units"] = self.recipe.part_summary(part)
        if self.recipe is not None:
            worst = self.recipe.part_form()
            out["recipe"] = {**self.recipe.to_dict(), "scheme": worst.scheme if worst else "none"}
        return out


def check_divides(name: str, shape: tuple[int, ...], c: Compression) -> None:
    """Refuse a group or block size that does not divide the weight `name` of shape (out, in, ...)."""
    if c.kind == "lut" and c.group_size and shape[0] % c.group_size:
        raise QuantizeError(f"--group-size {c.group_size} does not divide the {shape[0]} output channels of "
                            f"{name}; choose a divisor of {shape[0]} (e.g. 16, 32) or --group-size 0 (one LUT "
                            "per tensor)")
    if c.scaled and c.block_size and shape[1] % c.block_size:
        raise QuantizeError(f"--lut-block-size {c.block_size} does not divide the {shape[1]} input channels of "
                            f"{name}; choose a divisor of {shape[1]} (e.g. 32, 64) or --lut-block-size 0 (one "
                            "scale per output channel)")
    if c.kind == "int" and c.block_size and shape[1] % c.block_size:
        raise QuantizeError(f"--block-size {c.block_size} does not divide the {shape[1]} input channels of "
                            f"{name}; choose a divisor of {shape[1]} (e.g. 32, 64) or --block-size 0 (one scale "
                            "per output channel)")


def stored_bytes(shape: tuple[int, ...], c: Compression | None, dense_bytes: int = 2) -> int:
    """Bytes a weight of `shape` takes in a package: dense, or its packed codes plus the LUTs
    (fp16, 2^bits per group) and/or scales and offsets (fp16, one each per row and block; no
    offsets when symmetric)."""
    n = 1
    for d in shape:
        n *= d
    if c is None:
        return n * dense_bytes
    codes = -(-n * c.bits // 8)
    scales = shape[0] * (shape[1] // (c.block_size or shape[1])) * 2 * (1 if c.symmetric else 2)
    if c.kind == "lut":
        return codes + shape[0] // (c.group_size or shape[0]) * (1 << c.bits) * 2 + (scales if c.scaled else 0)
    return codes + scales
