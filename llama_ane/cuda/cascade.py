"""Two-level cascade for shared-prefix batch decoding, with per-call auto-dispatch.

As FlashInfer's wrappers, :class:`SharedPrefixBatch` is built once for an attention shape and
then used in two steps: ``plan`` (host work once per decode step: page tables, split counts, the
cascade-or-decode decision) and ``run`` (launches only, once per layer). The partial-state
buffers, the plain-decode page lists and the side stream live on the object and are reused by
later plans, grown only when a plan needs more.
"""

from __future__ import annotations

import math

import torch

from ..errors import InvalidArgumentError, LlamaANEError
from . import ops
from .cost_model import DEFAULT_COST_MODEL, CostModel
from .splits import (choose_decode_splits, choose_overlap_prefix_splits, choose_prefix_splits,
                     consecutive_first_page, prefix_block_m)

PATHS = ("auto", "cascade", "decode")
PREFIX_KERNELS = ("auto", "paged", "ordered")
# Prefix work above which the prefix tiles run on a side stream next to the suffix decode (three
# launches) instead of before a decode that merges their states (two launches): ~50 us of tensor
# work, enough to hide the third launch behind the overlap.
OVERLAP_MIN_FLOPS = 2e10
# The one-launch (fused) cascade for short suffixes when the kv groups have at least this many
# query heads: with few suffix bytes per prefix flop the suffix streams behind the other
# program's tensor work on the same SM (benchmarks/results/cuda_notes.md).
FUSED_MIN_GROUP = 4
# the paged prefix tile of the fused cascade (a 128-row tile with the suffix part spills)
FUSED_PAGED_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)


