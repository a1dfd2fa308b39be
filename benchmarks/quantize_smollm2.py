"""Quality and size of every compression scheme on the embedded SmolLM2-135M-Instruct.

For each scheme: `llama-ane export --quantize ...` (verify gate on, its lines recorded), the
packages' size, and `llama-ane eval --backend mil --reference <the fp16 export> --json`:
perplexity on the shipped held-out prose (about 2100 tokens), its change against the fp16
export, top-1 agreement and mean KL. Results go to benchmarks/results/quantize_smollm2.{json,md}.

    python benchmarks/quantize_smollm2.py                      # every scheme (about 30 minutes)
    python benchmarks/quantize_smollm2.py --schemes lut6,int4 --backend torch

The embedded SmolLM2 was itself dequantized from a 4-bit GGUF (Q4_1 layers, Q8_0 embeddings), so
its weights already lie on 4-bit grids: say so beside any number taken from here.

Results of earlier runs are kept: a run replaces the rows of the schemes it measured (each row
records the commit it was measured at).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCHEMES = {  # name -> export options
    "fp16": [],
    "int8": ["--quantize", "int8"],
    "lut8": ["--quantize", "lut8"],
    "lut6": ["--quantize", "lut6"],
    "int4": ["--quantize", "int4"],
    "lut4": ["--quantize", "lut4"],
    "lut4-mlp/lut6": ["--quantize", "lut6", "--quantize-mlp", "lut4"],  # Anemll's mix
    "int4/int8-vocab": ["--quantize", "int4", "--quantize-embeddings", "int8", "--quantize-lm-head", "int8"],
    # what else was tried for the lut6 and lut4 targets: where the loss is, and smaller LUT groups
    "lut6/fp16-vocab": ["--quantize", "lut6", "--quantize-embeddings", "none", "--quantize-lm-head", "none"],
    "lut6-group16": ["--quantize", "lut6", "--group-size", "16"],
    "lut6-group4": ["--quantize", "lut6", "--group-size", "4"],
    "lut4-group4": ["--quantize", "lut4", "--group-size", "4"],
    # LUT values scaled and shifted per block of input channels (the bytes of int4 in blocks alike)
    "lut4-block32": ["--quantize", "lut4", "--lut-block-size", "32"],
    "lut4-block64": ["--quantize", "lut4", "--lut-block-size", "64"],
}
TARGETS = {"int8": 0.5, "lut8": 0.5, "lut6": 2.0, "int4": 8.0, "lut4": 8.0, "lut4-block32": 8.0}  # max perplexity
# increase, %: lut4's also holds for its LUTs scaled per block of 32, the block of the checkpoint's Q4_1 layers


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llama_ane", *args], cwd=ROOT, capture_output=True, text=True)


def package_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("*.mlpackage/**/*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated: {', '.join(SCHEMES)}")
    ap.add_argument("--backend", default="mil", choices=["mil", "torch"], help="backend of `llama-ane eval`")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.schemes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        ap.error(f"unknown scheme(s) {unknown}; choose from {', '.join(SCHEMES)}")
    work = Path(tempfile.mkdtemp(prefix="llama-ane-quantize-"))
    results: dict[str, dict] = {}
    failed = False
    try:
        fp16 = work / "fp16"
        order = ["fp16"] + [n for n in names if n != "fp16"]
        for name in order:
            out = fp16 if name == "fp16" else work / name.replace("/", "_")
            t0 = time.perf_counter()
            r = cli("export", "-o", str(out), "--force", "--quiet", *SCHEMES[name])
            wall = time.perf_counter() - t0
            lines = (r.stdout + r.stderr).splitlines()
            entry = {"options": SCHEMES[name], "export_exit": r.returncode, "export_wall_s": round(wall, 1),
                     "verify": [ln for ln in lines if ln.startswith("  ") and ("|" in ln or "torch" in ln
                                                                            or "transformers" in ln)]}
            print(f"{name}: export exit {r.returncode} in {wall:.0f} s", flush=True)
            if r.returncode != 0:
                entry["output_tail"] = lines[-20:]
                results[name] = entry
                failed = True
                continue
            entry["package_bytes"] = package_bytes(out)
            e = cli("eval", str(out), "--backend", args.backend, "--json",
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
            if out != fp16:
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save(results)
    return 1 if failed else 0


def save(results: dict) -> None:
    """Merge `results` into benchmarks/results/quantize_smollm2.json (rows of schemes no longer in
    SCHEMES are dropped) and write the table, quantize_smollm2.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    file = RESULTS / "quantize_smollm2.json"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    for entry in results.values():
        entry["commit"] = commit
    kept = json.loads(file.read_text()) if file.exists() else {}
    merged = {**kept, **results}
    results = {name: merged[name] for name in SCHEMES if name in merged}
    file.write_text(json.dumps(results, indent=2) + "\n")
    rows = ["| scheme | packages MB | perplexity | change vs fp16 | target | top-1 vs fp16 | mean KL |",
            "|---|---|---|---|---|---|---|"]
    for name, e in results.items():
        if "perplexity" not in e:
            rows.append(f"| {name} | - | failed | | | | |")
            continue
        change = f"{e['perplexity_change_pct']:+.2f}%" if "perplexity_change_pct" in e else "-"
        target = f"<= {TARGETS[name]}%" if name in TARGETS else "-"
        top1 = f"{e['top1_agreement']:.3f}" if e.get("top1_agreement") is not None else "-"
        kl = f"{e['mean_kl']:.4f}" if e.get("mean_kl") is not None else "-"
        rows.append(f"| {name} | {e['package_bytes'] / 1e6:.1f} | {e['perplexity']:.3f} | {change} | {target} | "
                    f"{top1} | {kl} |")
    md = "\n".join(rows) + "\n"
    (RESULTS / "quantize_smollm2.md").write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    sys.exit(main())
