"""Copies of the weights a runtime keeps on the Neural Engine, and what one copy costs in speed, at
published models' shapes: the table in docs/device-model.md ("Fewer copies").

Each model's config is written by its transformers config class; `manifest_from_config` plans the
export the options would make (no weights read, nothing written), `contract.resident` prices the
functions its load plan holds and the device model the time to first token of a 512-token prompt
and a decode step at the last position, on one chip. Every number is modelled.

    python benchmarks/one_copy.py                 # the markdown table (M4, context 1024)
    python benchmarks/one_copy.py --chip "A18 Pro" --json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
from pathlib import Path

from device_model import llama_3_2_1b, llama_3_2_3b, qwen3

from llama_ane.config import LlamaConfig
from llama_ane.contract import device_model as dm
from llama_ane.contract import resident as rs

SHAPES = {"Llama-3.2-1B": llama_3_2_1b, "Llama-3.2-3B": llama_3_2_3b,
          "Qwen3-4B": lambda: qwen3(2560, 9728, 36, 32)}
EXPORTS = {"decode functions": {"decode_function": "decode"}, "prefill window": {"decode_function": "prefill"}}
CONTEXT, PROMPT = 1024, 512


def rows(chip_name: str) -> list[dict]:
    chip = dm.chip(chip_name)
    out = []
    for name, shape in SHAPES.items():
        cfg = LlamaConfig.from_hf_dict(shape())
        for export, options in EXPORTS.items():
            m = dm.manifest_from_config(cfg, context_length=CONTEXT, **options)
            wired = rs.resident(m)
            out.append({"model": name, "export": export, **options, "kv_cache": m["cache"]["kind"],
                        "copies": round(wired.copies, 3), "functions": wired.functions,
                        "resident_bytes": wired.bytes, "weight_copy_bytes": wired.weight_copy_bytes,
                        "ttft_ms": round(1000 * chip.seconds(dm.prefill_cost(m, PROMPT)), 1),
                        "decode_tokens_per_s": round(1 / chip.seconds(dm.decode_step(m, CONTEXT - 1)), 2)})
    return out


def table(found: list[dict]) -> str:
    lines = ["| model | copies of the weights | functions | TTFT (512) ms | decode tok/s |", "|---|---|---|---|---|"]
    for name in SHAPES:
        a, b = (r for r in found if r["model"] == name)
        lines.append(f"| {name} | {a['copies']:.2f} -> {b['copies']:.2f} | {a['functions']} -> {b['functions']} | "
                     f"{a['ttft_ms']:.0f} -> {b['ttft_ms']:.0f} | {a['decode_tokens_per_s']:.1f} -> "
                     f"{b['decode_tokens_per_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chip", default="M4")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    found = rows(args.chip)
    if args.json:
        print(json.dumps(found, indent=2))
        return
    print(f"modelled, {args.chip}, context {CONTEXT}; each row: with decode functions -> the prefill window decoding")
    print(table(found))
    here = Path(__file__).parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True).stdout
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "commit": commit.strip()}
    (here / "results" / "one_copy.json").write_text(json.dumps(
        {"meta": meta, "chip": args.chip, "context_length": CONTEXT, "prompt_length": PROMPT, "modelled": True,
         "rows": found}, indent=2) + "\n")


if __name__ == "__main__":
    main()
