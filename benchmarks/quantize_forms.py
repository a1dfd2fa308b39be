"""Which LUT forms keep SmolLM2's quality, part by part: every unit of some parts compressed at once,
float32 in torch, perplexity and KL on the held-out prose.

Each row compresses the parts it names (every layer's attention or MLP, the embedding table, the
LM head) with one form and leaves the rest at lut6 (groups of 8, plain codes: `--quantize lut6`),
fitted as the export fits them (quantize.fit, weighted by the calibration's statistics,
compensated forms against its second moments), and measures the perplexity of
benchmarks/heldout_prose.txt with the weights decompressed (quantize.sensitivity.Float32Model),
and the mean KL divergence of its next-token distributions from the float32 model's: the KL is
the steadier of the two on 1180 tokens (a change of perplexity is one text's draw of it).
That text is read neither by the calibration nor by `--quantize auto`'s check. The bytes are the
compressed weights' (quantize.schemes.stored_bytes), without the packages' other files.

The last row tries a form the export does not make yet: activation-aware scales before
palettization. Each MLP's input channels are scaled by s = (mean square activation)^(ALPHA/2)
(normalised to a mean of 1), folded exactly into the weights around them (the norm before
gate_proj and up_proj divided by s, their columns times s; up_proj's rows divided by t and
down_proj's columns times t, t from down_proj's inputs), so the float32 model is unchanged and
the LUTs of the scaled weights give the channels that carry the most signal finer steps.

It compares forms quickly, in one process; `benchmarks/quantize_smollm2.py` measures whole exports
on the mil backend.

    python benchmarks/quantize_forms.py
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "quantize_forms.json"
HELD_OUT = ROOT / "benchmarks" / "heldout_prose.txt"
ALPHA = 0.25  # the activation-aware scales' exponent


def forms() -> tuple[dict, object]:
    """Row name -> (part -> its form, every other part lut6; whether the MLPs take activation-aware
    scales), and lut6."""
    from llama_ane.quantize.schemes import Compression

    lut6, lut4 = Compression("lut6", group_size=8), Compression("lut4", group_size=16, block_size=0, scaled=True)
    lut6c, lut4c = replace(lut6, compensated=True), replace(lut4, compensated=True)
    return {
        "lut6 (plain codes)": ({}, False),
        "lut6, compensated codes in the layers": ({"attention": lut6c, "mlp": lut6c}, False),
        "lut6, compensated codes in the LM head": ({"lm_head": lut6c}, False),
        "lut6, compensated codes in the layers and the LM head": ({"attention": lut6c, "mlp": lut6c,
                                                                   "lm_head": lut6c}, False),
        "MLPs lut4 scaled per channel": ({"mlp": lut4}, False),
        "MLPs lut4 scaled per channel, compensated": ({"mlp": lut4c}, False),
        "embeddings lut4 scaled per channel": ({"embeddings": lut4}, False),
        "LM head lut4 scaled per channel": ({"lm_head": lut4}, False),
        f"MLPs lut4 scaled per channel, compensated, activation-aware scales ({ALPHA})": ({"mlp": lut4c}, True),
        f"lut6, activation-aware scales in the MLPs ({ALPHA})": ({}, True),
    }, lut6


@contextlib.contextmanager
def activation_scaled(model, importance: dict, alpha: float):
    """Within the block, every MLP's input channels scaled as the module docstring says, and the
    calibration's statistics of the scaled inputs in `importance` (restored after)."""
    import numpy as np
    import torch

    saved_layers = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in model.layers]
    saved = dict(importance)

    def scales(key: str) -> np.ndarray:
        s = np.maximum(saved[key].astype(np.float64), 1e-12) ** (alpha / 2)
        return (s / s.mean()).astype(np.float32)

    def rescaled(key: str, s: np.ndarray) -> None:
        importance[key] = saved[key] / s ** 2
        importance[f"{key}.gram"] = (saved[f"{key}.gram"] / s[:, None] / s[None, :]).astype(np.float32)

    try:
        with torch.no_grad():
            for n, layer in enumerate(model.layers):
                mlp = layer.mlp
                s = scales(f"layers.{n}.mlp.gate_proj.weight")
                layer.post_attention_layernorm.weight.data /= torch.from_numpy(s)
                for name in ("gate_proj", "up_proj"):
                    mlp.get_submodule(name).weight.data *= torch.from_numpy(s)[None, :]
                    rescaled(f"layers.{n}.mlp.{name}.weight", s)
                t = scales(f"layers.{n}.mlp.down_proj.weight")
                mlp.up_proj.weight.data /= torch.from_numpy(t)[:, None]
                mlp.down_proj.weight.data *= torch.from_numpy(t)[None, :]
                rescaled(f"layers.{n}.mlp.down_proj.weight", t)
        model.kept.clear()
        model.kept_bytes = 0
        yield
    finally:
        for layer, state in zip(model.layers, saved_layers):
            layer.load_state_dict(state)
        importance.clear()
        importance.update(saved)
        model.kept.clear()
        model.kept_bytes = 0


def main() -> int:
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.export import quality
    from llama_ane.quantize.auto import label, part_of_unit, units
    from llama_ane.quantize.sensitivity import compressed_unit, kl, nll

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    stamp = {"date": datetime.date.today().isoformat(), "commit": commit,
             "machine": f"{platform.machine()}, {platform.system()}, {os.cpu_count()} CPUs"}
    ckpt = load_checkpoint(None)
    importance = quality.calibrate(ckpt, print, grams=True)
    model = quality.quality_model(ckpt)
    ids = quality.text_ids(ckpt, HELD_OUT.read_text(encoding="utf-8"), 1 << 16)
    reference = model.log_probs(ids)
    base = nll(reference, ids)
    print(f"float32: perplexity {math.exp(base):.3f} on {len(ids)} tokens of {HELD_OUT.name}")
    rows = []
    table, lut6 = forms()
    for name, (parts, scaled) in table.items():
        t0 = time.perf_counter()
        with activation_scaled(model, importance, ALPHA) if scaled else contextlib.nullcontext():
            folded = math.exp(nll(model.log_probs(ids), ids)) if scaled else None  # the scales alone: unchanged
            values, size = {}, 0
            for unit in units(len(model.layers)):
                c = parts.get(part_of_unit(unit), lut6)
                values[unit], stored = compressed_unit(model, unit, c, importance)
                size += stored
            with model.swapped(values):
                log_probs = model.log_probs(ids)
                after, divergence = nll(log_probs, ids), kl(reference, log_probs)
        row = {"row": name, "forms": {p: label(c) for p, c in parts.items()}, "weights_mb": round(size / 1e6, 2),
               "perplexity": round(math.exp(after), 3), "change_pct": round(100 * (math.exp(after - base) - 1), 2),
               "mean_kl": round(divergence, 5),
               "seconds": round(time.perf_counter() - t0, 1),
               **({"float32_perplexity_with_scales": round(folded, 3)} if scaled else {})}
        print(f"{name}: {row['weights_mb']} MB of weights, perplexity {row['perplexity']} ({row['change_pct']:+.2f}%), "
              f"KL {row['mean_kl']:.4f}",
              flush=True)
        rows.append(row)
    RESULTS.write_text(json.dumps({**stamp, "text": HELD_OUT.name, "tokens": len(ids),
                                   "float32_perplexity": round(math.exp(base), 3), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
