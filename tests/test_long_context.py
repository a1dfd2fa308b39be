"""Long context: SmolLM2 exported with an 8192-token context passes its parity check, and a
6000-token prompt generates (the torch backend reading the export's own weights)."""

from __future__ import annotations

from pathlib import Path

import pytest

import llama_ane

pytestmark = pytest.mark.slow

CONTEXT = 8192


@pytest.fixture(scope="module")
def long_export(tmp_path_factory):
    from llama_ane.api import export_model

    # export_model runs the parity gate and raises if it fails
    return export_model(None, tmp_path_factory.mktemp("long") / "smollm2-8k", context_length=CONTEXT, progress=False)


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
        assert r.prompt_tokens == 6000 and len(r.token_ids) == 8
        # the prose was seen twice already: the model copies its continuation from thousands of tokens back
        copied = sum(a == b for a, b in zip(r.token_ids, repeated[6000:6008]))
        assert copied >= 6, (r.token_ids, repeated[6000:6008])
    finally:
        model.close()
