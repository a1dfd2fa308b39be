"""Every CUDA-path kernel against its torch reference on the GPU (skipped without CUDA + triton).

Inputs are fresh random normals per case, on shuffled pages with unused pages between them, so
wrong indexing or unwritten outputs show up as mismatches. Tolerances: fp16 max abs error 2e-3 on
``o`` and on ``lse``; bf16 (8 mantissa bits) 1e-2 relative.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

DTYPES = [torch.float16, torch.bfloat16]
HEADS = [(32, 32), (32, 8)]


def _tol(dtype):
    return dict(atol=2e-3, rtol=0) if dtype == torch.float16 else dict(atol=1e-2, rtol=1e-2)


def _make_cache(lengths, page_size, hkv, d, dtype, seed):
    """Random NHD cache with one sequence per entry of ``lengths`` on shuffled pages."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n_pages = [max(1, -(-n // page_size)) for n in lengths]
    total = 2 * sum(n_pages) + 1
    cache = torch.randn(total, 2, page_size, hkv, d, device="cuda", dtype=dtype, generator=gen)
    perm = torch.randperm(total, device="cuda", generator=gen)[: sum(n_pages)].to(torch.int32)
    counts = torch.tensor(n_pages, device="cuda")
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = counts.cumsum(0)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lengths, n_pages)],
                        dtype=torch.int32, device="cuda")
    return cache, indptr, perm.contiguous(), last, gen


def _assert_state(o, lse, ref_o, ref_lse, dtype):
    assert torch.isfinite(o).all() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.float(), ref_o, **_tol(dtype))
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-4)


DECODE_CASES = [  # (batch, max length, page size)
    (1, 16, 1), (1, 32768, 16), (7, 1000, 1), (64, 2049, 16), (256, 129, 16), (3, 32768, 1),
    (256, 2048, 16),
]


@pytest.mark.parametrize("batch,max_len,page_size", DECODE_CASES)
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_batch_decode(batch, max_len, page_size, hq, hkv, dtype, d):
    from llama_ane.cuda import ops, reference as ref

    gen = torch.Generator().manual_seed(batch * 7 + max_len)
    lengths = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lengths[0] = max_len
    cache, indptr, indices, last, g = _make_cache(lengths, page_size, hkv, d, dtype, max_len)
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype, generator=g)
    o, lse = ops.batch_decode(q, cache, indptr, indices, last)
    _assert_state(o, lse, *ref.batch_decode_ref(q, cache, indptr, indices, last), dtype)


PREFIX_CASES = [(1, 16, 16), (16, 1000, 1), (256, 32768, 16), (64, 4103, 16), (5, 32768, 1)]


@pytest.mark.parametrize("batch,prefix_len,page_size", PREFIX_CASES)
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_shared_prefix(batch, prefix_len, page_size, hq, hkv, dtype, d):
    from llama_ane.cuda import ops, reference as ref

    cache, indptr, indices, _, g = _make_cache([prefix_len], page_size, hkv, d, dtype, prefix_len)
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype, generator=g)
    o, lse = ops.shared_prefix_attention(q, cache, indices, prefix_len)
    _assert_state(o, lse, *ref.shared_prefix_ref(q, cache, indices, prefix_len), dtype)


@pytest.mark.parametrize("q_scale", [4.0, 16.0])
def test_shared_prefix_large_scores(q_scale):
    """Peaked scores move the running max often: exercises the rescaling in the main loop."""
    from llama_ane.cuda import ops, reference as ref

    cache, _, indices, _, g = _make_cache([8192 + 37], 16, 8, 128, torch.float16, 3)
    q = (torch.randn(64, 32, 128, device="cuda", generator=g) * q_scale).half()
    o, lse = ops.shared_prefix_attention(q, cache, indices, 8192 + 37)
    _assert_state(o, lse, *ref.shared_prefix_ref(q, cache, indices, 8192 + 37), torch.float16)


CASCADE_CASES = [  # (batch, prefix, max suffix, page size)
    (1, 16, 1, 1), (16, 1024, 128, 16), (256, 32768, 128, 16), (4, 8192, 2048, 16),
    (33, 100, 2048, 1), (256, 1024, 2048, 16), (64, 4096, 7, 1),
]


