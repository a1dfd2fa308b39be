"""Speculative decoding: the verify function (a token tree in one window), the drafters, greedy
output equal to plain decoding, and the sampling path's distribution equal to plain sampling."""

from __future__ import annotations

import json

import numpy as np
import pytest

import llama_ane
from llama_ane.runtime.drafters import DraftTree, ModelDrafter, PromptLookupDrafter
from llama_ane.runtime.sampling import SamplingParams, SeededRandom, probabilities
from llama_ane.runtime.speculative import SpeculativeDecoder, StepTimes, choose

from conftest import no_eos
from swift_fixtures import fixed_step_times

FixedTimes = fixed_step_times()


def _load(folder, **kw):
    opts = dict(backend="torch", precision="fp32", context_length=256, prefill_length=32, layers_per_chunk=2,
                branch_width=0, verify_window=16)
    opts.update(kw)
    return llama_ane.load(folder, **opts)




def repetitive_prompt(seed: int = 0, vocab: int = 300) -> list[int]:
    """Random text with repeated passages, so prompt lookup finds matches (some right, some wrong)."""
    rng = np.random.default_rng(seed)
    parts = [[int(t) for t in rng.integers(3, vocab, n)] for n in (9, 6, 11)]
    return parts[0] + parts[1] + parts[0][:5] + parts[2] + parts[1] + parts[0] + parts[2][:4]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint(num_hidden_layers=3, head_dim=32)


def test_tree_logits_equal_scoring_each_branch(tiny):
    """Every node of a tree gets the logits of scoring its own path alone (tree attention)."""
    model = _load(tiny)
    prompt = repetitive_prompt(1)
    tree = DraftTree.root(prompt[-1])
    a = tree.add(0, 11)
    tree.add(a, 12)
    b = tree.add(0, 13)
    c = tree.add(b, 14)
    tree.add(c, 15)
    tree.add(b, 16)
    p = model.pipeline
    p.reset()
    p.prefill(prompt[:-1])
    got = p.verify_tree(np.array(tree.tokens, np.int32), tree.depths(), tree.mask())
    for node in range(len(tree)):
        path = [node]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        want = model.score(prompt[:-1] + [tree.tokens[i] for i in reversed(path)])[-1]
        assert np.abs(got[node] - want).max() < 1e-3, f"node {node}"


@pytest.mark.parametrize("direct", [True, False])
def test_only_the_accepted_path_reaches_the_cache(tiny, direct):
    model = _load(tiny, direct_cache=direct)
    prompt = repetitive_prompt(2)
    tree = DraftTree.root(prompt[-1])
    x = tree.add(0, 21)
    tree.add(0, 22)
    y = tree.add(x, 23)
    tree.add(x, 24)
    p = model.pipeline
    p.reset()
    p.prefill(prompt[:-1])
    p.wait()
    before = [{k: v.copy() for k, v in c.items()} for c in p.cache.caches]  # (prefill padding past the end)
    p.verify_tree(np.array(tree.tokens, np.int32), tree.depths(), tree.mask())
    p.accept([0, x, y])
    p.wait()
    kept = [prompt[-1], 21, 23]
    assert p.cache.tokens == prompt[:-1] + kept
    spec = [{k: v.copy() for k, v in c.items()} for c in p.cache.caches]
    p.reset()
    p.prefill(prompt[:-1] + kept)
    p.wait()
    n = len(prompt) + 2
    for got, want, old in zip(spec, p.cache.caches, before):
        for key in ("k", "v"):
            assert np.abs(got[key][..., :n] - want[key][..., :n]).max() < 1e-4
            assert (got[key][..., n:] == old[key][..., n:]).all(), "a rejected token was written to the cache"


@pytest.mark.parametrize("direct", [True, False])
def test_greedy_lookup_equals_plain_decoding_fp32(tiny, direct):
    model = _load(tiny, direct_cache=direct)
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        with no_eos(model):
            plain = model.generate(prompt, max_new_tokens=40)
            spec = model.generate(prompt, max_new_tokens=40, speculative="lookup")
        assert spec.token_ids == plain.token_ids
        assert spec.speculative["verify_steps"] > 0
        assert spec.decoded_tokens == plain.decoded_tokens


