"""Tuning runs for the two-level cascade at its key point: prefix 32768, 256 requests with 128
suffix tokens each, heads 32/32 and 32/8, D=128, page 16, all in one process.

Prefix section: variants of one simplified shared-prefix program (whole key blocks only, the same paged
gathers and online softmax as ``llama_ane.cuda.kernels._prefix_program``) against the library's
kernel. Variants:
  exp16   exponentials as packed half pairs (``ex2.approx.f16x2``: two per MUFU instruction, the
          P tile is in half precision for the P.V product anyway); row sums stay fp32
  pipe    the next key block's scores are issued before this block's softmax (FA3's
          intra-warpgroup overlap, written out by hand)
  tiles   BLOCK_N 64 / 128, 4 / 8 warps, 2-4 stages

Suffix section: the paged decode over the suffixes alone under several launch configurations
(bandwidth of the bytes read), and the whole cascade with the prefix on a side stream
("overlap", three launches) or before a decode that merges its states ("sequential", two).

    python benchmarks/cascade_tuning_gpu.py > benchmarks/results/cuda_cascade_tuning.log
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from llama_ane.cuda.kernels import (_load_kv, _online_softmax_step, _page_rows, _prefix_row_tile,
                                    _store_state, _whole_page_rows)

PREFIX, BATCH, D, PAGE = 32768, 256, 128, 16


@triton.jit
def _exp2_half(x):
    """2^x of a half-precision tensor, two elements per instruction."""
    if x.dtype == tl.float16:
        return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x],
                                         dtype=tl.float16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.bf16x2 $0, $1;", "=r,r", [x],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _softmax_block(s, m_i, l_i, acc, v, sm_scale_log2, EXP16: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1) * sm_scale_log2)
    alpha = tl.exp2(m_i - m_new)
    x = s * sm_scale_log2 - m_new[:, None]
    if EXP16:
        p = _exp2_half(x.to(v.dtype))
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
    else:
        pf = tl.exp2(x)
        l_i = l_i * alpha + tl.sum(pf, 1)
        p = pf.to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(p, v)
    return m_new, l_i, acc


@triton.jit
def prefix_variant_kernel(
    q_ptr, kv_ptr, indices_ptr, n_rows, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_page, stride_kv, stride_tok,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
    sm_scale_log2, chunk_len,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXP16: tl.constexpr, PIPE: tl.constexpr,
):
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    r_mask, b, heads, q = _prefix_row_tile(q_ptr, tl.program_id(0), kvh, n_rows, stride_qb,
                                           stride_qh, GROUP, BLOCK_M, HEAD_DIM)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    start = split * chunk_len
    end = start + chunk_len
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_head = kv_ptr + kvh * HEAD_DIM
    if PIPE:
        krow = _whole_page_rows(indices_ptr, start + offs_n, PAGE_SIZE, stride_page, stride_tok)
        s = tl.dot(q, tl.trans(tl.load(kv_head + krow[:, None] + offs_d[None, :])))
        for n0 in range(start, end, BLOCK_N):
            krow = _whole_page_rows(indices_ptr, n0 + offs_n, PAGE_SIZE, stride_page, stride_tok)
            v = tl.load(kv_head + stride_kv + krow[:, None] + offs_d[None, :])
            # the last iteration recomputes its own block instead of reading past the chunk
            krow1 = _whole_page_rows(indices_ptr, tl.minimum(n0 + BLOCK_N, end - BLOCK_N) + offs_n,
                                     PAGE_SIZE, stride_page, stride_tok)
            s_next = tl.dot(q, tl.trans(tl.load(kv_head + krow1[:, None] + offs_d[None, :])))
            m_i, l_i, acc = _softmax_block(s, m_i, l_i, acc, v, sm_scale_log2, EXP16)
            s = s_next
    else:
        for n0 in range(start, end, BLOCK_N):
            krow = _whole_page_rows(indices_ptr, n0 + offs_n, PAGE_SIZE, stride_page, stride_tok)
            k = tl.load(kv_head + krow[:, None] + offs_d[None, :])
            v = tl.load(kv_head + stride_kv + krow[:, None] + offs_d[None, :])
            s = tl.dot(q, tl.trans(k))
            m_i, l_i, acc = _softmax_block(s, m_i, l_i, acc, v, sm_scale_log2, EXP16)
    o = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    o_ptrs = o_ptr + b[:, None] * stride_ob + split * stride_os + heads[:, None] * stride_oh \
        + offs_d[None, :]
    tl.store(o_ptrs, o, mask=r_mask[:, None])
    tl.store(lse_ptr + b * stride_lb + split * stride_ls + heads, lse, mask=r_mask)


@triton.jit
def multi_request_decode_kernel(
    q_ptr, kv_ptr, indptr_ptr, indices_ptr, last_len_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_page, stride_kv, stride_tok,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
    state_offset, sm_scale_log2, batch, n_blocks,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, REQS: tl.constexpr,
):
    """Paged decode of ``REQS`` short requests per program in one flat, software-pipelined loop
    over (request, key block): the page-table lookups of the next request are in flight while
    this one is computed. ``n_blocks`` key blocks per request (the longest request's count)."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    kv_head = kv_ptr + kvh * HEAD_DIM
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for it in range(0, REQS * n_blocks):
        r = it // n_blocks
        blk = it - r * n_blocks
        b = pid * REQS + r
        valid = b < batch
        bb = tl.minimum(b, batch - 1)
        page_start = tl.load(indptr_ptr + bb)
        page_end = tl.load(indptr_ptr + bb + 1)
        last_len = tl.load(last_len_ptr + bb)
        seq_len = tl.where(valid, tl.maximum((page_end - page_start - 1) * PAGE_SIZE + last_len, 0),
                           0)
        tok = blk * BLOCK_N + offs_n
        n_mask = tok < seq_len
        rows = _page_rows(indices_ptr + page_start, tok, n_mask, PAGE_SIZE, stride_page, stride_tok)
        k, v = _load_kv(kv_head, rows, offs_d, stride_kv, n_mask)
        q = tl.load(q_ptr + bb * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None], other=0.0)
        first = blk == 0
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        s = tl.where(n_mask[None, :], tl.dot(q, tl.trans(k)) * sm_scale_log2, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v)
        o_ptrs = o_ptr + bb * stride_ob + state_offset * stride_os + heads[:, None] * stride_oh \
            + offs_d[None, :]
        lse_ptrs = lse_ptr + bb * stride_lb + state_offset * stride_ls + heads
        _store_state(o_ptrs, lse_ptrs, acc, m_i, l_i, g_mask & valid & (blk == n_blocks - 1))


