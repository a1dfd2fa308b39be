"""Long context: SmolLM2 exported with an 8192-token context passes its parity check, and a
6000-token prompt generates (the torch backend reading the export's own weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import llama_ane

pytestmark = [pytest.mark.slow, pytest.mark.long]

CONTEXT = 8192


@pytest.fixture(scope="module")
def long_export(tmp_path_factory):
    from llama_ane.api import export_model

    # verify=True: the parity gate runs on the exported programs and export_model raises if it fails
    return export_model(None, tmp_path_factory.mktemp("long") / "smollm2-8k", context_length=CONTEXT, verify=True,
                        progress=False)


def test_an_8192_context_export_generates_from_a_6000_token_prompt(long_export):
    model = llama_ane.load(long_export, backend="torch")
    try:
        assert model.manifest["context_length"] == CONTEXT
        text = (Path(llama_ane.__file__).parent / "eval_text.txt").read_text()
        base = model.encode(text)
        repeated = base * (6000 // len(base) + 2)
        prompt = repeated[:6000]
        r = model.generate(prompt, max_new_tokens=8)
        print(f"6000-token prompt: prefill {r.prefill_tokens_per_s:.1f} tok/s, decode {r.decode_tokens_per_s:.1f} tok/s")
        assert r.prompt_tokens == 6000 and r.reused_tokens == 0 and 1 <= len(r.token_ids) <= 8
        # attention reaches thousands of tokens back: the second and third copies of the prose are
        # predicted far better than the first (the model copies what it read 2112 tokens earlier)
        logits = model.score(prompt)
        logp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        nll = -logp[np.arange(len(prompt) - 1), prompt[1:]]
        n = len(base)
        first, second, third = nll[:n - 1].mean(), nll[n:2 * n - 1].mean(), nll[2 * n:].mean()
        print(f"mean NLL per copy: {first:.3f}, {second:.3f}, {third:.3f}")
        assert second < 0.5 * first and third < 0.5 * first
    finally:
        model.close()
