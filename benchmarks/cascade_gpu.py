"""Shared-prefix batch decode on the GPU: our cascade / decode / auto against FlashInfer 0.7.2.

Grid: prefix {1024, 8192, 32768} x batch {16, 64, 256} x suffix {128, 2048}, heads 32/32 and 32/8,
head_dim 128, page 16, fp16; every path runs on the same cache and page tables in the same process.
Timing: L2 flushed before each call, median of >= 20 (benchmarks/timing.py). Also: plain decode
bandwidth at batch 64 x 4096 tokens (no sharing), a split sweep of the prefix kernel, and checks
that our outputs equal FlashInfer's (through the base-2 LSE adapter for merge_state).

    python benchmarks/cascade_gpu.py --out benchmarks/results/cuda_cascade.json
    python benchmarks/cascade_gpu.py --plot benchmarks/results/cuda_cascade.json   # PNG only, no GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HBM_PEAK = 3.35e12  # H100 SXM datasheet bytes/s
FP16_PEAK = 989e12  # H100 SXM dense fp16 tensor-core FLOP/s (datasheet)
PREFIXES = (1024, 8192, 32768)
BATCHES = (16, 64, 256)
SUFFIXES = (128, 2048)
HEADS = ((32, 32), (32, 8))
D = 128
PAGE = 16


def make_batch(prefix, batch, suffix, hkv, dtype, seed=0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    n_prefix = prefix // PAGE
    n_suffix = -(-suffix // PAGE)
    total = n_prefix + batch * n_suffix
    cache = torch.randn(total, 2, PAGE, hkv, D, device="cuda", dtype=dtype, generator=gen)
    perm = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
    t = dict(
        cache=cache,
        prefix_indices=perm[:n_prefix].contiguous(),
        suffix_indices=perm[n_prefix:].contiguous(),
        suffix_indptr=(torch.arange(batch + 1, device="cuda", dtype=torch.int32) * n_suffix),
        suffix_last=torch.full((batch,), suffix - (n_suffix - 1) * PAGE, dtype=torch.int32,
                               device="cuda"),
    )
    # plain decode: every request lists the shared prefix pages, then its own
    full = torch.cat([t["prefix_indices"].expand(batch, n_prefix),
                      t["suffix_indices"].view(batch, n_suffix)], dim=1)
    t["full_indices"] = full.reshape(-1).contiguous()
    t["full_indptr"] = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * (n_prefix +
                                                                                  n_suffix)
    return t


def traffic(prefix, batch, suffix, hq, hkv, path, n_states=0):
    """(bytes the path reads + writes, attention flops)."""
    tok = 2 * hkv * D * 2
    q_out = 2 * batch * hq * D * 2
    flops = 4.0 * batch * hq * (prefix + suffix) * D
    if path == "decode":
        return batch * (prefix + suffix) * tok + q_out, flops
    states = 2 * batch * n_states * hq * (D + 1) * 4
    return (prefix + batch * suffix) * tok + q_out + states, flops


def run_grid(timer, fi, log):
    import torch

    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    points = []
    for hq, hkv in HEADS:
        for suffix in SUFFIXES:
            for prefix in PREFIXES:
                for batch in BATCHES:
                    t = make_batch(prefix, batch, suffix, hkv, torch.float16)
                    q = torch.randn(batch, hq, D, device="cuda", dtype=torch.float16)
                    plans = {p: planned(t, prefix, hq, hkv, p)
                             for p in ("cascade", "decode", "auto")}
                    cache = t["cache"]
                    rec = dict(prefix=prefix, batch=batch, suffix=suffix, hq=hq, hkv=hkv,
                               auto_path=plans["auto"].path)
                    for p, plan in plans.items():
                        rec[f"ours_{p}_ms"] = timer.median_ms(lambda plan=plan: plan.run(q, cache))
                    o_ours, _ = plans["cascade"].run(q, cache)
                    o_dec, _ = plans["decode"].run(q, cache)
                    rec["cascade_vs_decode_maxdiff"] = (o_ours.float() - o_dec.float()).abs().max().item()
                    if fi is not None:
                        casc = fi.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
                        casc.plan(
                            [torch.tensor([0, batch], dtype=torch.int32, device="cuda"),
                             torch.arange(batch + 1, dtype=torch.int32, device="cuda")],
                            [torch.tensor([0, prefix // PAGE], dtype=torch.int32, device="cuda"),
                             t["suffix_indptr"]],
                            [t["prefix_indices"], t["suffix_indices"]],
                            [torch.tensor([PAGE], dtype=torch.int32, device="cuda"),
                             t["suffix_last"]],
                            hq, hkv, D, PAGE, q_data_type=torch.float16)
                        rec["fi_cascade_ms"] = timer.median_ms(lambda: casc.run(q, cache))
                        o_fi = casc.run(q, cache)
                        rec["ours_vs_fi_maxdiff"] = (o_ours.float() - o_fi.float()).abs().max().item()
                        fi_dec = []
                        for tc in ((False, True) if hq != hkv else (False,)):
                            dec = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD",
                                                                        use_tensor_cores=tc)
                            dec.plan(t["full_indptr"], t["full_indices"], t["suffix_last"], hq,
                                     hkv, D, PAGE, q_data_type=torch.float16)
                            fi_dec.append(timer.median_ms(lambda dec=dec: dec.run(q, cache)))
                        rec["fi_decode_ms"] = min(fi_dec)
                        rec["fi_best_ms"] = min(rec["fi_cascade_ms"], rec["fi_decode_ms"])
                        rec["auto_vs_fi_best"] = rec["fi_best_ms"] / rec["ours_auto_ms"]
                        rec["auto_vs_fi_cascade"] = rec["fi_cascade_ms"] / rec["ours_auto_ms"]
                        rec["auto_vs_fi_decode"] = rec["fi_decode_ms"] / rec["ours_auto_ms"]
                        rec["cascade_vs_fi_cascade"] = rec["fi_cascade_ms"] / rec["ours_cascade_ms"]
                    auto = plans["auto"]
                    n_states = (auto.prefix_splits + auto.suffix_splits) if auto.path == "cascade" \
                        else (auto.decode_splits if auto.decode_splits > 1 else 0)
                    nbytes, flops = traffic(prefix, batch, suffix, hq, hkv, auto.path, n_states)
                    ms = rec["ours_auto_ms"]
                    rec["bytes"] = nbytes
                    rec["flops"] = flops
                    rec["bw_frac"] = nbytes / (ms * 1e-3) / HBM_PEAK
                    unique_bytes, _ = traffic(prefix, batch, suffix, hq, hkv, "cascade", 0)
                    rec["roofline_ms"] = 1e3 * max(unique_bytes / HBM_PEAK, flops / FP16_PEAK)
                    rec["roofline_frac"] = rec["roofline_ms"] / ms
                    points.append(rec)
                    log(format_point(rec))
                    del t, plans, cache, q
                    torch.cuda.empty_cache()
    return points


def format_point(r):
    s = (f"P={r['prefix']:>5} B={r['batch']:>3} S={r['suffix']:>4} H={r['hq']}/{r['hkv']:<2} "
         f"auto={r['ours_auto_ms']:.3f}ms[{r['auto_path'][:3]}] casc={r['ours_cascade_ms']:.3f} "
         f"dec={r['ours_decode_ms']:.3f}")
    if "fi_cascade_ms" in r:
        s += (f" | FI casc={r['fi_cascade_ms']:.3f} dec={r['fi_decode_ms']:.3f} | x{r['auto_vs_fi_cascade']:.2f}"
              f" vs FIc x{r['auto_vs_fi_decode']:.2f} vs FId x{r['auto_vs_fi_best']:.2f} vs best")
    s += f" | bw {100 * r['bw_frac']:.0f}% roof {100 * r['roofline_frac']:.0f}%"
    return s


def run_decode_bandwidth(timer, fi, log):
    """Plain paged decode, batch 64 x 4096 tokens each, nothing shared."""
    import torch

    from llama_ane.cuda import ops

    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    out = []
    for hq, hkv in HEADS:
        batch, length = 64, 4096
        n = length // PAGE
        cache = torch.randn(batch * n, 2, PAGE, hkv, D, device="cuda", dtype=torch.float16)
        indices = torch.randperm(batch * n, device="cuda").to(torch.int32)
        indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * n
        last = torch.full((batch,), PAGE, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, hq, D, device="cuda", dtype=torch.float16)
        ms = timer.median_ms(lambda: ops.batch_decode(q, cache, indptr, indices, last,
                                                      max_seq_len=length))
        nbytes = batch * length * 2 * hkv * D * 2 + 2 * batch * hq * D * 2
        rec = dict(hq=hq, hkv=hkv, batch=batch, length=length, ours_ms=ms, bytes=nbytes,
                   bw_frac=nbytes / (ms * 1e-3) / HBM_PEAK)
        if hq == hkv:  # the tensor-core tile for MHA too (rows 1..15 padding)
            for bn in (64, 128):
                cfg = dict(BLOCK_G=16, BLOCK_N=bn, num_warps=4, num_stages=3)
                o1, lse1 = torch.empty_like(q).unsqueeze(1), torch.empty(
                    batch, 1, hq, device="cuda", dtype=torch.float32)
                t_ms = timer.median_ms(lambda: ops.launch_decode(
                    q, cache, indptr, indices, last, o1, lse1, 0, 1, length, D ** -0.5,
                    config=cfg))
                rec[f"dot_tile_bn{bn}_bw_frac"] = nbytes / (t_ms * 1e-3) / HBM_PEAK
                log(f"decode bandwidth MHA with BLOCK_G=16 BLOCK_N={bn}: {t_ms:.3f} ms = "
                    f"{100 * rec[f'dot_tile_bn{bn}_bw_frac']:.1f}%")
        if fi is not None:
            dec = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=hq != hkv)
            dec.plan(indptr, indices, last, hq, hkv, D, PAGE, q_data_type=torch.float16)
            rec["fi_ms"] = timer.median_ms(lambda: dec.run(q, cache))
            rec["fi_bw_frac"] = nbytes / (rec["fi_ms"] * 1e-3) / HBM_PEAK
        out.append(rec)
        log(f"decode bandwidth H={hq}/{hkv} B=64x4096: ours {ms:.3f} ms = "
            f"{100 * rec['bw_frac']:.1f}% of 3.35 TB/s"
            + (f"; FI {rec['fi_ms']:.3f} ms = {100 * rec['fi_bw_frac']:.1f}%" if fi else ""))
    return out


def planned(t, prefix, hq, hkv, path, **kw):
    """A SharedPrefixBatch (``path``, launch overrides ``kw``) planned for the batch ``t`` of
    :func:`make_batch`."""
    from llama_ane.cuda.cascade import SharedPrefixBatch

    attention = SharedPrefixBatch(hq, hkv, D, PAGE, path=path, **kw)
    attention.plan(t["prefix_indices"], prefix, t["suffix_indptr"], t["suffix_indices"],
                   t["suffix_last"])
    return attention


def run_sweeps(timer, log):
    """The cascade's two schedules at the largest shared prefixes."""
    import torch

    rows = []
    for hq, hkv in HEADS:
        for prefix, batch, suffix in ((32768, 256, 128), (32768, 64, 128), (8192, 256, 128),
                                      (32768, 256, 2048)):
            t = make_batch(prefix, batch, suffix, hkv, torch.float16)
            q = torch.randn(batch, hq, D, device="cuda", dtype=torch.float16)
            for name, cfg in (("sequential", dict(overlap=False)),
                              ("overlap", dict(overlap=True))):
                for splits in (4, 8):
                    plan = planned(t, prefix, hq, hkv, "cascade", config=cfg, prefix_splits=splits)
                    ms = timer.median_ms(lambda: plan.run(q, t["cache"]))
                    rows.append(dict(kind="cascade", hq=hq, hkv=hkv, prefix=prefix, batch=batch,
                                     suffix=suffix, schedule=name, splits=splits, ms=ms))
                    log(f"cascade sweep {prefix}/{batch}/{suffix} {hq}/{hkv} {name} "
                        f"splits={splits}: {ms:.3f} ms")
            del t
            torch.cuda.empty_cache()
    return rows


