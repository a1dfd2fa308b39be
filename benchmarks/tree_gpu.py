"""Tree attention on the GPU: the flattened multi-level kernel against per-branch paged decode and
against the two-level cascade (prompt as shared prefix, the rest per query as suffix).

Workloads (head_dim 128, fp16, page size 1 so any token can be any node's):
* speculative-decoding token trees of t = 32, 64, 128 draft tokens over a 4096-token prompt; every
  tree token is a query (tree verification) and sees the prompt and its ancestors;
* few-shot trees: a 4096-token prompt with width 20 / 50 branches of 256 tokens, one query each.

"auto" is ``TreeBatch``'s pick (the cascade when no node below the root is shared).

    python benchmarks/tree_gpu.py --out benchmarks/results/cuda_tree.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

D = 128
PROMPT = 4096
HEADS = ((32, 32), (32, 8))


def spec_tree(t: int, seed: int) -> list[int]:
    """Parents of a draft tree: node 0 the prompt, node i > 0 a token under a random earlier node,
    biased toward recent nodes so that depth grows like a beam of drafts."""
    import random

    rng = random.Random(seed)
    parents = [-1, 0]
    for i in range(2, t + 1):
        lo = max(0, i - 8)
        parents.append(rng.randint(lo, i - 1))
    return parents


def workloads():
    for t in (32, 64, 128):
        parents = spec_tree(t, t)
        sizes = [PROMPT] + [1] * t
        yield f"spec t={t}", parents, sizes, list(range(1, t + 1))
    for width in (20, 50):
        parents = [-1] + [0] * width
        sizes = [PROMPT] + [256] * width
        yield f"few-shot w={width}", parents, sizes, list(range(1, width + 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cuda_tree.json"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--table", type=Path, help="only print the markdown table of an existing JSON")
    ap.add_argument("--sweep-blocks", action="store_true",
                    help="also time the tree kernel at every block size the planner may choose")
    args = ap.parse_args()
    if args.table:
        rows = json.loads(args.table.read_text())["rows"]
        print("| workload | heads | queries | per-branch decode ms | two-level cascade ms "
              "| tree kernel ms | vs per-branch | vs cascade | auto ms (path) |")
        print("|---|:---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            auto = f"{r['auto_ms']:.4f} ({r['auto_path']})" if "auto_ms" in r else "-"
            print(f"| {r['workload']} | {r['hq']}/{r['hkv']} | {r['queries']} "
                  f"| {r['per_branch_ms']:.4f} | {r['cascade_ms']:.4f} | {r['tree_ms']:.4f} "
                  f"| {r['speedup_vs_per_branch']:.2f}x | {r['speedup_vs_cascade']:.2f}x "
                  f"| {auto} |")
        return 0

    import torch

    from llama_ane.cuda import ops
    from llama_ane.cuda.cascade import SharedPrefixBatch
    from timing import Timer  # benchmarks/timing.py, beside this script
    from llama_ane.cuda.tree import BLOCK_TOKEN_CHOICES, build_tree_plan
    from llama_ane.cuda.tree_batch import TreeBatch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    timer = Timer(args.reps)
    rows = []
    for hq, hkv in HEADS:
        for name, parents, sizes, query_nodes in workloads():
            gen = torch.Generator().manual_seed(len(parents))
            total = sum(sizes)
            n_slots = total + 1024
            cache = torch.randn(n_slots, 2, 1, hkv, D, device="cuda", dtype=torch.float16)
            slots = torch.randperm(n_slots, generator=gen)[:total].tolist()
            node_slots, at = [], 0
            for s in sizes:
                node_slots.append(slots[at:at + s])
                at += s
            nq = len(query_nodes)
            q = torch.randn(nq, hq, D, device="cuda", dtype=torch.float16)

            # per-branch page lists (page size 1: a page is a token): prompt, then ancestors
            paths, suffixes = [], []
            for qn in query_nodes:
                chain, n = [], qn
                while n > 0:
                    chain.append(n)
                    n = parents[n]
                suffix = [s for m in reversed(chain) for s in node_slots[m]]
                suffixes.append(suffix)
                paths.append(node_slots[0] + suffix)

            def csr(lists):
                indptr = torch.tensor([0] + [len(x) for x in lists]).cumsum(0).to(torch.int32)
                flat = torch.tensor([s for x in lists for s in x], dtype=torch.int32)
                return indptr.cuda(), flat.cuda(), torch.ones(len(lists), dtype=torch.int32,
                                                              device="cuda")

            p_indptr, p_indices, p_last = csr(paths)
            s_indptr, s_indices, s_last = csr(suffixes)
            max_len = max(len(p) for p in paths)
            prompt_pages = torch.tensor(node_slots[0], dtype=torch.int32, device="cuda")
            cascade = SharedPrefixBatch(hq, hkv, D, 1, path="cascade")
            cascade.plan(prompt_pages, PROMPT, s_indptr, s_indices, s_last)
            t0 = time.perf_counter()
            plan = build_tree_plan(parents, node_slots, query_nodes, group=hq // hkv,
                                   num_kv_heads=hkv, num_sms=ops.num_sms(q.device), device="cuda")
            plan_ms = 1e3 * (time.perf_counter() - t0)

            def per_branch():
                return ops.batch_decode(q, cache, p_indptr, p_indices, p_last, max_seq_len=max_len)

            rec = dict(workload=name, hq=hq, hkv=hkv, queries=nq, tree_tokens=total,
                       plan_items=plan.n_items, plan_pairs=plan.n_pairs,
                       block_tokens=plan.block_tokens, plan_build_ms=plan_ms)
            rec["per_branch_ms"] = timer.median_ms(per_branch)
            rec["cascade_ms"] = timer.median_ms(lambda: cascade.run(q, cache))
            rec["tree_ms"] = timer.median_ms(lambda: ops.tree_attention(q, cache, plan))
            auto = TreeBatch(parents, node_slots, query_nodes, num_qo_heads=hq,
                             num_kv_heads=hkv, head_dim=D, page_size=1)
            rec["auto_path"] = auto.path
            rec["auto_ms"] = timer.median_ms(lambda: auto.run(q, cache))
            o_tree, _ = ops.tree_attention(q, cache, plan)
            o_dec, _ = per_branch()
            o_cas, _ = cascade.run(q, cache)
            rec["maxdiff_tree_vs_decode"] = (o_tree.float() - o_dec.float()).abs().max().item()
            rec["maxdiff_cascade_vs_decode"] = (o_cas.float() - o_dec.float()).abs().max().item()
            rec["speedup_vs_per_branch"] = rec["per_branch_ms"] / rec["tree_ms"]
            rec["speedup_vs_cascade"] = rec["cascade_ms"] / rec["tree_ms"]
            kv_bytes = total * 2 * hkv * D * 2
            rec["tree_bw_frac"] = kv_bytes / (rec["tree_ms"] * 1e-3) / 3.35e12
            rows.append(rec)
            print(f"{name:<14} H={hq}/{hkv:<2} q={nq:<3} per-branch {rec['per_branch_ms']:.4f} ms"
                  f" | cascade {rec['cascade_ms']:.4f} | tree {rec['tree_ms']:.4f} "
                  f"(x{rec['speedup_vs_per_branch']:.2f} vs per-branch, "
                  f"x{rec['speedup_vs_cascade']:.2f} vs cascade; items {plan.n_items}, "
                  f"block {plan.block_tokens}) | auto {rec['auto_ms']:.4f} ({rec['auto_path']}) "
                  f"maxdiff {rec['maxdiff_tree_vs_decode']:.1e}",
                  flush=True)
            if args.sweep_blocks:
                # the tree kernel at every block size the planner may choose
                rec["tree_ms_by_block"] = {}
                for bt in BLOCK_TOKEN_CHOICES:
                    p = build_tree_plan(parents, node_slots, query_nodes, group=hq // hkv,
                                        num_kv_heads=hkv, block_tokens=bt, device="cuda")
                    rec["tree_ms_by_block"][bt] = timer.median_ms(
                        lambda p=p: ops.tree_attention(q, cache, p))
                print("    block sweep: " + ", ".join(
                    f"{bt}: {ms:.4f} ms ({-(-total // bt)} blocks)"
                    for bt, ms in rec["tree_ms_by_block"].items()), flush=True)
            del cache
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                        torch=torch.__version__, reps=args.reps, rows=rows),
                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
