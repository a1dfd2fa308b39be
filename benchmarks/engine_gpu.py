"""GPU engine throughput: greedy decoding of several branches after one shared prompt, our engine
(decode step replayed as a CUDA graph, and eager) against transformers' ``generate`` on the same
model in the same process.

Every system gets the same token ids (prompt + branch per request, branches of equal length so that
transformers needs no padding) and produces ``--new`` tokens per branch; the time is the whole
call (prefill included), median of ``--reps`` after a warm-up call, so tokens/s = branches x new /
seconds. Default model: random weights with SmolLM2-135M's shapes (30 layers, 576 wide, 9/3 heads
of 64), since throughput depends on shapes only; ``--model-dir`` takes a real llama folder.

    python benchmarks/engine_gpu.py --out benchmarks/results/cuda_engine.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path


def smollm2_shaped_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                      initializer_range=0.02)
    return LlamaForCausalLM(cfg).eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, help="a llama folder (default: SmolLM2-135M shapes)")
    ap.add_argument("--branches", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--branch-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch

    from llama_ane.cuda.engine import GPUEngine, load_hf_model

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    model = load_hf_model(args.model_dir)[0] if args.model_dir else smollm2_shaped_model()
    engine = GPUEngine(model, dtype=torch.float16)
    hf = copy.deepcopy(model).to("cuda", torch.float16)  # the engine keeps its own rotary module
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()

    def timed(fn):
        fn()  # warm-up: kernel compilation, cuBLAS handles, the graph capture
        times = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), out

    rows = []
    for n in args.branches:
        branches = [torch.randint(0, vocab, (args.branch_len,), generator=gen).tolist()
                    for _ in range(n)]
        ids = torch.tensor([prompt + b for b in branches], device="cuda")

        def run_hf():
            with torch.inference_mode():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=args.new, min_new_tokens=args.new,
                                   pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:].tolist()

        rec = dict(branches=n, prompt_len=args.prompt_len, branch_len=args.branch_len,
                   new_tokens=args.new)
        rec["hf_s"], hf_tokens = timed(run_hf)
        for name, graph in (("graph", True), ("eager", False)):
            rec[f"ours_{name}_s"], res = timed(lambda graph=graph: engine.generate(
                prompt, branches, args.new, path="auto", cuda_graph=graph))
            rec[f"ours_{name}_path"] = res.path
            rec[f"ours_{name}_same_tokens_as_hf"] = sum(a == b for a, b in zip(res.tokens,
                                                                                  hf_tokens))
        for key in ("hf", "ours_graph", "ours_eager"):
            rec[f"{key}_tokens_per_s"] = n * args.new / rec[f"{key}_s"]
        rec["graph_vs_hf"] = rec["hf_s"] / rec["ours_graph_s"]
        rec["eager_vs_hf"] = rec["hf_s"] / rec["ours_eager_s"]
        rows.append(rec)
        print(f"branches {n:>3}: transformers {rec['hf_tokens_per_s']:8.0f} tok/s | ours graph "
              f"{rec['ours_graph_tokens_per_s']:8.0f} tok/s (x{rec['graph_vs_hf']:.2f}, "
              f"{rec['ours_graph_path']}) | ours eager {rec['ours_eager_tokens_per_s']:8.0f} "
              f"tok/s (x{rec['eager_vs_hf']:.2f}) | branches with transformers' tokens: "
              f"{rec['ours_graph_same_tokens_as_hf']}/{n}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                            torch=torch.__version__, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
