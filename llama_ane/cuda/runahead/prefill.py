"""Prefill of one prompt across processes: KV-Runahead, the sequence-parallel baseline, and one
process alone. Every rank calls the same function with the same prompt.

KV-Runahead (Cho et al., ICML 2024): rank ``r`` prefills tokens ``[b_r, b_{r+1})``. At every layer
it computes its slab's Q/K/V, waits for the K/V of tokens ``[0, b_r)`` from rank ``r - 1`` (posted
as asynchronous receives before the first layer, so they land while it computes), appends its own
slab in the same paged cache, sends the K/V of ``[0, b_{r+1})`` on to rank ``r + 1`` (an
asynchronous send, waited for only at the end) and attends with the causal offset. Only the last
rank ends with the whole cache; it produces the first token's logits, and its cache is the GPU
engine's decode cache (:meth:`GPUEngine.generate` ``prefix_cache``; on the CPU
:func:`greedy_after_prefill`).

The hand-off (``Transport.handoff``): ``unbatched`` posts every layer's receive before the first
layer and sends each layer on its own; on a group initialised eagerly (as :func:`.launch.spawn`
does) NCCL runs unbatched point-to-point operations in the order they were posted, serialised with
everything else on that group, so a middle rank's first send queues behind all its receives. ``batched`` posts one :func:`torch.distributed.batch_isend_irecv` per
layer: the send of layer ``l`` with the receive of layer ``l + 1``. ``links`` keeps the receives
posted up front but puts each link ``r -> r + 1`` on one of two extra process groups (by the
parity of ``r``), so a rank receives on one group and sends on the other.

Sequence parallel (the paper's TSP baseline): at every layer each rank all-gathers the K/V of every
slab (a global synchronisation), then attends over the keys up to its slabs' ends. ``even``: equal
slabs in order; ``zigzag`` (load-balanced): ``2 * world`` chunks, rank ``r`` takes chunks ``r`` and
``2 * world - 1 - r``, so every rank's causal attention work is the same.

The network is the GPU engine's (:class:`~llama_ane.cuda.engine.GPUEngine`, weights from a HF
checkpoint); the transport is a ``torch.distributed`` process group: NCCL between GPUs, gloo on
the CPU (``host_staging`` also lets gloo carry CUDA tensors through host memory, for checks of
several ranks on one GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import METHODS, offset_causal
from .partition import check_bounds, sequence_parallel_spans

HANDOFFS = ("unbatched", "batched", "links")


@dataclass
class PrefillResult:
    """What one rank ends with.

    logits : the rank holding the prompt's last token (KV-Runahead and even sequence parallel:
        the last rank; zigzag: rank 0): ``[vocab]`` float32 of that token (with ``all_logits``
        ``[tokens, vocab]``, a row for every token of ``spans``); other ranks: None, or their
        tokens' logits with ``all_logits``
    cache : that rank: ``[layers, pages, 2, page_size, Hkv, D]`` K/V of the whole prompt, in the
        engine's page layout; other ranks: the K/V up to the end of their last span
    bounds : the partition used
    spans : the token ranges ``(start, end)`` this rank computed, in the order of its rows
    """

    logits: torch.Tensor | None
    cache: torch.Tensor | None
    bounds: list[int]
    spans: list[tuple[int, int]] | None = None


class Transport:
    """Point-to-point and all-gather over a process group (``group.send``/``recv``/``allgather``).

    With ``host_staging`` CUDA tensors travel through host copies (gloo cannot send device
    memory); otherwise the group must carry the tensors' device (NCCL for CUDA). ``handoff`` is
    KV-Runahead's (:data:`HANDOFFS`). ``links``: the two groups of the ``links`` hand-off (the
    same ranks as ``group``); left out, they are made with :func:`torch.distributed.new_group`,
    which every process of the default group must then call at the same point.
    """

    def __init__(self, group, host_staging: bool = False, handoff: str = "unbatched",
                 links: tuple | None = None) -> None:
        if handoff not in HANDOFFS:
            raise ValueError(f"hand-off must be one of {HANDOFFS}, got {handoff!r}")
        self.group = group
        self.rank = group.rank()
        self.world = group.size()
        self.host_staging = host_staging
        self.handoff = handoff
        self.registered = _registered(group)
        if handoff == "links" and links is None:
            import torch.distributed as dist

            ranks = dist.get_process_group_ranks(group)
            links = (dist.new_group(ranks), dist.new_group(ranks))
        self.links = links

    def link(self, src: int):
        """The group that carries the link ``src -> src + 1``."""
        return self.links[src % 2] if self.handoff == "links" else self.group

    def send(self, tensor: torch.Tensor, dst: int, tag: int):
        if self.host_staging and tensor.is_cuda:
            tensor = tensor.cpu()
        return self.link(min(self.rank, dst)).send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int):
        """Post a receive into ``tensor``; ``wait()`` on the result before reading it."""
        group = self.link(min(self.rank, src))
        if self.host_staging and tensor.is_cuda:
            staged = torch.empty(tensor.shape, dtype=tensor.dtype)
            return _StagedRecv(group.recv([staged], src, tag), staged, tensor)
        return group.recv([tensor], src, tag)

    def batch(self, sends, recvs) -> "_Batch":
        """Post ``sends`` ``[(tensor, dst, tag)]`` and ``recvs`` ``[(tensor, src, tag)]`` together
        (:func:`torch.distributed.batch_isend_irecv`: one grouped launch on NCCL); ``wait()`` on
        the result waits for all of them. A group that torch.distributed does not know (ranks
        that are threads) posts them one by one, as batch_isend_irecv does on gloo."""
        if not self.registered:
            return _Batch([self.send(*s) for s in sends] + [self.recv(*r) for r in recvs])
        import torch.distributed as dist

        ops, staged = [], []
        for tensor, dst, tag in sends:
            if self.host_staging and tensor.is_cuda:
                tensor = tensor.cpu()
            ops.append(dist.P2POp(dist.isend, tensor, group=self.group, tag=tag, group_peer=dst))
        for tensor, src, tag in recvs:
            if self.host_staging and tensor.is_cuda:
                staged.append((torch.empty(tensor.shape, dtype=tensor.dtype), tensor))
                tensor = staged[-1][0]
            ops.append(dist.P2POp(dist.irecv, tensor, group=self.group, tag=tag, group_peer=src))
        return _Batch(dist.batch_isend_irecv(ops), staged)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[world * n, ...]``: every rank's ``tensor`` (all of shape ``[n, ...]``) in rank order."""
        src = tensor.cpu() if self.host_staging and tensor.is_cuda else tensor.contiguous()
        outs = [torch.empty_like(src) for _ in range(self.world)]
        self.group.allgather([outs], [src]).wait()
        return torch.cat(outs).to(tensor.device)


