"""CPU checks of the CUDA path's pure parts: torch references, LSE adapter, tree plans, splits,
the cost model. These run in CI; the kernels themselves are tested in test_cuda_kernels.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from llama_ane.cuda import reference as ref
from llama_ane.cuda.cost_model import CostModel
from llama_ane.cuda.lse import lse_base2_to_natural, lse_natural_to_base2
from llama_ane.cuda.splits import (choose_decode_splits, choose_overlap_prefix_splits,
                                   choose_prefix_splits, consecutive_first_page, overlap_time)
from llama_ane.cuda.tree import build_tree_plan

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cuda_cascade.json"
# multiprocessors of the H100 80GB that measured the committed grid (cuda_notes.md)
H100_SMS = 132


def _paged(gen, lengths, page_size, hkv, d, extra_pages=3):
    """A random NHD cache holding one sequence per length, on shuffled pages."""
    n_pages = [max(1, -(-n // page_size)) for n in lengths]
    total = sum(n_pages) + extra_pages
    cache = torch.randn(total, 2, page_size, hkv, d, generator=gen)
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    indptr = torch.tensor([0] + list(torch.tensor(n_pages).cumsum(0)), dtype=torch.int32)
    indices = perm[: sum(n_pages)].contiguous()
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lengths, n_pages)],
                        dtype=torch.int32)
    return cache, indptr, indices, last


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_attention_state_matches_naive_softmax(hq, hkv):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, hq, 16, generator=gen)
    k = torch.randn(37, hkv, 16, generator=gen)
    v = torch.randn(37, hkv, 16, generator=gen)
    o, lse = ref.attention_state(q, k, v, 0.25)
    torch.testing.assert_close(o.double(), ref.naive_attention(q, k, v, 0.25), atol=1e-5, rtol=1e-5)
    group = hq // hkv
    scores = torch.einsum("nhd,lhd->nhl", q.double(), k.double().repeat_interleave(group, 1))
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores * 0.25, -1), atol=1e-5,
                               rtol=1e-5)


def test_split_states_merge_to_the_whole():
    """The merge operator is exact: any partition of the keys merges back to full attention."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 16, generator=gen)
    k = torch.randn(50, 4, 16, generator=gen) * 3
    v = torch.randn(50, 4, 16, generator=gen)
    full_o, full_lse = ref.attention_state(q, k, v, 0.3)
    cuts = [0, 7, 8, 31, 50]
    states = [ref.attention_state(q, k[a:b], v[a:b], 0.3) for a, b in zip(cuts, cuts[1:])]
    o, lse = ref.merge_states_ref(torch.stack([s[0] for s in states], 1),
                                  torch.stack([s[1] for s in states], 1))
    torch.testing.assert_close(o, full_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=1e-5)
    o2, lse2 = ref.merge_state_ref(*ref.attention_state(q, k[:20], v[:20], 0.3),
                                   *ref.attention_state(q, k[20:], v[20:], 0.3))
    torch.testing.assert_close(o2, full_o, atol=1e-5, rtol=1e-5)


def test_merge_with_empty_state_is_identity():
    gen = torch.Generator().manual_seed(2)
    v = torch.randn(3, 2, 8, generator=gen)
    s = torch.randn(3, 2, generator=gen)
    o, lse = ref.merge_state_ref(v, s, torch.zeros_like(v), torch.full_like(s, float("-inf")))
    torch.testing.assert_close(o, v)
    torch.testing.assert_close(lse, s)


