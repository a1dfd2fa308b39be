"""Prefill tokens/s and decode time per step against how full a long context is (torch backend, CPU).

Exports SmolLM2-135M-Instruct with `--context-length 8192` (once, into benchmarks/.scale/exports/
long-context, with its parity check) unless `--export` names one, then for each prompt length
prefills real text (the shipped held-out prose, repeated) and decodes `--new-tokens` greedy tokens,
two ways in the same process:

  * direct caches (the torch backend's default): new K/V written in place, each step attends over
    the filled positions only;
  * the cache-update modules (`direct_cache=False`): every step reads and rewrites the whole
    context, as the exported programs do on a device.

Results go to benchmarks/results/long_context.{json,md}.

    python benchmarks/long_context.py [--lengths 512,2048,4096,6000] [--new-tokens 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
RESULTS = HERE / "results"
CONTEXT = 8192


def measure(model, ids: list[int], new_tokens: int) -> dict:
    eos = model.manifest["tokenizer"]["eos_token_ids"]
    model.manifest["tokenizer"]["eos_token_ids"] = []  # decode exactly new_tokens
    try:
        t0 = time.perf_counter()
        r = model.generate(ids, max_new_tokens=new_tokens)
        wall = time.perf_counter() - t0
    finally:
        model.manifest["tokenizer"]["eos_token_ids"] = eos
    return {"prefill_tok_s": r.prefill_tokens_per_s, "decode_ms_per_step": 1000 * r.decode_seconds / r.decoded_tokens,
            "wall_s": wall, "tokens": r.token_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,2048,4096,6000", help="prompt lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--export", type=Path, default=None, help=f"an export of SmolLM2 at context {CONTEXT}")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import llama_ane

    folder = args.export or HERE / ".scale" / "exports" / "long-context"
    if not (folder / "manifest.json").is_file():
        print(f"exporting SmolLM2 at context {CONTEXT} to {folder} ...", flush=True)
        llama_ane.export_model(None, folder, context_length=CONTEXT, verify=True, log=print)
    direct = llama_ane.load(folder, backend="torch")
    modules = llama_ane.load(folder, backend="torch", direct_cache=False)
    for m in (direct, modules):
        m.prepare()
    text = (llama_ane.__path__[0] + "/eval_text.txt")
    base = direct.encode(Path(text).read_text())
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        ids = (base * (n // len(base) + 1))[:n]
        a = measure(direct, ids, args.new_tokens)
        b = measure(modules, ids, args.new_tokens)
        row = {"prompt_tokens": n, "direct": {k: a[k] for k in ("prefill_tok_s", "decode_ms_per_step")},
               "cache_update_modules": {k: b[k] for k in ("prefill_tok_s", "decode_ms_per_step")},
               "same_greedy_tokens": a["tokens"] == b["tokens"]}
        rows.append(row)
        print(f"{n:5d} tokens: direct prefill {a['prefill_tok_s']:7.1f} tok/s, decode {a['decode_ms_per_step']:7.1f} "
              f"ms/step | cache-update modules prefill {b['prefill_tok_s']:7.1f} tok/s, decode "
              f"{b['decode_ms_per_step']:7.1f} ms/step | same tokens: {row['same_greedy_tokens']}", flush=True)
    meta = {"model": direct.manifest["name"], "context_length": direct.manifest["context_length"],
            "threads": torch.get_num_threads(), "machine": platform.machine(), "torch": torch.__version__,
            "new_tokens": args.new_tokens}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "long_context.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"| prompt tokens (context {meta['context_length']}) | prefill tok/s, direct | decode ms/step, direct "
             "| prefill tok/s, cache-update modules | decode ms/step, cache-update modules | same tokens |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['prompt_tokens']} | {r['direct']['prefill_tok_s']:.1f} | {r['direct']['decode_ms_per_step']:.1f} | "
              f"{r['cache_update_modules']['prefill_tok_s']:.1f} | {r['cache_update_modules']['decode_ms_per_step']:.1f} | "
              f"{r['same_greedy_tokens']} |" for r in rows]
    (RESULTS / "long_context.md").write_text("\n".join(lines) + "\n")
    direct.close()
    modules.close()


if __name__ == "__main__":
    main()
