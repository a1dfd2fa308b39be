"""Modelled decode tokens/s (contract/device_model.py) beside published device measurements, at the
published models' shapes, contexts and compression: the table in docs/device-model.md.

Each model's config is written by its transformers config class with the published shapes (Gemma 3
has no exporter here: its shapes go into a Llama-family config, a stand-in for the cost model only);
`manifest_from_config` plans the export those options would make (no weights, nothing written) and
the device model prices one decode step of it on the chip measured. The published numbers are
third-party measurements (gathered 2026-11); every number this script computes is modelled.

    python benchmarks/device_model.py            # the markdown table
    python benchmarks/device_model.py --json     # the same rows as JSON
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from transformers import Gemma3TextConfig, LlamaConfig as HFLlamaConfig, Qwen3Config

from llama_ane.config import LlamaConfig
from llama_ane.contract.device_model import CHIPS, decode_step, manifest_from_config
from llama_ane.quantize import QuantizeOptions

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def llama_3_2_1b() -> dict:
    return HFLlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE).to_dict()


def llama_3_2_3b() -> dict:
    return HFLlamaConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE).to_dict()


def llama_3_1_8b() -> dict:
    return HFLlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={**LLAMA3_ROPE, "factor": 8.0}).to_dict()


def qwen3(hidden: int, intermediate: int, layers: int, heads: int) -> dict:
    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960, rope_theta=1000000.0).to_dict()


def gemma_3_1b_as_llama() -> dict:
    """Gemma-3-1B's shapes (from its own config class) in a Llama-family config: the same weight and
    cache bytes per layer; its sliding-window layers are priced as full-context layers."""
    g = Gemma3TextConfig(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768)
    return HFLlamaConfig(vocab_size=g.vocab_size, hidden_size=g.hidden_size, intermediate_size=g.intermediate_size,
                         num_hidden_layers=g.num_hidden_layers, num_attention_heads=g.num_attention_heads,
                         num_key_value_heads=g.num_key_value_heads, head_dim=g.head_dim, tie_word_embeddings=True,
                         max_position_embeddings=g.max_position_embeddings).to_dict()


# Anemll's usual compression: LUT4 decoder layers, LUT6 LM head (docs/device-model.md)
ANEMLL_LUT4 = QuantizeOptions({"embeddings": "none", "attention": "lut4", "mlp": "lut4", "lm_head": "lut6"})
LUT6 = QuantizeOptions.from_cli("lut6")
FOUR_BIT = QuantizeOptions.from_cli("lut4")  # 4-bit palettization: what Core AI's recipes compress with


@dataclass(frozen=True)
class Row:
    model: str
    config: dict
    published: str  # tok/s as published
    device: str  # as published
    chips: tuple[str, ...]  # the modelled chips standing for the device (two: a bracket)
    context: int
    filled: int
    quantize: QuantizeOptions
    compression: str  # the compression modelled, in words
    target: str


ROWS = [
    Row("Llama-3.2-1B", llama_3_2_1b(), "47-62", "M-series Mac, Anemll", ("M1", "M4 Max"), 512, 256,
        ANEMLL_LUT4, "LUT4 layers, LUT6 head", "macOS15"),
    Row("Gemma-3-1B (Llama-shaped)", gemma_3_1b_as_llama(), "52-60", "M3 Pro, Anemll", ("M3", "M3 Max"), 512, 256,
        LUT6, "LUT6", "macOS15"),
    Row("Qwen3-4B", qwen3(2560, 9728, 36, 32), "<= 11", "M1, Anemll, ctx 1024", ("M1",), 1024, 1023,
        ANEMLL_LUT4, "LUT4 layers, LUT6 head", "macOS15"),
    Row("Llama-3.1-8B", llama_3_1_8b(), "~9", "M4 Max, Anemll", ("M4 Max",), 1024, 512,
        ANEMLL_LUT4, "LUT4 layers, LUT6 head", "macOS15"),
    Row("Qwen3-1.7B", qwen3(2048, 6144, 28, 16), "64.8", "iPhone 17 Pro, Core AI", ("A19 Pro",), 512, 256,
        FOUR_BIT, "4-bit", "iOS18"),
    Row("Llama-3.2-3B", llama_3_2_3b(), "24.2", "iPhone 17 Pro, Core AI", ("A19 Pro",), 512, 256,
        FOUR_BIT, "4-bit", "iOS18"),
    Row("Qwen3-4B int4", qwen3(2560, 9728, 36, 32), "29.7", "iPhone 17 Pro, Core AI", ("A19 Pro",), 512, 256,
        FOUR_BIT, "4-bit", "iOS18"),
    Row("Qwen3-4B int4, ~4K context", qwen3(2560, 9728, 36, 32), "10.5", "iPhone 17 Pro, Core AI", ("A19 Pro",),
        4096, 4000, FOUR_BIT, "4-bit", "iOS18"),
]


def model_row(row: Row, kv_cache: str) -> dict:
    """The modelled decode step of `row` with `kv_cache` caches, on each of its chips."""
    m = manifest_from_config(LlamaConfig.from_hf_dict(row.config), row.context, row.quantize, target=row.target,
                             kv_cache=kv_cache, branch_width=0, verify_window=0)
    out = {}
    for key, dense in (("stored", False), ("dense", True)):
        step = decode_step(m, row.filled, dense=dense)
        out[key] = {"bytes": step.bytes, "calls": step.calls,
                    "tokens_per_s": {name: [CHIPS[name].tokens_per_s(step, case) for case in ("slow", "mid", "fast")]
                                     for name in row.chips}}
    return out


def rows() -> list[dict]:
    out = []
    for row in ROWS:
        out.append({"model": row.model, "device": row.device, "published_tokens_per_s": row.published,
                    "context": row.context, "filled": row.filled, "compression": row.compression,
                    "modelled": {kind: model_row(row, kind) for kind in ("state", "inputs")}})
    return out


def _rate(chips: dict) -> str:
    """"M1 21 (19-24)", or a bracket of two chips "M3-M3 Max 21-45"."""
    names = list(chips)
    if len(names) == 1:
        slow, mid, fast = chips[names[0]]
        return f"{names[0]}: {mid:.1f} ({slow:.1f}-{fast:.1f})"
    low, high = chips[names[0]][0], chips[names[-1]][2]
    return f"{names[0]} to {names[-1]}: {low:.1f}-{high:.1f}"


def markdown(results: list[dict]) -> str:
    lines = ["| model | published device | published tok/s | context (filled), weights | MB, calls per token "
             "| modelled tok/s | modelled tok/s, weights read decompressed | modelled tok/s, input caches |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        s, i = r["modelled"]["state"], r["modelled"]["inputs"]
        lines.append(f"| {r['model']} | {r['device']} | {r['published_tokens_per_s']} | {r['context']} "
                     f"({r['filled']}), {r['compression']} | {s['stored']['bytes'] / 1e6:.0f}, {s['stored']['calls']} "
                     f"| {_rate(s['stored']['tokens_per_s'])} | {_rate(s['dense']['tokens_per_s'])} "
                     f"| {_rate(i['stored']['tokens_per_s'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    results = rows()
    print(json.dumps(results, indent=2) if args.json else markdown(results))


if __name__ == "__main__":
    main()
