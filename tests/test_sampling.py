"""Next-token sampling: greedy, seeded determinism, temperature, top-k and top-p support, the generator
and the per-branch seeding rule shared with Swift."""

from __future__ import annotations

import numpy as np
import pytest

import llama_ane
from llama_ane.runtime.sampling import (REPETITION_WINDOW, SamplingParams, SeededRandom, argmax, branch_seed,
                                       penalize, sample)
from conftest import no_eos


def draws(logits, params, n=4000, seed=0) -> np.ndarray:
    rng = SeededRandom(seed)
    return np.array([sample(logits, params, rng) for _ in range(n)])


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax(seed):
    logits = np.random.default_rng(seed).normal(size=1000).astype(np.float32)
    rng = SeededRandom(0)
    assert sample(logits, SamplingParams(), rng) == int(np.argmax(logits))
    # top-k / top-p do not change greedy, nor does the generator's state
    assert sample(logits, SamplingParams(0.0, top_k=5, top_p=0.5), rng) == int(np.argmax(logits))


def test_the_generator_is_splitmix_seeded_xoshiro256starstar():
    """SplitMix64's first output for seed 0 is the published 0xE220A8397B1DCDAF; xoshiro256** of a
    state is computed here step by step, apart from the class."""
    rng = SeededRandom(0)
    s = list(rng._s)
    assert s[0] == 0xE220A8397B1DCDAF
    mask = (1 << 64) - 1
    rotl = lambda x, k: ((x << k) | (x >> (64 - k))) & mask  # noqa: E731
    want = []
    for _ in range(5):
        want.append(rotl(s[1] * 5 & mask, 7) * 9 & mask)
        t = s[1] << 17 & mask
        s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t; s[3] = rotl(s[3], 45)  # noqa: E702
    assert [rng.next() for _ in range(5)] == want
    units = [SeededRandom(1).next_unit() for _ in range(1)] + [rng.next_unit() for _ in range(2000)]
    assert all(0 <= u < 1 for u in units) and abs(np.mean(units) - 0.5) < 0.03


def test_nan_logits_are_never_drawn():
    logits = np.array([np.nan, 1.0, np.nan, 0.5], np.float32)
    assert sample(logits, SamplingParams(), SeededRandom(0)) == 1
    assert set(draws(logits, SamplingParams(temperature=1.0), 500).tolist()) == {1, 3}


def test_seeded_sampling_is_deterministic():
    logits = np.random.default_rng(1).normal(size=500)
    params = SamplingParams(temperature=1.0)
    a, b = draws(logits, params, 200, seed=7), draws(logits, params, 200, seed=7)
    c = draws(logits, params, 200, seed=8)
    assert (a == b).all()
    assert (a != c).any()


def test_temperature_follows_softmax():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    for t in (1.0, 0.5, 2.0):
        want = np.exp(logits / t) / np.exp(logits / t).sum()
        got = np.bincount(draws(logits, SamplingParams(temperature=t), 20000), minlength=4) / 20000
        np.testing.assert_allclose(got, want, atol=0.015)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_restricts_the_support(k):
    logits = np.random.default_rng(2).normal(size=50)
    top = set(np.argsort(-logits)[:k].tolist())
    got = set(draws(logits, SamplingParams(temperature=5.0, top_k=k)).tolist())  # hot: all k get drawn
    assert got == top


def test_top_k_larger_than_vocab_is_no_filter():
    logits = np.zeros(6)
    assert set(draws(logits, SamplingParams(temperature=1.0, top_k=100), 2000).tolist()) == set(range(6))