def test_base2_lse_adapter():
    """FlashInfer's LSE is log2 sum 2^(x log2 e); the adapter must map it onto logsumexp."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 9, generator=gen, dtype=torch.float64) * 4
    lse2 = torch.log2(torch.exp2(x * math.log2(math.e)).sum(-1))
    torch.testing.assert_close(lse_base2_to_natural(lse2), torch.logsumexp(x, -1))
    torch.testing.assert_close(lse_natural_to_base2(torch.logsumexp(x, -1)), lse2)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cascade_reference_equals_decode_over_prefix_plus_suffix(page_size):
    gen = torch.Generator().manual_seed(4)
    hq, hkv, d = 4, 2, 16
    prefix_len = 2 * page_size if page_size > 1 else 5
    suffix_lens = [1, 3, 17]
    cache, indptr, indices, last = _paged(gen, [prefix_len] + suffix_lens, page_size, hkv, d)
    q = torch.randn(3, hq, d, generator=gen)
    prefix_pages = indices[indptr[0]:indptr[1]]
    s_indices = indices[indptr[1]:]
    s_indptr = indptr[1:] - indptr[1]
    o, lse = ref.cascade_ref(q, cache, prefix_pages, prefix_len, s_indptr, s_indices, last[1:])
    # the same via a merge of two states
    po, plse = ref.shared_prefix_ref(q, cache, prefix_pages, prefix_len)
    so, slse = ref.batch_decode_ref(q, cache, s_indptr, s_indices, last[1:])
    mo, mlse = ref.merge_state_ref(po, plse, so, slse)
    torch.testing.assert_close(mo, o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mlse, lse, atol=1e-5, rtol=1e-5)


def _random_tree(gen, n_nodes, tokens_per_node, root_tokens):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n_nodes)]
    sizes = [root_tokens] + [tokens_per_node] * (n_nodes - 1)
    slots = torch.randperm(sum(sizes) + 10, generator=gen).tolist()
    node_slots, at = [], 0
    for s in sizes:
        node_slots.append(slots[at:at + s])
        at += s
    return parents, node_slots


@pytest.mark.parametrize("group,block_tokens,tokens_per_node", [(1, 32, 1), (2, 64, 5), (4, 32, 40)])
def test_tree_plan_executes_to_tree_attention(group, block_tokens, tokens_per_node):
    """Run the plan's items, masks, slots and reduction in torch: equals per-query attention."""
    gen = torch.Generator().manual_seed(5)
    hkv, d, page_size = 2, 16, 4
    parents, node_slots = _random_tree(gen, 12, tokens_per_node, root_tokens=70)
    query_nodes = [int(torch.randint(0, 12, (1,), generator=gen)) for _ in range(9)] + [0]
    total_slots = max(max(s) for s in node_slots) + 1
    cache = torch.randn(-(-total_slots // page_size), 2, page_size, hkv, d, generator=gen)
    q = torch.randn(len(query_nodes), hkv * group, d, generator=gen)
    plan = build_tree_plan(parents, node_slots, query_nodes, group=group, num_kv_heads=hkv,
                           block_tokens=block_tokens, block_m=16)
    o, lse = ref.tree_plan_ref(q, cache, plan)
    ref_o, ref_lse = ref.tree_ref(q, cache, parents, node_slots, query_nodes)
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    # KV-guided grouping: each block is read once per work item, never once per query
    assert plan.n_items <= plan.n_pairs
    assert plan.tokens_read <= sum(len(s) for s in node_slots) * -(-len(query_nodes) // (16 // group))


def test_tree_plan_rejects_bad_trees():
    with pytest.raises(ValueError, match="after their parent"):
        build_tree_plan([-1, 2, 0], [[0], [1], [2]], [1], group=1, num_kv_heads=1)
    with pytest.raises(ValueError, match="does not exist"):
        build_tree_plan([-1], [[0]], [3], group=1, num_kv_heads=1)


def test_splits_cover_the_sequence():
    for batch, hkv, length in [(1, 8, 32768), (256, 32, 128), (16, 32, 1), (64, 8, 4096)]:
        splits, chunk = choose_decode_splits(batch, hkv, length, H100_SMS)
        assert splits >= 1 and splits * chunk >= length and (splits - 1) * chunk < length
        splits, chunk = choose_prefix_splits(batch, 128, hkv, length, H100_SMS)
        assert splits >= 1 and splits * chunk >= length and (splits - 1) * chunk < length
    assert choose_decode_splits(1, 8, 32768, 132)[0] > 1  # one long request must be split


def test_consecutive_first_page():
    """Only a run of consecutive pages can be read without its page table (bulk copies)."""
    assert consecutive_first_page([0, 1, 2, 3]) == 0
    assert consecutive_first_page(torch.arange(7, 4103, dtype=torch.int32).tolist()) == 7
    assert consecutive_first_page([5]) == 5
    assert consecutive_first_page([]) is None
    assert consecutive_first_page([0, 1, 3, 4]) is None
    assert consecutive_first_page([3, 2, 1]) is None
    assert consecutive_first_page([4, 4, 5]) is None


def test_overlap_model():
    # two programs per SM and no suffix: the prefix kernel's own time
    assert overlap_time(264, 1e-3, 0.0, 132) == pytest.approx(1e-3)
    # a free half-SM per single program absorbs decode work: a big suffix costs less than in series
    assert overlap_time(192, 1e-3, 0.6e-3, 132) < 1e-3 * 264 / 192 + 0.6e-3
    with pytest.raises(ValueError, match="one wave"):
        overlap_time(265, 1e-3, 0.0, 132)


def test_overlap_splits_leave_room_for_large_suffixes():
    # 32768 x 256 x 128: MHA suffixes are 0.6x the prefix time -> 3 splits measured best on an
    # H100; GQA 32/8 suffixes a fifth -> the standalone 4
    model = CostModel()
    for (hq, hkv), want in (((32, 32), 3), ((32, 8), 4)):
        rows = 256 * hq // hkv
        prefix_s = model.prefix_time(256, 32768, hq, hkv, 128)
        suffix_s = model.suffix_time(256, 128, hkv, 128)
        splits, chunk = choose_overlap_prefix_splits(rows, 128, hkv, 32768, 132, prefix_s, suffix_s)
        assert splits == want and splits * chunk >= 32768 and chunk % 64 == 0
    # however large the suffixes, every SM keeps at least one prefix program
    assert choose_overlap_prefix_splits(256, 128, 32, 32768, 132, 3e-4, 3e-2)[0] == 3
    # no suffix at all: the standalone choice
    assert choose_overlap_prefix_splits(256, 128, 32, 32768, 132, 3e-4, 0.0)[0] == \
        choose_prefix_splits(256, 128, 32, 32768, 132)[0]


def test_cost_model_prefers_cascade_for_long_shared_prefixes():
    model = CostModel()
    assert model.choose(256, 32768, 128, 32, 32, 128, num_sms=H100_SMS) == "cascade"
    assert model.choose(64, 8192, 128, 32, 8, 128, num_sms=H100_SMS) == "cascade"
    # a one-request batch shares nothing: the extra launches can only cost
    assert model.choose(1, 1024, 128, 32, 32, 128, num_sms=H100_SMS) == "decode"


@pytest.mark.skipif(not RESULTS.exists(), reason="no committed GPU benchmark results")
def test_cost_model_within_5_percent_on_measured_grid():
    """Replay the committed H100 grid: the model's pick is never >5% slower than the best path."""
    data = json.loads(RESULTS.read_text())
    model = CostModel()
    for p in data["points"]:
        pick = model.choose(p["batch"], p["prefix"], p["suffix"], p["hq"], p["hkv"], 128,
                            num_sms=H100_SMS)
        best = min(p["ours_cascade_ms"], p["ours_decode_ms"])
        chosen = p["ours_cascade_ms"] if pick == "cascade" else p["ours_decode_ms"]
        assert chosen <= 1.05 * best, (p, pick)


def test_tree_structure_decides_tree_or_cascade():
    from llama_ane.cuda.tree import cascade_tables, shares_below_root

    spec = [-1, 0, 1, 1, 2]  # queries at 2, 3 and 4 all see node 1
    assert shares_below_root(spec, [2, 3, 4])
    few = [-1, 0, 0, 0]  # a prompt and three private branches
    assert not shares_below_root(few, [1, 2, 3])
    # page size 4: the root's 6 tokens on pages 5 and 9, each branch from the start of a page
    slots = [[20, 21, 22, 23, 36, 37], [8, 9, 10, 11, 12], [40, 41], [44]]
    assert cascade_tables(few, slots, [1, 2, 3], 4) == ([5, 9], 6, [0, 2, 3, 4], [2, 3, 10, 11],
                                                        [1, 2, 1])
    # a branch that starts mid-page, or two roots, is no two-level cascade
    assert cascade_tables(few, [slots[0], slots[1], [41, 42], slots[3]], [1, 2, 3], 4) is None
    assert cascade_tables([-1, -1, 0, 1], [[0], [1], [2], [3]], [2, 3], 1) is None
