"""Shared-prefix batch decode on the GPU: our cascade / decode / auto against FlashInfer 0.7.2.

Grid: prefix {1024, 8192, 32768} x batch {16, 64, 256} x suffix {128, 2048}, heads 32/32 and 32/8,
head_dim 128, page 16, fp16; every path runs on the same cache and page tables in the same process.
Timing: L2 flushed before each call, median of >= 20 (benchmarks/timing.py). Also: plain decode
bandwidth at batch 64 x 4096 tokens (no sharing), a split sweep of the prefix kernel, and checks
that our outputs equal FlashInfer's (through the base-2 LSE adapter for merge_state).

The roofline is the GPU's own: its datasheet peaks when the name is known (H100 SXM, PCIe,
NVL; H200), else the HBM bandwidth of a large device-to-device copy and the rate of an fp16
matrix product, both measured in the same run and recorded in the JSON beside the datasheet
values (``roofline``).

``--gqa`` runs the GQA study instead of the grid: heads 32/8, batch 256, suffix 128, prefixes
8192-65536, on shuffled pages and with the prefix on consecutive pages (the engine's layout):
the library's cascade, its schedules and prefix kernels, each kernel alone, and a torch profile
of the launches (``--profile``). ``--gqa-once`` runs each study variant once, untimed (for ncu).

    python benchmarks/cascade_gpu.py --out benchmarks/results/cuda_cascade.json
    python benchmarks/cascade_gpu.py --gqa --profile --out benchmarks/results/cuda_gqa.json
    python benchmarks/cascade_gpu.py --plot benchmarks/results/cuda_cascade.json   # PNG only, no GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# (name fragment, HBM bytes/s, dense fp16 tensor-core FLOP/s) from the vendor's datasheets; the
# first fragment that the device name contains wins
DATASHEET = (("H200", 4.8e12, 989e12), ("H100 NVL", 3.9e12, 835e12),
             ("H100 PCIe", 2.0e12, 756e12), ("H100", 3.35e12, 989e12))
# set by main() from device_roofline(): the peaks every percentage of this run divides by
HBM_PEAK = 3.35e12
FP16_PEAK = 989e12
PREFIXES = (1024, 8192, 32768)
BATCHES = (16, 64, 256)
SUFFIXES = (128, 2048)
HEADS = ((32, 32), (32, 8))
D = 128
PAGE = 16


def datasheet_peaks(name: str):
    """(HBM bytes/s, fp16 FLOP/s) of a known GPU name, else None."""
    for fragment, hbm, fp16 in DATASHEET:
        if fragment in name:
            return hbm, fp16
    return None


def device_roofline(log) -> dict:
    """The peaks this run divides by: the datasheet's for a known GPU, else measured; both kinds
    are recorded. Copy bandwidth counts the bytes read plus the bytes written."""
    import torch

    name = torch.cuda.get_device_name()
    n = 2 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    copy_bw = 2 * n / sorted(times[2:])[len(times[2:]) // 2]
    del src, dst
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.float16)
    y = torch.randn(m, m, device="cuda", dtype=torch.float16)
    times = []
    for _ in range(8):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        x @ y
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    mm_rate = 2 * m ** 3 / sorted(times[2:])[len(times[2:]) // 2]
    del x, y
    torch.cuda.empty_cache()
    sheet = datasheet_peaks(name)
    rec = dict(device=name, hbm_measured_copy=copy_bw, fp16_measured_matmul=mm_rate,
               hbm_datasheet=sheet[0] if sheet else None,
               fp16_datasheet=sheet[1] if sheet else None)
    if sheet:
        rec.update(hbm_used=sheet[0], fp16_used=sheet[1], source="datasheet")
    else:
        rec.update(hbm_used=copy_bw, fp16_used=mm_rate,
                   source="measured (device name not in the datasheet table)")
    log(f"roofline of {name}: {rec['source']}: HBM {rec['hbm_used'] / 1e12:.2f} TB/s, fp16 "
        f"{rec['fp16_used'] / 1e12:.0f} TFLOP/s (measured here: copy {copy_bw / 1e12:.2f} TB/s, "
        f"fp16 {m}^3 matmul {mm_rate / 1e12:.0f} TFLOP/s)")
    return rec


def make_batch(prefix, batch, suffix, hkv, dtype, seed=0, ordered_prefix=False):
    """A random cache with one shared prefix and ``batch`` suffixes on shuffled pages; with
    ``ordered_prefix`` the prefix takes the cache's first pages in order (the engine's layout)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    n_prefix = prefix // PAGE
    n_suffix = -(-suffix // PAGE)
    total = n_prefix + batch * n_suffix
    cache = torch.randn(total, 2, PAGE, hkv, D, device="cuda", dtype=dtype, generator=gen)
    perm = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
    if ordered_prefix:
        perm = torch.cat([torch.arange(n_prefix, device="cuda", dtype=torch.int32),
                          n_prefix + torch.randperm(total - n_prefix, device="cuda",
                                                    generator=gen).to(torch.int32)])
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
            f"{100 * rec['bw_frac']:.1f}% of {HBM_PEAK / 1e12:.2f} TB/s"
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


# -- the GQA study -------------------------------------------------------------------------------

GQA_PREFIXES = (8192, 16384, 32768, 65536)
GQA_SHAPE = dict(batch=256, suffix=128, hq=32, hkv=8)
# prefix tiles (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]) and suffix decode configs
TMA_S3 = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
TMA_S2 = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
TMA_S4 = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)
TMA_W8 = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, maxnreg=128)
PAGED_128 = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
PAGED_64S2 = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
DEC_64S3 = dict(BLOCK_G=16, BLOCK_N=64, num_warps=4, num_stages=3)
DEC_64S2 = dict(BLOCK_G=16, BLOCK_N=64, num_warps=4, num_stages=2)
DEC_128S3 = dict(BLOCK_G=16, BLOCK_N=128, num_warps=4, num_stages=3)


