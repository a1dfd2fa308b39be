"""The parity yardsticks: random prompts, transformers' logits and greedy tokens, the limits a torch
fp32 model is held to against them, and the random prefix and branches a cascade decodes."""

from __future__ import annotations

import numpy as np
import torch

SEQ_LEN = 150          # crosses several prefill windows
GREEDY_TOKENS = 32
MAX_LOGIT_DIFF = 1e-3


@torch.no_grad()
def reference_logits(ref, ids) -> np.ndarray:
    return ref(torch.tensor([list(ids)], dtype=torch.long)).logits[0].float().numpy()


@torch.no_grad()
def reference_greedy(ref, prompt, n) -> list[int]:
    """Greedy tokens by full recomputation: argmax of the last position, no cache, no stopping."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(reference_logits(ref, ids)[-1].argmax()))
    return ids[len(prompt):]


def random_ids(vocab: int, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]  # no special tokens


def assert_same_greedy(ours, want, eos_ids):
    """`ours` stops at EOS; up to there it must equal the reference, which does not stop."""
    assert ours.token_ids == want[:len(ours.token_ids)]
    if len(ours.token_ids) < len(want):
        assert ours.finish_reason == "eos" and want[len(ours.token_ids)] in eos_ids
    else:
        assert ours.finish_reason == "length"


def branch_inputs(seed=0, prefix_len=70, lengths=(1, 3, 7, 2, 5, 9)):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 300, prefix_len)], [[int(t) for t in rng.integers(3, 300, k)] for k in lengths]
