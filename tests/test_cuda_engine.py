"""The GPU decode engine: cascade decoding gives the same greedy tokens as plain paged decode, and
its forward matches transformers' LlamaForCausalLM. Skipped without CUDA + triton."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, initializer_range=0.08,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder)
    return folder


def _branches(seed, n, lo, hi, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def test_engine_forward_matches_transformers(tiny_llama):
    from llama_ane.cuda.engine import GPUEngine, load_hf_model

    model, _ = load_hf_model(tiny_llama)
    engine = GPUEngine(model, dtype=torch.float16)
    ids = _branches(1, 1, 100, 100)[0]
    with torch.no_grad():
        want = model.to("cuda")(torch.tensor([ids], device="cuda")).logits[0].float()
    got = engine.prefill_logits(ids)
    rel = (got - want).norm() / want.norm()
    assert rel < 1e-2, rel


def _assert_same_up_to_ties(engine, prompt, branches, got, want, rel_tie):
    """Token lists must be equal, except that they may part at an exact near-tie of the model.

    Cascade and plain decode add the same fp32 terms in a different order, so their fp16 outputs
    can differ in the last bit; on a random model two logits can be that close (bf16 keeps 8
    bits, so its ties are wider than fp16's). At the first
    difference both tokens must be within ``rel_tie`` logit-std of each other in a full causal
    recompute; after it the branches legitimately continue differently.
    """
    for b, g, w in zip(branches, got, want):
        if g == w:
            continue
        i = next(i for i, (x, y) in enumerate(zip(g, w)) if x != y)
        seq = prompt + b + g[:i]
        logits = engine.prefill_logits(seq)[-1]
        gap = (logits[g[i]] - logits[w[i]]).abs()
        assert gap < rel_tie * logits.std(), (i, gap.item(), logits.std().item())


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cascade_tokens_equal_plain_decode(tiny_llama, page_size, dtype):
    from llama_ane.cuda.engine import GPUEngine, load_hf_model

    model, _ = load_hf_model(tiny_llama)
    engine = GPUEngine(model, dtype=dtype, page_size=page_size)
    prompt = _branches(2, 1, 300, 300)[0]
    branches = _branches(3, 8, 1, 12)
    plain = engine.generate(prompt, branches, 24, path="decode")
    cascade = engine.generate(prompt, branches, 24, path="cascade")
    auto = engine.generate(prompt, branches, 24, path="auto")
    assert cascade.paths_used == {"cascade": cascade.steps}
    assert plain.paths_used == {"decode": plain.steps}
    assert all(len(t) == 24 for t in cascade.tokens)
    rel_tie = 0.02 if dtype == torch.float16 else 0.06
    _assert_same_up_to_ties(engine, prompt, branches, cascade.tokens, plain.tokens, rel_tie)
    _assert_same_up_to_ties(engine, prompt, branches, auto.tokens, plain.tokens, rel_tie)
    # the tokens are what a full causal recompute picks (up to near-ties)
    for b, toks in zip(branches, cascade.tokens):
        seq = prompt + b + toks
        logits = engine.prefill_logits(seq[:-1])[len(prompt) + len(b) - 1:]
        picked = logits.gather(1, torch.tensor(toks, device="cuda")[:, None])[:, 0]
        assert ((logits.max(1).values - picked) < 0.05 * logits.std(1)).all()
    identical = sum(c == p for c, p in zip(cascade.tokens, plain.tokens))
    print(f"{identical}/{len(branches)} branches token-identical")


@pytest.mark.skipif(not os.environ.get("LLAMA_ANE_SMOLLM2_DIR"),
                    reason="set LLAMA_ANE_SMOLLM2_DIR to the folder holding the SmolLM2 GGUF")
def test_smollm2_cascade_equals_plain_decode():
    from llama_ane.cuda.engine import SMOLLM2_GGUF, GPUEngine, load_hf_model

    model, tok = load_hf_model(os.environ["LLAMA_ANE_SMOLLM2_DIR"], SMOLLM2_GGUF)
    engine = GPUEngine(model, dtype=torch.float16)
    from llama_ane.commands.gpu_generate import DEFAULT_BRANCHES, DEFAULT_PROMPT

    prompt = tok(DEFAULT_PROMPT)["input_ids"]
    branches = [tok(b, add_special_tokens=False)["input_ids"] for b in DEFAULT_BRANCHES]
    plain = engine.generate(prompt, branches, 32, path="decode")
    cascade = engine.generate(prompt, branches, 32, path="cascade")
    print("SmolLM2 branches:", [tok.decode(t) for t in cascade.tokens])
    assert cascade.tokens == plain.tokens


@pytest.mark.parametrize("path", ["cascade", "decode"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_replays_the_eager_step(tiny_llama, path, page_size):
    """The decode step replayed as a CUDA graph gives exactly the eager loop's tokens."""
    from llama_ane.cuda.engine import GPUEngine, load_hf_model

    model, _ = load_hf_model(tiny_llama)
    engine = GPUEngine(model, dtype=torch.float16, page_size=page_size)
    prompt = _branches(4, 1, 200, 200)[0]
    branches = _branches(5, 6, 1, 20)
    eager = engine.generate(prompt, branches, 40, path=path, cuda_graph=False)
    graph = engine.generate(prompt, branches, 40, path=path, cuda_graph=True)
    assert graph.tokens == eager.tokens
    assert graph.paths_used == eager.paths_used == {path: eager.steps}
    print(f"{path} page {page_size}: eager {eager.tokens_per_second:.0f} tokens/s, "
          f"graph {graph.tokens_per_second:.0f} tokens/s")


@pytest.mark.parametrize("path", ["cascade", "decode"])
def test_engine_replans_its_attention_for_each_generation(tiny_llama, path):
    """One engine keeps its attention object across generations of other sizes and plans it again
    for each: its tokens are a fresh engine's."""
    from llama_ane.cuda.engine import GPUEngine, load_hf_model

    model, _ = load_hf_model(tiny_llama)
    prompt = _branches(6, 1, 200, 200)[0]
    branches = _branches(7, 5, 1, 20)
    fresh = GPUEngine(model, dtype=torch.float16).generate(prompt, branches, 16, path=path)
    engine = GPUEngine(model, dtype=torch.float16)
    engine.generate(_branches(8, 1, 600, 600)[0], _branches(9, 12, 1, 40), 24, path=path)
    attention = engine._attention[path]
    again = engine.generate(prompt, branches, 16, path=path)
    assert engine._attention[path] is attention
    assert again.tokens == fresh.tokens