def gqa_variants(layout, wide=False):
    """(name, SharedPrefixBatch keyword overrides) of the study; ``library`` is the default.
    ``wide`` adds the tiles and schedules that lost in the first study run (cuda_notes.md)."""
    v = [("library", {}),
         ("paged seq", dict(config={"prefix_kernel": "paged", "overlap": False})),
         ("paged overlap (d128)", dict(config={"prefix_kernel": "paged", "overlap": True})),
         ("fused paged64", dict(config={"prefix_kernel": "paged", "fused": True}))]
    if wide:
        v.append(("paged64s2 overlap d64s3", dict(config={
            "prefix_kernel": "paged", "overlap": True, "prefix": PAGED_64S2,
            "decode": DEC_64S3})))
    if layout == "ordered":
        v += [("tma s3 seq", dict(config={"prefix_kernel": "ordered", "overlap": False,
                                          "prefix": TMA_S3})),
              ("tma s3 overlap d128s3", dict(config={"prefix_kernel": "ordered", "overlap": True,
                                                     "prefix": TMA_S3, "decode": DEC_128S3}))]
        for splits in (None, 3, 4):
            v.append(("fused tma s3" + (f" splits{splits}" if splits else ""),
                      dict(config={"prefix_kernel": "ordered", "fused": True, "prefix": TMA_S3},
                           prefix_splits=splits)))
        v.append(("fused tma s2", dict(config={"prefix_kernel": "ordered", "fused": True,
                                               "prefix": TMA_S2})))
    if layout == "ordered":
        # the fused cascade's suffix loop: key block, pipeline depth, and which part goes first
        for sbn, sst, order in ((64, 3, 0), (64, 4, 0), (64, 5, 0), (128, 3, 0), (32, 6, 0),
                                (128, 2, 1), (128, 2, 2)):
            if not wide and (sbn, order) != (128, 1):
                continue
            tile = dict(TMA_S3, suffix_block_n=sbn, suffix_stages=sst, order=order)
            v.append((f"fused tma s3 sbn{sbn} sst{sst} order{order}",
                      dict(config={"prefix_kernel": "ordered", "fused": True, "prefix": tile})))
    if layout == "ordered" and wide:
        for pre_name, pre in (("tma s2", TMA_S2), ("tma s4", TMA_S4), ("tma w8 r128", TMA_W8)):
            v.append((f"{pre_name} seq", dict(config={"prefix_kernel": "ordered",
                                                      "overlap": False, "prefix": pre})))
        for pre_name, pre, dec_name, dec in (("tma s3", TMA_S3, "d64s3", DEC_64S3),
                                             ("tma s2", TMA_S2, "d64s3", DEC_64S3),
                                             ("tma s2", TMA_S2, "d64s2", DEC_64S2),
                                             ("tma w8 r128", TMA_W8, "d64s2", DEC_64S2)):
            v.append((f"{pre_name} overlap {dec_name}",
                      dict(config={"prefix_kernel": "ordered", "overlap": True, "prefix": pre,
                                   "decode": dec})))
        for splits in (3, 4):
            v.append((f"tma s2 overlap d64s3 splits{splits}",
                      dict(config={"prefix_kernel": "ordered", "overlap": True,
                                   "prefix": TMA_S2, "decode": DEC_64S3},
                           prefix_splits=splits)))
    return v