def _cascade_batch(batch, prefix_len, max_suffix, page_size, hq, hkv, d, dtype):
    """A random cache, one shared prefix and random suffixes on it, and queries:
    ``(cache, tables, q)`` with ``tables`` in :meth:`SharedPrefixBatch.plan`'s order."""
    gen = torch.Generator().manual_seed(batch + prefix_len + max_suffix)
    suffix = torch.randint(1, max_suffix + 1, (batch,), generator=gen).tolist()
    cache, indptr, indices, last, g = _make_cache([prefix_len] + suffix, page_size, hkv, d,
                                                  dtype, prefix_len + max_suffix)
    tables = (indices[: int(indptr[1])], prefix_len, (indptr[1:] - indptr[1]).contiguous(),
              indices[int(indptr[1]):].contiguous(), last[1:].contiguous())
    return cache, tables, torch.randn(batch, hq, d, device="cuda", dtype=dtype, generator=g)


def _attention(hq, hkv, d, page_size, path):
    """A SharedPrefixBatch for ``path``: cascade, overlap (the cascade on two streams), fused
    (the one-launch cascade where it applies), decode or auto."""
    from llama_ane.cuda.cascade import SharedPrefixBatch

    config = {"overlap": {"overlap": True}, "fused": {"fused": True}}.get(path)
    return SharedPrefixBatch(hq, hkv, d, page_size, device="cuda",
                             path="cascade" if path in ("overlap", "fused") else path,
                             config=config)


@pytest.mark.parametrize("batch,prefix_len,max_suffix,page_size", CASCADE_CASES)
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["cascade", "overlap", "fused", "decode", "auto"])
def test_cascade_paths(batch, prefix_len, max_suffix, page_size, hq, hkv, dtype, path):
    from llama_ane.cuda import reference as ref

    d = 128
    cache, tables, q = _cascade_batch(batch, prefix_len, max_suffix, page_size, hq, hkv, d, dtype)
    attention = _attention(hq, hkv, d, page_size, path)
    attention.plan(*tables)
    o, lse = attention.run(q, cache)
    _assert_state(o, lse, *ref.cascade_ref(q, cache, *tables), dtype)


@pytest.mark.parametrize("path", ["cascade", "overlap", "fused", "decode"])
def test_plan_once_run_twice(path):
    """Runs read the plan, never change it: a second run gives the first one's exact output
    (the fused cascade leaves its arrival counts at zero)."""
    from llama_ane.cuda import reference as ref

    hq, hkv, d, page_size, dtype = 32, 8, 128, 16, torch.float16
    cache, tables, q = _cascade_batch(16, 1024, 128, page_size, hq, hkv, d, dtype)
    attention = _attention(hq, hkv, d, page_size, path)
    attention.plan(*tables)
    assert attention.fused == (path == "fused")
    o1, lse1 = attention.run(q, cache)
    o2, lse2 = attention.run(q, cache)
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
    if path == "fused":
        assert not attention.counts.any()
    _assert_state(o1, lse1, *ref.cascade_ref(q, cache, *tables), dtype)


@pytest.mark.parametrize("path", ["cascade", "overlap", "decode", "auto"])
@pytest.mark.parametrize("grow", [False, True])
def test_replan_equals_a_fresh_object(path, grow):
    """Planning one object for a second batch (another size, another prefix) gives exactly what a
    new object planned for that batch gives, whether its buffers shrink or grow."""
    from llama_ane.cuda import reference as ref

    hq, hkv, d, page_size, dtype = 32, 8, 128, 16, torch.float16
    small, large = (8, 1024, 200, page_size), (64, 4096, 64, page_size)
    first, second = (small, large) if grow else (large, small)
    attention = _attention(hq, hkv, d, page_size, path)
    cache, tables, q = _cascade_batch(*first, hq, hkv, d, dtype)
    attention.plan(*tables)
    attention.run(q, cache)
    cache, tables, q = _cascade_batch(*second, hq, hkv, d, dtype)
    attention.plan(*tables)
    o, lse = attention.run(q, cache)
    fresh = _attention(hq, hkv, d, page_size, path)
    fresh.plan(*tables)
    o_fresh, lse_fresh = fresh.run(q, cache)
    assert attention.path == fresh.path
    assert torch.equal(o, o_fresh) and torch.equal(lse, lse_fresh)
    _assert_state(o, lse, *ref.cascade_ref(q, cache, *tables), dtype)


