"""Quality and size of every compression scheme, and of `--quantize auto`, on the embedded SmolLM2-135M-Instruct.

For each row: `llama-ane export` with its options (`--no-verify`: the parity gate is tested
elsewhere), the packages' size, the bytes one decode step reads on the Neural Engine as the
manifest models them (forms decompressed at load count as fp16), and `llama-ane eval --backend mil
--reference <the fp16 export> --text benchmarks/heldout_prose.txt --json`: perplexity on held-out
prose that neither the calibration (llama_ane/calibration_text.txt) nor `--quantize auto`'s check
(llama_ane/eval_text.txt) reads, its change against the fp16 export, top-1 agreement and mean KL.

The auto rows measure every unit once (quantize.sensitivity, as `--quantize auto` does), choose a
recipe per budget, and export it with `--quantize-recipe`: the export `--quantize auto
--quantize-budget B` makes, without measuring three times.

    python benchmarks/quantize_smollm2.py                       # every row (about an hour on 2 cores)
    python benchmarks/quantize_smollm2.py --rows lut6,auto-5

The embedded SmolLM2 was itself dequantized from a 4-bit GGUF (Q4_1 layers, Q8_0 embeddings), so
its weights already lie on 4-bit grids of blocks of 32: say so beside any number taken from here.

A run replaces the rows it measured; rows measured on other text are dropped. Each row records
its date, machine and commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from llama_ane.contract.traffic import weight_read_bytes  # noqa: E402
RESULTS = ROOT / "benchmarks" / "results"
HELD_OUT = ROOT / "benchmarks" / "heldout_prose.txt"
SCHEMES = {  # name -> export options
    "fp16": [],
    "int8": ["--quantize", "int8"],
    "lut8": ["--quantize", "lut8"],
    "lut6": ["--quantize", "lut6"],
    "int4": ["--quantize", "int4"],
    "lut4": ["--quantize", "lut4"],
    "lut4-mlp/lut6": ["--quantize", "lut6", "--quantize-mlp", "lut4"],  # Anemll's mix
    "int4/int8-vocab": ["--quantize", "int4", "--quantize-embeddings", "int8", "--quantize-lm-head", "int8"],
    "lut4-group4": ["--quantize", "lut4", "--group-size", "4"],
    # LUT values scaled and shifted per block of input channels: the GPU's form (decompressed at load on the ANE)
    "lut4-block32": ["--quantize", "lut4", "--lut-block-size", "32"],
}
BUDGETS = {"auto-2": 2.0, "auto-5": 5.0, "auto-10": 10.0}
ROWS = list(SCHEMES) + list(BUDGETS)
TARGETS = {"int8": 0.5, "lut8": 0.5, "lut6": 3.0, "auto-2": 2.0, "auto-5": 5.0, "auto-10": 10.0}  # max increase, %


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llama_ane", *args], cwd=ROOT, capture_output=True, text=True)


def package_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("*.mlpackage/**/*") if p.is_file())


def auto_recipes(budgets: dict[str, float], folder: Path) -> dict[str, dict]:
    """Measure every unit once and choose a recipe per budget, as `--quantize auto` does;
    name -> {"file": recipe path, "seconds": ..., "recipe": its JSON}."""
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.export import quality
    from llama_ane.quantize.auto import CANDIDATES, CHECK_TOKENS
    from llama_ane.quantize.sensitivity import choose_recipe, measure_units

    t0 = time.perf_counter()
    ckpt = load_checkpoint(None)
    importance = quality.calibrate(ckpt, print, grams=True)
    model = quality.quality_model(ckpt)
    ids = quality.sensitivity_ids(ckpt)
    check = quality.text_ids(ckpt, quality.eval_text(), CHECK_TOKENS)
    found = measure_units(model, ids, CANDIDATES, importance, print)
    measured_s = time.perf_counter() - t0
    out = {}
    for name, budget in budgets.items():
        t1 = time.perf_counter()
        recipe = choose_recipe(model, ids, check, importance, budget, "the eval text", print, found=found)
        file = folder / f"{name}.json"
        recipe.save(file)
        out[name] = {"file": file, "recipe": recipe.to_dict(),
                     "choose_s": round(measured_s + time.perf_counter() - t1, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    ap.add_argument("--backend", default="mil", choices=["mil", "torch"], help="backend of `llama-ane eval`")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.rows.split(",") if s.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown row(s) {unknown}; choose from {', '.join(ROWS)}")
    work = Path(tempfile.mkdtemp(prefix="llama-ane-quantize-"))
    results: dict[str, dict] = {}
    failed = False
    try:
        recipes = auto_recipes({n: BUDGETS[n] for n in names if n in BUDGETS}, work)
        fp16 = work / "fp16"
        for name in ["fp16"] + [n for n in names if n != "fp16"]:
            out = fp16 if name == "fp16" else work / name.replace("/", "_")
            options = SCHEMES[name] if name in SCHEMES else ["--quantize-recipe", str(recipes[name]["file"])]
            t0 = time.perf_counter()
            r = cli("export", "-o", str(out), "--force", "--quiet", "--no-verify", *options)
            wall = time.perf_counter() - t0
            lines = (r.stdout + r.stderr).splitlines()
            entry = {"options": SCHEMES.get(name, ["--quantize", "auto", "--quantize-budget", f"{BUDGETS.get(name)}"]),
                     "export_exit": r.returncode, "export_wall_s": round(wall, 1), "text": HELD_OUT.name}
            if name in recipes:
                entry["recipe"] = recipes[name]["recipe"]
                entry["choose_s"] = recipes[name]["choose_s"]
            print(f"{name}: export exit {r.returncode} in {wall:.0f} s", flush=True)
            if r.returncode != 0:
                entry["output_tail"] = lines[-20:]
                results[name] = entry
                save({name: entry})
                failed = True
                continue
            entry["package_bytes"] = package_bytes(out)
            manifest = json.loads((out / "manifest.json").read_text())
            entry["weight_bytes"] = sum(w["bytes"] for w in manifest["weights"].values())
            entry["ane_read_bytes"] = weight_read_bytes(manifest)  # per decode token, as the device model counts
            e = cli("eval", str(out), "--backend", args.backend, "--json", "--text", str(HELD_OUT),
                    *([] if name == "fp16" else ["--reference", str(fp16)]))
            if e.returncode != 0:
                entry["eval_error"] = (e.stdout + e.stderr).splitlines()[-5:]
                failed = True
            else:
                report = json.loads(e.stdout)
                entry.update({k: report[k] for k in ("perplexity", "reference_perplexity", "top1_agreement",
                                                     "mean_kl", "tokens", "backend", "precision", "quantization")})
                if report.get("reference_perplexity"):
                    entry["perplexity_change_pct"] = round(100 * (report["perplexity"] / report["reference_perplexity"] - 1), 2)
                print(f"  perplexity {report['perplexity']:.3f}"
                      + (f" ({entry['perplexity_change_pct']:+.2f}%)" if "perplexity_change_pct" in entry else ""),
                      flush=True)
            results[name] = entry
            save({name: entry})  # row by row: an interrupted run keeps what it measured
            if out != fp16:
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def save(results: dict) -> None:
    """Merge `results` into benchmarks/results/quantize_smollm2.json (rows no longer in ROWS, or
    measured on other text, are dropped) and write the table, quantize_smollm2.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    file = RESULTS / "quantize_smollm2.json"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "llama_ane", "benchmarks/quantize_smollm2.py"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    stamp = {"date": datetime.date.today().isoformat(), "commit": commit + ("-dirty" if dirty else ""),
             "machine": f"{platform.machine()}, {platform.system()}, {__import__('os').cpu_count()} CPUs"}
    for entry in results.values():
        entry.update(stamp)
    kept = json.loads(file.read_text()) if file.exists() else {}
    merged = {**kept, **results}
    results = {name: merged[name] for name in ROWS if name in merged and merged[name].get("text") == HELD_OUT.name}
    file.write_text(json.dumps(results, indent=2) + "\n")
    rows = ["| row | packages MB | weights read MB/token | perplexity | change vs fp16 | target | top-1 vs fp16 | mean KL |",
            "|---|---|---|---|---|---|---|---|"]
    for name, e in results.items():
        if "perplexity" not in e:
            rows.append(f"| {name} | - | - | failed | | | | |")
            continue
        change = f"{e['perplexity_change_pct']:+.2f}%" if "perplexity_change_pct" in e else "-"
        target = f"<= {TARGETS[name]}%" if name in TARGETS else "-"
        top1 = f"{e['top1_agreement']:.3f}" if e.get("top1_agreement") is not None else "-"
        kl = f"{e['mean_kl']:.4f}" if e.get("mean_kl") is not None else "-"
        rows.append(f"| {name} | {e['package_bytes'] / 1e6:.1f} | {e['ane_read_bytes'] / 1e6:.1f} | "
                    f"{e['perplexity']:.3f} | {change} | {target} | {top1} | {kl} |")
    md = (f"Perplexity on benchmarks/{HELD_OUT.name} ({next(iter(results.values()), {}).get('tokens', '?')} tokens), "
          "mil backend, against the fp16 export. SmolLM2 was dequantized from a Q4_1/Q8_0 GGUF.\n\n"
          + "\n".join(rows) + "\n")
    (RESULTS / "quantize_smollm2.md").write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    sys.exit(main())
