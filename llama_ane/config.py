"""The model configuration, with Hugging Face field names.

`LlamaConfig.from_hf_dict` accepts a `config.json` dictionary (transformers 4 style, with
`rope_theta`/`rope_scaling`, or transformers 5 style, with `rope_parameters`), drops keys it does not
use, and validates that the checkpoint is one we can export.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import LlamaANEError

SUPPORTED_MODEL_TYPES = ("llama",)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
SUPPORTED_DESCRIPTION = (
    "supported: model_type 'llama' (Llama 2, 3, 3.1, 3.2, SmolLM2 and other LlamaForCausalLM "
    "checkpoints) with RoPE type default, linear or llama3, silu MLP, no attention/MLP bias"
)


class ConfigError(LlamaANEError, ValueError):
    """A checkpoint configuration we cannot export; the message says what and what is supported."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    model_type: str = "llama"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Build and validate from a Hugging Face `config.json` dictionary."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {model_type!r}; {SUPPORTED_DESCRIPTION}")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {d.get('hidden_act')!r}; {SUPPORTED_DESCRIPTION}")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ConfigError(f"attention_bias/mlp_bias are not supported; {SUPPORTED_DESCRIPTION}")
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"]
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")

        rope = dict(d.get("rope_parameters") or {})
        rope_theta = float(d.get("rope_theta", rope.get("rope_theta", 10000.0)))
        scaling = d.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling:
            scaling = dict(scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(f"unsupported RoPE scaling {rope_type!r}; {SUPPORTED_DESCRIPTION}")
            scaling["rope_type"] = rope_type
            scaling.pop("type", None)
            scaling.pop("rope_theta", None)
            if rope_type == "default":
                scaling = None

        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        heads = int(d["num_attention_heads"])
        cfg = cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=scaling or None,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_list,
            model_type=model_type,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def kv_channels(self) -> int:
        """Channels of one layer's K (or V) cache: num_key_value_heads * head_dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def q_channels(self) -> int:
        return self.num_attention_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Inverse of `to_dict` (the manifest's copy); unknown keys are dropped."""
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        cfg.validate()
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers `LlamaConfig` dictionary, for building the reference model."""
        d = {k: v for k, v in self.to_dict().items() if k != "eos_token_id"}
        d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else (self.eos_token_id or None)
        d["hidden_act"] = "silu"
        d["attention_bias"] = False
        d["mlp_bias"] = False
        return d


def inv_freq(cfg: LlamaConfig) -> "list[float]":
    """RoPE inverse frequencies [head_dim/2], with llama3 or linear scaling applied as transformers does."""
    d = cfg.head_dim
    base = [1.0 / (cfg.rope_theta ** (2 * i / d)) for i in range(d // 2)]
    s = cfg.rope_scaling
    if not s:
        return base
    if s["rope_type"] == "linear":
        return [f / float(s["factor"]) for f in base]
    # llama3: keep high frequencies, divide low ones by factor, smooth between.
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    out = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out
