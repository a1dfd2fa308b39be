"""Triton kernels of the CUDA path: pure ``@triton.jit`` functions, no host logic.

Every kernel produces *attention states* ``(o, lse)``: ``o`` is the softmax-weighted value vector of
a query head over a set of keys and ``lse`` the natural-log log-sum-exp of its scaled scores over
the same set. States over disjoint key sets merge exactly (see ``merge_states_kernel``), which is
what split-KV, cascade and tree attention are built from.

Inside the kernels scores are kept in base 2 (``exp2`` is one instruction, ``exp`` is two); the
scale passed in already holds ``log2(e)``, and the LSE written out is converted back to natural log.

Paged KV cache layout (NHD): ``kv[pages, 2, page_size, num_kv_heads, head_dim]``; index 0 of the
second axis is K, 1 is V. Token ``t`` of a request lives at page ``indices[indptr[b] + t //
page_size]``, slot ``t % page_size``. The page size is a compile-time constant so that the division
is a shift for powers of two.

Host wrappers (shape checks, grids, split choice) live in ``ops.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
LOG2E_C = tl.constexpr(1.4426950408889634)


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v):
    """One flash-attention step over a key block: ``s`` [M, N] (base-2 scores, -inf = masked)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row whose keys are all masked so far keeps m = -inf; use 0 as its reference so that
    # exp2(-inf - ref) = 0 instead of NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _page_rows(indices_ptr, tok, n_mask, PAGE_SIZE: tl.constexpr, stride_page, stride_tok):
    """Element offsets of the slots of tokens ``tok`` [N] in a paged cache (``indices_ptr``
    points at the request's first page); rows outside ``n_mask`` point at page ``indices[0]``."""
    page = tl.load(indices_ptr + tok // PAGE_SIZE, mask=n_mask, other=0)
    return page.to(tl.int64) * stride_page + (tok % PAGE_SIZE) * stride_tok


@triton.jit
def _whole_page_rows(indices_ptr, tok, PAGE_SIZE: tl.constexpr, stride_page, stride_tok):
    """``_page_rows`` for tokens that all exist (a whole key block): no mask on the loads."""
    page = tl.load(indices_ptr + tok // PAGE_SIZE)
    return page.to(tl.int64) * stride_page + (tok % PAGE_SIZE) * stride_tok


@triton.jit
def _load_kv(kv_head, krow, offs_d, stride_kv, n_mask):
    """K and V [N, D] at slot offsets ``krow`` [N] of one kv head; rows outside ``n_mask`` are 0."""
    ptrs = kv_head + krow[:, None] + offs_d[None, :]
    k = tl.load(ptrs, mask=n_mask[:, None], other=0.0)
    v = tl.load(ptrs + stride_kv, mask=n_mask[:, None], other=0.0)
    return k, v


@triton.jit
def _prefix_row_tile(q_ptr, mb, kvh, n_rows, stride_qb, stride_qh, GROUP: tl.constexpr,
                     BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Row tile ``mb`` of kv head ``kvh`` in the shared-prefix kernel: rows are (request, query
    head of the group) pairs. Returns the row mask, requests and heads [BLOCK_M] and q [BLOCK_M, D]."""
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < n_rows
    b = rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=r_mask[:, None], other=0.0)
    return r_mask, b, heads, q


@triton.jit
def _store_state(o_ptrs, lse_ptrs, acc, m_i, l_i, row_mask):
    """Normalise and store a state; an empty key set gives ``o = 0`` and ``lse = -inf``."""
    nonempty = l_i > 0.0
    l_safe = tl.where(nonempty, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=row_mask[:, None])
    tl.store(lse_ptrs, lse, mask=row_mask)


@triton.jit
def _merge_rows(m_i, l_i, acc, lse2, o):
    """Fold a stored state (log2-scaled ``lse2`` [M], normalised ``o`` [M, D]) into the running
    state of M rows (max ``m_i``, sum ``l_i``, unnormalised ``acc``); an empty state adds nothing."""
    m_new = tl.maximum(m_i, lse2)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    w = tl.exp2(lse2 - m_ref)
    return m_new, l_i * alpha + w, acc * alpha[:, None] + o * w[:, None]


@triton.jit
def _whole_block_step(s, m_i, l_i, acc, v, sm_scale_log2):
    """Online-softmax step over a key block every row sees (raw scores ``s`` [M, N]): the running
    max stays finite, so no -inf guard. The scale is applied to the row max and inside the exp2's
    argument (one FMA per score)."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * sm_scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * sm_scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _empty_state(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Running max, sum and accumulator of a row tile before its first key block."""
    return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, HEAD_DIM], tl.float32))