def _registered(group) -> bool:
    """Whether ``group`` is one of torch.distributed's (batch_isend_irecv needs its ranks)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    try:
        dist.get_process_group_ranks(group)
    except KeyError:
        return False
    return True


class _Batch:
    """Works that complete together; host-staged receives are copied in on the first wait."""

    def __init__(self, works, staged=()) -> None:
        self.works, self.staged = [w for w in works if w is not None], list(staged)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        for src, dst in self.staged:
            dst.copy_(src)
        self.works, self.staged = [], []


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


def _rest_of_layer(engine, layer, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The output projection of attention ``a`` ``[T, Hq, D]``, its residual and the MLP."""
    return engine._mlp(layer, x + F.linear(a.reshape(x.shape[0], -1), layer["o"]))


class _Chain:
    """Rank ``r``'s side of KV-Runahead's hand-off (see the module's docstring): every layer's
    prefix ``[0, start)`` arrives from rank ``r - 1`` in the cache's first pages, and the K/V of
    ``[0, end)`` go on to rank ``r + 1``."""

    def __init__(self, transport: Transport, cache: torch.Tensor, start: int, end: int) -> None:
        ps = cache.shape[3]
        self.t, self.cache = transport, cache
        self.layers = cache.shape[0]
        self.have, self.give = start // ps, end // ps
        self.src = transport.rank - 1 if transport.rank > 0 else None
        self.dst = transport.rank + 1 if transport.rank < transport.world - 1 else None
        self.arrivals: dict = {}
        self.sends: list = []
        if self.src is None:
            return
        if transport.handoff == "batched":
            self.arrivals[0] = transport.batch([], [self._recv(0)])
        else:
            # each layer's prefix in its own pages: every receive posted now lands while this
            # rank computes the layers before it
            for li in range(self.layers):
                self.arrivals[li] = transport.recv(*self._recv(li))

    def _recv(self, li: int) -> tuple:
        return self.cache[li, :self.have], self.src, li

    def arrived(self, li: int) -> None:
        """Wait for layer ``li``'s prefix."""
        work = self.arrivals.pop(li, None)
        if work is not None:
            work.wait()

    def forward(self, li: int) -> None:
        """Send layer ``li``'s K/V of ``[0, end)`` on (its prefix arrived, its slab written)."""
        sends = [] if self.dst is None else [(self.cache[li, :self.give], self.dst, li)]
        if self.t.handoff == "batched":
            nxt = li + 1 < self.layers and self.src is not None
            if sends or nxt:
                work = self.t.batch(sends, [self._recv(li + 1)] if nxt else [])
                self.sends.append(work)
                if nxt:
                    self.arrivals[li + 1] = work
        elif sends:
            self.sends.append(self.t.send(*sends[0]))

    def finish(self) -> None:
        for work in self.sends:
            work.wait()