@pytest.mark.parametrize("path", ["overlap", "decode"])
def test_replan_reuses_buffers_that_fit(path):
    """A plan that fits the buffers of an earlier, larger one takes them (and the side stream)
    instead of allocating new ones."""
    from llama_ane.cuda import reference as ref

    hq, hkv, d, page_size, dtype = 32, 8, 128, 16, torch.float16
    attention = _attention(hq, hkv, d, page_size, path)
    cache, tables, q = _cascade_batch(16, 4096, 128, page_size, hq, hkv, d, dtype)
    attention.plan(*tables)
    attention.run(q, cache)
    held = [attention.o_buf.data_ptr(), attention.lse_buf.data_ptr()]
    if path == "decode":
        held += [attention.full_indptr.data_ptr(), attention.full_indices.data_ptr()]
    stream = attention.side_stream
    cache, tables, q = _cascade_batch(2, 1024, 64, page_size, hq, hkv, d, dtype)
    attention.plan(*tables)
    now = [attention.o_buf.data_ptr(), attention.lse_buf.data_ptr()]
    if path == "decode":
        now += [attention.full_indptr.data_ptr(), attention.full_indices.data_ptr()]
    assert now == held
    assert attention.side_stream is stream and (stream is not None) == (path == "overlap")
    o, lse = attention.run(q, cache)
    _assert_state(o, lse, *ref.cascade_ref(q, cache, *tables), dtype)


def test_run_needs_a_matching_plan():
    """run and set_suffix_lengths refuse before any plan, after a plan that raised, and for a
    batch of another shape than planned."""
    from llama_ane.errors import LlamaANEError

    hq, hkv, d, page_size, dtype = 32, 8, 128, 16, torch.float16
    attention = _attention(hq, hkv, d, page_size, "decode")
    cache, tables, q = _cascade_batch(4, 1024, 32, page_size, hq, hkv, d, dtype)
    with pytest.raises(LlamaANEError, match="no plan"):
        attention.run(q, cache)
    with pytest.raises(LlamaANEError, match="no plan"):
        attention.set_suffix_lengths(torch.ones(4, dtype=torch.int32, device="cuda"))
    attention.plan(*tables)
    with pytest.raises(ValueError, match="plan again"):
        attention.run(q[:2], cache)
    _, unaligned, _ = _cascade_batch(4, 1000, 32, page_size, hq, hkv, d, dtype)
    with pytest.raises(ValueError, match="page-aligned"):
        attention.plan(*unaligned)
    with pytest.raises(LlamaANEError, match="no plan"):
        attention.run(q, cache)
    with pytest.raises(ValueError, match="int32"):
        attention.plan(tables[0].long(), *tables[1:])


@pytest.mark.parametrize("batch,prefix_len,max_suffix,page_size",
                         [(16, 1024, 128, 16), (64, 4096, 7, 1), (256, 32768, 128, 16)])
@pytest.mark.parametrize("path", ["cascade", "overlap", "fused", "decode"])
def test_plan_with_reserved_pages_follows_set_suffix_lengths(batch, prefix_len, max_suffix,
                                                             page_size, path):
    """A plan over pages reserved ahead, shortened by set_suffix_lengths, equals the reference
    over exactly the pages those lengths use (the engine's decode loop and CUDA graph)."""
    from llama_ane.cuda import reference as ref
    from llama_ane.cuda.cascade import SharedPrefixBatch

    d, hq, hkv, dtype = 128, 32, 8, torch.float16
    cache, indptr, indices, last, g = _make_cache([prefix_len] + [max_suffix] * batch, page_size,
                                                  hkv, d, dtype, prefix_len + max_suffix)
    prefix_pages = indices[: int(indptr[1])]
    s_indptr = (indptr[1:] - indptr[1]).contiguous()
    s_indices = indices[int(indptr[1]):].contiguous()
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype, generator=g)
    attention = SharedPrefixBatch(hq, hkv, d, page_size, device="cuda",
                                  path="decode" if path == "decode" else "cascade",
                                  config={"fused": True} if path == "fused" else
                                  {"overlap": path == "overlap"})
    attention.plan(prefix_pages, prefix_len, s_indptr, s_indices, last[1:].clone())
    lengths = torch.randint(1, max_suffix + 1, (batch,), generator=torch.Generator().manual_seed(7))
    attention.set_suffix_lengths(lengths.to(torch.int32).cuda())
    o, lse = attention.run(q, cache)
    # the tables of exactly the pages in use
    pages = (lengths + page_size - 1) // page_size
    starts = s_indptr[:-1].cpu()
    used = torch.cat([s_indices.cpu()[int(a):int(a) + int(n)] for a, n in zip(starts, pages)])
    u_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)]).to(torch.int32)
    u_last = (lengths - (pages - 1) * page_size).to(torch.int32)
    want = ref.cascade_ref(q, cache, prefix_pages, prefix_len, u_indptr.cuda(),
                           used.to(torch.int32).cuda(), u_last.cuda())
    _assert_state(o, lse, *want, dtype)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("d", [64, 128])