def gqa_roofline(prefix):
    """(roofline ms, unique bytes, flops) of a GQA study point on this run's peaks."""
    g = GQA_SHAPE
    nbytes, flops = traffic(prefix, g["batch"], g["suffix"], g["hq"], g["hkv"], "cascade", 0)
    return 1e3 * max(nbytes / HBM_PEAK, flops / FP16_PEAK), nbytes, flops


def gqa_point(timer, prefix, layout, log, variants=None, once=False, wide=False):
    """Every study variant at one prefix and layout: time, check, and the kernels alone."""
    import torch

    from llama_ane.cuda import ops

    g = GQA_SHAPE
    t = make_batch(prefix, g["batch"], g["suffix"], g["hkv"], torch.float16, seed=prefix,
                   ordered_prefix=layout == "ordered")
    cache = t["cache"]
    q = torch.randn(g["batch"], g["hq"], D, device="cuda", dtype=torch.float16)
    ref_o, ref_lse = planned(t, prefix, g["hq"], g["hkv"], "decode").run(q, cache)
    roof_ms, nbytes, flops = gqa_roofline(prefix)
    rows = []
    for name, kw in gqa_variants(layout, wide):
        if variants and name not in variants:
            continue
        try:
            plan = planned(t, prefix, g["hq"], g["hkv"], "auto" if name == "library" else
                           "cascade", **kw)
            o, lse = plan.run(q, cache)
            if once:
                torch.cuda.synchronize()
                log(f"once: {prefix} {layout} {name}")
                continue
            diff = max((o.float() - ref_o.float()).abs().max().item(),
                       (lse - ref_lse).abs().max().item())
            ms = timer.median_ms(lambda plan=plan: plan.run(q, cache))
        except Exception as e:  # a variant that fails to compile or launch is reported
            log(f"{prefix:>6} {layout:8s} {name:34s} FAILED: {type(e).__name__}: {e}")
            rows.append(dict(prefix=prefix, layout=layout, variant=name, error=repr(e)))
            continue
        rec = dict(prefix=prefix, layout=layout, variant=name, ms=ms, path=plan.path,
                   roofline_ms=roof_ms, roofline_frac=roof_ms / ms, max_diff_vs_decode=diff,
                   ok=bool(diff < 4e-3 and torch.isfinite(o).all().item()),
                   overlap=getattr(plan, "overlap", None), fused=getattr(plan, "fused", None),
                   prefix_kernel="ordered" if getattr(plan, "prefix_page0", None) is not None
                   else "paged", prefix_splits=getattr(plan, "prefix_splits", None),
                   suffix_splits=getattr(plan, "suffix_splits", None))
        if plan.path == "cascade" and not plan.fused:
            cfg = plan.config or {}
            pre_cfg, dec_cfg = cfg.get("prefix"), cfg.get("decode")
            if plan.overlap and dec_cfg is None:
                dec_cfg = dict(ops.decode_config(g["hq"] // g["hkv"]), BLOCK_N=128)
            rec["prefix_alone_ms"] = timer.median_ms(
                lambda: plan._launch_prefix(q, cache, pre_cfg))
            rec["suffix_alone_ms"] = timer.median_ms(lambda: ops.launch_decode(
                q, cache, *plan.suffix, plan.o_buf, plan.lse_buf, plan.prefix_splits,
                plan.suffix_splits, plan.suffix_chunk, plan.sm_scale, dec_cfg))
            pre_flops = 4.0 * g["batch"] * g["hq"] * prefix * D
            rec["prefix_tflops"] = pre_flops / rec["prefix_alone_ms"] / 1e9
            rec["suffix_tb_s"] = g["batch"] * g["suffix"] * 2 * g["hkv"] * D * 2 \
                / rec["suffix_alone_ms"] / 1e9
            # the share of the shorter kernel hidden behind the longer one
            lo = min(rec["prefix_alone_ms"], rec["suffix_alone_ms"])
            hidden = rec["prefix_alone_ms"] + rec["suffix_alone_ms"] - ms
            rec["hidden_frac"] = hidden / lo if lo > 0 else 0.0
        rows.append(rec)
        log(f"{prefix:>6} {layout:8s} {name:34s} {ms:7.4f} ms  roof {100 * rec['roofline_frac']:4.0f}%"
            f"  ok={rec['ok']} diff {diff:.1e}  {rec['prefix_kernel']}/{rec['prefix_splits']}"
            + (f"  prefix {rec['prefix_alone_ms']:.4f} ({rec['prefix_tflops']:.0f} TF/s) "
               f"suffix {rec['suffix_alone_ms']:.4f} ({rec['suffix_tb_s']:.2f} TB/s) "
               f"hidden {100 * rec['hidden_frac']:.0f}%" if "prefix_alone_ms" in rec else ""))
    del t, cache
    torch.cuda.empty_cache()
    return rows


def gqa_profile(prefix, layout, variant_names, log, reps=5):
    """torch.profiler over ``reps`` runs of each variant: every kernel's mean time and the
    span of one run (first kernel start to last kernel end), which shows their overlap."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    g = GQA_SHAPE
    t = make_batch(prefix, g["batch"], g["suffix"], g["hkv"], torch.float16, seed=prefix,
                   ordered_prefix=layout == "ordered")
    cache = t["cache"]
    q = torch.randn(g["batch"], g["hq"], D, device="cuda", dtype=torch.float16)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    out = []
    variants = dict(gqa_variants(layout, wide=True))
    for name in variant_names:
        if name not in variants:
            continue
        plan = planned(t, prefix, g["hq"], g["hkv"], "auto" if name == "library" else "cascade",
                       **variants[name])
        plan.run(q, cache)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                flush.zero_()
                torch.cuda._sleep(1_500_000)
                plan.run(q, cache)
            torch.cuda.synchronize()
        ours = ("prefix_kernel", "decode_kernel", "merge_states_kernel", "fused_cascade")
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and any(k in e.name for k in ours)]
        kernels.sort(key=lambda e: e.time_range.start)
        per_run = len(kernels) // reps if reps else 0
        last = kernels[-per_run:] if per_run else []
        t0 = last[0].time_range.start if last else 0
        timeline = [dict(kernel=e.name[:40], start_us=e.time_range.start - t0,
                         us=e.time_range.end - e.time_range.start) for e in last]
        span = max(e.time_range.end for e in last) - t0 if last else 0
        by_name = {}
        for e in kernels:
            by_name.setdefault(e.name[:40], []).append(e.time_range.end - e.time_range.start)
        rec = dict(prefix=prefix, layout=layout, variant=name, span_us=span, timeline=timeline,
                   mean_us={k: sum(v) / len(v) for k, v in by_name.items()})
        out.append(rec)
        log(f"profile {prefix} {layout} {name}: span {span:.1f} us; " + "; ".join(
            f"{x['kernel']} @{x['start_us']:.1f} +{x['us']:.1f}" for x in timeline))
    del t, cache, flush
    torch.cuda.empty_cache()
    return out


def run_gqa(timer, log, args):
    rows, profiles = [], []
    for prefix in args.gqa_prefixes:
        for layout in ("shuffled", "ordered"):
            rows += gqa_point(timer, prefix, layout, log, args.variants, once=args.gqa_once,
                              wide=args.wide)
    if args.profile and not args.gqa_once:
        best = {}
        for r in rows:
            if "ms" in r and r["ok"]:
                k = (r["prefix"], r["layout"])
                if k not in best or r["ms"] < best[k]["ms"]:
                    best[k] = r
        for (prefix, layout), r in sorted(best.items()):
            if prefix in (8192, 32768):
                names = ["library", "paged seq", "paged overlap (d128)", "tma s3 seq",
                         r["variant"]]
                profiles += gqa_profile(prefix, layout, list(dict.fromkeys(names)), log)
    summary = []
    for prefix in args.gqa_prefixes:
        for layout in ("shuffled", "ordered"):
            sel = [r for r in rows if r["prefix"] == prefix and r["layout"] == layout
                   and "ms" in r]
            if not sel:
                continue
            lib = next((r for r in sel if r["variant"] == "library"), None)
            old = next((r for r in sel if r["variant"] == "paged overlap (d128)"), None)
            best = min((r for r in sel if r["ok"]), key=lambda r: r["ms"], default=None)
            summary.append(dict(prefix=prefix, layout=layout, roofline_ms=sel[0]["roofline_ms"],
                                library_ms=lib and lib["ms"],
                                library_frac=lib and lib["roofline_frac"],
                                before_ms=old and old["ms"],
                                best_variant=best and best["variant"],
                                best_ms=best and best["ms"],
                                best_frac=best and best["roofline_frac"]))
    return dict(points=rows, profiles=profiles, summary=summary)


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
    lines.append(f"| plain decode, 64 x 4096 tokens, no sharing | ours ms "
                 f"| % of {data.get('hbm_peak', 3.35e12) / 1e12:.2f} TB/s "
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
    ap.add_argument("--gqa", action="store_true", help="the GQA study instead of the grid")
    ap.add_argument("--gqa-once", action="store_true",
                    help="run each GQA study variant once, untimed (for ncu)")
    ap.add_argument("--gqa-prefixes", type=int, nargs="+", default=list(GQA_PREFIXES))
    ap.add_argument("--variants", nargs="*", help="only these GQA study variants")
    ap.add_argument("--wide", action="store_true",
                    help="with --gqa: also the variants that lost in the first study run")
    ap.add_argument("--profile", action="store_true",
                    help="with --gqa: torch profiles of the library and the best variant")
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
    global HBM_PEAK, FP16_PEAK
    timer = Timer(args.reps)
    started = time.time()
    if args.gqa_once:
        return 0 if run_gqa(timer, log, args) else 1
    roof = device_roofline(log)
    HBM_PEAK, FP16_PEAK = roof["hbm_used"], roof["fp16_used"]
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  flashinfer=getattr(fi, "__version__", None), reps=args.reps, dtype="float16",
                  head_dim=D, page_size=PAGE, hbm_peak=HBM_PEAK, fp16_peak=FP16_PEAK,
                  roofline=roof, command=" ".join(sys.argv))
    import triton

    result["triton"] = triton.__version__
    if args.gqa:
        result["gqa"] = run_gqa(timer, log, args)
        result["seconds"] = time.time() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        def ms(x):
            return "-" if x is None else f"{x:.4f} ms"

        for r in result["gqa"]["summary"]:
            log(f"GQA 32/8 B=256 S=128 prefix {r['prefix']:>6} {r['layout']:8s}: roofline "
                f"{ms(r['roofline_ms'])}; before (paged overlap) {ms(r['before_ms'])}; library "
                f"{ms(r['library_ms'])}" + (f" = {100 * r['library_frac']:.0f}%"
                                            if r["library_frac"] else "")
                + f"; best {r['best_variant']} {ms(r['best_ms'])} = {100 * r['best_frac']:.0f}%")
        return 0
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
