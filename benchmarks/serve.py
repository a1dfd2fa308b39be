"""`llama-ane serve` under concurrent clients vs the same requests one after another (torch, CPU).

For 1, 2, 4 and 8 clients, each asking a different question about one shared document (the
prompts share the document's first 250 tokens), the script sends the requests first one
after another, then all at once, to a live server over HTTP with the openai client, and reports
the aggregate completion tokens/s of each, their ratio, the model calls each needed and how many
batches the server ran and declined (`--batching`, default auto: only where it pays). Answers
are greedy with no end-of-sequence token, so every request generates exactly --new-tokens tokens,
and the concurrent answers are checked equal to the sequential ones. The prompt cache is on, as
the server's default: one after the other, every request after the first reuses the document
from it. The prompt cache is emptied before each run, so no run reuses another's prompts
(--no-prompt-cache measures batching alone). It also measures the JSON-schema mask's cost per
token (llguidance) on the served tokenizer. Results go to benchmarks/results/serve.json, with the
command that made them.

    python benchmarks/serve.py                      the tiny random model (exported to a temp folder)
    python benchmarks/serve.py --smollm2            SmolLM2-135M-Instruct (exported first: minutes)
    python benchmarks/serve.py --model out/smollm2  an existing export
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
import threading
import time
from pathlib import Path

import numpy as np

import llama_ane
from llama_ane.serve.app import create_app, serve_in_thread
from llama_ane.serve.constraints import Grammars
from llama_ane.serve.options import ServeOptions

RESULTS = Path(__file__).parent / "results"
DOCUMENT = (Path(__file__).parent / "document.txt").read_text()
QUESTIONS = ["Who paid for the pier?", "When did the railway arrive?", "What was built first?",
             "Who lived there?", "What changed later?", "Why did it close?", "Where is it?", "What remains?"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()


def machine() -> dict:
    return {"system": platform.system(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "processor": platform.processor() or None, "python": platform.python_version()}


def tiny_export(folder: Path) -> Path:
    from llama_ane.api import export_model
    from llama_ane.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(folder / "ckpt", num_hidden_layers=3, head_dim=32)
    return export_model(ckpt, folder / "export", context_length=512, prefill_length=64, layers_per_chunk=2,
                        branch_width=8, suffix_length=64, progress=False, verify=False)


def ask_all(client, prompts: list[str], new_tokens: int, concurrent: bool) -> tuple[list[str], float]:
    answers: list = [None] * len(prompts)

    def ask(i: int) -> None:
        answers[i] = client.completions.create(model="m", prompt=prompts[i], max_tokens=new_tokens,
                                               temperature=0).choices[0].text
    t0 = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(prompts)):
            ask(i)
    return answers, time.perf_counter() - t0


def mask_ms_per_token(model, tokens: int = 64) -> float:
    """Mean milliseconds to compute and apply the JSON-schema mask for one token (random logits)."""
    grammars = Grammars(model.tokenizer, model.manifest["config"]["vocab_size"], model.eos_token_ids)
    grammar = grammars.json_schema(PERSON)
    rng = np.random.default_rng(0)
    spent, count = 0.0, 0
    while count < tokens:
        constraint = grammars.matcher(grammar)
        while not constraint.complete and count < tokens:
            logits = rng.normal(size=grammars.vocab_size).astype(np.float32)
            t0 = time.perf_counter()
            masked = constraint.mask(logits)
            spent += time.perf_counter() - t0
            constraint.advance(int(np.argmax(masked)))
            count += 1
    return 1000 * spent / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="an export folder (default: a tiny random export)")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--smollm2", action="store_true", help="export the embedded SmolLM2-135M and serve it")
    ap.add_argument("--prefix-tokens", type=int, default=250,
                    help="tokens of benchmarks/document.txt shared by every prompt")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each; the fastest is kept (a shared CPU is noisy)")
    ap.add_argument("--batching", choices=["auto", "always", "never"], default="auto", help="the server's --batching")
    ap.add_argument("--no-prompt-cache", action="store_true", help="serve without the prompt cache")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: benchmarks/results/serve.json (serve_smollm2.json with --smollm2)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        __import__("torch").set_num_threads(args.threads)
    args.out = args.out or RESULTS / ("serve_smollm2.json" if args.smollm2 else "serve.json")
    import openai

    with tempfile.TemporaryDirectory() as tmp:
        if args.smollm2:
            from llama_ane.api import export_model

            folder = export_model(None, Path(tmp) / "smollm2", branch_width=8, progress=False, verify=False)
        else:
            folder = Path(args.model) if args.model else tiny_export(Path(tmp))
        model = llama_ane.load(folder, backend="torch", precision="fp32")
        model.manifest["tokenizer"]["eos_token_ids"] = []  # every answer is --new-tokens long
        calls = [0]
        predict = model.backend.predict

        def counted(*a, **k):
            calls[0] += 1
            return predict(*a, **k)
        model.backend.predict = counted
        shared = model.tokenizer.decode(model.encode(DOCUMENT)[:args.prefix_tokens], skip_special_tokens=True)
        prompts = [f"{shared}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
        rows = []
        options = ServeOptions(prompt_cache_bytes=0 if args.no_prompt_cache else ServeOptions.prompt_cache_bytes,
                               batching=args.batching)
        app = create_app(model, options)
        with serve_in_thread(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            ask_all(client, prompts[:1], 4, concurrent=False)  # warm-up: weights loaded, paths taken, steps timed
            scheduler = app.state.server.scheduler
            metrics = scheduler.metrics

            def run(k: int, concurrent: bool) -> tuple[list[str], float]:
                if scheduler.prompt_cache is not None:  # each run starts without the others' prompts
                    scheduler.prompt_cache.clear()
                return ask_all(client, prompts[:k], args.new_tokens, concurrent)
            for k in [int(c) for c in args.clients.split(",")]:
                seq_s = con_s = float("inf")
                same = True
                for _ in range(args.repeats):
                    c0, b0, d0 = calls[0], metrics.cascade_batches, metrics.batches_declined
                    seq, s = run(k, concurrent=False)
                    c1 = calls[0]
                    con, c = run(k, concurrent=True)
                    c2 = calls[0]
                    same = same and con == seq
                    if c < con_s:
                        con_calls, batches, declined = c2 - c1, metrics.cascade_batches - b0, \
                            metrics.batches_declined - d0
                    seq_s, con_s = min(seq_s, s), min(con_s, c)
                tokens = k * args.new_tokens
                rows.append({"clients": k, "prompt_tokens": [len(model.encode(p)) for p in prompts[:k]],
                             "new_tokens_per_client": args.new_tokens, "same_answers": same,
                             "sequential_s": seq_s, "sequential_tok_per_s": tokens / seq_s,
                             "sequential_model_calls": c1 - c0,
                             "concurrent_s": con_s, "concurrent_tok_per_s": tokens / con_s,
                             "concurrent_model_calls": con_calls, "concurrent_batches": batches,
                             "batches_declined": declined, "speedup": seq_s / con_s,
                             "concurrent_over_sequential": con_s / seq_s})
                print(f"{k} clients: sequential {tokens / seq_s:7.1f} tok/s ({c1 - c0} calls), concurrent "
                      f"{tokens / con_s:7.1f} tok/s ({con_calls} calls, {batches} batches, {declined} declined), "
                      f"x{seq_s / con_s:.2f}, same: {same}")
        mask_ms = mask_ms_per_token(model)
        print(f"JSON-schema mask: {mask_ms:.3f} ms per token (vocabulary {model.manifest['config']['vocab_size']})")
        result = {"benchmark": "serve", "model": "SmolLM2-135M-Instruct" if args.smollm2 else args.model or
                  "tiny random (3 layers, hidden 64, vocab 320)",
                  "backend": "torch fp32", "branch_width": model.manifest.get("branch_width"),
                  "context_length": model.manifest["context_length"], "prompt_cache": not args.no_prompt_cache,
                  "batching": args.batching, "command": " ".join(["python", "benchmarks/serve.py", *sys.argv[1:]]),
                  "shared_prefix_tokens": args.prefix_tokens, "repeats": args.repeats,
                  "torch_threads": __import__("torch").get_num_threads(), "rows": rows,
                  "grammar": {"library": "llguidance", "schema": PERSON, "mask_ms_per_token": mask_ms,
                              "vocab_size": model.manifest["config"]["vocab_size"]},
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "machine": machine(),
                  "commit": git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--",
                                                                                    "llama_ane") else "")}
        model.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