def test_greedy_draft_model_equals_plain_decoding_fp32(tiny_checkpoint, tiny):
    model = _load(tiny)
    draft = _load(tiny_checkpoint(num_hidden_layers=1, head_dim=32))  # another model, the same tokenizer
    prompt = repetitive_prompt(4)
    with no_eos(model):
        plain = model.generate(prompt, max_new_tokens=30)
        spec = model.generate(prompt, max_new_tokens=30, speculative=ModelDrafter(draft), draft_tokens=5)
        itself = model.generate(prompt, max_new_tokens=30, speculative=ModelDrafter(_load(tiny)), draft_tokens=6)
    assert spec.token_ids == plain.token_ids
    assert itself.token_ids == plain.token_ids
    assert itself.speculative["acceptance_rate"] > 0.9  # the model drafting for itself is always right
    assert itself.speculative["tokens_per_step"] > 2


def test_greedy_speculative_on_the_mil_backend(tiny_export):
    """The exported programs themselves (verify function and its cache update) give plain decoding's tokens."""
    model = llama_ane.load(tiny_export, backend="mil", precision="fp32")
    vocab = model.manifest["config"]["vocab_size"]
    prompt = repetitive_prompt(5, vocab)
    with no_eos(model):
        plain = model.generate(prompt, max_new_tokens=16)
        spec = model.generate(prompt, max_new_tokens=16, speculative="lookup", draft_tokens=6)
    assert spec.token_ids == plain.token_ids
    assert spec.speculative["verify_steps"] > 0


def test_stopping_inside_an_accepted_path_leaves_the_cache_as_plain_decoding(tiny):
    model = _load(tiny)
    prompt = repetitive_prompt(6)
    with no_eos(model):
        plain = model.generate(prompt, max_new_tokens=9, cache=(c1 := model.make_cache()))
        spec = model.generate(prompt, max_new_tokens=9, cache=(c2 := model.make_cache()),
                              speculative=ModelDrafter(_load(tiny)), draft_tokens=6)
    assert spec.token_ids == plain.token_ids
    assert c2.tokens == c1.tokens == prompt + plain.token_ids[:-1]


