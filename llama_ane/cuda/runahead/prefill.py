"""Prefill of one prompt across processes: KV-Runahead, the sequence-parallel baseline, and one
process alone. Every rank calls the same function with the same prompt.

KV-Runahead (Cho et al., ICML 2024): rank ``r`` prefills tokens ``[b_r, b_{r+1})``. At every layer
it computes its slab's Q/K/V, waits for the K/V of tokens ``[0, b_r)`` from rank ``r - 1`` (posted
as asynchronous receives before the first layer, so they land while it computes), appends its own
slab in the same paged cache, sends the K/V of ``[0, b_{r+1})`` on to rank ``r + 1`` (an
asynchronous send, waited for only at the end) and attends with the causal offset. Only the last
rank ends with the whole cache; it produces the first token's logits, and its cache is the GPU
engine's decode cache (:meth:`GPUEngine.generate` ``prefix_cache``).

Sequence parallel (the paper's TSP baseline): equal slabs; at every layer each rank all-gathers
the K/V of every slab (a global synchronisation), then attends over the keys up to its slab's end.

The network is the GPU engine's (:class:`~llama_ane.cuda.engine.GPUEngine`, weights from a HF
checkpoint); the transport is a ``torch.distributed`` process group: NCCL between GPUs, gloo on
the CPU (``host_staging`` also lets gloo carry CUDA tensors through host memory, for checks of
several ranks on one GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import METHODS, offset_causal, offset_causal_sdpa
from .partition import check_bounds, even_bounds


@dataclass
class PrefillResult:
    """What one rank ends with.

    logits : last rank: ``[vocab]`` float32 of the prompt's last token (``[slab, vocab]`` for
        every token of the slab with ``all_logits``); other ranks: None, or their slab's logits
        with ``all_logits``
    cache : last rank: ``[layers, pages, 2, page_size, Hkv, D]`` K/V of the whole prompt, in the
        engine's page layout; other ranks: their partial cache (KV-Runahead) or None
    bounds : the partition used
    """

    logits: torch.Tensor | None
    cache: torch.Tensor | None
    bounds: list[int]


class Transport:
    """Point-to-point and all-gather over a process group (``group.send``/``recv``/``allgather``).

    With ``host_staging`` CUDA tensors travel through host copies (gloo cannot send device
    memory); otherwise the group must carry the tensors' device (NCCL for CUDA).
    """

    def __init__(self, group, host_staging: bool = False) -> None:
        self.group = group
        self.rank = group.rank()
        self.world = group.size()
        self.host_staging = host_staging

    def send(self, tensor: torch.Tensor, dst: int, tag: int):
        if self.host_staging and tensor.is_cuda:
            tensor = tensor.cpu()
        return self.group.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int):
        """Post a receive into ``tensor``; ``wait()`` on the result before reading it."""
        if self.host_staging and tensor.is_cuda:
            staged = torch.empty(tensor.shape, dtype=tensor.dtype)
            work = self.group.recv([staged], src, tag)
            return _StagedRecv(work, staged, tensor)
        return self.group.recv([tensor], src, tag)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[world * n, ...]``: every rank's ``tensor`` (all of shape ``[n, ...]``) in rank order."""
        src = tensor.cpu() if self.host_staging and tensor.is_cuda else tensor.contiguous()
        outs = [torch.empty_like(src) for _ in range(self.world)]
        self.group.allgather([outs], [src]).wait()
        return torch.cat(outs).to(tensor.device)


class _StagedRecv:
    def __init__(self, work, staged: torch.Tensor, target: torch.Tensor) -> None:
        self.work, self.staged, self.target = work, staged, target

    def wait(self) -> None:
        self.work.wait()
        self.target.copy_(self.staged)


def _check_prompt(engine, ids, world: int) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long).to(engine.device)
    if ids.dim() != 1 or ids.numel() < world:
        raise ValueError(f"the prompt needs at least one token per process ({world}), "
                         f"got {ids.numel()}")
    return ids


def _default_method(engine) -> str:
    return "triton" if engine.device.type == "cuda" else "torch"