class SharedPrefixBatch:
    """A batch of requests that share one prefix and each own a suffix, in one paged KV cache.

    Build it once per attention shape; call :meth:`plan` whenever the batch's page tables change
    (once per decode step, or once per generation over pages reserved ahead with
    :meth:`set_suffix_lengths` moving the lengths) and :meth:`run` once per layer.

    Parameters
    ----------
    num_qo_heads, num_kv_heads, head_dim, page_size : attention shape
    device : the CUDA device of the page tables, the cache and the queries
    path : ``"auto"`` (cost model, per plan), ``"cascade"`` or ``"decode"``
    cost_model : constants of the auto decision
    sm_scale : default ``1 / sqrt(head_dim)``
    elem_bytes : bytes per cache element, for the cost model
    config, prefix_splits, decode_splits : launch overrides for tuning runs (default: the tuned
        choices; ``decode_splits`` applies to the suffix of the cascade and to plain decode):
        ``{"prefix": {...}, "decode": {...}, "overlap": bool, "prefix_kernel": str,
        "fused": bool}``, where ``prefix_kernel`` is ``"auto"`` (bulk tensor copies when the
        prefix lies on consecutive pages, the paged kernel otherwise), ``"paged"`` or
        ``"ordered"`` (consecutive pages required), ``prefix`` is the tile of whichever prefix
        kernel runs, and ``fused`` asks for (or refuses) the one-launch cascade where it
        applies (whole 64-key prefix blocks, suffixes of at most ``ops.FUSED_MAX_SUFFIX``)

    Plain decode needs one page list per request, prefix pages first; that requires a prefix that
    ends on a page boundary. Otherwise ``auto`` uses the cascade and ``decode`` is refused.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
                 device: torch.device | str = "cuda", path: str = "auto",
                 cost_model: CostModel = DEFAULT_COST_MODEL, sm_scale: float | None = None,
                 elem_bytes: int = 2, config: dict | None = None,
                 prefix_splits: int | None = None, decode_splits: int | None = None) -> None:
        if path not in PATHS:
            raise InvalidArgumentError(f"path must be one of {PATHS}, got {path!r}")
        if num_qo_heads % num_kv_heads:
            raise InvalidArgumentError(f"num_qo_heads {num_qo_heads} is not a multiple of "
                                       f"num_kv_heads {num_kv_heads}")
        device = torch.device(device)
        if device.type != "cuda":
            raise InvalidArgumentError(f"SharedPrefixBatch runs on a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size = page_size
        self.sm_scale = ops.default_scale(head_dim) if sm_scale is None else sm_scale
        self.elem_bytes = elem_bytes
        self.cost_model = cost_model
        self.config = config
        self.requested_path = path
        self._prefix_splits, self._decode_splits = prefix_splits, decode_splits
        self._num_sms = ops.num_sms(device)
        self._stores: dict[str, torch.Tensor] = {}  # flat buffers that plans take views of
        self.side_stream: torch.cuda.Stream | None = None  # made by the first overlapped plan
        self.path: str | None = None  # the planned path; None until a plan succeeds
        self.batch = 0

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape`` view of the flat buffer ``name``, made larger only when a plan
        needs more than it holds (a fresh tensor of that shape has the same strides)."""
        n = math.prod(shape)
        store = self._stores.get(name)
        if store is None or store.numel() < n or store.dtype != dtype:
            store = torch.empty(n, dtype=dtype, device=self.device)
            self._stores[name] = store
        return store[:n].view(shape)

    def plan(self, prefix_indices: torch.Tensor, prefix_len: int, suffix_indptr: torch.Tensor,
             suffix_indices: torch.Tensor, suffix_last_page_len: torch.Tensor) -> None:
        """Plan the next :meth:`run` calls for one batch (host work: reads the tables back).

        Parameters
        ----------
        prefix_indices : int32 [n_prefix_pages]: the shared prefix's pages
        prefix_len : tokens in the prefix
        suffix_indptr, suffix_indices, suffix_last_page_len : int32 CSR page table of the
            suffixes ([batch + 1], [nnz], [batch]); every request's query attends to prefix + its
            suffix. The plan keeps these tensors: :meth:`run` reads them on the GPU, and
            :meth:`set_suffix_lengths` writes ``suffix_last_page_len``.

        A CUDA graph captured over :meth:`run` replays the plan it was captured with: it follows
        :meth:`set_suffix_lengths`, but another ``plan`` (other split counts, grids and tables)
        needs a new capture.
        """
        self.path = None  # a plan that fails part-way leaves nothing to run
        device = self.device
        for name, t in (("prefix_indices", prefix_indices), ("suffix_indptr", suffix_indptr),
                        ("suffix_indices", suffix_indices),
                        ("suffix_last_page_len", suffix_last_page_len)):
            if t.dtype != torch.int32 or t.device != device or t.dim() != 1:
                raise InvalidArgumentError(f"{name} must be a 1-D int32 tensor on {device}, got "
                                           f"{t.dtype} {tuple(t.shape)} on {t.device}")
        num_qo_heads, num_kv_heads, head_dim = self.num_qo_heads, self.num_kv_heads, self.head_dim
        page_size, elem_bytes, sms = self.page_size, self.elem_bytes, self._num_sms
        cost_model, config = self.cost_model, self.config
        self.batch = suffix_indptr.numel() - 1
        self.prefix_len = int(prefix_len)
        self.prefix_indices = prefix_indices
        self.suffix = (suffix_indptr, suffix_indices, suffix_last_page_len)
        self._listed_before_last = None  # set_suffix_lengths' per-request offsets, made once

        indptr_h = suffix_indptr.cpu()
        last_h = suffix_last_page_len.cpu()
        counts = indptr_h[1:] - indptr_h[:-1]
        lengths = torch.where(counts > 0, (counts - 1) * page_size + last_h, 0)
        self.max_suffix = int(lengths.max()) if self.batch else 0
        mean_suffix = float(lengths.float().mean()) if self.batch else 0.0
        aligned = self.prefix_len % page_size == 0

        path = self.requested_path
        if path == "auto":
            path = "cascade" if not aligned else cost_model.choose(
                self.batch, self.prefix_len, mean_suffix, num_qo_heads, num_kv_heads, head_dim,
                elem_bytes, num_sms=sms)
        if path == "decode" and not aligned:
            raise InvalidArgumentError(
                f"plain decode needs a page-aligned prefix; prefix_len {self.prefix_len} is not a "
                f"multiple of page_size {page_size} (use path 'cascade' or 'auto')")

        self.overlap = self.fused = False
        self.o_buf = self.lse_buf = None
        self.prefix_page0 = None  # first page of a prefix on consecutive pages (bulk copies)
        if path == "cascade":
            group = num_qo_heads // num_kv_heads
            rows = self.batch * group
            flops = 4.0 * rows * num_kv_heads * self.prefix_len * head_dim
            fused = (config or {}).get("fused")
            auto_fused = fused is None
            if auto_fused:  # an explicit overlap choice keeps its two-kernel schedule
                fused = ("overlap" not in (config or {}) and group >= FUSED_MIN_GROUP
                         and flops >= OVERLAP_MIN_FLOPS)
            self.fused = bool(fused and 0 < self.prefix_len and self.prefix_len % 64 == 0
                              and self.max_suffix <= ops.FUSED_MAX_SUFFIX)
            kernel = (config or {}).get("prefix_kernel", "auto")
            if kernel not in PREFIX_KERNELS:
                raise InvalidArgumentError(f"prefix_kernel must be one of {PREFIX_KERNELS}, "
                                           f"got {kernel!r}")
            tile = (config or {}).get("prefix") or {}
            if kernel != "paged":
                n_pages = -(-self.prefix_len // page_size)
                block_n = tile.get("BLOCK_N", ops.ORDERED_PREFIX_CONFIG["BLOCK_N"])
                if self.prefix_len > 0 and self.prefix_len % block_n == 0:
                    self.prefix_page0 = consecutive_first_page(
                        prefix_indices[:n_pages].tolist())
                if kernel == "ordered" and self.prefix_page0 is None:
                    raise InvalidArgumentError(
                        "prefix_kernel 'ordered' needs the prefix on consecutive pages and whole "
                        f"{ops.ORDERED_PREFIX_CONFIG['BLOCK_N']}-key blocks")
            if auto_fused and self.prefix_page0 is None:
                # the fused cascade's paged prefix tile (64 rows) is slower than the paged
                # kernel's 128-row tile by more than the fusion saves
                self.fused = False
            if self.fused and not tile:
                tile = ops.ORDERED_PREFIX_CONFIG if self.prefix_page0 is not None else \
                    FUSED_PAGED_CONFIG
            self.fused_tile = tile if self.fused else None
            if self.prefix_page0 is not None:
                block_m = tile.get("BLOCK_M") or ops.ORDERED_PREFIX_CONFIG["BLOCK_M"]
            else:
                block_m = tile.get("BLOCK_M") or prefix_block_m(rows)
            if block_m % group:
                # a request's rows would straddle two tiles, whose merges then race
                self.fused = False
            self.overlap = not self.fused and bool((config or {}).get(
                "overlap", flops >= OVERLAP_MIN_FLOPS))
            if self.overlap and self.side_stream is None:
                self.side_stream = torch.cuda.Stream(device, priority=-1)
            if self.overlap and self._prefix_splits is None:
                # as many prefix programs as leave the suffix decode room to run beside them
                self.prefix_splits, self.prefix_chunk = choose_overlap_prefix_splits(
                    rows, block_m, num_kv_heads, self.prefix_len, sms,
                    cost_model.prefix_time(self.batch, self.prefix_len, num_qo_heads,
                                           num_kv_heads, head_dim, elem_bytes),
                    cost_model.suffix_time(self.batch, mean_suffix, num_kv_heads, head_dim,
                                           elem_bytes))
            else:
                self.prefix_splits, self.prefix_chunk = choose_prefix_splits(
                    rows, block_m, num_kv_heads, self.prefix_len, sms, self._prefix_splits)
            if self.prefix_chunk % tile.get("BLOCK_N", ops.ORDERED_PREFIX_CONFIG["BLOCK_N"]):
                # a split would end inside a key block (no choice of splits makes one)
                self.prefix_page0 = None
                self.fused = False
            if not self.fused:
                self.fused_tile = None
            if self.fused:
                self.suffix_splits, self.suffix_chunk = 1, self.max_suffix
                self._state_buffers(self.prefix_splits + 1)
                tiles = -(-rows // block_m) * num_kv_heads
                self.counts = self._buffer("counts", (tiles,), torch.int32).zero_()
            else:
                self.suffix_splits, self.suffix_chunk = choose_decode_splits(
                    self.batch, num_kv_heads, self.max_suffix, sms, self._decode_splits)
                self._state_buffers(self.prefix_splits + self.suffix_splits)
        else:
            # one page list per request: the shared prefix pages, then its own suffix pages
            n_prefix_pages = self.prefix_len // page_size
            prefix_h = prefix_indices[:n_prefix_pages].cpu()
            suffix_idx_h = suffix_indices.cpu()
            lists = [torch.cat([prefix_h, suffix_idx_h[indptr_h[b]:indptr_h[b + 1]]])
                     for b in range(self.batch)]
            full_counts = torch.tensor([r.numel() for r in lists], dtype=torch.int64)
            full_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), full_counts.cumsum(0)])
            full_indices = torch.cat(lists) if lists else torch.zeros(0)
            self.full_indptr = self._table("full_indptr", full_indptr)
            self.full_indices = self._table("full_indices", full_indices)
            self.full_last = self._table("full_last", torch.where(counts > 0, last_h, page_size))
            self.decode_splits, self.decode_chunk = choose_decode_splits(
                self.batch, num_kv_heads, self.prefix_len + self.max_suffix, sms,
                self._decode_splits)
            if self.decode_splits > 1:
                self._state_buffers(self.decode_splits)
        self.path = path

    def _table(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """``values`` (host) as int32 in the reused device buffer ``name``."""
        return self._buffer(name, tuple(values.shape), torch.int32).copy_(values.to(torch.int32))

    def _state_buffers(self, n_states: int) -> None:
        # fp32 partial states: merging splits in fp16 would lose the precision the split saved
        self.o_buf = self._buffer("o", (self.batch, n_states, self.num_qo_heads, self.head_dim),
                                  torch.float32)
        self.lse_buf = self._buffer("lse", (self.batch, n_states, self.num_qo_heads),
                                    torch.float32)

    def _require_plan(self) -> None:
        if self.path is None:
            raise LlamaANEError("SharedPrefixBatch has no plan: call plan(...) with the batch's "
                                "page tables first (a plan that raised leaves none)")

    def set_suffix_lengths(self, lengths: torch.Tensor) -> None:
        """Give every suffix a new length on its listed pages, without planning again.

        For a plan built once over pages reserved ahead (a decode loop, a CUDA graph): request
        ``b`` uses the first ``lengths[b]`` tokens of its listed suffix pages. The split choices
        and the cascade-or-decode decision stay those of the lengths the plan was built with.
        ``lengths`` is an int32 [batch] tensor on the plan's device; nothing is read back. The
        new values are written into the ``suffix_last_page_len`` tensor the plan was given.

        The kernels take a request's length as ``(pages - 1) * page_size + last_page_len``, so
        pages listed past the length give a ``last_page_len`` of 0 or below.
        """
        self._require_plan()
        if self._listed_before_last is None:  # tokens on the listed pages before the last one
            indptr = self.suffix[0]
            self._listed_before_last = (indptr[1:] - indptr[:-1] - 1) * self.page_size
        self.suffix[2].copy_(lengths - self._listed_before_last)
        if self.path == "decode":
            # full lists: the prefix's whole pages, then the same suffix pages
            self.full_last.copy_(self.suffix[2])

    def _launch_prefix(self, q, kv_cache, pre_cfg) -> None:
        """The prefix kernel into state slots ``[0, prefix_splits)``: bulk tensor copies when the
        plan found the prefix on consecutive pages and this cache's layout allows them."""
        ps, pc = self.prefix_splits, self.prefix_chunk
        if self.prefix_page0 is not None and ops.ordered_prefix_fits(kv_cache, self.prefix_len,
                                                                     self.prefix_page0):
            ops.launch_ordered_prefix(q, kv_cache, self.prefix_len, self.o_buf, self.lse_buf, 0,
                                      ps, pc, self.sm_scale, self.prefix_page0, pre_cfg)
        else:
            ops.launch_shared_prefix(q, kv_cache, self.prefix_indices, self.prefix_len,
                                     self.o_buf, self.lse_buf, 0, ps, pc, self.sm_scale,
                                     pre_cfg)

    def _run_cascade(self, q, kv_cache, out, lse) -> None:
        cfg = self.config or {}
        pre_cfg, dec_cfg = cfg.get("prefix"), cfg.get("decode")
        ps = self.prefix_splits
        if self.fused:
            page0 = self.prefix_page0
            if page0 is not None and not ops.ordered_prefix_fits(kv_cache, self.prefix_len, page0):
                page0 = None
            ops.launch_fused_cascade(q, kv_cache, self.prefix_indices, page0, self.prefix_len,
                                     *self.suffix, self.max_suffix, out, lse, self.o_buf,
                                     self.lse_buf, self.counts, ps, self.prefix_chunk,
                                     self.sm_scale, self.fused_tile)
            return
        if self.overlap:
            # prefix tiles (tensor cores) on a high-priority side stream, suffix decode (HBM) on
            # this one: the scheduler fills SM slots the prefix leaves free with decode programs
            # (128-key blocks: fewer, longer decode programs fit the gaps the prefix leaves)
            if dec_cfg is None:
                dec_cfg = dict(ops.decode_config(self.num_qo_heads // self.num_kv_heads),
                               BLOCK_N=128)
            cur = torch.cuda.current_stream(q.device)
            self.side_stream.wait_stream(cur)
            with torch.cuda.stream(self.side_stream):
                self._launch_prefix(q, kv_cache, pre_cfg)
            ops.launch_decode(q, kv_cache, *self.suffix, self.o_buf, self.lse_buf, ps,
                              self.suffix_splits, self.suffix_chunk, self.sm_scale, dec_cfg)
            cur.wait_stream(self.side_stream)
            ops.launch_merge(self.o_buf, self.lse_buf, out, lse)
            return
        self._launch_prefix(q, kv_cache, pre_cfg)
        if self.suffix_splits == 1:
            # two launches: the decode program merges the prefix states into its own
            ops.launch_decode(q, kv_cache, *self.suffix, out.unsqueeze(1), lse.unsqueeze(1), 0,
                              1, self.suffix_chunk, self.sm_scale, dec_cfg,
                              merge_from=(self.o_buf, self.lse_buf, ps))
        else:
            ops.launch_decode(q, kv_cache, *self.suffix, self.o_buf, self.lse_buf, ps,
                              self.suffix_splits, self.suffix_chunk, self.sm_scale, dec_cfg)
            ops.launch_merge(self.o_buf, self.lse_buf, out, lse)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of every request's query over prefix + its suffix, as last planned.

        Parameters
        ----------
        q : [batch, num_qo_heads, head_dim] fp16/bf16
        kv_cache : [pages, 2, page_size, num_kv_heads, head_dim]

        Returns
        -------
        o : [batch, num_qo_heads, head_dim], dtype of q
        lse : [batch, num_qo_heads] float32 (natural log)
        """
        self._require_plan()
        batch, hq, hkv, d, page_size = ops._check_q_kv(q, kv_cache)
        planned = (self.batch, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                   self.page_size)
        if (batch, hq, hkv, d, page_size) != planned:
            raise InvalidArgumentError(
                f"q/kv_cache shape (batch, Hq, Hkv, D, page) = {(batch, hq, hkv, d, page_size)} "
                f"does not match the plan's {planned}; plan again for this batch")
        if q.device != self.device:
            raise InvalidArgumentError(f"q is on {q.device}, the plan on {self.device}")
        out = torch.empty_like(q)
        lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
        if batch == 0:
            return out, lse
        if self.path == "cascade":
            self._run_cascade(q, kv_cache, out, lse)
        elif self.decode_splits == 1:
            ops.launch_decode(q, kv_cache, self.full_indptr, self.full_indices, self.full_last,
                              out.unsqueeze(1), lse.unsqueeze(1), 0, 1, self.decode_chunk,
                              self.sm_scale, (self.config or {}).get("decode"))
        else:
            ops.launch_decode(q, kv_cache, self.full_indptr, self.full_indices, self.full_last,
                              self.o_buf, self.lse_buf, 0, self.decode_splits, self.decode_chunk,
                              self.sm_scale, (self.config or {}).get("decode"))
            ops.launch_merge(self.o_buf, self.lse_buf, out, lse)
        return out, lse


def cascade_attention(q: torch.Tensor, kv_cache: torch.Tensor, prefix_indices: torch.Tensor,
                      prefix_len: int, suffix_indptr: torch.Tensor, suffix_indices: torch.Tensor,
                      suffix_last_page_len: torch.Tensor, *, sm_scale: float | None = None,
                      path: str = "cascade") -> tuple[torch.Tensor, torch.Tensor]:
    """One-shot two-level cascade (plan + run). Shapes as in :class:`SharedPrefixBatch`.

    Returns ``o`` [batch, num_qo_heads, head_dim] and natural-log ``lse`` [batch, num_qo_heads].
    """
    _, _, page_size, hkv, d = kv_cache.shape
    batch = SharedPrefixBatch(q.shape[1], hkv, d, page_size, device=q.device, path=path,
                              sm_scale=sm_scale, elem_bytes=q.element_size())
    batch.plan(prefix_indices, prefix_len, suffix_indptr, suffix_indices, suffix_last_page_len)
    return batch.run(q, kv_cache)
