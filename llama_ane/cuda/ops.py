"""Checked wrappers around the Triton kernels: validate inputs, choose splits, launch.

Conventions shared by every op:

* ``q`` is ``[batch, num_qo_heads, head_dim]``, fp16 or bf16, last dim contiguous.
* The paged KV cache is NHD: ``kv_cache[pages, 2, page_size, num_kv_heads, head_dim]``.
* Page tables are int32 CSR arrays as in FlashInfer: ``indptr[batch + 1]``, ``indices[nnz]`` and
  ``last_page_len[batch]`` (tokens used in each request's last page, 1..page_size).
* LSE is natural-log, float32 (FlashInfer's is base 2: see :func:`lse_base2_to_natural`).
* ``num_qo_heads`` must be a multiple of ``num_kv_heads`` (MHA when equal, GQA otherwise).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import triton

from . import kernels
from .lse import LOG2E
from .splits import choose_decode_splits, choose_prefix_splits, prefix_block_m

_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 128)


@lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached)."""
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_q_kv(q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Validate ``q`` and the paged cache; return (batch, Hq, Hkv, D, page_size)."""
    _check(q.is_cuda and kv_cache.is_cuda, "q and kv_cache must be CUDA tensors")
    _check(q.device == kv_cache.device, f"q is on {q.device} but kv_cache on {kv_cache.device}")
    _check(q.dim() == 3, f"q must be [batch, num_qo_heads, head_dim], got shape {tuple(q.shape)}")
    _check(kv_cache.dim() == 5 and kv_cache.shape[1] == 2,
           "kv_cache must be NHD [pages, 2, page_size, num_kv_heads, head_dim], "
           f"got shape {tuple(kv_cache.shape)}")
    _check(q.dtype in _DTYPES, f"q must be float16 or bfloat16, got {q.dtype}")
    _check(kv_cache.dtype == q.dtype, f"kv_cache dtype {kv_cache.dtype} != q dtype {q.dtype}")
    batch, hq, d = q.shape
    _, _, page_size, hkv, d_kv = kv_cache.shape
    _check(d == d_kv, f"head_dim of q ({d}) and kv_cache ({d_kv}) differ")
    _check(d in _HEAD_DIMS, f"head_dim must be one of {_HEAD_DIMS}, got {d}")
    _check(hq % hkv == 0, f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    _check(q.stride(2) == 1, "q's last dim must be contiguous")
    _check(kv_cache.stride(4) == 1 and kv_cache.stride(3) == d,
           "kv_cache's last two dims must be contiguous")
    return batch, hq, hkv, d, page_size


def _check_table(name: str, t: torch.Tensor, device: torch.device, length: int | None) -> None:
    _check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _check(t.device == device, f"{name} is on {t.device}, expected {device}")
    _check(t.dim() == 1 and t.is_contiguous(), f"{name} must be a contiguous 1-D tensor")
    if length is not None:
        _check(t.numel() == length, f"{name} must have {length} entries, got {t.numel()}")


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _state_buffers(batch: int, n_states: int, hq: int, d: int, device) -> tuple:
    # fp32 partial states: merging splits in fp16 would lose the precision the split saved.
    return (torch.empty(batch, n_states, hq, d, dtype=torch.float32, device=device),
            torch.empty(batch, n_states, hq, dtype=torch.float32, device=device))


def _decode_block_g(group: int) -> int:
    # tl.dot needs M >= 16: the group's rows are padded up to a tensor-core tile
    return max(16, triton_next_pow2(group))


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _layout_args(q, kv_cache, o_buf, lse_buf) -> tuple:
    """Strides the decode and shared-prefix kernels take, in their parameter order."""
    return (q.stride(0), q.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            o_buf.stride(0), o_buf.stride(1), o_buf.stride(2),
            lse_buf.stride(0), lse_buf.stride(1))


def decode_config(group: int) -> dict:
    """Launch parameters of the decode kernel (the sweeps are in benchmarks/results/cuda_notes.md).

    ``BLOCK_G`` is the row tile of the query heads of one kv head: 1 selects the broadcast path,
    >= 16 the tensor-core path (rows past the group are padding). The tensor-core tile wins even
    for MHA, where 15 of 16 rows are padding: it streams the cache closer to peak bandwidth.
    """
    return dict(BLOCK_G=_decode_block_g(group), BLOCK_N=64, num_warps=4, num_stages=3)


def launch_decode(q, kv_cache, indptr, indices, last_page_len, o_buf, lse_buf, state_offset: int,
                  num_splits: int, chunk_len: int, sm_scale: float,
                  config: dict | None = None, merge_from: tuple | None = None) -> None:
    """Launch the paged decode kernel into state slots ``[state_offset, state_offset + splits)``.

    ``o_buf`` is ``[batch, slots, Hq, D]`` (or ``[batch, Hq, D]`` viewed with one slot) and
    ``lse_buf`` ``[batch, slots, Hq]``. ``merge_from = (o_states, lse_states, n)`` merges the
    first ``n`` states of those ``[batch, slots, Hq(, D)]`` buffers into the result (one split
    only). No checks: callers have validated the inputs.
    """
    batch, hq, d = q.shape
    _, _, page_size, hkv, _ = kv_cache.shape
    group = hq // hkv
    cfg = decode_config(group) if config is None else config
    if merge_from is None:
        pre_o, pre_lse, n_pre = lse_buf, lse_buf, 0
        pre_strides = (0, 0, 0, 0, 0)
    else:
        pre_o, pre_lse, n_pre = merge_from
        pre_strides = (pre_o.stride(0), pre_o.stride(1), pre_o.stride(2), pre_lse.stride(0),
                       pre_lse.stride(1))
    grid = (batch, hkv, num_splits)
    kernels.paged_decode_kernel[grid](
        q, kv_cache, indptr, indices, last_page_len, o_buf, lse_buf,
        *_layout_args(q, kv_cache, o_buf, lse_buf),
        state_offset, sm_scale * LOG2E, chunk_len,
        pre_o, pre_lse, n_pre, *pre_strides,
        GROUP=group, BLOCK_G=cfg.get("BLOCK_G") or _decode_block_g(group), HEAD_DIM=d,
        PAGE_SIZE=page_size, BLOCK_N=cfg["BLOCK_N"], MERGE_PREFIX=merge_from is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def prefix_config() -> dict:
    """Launch parameters of the shared-prefix kernel, the same for every row tile (8 warps,
    128-key blocks and 256-row tiles were all slower: benchmarks/results/cuda_notes.md)."""
    return dict(BLOCK_N=64, num_warps=4, num_stages=3)


def launch_shared_prefix(q, kv_cache, prefix_indices, prefix_len: int, o_buf, lse_buf,
                         state_offset: int, num_splits: int, chunk_len: int,
                         sm_scale: float, config: dict | None = None):
    """Launch the shared-prefix kernel into state slots ``[state_offset, state_offset + splits)``;
    returns Triton's compiled-kernel handle (registers, spills, shared memory).

    ``config`` overrides :func:`prefix_config` (BLOCK_N, num_warps, num_stages and optionally
    BLOCK_M and maxnreg) for tuning runs.
    """
    batch, hq, d = q.shape
    _, _, page_size, hkv, _ = kv_cache.shape
    group = hq // hkv
    n_rows = batch * group
    cfg = prefix_config() if config is None else config
    block_m = cfg.get("BLOCK_M") or prefix_block_m(n_rows)
    block_n = cfg["BLOCK_N"]
    grid = (triton.cdiv(n_rows, block_m), hkv, num_splits)
    extra = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}
    return kernels.shared_prefix_kernel[grid](
        q, kv_cache, prefix_indices, prefix_len, n_rows, o_buf, lse_buf,
        *_layout_args(q, kv_cache, o_buf, lse_buf),
        state_offset, sm_scale * LOG2E, chunk_len,
        GROUP=group, HEAD_DIM=d, PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        WHOLE_BLOCKS=prefix_len % block_n == 0 and chunk_len % block_n == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra,
    )


# the ordered-pages (TMA) prefix kernel's tile: the best at most GQA grid points of
# benchmarks/prefix_tma_gpu.py, and close to it at the others
ORDERED_PREFIX_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)


def ordered_prefix_fits(kv_cache: torch.Tensor, prefix_len: int, page_offset: int = 0) -> bool:
    """Whether the bulk-copy prefix kernel can read ``prefix_len`` tokens of this cache from page
    ``page_offset`` on: whole 64-key blocks, pages of a power-of-two size, strides a copy
    descriptor accepts, and the pages inside the cache."""
    page_size = kv_cache.shape[2]
    block_n = ORDERED_PREFIX_CONFIG["BLOCK_N"]
    elem = kv_cache.element_size()
    return (prefix_len % block_n == 0 and page_size & (page_size - 1) == 0
            and (page_size <= block_n or page_size % block_n == 0)
            and 0 <= page_offset and page_offset * page_size + prefix_len
            <= kv_cache.shape[0] * page_size
            and kv_cache.stride(4) == 1 and kv_cache.data_ptr() % 16 == 0
            and all(kv_cache.stride(i) * elem % 16 == 0 for i in range(4)))


def launch_ordered_prefix(q, kv_cache, prefix_len: int, o_buf, lse_buf, state_offset: int,
                          num_splits: int, chunk_len: int, sm_scale: float, page_offset: int = 0,
                          config: dict | None = None):
    """Launch the ordered-pages prefix kernel (the prefix is the cache's pages ``page_offset``,
    ``page_offset + 1``, ... in order; :func:`ordered_prefix_fits` holds and ``chunk_len`` is a
    multiple of the key block); returns Triton's compiled-kernel handle.

    ``config`` overrides :data:`ORDERED_PREFIX_CONFIG` (``BLOCK_M``, ``BLOCK_N``, ``num_warps``,
    ``num_stages`` and optionally ``maxnreg``) for tuning runs.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, hq, d = q.shape
    _, _, page_size, hkv, _ = kv_cache.shape
    group = hq // hkv
    n_rows = batch * group
    cfg = ORDERED_PREFIX_CONFIG if config is None else config
    block_n = cfg["BLOCK_N"]
    block = [block_n // page_size, 1, page_size, 1, d] if page_size <= block_n else \
        [1, 1, block_n, 1, d]
    desc = TensorDescriptor(kv_cache, list(kv_cache.shape), list(kv_cache.stride()), block)
    grid = (triton.cdiv(n_rows, cfg["BLOCK_M"]), hkv, num_splits)
    extra = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}
    return kernels.ordered_prefix_kernel[grid](
        q, desc, page_offset, prefix_len, n_rows, o_buf, lse_buf,
        q.stride(0), q.stride(1), o_buf.stride(0), o_buf.stride(1), o_buf.stride(2),
        lse_buf.stride(0), lse_buf.stride(1),
        state_offset, sm_scale * LOG2E, chunk_len,
        GROUP=group, HEAD_DIM=d, PAGE_SIZE=page_size, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=block_n,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra,
    )


# the fused cascade (prefix, short suffixes and merge in one launch): suffixes up to this many
# tokens, read in key blocks of FUSED_SUFFIX_BLOCK_N with a pipeline of FUSED_SUFFIX_STAGES (the
# best of the block and depth sweep of benchmarks/results/cuda_notes.md; deeper K/V buffers of
# the suffix loop leave room for only one program an SM)
FUSED_MAX_SUFFIX = 256
FUSED_SUFFIX_BLOCK_N = 128
FUSED_SUFFIX_STAGES = 2


def launch_fused_cascade(q, kv_cache, prefix_indices, page_offset: int | None, prefix_len: int,
                         suffix_indptr, suffix_indices, suffix_last_page_len, max_suffix: int,
                         out, out_lse, st_o, st_lse, counts, num_splits: int, chunk_len: int,
                         sm_scale: float, config: dict | None = None):
    """Launch the one-launch cascade (``kernels.fused_cascade_kernel``): the prefix by bulk
    copies from consecutive pages starting at ``page_offset``, or through ``prefix_indices``
    when ``page_offset`` is None. ``st_o``/``st_lse`` are ``[batch, num_splits + 1, Hq(, D)]``
    fp32 state buffers, ``counts`` an int32 zero per (row tile, kv head), left zero. Whole
    64-key blocks only (``prefix_len`` and ``chunk_len``). ``config`` is the prefix tile, with
    optional ``suffix_block_n``, ``suffix_stages`` and ``order`` (the kernel's ``ORDER``).
    Returns Triton's compiled-kernel handle."""
    batch, hq, d = q.shape
    _, _, page_size, hkv, _ = kv_cache.shape
    group = hq // hkv
    n_rows = batch * group
    ordered = page_offset is not None
    if config is None:
        config = ORDERED_PREFIX_CONFIG if ordered else dict(prefix_config(),
                                                            BLOCK_M=prefix_block_m(n_rows))
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    if ordered:
        from triton.tools.tensor_descriptor import TensorDescriptor

        block = [block_n // page_size, 1, page_size, 1, d] if page_size <= block_n else \
            [1, 1, block_n, 1, d]
        desc = TensorDescriptor(kv_cache, list(kv_cache.shape), list(kv_cache.stride()), block)
    else:
        desc = kv_cache
    grid = (triton.cdiv(n_rows, block_m), hkv, num_splits)
    extra = {"maxnreg": config["maxnreg"]} if config.get("maxnreg") else {}
    suffix_block_n = config.get("suffix_block_n", FUSED_SUFFIX_BLOCK_N)
    suffix_blocks = triton.cdiv(max(max_suffix, 1), suffix_block_n)
    return kernels.fused_cascade_kernel[grid](
        q, kv_cache, desc, prefix_indices, page_offset or 0, prefix_len, n_rows,
        suffix_indptr, suffix_indices, suffix_last_page_len,
        suffix_blocks,
        out, out_lse, st_o, st_lse, counts,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        out.stride(0), out.stride(1), out_lse.stride(0),
        st_o.stride(0), st_o.stride(1), st_o.stride(2), st_lse.stride(0), st_lse.stride(1),
        sm_scale * LOG2E, chunk_len, num_splits, batch,
        GROUP=group, BLOCK_G=_decode_block_g(group), HEAD_DIM=d, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        SUFFIX_BLOCK_N=suffix_block_n,
        SUFFIX_STAGES=config.get("suffix_stages", FUSED_SUFFIX_STAGES), ORDERED=ordered,
        ORDER=config.get("order", 0),
        num_warps=config["num_warps"], num_stages=config["num_stages"], **extra,
    )


def launch_merge(v: torch.Tensor, s: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 indptr: torch.Tensor | None = None) -> None:
    """Launch the n-ary merge: fixed count ``v[rows, n, H, D]``, or varlen ``v[states, H, D]``."""
    varlen = indptr is not None
    if varlen:
        rows = indptr.numel() - 1
        n_states, heads, d = 0, v.shape[1], v.shape[2]
        svr, svn, svh = 0, v.stride(0), v.stride(1)
        ssr, ssn, ssh = 0, s.stride(0), s.stride(1)
    else:
        rows, n_states, heads, d = v.shape
        svr, svn, svh = v.stride(0), v.stride(1), v.stride(2)
        ssr, ssn, ssh = s.stride(0), s.stride(1), s.stride(2)
    if rows == 0:
        return
    kernels.merge_states_kernel[(rows, heads)](
        v, s, indptr if varlen else s, out, lse, n_states, heads,
        svr, svn, svh, ssr, ssn, ssh, out.stride(0), out.stride(1), lse.stride(0),
        HEAD_DIM=d, BLOCK_S=8 if varlen or n_states > 4 else 4, VARLEN=varlen, num_warps=2,
    )


# --------------------------------------------------------------------------------------------
# public ops
# --------------------------------------------------------------------------------------------


def batch_decode(q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                 kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *,
                 sm_scale: float | None = None, num_splits: int | None = None,
                 max_seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged batch decode with LSE: one query token per request against its own KV pages.

    Parameters
    ----------
    q : [batch, num_qo_heads, head_dim] fp16/bf16
    kv_cache : [pages, 2, page_size, num_kv_heads, head_dim], same dtype
    kv_indptr : int32 [batch + 1]
    kv_indices : int32 [kv_indptr[-1]]
    kv_last_page_len : int32 [batch], each in 1..page_size for non-empty requests
    sm_scale : softmax scale, default ``1 / sqrt(head_dim)``
    num_splits : KV splits per request; default from the batch, the sequence length and the GPU
    max_seq_len : longest sequence, if known (avoids a device-to-host copy)

    Returns
    -------
    o : [batch, num_qo_heads, head_dim], dtype of q
    lse : [batch, num_qo_heads] float32, natural log; ``-inf`` for an empty request
    """
    batch, hq, hkv, d, page_size = _check_q_kv(q, kv_cache)
    _check_table("kv_indptr", kv_indptr, q.device, batch + 1)
    _check_table("kv_indices", kv_indices, q.device, None)
    _check_table("kv_last_page_len", kv_last_page_len, q.device, batch)
    if max_seq_len is None:
        max_seq_len = int(((kv_indptr[1:] - kv_indptr[:-1]).max().item()) * page_size) if batch else 0
    sm_scale = default_scale(d) if sm_scale is None else sm_scale
    splits, chunk = choose_decode_splits(batch, hkv, max_seq_len, num_sms(q.device), num_splits)
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    if splits == 1:
        launch_decode(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len,
                      out.unsqueeze(1), lse.unsqueeze(1), 0, 1, chunk, sm_scale)
        return out, lse
    o_buf, lse_buf = _state_buffers(batch, splits, hq, d, q.device)
    launch_decode(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, o_buf, lse_buf, 0,
                  splits, chunk, sm_scale)
    launch_merge(o_buf, lse_buf, out, lse)
    return out, lse


def shared_prefix_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                            prefix_indices: torch.Tensor | None, prefix_len: int, *,
                            sm_scale: float | None = None,
                            num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query attention of every query against one shared paged KV sequence, with LSE.

    Parameters
    ----------
    q : [batch, num_qo_heads, head_dim] fp16/bf16: one query token per request
    kv_cache : [pages, 2, page_size, num_kv_heads, head_dim]
    prefix_indices : int32 [ceil(prefix_len / page_size)]: the prefix's pages in order; None:
        the prefix is the cache's first pages in order (read by bulk tensor copies where
        :func:`ordered_prefix_fits`)
    prefix_len : number of prefix tokens (>= 0)
    sm_scale : default ``1 / sqrt(head_dim)``
    num_splits : KV splits of the prefix; default chosen to fill the GPU

    Returns
    -------
    o : [batch, num_qo_heads, head_dim], dtype of q
    lse : [batch, num_qo_heads] float32 (natural log)
    """
    batch, hq, hkv, d, page_size = _check_q_kv(q, kv_cache)
    ordered = prefix_indices is None and ordered_prefix_fits(kv_cache, prefix_len)
    if prefix_indices is None:
        _check(kv_cache.shape[0] * page_size >= prefix_len >= 0,
               f"prefix_len {prefix_len} needs {math.ceil(prefix_len / page_size)} pages, "
               f"the cache has {kv_cache.shape[0]}")
        if not ordered:
            prefix_indices = torch.arange(-(-prefix_len // page_size), device=q.device,
                                          dtype=torch.int32)
    else:
        _check_table("prefix_indices", prefix_indices, q.device, None)
        _check(prefix_indices.numel() * page_size >= prefix_len >= 0,
               f"prefix_len {prefix_len} needs {math.ceil(prefix_len / page_size)} pages, "
               f"got {prefix_indices.numel()}")
    sm_scale = default_scale(d) if sm_scale is None else sm_scale
    n_rows = batch * (hq // hkv)
    block_m = ORDERED_PREFIX_CONFIG["BLOCK_M"] if ordered else prefix_block_m(n_rows)
    splits, chunk = choose_prefix_splits(n_rows, block_m, hkv, prefix_len, num_sms(q.device),
                                         num_splits)
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse

    def launch(o_buf, lse_buf):
        if ordered:
            launch_ordered_prefix(q, kv_cache, prefix_len, o_buf, lse_buf, 0, splits, chunk,
                                  sm_scale)
        else:
            launch_shared_prefix(q, kv_cache, prefix_indices, prefix_len, o_buf, lse_buf, 0,
                                 splits, chunk, sm_scale)

    if splits == 1:
        launch(out.unsqueeze(1), lse.unsqueeze(1))
        return out, lse
    o_buf, lse_buf = _state_buffers(batch, splits, hq, d, q.device)
    launch(o_buf, lse_buf)
    launch_merge(o_buf, lse_buf, out, lse)
    return out, lse


def _check_state(name: str, v: torch.Tensor, s: torch.Tensor) -> None:
    _check(v.is_cuda and s.is_cuda, f"{name}: states must be CUDA tensors")
    _check(v.dim() == 3, f"{name}: v must be [rows, num_heads, head_dim], got {tuple(v.shape)}")
    _check(s.shape == v.shape[:2], f"{name}: s must be {tuple(v.shape[:2])}, got {tuple(s.shape)}")
    _check(s.dtype == torch.float32, f"{name}: s must be float32, got {s.dtype}")
    _check(v.dtype in _DTYPES + (torch.float32,), f"{name}: v must be fp16/bf16/fp32")
    _check(v.stride(2) == 1 and s.stride(1) == 1, f"{name}: last dims must be contiguous")
    _check(v.shape[2] in (64, 128, 256), f"{name}: head_dim must be 64, 128 or 256")


def _launch_merge_two(v_a, s_a, v_b, s_b, out, lse) -> None:
    rows, heads, d = v_a.shape
    if rows == 0:
        return
    block_h = min(triton_next_pow2(heads), 8 if d <= 128 else 4)
    kernels.merge_two_states_kernel[(rows, triton.cdiv(heads, block_h))](
        v_a, s_a, v_b, s_b, out, lse, heads,
        v_a.stride(0), v_a.stride(1), s_a.stride(0),
        v_b.stride(0), v_b.stride(1), s_b.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        HEAD_DIM=d, BLOCK_H=block_h, num_warps=4,
    )


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets.

    Parameters
    ----------
    v_a, v_b : [rows, num_heads, head_dim] fp16/bf16/fp32, same shape
    s_a, s_b : [rows, num_heads] float32, natural-log LSE

    Returns
    -------
    v : [rows, num_heads, head_dim], dtype of v_a
    s : [rows, num_heads] float32
    """
    _check_state("merge_state(a)", v_a, s_a)
    _check_state("merge_state(b)", v_b, s_b)
    _check(v_a.shape == v_b.shape and v_a.device == v_b.device,
           "merge_state: the two states differ in shape or device")
    out = torch.empty_like(v_a)
    lse = torch.empty_like(s_a)
    _launch_merge_two(v_a, s_a, v_b, s_b, out, lse)
    return out, lse


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor,
                         s_other: torch.Tensor) -> None:
    """``(v, s) <- (v, s) (+) (v_other, s_other)``, writing into ``v`` and ``s``.

    Shapes as in :func:`merge_state`.
    """
    _check_state("merge_state_in_place", v, s)
    _check_state("merge_state_in_place(other)", v_other, s_other)
    _check(v.shape == v_other.shape and v.device == v_other.device,
           "merge_state_in_place: the two states differ in shape or device")
    _launch_merge_two(v, s, v_other, s_other, v, s)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """N-ary merge: ``v[r, 0] (+) v[r, 1] (+) ... (+) v[r, n-1]`` for every row ``r``.

    Parameters
    ----------
    v : [rows, num_states, num_heads, head_dim] fp16/bf16/fp32
    s : [rows, num_states, num_heads] float32, natural-log LSE

    Returns
    -------
    v : [rows, num_heads, head_dim], dtype of the input v
    s : [rows, num_heads] float32
    """
    _check(v.is_cuda and s.is_cuda, "merge_states: states must be CUDA tensors")
    _check(v.dim() == 4 and s.shape == v.shape[:3],
           f"merge_states: v must be [rows, n, H, D] and s [rows, n, H]; got {tuple(v.shape)}, "
           f"{tuple(s.shape)}")
    _check(s.dtype == torch.float32, "merge_states: s must be float32")
    _check(v.stride(3) == 1 and s.stride(2) == 1, "merge_states: last dims must be contiguous")
    _check(v.shape[3] in (64, 128, 256), "merge_states: head_dim must be 64, 128 or 256")
    rows, _, heads, d = v.shape
    out = torch.empty(rows, heads, d, dtype=v.dtype, device=v.device)
    lse = torch.empty(rows, heads, dtype=torch.float32, device=v.device)
    launch_merge(v, s, out, lse)
    return out, lse



def tree_attention(q: torch.Tensor, kv_cache: torch.Tensor, plan,
                   sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-level (tree) attention: each query against its node's and its ancestors' tokens.

    Two launches whatever the depth of the tree: the flattened-block kernel, then a varlen merge.

    Parameters
    ----------
    q : [n_queries, num_qo_heads, head_dim] fp16/bf16
    kv_cache : [pages, 2, page_size, num_kv_heads, head_dim]
    plan : :class:`~llama_ane.cuda.tree.TreePlan` from ``build_tree_plan`` (on q's device),
        built with ``group = num_qo_heads // num_kv_heads``

    Returns
    -------
    o : [n_queries, num_qo_heads, head_dim], dtype of q
    lse : [n_queries, num_qo_heads] float32 (natural log)
    """
    n, hq, hkv, d, page_size = _check_q_kv(q, kv_cache)
    _check(plan.n_queries == n, f"plan has {plan.n_queries} queries but q has {n}")
    _check(plan.group == hq // hkv, f"plan was built for group {plan.group}, q/kv give {hq // hkv}")
    _check(plan.tok_loc.device == q.device, f"plan is on {plan.tok_loc.device}, q on {q.device}")
    sm_scale = default_scale(d) if sm_scale is None else sm_scale
    o_part = torch.empty(plan.n_pairs, hq, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(plan.n_pairs, hq, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty(n, hq, dtype=torch.float32, device=q.device)
    if plan.n_items:
        kernels.tree_attention_kernel[(plan.n_items, hkv)](
            q, kv_cache, plan.tok_loc, plan.item_tok_start, plan.item_tok_len,
            plan.item_pair_start, plan.item_nq, plan.item_full, plan.pair_query, plan.pair_slot,
            plan.mask, o_part, lse_part,
            q.stride(0), q.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            o_part.stride(0), o_part.stride(1), lse_part.stride(0),
            sm_scale * LOG2E,
            GROUP=plan.group, HEAD_DIM=d, PAGE_SIZE=page_size, BLOCK_M=plan.block_m, BLOCK_N=64,
            MASK_WORDS=plan.mask_words, num_warps=8 if plan.block_m >= 128 else 4, num_stages=3,
        )
    launch_merge(o_part, lse_part, out, lse, indptr=plan.query_indptr)
    return out, lse