def prefix_section(timer, log) -> None:
    from llama_ane.cuda import ops
    from llama_ane.cuda.lse import LOG2E

    for hq, hkv in ((32, 32), (32, 8)):
        for dtype in (torch.float16, torch.bfloat16):
            g = torch.Generator(device="cuda").manual_seed(0)
            n_pages = PREFIX // PAGE
            cache = torch.randn(n_pages, 2, PAGE, hkv, D, device="cuda", dtype=dtype, generator=g)
            idx = torch.randperm(n_pages, device="cuda", generator=g).to(torch.int32)
            q = torch.randn(BATCH, hq, D, device="cuda", dtype=dtype, generator=g)
            ref, ref_lse = ops.shared_prefix_attention(q, cache, idx, PREFIX)
            group = hq // hkv
            n_rows = BATCH * group
            splits = 4
            chunk = PREFIX // splits
            o_buf = torch.empty(BATCH, splits, hq, D, device="cuda", dtype=torch.float32)
            lse_buf = torch.empty(BATCH, splits, hq, device="cuda", dtype=torch.float32)
            lib_ms = timer.median_ms(lambda: ops.launch_shared_prefix(
                q, cache, idx, PREFIX, o_buf, lse_buf, 0, splits, chunk, D ** -0.5))
            flops = 4.0 * BATCH * hq * PREFIX * D
            k = ops.launch_shared_prefix(q, cache, idx, PREFIX, o_buf, lse_buf, 0, splits, chunk,
                                         D ** -0.5)
            log(f"heads {hq}/{hkv} {str(dtype)[6:]}: library kernel {lib_ms:.4f} ms "
                f"({flops / lib_ms / 1e9:.0f} TFLOP/s) [{k.n_regs} regs, {k.n_spills} spills, "
                f"{k.metadata.shared} B smem]")
            if dtype == torch.bfloat16 and hkv != hq:
                continue
            for exp16, pipe, bm, bn, warps, stages in (
                    (0, 0, 128, 64, 4, 3), (1, 0, 128, 64, 4, 3), (1, 0, 128, 64, 4, 2),
                    (1, 0, 128, 64, 4, 4), (1, 0, 128, 64, 8, 3), (0, 0, 128, 128, 8, 2),
                    (1, 0, 128, 128, 8, 2), (1, 0, 128, 128, 8, 3), (0, 1, 128, 64, 8, 2),
                    (1, 1, 128, 64, 8, 2), (1, 1, 128, 64, 8, 3), (1, 1, 128, 64, 4, 2),
                    (1, 0, 256, 64, 8, 2), (1, 0, 256, 64, 8, 3), (0, 0, 128, 64, 4, 2),
                    (0, 0, 128, 64, 4, 4), (0, 0, 64, 64, 4, 2), (0, 0, 64, 64, 4, 3),
                    (0, 0, 64, 128, 4, 2)):
                if dtype == torch.bfloat16 and not exp16:
                    continue
                name = f"exp16={exp16} pipe={pipe} BM={bm} BN={bn} warps={warps} stages={stages}"

                def launch():
                    return prefix_variant_kernel[(triton.cdiv(n_rows, bm), hkv, splits)](
                        q, cache, idx, n_rows, o_buf, lse_buf,
                        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
                        cache.stride(2), o_buf.stride(0), o_buf.stride(1), o_buf.stride(2),
                        lse_buf.stride(0), lse_buf.stride(1), D ** -0.5 * LOG2E, chunk,
                        GROUP=group, HEAD_DIM=D, PAGE_SIZE=PAGE, BLOCK_M=bm, BLOCK_N=bn,
                        EXP16=exp16, PIPE=pipe, num_warps=warps, num_stages=stages)

                try:
                    k = launch()
                    name += f" [{k.n_regs} regs, {k.n_spills} spills, {k.metadata.shared} B smem]"
                    out, lse = ops.merge_states(o_buf, lse_buf)
                    err = (out.float() - ref.float()).abs().max().item()
                    lerr = (lse - ref_lse).abs().max().item()
                    ms = timer.median_ms(launch)
                except Exception as exc:  # a variant that does not compile is reported, not fatal
                    log(f"  {name}: failed: {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                log(f"  {name}: {ms:.4f} ms = {lib_ms / ms:.3f}x library "
                    f"({flops / ms / 1e9:.0f} TFLOP/s), max |o diff| {err:.2e}, |lse diff| {lerr:.2e}")
            torch.cuda.empty_cache()


