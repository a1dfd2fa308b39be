"""The parts of benchmarks/speculative.py that are not timings: the lookup oracle and the step-cost probe."""

from __future__ import annotations

import numpy as np
import pytest

import llama_ane
from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("speculative")


PROMPT = [1, 2, 3, 2, 4, 5]
GENERATED = [9, 1, 2, 4, 5, 6]
# After the prompt and 9: 9 never occurred (a plain step). 1 occurred once, followed by 2 3: a window
# of 2 nodes accepts 2, then the model says 4, not 3 (a one-token match: nothing came before that
# 1). 2 4 occurred in the prompt, followed by 5: a window of 2 nodes accepts 5 after a two-token
# match, then the model's 6 ends the text. 5 tokens after the first, in 3 steps.


def test_the_oracle_drafts_the_longest_continuation_of_an_earlier_occurrence(bench):
    free = bench.lookup_oracle(PROMPT, GENERATED, lambda n: 1.0)
    assert free == {"speedup": round(5 / 3, 3), "windows": 2, "plain_steps": 1,
                    "one_token_match_windows": 1, "one_token_match_tokens": 1}
    costly = bench.lookup_oracle(PROMPT, GENERATED, lambda n: 1.0 + 0.5 * (n - 1))
    assert costly["speedup"] == round(5 / (1 + 1.5 + 1.5), 3)


def test_the_oracle_without_any_repeat_is_plain_decoding(bench):
    oracle = bench.lookup_oracle([1, 2, 3], [4, 5, 6, 7], lambda n: 0.5)
    assert oracle == {"speedup": 1.0, "windows": 0, "plain_steps": 3, "one_token_match_windows": 0,
                      "one_token_match_tokens": 0}


def test_step_costs_are_ratios_to_a_plain_step_and_keep_nothing(bench, tiny_checkpoint):
    model = llama_ane.load(tiny_checkpoint(num_hidden_layers=2), backend="torch", precision="fp32",
                           context_length=128, prefill_length=16, branch_width=0, verify_window=8)
    prompt = [int(t) for t in np.arange(3, 23)]
    costs = bench.step_costs(model, prompt, [2, 4, 8], repeats=2)
    assert list(costs) == [1, 2, 4, 8] and costs[1] == 1.0
    assert all(c > 0 for c in costs.values())
    assert model.pipeline.position == 0  # the probe's cache is dropped