@pytest.mark.parametrize("top_p, support", [
    (0.4, {0}),           # the top token alone reaches 0.4
    (0.7, {0, 1}),
    (0.79, {0, 1}),       # 0.5 + 0.3 reaches it
    (0.81, {0, 1, 2}),
    (0.99, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, support):
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    order = np.array([2, 0, 3, 1])  # shuffled positions: the filter must sort
    logits = np.empty(4)
    logits[order] = np.log(probs)
    got = set(draws(logits, SamplingParams(temperature=1.0, top_p=top_p), 4000).tolist())
    assert got == {int(order[i]) for i in support}


def test_top_p_renormalises():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    got = np.bincount(draws(logits, SamplingParams(temperature=1.0, top_p=0.75), 20000), minlength=4) / 20000
    np.testing.assert_allclose(got, [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.015)


def test_top_k_and_top_p_together():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    # top-k 3 renormalises to [4/9, 3/9, 2/9]; top-p 0.7 then keeps the first two (4/9 + 3/9 >= 0.7)
    got = set(draws(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7)).tolist())
    assert got == {0, 1}


@pytest.mark.parametrize("kwargs, word", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_parameters(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    model = llama_ane.load(tiny_checkpoint(), backend="torch", context_length=128, prefill_length=16)
    yield model
    model.close()


def test_generate_with_a_seed_is_reproducible(tiny_model):
    prompt = list(range(10, 30))
    a = tiny_model.generate(prompt, max_new_tokens=24, temperature=1.0, seed=11)
    b = tiny_model.generate(prompt, max_new_tokens=24, temperature=1.0, seed=11)
    c = tiny_model.generate(prompt, max_new_tokens=24, temperature=1.0, seed=12)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_generate_top_k_1_is_greedy(tiny_model):
    prompt = list(range(40, 60))
    greedy = tiny_model.generate(prompt, max_new_tokens=16)
    assert tiny_model.generate(prompt, max_new_tokens=16, temperature=1.5, top_k=1, seed=3).token_ids == greedy.token_ids


def test_branch_i_samples_as_a_single_generation_seeded_seed_plus_i(tiny_model):
    """The per-branch seeding rule (shared with Swift): branch i of `generate_branches(seed=s)`
    gives the tokens of `generate(seed=s + i)` on the same prefix."""
    prefix = list(range(10, 30))
    out = tiny_model.generate_branches(prefix, n=3, max_new_tokens=12, temperature=1.0, seed=41)
    alone = [tiny_model.generate(prefix, max_new_tokens=12, temperature=1.0, seed=branch_seed(41, i)).token_ids
             for i in range(3)]
    assert [b.token_ids for b in out.branches] == alone
    assert len({tuple(t) for t in alone}) > 1  # the branches differ: each has its own seed
    assert branch_seed(2**64 - 1, 2) == 1  # wraps as Swift's UInt64 &+ does


# --- min-p and the repetition penalty -------------------------------------------------------------


@pytest.mark.parametrize("min_p, support", [
    (0.0, {0, 1, 2, 3}),
    (0.19, {0, 1, 2}),    # 0.1 / 0.5 = 0.2
    (0.21, {0, 1}),
    (0.5, {0, 1}),
    (0.61, {0}),          # 0.3 / 0.5 = 0.6
    (1.0, {0}),           # the most likely token always stays
])
def test_min_p_keeps_tokens_within_a_ratio_of_the_most_likely(min_p, support):
    probs = np.array([0.5, 0.3, 0.1, 0.1])
    probs[3] = 0.09  # 0.18 of the most likely
    order = np.array([3, 1, 0, 2])
    logits = np.empty(4)
    logits[order] = np.log(probs)
    got = set(draws(logits, SamplingParams(temperature=1.0, min_p=min_p), 4000).tolist())
    assert got == {int(order[i]) for i in support}


def test_min_p_follows_temperature_and_renormalises():
    """min-p judges the tempered distribution: at T=0.5 the ratios square."""
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    # T=1: ratios 0.6, 0.4 -> min_p 0.5 keeps {0, 1}; T=0.5: 0.36, 0.16 -> keeps {0}
    assert set(draws(logits, SamplingParams(temperature=1.0, min_p=0.5), 3000).tolist()) == {0, 1}
    assert set(draws(logits, SamplingParams(temperature=0.5, min_p=0.5), 3000).tolist()) == {0}
    got = np.bincount(draws(logits, SamplingParams(temperature=1.0, min_p=0.5), 20000), minlength=3) / 20000
    np.testing.assert_allclose(got, [0.5 / 0.8, 0.3 / 0.8, 0], atol=0.015)


def test_min_p_comes_after_top_p():
    """[0.4, 0.3, 0.2, 0.1]: top-p 0.75 keeps {0, 1, 2} (0.4 + 0.3 < 0.75), then min-p 0.45 keeps all
    three (0.2 / 0.4 = 0.5). The other order would renormalise min-p's {0, 1, 2} to [4/9, 3/9, 2/9]
    and top-p would then stop at {0, 1}."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.75, min_p=0.45), 4000).tolist()) == {0, 1, 2}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0], np.float32)
    got = penalize(logits, [0, 1, 1, 4], 2.0)
    np.testing.assert_array_equal(got, np.array([1.0, -2.0, 0.5, 3.0, -4.0], np.float32))
    assert penalize(logits, [0, 1], 1.0) is logits  # no penalty: untouched
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 3.0, -2.0])  # the input is not modified


def test_repetition_penalty_reads_only_the_last_window():
    logits = np.ones(REPETITION_WINDOW + 2, np.float32)
    context = list(range(REPETITION_WINDOW + 1))  # token 0 falls out of the window
    got = penalize(logits, context, 4.0)
    assert got[0] == 1.0 and got[REPETITION_WINDOW + 1] == 1.0
    assert (got[1:REPETITION_WINDOW + 1] == 0.25).all()


def test_repetition_penalty_changes_greedy_and_sampling():
    logits = np.array([3.0, 2.9, -1.0], np.float32)
    assert sample(logits, SamplingParams(), SeededRandom(0), recent=[0]) == 0
    assert sample(logits, SamplingParams(repetition_penalty=1.5), SeededRandom(0), recent=[0]) == 1
    got = set(draws(logits, SamplingParams(temperature=1.0, repetition_penalty=50.0), 2000).tolist())
    assert got == {0, 1, 2}  # without recent tokens nothing is penalized
    # seen: 3/50 = 0.06 and 2.9/50 = 0.058; unseen 2 keeps -1: the penalty moved most of the mass
    rng = SeededRandom(3)
    drawn = [sample(logits, SamplingParams(temperature=1.0, repetition_penalty=50.0), rng, recent=[0, 1])
             for _ in range(2000)]
    np.testing.assert_allclose(np.bincount(drawn, minlength=3) / 2000,
                               np.exp([0.06, 0.058, -1.0]) / np.exp([0.06, 0.058, -1.0]).sum(), atol=0.03)


@pytest.mark.parametrize("kwargs, word", [
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
])
def test_bad_min_p_and_penalty(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_seeded_min_p_and_penalty_sampling_is_deterministic():
    logits = np.random.default_rng(4).normal(size=300)
    params = SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.3)
    recent = list(range(0, 300, 7))
    a = [sample(logits, params, SeededRandom(9), recent) for _ in range(3)]
    rng1, rng2 = SeededRandom(5), SeededRandom(5)
    assert [sample(logits, params, rng1, recent) for _ in range(100)] == \
        [sample(logits, params, rng2, recent) for _ in range(100)]
    assert len(set(a)) == 1


def test_generate_applies_the_penalty_to_the_prompt_and_the_reply(tiny_model):
    """Greedy generation with a penalty equals a step-by-step reference: score the context so far,
    penalize its last window, take the argmax."""
    with no_eos(tiny_model):
        # the prompt holds what plain greedy decoding would say next, so the penalty must matter
        prompt = [5, 6, 7, 8]
        prompt += tiny_model.generate(prompt, max_new_tokens=8).token_ids
        got = tiny_model.generate(prompt, max_new_tokens=6, repetition_penalty=3.0).token_ids
        plain = tiny_model.generate(prompt, max_new_tokens=6).token_ids
    context = list(prompt)
    for _ in range(6):
        logits = tiny_model.score(context)[-1]
        context.append(argmax(penalize(logits, context, 3.0)))
    assert got == context[len(prompt):]
    assert got != plain  # the penalty changed something on this prompt


def test_generate_with_min_p_and_a_seed_is_reproducible(tiny_model):
    prompt = list(range(10, 30))
    a = tiny_model.generate(prompt, max_new_tokens=16, temperature=1.5, min_p=0.1, seed=2)
    b = tiny_model.generate(prompt, max_new_tokens=16, temperature=1.5, min_p=0.1, seed=2)
    assert a.token_ids == b.token_ids


def test_the_penalty_is_refused_with_speculative_decoding(tiny_model):
    with pytest.raises(ValueError, match="repetition penalty"):
        tiny_model.generate([1, 2, 3], max_new_tokens=2, repetition_penalty=1.2, speculative="lookup")
