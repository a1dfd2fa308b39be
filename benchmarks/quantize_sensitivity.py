"""The sensitivity phase of `--quantize auto` alone: measuring every unit (quantize.sensitivity.measure_units).

Two models, each timed in this process from the captured inputs to the last unit (calibration and
loading not included, as `auto` shows them as phases of their own):

* `smollm2`: the embedded SmolLM2-135M-Instruct (30 layers, 62 units), its calibration's
  statistics, 128 tokens of the calibration text, as `--quantize auto` measures it;
* `1b`: a Llama-3.2-1B-shaped model (hidden 2048, MLP 8192, 32 heads of 64, 8 KV heads, vocabulary
  128256) with random weights built by transformers' classes, the statistics taken from the same
  128 random tokens. Memory on a shared machine allows `--layers` of its 16 decoder layers (default
  4): the row records the measured seconds, each unit's seconds, and the 16-layer time
  extrapolated from them (the table, the head and the trace counted once, the layers' units times
  16 / layers), labelled as extrapolated.

Every row records the date, machine, commit and the load average when it started: the machine
is shared, so compare rows taken at a similar load.

    python benchmarks/quantize_sensitivity.py                 # both
    python benchmarks/quantize_sensitivity.py --models smollm2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "quantize_sensitivity.json"
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, vocab_size=128256, num_hidden_layers=16, rms_norm_eps=1e-5, rope_theta=500000.0,
                tie_word_embeddings=True, max_position_embeddings=131072)


def stamp() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "llama_ane", "benchmarks/quantize_sensitivity.py"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"date": datetime.date.today().isoformat(), "commit": commit + ("-dirty" if dirty else ""),
            "machine": f"{platform.machine()}, {platform.system()}, {os.cpu_count()} CPUs",
            "load_average_1min": round(os.getloadavg()[0], 2)}


def timed(model, ids, importance) -> tuple[float, dict[str, float], int]:
    """measure_units' seconds, each unit's seconds, and its partial passes."""
    from llama_ane.quantize.auto import CANDIDATES
    from llama_ane.quantize.sensitivity import measure_units

    per_unit: dict[str, float] = {}
    last = [time.perf_counter()]

    def on_unit(note: str) -> None:
        now = time.perf_counter()
        per_unit[note.split(":")[0]] = now - last[0]
        last[0] = now

    t0 = time.perf_counter()
    found = measure_units(model, ids, CANDIDATES, importance, print, on_unit=on_unit)
    return time.perf_counter() - t0, per_unit, found["passes"]


def smollm2() -> dict:
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.export import quality

    row = {"model": "SmolLM2-135M (embedded)", **stamp()}
    ckpt = load_checkpoint(None)
    importance = quality.calibrate(ckpt, print, grams=True)
    model = quality.quality_model(ckpt)
    ids = quality.sensitivity_ids(ckpt)
    seconds, per_unit, passes = timed(model, ids, importance)
    return {**row, "layers": len(model.layers), "units": len(per_unit), "tokens": len(ids), "passes": passes,
            "seconds": round(seconds, 1), "kind": "measured"}


def statistics(model, ids) -> dict:
    """What the calibration gives (mean squares and second moments of every projection's inputs,
    and of the final norm's output), taken on the model itself."""
    import torch

    found, hooks = {}, []
    for n, layer in enumerate(model.layers):
        for module, names in ((layer.self_attn.q_proj, ("q_proj", "k_proj", "v_proj")),
                              (layer.self_attn.o_proj, ("o_proj",)),
                              (layer.mlp.gate_proj, ("mlp.gate_proj", "mlp.up_proj")),
                              (layer.mlp.down_proj, ("mlp.down_proj",))):
            def hook(_m, inputs, _o, keys=[f"layers.{n}.{x}.weight" for x in names]):
                x = inputs[0].reshape(-1, inputs[0].shape[-1]).to(torch.float64)
                power, gram = (x * x).mean(0).float().numpy(), (x.T @ x / len(x)).float().numpy()
                for key in keys:
                    found[key], found[f"{key}.gram"] = power, gram
            hooks.append(module.register_forward_hook(hook))
    inputs, _ = model.trace(ids)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        h = model.norm(inputs[-1][0]).to(torch.float64)
    found["heads"], found["heads.gram"] = (h * h).mean(0).float().numpy(), (h.T @ h / len(h)).float().numpy()
    return found


def llama_1b(layers: int) -> dict:
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    from llama_ane.quantize.auto import SENSITIVITY_TOKENS
    from llama_ane.quantize.sensitivity import Float32Model

    row = {"model": f"Llama-3.2-1B shape, random weights, {layers} of 16 layers", **stamp()}
    torch.manual_seed(0)
    config = LlamaConfig(**{**LLAMA_1B, "num_hidden_layers": layers}, attn_implementation="sdpa")
    with torch.no_grad():
        decoder = [LlamaDecoderLayer(config, n).eval() for n in range(layers)]
        for layer in decoder:
            for p in layer.parameters():
                if p.ndim == 2:
                    p.normal_(0, 0.02)
        table = torch.randn(config.vocab_size, config.hidden_size) * 0.02
    norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps).requires_grad_(False)
    model = Float32Model(table, decoder, norm, table.clone(), LlamaRotaryEmbedding(config=config))
    ids = torch.randint(0, config.vocab_size, (SENSITIVITY_TOKENS,)).tolist()
    importance = statistics(model, ids)
    seconds, per_unit, passes = timed(model, ids, importance)
    layer_s = sum(s for u, s in per_unit.items() if u.startswith("layers."))
    return {**row, "layers": layers, "units": len(per_unit), "tokens": len(ids), "passes": passes,
            "seconds": round(seconds, 1), "kind": "measured",
            "seconds_16_layers": round(seconds - layer_s + layer_s * 16 / layers, 1),
            "seconds_16_layers_kind": f"extrapolated from {layers} layers",
            "unit_seconds": {u: round(s, 2) for u, s in per_unit.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,1b", help="comma-separated: smollm2, 1b")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 1B-shaped model (of 16)")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in names if m not in ("smollm2", "1b")]
    if bad or not 1 <= args.layers <= 16:
        ap.error(f"--models takes smollm2 and 1b (got {bad}); --layers 1..16 (got {args.layers})")
    for name in names:
        row = {"name": name, **(smollm2() if name == "smollm2" else llama_1b(args.layers))}
        print(f"{name}: {row['seconds']} s" + (f" ({row['seconds_16_layers']} s at 16 layers, extrapolated)"
                                               if "seconds_16_layers" in row else ""), flush=True)
        kept = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}  # (read late: another
        rows = {**{r["name"]: r for r in kept["rows"]}, name: row}  # run may have written the other row)
        RESULTS.write_text(json.dumps({"rows": [rows[n] for n in ("smollm2", "1b") if n in rows]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
