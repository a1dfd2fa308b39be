"""Which LUT forms keep SmolLM2's quality, part by part: every unit of some parts compressed at once,
float32 in torch, perplexity on the held-out prose.

Each row compresses the parts it names (every layer's attention or MLP, the embedding table, the
LM head) with one form and leaves the rest at lut6 (groups of 8, plain codes: `--quantize lut6`),
fitted as the export fits them (quantize.fit, weighted by the calibration's statistics,
compensated forms against its second moments), and measures the perplexity of
benchmarks/heldout_prose.txt with the weights decompressed (quantize.sensitivity.Float32Model).
That text is read neither by the calibration nor by `--quantize auto`'s check. The bytes are the
compressed weights' (quantize.schemes.stored_bytes), without the packages' other files.

It compares forms quickly, in one process; `benchmarks/quantize_smollm2.py` measures whole exports
on the mil backend.

    python benchmarks/quantize_forms.py
"""

from __future__ import annotations

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


def forms() -> dict:
    from llama_ane.quantize.schemes import Compression

    lut6, lut4 = Compression("lut6", group_size=8), Compression("lut4", group_size=16, block_size=0, scaled=True)
    lut6c, lut4c = replace(lut6, compensated=True), replace(lut4, compensated=True)
    return {
        "lut6 (plain codes)": {},
        "lut6, compensated codes in the layers": {"attention": lut6c, "mlp": lut6c},
        "MLPs lut4 scaled per channel": {"mlp": lut4},
        "MLPs lut4 scaled per channel, compensated": {"mlp": lut4c},
        "embeddings lut4 scaled per channel": {"embeddings": lut4},
        "LM head lut4 scaled per channel": {"lm_head": lut4},
    }, lut6


def main() -> int:
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.export import quality
    from llama_ane.quantize.auto import label, part_of_unit, units
    from llama_ane.quantize.sensitivity import compressed_unit, nll

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    stamp = {"date": datetime.date.today().isoformat(), "commit": commit,
             "machine": f"{platform.machine()}, {platform.system()}, {os.cpu_count()} CPUs"}
    ckpt = load_checkpoint(None)
    importance = quality.calibrate(ckpt, print, grams=True)
    model = quality.quality_model(ckpt)
    ids = quality.text_ids(ckpt, HELD_OUT.read_text(encoding="utf-8"), 1 << 16)
    base = nll(model.log_probs(ids), ids)
    print(f"float32: perplexity {math.exp(base):.3f} on {len(ids)} tokens of {HELD_OUT.name}")
    rows = []
    table, lut6 = forms()
    for name, parts in table.items():
        t0 = time.perf_counter()
        values, size = {}, 0
        for unit in units(len(model.layers)):
            c = parts.get(part_of_unit(unit), lut6)
            values[unit], stored = compressed_unit(model, unit, c, importance)
            size += stored
        with model.swapped(values):
            after = nll(model.log_probs(ids), ids)
        row = {"row": name, "forms": {p: label(c) for p, c in parts.items()}, "weights_mb": round(size / 1e6, 2),
               "perplexity": round(math.exp(after), 3), "change_pct": round(100 * (math.exp(after - base) - 1), 2),
               "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{name}: {row['weights_mb']} MB of weights, perplexity {row['perplexity']} ({row['change_pct']:+.2f}%)",
              flush=True)
        rows.append(row)
    RESULTS.write_text(json.dumps({**stamp, "text": HELD_OUT.name, "tokens": len(ids),
                                   "float32_perplexity": round(math.exp(base), 3), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