def _new_cache(engine, tokens: int) -> torch.Tensor:
    ps = engine.page_size
    return torch.empty(engine.n_layers, -(-tokens // ps), 2, ps, engine.n_kv, engine.head_dim,
                       device=engine.device, dtype=engine.dtype)


def _write_tokens(cache_layer: torch.Tensor, start: int, k: torch.Tensor,
                  v: torch.Tensor) -> None:
    """Write K/V ``[c, Hkv, D]`` of tokens ``[start, start + c)`` (``start`` on a page boundary)."""
    ps = cache_layer.shape[2]
    c = k.shape[0]
    first = start // ps
    whole = c // ps
    if whole:
        cache_layer[first:first + whole, 0] = k[:whole * ps].view(whole, ps, *k.shape[1:])
        cache_layer[first:first + whole, 1] = v[:whole * ps].view(whole, ps, *v.shape[1:])
    rest = c - whole * ps
    if rest:
        cache_layer[first + whole, 0, :rest] = k[whole * ps:]
        cache_layer[first + whole, 1, :rest] = v[whole * ps:]


def _logits(engine, x: torch.Tensor, all_logits: bool) -> torch.Tensor:
    return engine._logits(x) if all_logits else engine._logits(x[-1:])[0]


@torch.inference_mode()
def runahead_prefill(engine, ids, bounds, transport: Transport | None = None, *,
                     method: str | None = None, all_logits: bool = False) -> PrefillResult:
    """KV-Runahead prefill of ``ids`` on this rank (``transport`` None: one process, the whole
    prompt). ``bounds`` partition the prompt (inner bounds on page boundaries; see
    :mod:`.partition`); ``method`` is the attention of :mod:`.attention` (default ``triton`` on
    CUDA, ``torch`` elsewhere)."""
    rank, world = (transport.rank, transport.world) if transport is not None else (0, 1)
    ids = _check_prompt(engine, ids, world)
    check_bounds(bounds, ids.numel(), world, engine.page_size)
    method = method or _default_method(engine)
    if method not in METHODS:
        raise ValueError(f"attention method must be one of {METHODS}, got {method!r}")
    ps = engine.page_size
    start, end = bounds[rank], bounds[rank + 1]
    cache = _new_cache(engine, end)
    # every layer's prefix K/V is received into its own pages: post all receives now, so each
    # lands while this rank computes the layers before it
    recvs = [transport.recv(cache[li, :start // ps], rank - 1, li)
             for li in range(engine.n_layers)] if rank > 0 else []
    sends = []
    x = engine.embed[ids[start:end]]
    cos, sin = engine._rope(torch.arange(start, end, device=engine.device))
    scale = engine.head_dim ** -0.5
    for li, layer in enumerate(engine.layers):
        q, k, v = engine._qkv(layer, engine._rms(x, layer["ln1"]), cos, sin)
        _write_tokens(cache[li], start, k, v)
        if recvs:
            recvs[li].wait()
        if rank < world - 1:
            sends.append(transport.send(cache[li, :end // ps], rank + 1, li))
        a = offset_causal(method, q, k, v, cache[li], start, scale)
        x = x + F.linear(a.reshape(end - start, -1), layer["o"])
        x = engine._mlp(layer, x)
    logits = _logits(engine, x, all_logits) if rank == world - 1 or all_logits else None
    for work in sends:
        work.wait()
    return PrefillResult(logits, cache, list(bounds))


@torch.inference_mode()
def sequence_parallel_prefill(engine, ids, transport: Transport, *,
                              all_logits: bool = False) -> PrefillResult:
    """The sequence-parallel baseline: equal slabs (the prompt's length must divide by the
    number of ranks times the page size), an all-gather of every layer's K/V, attention over the
    keys up to the slab's end. The last rank keeps the whole cache and the first token's logits."""
    rank, world = transport.rank, transport.world
    ids = _check_prompt(engine, ids, world)
    n, ps = ids.numel(), engine.page_size
    if n % (world * ps):
        raise ValueError(f"sequence-parallel prefill needs a prompt length divisible by "
                         f"{world} ranks x page size {ps}, got {n}")
    bounds = even_bounds(n, world, ps)
    start, end = bounds[rank], bounds[rank + 1]
    last = rank == world - 1
    kept = n if last else end  # the last rank keeps every token for decoding, the others theirs
    cache = _new_cache(engine, kept)
    x = engine.embed[ids[start:end]]
    cos, sin = engine._rope(torch.arange(start, end, device=engine.device))
    scale = engine.head_dim ** -0.5
    sdpa = offset_causal_sdpa if engine.device.type == "cuda" else None
    for li, layer in enumerate(engine.layers):
        q, k, v = engine._qkv(layer, engine._rms(x, layer["ln1"]), cos, sin)
        kv = transport.all_gather(torch.stack([k, v], dim=1))  # [n, 2, Hkv, D]
        _write_tokens(cache[li], 0, kv[:kept, 0], kv[:kept, 1])
        if sdpa is not None:
            a = sdpa(q, cache[li], start, end, scale)
        else:
            a = offset_causal("torch", q, k, v, cache[li], start, scale)
        x = x + F.linear(a.reshape(end - start, -1), layer["o"])
        x = engine._mlp(layer, x)
    logits = _logits(engine, x, all_logits) if last or all_logits else None
    return PrefillResult(logits, cache, bounds)


def single_prefill(engine, ids, *, method: str | None = None,
                   all_logits: bool = False) -> PrefillResult:
    """The whole prompt in this process (the single-GPU baseline): KV-Runahead with one rank."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    return runahead_prefill(engine, ids, [0, ids.numel()], None, method=method,
                            all_logits=all_logits)