@triton.jit
def _store_prefix_state(o_ptr, lse_ptr, b, heads, slot, stride_ob, stride_os, stride_oh,
                        stride_lb, stride_ls, acc, m_i, l_i, r_mask, HEAD_DIM: tl.constexpr):
    """Store a shared-prefix program's state in slot ``slot`` of rows (``b``, ``heads``)."""
    offs_d = tl.arange(0, HEAD_DIM)
    o_ptrs = o_ptr + b[:, None] * stride_ob + slot * stride_os + heads[:, None] * stride_oh \
        + offs_d[None, :]
    lse_ptrs = lse_ptr + b * stride_lb + slot * stride_ls + heads
    _store_state(o_ptrs, lse_ptrs, acc, m_i, l_i, r_mask)


@triton.jit
def paged_decode_kernel(
    q_ptr, kv_ptr, indptr_ptr, indices_ptr, last_len_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_page, stride_kv, stride_tok,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
    state_offset, sm_scale_log2, chunk_len,
    pre_o_ptr, pre_lse_ptr, n_pre, stride_pb, stride_ps, stride_ph, stride_plb, stride_pls,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MERGE_PREFIX: tl.constexpr,
):
    """Batch decode over a paged KV cache, one program per (request, kv head, KV split).

    The ``GROUP`` query heads that share a kv head are processed together so each K/V row is read
    once per group. Split ``s`` covers tokens ``[s * chunk_len, (s + 1) * chunk_len)`` and writes
    state slot ``state_offset + s`` of ``o[b, slot, head, :]`` and ``lse[b, slot, head]``.

    With ``MERGE_PREFIX`` the ``n_pre`` states ``pre_o[b, i, head]`` / ``pre_lse[b, i, head]``
    (natural log; the shared-prefix kernel's splits) are merged into this program's state before
    it is stored, which saves the cascade a merge launch and a round trip of the states.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    page_start = tl.load(indptr_ptr + b)
    page_end = tl.load(indptr_ptr + b + 1)
    last_len = tl.load(last_len_ptr + b)
    # an empty request (no pages, last_len <= page_size) comes out as length <= 0
    seq_len = tl.maximum((page_end - page_start - 1) * PAGE_SIZE + last_len, 0)
    start = split * chunk_len
    end = tl.minimum(start + chunk_len, seq_len)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    kv_head = kv_ptr + kvh * HEAD_DIM
    slot = state_offset + split
    if BLOCK_G == 1:
        # MHA: one query row per program. 1-D vectors and 2-D reductions keep the loop lean
        # (a [1, D] x [D, N] product is below the tensor-core tile anyway).
        q = tl.load(q_ptr + b * stride_qb + kvh * stride_qh + offs_d).to(tl.float32)
        m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
        l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            tok = n0 + offs_n
            n_mask = tok < end
            rows = _page_rows(indices_ptr + page_start, tok, n_mask, PAGE_SIZE, stride_page,
                              stride_tok)
            k, v = _load_kv(kv_head, rows, offs_d, stride_kv, n_mask)
            s = tl.sum(k.to(tl.float32) * q[None, :], 1) * sm_scale_log2
            s = tl.where(n_mask, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref)
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
            m_i = m_new
        if MERGE_PREFIX:
            for i in range(0, n_pre):
                lse2 = tl.load(pre_lse_ptr + b * stride_plb + i * stride_pls + kvh) * LOG2E_C
                o_pre = tl.load(pre_o_ptr + b * stride_pb + i * stride_ps + kvh * stride_ph
                                + offs_d).to(tl.float32)
                m_new = tl.maximum(m_i, lse2)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_ref)
                w = tl.exp2(lse2 - m_ref)
                l_i = l_i * alpha + w
                acc = acc * alpha + o_pre * w
                m_i = m_new
        nonempty = l_i > 0.0
        l_safe = tl.where(nonempty, l_i, 1.0)
        lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
        o_ptrs = o_ptr + b * stride_ob + slot * stride_os + kvh * stride_oh + offs_d
        tl.store(o_ptrs, (acc / l_safe).to(o_ptr.dtype.element_ty))
        tl.store(lse_ptr + b * stride_lb + slot * stride_ls + kvh, lse)
    else:
        offs_g = tl.arange(0, BLOCK_G)
        g_mask = offs_g < GROUP
        heads = kvh * GROUP + offs_g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            tok = n0 + offs_n
            n_mask = tok < end
            rows = _page_rows(indices_ptr + page_start, tok, n_mask, PAGE_SIZE, stride_page,
                              stride_tok)
            k, v = _load_kv(kv_head, rows, offs_d, stride_kv, n_mask)
            s = tl.where(n_mask[None, :], tl.dot(q, tl.trans(k)) * sm_scale_log2, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v)
        if MERGE_PREFIX:
            for i in range(0, n_pre):
                lse2 = tl.load(pre_lse_ptr + b * stride_plb + i * stride_pls + heads,
                               mask=g_mask, other=float("-inf")) * LOG2E_C
                o_pre = tl.load(pre_o_ptr + b * stride_pb + i * stride_ps
                                + heads[:, None] * stride_ph + offs_d[None, :],
                                mask=g_mask[:, None], other=0.0).to(tl.float32)
                m_i, l_i, acc = _merge_rows(m_i, l_i, acc, lse2, o_pre)
        o_ptrs = o_ptr + b * stride_ob + slot * stride_os + heads[:, None] * stride_oh \
            + offs_d[None, :]
        lse_ptrs = lse_ptr + b * stride_lb + slot * stride_ls + heads
        _store_state(o_ptrs, lse_ptrs, acc, m_i, l_i, g_mask)


@triton.jit
def shared_prefix_kernel(
    q_ptr, kv_ptr, indices_ptr, prefix_len, n_rows, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_page, stride_kv, stride_tok,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
    state_offset, sm_scale_log2, chunk_len,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
):
    """All queries against one shared paged KV sequence (multi-query attention with LSE).

    Rows are (request, query head within the kv group) pairs, ``row = b * GROUP + g``, so a tile
    of ``BLOCK_M`` rows turns the shared prefix into a dense matrix product on the tensor cores.
    Grid: (row blocks, kv heads, KV splits). Row blocks vary fastest so the programs that read the
    same KV chunk run at the same time and share it through L2. ``WHOLE_BLOCKS`` says that
    ``prefix_len`` and ``chunk_len`` are multiples of ``BLOCK_N``: no split has a partial key
    block, and the masked tail loop is left out of the program.
    """
    mb = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    r_mask, b, heads, q = _prefix_row_tile(q_ptr, mb, kvh, n_rows, stride_qb, stride_qh, GROUP,
                                           BLOCK_M, HEAD_DIM)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    start = split * chunk_len
    end = tl.minimum(start + chunk_len, prefix_len)
    # whole key blocks need no bounds mask; only the last partial block does
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_head = kv_ptr + kvh * HEAD_DIM
    for n0 in range(start, full_end, BLOCK_N):
        krow = _whole_page_rows(indices_ptr, n0 + offs_n, PAGE_SIZE, stride_page, stride_tok)
        k = tl.load(kv_head + krow[:, None] + offs_d[None, :])
        v = tl.load(kv_head + stride_kv + krow[:, None] + offs_d[None, :])
        # no lazy rescale (skipping acc *= alpha while the max moves < 2^8): the CTA-wide test
        # costs more than the multiply it skips
        m_i, l_i, acc = _whole_block_step(tl.dot(q, tl.trans(k)), m_i, l_i, acc, v,
                                          sm_scale_log2)
    if not WHOLE_BLOCKS:
        # a second (masked) loop after the main one slows the main loop's code even where it
        # never executes, so prefixes of whole key blocks are compiled without it
        for n0 in range(full_end, end, BLOCK_N):
            tok = n0 + offs_n
            n_mask = tok < end
            krow = _page_rows(indices_ptr, tok, n_mask, PAGE_SIZE, stride_page, stride_tok)
            k, v = _load_kv(kv_head, krow, offs_d, stride_kv, n_mask)
            s = tl.dot(q, tl.trans(k)) * sm_scale_log2
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v)

    _store_prefix_state(o_ptr, lse_ptr, b, heads, state_offset + split, stride_ob, stride_os,
                        stride_oh, stride_lb, stride_ls, acc, m_i, l_i, r_mask, HEAD_DIM)


@triton.jit
def ordered_prefix_kernel(
    q_ptr, kv_desc, page_offset, prefix_len, n_rows, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
    state_offset, sm_scale_log2, chunk_len,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``shared_prefix_kernel`` for a prefix on consecutive pages of the cache, from page
    ``page_offset`` on (the engine's and KV-Runahead's layout, with ``page_offset`` 0): every key
    block is one bulk tensor copy (TMA) through
    ``kv_desc`` over the whole cache ``[pages, 2, page_size, Hkv, D]``, with no page table and no
    per-element addresses. The descriptor's block is ``[BLOCK_N // PAGE_SIZE, 1, PAGE_SIZE, 1,
    D]`` for pages of at most ``BLOCK_N`` tokens, ``[1, 1, BLOCK_N, 1, D]`` for larger ones.
    ``prefix_len`` and ``chunk_len`` are multiples of ``BLOCK_N`` (whole key blocks only).
    Faster than the paged kernel because the copy engine computes the addresses; paged gathers
    gain nothing from ordered pages (``benchmarks/prefix_tma_gpu.py`` measures both).
    """
    mb = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    r_mask, b, heads, q = _prefix_row_tile(q_ptr, mb, kvh, n_rows, stride_qb, stride_qh, GROUP,
                                           BLOCK_M, HEAD_DIM)
    start = split * chunk_len
    end = tl.minimum(start + chunk_len, prefix_len)
    m_i, l_i, acc = _ordered_prefix_loop(q, kv_desc, page_offset, kvh, start, end, sm_scale_log2,
                                         HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N)
    _store_prefix_state(o_ptr, lse_ptr, b, heads, state_offset + split, stride_ob, stride_os,
                        stride_oh, stride_lb, stride_ls, acc, m_i, l_i, r_mask, HEAD_DIM)