def test_merge_ops(dtype, d):
    from llama_ane.cuda import ops, reference as ref

    g = torch.Generator(device="cuda").manual_seed(d)
    rows, n, h = 37, 5, 12
    v = torch.randn(rows, n, h, d, device="cuda", generator=g).to(dtype)
    s = torch.randn(rows, n, h, device="cuda", generator=g) * 5
    s[0, :, 0] = float("-inf")  # a row whose every state is empty
    s[1, 2, :] = float("-inf")  # one empty state among others
    want_o, want_s = ref.merge_states_ref(v, s)
    o, lse = ops.merge_states(v, s)
    torch.testing.assert_close(o.float(), want_o, **_tol(dtype if dtype != torch.float32
                                                         else torch.float16))
    torch.testing.assert_close(lse, want_s, atol=1e-5, rtol=1e-5)
    a_o, a_s = ref.merge_state_ref(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    o2, s2 = ops.merge_state(v[:, 0], s[:, 0].contiguous(), v[:, 1], s[:, 1].contiguous())
    torch.testing.assert_close(o2.float(), a_o, **_tol(dtype if dtype != torch.float32
                                                       else torch.float16))
    torch.testing.assert_close(s2, a_s, atol=1e-5, rtol=1e-5)
    va, sa = v[:, 0].clone(), s[:, 0].clone()
    ops.merge_state_in_place(va, sa, v[:, 1].contiguous(), s[:, 1].contiguous())
    torch.testing.assert_close(va, o2)
    torch.testing.assert_close(sa, s2)


def test_merge_matches_flashinfer_convention_through_adapter():
    """A base-2 LSE computed the way FlashInfer does (scores scaled by log2 e, log2 of the sum of
    powers of 2, in float64: nothing shared with the adapter or the reference), converted by the
    adapter, merges like the natural-log state it stands for."""
    import math

    from llama_ane.cuda import ops, reference as ref
    from llama_ane.cuda.lse import lse_base2_to_natural

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(4, 8, 64, device="cuda", generator=g)
    k = torch.randn(100, 8, 64, device="cuda", generator=g)
    v = torch.randn(100, 8, 64, device="cuda", generator=g)
    oa, _ = ref.attention_state(q, k[:40], v[:40], 0.125)
    ob, sb = ref.attention_state(q, k[40:], v[40:], 0.125)
    scores2 = torch.einsum("nhd,lhd->nhl", q.double(), k[:40].double()) * 0.125 * (1 / math.log(2))
    top = scores2.amax(-1)
    lse2 = (top + torch.log2(torch.exp2(scores2 - top[..., None]).sum(-1))).float()  # [n, H], base 2
    o, s = ops.merge_state(oa, lse_base2_to_natural(lse2), ob, sb)
    full_o, full_s = ref.attention_state(q, k, v, 0.125)
    torch.testing.assert_close(o, full_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, full_s, atol=1e-5, rtol=1e-5)


def _spec_tree(n_tokens, gen):
    """A random draft-token tree: node 0 is the prompt, every other node one token."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n_tokens + 1)]


@pytest.mark.parametrize("t,prompt,page_size", [(32, 4096, 1), (64, 4096, 16), (128, 1000, 16),
                                                (7, 16, 1)])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_attention_spec_tree(t, prompt, page_size, hq, hkv, dtype):
    from llama_ane.cuda import ops, reference as ref
    from llama_ane.cuda.tree import build_tree_plan

    d = 128
    gen = torch.Generator().manual_seed(t + prompt)
    parents = _spec_tree(t, gen)
    total = prompt + t
    n_pages = -(-total // page_size) * 2
    cache = torch.randn(n_pages, 2, page_size, hkv, d, device="cuda", dtype=dtype)
    slots = torch.randperm(n_pages * page_size, generator=gen)[:total].tolist()
    node_slots = [slots[:prompt]] + [[s] for s in slots[prompt:]]
    query_nodes = list(range(1, t + 1))
    plan = build_tree_plan(parents, node_slots, query_nodes, group=hq // hkv, num_kv_heads=hkv,
                           device="cuda")
    q = torch.randn(t, hq, d, device="cuda", dtype=dtype)
    o, lse = ops.tree_attention(q, cache, plan)
    _assert_state(o, lse, *ref.tree_ref(q, cache, parents, node_slots, query_nodes), dtype)


@pytest.mark.parametrize("width", [20, 50])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_attention_few_shot(width, dtype):
    from llama_ane.cuda import ops, reference as ref
    from llama_ane.cuda.tree import build_tree_plan

    hq, hkv, d, page_size = 32, 8, 128, 16
    parents, sizes = [-1], [4096]
    for gi in range(5):
        parents.append(0)
        sizes.append(1024)
        group_node = len(parents) - 1
        for _ in range(width // 5):
            parents.append(group_node)
            sizes.append(128 + gi)
    gen = torch.Generator().manual_seed(width)
    n_pages = -(-sum(sizes) // page_size) * 2
    slots = torch.randperm(n_pages * page_size, generator=gen)[: sum(sizes)].tolist()
    node_slots, at = [], 0
    for s in sizes:
        node_slots.append(slots[at:at + s])
        at += s
    query_nodes = [n for n in range(len(parents)) if n > 0 and parents[n] > 0]
    cache = torch.randn(n_pages, 2, page_size, hkv, d, device="cuda", dtype=dtype)
    q = torch.randn(len(query_nodes), hq, d, device="cuda", dtype=dtype)
    plan = build_tree_plan(parents, node_slots, query_nodes, group=hq // hkv, num_kv_heads=hkv,
                           device="cuda")
    o, lse = ops.tree_attention(q, cache, plan)
    _assert_state(o, lse, *ref.tree_ref(q, cache, parents, node_slots, query_nodes), dtype)


def test_wrappers_reject_bad_inputs():
    from llama_ane.cuda import ops

    q = torch.randn(2, 8, 128, device="cuda", dtype=torch.float16)
    cache = torch.randn(4, 2, 16, 4, 128, device="cuda", dtype=torch.float16)
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    idx = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    last = torch.tensor([3, 4], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="dtype"):
        ops.batch_decode(q, cache.float(), indptr, idx, last)
    with pytest.raises(ValueError, match="int32"):
        ops.batch_decode(q, cache, indptr.long(), idx, last)
    with pytest.raises(ValueError, match="multiple"):
        ops.batch_decode(torch.randn(2, 6, 128, device="cuda", dtype=torch.float16), cache,
                         indptr, idx, last)
    with pytest.raises(ValueError, match="head_dim"):
        ops.batch_decode(q[..., :96].contiguous(), cache[..., :96].contiguous(), indptr, idx,
                         last)


def _page_aligned_slots(sizes, page_size, gen):
    """Node tokens that fill fresh pages from their first slot, pages shuffled."""
    n_pages = [-(-n // page_size) for n in sizes]
    perm = torch.randperm(sum(n_pages) + 8, generator=gen).tolist()
    slots, at = [], 0
    for n, p in zip(sizes, n_pages):
        pages = perm[at:at + p]
        at += p
        slots.append([pages[i // page_size] * page_size + i % page_size for i in range(n)])
    return slots, len(perm)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["few-shot", "spec"])
def test_tree_batch_paths(kind, page_size):
    """TreeBatch picks the cascade for a prompt with private branches and the tree kernel for a
    tree that shares nodes below the root; both paths equal the reference."""
    from llama_ane.cuda import reference as ref
    from llama_ane.cuda.tree_batch import TreeBatch

    hq, hkv, d, dtype = 32, 8, 128, torch.float16
    gen = torch.Generator().manual_seed(page_size)
    if kind == "few-shot":
        parents, sizes = [-1] + [0] * 12, [1000] + [100 + i for i in range(12)]
    else:
        parents = _spec_tree(48, gen)
        sizes = [1000] + [1] * 48
    query_nodes = list(range(1, len(parents)))
    node_slots, n_pages = _page_aligned_slots(sizes, page_size, gen)
    cache = torch.randn(n_pages, 2, page_size, hkv, d, device="cuda", dtype=dtype)
    q = torch.randn(len(query_nodes), hq, d, device="cuda", dtype=dtype)
    want = ref.tree_ref(q, cache, parents, node_slots, query_nodes)
    shape = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size)
    auto = TreeBatch(parents, node_slots, query_nodes, **shape)
    assert auto.path == ("cascade" if kind == "few-shot" else "tree")
    _assert_state(*auto.run(q, cache), *want, dtype)
    for path in ("tree", "cascade"):
        if path == "cascade" and kind == "spec" and page_size > 1:
            # one-token nodes cannot each start a page: no two-level form
            with pytest.raises(ValueError, match="cascade path needs"):
                TreeBatch(parents, node_slots, query_nodes, path=path, **shape)
            continue
        _assert_state(*TreeBatch(parents, node_slots, query_nodes, path=path, **shape).run(
            q, cache), *want, dtype)


@pytest.mark.parametrize("prefix_len,page_size", [(4096, 16), (8192 + 64, 1), (2048, 64),
                                                  (4096, 128), (1000, 16), (64, 16)])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_prefix_on_ordered_pages(prefix_len, page_size, hq, hkv, dtype):
    """No page table: the prefix is the cache's first pages in order (bulk tensor copies where
    the prefix is whole 64-key blocks, the paged kernel otherwise); extra pages after it."""
    from llama_ane.cuda import ops, reference as ref

    g = torch.Generator(device="cuda").manual_seed(prefix_len + page_size)
    n_pages = -(-prefix_len // page_size)
    cache = torch.randn(n_pages + 3, 2, page_size, hkv, 128, device="cuda", dtype=dtype,
                        generator=g)
    q = torch.randn(37, hq, 128, device="cuda", dtype=dtype, generator=g)
    assert ops.ordered_prefix_fits(cache, prefix_len) == (prefix_len % 64 == 0)
    o, lse = ops.shared_prefix_attention(q, cache, None, prefix_len)
    pages = torch.arange(n_pages, device="cuda", dtype=torch.int32)
    _assert_state(o, lse, *ref.shared_prefix_ref(q, cache, pages, prefix_len), dtype)


def _consecutive_prefix_batch(batch, prefix_len, max_suffix, page_size, hq, hkv, dtype, first):
    """A cache whose prefix lies on the consecutive pages ``first, first + 1, ...`` (the engine's
    layout, moved by ``first``) and whose suffixes lie on shuffled pages around it."""
    g = torch.Generator(device="cuda").manual_seed(prefix_len + first + page_size)
    n_prefix = -(-prefix_len // page_size)
    suffix = torch.randint(1, max_suffix + 1, (batch,),
                           generator=torch.Generator().manual_seed(batch)).tolist()
    n_suffix = [-(-n // page_size) for n in suffix]
    total = first + n_prefix + sum(n_suffix) + 2
    cache = torch.randn(total, 2, page_size, hkv, 128, device="cuda", dtype=dtype, generator=g)
    others = torch.cat([torch.arange(first), torch.arange(first + n_prefix, total)])
    others = others[torch.randperm(others.numel(), generator=torch.Generator().manual_seed(1))]
    s_indices = others[: sum(n_suffix)].to(torch.int32).cuda()
    s_indptr = torch.tensor([0] + n_suffix, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    s_last = torch.tensor([n - (p - 1) * page_size for n, p in zip(suffix, n_suffix)],
                          dtype=torch.int32, device="cuda")
    prefix_pages = torch.arange(first, first + n_prefix, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, 128, device="cuda", dtype=dtype, generator=g)
    return cache, (prefix_pages, prefix_len, s_indptr, s_indices, s_last), q


@pytest.mark.parametrize("batch,prefix_len,max_suffix,page_size,first",
                         [(256, 8192, 128, 16, 5), (16, 4096, 300, 16, 0), (7, 2048, 64, 64, 3),
                          (33, 1024, 17, 1, 11), (4, 4096 + 16, 128, 16, 2),
                          (256, 32768, 128, 16, 1)])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["cascade", "overlap", "fused", "auto"])
def test_cascade_on_consecutive_prefix_pages(batch, prefix_len, max_suffix, page_size, first,
                                             hq, hkv, dtype, path):
    """A prefix on consecutive pages is read by bulk tensor copies (whole 64-key blocks) from its
    first page on, and gives the reference's states; other prefixes take the paged kernel."""
    from llama_ane.cuda import reference as ref

    cache, tables, q = _consecutive_prefix_batch(batch, prefix_len, max_suffix, page_size, hq,
                                                 hkv, dtype, first)
    attention = _attention(hq, hkv, 128, page_size, path)
    attention.plan(*tables)
    o, lse = attention.run(q, cache)
    if attention.path == "cascade":
        assert attention.prefix_page0 == (first if prefix_len % 64 == 0 else None)
    _assert_state(o, lse, *ref.cascade_ref(q, cache, *tables), dtype)