def check_flashinfer_merge(fi, log):
    """Our merge equals FlashInfer's merge_state once LSEs go through the base-2 adapter."""
    import torch

    from llama_ane.cuda import ops
    from llama_ane.cuda.lse import lse_natural_to_base2

    g = torch.Generator(device="cuda").manual_seed(0)
    va = torch.randn(1000, 32, D, device="cuda", dtype=torch.float16, generator=g)
    vb = torch.randn(1000, 32, D, device="cuda", dtype=torch.float16, generator=g)
    sa = torch.randn(1000, 32, device="cuda", generator=g) * 4
    sb = torch.randn(1000, 32, device="cuda", generator=g) * 4
    o, s = ops.merge_state(va, sa, vb, sb)
    o_fi, s_fi = fi.merge_state(va, lse_natural_to_base2(sa), vb, lse_natural_to_base2(sb))
    res = dict(v_maxdiff=(o.float() - o_fi.float()).abs().max().item(),
               s_maxdiff=(lse_natural_to_base2(s) - s_fi).abs().max().item())
    log(f"merge_state vs FlashInfer (base-2 adapter): {res}")
    return res


def warm_flashinfer(fi, log):
    """Build FlashInfer's JIT modules (minutes on first use) on a tiny problem of each kind."""
    import torch

    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    for hq, hkv in HEADS:
        t0 = time.time()
        t = make_batch(64, 2, 32, hkv, torch.float16)
        q = torch.randn(2, hq, D, device="cuda", dtype=torch.float16)
        casc = fi.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
        casc.plan([torch.tensor([0, 2], dtype=torch.int32, device="cuda"),
                   torch.arange(3, dtype=torch.int32, device="cuda")],
                  [torch.tensor([0, 4], dtype=torch.int32, device="cuda"), t["suffix_indptr"]],
                  [t["prefix_indices"], t["suffix_indices"]],
                  [torch.tensor([PAGE], dtype=torch.int32, device="cuda"), t["suffix_last"]],
                  hq, hkv, D, PAGE, q_data_type=torch.float16)
        casc.run(q, t["cache"])
        for tc in ((False, True) if hq != hkv else (False,)):
            dec = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            dec.plan(t["full_indptr"], t["full_indices"], t["suffix_last"], hq, hkv, D, PAGE,
                     q_data_type=torch.float16)
            dec.run(q, t["cache"])
        torch.cuda.synchronize()
        log(f"FlashInfer modules for heads {hq}/{hkv} ready in {time.time() - t0:.0f} s")


