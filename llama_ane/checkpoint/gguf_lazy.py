"""Read a .gguf lazily: one tensor at a time, dequantized only when it is asked for.

Loading a .gguf through transformers dequantizes every tensor and builds the whole model in float32
(about 4 bytes per parameter, several times the file's size) before the first layer can be exported.
`open_gguf` instead memory-maps the file with gguf's `GGUFReader` (which reads the metadata and the
tensor table, no tensor data), builds a Hugging Face `config.json`-style dict from the metadata of
the file's architecture, and `LazyGGUF.get(hf_name)` dequantizes just that one tensor, undoing
llama.cpp's layout on the way: GGUF stores dims reversed; llama.cpp's convert script interleaves
the two RoPE halves of each q/k head's rows for the architectures it runs with the interleaved
("normal") RoPE, which transformers' rotate-half RoPE needs back in their original order; and it
stores Gemma 3's norm weights as the (1 + w) they scale by, where transformers keeps w (Gemma 4's
are stored as w); it squeezes LFM2's depthwise conv kernel (C, 1, K) to (C, K); and it writes Gemma 4's
layer scalars as blk.N.layer_output_scale.weight and its proportional RoPE as a rope_freqs tensor
(1 for each rotated frequency, 1e30 for each one left alone). A family's GGUFArch undoes the rest
(Falcon-H1's renamed, reshaped and transformed Mamba-2 tensors: families/falcon_h1.py).

Metadata llama.cpp does not store (Gemma 3's attention scale, local RoPE base and layer pattern
in older files, SmolLM3's layers without RoPE) is what llama.cpp itself assumes for the
architecture, so a file means here what it means to llama.cpp. LFM2's conv layers are, as llama.cpp
reads them, the layers whose per-layer attention.head_count_kv is 0. Gemma 4's global layers take V
from the K projection (attention_k_eq_v) where the file has no attn_v for them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..config import LlamaConfig
from ..errors import LlamaANEError
from ..families import FAMILIES, Family
from .tensors import TensorInfo

if TYPE_CHECKING:
    from gguf import GGUFReader


# general.architecture -> the family it holds; every family the exporter builds that llama.cpp has an
# architecture for (Mistral's dense models are written as 'llama')
ARCHES: dict[str, Family] = {f.gguf.name: f for f in FAMILIES.values() if f.gguf is not None}
SUPPORTED = ("supported: general.architecture " + ", ".join(f"'{a}' ({f.gguf.label})" for a, f in ARCHES.items())
             + ", with RoPE scaling none, linear or llama3 ('phi3': none or longrope)")

# tensors that are not weights: llama3's per-frequency divisors, Phi-3's longrope factors
_ROPE_FREQS = "rope_freqs.weight"
_CONV_KERNEL = "conv.conv.weight"  # LFM2's depthwise kernel, (C, 1, K) in HF
_LONGROPE = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
_REQUIRED = object()
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")  # what transformers builds a tokenizer from


def _dequantizable() -> tuple[str, ...]:
    """The GGML types `gguf.dequantize` turns into floats: F32, F16 and those gguf has a dequantizer
    for (BF16 and the quantized types). Integer types (I8..I64) are not weights we can convert."""
    try:
        from gguf import quants
    except ImportError:
        return ("F32", "F16")
    return ("F32", "F16", *(t.name for t in getattr(quants, "_type_traits", {})))


GGUF_FLOATS = _dequantizable()


class GGUFError(LlamaANEError, ValueError):
    """A .gguf we cannot read as a checkpoint we export; the message says what and what is supported."""


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleave. w: (heads * head_dim, ...) -> same shape.

    llama.cpp stores each head's rows as (head_dim/2, 2) pairs, HF as (2, head_dim/2) halves.
    """
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The HF llama3 `rope_scaling` that reproduces llama.cpp's rope_freqs divisors [head_dim/2].

    The divisors fix only original_max_position_embeddings / low_freq_factor and / high_freq_factor,
    so low_freq_factor is pinned to 1 (Llama 3.x's value); the fit is checked by recomputing them.
    """
    r = divisors.astype(np.float64)
    factor = float(divisors.max())
    if factor == 1.0:
        return None
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    # between the two wavelength bounds r = 1 / ((1 - s) / factor + s), s = (ctx / wavelen - 1) / (high - 1)
    mid = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    s = (1 / r[mid] - 1 / factor) / (1 - 1 / factor)
    candidates = [(8192, 4.0)]  # Llama 3.1 / 3.2 / 3.3
    if mid.sum() >= 2:  # ctx * (1/wavelen) - (high - 1) * s = 1, least squares over the smooth band
        (ctx, high_m1), *_ = np.linalg.lstsq(np.stack([1 / wavelen[mid], -s], 1), np.ones(mid.sum()), rcond=None)
        candidates.insert(0, (int(round(ctx)), round(float(high_m1) + 1, 4)))
    for ctx, high in candidates:
        sm = np.clip((ctx / wavelen - 1) / (high - 1), 0, 1)
        if np.allclose(1 / ((1 - sm) / factor + sm), r, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                    "high_freq_factor": float(high), "original_max_position_embeddings": ctx}
    raise GGUFError(f"the file's rope_freqs ({r.round(4).tolist()}) match no llama3 RoPE scaling; {SUPPORTED}")


class LazyGGUF:
    """An open .gguf of an architecture in ARCHES. `config_dict` is built at open; tensors are read only by `get`.

    Its metadata readers (`meta`, `meta_list`, `per_layer`, `kv_heads`, `rope_freqs`, ...) are what a
    family's GGUF hooks (llama_ane.families) read the file's own keys with."""

    REQUIRED = _REQUIRED  # `meta`'s default: the key must be there

    def __init__(self, path: Path, reader: GGUFReader):
        self.path = path
        self._reader = reader  # keeps the memory map open; its tensors' `data` are views into it
        self.arch_name = self.meta("general.architecture")
        if self.arch_name not in ARCHES:
            raise GGUFError(f"{path} holds a {self.arch_name!r} model, which llama-ane does not export; {SUPPORTED}")
        self.family = ARCHES[self.arch_name]
        self.arch = self.family.gguf
        by_name = {t.name: t for t in reader.tensors}
        self.aux = {name: by_name.pop(name) for name in (_ROPE_FREQS, *_LONGROPE) if name in by_name}
        if "token_embd.weight" not in by_name:
            raise GGUFError(f"{path} has no token_embd.weight; is it a complete {self.arch_name} GGUF?")
        self.file_names = set(by_name)
        self.config_dict: dict[str, Any] = self._config()
        hf_to_gguf = self._names(LlamaConfig.from_hf_dict(self.config_dict, origin=f"{path}'s metadata"))
        self._tensors = {hf: by_name[g] for hf, g in hf_to_gguf.items() if g in by_name}  # in the map's order
        unknown = sorted(set(by_name) - set(hf_to_gguf.values()))
        if unknown:  # dropping them, as transformers does, would export a different model
            raise GGUFError(f"{path} has tensors a {self.arch_name} checkpoint llama-ane exports does not: "
                            f"{unknown[:5]}; {SUPPORTED}")
        self.has_tokenizer = all(key in reader.fields for key in TOKENIZER_KEYS)

    def _names(self, cfg: LlamaConfig) -> dict[str, str]:
        """Each HF tensor an export of `cfg` reads -> its GGUF name, from gguf's own table of the
        architecture's names (the one llama.cpp's convert script writes them with)."""
        import gguf

        from .mapping import expected_tensors

        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.arch_name)
        table = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
        out = {}
        for hf in expected_tensors(cfg):
            stem, _, kind = hf.rpartition(".")
            if kind == "layer_scalar":  # Gemma 4's, a parameter without .weight: llama.cpp adds one
                stem, kind = hf, "weight"
            source = next((hf[:-len(end)] + theirs for end, theirs in self.arch.renamed.items() if hf.endswith(end)),
                          hf)
            if source != hf:
                stem, _, kind = source.rpartition(".")
            name = table.get_name(stem)
            if name is not None:
                out[hf] = f"{name}.{kind}"
                continue
            # a name the table holds whole (Falcon-H1's A_log and D, which llama.cpp writes without a suffix)
            name = table.get_name(source)
            if name is None:  # the exporter reads a tensor llama.cpp's table has no name for
                raise GGUFError(f"{self.path}: gguf has no {self.arch_name} tensor for {hf!r}; {SUPPORTED}")
            out[hf] = name
        return out

    def error(self, message: str, supported: bool = False) -> GGUFError:
        """A GGUFError of `message`, followed by what is supported where `supported`."""
        return GGUFError(f"{message}; {SUPPORTED}" if supported else message)

    def field(self, key: str) -> Any:
        return self._reader.fields.get(key)

    def meta(self, key: str, default: Any = _REQUIRED) -> Any:
        """One scalar metadata value (int, float, bool or str), or `default` when the key is absent."""
        field = self.field(key)
        if field is None:
            if default is _REQUIRED:
                raise GGUFError(f"{self.path} lacks the metadata key {key!r}; is it a complete GGUF checkpoint?")
            return default
        if field.types[0].name == "ARRAY":  # e.g. per-layer head counts: a layout we do not export
            raise GGUFError(f"{self.path} has a per-layer {key!r}; {SUPPORTED}")
        part = field.parts[field.data[0]]
        if field.types[0].name == "STRING":
            return bytes(part).decode()
        value = part[0]
        return float(value) if np.issubdtype(value.dtype, np.floating) else (
            bool(value) if value.dtype == np.bool_ else int(value))

    def meta_list(self, key: str) -> list[Any] | None:
        """An array metadata value as a list (a scalar as a list of one), or None when the key is absent."""
        field = self.field(key)
        if field is None:
            return None
        if field.types[0].name != "ARRAY":
            return [self.meta(key)]
        return [field.parts[i].tolist()[0] for i in field.data]

    def _config(self) -> dict[str, Any]:
        arch = self.arch_name
        m = lambda key, default=_REQUIRED: self.meta(f"{arch}.{key}", default)  # noqa: E731
        heads, hidden = m("attention.head_count"), m("embedding_length")
        vocab = m("vocab_size", None)
        if vocab is None:  # as transformers does: the tokenizer's length (else the embedding's rows)
            tokens = self.field("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else int(self.reader_tensor("token_embd.weight").shape[1])
        cfg: dict[str, Any] = {
            "model_type": self.family.model_type, "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": self.per_layer("feed_forward_length")[0], "num_hidden_layers": m("block_count"),
            "num_attention_heads": heads, "num_key_value_heads": max(self.kv_heads(heads)),
            "rms_norm_eps": m("attention.layer_norm_rms_epsilon"), "rope_theta": m("rope.freq_base", 10000.0),
            "max_position_embeddings": m("context_length"),
            "tie_word_embeddings": "output.weight" not in self.file_names,
        }
        if any(n.endswith(("attn_q.bias", "attn_output.bias")) for n in self.file_names):
            cfg["attention_bias"] = True  # the families with the flag put a bias on q, k, v and o
        # the head size: the key/value width where written, else hidden / heads as llama.cpp takes it;
        # RoPE rotates all of it, but for a partial rotary (rope.dimension_count < head size)
        key, value, rope = m("attention.key_length", None), m("attention.value_length", None), m(
            "rope.dimension_count", None)
        if self.arch.swa_heads:  # key_length: the global layers' head size, key_length_swa the sliding ones'
            key, value, rope = m("attention.key_length_swa"), m("attention.value_length_swa"), m(
                "rope.dimension_count_swa", None)
        if key is not None and value is not None and key != value:
            raise GGUFError(f"{self.path} has unequal key and value head sizes ({key}, {value}); {SUPPORTED}")
        head_dim = key or value or (rope if not self.arch.partial_rope else None) or hidden // heads
        cfg["head_dim"] = head_dim
        if rope is not None and rope != head_dim:
            if not self.arch.partial_rope:
                raise GGUFError(f"{self.path} has partial RoPE (rope.dimension_count {rope} of head size "
                                f"{head_dim}); {SUPPORTED}")
            cfg["partial_rotary_factor"] = rope / head_dim
        for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
            if (value := self.meta(f"tokenizer.ggml.{key}", None)) is not None:
                cfg[hf] = value
        scaling = self._rope_scaling(cfg)
        if scaling:
            cfg["rope_scaling"] = scaling
        if self.arch.read is not None:
            self.arch.read(self, cfg)
        return cfg

    def per_layer(self, key: str, default: list[Any] | None = None) -> list[Any]:
        """{arch}.`key` per layer (a scalar for every layer). Only the keys the architecture lists per
        layer (GGUFArch.per_layer, and head_count_kv where conv layers have none) may be lists."""
        layers = self.meta(f"{self.arch_name}.block_count")
        values = self.meta_list(f"{self.arch_name}.{key}") or default
        if values is None:
            self.meta(f"{self.arch_name}.{key}")  # raises: the key is required
        if len(values) == 1:
            return values * layers
        if key not in self.arch.per_layer + (("attention.head_count_kv",) if self.arch.conv_kv else ()):
            raise GGUFError(f"{self.path} has a per-layer {self.arch_name}.{key}; {SUPPORTED}")
        if len(values) != layers and key in self.arch.per_layer:  # conv layers' head counts: kv_heads
            raise GGUFError(f"{self.path}: {self.arch_name}.{key} lists {len(values)} layers, the model has "
                            f"{layers}; convert the model again")
        return values

    def kv_heads(self, heads: int) -> list[int]:
        """attention.head_count_kv per layer (a scalar, or `heads` where absent, for every layer). Where
        conv layers have none (GGUFArch.conv_kv) the file lists it per layer, 0 for each conv layer,
        and its attention layers must agree; Gemma 4's list the sliding and the global layers' counts."""
        layers = self.meta(f"{self.arch_name}.block_count")
        kv = self.per_layer("attention.head_count_kv", [heads])
        if not self.arch.conv_kv:
            return kv
        if len(kv) != layers or len({n for n in kv if n}) != 1:
            raise GGUFError(f"{self.path}: {self.arch_name}.attention.head_count_kv must list block_count ({layers}) "
                            f"entries, 0 for a conv layer and one head count for every attention layer, got {kv}")
        return kv

    def reader_tensor(self, name: str) -> Any:
        return next(t for t in self._reader.tensors if t.name == name)

    def _rope_scaling(self, cfg: dict[str, Any]) -> dict[str, Any] | None:
        """HF `rope_scaling` from {arch}.rope.scaling.* (linear), the rope_freqs tensor (llama3) or
        the longrope factor tensors (GGUFArch.read_longrope); None if plain."""
        arch = self.arch_name
        kind = self.meta(f"{arch}.rope.scaling.type", None)
        factor = self.meta(f"{arch}.rope.scaling.factor", None)
        if kind is None and (old := self.meta(f"{arch}.rope.scale_linear", None)) is not None:
            kind, factor = "linear", old  # the key written before rope.scaling.* existed
        if kind == "linear" and factor in (None, 1.0):  # llama.cpp reads a missing factor as 1: no scaling
            kind = None
        longrope = {hf: self.aux[name] for name, hf in _LONGROPE.items() if name in self.aux}
        if self.arch.read_longrope is not None and longrope:
            return self.arch.read_longrope(self, cfg, longrope)
        if kind not in (None, "none", "linear"):
            raise GGUFError(f"{self.path} uses RoPE scaling {kind!r}; {SUPPORTED}")
        freqs = self.aux.get(_ROPE_FREQS)
        if self.arch.rope_freqs == "proportional":  # the global layers' proportion (its `read` takes it)
            freqs = None
        if freqs is not None and (self.arch.rope_freqs != "llama3" or kind == "linear"):
            raise GGUFError(f"{self.path} has rope_freqs{' and linear RoPE scaling' if kind else ''}; {SUPPORTED}")
        if freqs is not None:
            return _llama3_scaling(self.aux_values(freqs), cfg["rope_theta"], cfg["head_dim"])
        return {"rope_type": "linear", "factor": float(factor)} if kind == "linear" else None

    def rope_freqs(self) -> np.ndarray | None:
        """The rope_freqs tensor's values, or None where the file has none."""
        freqs = self.aux.get(_ROPE_FREQS)
        return None if freqs is None else self.aux_values(freqs)

    def aux_values(self, t: Any) -> np.ndarray:
        import gguf

        return gguf.dequantize(t.data, t.tensor_type).reshape(-1)

    def _shape(self, hf_name: str, t: Any) -> tuple[int, ...]:
        """The HF shape of tensor `t`: GGUF's dims reversed, LFM2's conv kernel given back its middle 1."""
        shape = tuple(int(d) for d in reversed(t.shape))
        if self.arch.squeezed_conv and hf_name.endswith(_CONV_KERNEL) and len(shape) == 2:
            return (shape[0], 1, shape[1])
        return shape if self.arch.reshaped is None else self.arch.reshaped(hf_name, shape)

    def tensor_info(self) -> dict[str, TensorInfo]:
        """Each tensor's HF shape and GGML type, from the tensor table (no data read)."""
        return {name: TensorInfo(self._shape(name, t), t.tensor_type.name) for name, t in self._tensors.items()}

    def names(self) -> list[str]:
        """The Hugging Face tensor names in the file (lm_head.weight only when untied)."""
        return list(self._tensors)

    def get(self, hf_name: str) -> torch.Tensor:
        """Read and dequantize one tensor: float32 in the HF shape, e.g. q_proj (heads * head_dim, hidden).

        Raises KeyError for a name the file does not hold.
        """
        import gguf  # looked up at call time, so gguf.dequantize can be wrapped (tests count its calls)

        t = self._tensors[hf_name]
        try:
            w = gguf.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise GGUFError(f"{self.path}: {t.name} is stored as {t.tensor_type.name}, which gguf cannot "
                            f"dequantize ({e}); upgrade gguf or re-quantize the file") from None
        w = w.reshape(self._shape(hf_name, t))  # GGUF lists dims innermost first
        if self.arch.permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            cfg = self.config_dict
            w = _unpermute(w, cfg["num_attention_heads"] if "q_proj" in hf_name else cfg["num_key_value_heads"])
        if self.arch.norm_offset and hf_name.endswith("norm.weight"):
            w = w - np.float32(self.arch.norm_offset)  # exact: the file's (1 + w) lies in [0.5, 2] wherever w is small
        if self.arch.restore is not None:
            w = self.arch.restore(hf_name, w)
        # F32 comes back as a view of the read-only map: copy it so callers own a writable tensor
        return torch.from_numpy(np.require(w, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))


def open_gguf(path: Path) -> LazyGGUF:
    """Memory-map a .gguf and parse its metadata; no tensor is read until `get`."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path} does not exist or is not a file")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError("reading a .gguf needs the gguf package: pip install 'llama-ane[gguf]'") from None
    try:
        reader = GGUFReader(str(path))
    except (ValueError, IndexError, KeyError) as e:  # bad magic, truncated header, unknown value type
        raise GGUFError(f"{path} is not a readable GGUF file ({e}); {SUPPORTED}") from None
    return LazyGGUF(path, reader)