@pytest.mark.parametrize("kernel", ["paged", "ordered"])
@pytest.mark.parametrize("overlap", [False, True])
def test_prefix_kernel_choice(kernel, overlap):
    """``prefix_kernel`` forces either prefix kernel on consecutive pages (same states within
    rounding); 'ordered' on shuffled pages is refused."""
    from llama_ane.cuda import reference as ref
    from llama_ane.cuda.cascade import SharedPrefixBatch

    hq, hkv, dtype = 32, 8, torch.float16
    cache, tables, q = _consecutive_prefix_batch(64, 4096, 128, 16, hq, hkv, dtype, 9)
    attention = SharedPrefixBatch(hq, hkv, 128, 16, path="cascade",
                                  config={"prefix_kernel": kernel, "overlap": overlap})
    attention.plan(*tables)
    assert attention.prefix_page0 == (9 if kernel == "ordered" else None)
    _assert_state(*attention.run(q, cache), *ref.cascade_ref(q, cache, *tables), dtype)
    shuffled_cache, shuffled, q = _cascade_batch(64, 4096, 128, 16, hq, hkv, 128, dtype)
    if kernel == "ordered":
        with pytest.raises(ValueError, match="consecutive pages"):
            attention.plan(*shuffled)
    else:
        attention.plan(*shuffled)
        _assert_state(*attention.run(q, shuffled_cache),
                      *ref.cascade_ref(q, shuffled_cache, *shuffled), dtype)


