"""Cascade branch decoding vs decoding the same branches one after another (torch backend, CPU).

For B = 1, 2, 4, 8 branches over one ~400-token prefix of real text, both ways produce the same
greedy tokens (checked); the script times only the decode phase and prints aggregate tokens/s and
the ratio, plus the prefix K/V bytes each decode step reads. Results go to
benchmarks/results/branches_cpu.{json,png}.

    python benchmarks/branches_cpu.py [--model default|FOLDER] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import llama_ane

RESULTS = Path(__file__).parent / "results"
DOCUMENT = (Path(__file__).parent / "document.txt").read_text()
BRANCH_STARTS = [" The", " In", " A", " It", " This", " One", " When", " Many"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="export folder, checkpoint folder, .gguf or 'default'")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    rows = []
    for b in widths:
        # an export of cascade width B for B branches, as a deployment decoding B branches would use
        model = llama_ane.load(args.model, backend="torch", precision="fp32", branch_width=b)
        prefix = model.encode(DOCUMENT)[:400]
        conts = [model.tokenizer(s, add_special_tokens=False).input_ids[:1] for s in BRANCH_STARTS[:b]]
        model.generate(prefix[:64], max_new_tokens=4)  # warm-up
        t0 = time.perf_counter()
        out = model.generate_branches(prefix, conts, max_new_tokens=args.new_tokens)
        cascade_wall = time.perf_counter() - t0
        seq_decode, seq_tokens, same = 0.0, 0, True
        for r, cont in zip(out.branches, conts):
            alone = model.generate(prefix + cont, max_new_tokens=args.new_tokens)
            seq_decode += alone.decode_seconds
            seq_tokens += len(alone.token_ids)
            same &= alone.token_ids == r.token_ids
        s = out.stats
        row = {"branches": b, "prefix_tokens": len(prefix), "new_tokens_per_branch": args.new_tokens,
               "cascade_decode_s": s.decode_seconds, "cascade_tokens": s.generated_tokens,
               "cascade_tok_per_s": s.generated_tokens / s.decode_seconds, "cascade_wall_s": cascade_wall,
               "sequential_decode_s": seq_decode, "sequential_tokens": seq_tokens,
               "sequential_tok_per_s": seq_tokens / seq_decode,
               "prefix_bytes_per_step_cascade": s.prefix_bytes_per_step_cascade,
               "prefix_bytes_per_step_separate": s.prefix_bytes_per_step_cascade * b,
               "identical_tokens": bool(same)}
        row["speedup"] = row["cascade_tok_per_s"] / row["sequential_tok_per_s"]
        rows.append(row)
        model.close()
        print(f"B={b}: cascade {row['cascade_tok_per_s']:7.2f} tok/s  sequential {row['sequential_tok_per_s']:7.2f} tok/s"
              f"  speedup {row['speedup']:.2f}x  identical={same}  prefix K/V per step "
              f"{row['prefix_bytes_per_step_cascade'] / 1e6:.2f} MB vs {row['prefix_bytes_per_step_separate'] / 1e6:.2f} MB",
              flush=True)

    RESULTS.mkdir(exist_ok=True)
    meta = {"model": model.manifest["name"], "backend": "torch fp32 CPU", "threads": torch.get_num_threads(),
            "machine": platform.machine(), "processor": platform.processor(), "torch": torch.__version__}
    (RESULTS / "branches_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    plot(rows, RESULTS / "branches_cpu.png")
    best = rows[-1]
    print(f"\nB={best['branches']} over a {best['prefix_tokens']}-token prefix: {best['speedup']:.2f}x the aggregate decode "
          f"tokens/s of decoding the branches one after another")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = [r["branches"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(b, [r["cascade_tok_per_s"] for r in rows], "o-", label="cascade (one step for all branches)")
    ax1.plot(b, [r["sequential_tok_per_s"] for r in rows], "s-", label="one branch after another")
    ax1.set(xlabel="branches B", ylabel="aggregate decode tokens/s", xscale="log", title="Decode throughput, CPU")
    ax1.set_xticks(b, [str(x) for x in b])
    ax1.legend()
    ax2.bar([str(x) for x in b], [r["prefix_bytes_per_step_separate"] / 1e6 for r in rows], label="separate caches")
    ax2.bar([str(x) for x in b], [r["prefix_bytes_per_step_cascade"] / 1e6 for r in rows], label="cascade")
    ax2.set(xlabel="branches B", ylabel="prefix K/V read per step (MB)", title="Prefix bytes per decode step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