def test_prompt_lookup_merges_matches_into_a_tree():
    text = [1, 2, 3, 7, 8, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    drafter = PromptLookupDrafter(max_ngram=3, matches=4)
    # the shorter n-grams [2, 3] and [3] end at the same places: no further continuations
    assert drafter.continuations(text, 4) == [(3, [5, 6, 1, 2]), (3, [7, 8, 9, 1])]
    tree = drafter.draft(text, 6)
    assert tree.tokens[0] == 3 and len(tree) - 1 == 6
    assert [tree.tokens[c] for c in tree.children(0)] == [5, 7]  # two branches under the root
    assert tree.tokens == [3, 5, 6, 1, 7, 8, 9]  # the 6 likeliest nodes: each branch's first three
    assert tree.depths().tolist() == [0, 1, 2, 3, 1, 2, 3]
    mask = tree.mask()[0, 0]
    assert (mask[3, [0, 1, 2, 3]] == 0).all() and (mask[3, 4:] < 0).all()
    assert PromptLookupDrafter().draft([4, 5, 6], 8).tokens == [6]  # no match: nothing drafted


def test_prompt_lookup_learns_how_its_proposals_fare():
    """A drafter whose proposals keep being rejected estimates lower chances (and higher ones
    when they are accepted), starting from its prior."""
    text = [1, 2, 3, 7, 8, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    wrong, right = PromptLookupDrafter(max_ngram=3), PromptLookupDrafter(max_ngram=3)
    prior = wrong.chance(3, 1)
    assert prior == pytest.approx(PromptLookupDrafter.PRIOR[3])
    for _ in range(5):
        wrong.draft(text, 6)
        wrong.draft(text + [4], 6)  # neither 5 nor 7 came next
        right.draft(text, 6)
        right.draft(text + [5], 6)  # the most recent match's continuation did
    assert wrong.chance(3, 1) < 0.5 * prior
    assert right.chance(3, 1) == pytest.approx(prior)  # 5 accepted and 7 rejected each time: half, as the prior
    assert right.chance(4, 1) == pytest.approx(PromptLookupDrafter.PRIOR[4])  # what follows 5 is not known yet


def test_expected_tokens_of_a_tree():
    """1 (the model's own next token) + each node's chance that it and its ancestors are accepted."""
    tree = DraftTree.root(1)
    a = tree.add(0, 2, confidence=0.9)
    tree.add(a, 3, confidence=0.9)
    tree.add(0, 4, confidence=0.05)
    assert [node for node, _ in tree.ranked()] == [1, 2, 3]
    assert tree.expected_tokens() == pytest.approx(1 + 0.9 + 0.81 + 0.05)
    assert DraftTree.root(1).expected_tokens() == 1.0


def test_step_times_rule():
    """Verify when expected tokens per second of a verify step beat 1 token per second of a plain step."""
    times = StepTimes()
    assert not times.worth_verifying(5.0)  # no plain step measured yet
    times.plain(0.1)
    times.plain(0.3)
    assert times.plain_seconds == pytest.approx(0.2) and times.verify_seconds is None
    assert times.worth_verifying(1.01) and not times.worth_verifying(1.0)  # a window not measured yet: try one
    times.verify(0.5)
    times.verify(0.7)
    assert times.verify_seconds == pytest.approx(0.6)  # a window costs 3 plain steps
    assert times.worth_verifying(3.1) and not times.worth_verifying(2.9)


class ChanceDrafter:
    """Drafts a chain `tokens[-1] + 1, + 2, ...` whose every node has chance `chance`."""

    def __init__(self, chance: float = 1.0):
        self.chance = chance

    def draft(self, tokens, k):
        tree = DraftTree.root(tokens[-1])
        node = 0
        for i in range(k):
            node = tree.add(node, tokens[-1] + 1 + i, confidence=self.chance)
        return tree


def test_the_decoder_verifies_only_trees_worth_a_window(tiny):
    """A window that costs 3 plain steps: a chain of 4 nodes with chance 0.9 (3.1 tokens expected) is
    verified, one with chance 0.5 (1.9 tokens) is not; the first step is plain; without `adaptive`
    every drafted tree is verified."""
    model = _load(tiny)
    for chance, verified in ((0.9, True), (0.5, False)):
        decoder = SpeculativeDecoder(model.pipeline, ChanceDrafter(chance), SamplingParams(), SeededRandom(0),
                                     lambda token: None, draft_tokens=4)
        assert len(decoder._draft([1, 2, 3])) == 1  # nothing measured: a plain step, to measure one
        decoder.times = FixedTimes(0.1, 0.3)
        assert len(decoder._draft([1, 2, 3])) == (5 if verified else 1)
    decoder = SpeculativeDecoder(model.pipeline, ChanceDrafter(0.01), SamplingParams(), SeededRandom(0),
                                 lambda token: None, draft_tokens=4, adaptive=False)
    assert len(decoder._draft([1, 2, 3])) == 5


def test_the_decoder_measures_both_steps(tiny):
    """Every plain step and every verify step (drafting included) goes to the running averages."""
    model = _load(tiny)
    prompt = repetitive_prompt(3)
    decoder = SpeculativeDecoder(model.pipeline, PromptLookupDrafter(), SamplingParams(), SeededRandom(0),
                                 lambda token: model.pipeline.run_window([token])[0])
    model.pipeline.reset()
    logits = model.pipeline.prefill(prompt)
    for i, _ in enumerate(decoder.tokens(logits, prompt)):
        if i == 20:
            break
    s = decoder.stats
    assert s.decode_steps >= 1 and s.verify_steps >= 1
    assert decoder.times.plain_seconds == pytest.approx(s.decode_seconds / s.decode_steps)
    assert decoder.times.verify_seconds == pytest.approx(s.verify_seconds / s.verify_steps)


def test_lookup_drafts_nothing_where_it_does_not_pay(tiny):
    """With chances that its proposals are accepted far below what a window costs, a generation
    verifies at most one window (the one that measures a window); the output stays plain decoding's."""
    model = _load(tiny)
    prompt = repetitive_prompt(3)

    class Hopeless(PromptLookupDrafter):
        def chance(self, match, votes):
            return 1e-6

    with no_eos(model):
        plain = model.generate(prompt, max_new_tokens=12)
        spec = model.generate(prompt, max_new_tokens=12, speculative=Hopeless())
    assert spec.token_ids == plain.token_ids
    assert spec.speculative["verify_steps"] <= 1


def _sample_first(p_logits, make_tree, params, rng, n):
    """The first token a verify step emits (the accepted child, or the next token) on `make_tree()`, n times."""
    out = np.zeros(p_logits.shape[1], np.int64)
    for _ in range(n):
        tree = make_tree()
        path, nxt = choose(tree, p_logits, params, rng)
        out[tree.tokens[path[1]] if len(path) > 1 else nxt] += 1
    return out


def _chi2_sf(x: float, dof: int) -> float:
    """P(chi2_dof > x), by the Wilson-Hilferty normal approximation (ample for a 1e-3 threshold)."""
    import math

    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _chi2_pvalue(counts, p):
    """Goodness of fit of `counts` to the distribution `p`."""
    keep = p > 0
    expected = counts.sum() * p[keep]
    return _chi2_sf(float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1)


def _homogeneity_pvalue(table: np.ndarray) -> float:
    """Two-sample chi-square test of a (2, k) table of counts: the same distribution in both rows?"""
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    return _chi2_sf(float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1)


@pytest.mark.parametrize("draft_probs", [False, True])
def test_speculative_sampling_keeps_the_distribution(draft_probs):
    """Rejection sampling: the first emitted token is distributed as the model's p, for a tree of
    two point-mass drafts (prompt lookup) and for a draft sampled from its own distribution q."""
    rng = np.random.default_rng(123)
    vocab = 6
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    params = SamplingParams(temperature=0.8)
    p = probabilities(logits[0], params)
    if draft_probs:
        q = rng.dirichlet(np.ones(vocab))
        make = lambda: DraftTree([4, int(rng.choice(vocab, p=q))], [-1, 0], [None, q])  # noqa: E731
    else:
        make = lambda: DraftTree([4, 2, 5], [-1, 0, 0], [None, None, None])  # noqa: E731
    counts = _sample_first(logits, make, params, SeededRandom(7), 20000)
    assert _chi2_pvalue(counts, p) > 1e-3
    # the test can fail: a sampler that kept every draft it proposes would be far from p
    biased = np.bincount([2] * 6000 + list(rng.choice(vocab, 14000, p=p)), minlength=vocab)
    assert _chi2_pvalue(biased, p) < 1e-6


@pytest.mark.slow
def test_speculative_sampling_end_to_end_matches_plain_sampling(tiny):
    """Generated text at temperature > 0 with a fixed seed: the distribution of the tokens after
    the prompt is plain sampling's (two-sample chi-square over the first three tokens)."""
    model = _load(tiny)
    prompt = repetitive_prompt(7)
    cache = model.make_cache()
    runs = 300
    samples = {"plain": [], "spec": []}
    drafter = ModelDrafter(_load(tiny))  # drafts the greedy chain: accepted or rejected at random
    with no_eos(model):
        for i in range(runs):
            for kind in samples:
                spec = dict(speculative=drafter, draft_tokens=2) if kind == "spec" else {}
                r = model.generate(prompt, max_new_tokens=3, temperature=0.6, seed=1000 * i + (kind == "spec"),
                                   cache=cache, **spec)
                samples[kind].append(tuple(r.token_ids))
    for position in range(3):
        tokens = sorted({s[position] for kind in samples for s in samples[kind]})
        table = np.array([[sum(s[position] == t for s in samples[kind]) for t in tokens] for kind in samples])
        frequent = table.sum(axis=0) >= 10
        table = np.concatenate([table[:, frequent], table[:, ~frequent].sum(axis=1, keepdims=True)], axis=1)
        table = table[:, table.sum(axis=0) > 0]
        assert table.shape[1] >= 2 and _homogeneity_pvalue(table) > 1e-3, f"token {position}"


def test_an_export_without_verify_function_is_refused(tiny):
    model = _load(tiny, verify_window=0)
    assert "verify" not in model.manifest["models"]["chunk_0"]["functions"]
    with pytest.raises(ValueError, match="--verify-window"):
        model.generate([5, 6, 7], max_new_tokens=2, speculative="lookup")
    with pytest.raises(ValueError, match="draft_tokens needs"):
        _load(tiny).generate([5, 6, 7], max_new_tokens=2, draft_tokens=3)


def test_cli_speculative_json_and_errors(tiny_export):
    from click.testing import CliRunner

    from llama_ane.cli import main

    def run(*args):
        return CliRunner().invoke(main, ["generate", str(tiny_export), "--backend", "torch", *args],
                                  catch_exceptions=False)

    text = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    plain = run("--prompt", text, "--max-new-tokens", "12", "--json")
    spec = run("--prompt", text, "--max-new-tokens", "12", "--json", "--speculative", "lookup", "--draft-tokens", "4")
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert a["token_ids"] == b["token_ids"]
    assert {"tokens_per_step", "acceptance_rate", "verify_steps"} <= set(b["speculative"])
    bad = run("--prompt", text, "--speculative", "ngram")
    assert bad.exit_code == 1 and bad.output.strip().splitlines()[-1].startswith("Error: --speculative must be")
    bad = run("--prompt", text, "--speculative", "lookup", "--draft-tokens", "99")
    assert bad.exit_code == 1 and "Error: --draft-tokens must be 1..15" in bad.output
    assert "Traceback" not in bad.output


def test_cli_speculative_needs_a_verify_window(tiny):
    """Speculation is opt-in: without a verify window (the default), `generate --speculative` says how
    to get one, in one line."""
    from click.testing import CliRunner

    from llama_ane.cli import main

    out = CliRunner().invoke(main, ["generate", str(tiny), "--backend", "torch", "--prompt", "a b a b",
                                    "--max-new-tokens", "2", "--speculative", "lookup"])
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert out.output.strip().splitlines()[-1].startswith("Error: this export has no verify function")
    assert "--verify-window W" in out.output


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["lookup", pytest.param("draft", marks=pytest.mark.long)])
def test_smollm2_greedy_speculative_equals_plain(drafter):
    model = llama_ane.load("default", backend="torch", precision="fp32", verify_window=16)
    doc = ("The harbour of Harwick could only be entered at high tide. In 1847 a merchant built a stone pier, "
           "and the village became a town. The pier still stands, and the harbour can now be entered at any tide.")
    prompt = model.encode(f"Repeat this text exactly:\n\n{doc}", chat=True)
    plain = model.generate(prompt, max_new_tokens=48)
    speculative = "lookup" if drafter == "lookup" else ModelDrafter(llama_ane.load("default", backend="torch",
                                                                                  precision="fp32"))
    spec = model.generate(prompt, max_new_tokens=48, speculative=speculative, draft_tokens=8)
    assert spec.token_ids == plain.token_ids
    assert spec.speculative["tokens_per_step"] >= 2.0


def test_verify_checks_the_verify_function_mil_against_torch(tiny_export):
    from llama_ane.verify import text_tree, verify_export

    assert text_tree([7, 8, 9, 10, 11]) == ([7, 8, 9, 10, 11], [-1, 0, 1, 0, 3])
    report = verify_export(tiny_export, backend="mil", with_transformers=False)
    tree = [c for c in report.comparisons if "verify tree of 16" in c.reference]
    assert report.passed and len(tree) == 1 and tree[0].top1_agreement >= 0.99
