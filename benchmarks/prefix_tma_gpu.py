"""The shared-prefix kernel at the GQA grid points (32/8 heads, D=128, fp16, prefix >= 8192) with
Hopper's bulk tensor copies (TMA) for K/V instead of per-element paged gathers, and with Triton's
warp specialisation, against the library kernel on the same inputs.

Variants of one program (whole key blocks, the library's online softmax):
  gather    the library's loads: a page-table lookup and a 64-bit address per K/V element
  tma       a tensor descriptor over the page-ordered cache ``[pages, 2, page, Hkv, D]``: one
            bulk copy per key block (the prefix's pages in order, as the engine and KV-Runahead
            lay them out)
  tma_paged one bulk copy per key block from a page looked up in the page table: pages of
            ``BLOCK_N`` tokens, shuffled
  +ws       the key-block loop with ``warp_specialize=True`` (a producer warp for the copies)

Each variant is checked against the library's output (the states merged), then timed (L2
flushed, median of 30). The roofline of a point is max(bytes / HBM rate, flops / fp16 rate)
of the prefix part alone, at the GPU's datasheet rates (H100 SXM: 3.35 TB/s, 989 TFLOP/s).

    python benchmarks/prefix_tma_gpu.py > benchmarks/results/cuda_prefix_tma.log
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from llama_ane.cuda.kernels import (_empty_state, _prefix_row_tile, _store_prefix_state,
                                    _whole_block_step, _whole_page_rows)

D = 128
HQ, HKV = 32, 8
# the GPU's own datasheet peaks (cascade_gpu.DATASHEET), H100 SXM's for a name not listed there
HBM_PEAK, FP16_PEAK = 3.35e12, 989e12
POINTS = [(p, b) for p in (8192, 32768) for b in (16, 64, 256)]
# (BLOCK_M cap, BLOCK_N, num_warps, num_stages)
TILES = ((128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3))


@triton.jit
def _key_block(q, m_i, l_i, acc, n0, kv_head, kv_desc, indices_ptr, kvh, offs_n, offs_d,
               stride_page, stride_kv, stride_tok, sm_scale_log2, HEAD_DIM: tl.constexpr,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """Load one key block (MODE as in the kernel) and fold it into the online softmax."""
    if MODE == 0:
        krow = _whole_page_rows(indices_ptr, n0 + offs_n, PAGE_SIZE, stride_page, stride_tok)
        k = tl.load(kv_head + krow[:, None] + offs_d[None, :])
        v = tl.load(kv_head + stride_kv + krow[:, None] + offs_d[None, :])
    elif MODE == 1:
        page = n0 // PAGE_SIZE
        k = kv_desc.load([page, 0, 0, kvh, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = kv_desc.load([page, 1, 0, kvh, 0]).reshape(BLOCK_N, HEAD_DIM)
    else:
        page = tl.load(indices_ptr + n0 // PAGE_SIZE)
        k = kv_desc.load([page, 0, 0, kvh, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = kv_desc.load([page, 1, 0, kvh, 0]).reshape(BLOCK_N, HEAD_DIM)
    return _whole_block_step(tl.dot(q, tl.trans(k)), m_i, l_i, acc, v, sm_scale_log2)


@triton.jit
def prefix_tma_kernel(
    q_ptr, kv_ptr, kv_desc, indices_ptr, prefix_len, n_rows, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_page, stride_kv, stride_tok,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
    sm_scale_log2, chunk_len,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, WS: tl.constexpr,
):
    """MODE 0: paged gathers (the library's loads); 1: TMA over page-ordered pages;
    2: TMA of one page per key block (PAGE_SIZE == BLOCK_N), page from the table."""
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    r_mask, b, heads, q = _prefix_row_tile(q_ptr, tl.program_id(0), kvh, n_rows, stride_qb,
                                           stride_qh, GROUP, BLOCK_M, HEAD_DIM)
    start = split * chunk_len
    end = tl.minimum(start + chunk_len, prefix_len)  # whole key blocks: both are multiples
    m_i, l_i, acc = _empty_state(BLOCK_M, HEAD_DIM)
    offs_d, offs_n = tl.arange(0, HEAD_DIM), tl.arange(0, BLOCK_N)
    kv_head = kv_ptr + kvh * HEAD_DIM
    if WS:
        for n0 in tl.range(start, end, BLOCK_N, warp_specialize=True):
            m_i, l_i, acc = _key_block(q, m_i, l_i, acc, n0, kv_head, kv_desc, indices_ptr, kvh,
                                       offs_n, offs_d, stride_page, stride_kv, stride_tok,
                                       sm_scale_log2, HEAD_DIM, PAGE_SIZE, BLOCK_N, MODE)
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _key_block(q, m_i, l_i, acc, n0, kv_head, kv_desc, indices_ptr, kvh,
                                       offs_n, offs_d, stride_page, stride_kv, stride_tok,
                                       sm_scale_log2, HEAD_DIM, PAGE_SIZE, BLOCK_N, MODE)
    _store_prefix_state(o_ptr, lse_ptr, b, heads, split, stride_ob, stride_os, stride_oh,
                        stride_lb, stride_ls, acc, m_i, l_i, r_mask, HEAD_DIM)


def main() -> int:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from llama_ane.cuda import ops
    from llama_ane.cuda.lse import LOG2E
    from llama_ane.cuda.splits import choose_prefix_splits, prefix_block_m
    from timing import Timer  # benchmarks/timing.py, beside this script

    def log(msg):
        print(msg, flush=True)

    from cascade_gpu import datasheet_peaks  # benchmarks/cascade_gpu.py, beside this script

    global HBM_PEAK, FP16_PEAK
    HBM_PEAK, FP16_PEAK = datasheet_peaks(torch.cuda.get_device_name(0)) or (HBM_PEAK, FP16_PEAK)
    timer = Timer(30)
    sms = ops.num_sms(torch.device("cuda"))
    log(f"{torch.cuda.get_device_name(0)}, {sms} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}; heads {HQ}/{HKV}, D={D}, fp16; roofline at "
        f"{HBM_PEAK / 1e12:.2f} TB/s and {FP16_PEAK / 1e12:.0f} TFLOP/s")
    summary = []
    for prefix, batch in POINTS:
        g = torch.Generator(device="cuda").manual_seed(prefix + batch)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16, generator=g)
        group = HQ // HKV
        n_rows = batch * group
        flops = 4.0 * batch * HQ * prefix * D
        roof_ms = 1e3 * max(prefix * 2 * HKV * D * 2 / HBM_PEAK, flops / FP16_PEAK)
        caches = {}
        for page in (16, 64, 128):
            n_pages = prefix // page
            cache = torch.randn(n_pages, 2, page, HKV, D, device="cuda", dtype=torch.float16,
                                generator=g)
            order = torch.arange(n_pages, device="cuda", dtype=torch.int32)
            shuffled = torch.randperm(n_pages, device="cuda", generator=g).to(torch.int32)
            caches[page] = (cache, order, shuffled)
        cache16, order16, shuffled16 = caches[16]
        ref, ref_lse = ops.shared_prefix_attention(q, cache16, shuffled16, prefix)
        splits, chunk = choose_prefix_splits(n_rows, prefix_block_m(n_rows), HKV, prefix, sms)
        o_l = torch.empty(batch, splits, HQ, D, device="cuda", dtype=torch.float32)
        l_l = torch.empty(batch, splits, HQ, device="cuda", dtype=torch.float32)
        lib_ms = timer.median_ms(lambda: ops.launch_shared_prefix(
            q, cache16, shuffled16, prefix, o_l, l_l, 0, splits, chunk, D ** -0.5))
        log(f"\nprefix {prefix} batch {batch}: library kernel {lib_ms:.4f} ms "
            f"({flops / lib_ms / 1e9:.0f} TFLOP/s, {100 * roof_ms / lib_ms:.0f}% of the prefix "
            f"roofline {roof_ms:.4f} ms), {splits} splits")
        best = {}
        # (mode, page order): the library's gathers on shuffled and on page-ordered pages, TMA
        # over page-ordered pages, TMA of one page per key block on shuffled and ordered pages
        for mode, ordered in ((0, False), (0, True), (1, True), (2, False), (2, True)):
            for bm_cap, bn, warps, stages in TILES:
                # warp specialisation fails to compile on every 4-warp tile (Triton 3.6)
                for ws in (False, True) if warps == 8 else (False,):
                    page = bn if mode == 2 else 16
                    cache, order, shuffled = caches[page]
                    idx = order if ordered else shuffled
                    if page == 16 and not ordered:
                        want, want_lse = ref, ref_lse
                    else:  # the library kernel on this cache (verified against torch)
                        want, want_lse = ops.shared_prefix_attention(q, cache, idx, prefix)
                    bm = min(bm_cap, prefix_block_m(n_rows))
                    sp, _ = choose_prefix_splits(n_rows, bm, HKV, prefix, sms)
                    ch = -(-(-(-prefix // sp)) // bn) * bn  # whole key blocks per split
                    sp = -(-prefix // ch)
                    o_buf = torch.empty(batch, sp, HQ, D, device="cuda", dtype=torch.float32)
                    lse_buf = torch.empty(batch, sp, HQ, device="cuda", dtype=torch.float32)
                    block = [bn // page, 1, page, 1, D] if mode == 1 else [1, 1, page, 1, D]
                    kind = ["gather", "tma", "tma_paged"][mode]
                    family = f"{kind} {'ordered' if ordered else 'shuffled'} pages"
                    name = (f"{family}{' +ws' if ws else ''} page={page} BM={bm} BN={bn} "
                            f"warps={warps} stages={stages} splits={sp}")

                    def launch():
                        return prefix_tma_kernel[(triton.cdiv(n_rows, bm), HKV, sp)](
                            q, cache, desc, idx, prefix, n_rows, o_buf, lse_buf,
                            q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
                            cache.stride(2), o_buf.stride(0), o_buf.stride(1),
                            o_buf.stride(2), lse_buf.stride(0), lse_buf.stride(1),
                            D ** -0.5 * LOG2E, ch, GROUP=group, HEAD_DIM=D, PAGE_SIZE=page,
                            BLOCK_M=bm, BLOCK_N=bn, MODE=mode, WS=ws, num_warps=warps,
                            num_stages=stages)

                    try:
                        desc = TensorDescriptor(cache, list(cache.shape), list(cache.stride()),
                                                block)
                        o_buf.fill_(float("nan"))
                        k = launch()
                        out, lse = ops.merge_states(o_buf, lse_buf)
                        err = (out.float() - want.float()).abs().max().item()
                        lerr = (lse - want_lse).abs().max().item()
                        if not (err < 2e-3 and lerr < 2e-3):
                            log(f"  {name}: WRONG (max |o diff| {err:.2e}, |lse diff| {lerr:.2e})")
                            continue
                        ms = timer.median_ms(launch)
                    except Exception as exc:  # a variant that does not compile is reported
                        log(f"  {name}: failed: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}")
                        continue
                    log(f"  {name}: {ms:.4f} ms = {lib_ms / ms:.3f}x library, "
                        f"{flops / ms / 1e9:.0f} TFLOP/s, {100 * roof_ms / ms:.0f}% of roofline "
                        f"[{k.n_regs} regs, {k.n_spills} spills, {k.metadata.shared} B smem]")
                    if ms < best.get(family, ("", 1e9))[1]:
                        best[family] = (name, ms)
        summary.append((prefix, batch, lib_ms, best, roof_ms))
        del caches
        torch.cuda.empty_cache()
    log("\nbest of each family per point: ms (% of the prefix roofline), x library")
    for prefix, batch, lib_ms, best, roof_ms in summary:
        log(f"{prefix:6d} x {batch:3d}: library {lib_ms:.4f} ({100 * roof_ms / lib_ms:.0f}%)")
        for family, (name, ms) in best.items():
            log(f"    {family:26s} {ms:.4f} ({100 * roof_ms / ms:.0f}%) {lib_ms / ms:.2f}x  "
                f"{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