@torch.inference_mode()
def runahead_prefill(engine, ids, bounds, transport: Transport | None = None, *,
                     method: str | None = None, all_logits: bool = False) -> PrefillResult:
    """KV-Runahead prefill of ``ids`` on this rank (``transport`` None: one process, the whole
    prompt). ``bounds`` partition the prompt (inner bounds on page boundaries; see
    :mod:`.partition`); ``method`` is the attention of :mod:`.attention` (default ``triton`` on
    CUDA, ``torch`` elsewhere); the hand-off is ``transport.handoff``."""
    rank, world = (transport.rank, transport.world) if transport is not None else (0, 1)
    ids = _check_prompt(engine, ids, world)
    check_bounds(bounds, ids.numel(), world, engine.page_size)
    method = method or _default_method(engine)
    if method not in METHODS:
        raise ValueError(f"attention method must be one of {METHODS}, got {method!r}")
    start, end = bounds[rank], bounds[rank + 1]
    cache = _new_cache(engine, end)
    chain = _Chain(transport, cache, start, end) if transport is not None else None
    x = engine.embed[ids[start:end]]
    cos, sin = engine._rope(torch.arange(start, end, device=engine.device))
    scale = engine.head_dim ** -0.5
    for li, layer in enumerate(engine.layers):
        q, k, v = engine._qkv(layer, engine._rms(x, layer["ln1"]), cos, sin)
        _write_tokens(cache[li], start, k, v)
        if chain is not None:
            chain.arrived(li)
            chain.forward(li)
        a = offset_causal(method, q, k, v, cache[li], start, scale)
        x = _rest_of_layer(engine, layer, x, a)
    logits = _logits(engine, x, all_logits) if rank == world - 1 or all_logits else None
    if chain is not None:
        chain.finish()
    return PrefillResult(logits, cache, list(bounds), [(start, end)])


