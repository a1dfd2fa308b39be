"""Core ML calls per decode token, and the modelled tokens/s they cost, before and after the call cuts:
caches as inputs with the LM head apart (before), state caches (no cache-update call per chunk), and
state caches with the LM head folded into the last chunk where it fits.

Each model's config is written by transformers' LlamaConfig with the published shapes, and each
export is priced by `llama-ane info --config CONFIG --json` (no weights, nothing exported) at its
context less one filled position: an M4 with a macOS15 export (2 GB packages), an A18 Pro with an
iOS18 export (1 GB packages). Every tokens/s here is modelled (docs/device-model.md), not measured.

    python benchmarks/calls_per_token.py            # the table; writes results/calls_per_token.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from click.testing import CliRunner
from transformers import LlamaConfig as HFLlamaConfig

sys.path.insert(0, str(Path(__file__).parent))
from device_model import llama_3_1_8b, llama_3_2_1b, llama_3_2_3b  # noqa: E402  (the published shapes)

from llama_ane.commands.info import command as info  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "calls_per_token.json"
CONTEXT = 2048
DEVICES = {"M4": "macOS15", "A18 Pro": "iOS18"}  # chip -> the target an app on it exports for
VARIANTS = {  # name -> info options
    "before": ["--kv-cache", "inputs", "--fold-lm-head", "no"],
    "state": ["--kv-cache", "state", "--fold-lm-head", "no"],
    "state + folded head": ["--kv-cache", "state", "--fold-lm-head", "auto"],
}


def smollm2_135m() -> dict:
    return HFLlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0).to_dict()


MODELS = {"SmolLM2-135M": smollm2_135m, "Llama-3.2-1B": llama_3_2_1b, "Llama-3.2-3B": llama_3_2_3b,
          "Llama-3.1-8B": llama_3_1_8b}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()


def modelled(config: Path, chip: str, target: str, options: list[str]) -> dict:
    """`info --config` of one export on one chip: its calls per token, tokens/s and layout."""
    result = CliRunner().invoke(info, ["--config", str(config), "--target", target, "--context-length", str(CONTEXT),
                                       "--chip", chip, "--json", *options], catch_exceptions=False)
    if result.exit_code:
        raise SystemExit(result.output)
    m = json.loads(result.output)
    step = m["decode_step_bytes"]
    return {"calls_per_token": step["calls_per_token"], "tokens_per_s": round(step["chips"][chip]["tokens_per_s"], 2),
            "chunks": len(m["chunks"]), "lm_head_files": len(m["lm_head"]["models"]),
            "lm_head_folded_into": m["lm_head"].get("folded_into"),
            "last_chunk_mb": round(m["weights"][m["chunks"][-1]["model"]]["bytes"] / 1e6, 1),
            "lm_head_mb": round(sum(m["weights"][h]["bytes"] for h in m["lm_head"]["models"]) / 1e6, 1)}


def rows() -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in MODELS.items():
            config = Path(tmp) / name / "config.json"
            config.parent.mkdir()
            config.write_text(json.dumps(make()))
            for chip, target in DEVICES.items():
                out.append({"model": name, "chip": chip, "target": target,
                            **{variant: modelled(config, chip, target, options)
                               for variant, options in VARIANTS.items()}})
    return out


def table(results: list[dict]) -> str:
    head = ["model", "chip (target)", *(f"{v}: calls, tok/s" for v in VARIANTS), "head"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        folded = r["state + folded head"]
        before = r["state"]
        note = (f"in {folded['lm_head_folded_into']}" if folded["lm_head_folded_into"] else
                f"apart: {before['lm_head_files']} file(s), {before['lm_head_mb']:.0f} MB beside a "
                f"{before['last_chunk_mb']:.0f} MB last chunk")
        cells = [f"{r[v]['calls_per_token']}, {r[v]['tokens_per_s']:.1f}" for v in VARIANTS]
        lines.append(f"| {r['model']} | {r['chip']} ({r['target']}) | " + " | ".join(cells) + f" | {note} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = rows()
    print(f"Core ML calls per decode token and modelled decode tokens/s at {CONTEXT - 1} filled positions "
          "(context {CONTEXT}; modelled, not measured)\n".replace("{CONTEXT}", str(CONTEXT)))
    print(table(results))
    stamp = {"benchmark": "calls_per_token", "context_length": CONTEXT, "modelled": True,
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "machine": {"system": platform.system(), "machine": platform.machine(), "cpus": os.cpu_count(),
                         "python": platform.python_version()},
             "commit": git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--",
                                                                               "llama_ane") else ""),
             "rows": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(stamp, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
