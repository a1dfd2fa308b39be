"""KV-Runahead's GPU path on one GPU: the causal-offset attention methods against the torch
reference, and several ranks (threads, gloo with host staging) prefilling on one GPU with the
project's shared-prefix kernel, handing their cache to the decode engine. Skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.cuda


def _paged(k, v, page_size):
    """K/V [n, Hkv, D] in a page-ordered cache [pages, 2, page_size, Hkv, D]."""
    n, hkv, d = k.shape
    pages = -(-n // page_size)
    cache = torch.randn(pages, 2, page_size, hkv, d, device=k.device, dtype=k.dtype)
    flat = cache.permute(1, 0, 2, 3, 4).reshape(2, pages * page_size, hkv, d)
    flat[0, :n], flat[1, :n] = k, v
    return flat.reshape(2, pages, page_size, hkv, d).permute(1, 0, 2, 3, 4).contiguous()


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64), (8, 8, 64)])
@pytest.mark.parametrize("start,c,page_size", [(0, 200, 16), (512, 300, 16), (1024, 1024, 16),
                                               (96, 37, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_offset_attention_methods_match_reference(hq, hkv, d, start, c, page_size, dtype):
    from llama_ane.cuda.runahead.attention import offset_causal

    g = torch.Generator(device="cuda").manual_seed(start + c + hq)
    end = start + c
    q = torch.randn(c, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(end, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(end, hkv, d, device="cuda", dtype=dtype, generator=g)
    cache = _paged(k, v, page_size)
    scale = d ** -0.5
    want = offset_causal("torch", q.float(), k[start:].float(), v[start:].float(),
                         cache.float(), start, scale)
    for method in ("sdpa", "triton"):
        got = offset_causal(method, q, k[start:], v[start:], cache, start, scale)
        assert got.shape == (c, hq, d) and torch.isfinite(got).all(), method
        tol = 2e-3 if dtype == torch.float16 else 1.6e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=method)


def _thread_ranks(world, fn):
    from llama_ane.cuda.runahead.launch import run_thread_ranks

    return run_thread_ranks(world, fn, host_staging=True)


@pytest.fixture(scope="module")
def tiny_engine():
    from transformers import LlamaConfig, LlamaForCausalLM

    from llama_ane.cuda.engine import GPUEngine

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=4096, initializer_range=0.08,
                      tie_word_embeddings=False)
    return GPUEngine(LlamaForCausalLM(cfg).eval(), dtype=torch.float16)


def _same_tokens_up_to_ties(engine, prompt, got, want, rel_tie=0.02):
    """Equal, or parted at an fp16 near-tie of the model (see test_cuda_engine.py)."""
    if got == want:
        return
    i = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)
    logits = engine.prefill_logits(prompt + got[:i])[-1]
    assert (logits[got[i]] - logits[want[i]]).abs() < rel_tie * logits.std(), (i, got, want)


@pytest.mark.parametrize("world,bounds", [(2, [0, 640, 1000]), (3, [0, 448, 768, 1000])])
def test_runahead_ranks_on_one_gpu_match_single_prefill(tiny_engine, world, bounds):
    from llama_ane.cuda.runahead.prefill import (runahead_prefill, sequence_parallel_prefill,
                                                 single_prefill)

    engine = tiny_engine
    ids = torch.randint(0, 512, (1000,), generator=torch.Generator().manual_seed(world))
    results = _thread_ranks(world, lambda t: runahead_prefill(engine, ids, bounds, t,
                                                              all_logits=True))
    want = engine.prefill_logits(ids.tolist())
    got = torch.cat([r.logits for r in results])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    single = single_prefill(engine, ids)
    assert int(results[-1].logits[-1].argmax()) == int(single.logits.argmax())
    # the last rank's cache drives the decode engine like the engine's own prefill
    prompt = ids.tolist()
    plain = engine.generate(prompt, [[]], 16).tokens[0]
    after = engine.generate(prompt, [[]], 16, prefix_cache=results[-1].cache).tokens[0]
    _same_tokens_up_to_ties(engine, prompt, after, plain)
    if 1000 % (world * engine.page_size) == 0:
        sp = _thread_ranks(world, lambda t: sequence_parallel_prefill(engine, ids, t))
        torch.testing.assert_close(sp[-1].logits, single.logits, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not os.environ.get("LLAMA_ANE_SMOLLM2_DIR"),
                    reason="set LLAMA_ANE_SMOLLM2_DIR to the folder holding the SmolLM2 GGUF")
def test_smollm2_greedy_tokens_after_runahead_equal_one_gpu():
    from llama_ane.cuda.engine import SMOLLM2_GGUF, GPUEngine, load_hf_model
    from llama_ane.cuda.runahead.prefill import runahead_prefill

    model, tok = load_hf_model(os.environ["LLAMA_ANE_SMOLLM2_DIR"], SMOLLM2_GGUF)
    engine = GPUEngine(model, dtype=torch.float16)
    text = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    ids = tok(text)["input_ids"][:2000]
    results = _thread_ranks(2, lambda t: runahead_prefill(engine, ids, [0, 1104, 2000], t))
    plain = engine.generate(ids, [[]], 32).tokens[0]
    after = engine.generate(ids, [[]], 32, prefix_cache=results[-1].cache).tokens[0]
    print("SmolLM2 after KV-Runahead:", tok.decode(after))
    assert after == plain
