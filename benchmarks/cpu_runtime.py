"""The torch backend against transformers' own `generate`, on the same CPU threads, in one process.

Both run SmolLM2-135M-Instruct in fp32 on the same prompt (real text, `--prompt-tokens` tokens) and
decode `--new-tokens` greedy tokens; each side runs once to warm up, then the two run in turn
`--repeat` times (so a change in the machine's load falls on both), and each side's median is
kept. transformers runs the GGUF's weights; llama-ane runs an export of them (made here once,
in `benchmarks/.scale/exports/cpu-runtime`, unless `--export` names one). The greedy tokens of
both are printed side by side so a difference is seen, not hidden. Results go to
benchmarks/results/cpu_runtime.{json,md}.

    python benchmarks/cpu_runtime.py [--threads 2] [--prompt-tokens 256] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
RESULTS = HERE / "results"
DOCUMENT = (HERE / "document.txt").read_text()


def transformers_run(model, ids: list[int], new_tokens: int) -> dict:
    """Prefill and decode tokens/s of `model.generate` (greedy, its default dynamic cache)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        t0 = time.perf_counter()
        model(x, use_cache=True)  # prefill alone, to time it as llama-ane's is timed
        t1 = time.perf_counter()
        out = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        t2 = time.perf_counter()
    generated = out[0, len(ids):].tolist()
    # generate = one prefill + (new_tokens - 1) decode steps
    decode_s = (t2 - t1) - (t1 - t0)
    return {"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": (len(generated) - 1) / decode_s,
            "tokens": generated}


def llama_ane_run(model, ids: list[int], new_tokens: int) -> dict:
    eos = model.manifest["tokenizer"]["eos_token_ids"]
    model.manifest["tokenizer"]["eos_token_ids"] = []  # decode exactly new_tokens, as transformers does
    try:
        r = model.generate(ids, max_new_tokens=new_tokens)
    finally:
        model.manifest["tokenizer"]["eos_token_ids"] = eos
    return {"prefill_tok_s": r.prefill_tokens_per_s, "decode_tok_s": r.decode_tokens_per_s, "tokens": r.token_ids}


def alternated(ours, ref, repeat: int) -> tuple[dict, dict, list[float]]:
    """Each side warmed once, then run in turn `repeat` times (ours, ref, ours, ref, ...), so a
    change in the machine's load falls on both; the median of each side, and each pair's decode
    ratio."""
    ours(), ref()
    pairs = [(ours(), ref()) for _ in range(repeat)]

    def median(runs: list[dict]) -> dict:
        return {"prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs), "tokens": runs[-1]["tokens"]}
    return (median([a for a, _ in pairs]), median([b for _, b in pairs]),
            [a["decode_tok_s"] / b["decode_tok_s"] for a, b in pairs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--export", type=Path, default=None, help="an export of SmolLM2 to run (default: made here)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import llama_ane
    from transformers import AutoModelForCausalLM

    from llama_ane.checkpoint.loader import default_gguf_path

    folder = args.export
    if folder is None:
        folder = HERE / ".scale" / "exports" / "cpu-runtime"
        if not (folder / "manifest.json").is_file():
            llama_ane.export_model(None, folder, verify=False)
    model = llama_ane.load(folder, backend="torch")
    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()

    ids = model.encode(DOCUMENT)[:args.prompt_tokens]
    ours, ref, pair_ratios = alternated(lambda: llama_ane_run(model, ids, args.new_tokens),
                                        lambda: transformers_run(hf, ids, args.new_tokens), args.repeat)
    same = sum(a == b for a, b in zip(ours["tokens"], ref["tokens"]))
    row = {"prompt_tokens": len(ids), "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
           "llama_ane": {k: ours[k] for k in ("prefill_tok_s", "decode_tok_s")},
           "transformers": {k: ref[k] for k in ("prefill_tok_s", "decode_tok_s")},
           "prefill_ratio": ours["prefill_tok_s"] / ref["prefill_tok_s"],
           "decode_ratio": ours["decode_tok_s"] / ref["decode_tok_s"],
           "decode_ratio_per_pair": [round(r, 3) for r in pair_ratios],
           "load_average_1min": os.getloadavg()[0],
           "same_greedy_tokens": f"{same}/{len(ref['tokens'])}"}
    print(f"SmolLM2-135M fp32, {row['threads']} threads, {len(ids)}-token prompt, {args.new_tokens} new tokens "
          f"(median of {args.repeat}, the two run in turn; 1-minute load {row['load_average_1min']:.1f})")
    print(f"  prefill  llama-ane {ours['prefill_tok_s']:8.1f} tok/s  transformers {ref['prefill_tok_s']:8.1f} tok/s"
          f"  ratio {row['prefill_ratio']:.2f}x")
    print(f"  decode   llama-ane {ours['decode_tok_s']:8.1f} tok/s  transformers {ref['decode_tok_s']:8.1f} tok/s"
          f"  ratio {row['decode_ratio']:.2f}x (per pair: {', '.join(f'{r:.2f}' for r in pair_ratios)})")
    print(f"  greedy tokens equal at {row['same_greedy_tokens']} positions (the export's weights are fp16-rounded)")
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True).stdout.strip()
    meta = {"machine": platform.machine(), "processor": platform.processor(), "torch": torch.__version__,
            "export": str(folder), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--", "../llama_ane")
                                                            else "")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_runtime.json").write_text(json.dumps({"meta": meta, **row}, indent=2) + "\n")
    (RESULTS / "cpu_runtime.md").write_text(
        f"| SmolLM2-135M fp32, {row['threads']} threads | llama-ane torch backend | transformers generate | ratio |\n"
        "|---|---|---|---|\n"
        f"| prefill ({len(ids)} tokens) | {ours['prefill_tok_s']:.1f} tok/s | {ref['prefill_tok_s']:.1f} tok/s | "
        f"{row['prefill_ratio']:.2f}x |\n"
        f"| decode ({args.new_tokens} tokens) | {ours['decode_tok_s']:.1f} tok/s | {ref['decode_tok_s']:.1f} tok/s | "
        f"{row['decode_ratio']:.2f}x |\n")
    model.close()


if __name__ == "__main__":
    main()
