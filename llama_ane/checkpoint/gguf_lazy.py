"""Read a Llama .gguf lazily: one tensor at a time, dequantized only when it is asked for.

Loading a .gguf through transformers dequantizes every tensor and builds the whole model in float32
(about 4 bytes per parameter, several times the file's size) before the first layer can be exported.
`open_gguf` instead memory-maps the file with gguf's `GGUFReader` (which reads the metadata and the
tensor table, no tensor data), builds a Hugging Face `config.json`-style dict from the metadata, and
`LazyGGUF.get(hf_name)` dequantizes just that one tensor, undoing llama.cpp's layout on the way:
GGUF stores dims reversed, and llama.cpp's convert script interleaves the two RoPE halves of each
q/k head's rows, which transformers' rotate-half RoPE needs back in their original order.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import LlamaANEError
from .loader import TensorInfo

if TYPE_CHECKING:
    from gguf import GGUFReader

SUPPORTED = ("supported: general.architecture 'llama' (Llama 2/3.x, SmolLM2 and other LlamaForCausalLM "
             "checkpoints) with RoPE scaling none, linear or llama3")

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {  # GGUF name inside blk.N -> HF name inside model.layers.N
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_ROPE_FREQS = "rope_freqs.weight"  # llama3 per-frequency divisors: becomes config_dict["rope_scaling"]
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
    """A .gguf we cannot read as a Llama checkpoint; the message says what and what is supported."""


def _hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if Llama has no such weight."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind != "weight":  # llama has no biases; a file with them is not one we can export faithfully
        return None
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.weight"
    blk, _, rest = stem.partition(".")[2].partition(".")
    if stem.startswith("blk.") and blk.isdigit() and rest in _LAYER:
        return f"model.layers.{blk}.{_LAYER[rest]}.weight"
    return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleave. w: (heads * head_dim, hidden) -> same shape.

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
    """An open Llama .gguf. `config_dict` is built at open; tensors are read only by `get`."""

    def __init__(self, path: Path, reader: GGUFReader):
        self.path = path
        self._reader = reader  # keeps the memory map open; its tensors' `data` are views into it
        if (arch := self._meta("general.architecture")) != "llama":
            raise GGUFError(f"{path} holds a {arch!r} model; {SUPPORTED}")
        self._tensors: dict[str, Any] = {}  # HF name -> gguf ReaderTensor (name, type, dims, data view)
        self._rope_freqs, unknown = None, []
        for t in reader.tensors:
            if t.name == _ROPE_FREQS:
                self._rope_freqs = t
            elif (name := _hf_name(t.name)) is not None:
                self._tensors[name] = t
            else:
                unknown.append(t.name)
        if unknown:  # dropping them, as transformers does, would export a different model
            raise GGUFError(f"{path} has tensors a Llama checkpoint does not: {unknown[:5]}; {SUPPORTED}")
        if "model.embed_tokens.weight" not in self._tensors:
            raise GGUFError(f"{path} has no token_embd.weight; is it a complete llama GGUF?")
        self.config_dict: dict[str, Any] = self._config()
        self.has_tokenizer = all(key in reader.fields for key in TOKENIZER_KEYS)

    def _meta(self, key: str, default: Any = _REQUIRED) -> Any:
        """One scalar metadata value (int, float, bool or str), or `default` when the key is absent."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise GGUFError(f"{self.path} lacks the metadata key {key!r}; is it a complete llama GGUF?")
            return default
        if field.types[0].name == "ARRAY":  # e.g. per-layer head counts: not a plain Llama
            raise GGUFError(f"{self.path} has a per-layer {key!r}; {SUPPORTED}")
        part = field.parts[field.data[0]]
        if field.types[0].name == "STRING":
            return bytes(part).decode()
        value = part[0]
        return float(value) if np.issubdtype(value.dtype, np.floating) else (
            bool(value) if value.dtype == np.bool_ else int(value))

    def _config(self) -> dict[str, Any]:
        m = lambda key, default=_REQUIRED: self._meta(f"llama.{key}", default)  # noqa: E731
        heads = m("attention.head_count")
        vocab = m("vocab_size", None)
        if vocab is None:  # as transformers does: the tokenizer's length (else the embedding's rows)
            tokens = self._reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else int(self._tensors["model.embed_tokens.weight"].shape[1])
        cfg: dict[str, Any] = {
            "model_type": "llama", "vocab_size": vocab, "hidden_size": m("embedding_length"),
            "intermediate_size": m("feed_forward_length"), "num_hidden_layers": m("block_count"),
            "num_attention_heads": heads, "num_key_value_heads": m("attention.head_count_kv", heads),
            "rms_norm_eps": m("attention.layer_norm_rms_epsilon"), "rope_theta": m("rope.freq_base", 10000.0),
            "max_position_embeddings": m("context_length"),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
        }
        # transformers reads head_dim from the rotary width; llama rotates the whole head, so the
        # key/value widths, when written, must be the same number
        dims = {d for d in (m("rope.dimension_count", None), m("attention.key_length", None),
                            m("attention.value_length", None)) if d is not None}
        if len(dims) > 1:
            raise GGUFError(f"{self.path} has partial RoPE or unequal q/k/v head sizes {sorted(dims)}; {SUPPORTED}")
        if dims:
            cfg["head_dim"] = dims.pop()
        for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
            if (value := self._meta(f"tokenizer.ggml.{key}", None)) is not None:
                cfg[hf] = value
        scaling = self._rope_scaling(cfg.get("head_dim", cfg["hidden_size"] // heads), cfg["rope_theta"])
        if scaling:
            cfg["rope_scaling"] = scaling
        return cfg

    def _rope_scaling(self, head_dim: int, theta: float) -> dict[str, Any] | None:
        """HF `rope_scaling` from llama.rope.scaling.* (linear) or the rope_freqs tensor (llama3); None if plain."""
        kind, factor = self._meta("llama.rope.scaling.type", None), self._meta("llama.rope.scaling.factor", None)
        if kind is None and (old := self._meta("llama.rope.scale_linear", None)) is not None:
            kind, factor = "linear", old  # the key written before rope.scaling.* existed
        if kind == "linear" and factor in (None, 1.0):  # llama.cpp reads a missing factor as 1: no scaling
            kind = None
        if kind not in (None, "none", "linear"):
            raise GGUFError(f"{self.path} uses RoPE scaling {kind!r}; {SUPPORTED}")
        freqs = self._rope_freqs
        if freqs is not None and kind == "linear":
            raise GGUFError(f"{self.path} has both linear RoPE scaling and rope_freqs; {SUPPORTED}")
        if freqs is not None:
            import gguf

            return _llama3_scaling(gguf.dequantize(freqs.data, freqs.tensor_type).reshape(-1), theta, head_dim)
        return {"rope_type": "linear", "factor": float(factor)} if kind == "linear" else None

    def tensor_info(self) -> dict[str, TensorInfo]:
        """Each tensor's HF shape and GGML type, from the tensor table (no data read)."""
        return {name: TensorInfo(tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name)
                for name, t in self._tensors.items()}

    def names(self) -> list[str]:
        """The Hugging Face tensor names in the file, in file order (lm_head.weight only when untied)."""
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
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            cfg = self.config_dict
            w = _unpermute(w, cfg["num_attention_heads"] if "q_proj" in hf_name else cfg["num_key_value_heads"])
        # F32 comes back as a view of the read-only map: copy it so callers own a writable tensor
        return torch.from_numpy(np.require(w, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))


def open_gguf(path: Path) -> LazyGGUF:
    """Memory-map a Llama .gguf and parse its metadata; no tensor is read until `get`."""
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
