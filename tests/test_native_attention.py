"""The native attention kernel (runtime/backends/native_attention) against `grouped_attention`,
and the torch backend's decoder layers on it."""

from __future__ import annotations

import pytest
import torch

from llama_ane.chunks.layers import MASK_VALUE, grouped_attention
from llama_ane.chunks.models import BlockChunk
from llama_ane.config import LlamaConfig
from llama_ane.runtime.backends import native_attention
from llama_ane.runtime.backends.torch_modules import with_cpu_kernels

needs_kernel = pytest.mark.skipif(not native_attention.available(), reason="no native kernels here")


def window_inputs(g: int, r: int, d: int, s: int, t: int, seed: int, context: int = 300):
    """Attention inputs of a window of s tokens after t cached ones: the caches are views of the
    first t positions of (G, D, context) arrays, as the pipeline passes them; the window sees the
    cache and the tokens before it (a chain), MASK_VALUE elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(g, r, d, s, generator=gen) / d ** 0.5
    k_full, v_full = torch.randn(g, d, context, generator=gen), torch.randn(g, d, context, generator=gen)
    k_win, v_win = torch.randn(g, d, s, generator=gen), torch.randn(g, d, s, generator=gen)
    mask = torch.zeros(1, 1, s, t + s)
    mask[0, 0, :, t:] = torch.triu(torch.full((s, s), MASK_VALUE), 1)
    return q, k_full[..., :t], v_full[..., :t], k_win, v_win, mask


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("t", [0, 5, 16, 37, 250])
def test_attend_is_grouped_attention(t, threads):
    """Same result as the torch form for windows of 1..17 tokens, caches shorter than a panel, a
    whole number of panels and a rest, an empty cache, on 1 and 2 threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for s in (1, 2, 3, 6, 7, 16, 17):
            args = window_inputs(3, 2, 16, s, t, seed=t + s)
            torch.testing.assert_close(native_attention.attend(*args, 2, t), grouped_attention(*args, 2, t),
                                       rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_a_query_row_does_not_depend_on_the_others():
    """Each window token's output is the same bits as when it is the window's last token alone
    (its keys before it in the cache), whatever the window's size and the thread count: a verify
    window's attention is exactly that of one-token decoding."""
    g, r, d, t, s = 3, 3, 64, 123, 16
    q, k_cache, v_cache, k_win, v_win, mask = window_inputs(g, r, d, s, t, seed=7)
    keys, values = torch.cat([k_cache, k_win], dim=2), torch.cat([v_cache, v_win], dim=2)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            window = native_attention.attend(q, k_cache, v_cache, k_win, v_win, mask, r, t)
            for j in range(s):  # token j alone, after t + j cached tokens
                alone = native_attention.attend(q[..., j:j + 1], keys[..., :t + j], values[..., :t + j],
                                                k_win[..., j:j + 1], v_win[..., j:j + 1],
                                                torch.zeros(1, 1, 1, t + j + 1), r, t + j)
                assert torch.equal(alone[..., 0], window[..., j]), (threads, j)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_attend_refuses_what_does_not_match():
    q, k_cache, v_cache, k_win, v_win, mask = window_inputs(2, 2, 8, 2, 10, seed=1)
    with pytest.raises(ValueError, match="do not match"):
        native_attention.attend(q, k_cache, v_cache, k_win, v_win, mask, 3, 10)


@needs_kernel
def test_cpu_kernels_attend_natively_and_give_the_block_s_result():
    """with_cpu_kernels gives a block's decoder layers the native attention (the original keeps the
    torch form, which the export traces), and the copy computes what the block does."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    block = BlockChunk(cfg, [0, 1], 32).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    fast = with_cpu_kernels(block, "native")
    assert all(layer.attend is native_attention.attend for layer in fast.layers)
    assert all(layer.attend is grouped_attention for layer in block.layers)
    s, t = 3, 9
    x = torch.randn(1, 64, 1, s)
    cos, sin = torch.randn(1, 16, 1, s), torch.randn(1, 16, 1, s)
    mask = torch.zeros(1, 1, s, t + s)
    mask[0, 0, :, t:] = torch.triu(torch.full((s, s), MASK_VALUE), 1)
    caches = torch.randn(2, 32, 1, t), torch.randn(2, 32, 1, t)
    with torch.no_grad():
        for got, want in zip(fast(x, cos, sin, mask, *caches), block(x, cos, sin, mask, *caches)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