@triton.jit
def _ordered_prefix_loop(q, kv_desc, page_offset, kvh, start, end, sm_scale_log2,
                         HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """The state of row tile ``q`` over prefix tokens ``[start, end)`` (whole key blocks) of kv
    head ``kvh``, by bulk tensor copies from consecutive pages starting at ``page_offset``."""
    m_i, l_i, acc = _empty_state(BLOCK_M, HEAD_DIM)
    for n0 in range(start, end, BLOCK_N):
        page = page_offset + n0 // PAGE_SIZE
        if PAGE_SIZE <= BLOCK_N:
            k = kv_desc.load([page, 0, 0, kvh, 0]).reshape(BLOCK_N, HEAD_DIM)
            v = kv_desc.load([page, 1, 0, kvh, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            k = kv_desc.load([page, 0, n0 % PAGE_SIZE, kvh, 0]).reshape(BLOCK_N, HEAD_DIM)
            v = kv_desc.load([page, 1, n0 % PAGE_SIZE, kvh, 0]).reshape(BLOCK_N, HEAD_DIM)
        m_i, l_i, acc = _whole_block_step(tl.dot(q, tl.trans(k)), m_i, l_i, acc, v,
                                          sm_scale_log2)
    return m_i, l_i, acc


@triton.jit
def _paged_prefix_loop(q, kv_head, indices_ptr, start, end, sm_scale_log2, stride_page,
                       stride_kv, stride_tok, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_ordered_prefix_loop`` through the prefix's page table (paged gathers)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    m_i, l_i, acc = _empty_state(BLOCK_M, HEAD_DIM)
    for n0 in range(start, end, BLOCK_N):
        krow = _whole_page_rows(indices_ptr, n0 + offs_n, PAGE_SIZE, stride_page, stride_tok)
        k = tl.load(kv_head + krow[:, None] + offs_d[None, :])
        v = tl.load(kv_head + stride_kv + krow[:, None] + offs_d[None, :])
        m_i, l_i, acc = _whole_block_step(tl.dot(q, tl.trans(k)), m_i, l_i, acc, v,
                                          sm_scale_log2)
    return m_i, l_i, acc


@triton.jit
def _suffix_states(q_ptr, kv_head, indptr_ptr, indices_ptr, last_len_ptr, o_ptr, lse_ptr,
                   r_lo, r_hi, kvh, n_blocks, slot, stride_qb, stride_qh, stride_page, stride_kv,
                   stride_tok, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
                   sm_scale_log2, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   MAX_REQUESTS: tl.constexpr, STAGES: tl.constexpr):
    """The states of requests ``[r_lo, r_hi)`` (at most ``MAX_REQUESTS``) over their own paged
    suffixes (the query heads of kv head ``kvh``), stored in state slot ``slot``. One flat loop
    over (request, key block) with ``n_blocks`` blocks per request, so that the loads of the
    next request are in flight while this one computes; a request's state restarts at its first
    block and is stored after its last. The requests' page-table rows are read before the loop:
    a scalar load inside it would wait for memory on every iteration."""
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, MAX_REQUESTS)
    r_ok = offs_r < r_hi - r_lo
    starts = tl.load(indptr_ptr + r_lo + offs_r, mask=r_ok, other=0)
    ends = tl.load(indptr_ptr + r_lo + offs_r + 1, mask=r_ok, other=0)
    lengths = tl.maximum((ends - starts - 1) * PAGE_SIZE
                         + tl.load(last_len_ptr + r_lo + offs_r, mask=r_ok, other=0), 0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for it in tl.range(0, (r_hi - r_lo) * n_blocks, num_stages=STAGES):
        i = it // n_blocks
        r = r_lo + i
        j = it % n_blocks
        page_start = tl.sum(tl.where(offs_r == i, starts, 0), 0)
        seq_len = tl.sum(tl.where(offs_r == i, lengths, 0), 0)
        first = j == 0
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        q = tl.load(q_ptr + r * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None], other=0.0)
        tok = j * BLOCK_N + offs_n
        n_mask = tok < seq_len
        rows = _page_rows(indices_ptr + page_start, tok, n_mask, PAGE_SIZE, stride_page,
                          stride_tok)
        k, v = _load_kv(kv_head, rows, offs_d, stride_kv, n_mask)
        s = tl.where(n_mask[None, :], tl.dot(q, tl.trans(k)) * sm_scale_log2, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v)
        o_ptrs = o_ptr + r * stride_ob + slot * stride_os + heads[:, None] * stride_oh \
            + offs_d[None, :]
        _store_state(o_ptrs, lse_ptr + r * stride_lb + slot * stride_ls + heads, acc, m_i, l_i,
                     g_mask & (j == n_blocks - 1))


@triton.jit
def fused_cascade_kernel(
    q_ptr, kv_ptr, kv_desc, prefix_indices_ptr, page_offset, prefix_len, n_rows,
    s_indptr_ptr, s_indices_ptr, s_last_ptr, suffix_blocks,
    out_ptr, out_lse_ptr, st_o_ptr, st_lse_ptr, count_ptr,
    stride_qb, stride_qh, stride_page, stride_kv, stride_tok,
    stride_ob, stride_oh, stride_olb,
    stride_sb, stride_ss, stride_sh, stride_slb, stride_sls,
    sm_scale_log2, chunk_len, n_splits, batch,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SUFFIX_BLOCK_N: tl.constexpr, SUFFIX_STAGES: tl.constexpr, ORDERED: tl.constexpr,
    ORDER: tl.constexpr,
):
    """The whole two-level cascade in one launch, for short suffixes: program (row tile ``mb``,
    kv head, split) computes its prefix chunk's state (slot ``split``), the suffix states of its
    share of the tile's requests (slot ``n_splits``), and the last of the tile's ``n_splits``
    programs to finish merges the ``n_splits + 1`` states into ``out``/``out_lse``.

    The prefix part is tensor-core work and the suffix part streams from HBM. The later half of
    the programs (in launch order, the second program on each SM) does its suffix part first,
    so that the two programs on an SM are in different parts for most of their time
    (``ORDER`` 0; 1: every program starts with its prefix part, 2: with its suffix part).
    ``ORDERED``: the prefix lies on consecutive pages from ``page_offset`` (bulk copies through
    ``kv_desc``); else its page table is ``prefix_indices``. ``prefix_len`` and ``chunk_len``
    are whole ``BLOCK_N`` blocks. ``count_ptr`` holds one zero per (tile, kv head) before the
    launch and is left zero after it.
    """
    mb = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_mb = tl.num_programs(0)
    n_kvh = tl.num_programs(1)
    pid = mb + n_mb * (kvh + n_kvh * split)
    if ORDER == 0:
        suffix_first = 2 * pid >= n_mb * n_kvh * n_splits
    else:
        suffix_first = ORDER == 2
    req_per_tile: tl.constexpr = BLOCK_M // GROUP
    share = tl.cdiv(req_per_tile, n_splits)
    r_lo = tl.minimum(mb * req_per_tile + split * share, batch)
    r_hi = tl.minimum(tl.minimum(r_lo + share, (mb + 1) * req_per_tile), batch)
    kv_head = kv_ptr + kvh * HEAD_DIM
    if suffix_first:
        _suffix_states(q_ptr, kv_head, s_indptr_ptr, s_indices_ptr, s_last_ptr, st_o_ptr,
                       st_lse_ptr, r_lo, r_hi, kvh, suffix_blocks, n_splits, stride_qb,
                       stride_qh, stride_page, stride_kv, stride_tok, stride_sb, stride_ss,
                       stride_sh, stride_slb, stride_sls, sm_scale_log2, GROUP, BLOCK_G,
                       HEAD_DIM, PAGE_SIZE, SUFFIX_BLOCK_N, BLOCK_M // GROUP, SUFFIX_STAGES)
    r_mask, b, heads, q = _prefix_row_tile(q_ptr, mb, kvh, n_rows, stride_qb, stride_qh, GROUP,
                                           BLOCK_M, HEAD_DIM)
    start = split * chunk_len
    end = tl.minimum(start + chunk_len, prefix_len)
    if ORDERED:
        m_i, l_i, acc = _ordered_prefix_loop(q, kv_desc, page_offset, kvh, start, end,
                                             sm_scale_log2, HEAD_DIM, PAGE_SIZE, BLOCK_M,
                                             BLOCK_N)
    else:
        m_i, l_i, acc = _paged_prefix_loop(q, kv_head, prefix_indices_ptr, start, end,
                                           sm_scale_log2, stride_page, stride_kv, stride_tok,
                                           HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N)
    _store_prefix_state(st_o_ptr, st_lse_ptr, b, heads, split, stride_sb, stride_ss, stride_sh,
                        stride_slb, stride_sls, acc, m_i, l_i, r_mask, HEAD_DIM)
    if not suffix_first:
        _suffix_states(q_ptr, kv_head, s_indptr_ptr, s_indices_ptr, s_last_ptr, st_o_ptr,
                       st_lse_ptr, r_lo, r_hi, kvh, suffix_blocks, n_splits, stride_qb,
                       stride_qh, stride_page, stride_kv, stride_tok, stride_sb, stride_ss,
                       stride_sh, stride_slb, stride_sls, sm_scale_log2, GROUP, BLOCK_G,
                       HEAD_DIM, PAGE_SIZE, SUFFIX_BLOCK_N, BLOCK_M // GROUP, SUFFIX_STAGES)
    # every thread's state stores happen before the release of the arrival count (the barrier),
    # and the last program's loads after its acquire, past the L1 (.cg)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + mb * n_kvh + kvh, 1, sem="acq_rel", scope="gpu")
    if arrived == n_splits - 1:
        offs_d = tl.arange(0, HEAD_DIM)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for slot in range(0, n_splits + 1):
            lse2 = tl.load(st_lse_ptr + b * stride_slb + slot * stride_sls + heads, mask=r_mask,
                           other=float("-inf"), cache_modifier=".cg") * LOG2E_C
            o_s = tl.load(st_o_ptr + b[:, None] * stride_sb + slot * stride_ss
                          + heads[:, None] * stride_sh + offs_d[None, :], mask=r_mask[:, None],
                          other=0.0, cache_modifier=".cg")
            m_i, l_i, acc = _merge_rows(m_i, l_i, acc, lse2, o_s)
        o_ptrs = out_ptr + b[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        _store_state(o_ptrs, out_lse_ptr + b * stride_olb + heads, acc, m_i, l_i, r_mask)
        tl.atomic_xchg(count_ptr + mb * n_kvh + kvh, 0)


@triton.jit
def tree_attention_kernel(
    q_ptr, kv_ptr, tok_loc_ptr,
    item_tok_start_ptr, item_tok_len_ptr, item_pair_start_ptr, item_nq_ptr, item_full_ptr,
    pair_query_ptr, pair_slot_ptr, mask_ptr,
    o_ptr, lse_ptr,
    stride_qb, stride_qh,
    stride_page, stride_kv, stride_tok,
    stride_op, stride_oh, stride_lp,
    sm_scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_WORDS: tl.constexpr,
):
    """Flattened tree attention (KV-guided grouping), one program per (work item, kv head).

    A work item is one fixed-size block of the flattened tree KV together with up to
    ``BLOCK_M // GROUP`` of the queries that see any of its tokens. The block is loaded once for
    all of them; a per-(block, query) bitmask of ``MASK_WORDS`` int32 words says which of its
    tokens each query may attend to (a separate loop without it when the whole item sees the
    whole block, as for the shared prompt). Each
    (block, query) pair writes its state to ``slot = pair_slot[pair]``; the slots of one query are
    contiguous, so a varlen merge finishes the job.
    """
    it = tl.program_id(0)
    kvh = tl.program_id(1)
    t0 = tl.load(item_tok_start_ptr + it)
    tlen = tl.load(item_tok_len_ptr + it)
    p0 = tl.load(item_pair_start_ptr + it)
    nq = tl.load(item_nq_ptr + it)
    full = tl.load(item_full_ptr + it)

    rows = tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    r_mask = qi < nq
    pair = p0 + qi
    qid = tl.load(pair_query_ptr + pair, mask=r_mask, other=0)
    heads = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + qid[:, None].to(tl.int64) * stride_qb + heads[:, None] * stride_qh
                + offs_d[None, :], mask=r_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_head = kv_ptr + kvh * HEAD_DIM
    if full != 0:
        # every query of the item sees the whole block (the shared prompt): no bitmask work
        for n0 in range(0, tlen, BLOCK_N):
            j = n0 + offs_n
            n_mask = j < tlen
            loc = tl.load(tok_loc_ptr + t0 + j, mask=n_mask, other=0)
            krow = (loc // PAGE_SIZE).to(tl.int64) * stride_page + (loc % PAGE_SIZE) * stride_tok
            k, v = _load_kv(kv_head, krow, offs_d, stride_kv, n_mask)
            s = tl.where(n_mask[None, :], tl.dot(q, tl.trans(k)) * sm_scale_log2, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v)
    else:
        tl.static_assert(BLOCK_N == 64, "the bitmask loop reads two 32-bit words per key block")
        row_words = mask_ptr + pair.to(tl.int64) * MASK_WORDS
        for n0 in range(0, tlen, BLOCK_N):
            j = n0 + offs_n
            n_mask = j < tlen
            loc = tl.load(tok_loc_ptr + t0 + j, mask=n_mask, other=0)
            krow = (loc // PAGE_SIZE).to(tl.int64) * stride_page + (loc % PAGE_SIZE) * stride_tok
            k, v = _load_kv(kv_head, krow, offs_d, stride_kv, n_mask)
            s = tl.dot(q, tl.trans(k)) * sm_scale_log2
            # the block's two mask words per row, [BLOCK_M] each, spread over its 64 keys (one
            # load per row and word instead of one per row and key)
            w_lo = tl.load(row_words + n0 // 32, mask=r_mask, other=0)
            w_hi = tl.load(row_words + n0 // 32 + 1, mask=r_mask & (n0 + 32 < tlen), other=0)
            words = tl.where((offs_n < 32)[None, :], w_lo[:, None], w_hi[:, None])
            visible = ((words >> (offs_n % 32)[None, :]) & 1) != 0
            s = tl.where(visible & n_mask[None, :], s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v)

    slot = tl.load(pair_slot_ptr + pair, mask=r_mask, other=0).to(tl.int64)
    o_ptrs = o_ptr + slot[:, None] * stride_op + heads[:, None] * stride_oh + offs_d[None, :]
    lse_ptrs = lse_ptr + slot * stride_lp + heads
    _store_state(o_ptrs, lse_ptrs, acc, m_i, l_i, r_mask)


@triton.jit
def merge_states_kernel(
    v_ptr, s_ptr, indptr_ptr, o_ptr, lse_ptr,
    n_states, num_heads,
    stride_vr, stride_vn, stride_vh,
    stride_sr, stride_sn, stride_sh,
    stride_or, stride_oh, stride_lr,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, VARLEN: tl.constexpr,
):
    """N-ary merge of attention states, one program per (row, head).

    Fixed count: row ``r`` merges ``v[r, 0:n_states, h]``. Varlen: row ``r`` merges the states
    ``indptr[r]:indptr[r + 1]`` of a flat ``v[states, h]`` (``stride_vr`` unused). Natural-log LSE.
    """
    r = tl.program_id(0)
    h = tl.program_id(1)
    if VARLEN:
        first = tl.load(indptr_ptr + r)
        count = tl.load(indptr_ptr + r + 1) - first
        v_base = v_ptr + first.to(tl.int64) * stride_vn + h * stride_vh
        s_base = s_ptr + first.to(tl.int64) * stride_sn + h * stride_sh
    else:
        count = n_states
        v_base = v_ptr + r.to(tl.int64) * stride_vr + h * stride_vh
        s_base = s_ptr + r.to(tl.int64) * stride_sr + h * stride_sh
    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, BLOCK_S)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for n0 in range(0, count, BLOCK_S):
        n = n0 + offs_s
        n_mask = n < count
        s = tl.load(s_base + n * stride_sn, mask=n_mask, other=float("-inf")).to(tl.float32)
        v = tl.load(v_base + n[:, None] * stride_vn + offs_d[None, :], mask=n_mask[:, None],
                    other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(s, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        w = tl.exp(s - m_ref)
        l = l * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * v, 0)
        m = m_new
    nonempty = l > 0.0
    l_safe = tl.where(nonempty, l, 1.0)
    out = acc / l_safe
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    lse = tl.where(nonempty, m_ref + tl.log(l_safe), float("-inf"))
    tl.store(o_ptr + r.to(tl.int64) * stride_or + h * stride_oh + offs_d,
             out.to(o_ptr.dtype.element_ty))
    tl.store(lse_ptr + r.to(tl.int64) * stride_lr + h + tl.arange(0, 1), lse)


@triton.jit
def merge_two_states_kernel(
    va_ptr, sa_ptr, vb_ptr, sb_ptr, o_ptr, lse_ptr,
    num_heads,
    stride_var, stride_vah, stride_sar,
    stride_vbr, stride_vbh, stride_sbr,
    stride_or, stride_oh, stride_lr,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Binary merge ``(va, sa) (+) (vb, sb)``, one program per (row, block of heads).

    ``o``/``lse`` may alias ``va``/``sa`` (in-place merge): each program reads its rows before it
    writes them.
    """
    r = tl.program_id(0)
    hb = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_d = tl.arange(0, HEAD_DIM)
    r64 = r.to(tl.int64)
    sa = tl.load(sa_ptr + r64 * stride_sar + heads, mask=h_mask, other=float("-inf")).to(tl.float32)
    sb = tl.load(sb_ptr + r64 * stride_sbr + heads, mask=h_mask, other=float("-inf")).to(tl.float32)
    va = tl.load(va_ptr + r64 * stride_var + heads[:, None] * stride_vah + offs_d[None, :],
                 mask=h_mask[:, None], other=0.0).to(tl.float32)
    vb = tl.load(vb_ptr + r64 * stride_vbr + heads[:, None] * stride_vbh + offs_d[None, :],
                 mask=h_mask[:, None], other=0.0).to(tl.float32)
    m = tl.maximum(sa, sb)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(sa - m_ref)
    wb = tl.exp(sb - m_ref)
    l = wa + wb
    nonempty = l > 0.0
    l_safe = tl.where(nonempty, l, 1.0)
    out = (va * wa[:, None] + vb * wb[:, None]) / l_safe[:, None]
    lse = tl.where(nonempty, m_ref + tl.log(l_safe), float("-inf"))
    tl.store(o_ptr + r64 * stride_or + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=h_mask[:, None])
    tl.store(lse_ptr + r64 * stride_lr + heads, lse, mask=h_mask)