@torch.inference_mode()
def sequence_parallel_prefill(engine, ids, transport: Transport, *, layout: str = "even",
                              all_logits: bool = False) -> PrefillResult:
    """The sequence-parallel baseline: equal slabs (``layout`` ``even``) or zigzag chunks
    (``zigzag``, load-balanced; :func:`~.partition.sequence_parallel_spans`), the prompt's length
    divisible by the number of slabs times the page size; an all-gather of every layer's K/V,
    attention over the keys up to each slab's end. The rank holding the last token keeps the
    whole cache and the first token's logits."""
    rank, world = transport.rank, transport.world
    ids = _check_prompt(engine, ids, world)
    n, ps = ids.numel(), engine.page_size
    spans = sequence_parallel_spans(n, world, layout, ps)
    mine = spans[rank]
    holder = any(e == n for _, e in mine)
    # the holder keeps every token for decoding, the others what their attention reads
    kept = n if holder else max(e for _, e in mine)
    cache = _new_cache(engine, kept)
    pos = torch.cat([torch.arange(s, e) for s, e in mine]).to(engine.device)
    x = engine.embed[ids[pos]]
    cos, sin = engine._rope(pos)
    scale = engine.head_dim ** -0.5
    method = "sdpa" if engine.device.type == "cuda" else "torch"
    for li, layer in enumerate(engine.layers):
        q, k, v = engine._qkv(layer, engine._rms(x, layer["ln1"]), cos, sin)
        kv = transport.all_gather(torch.stack([k, v], dim=1))  # [world * tokens, 2, Hkv, D]
        row = 0
        for s, e in (span for rank_spans in spans for span in rank_spans):
            if s < kept:
                _write_tokens(cache[li], s, kv[row:row + e - s, 0], kv[row:row + e - s, 1])
            row += e - s
        parts, row = [], 0
        for s, e in mine:
            parts.append(offset_causal(method, q[row:row + e - s], None, None, cache[li], s,
                                       scale))
            row += e - s
        x = _rest_of_layer(engine, layer, x, torch.cat(parts))
    logits = _logits(engine, x, all_logits) if holder or all_logits else None
    bounds = sorted({0, n, *(b for r in spans for span in r for b in span)})
    return PrefillResult(logits, cache, bounds, list(mine))


def single_prefill(engine, ids, *, method: str | None = None,
                   all_logits: bool = False) -> PrefillResult:
    """The whole prompt in this process (the single-GPU baseline): KV-Runahead with one rank."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    return runahead_prefill(engine, ids, [0, ids.numel()], None, method=method,
                            all_logits=all_logits)


@torch.inference_mode()
def greedy_after_prefill(engine, result: PrefillResult, prompt_len: int,
                         max_new_tokens: int) -> list[int]:
    """Greedy tokens after a prefill whose ``result`` holds the whole prompt's cache and its
    last token's logits, one token a step with the torch attention over the pages: a decode on
    any device, for checks where the GPU engine's decode kernels do not run (the CPU)."""
    ps = engine.page_size
    cache = _new_cache(engine, prompt_len + max_new_tokens)
    pages = -(-prompt_len // ps)
    cache[:, :pages] = result.cache[:, :pages]
    logits = result.logits if result.logits.dim() == 1 else result.logits[-1]
    scale = engine.head_dim ** -0.5
    tokens: list[int] = []
    for pos in range(prompt_len, prompt_len + max_new_tokens):
        tokens.append(int(logits.argmax()))
        if len(tokens) == max_new_tokens:
            break
        x = engine.embed[torch.tensor(tokens[-1:], device=engine.device)]
        cos, sin = engine._rope(torch.tensor([pos], device=engine.device))
        for li, layer in enumerate(engine.layers):
            q, k, v = engine._qkv(layer, engine._rms(x, layer["ln1"]), cos, sin)
            cache[li, pos // ps, :, pos % ps] = torch.stack([k[0], v[0]])
            x = _rest_of_layer(engine, layer, x,
                               offset_causal("torch", q, k, v, cache[li], pos, scale))
        logits = engine._logits(x)[0]
    return tokens