SUFFIX = 128
HBM_PEAK = 3.35e12
# (BLOCK_G, BLOCK_N, num_warps, num_stages); BLOCK_G 1 is the MHA-only scalar path
DECODE_CONFIGS = ((16, 64, 4, 3), (16, 128, 4, 3), (16, 128, 4, 2), (16, 32, 4, 3),
                  (16, 64, 2, 3), (16, 128, 8, 2), (1, 64, 4, 3), (1, 128, 4, 2), (1, 128, 2, 2))


def suffix_section(timer, log) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from cascade_gpu import make_batch, planned

    from llama_ane.cuda import ops

    for hq, hkv in ((32, 32), (32, 8)):
        t = make_batch(PREFIX, BATCH, SUFFIX, hkv, torch.float16)
        q = torch.randn(BATCH, hq, D, device="cuda", dtype=torch.float16)
        cache, suffix = t["cache"], (t["suffix_indptr"], t["suffix_indices"], t["suffix_last"])
        nbytes = BATCH * SUFFIX * 2 * hkv * D * 2
        ref, _ = ops.batch_decode(q, cache, *suffix, max_seq_len=SUFFIX)
        configs = [c for c in DECODE_CONFIGS if c[0] > 1 or hq == hkv]
        for g, bn, warps, stages in configs:
            cfg = dict(BLOCK_G=g, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            out = torch.empty_like(q)
            lse = torch.empty(BATCH, hq, device="cuda", dtype=torch.float32)
            run = lambda cfg=cfg, out=out, lse=lse: ops.launch_decode(  # noqa: E731
                q, cache, *suffix, out.unsqueeze(1), lse.unsqueeze(1), 0, 1, SUFFIX, D ** -0.5,
                config=cfg)
            run()
            err = (out.float() - ref.float()).abs().max().item()
            ms = timer.median_ms(run)
            log(f"suffix decode {hq}/{hkv} G={g} BN={bn} warps={warps} stages={stages}: "
                f"{ms:.4f} ms = {100 * nbytes / (ms * 1e-3) / HBM_PEAK:.1f}% of HBM, "
                f"max |o diff| {err:.1e}")
        group = hq // hkv
        multi = {}
        for reqs, bn, stages in ((2, 64, 3), (4, 64, 3), (8, 64, 3), (4, 128, 2), (8, 128, 2),
                                 (16, 128, 2), (8, 128, 3), (16, 64, 3)):
            n_blocks = triton.cdiv(SUFFIX, bn)
            out = torch.empty_like(q)
            lse = torch.empty(BATCH, hq, device="cuda", dtype=torch.float32)

            def run(out=out, lse=lse, reqs=reqs, bn=bn, stages=stages, n_blocks=n_blocks,
                    o_slot=None):
                o_t, l_t, slot = (out.unsqueeze(1), lse.unsqueeze(1), 0) if o_slot is None \
                    else o_slot
                return multi_request_decode_kernel[(triton.cdiv(BATCH, reqs), hkv)](
                    q, cache, *suffix, o_t, l_t,
                    q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
                    o_t.stride(0), o_t.stride(1), o_t.stride(2), l_t.stride(0), l_t.stride(1),
                    slot, D ** -0.5 * 1.4426950408889634, BATCH, n_blocks,
                    GROUP=group, HEAD_DIM=D, BLOCK_G=max(16, group), PAGE_SIZE=PAGE,
                    BLOCK_N=bn, REQS=reqs, num_warps=4, num_stages=stages)

            try:
                k = run()
                err = (out.float() - ref.float()).abs().max().item()
                ms = timer.median_ms(run)
            except Exception as exc:
                log(f"multi-request decode {hq}/{hkv} REQS={reqs}: failed: {type(exc).__name__}: "
                    f"{str(exc)[:400]}")
                continue
            multi[ms] = run
            log(f"multi-request decode {hq}/{hkv} REQS={reqs} BN={bn} stages={stages} "
                f"[{k.n_regs} regs, {k.metadata.shared} B smem]: {ms:.4f} ms = "
                f"{100 * nbytes / (ms * 1e-3) / HBM_PEAK:.1f}% of HBM, max |o diff| {err:.1e}")
        if multi:
            # the overlap schedule with the best of them as the suffix decode
            plan = planned(t, PREFIX, hq, hkv, "cascade", config=dict(overlap=True))
            best = multi[min(multi)]
            o_ref, _ = plan.run(q, cache)
            side = torch.cuda.Stream(priority=-1)
            out = torch.empty_like(q)
            lse = torch.empty(BATCH, hq, device="cuda", dtype=torch.float32)

            def cascade():
                cur = torch.cuda.current_stream()
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    ops.launch_shared_prefix(q, cache, t["prefix_indices"], PREFIX, plan.o_buf,
                                             plan.lse_buf, 0, plan.prefix_splits,
                                             plan.prefix_chunk, D ** -0.5)
                best(o_slot=(plan.o_buf, plan.lse_buf, plan.prefix_splits))
                cur.wait_stream(side)
                ops.launch_merge(plan.o_buf, plan.lse_buf, out, lse)

            cascade()
            ms = timer.median_ms(cascade)
            log(f"cascade {hq}/{hkv} overlap with the best multi-request decode: {ms:.4f} ms, "
                f"max |o diff| {(out.float() - o_ref.float()).abs().max().item():.1e}")
        for splits in (2, 3, 4, 5, 6, 8):
            for bn in (64, 128):
                cfg = dict(overlap=True, decode=dict(BLOCK_G=max(16, group), BLOCK_N=bn,
                                                     num_warps=4, num_stages=3))
                plan = planned(t, PREFIX, hq, hkv, "cascade", config=cfg, prefix_splits=splits)
                ms = timer.median_ms(lambda plan=plan: plan.run(q, cache))
                log(f"cascade {hq}/{hkv} overlap prefix splits={splits} decode BN={bn}: "
                    f"{ms:.4f} ms")
        base = None
        for overlap in (True, False):
            for g, bn, warps, stages in configs[:3] + [c for c in configs if c[0] == 1][:2]:
                cfg = dict(overlap=overlap, decode=dict(BLOCK_G=g, BLOCK_N=bn, num_warps=warps,
                                                        num_stages=stages))
                plan = planned(t, PREFIX, hq, hkv, "cascade", config=cfg)
                o, _ = plan.run(q, cache)
                base = o if base is None else base
                ms = timer.median_ms(lambda plan=plan: plan.run(q, cache))
                log(f"cascade {hq}/{hkv} {'overlap' if overlap else 'sequential'} decode G={g} "
                    f"BN={bn} warps={warps} stages={stages}: {ms:.4f} ms, max |o diff| "
                    f"{(o.float() - base.float()).abs().max().item():.1e}")
        torch.cuda.empty_cache()


def main() -> None:
    from timing import Timer  # benchmarks/timing.py, beside this script

    timer = Timer(30)
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    if "--suffix-only" not in sys.argv:
        prefix_section(timer, log)
    suffix_section(timer, log)


if __name__ == "__main__":
    sys.exit(main())