def table(path: Path) -> str:
    """Markdown table of a result JSON (what docs/cuda.md shows)."""
    data = json.loads(path.read_text())
    lines = ["| prefix | batch | suffix | heads | auto ms (path) | ours cascade | ours decode "
             "| FI cascade | FI decode | vs FI cascade | vs FI decode | vs best FI | BW | roofline |",
             "|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in data["points"]:
        lines.append(
            f"| {p['prefix']} | {p['batch']} | {p['suffix']} | {p['hq']}/{p['hkv']} "
            f"| {p['ours_auto_ms']:.3f} ({p['auto_path']}) | {p['ours_cascade_ms']:.3f} "
            f"| {p['ours_decode_ms']:.3f} | {p['fi_cascade_ms']:.3f} | {p['fi_decode_ms']:.3f} "
            f"| {p['auto_vs_fi_cascade']:.2f}x | {p['auto_vs_fi_decode']:.2f}x "
            f"| {p['auto_vs_fi_best']:.2f}x | {100 * p['bw_frac']:.0f}% "
            f"| {100 * p['roofline_frac']:.0f}% |")
    bw = data["decode_bandwidth"]
    lines.append("")
    lines.append("| plain decode, 64 x 4096 tokens, no sharing | ours ms | % of 3.35 TB/s "
                 "| FlashInfer ms | FlashInfer % |")
    lines.append("|---|---:|---:|---:|---:|")
    for r in bw:
        lines.append(f"| heads {r['hq']}/{r['hkv']} | {r['ours_ms']:.3f} | {100 * r['bw_frac']:.1f}% "
                     f"| {r['fi_ms']:.3f} | {100 * r['fi_bw_frac']:.1f}% |")
    return "\n".join(lines)


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    pts = data["points"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 8), sharey=True)
    for ax, ((hq, hkv), suffix) in zip(axes.flat, [(h, s) for h in HEADS for s in SUFFIXES]):
        sel = [p for p in pts if p["hq"] == hq and p["hkv"] == hkv and p["suffix"] == suffix]
        labels = [f"{p['prefix'] // 1024}k/{p['batch']}" for p in sel]
        x = range(len(sel))
        for key, label, style in (("ours_auto_ms", "ours auto", "o-"),
                                  ("ours_cascade_ms", "ours cascade", "s--"),
                                  ("fi_cascade_ms", "FlashInfer cascade", "^-"),
                                  ("fi_decode_ms", "FlashInfer decode", "v:")):
            if sel and key in sel[0]:
                ax.plot(list(x), [p[key] for p in sel], style, label=label)
        ax.set_yscale("log")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=45, fontsize=8)
        ax.set_title(f"heads {hq}/{hkv}, suffix {suffix}")
        ax.set_xlabel("prefix / batch")
        ax.set_ylabel("ms (median, L2 flushed)")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle(f"Shared-prefix batch decode, D=128, page 16, fp16 — {data.get('device', '')}")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cuda_cascade.json"))
    ap.add_argument("--plot", type=Path, help="only draw the PNG of an existing JSON")
    ap.add_argument("--table", type=Path, help="only print the markdown table of an existing JSON")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--warm-only", action="store_true",
                    help="only JIT-compile FlashInfer's modules for the grid's shapes, then exit")
    args = ap.parse_args()
    if args.plot:
        print(plot(args.plot))
        return 0
    if args.table:
        print(table(args.table))
        return 0

    import torch

    from timing import Timer  # benchmarks/timing.py, beside this script

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    fi = None
    if not args.no_flashinfer:
        import flashinfer as fi  # noqa: F811

    def log(msg):
        print(msg, flush=True)

    if args.warm_only:
        warm_flashinfer(fi, log)
        return 0
    timer = Timer(args.reps)
    started = time.time()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  flashinfer=getattr(fi, "__version__", None), reps=args.reps, dtype="float16",
                  head_dim=D, page_size=PAGE, hbm_peak=HBM_PEAK, fp16_peak=FP16_PEAK)
    import triton

    result["triton"] = triton.__version__
    if fi is not None:
        result["merge_check"] = check_flashinfer_merge(fi, log)
    result["decode_bandwidth"] = run_decode_bandwidth(timer, fi, log)
    if not args.skip_sweep:
        result["sweeps"] = run_sweeps(timer, log)
    result["points"] = run_grid(timer, fi, log)
    result["seconds"] = time.time() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if fi is not None:
        worst = min(p["auto_vs_fi_best"] for p in result["points"])
        key = [p for p in result["points"] if (p["prefix"], p["batch"], p["suffix"], p["hq"],
                                               p["hkv"]) == (32768, 256, 128, 32, 32)]
        log(f"worst auto vs best FlashInfer: x{worst:.3f} (>= 0.952 means within 5%)")
        if key:
            log(f"32768/256/128 32/32: ours cascade {key[0]['ours_cascade_ms']:.3f} ms, FI cascade "
                f"{key[0]['fi_cascade_ms']:.3f} ms: x{key[0]['cascade_vs_fi_cascade']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