@pytest.mark.parametrize("batch,prefix_len,max_suffix,page_size",
                         [(256, 8192, 128, 16), (3, 64, 1, 1), (100, 4096, 256, 64),
                          (33, 2048, 200, 16), (256, 32768, 128, 16), (1, 1024, 17, 16)])
@pytest.mark.parametrize("hq,hkv", HEADS + [(28, 4)])
@pytest.mark.parametrize("layout", ["shuffled", "consecutive"])
def test_fused_cascade(batch, prefix_len, max_suffix, page_size, hq, hkv, layout):
    """The one-launch cascade (prefix, suffixes and the last program's merge) equals the
    reference on both prefix layouts, runs again to the same bits, and leaves its counts at
    zero; it is the default for GQA with short suffixes and a large prefix."""
    from llama_ane.cuda import reference as ref

    dtype = torch.float16
    if layout == "shuffled":
        cache, tables, q = _cascade_batch(batch, prefix_len, max_suffix, page_size, hq, hkv, 128,
                                          dtype)
    else:
        cache, tables, q = _consecutive_prefix_batch(batch, prefix_len, max_suffix, page_size,
                                                     hq, hkv, dtype, 4)
    attention = _attention(hq, hkv, 128, page_size, "fused")
    attention.plan(*tables)
    group = hq // hkv
    # a group that does not divide the 64-row tile would split a request over two tiles
    assert attention.fused == (64 % group == 0)
    assert (attention.prefix_page0 is not None) == (layout == "consecutive")
    o, lse = attention.run(q, cache)
    _assert_state(o, lse, *ref.cascade_ref(q, cache, *tables), dtype)
    o2, lse2 = attention.run(q, cache)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    if attention.fused:
        assert not attention.counts.any()
    auto = _attention(hq, hkv, 128, page_size, "auto")
    auto.plan(*tables)
    flops = 4.0 * batch * hq * prefix_len * 128
    assert auto.fused == (auto.path == "cascade" and 4 <= group and 64 % group == 0
                          and flops >= 2e10 and layout == "consecutive")
