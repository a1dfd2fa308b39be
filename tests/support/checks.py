"""The end-to-end checks each family's tests run on a tiny checkpoint: the torch backend (fp32) against
transformers' own class of the family (logits, greedy tokens, the gate's reference, cascade branches),
and on one fp16 export the mil backend against torch fp16, decode_branches and `inspect --strict`."""

from __future__ import annotations

import numpy as np
import torch
from click.testing import CliRunner

import llama_ane
from llama_ane.cli import main
from llama_ane.config import FAMILY_CLASS_PREFIX
from llama_ane.verify import compare_logits, default_text

from conftest import NEAR_TIE
from support.parity import (GREEDY_TOKENS, MAX_LOGIT_DIFF, SEQ_LEN, assert_same_greedy, branch_inputs, random_ids,
                            reference_greedy, reference_logits)


def made_once(tmp_path_factory, cases: dict, make):
    """Factory: name of `cases` -> its checkpoint folder, written by `make(folder, **overrides)` once."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = make(tmp_path_factory.mktemp(name), **cases[name])
        return made[name]
    return get


def reference(folder, model_type):
    """transformers' own ForCausalLM class of the family (Qwen2ForCausalLM, ...) in fp32."""
    import transformers

    cls = f"{FAMILY_CLASS_PREFIX[model_type]}ForCausalLM"
    ref = getattr(transformers, cls).from_pretrained(str(folder), dtype=torch.float32).eval()
    assert type(ref).__name__ == cls
    return ref


# --- torch fp32 against transformers' own class -------------------------------------------------

def load_fp32(folder, **options):
    """The torch backend in fp32 over a 256-token context, the model every family check runs."""
    return llama_ane.load(folder, backend="torch", precision="fp32", context_length=256, prefill_length=32,
                          layers_per_chunk=2, **options)


def export_tiny(folder, out):
    """One fp16 export of a tiny checkpoint, the one every family's export checks run on."""
    from llama_ane.api import export_model

    return export_model(folder, out, context_length=256, prefill_length=64, layers_per_chunk=2, progress=False, verify=False)


def check_logits(name, model, ref, model_type: str, vocab: int, length: int = SEQ_LEN) -> None:
    """torch fp32 logits of `length` random ids below `vocab` within MAX_LOGIT_DIFF of transformers' class."""
    cfg = model.manifest["config"]
    assert cfg["model_type"] == model_type
    ids = random_ids(vocab, length, seed=1)
    got, want = model.score(ids), reference_logits(ref, ids)
    assert got.shape == want.shape == (length, cfg["vocab_size"])
    diff = float(np.abs(got - want).max())
    print(f"{name}: max |logit diff| = {diff:.2e} (logits up to {np.abs(want).max():.1f})")
    assert diff <= MAX_LOGIT_DIFF
    assert np.abs(want).max() > 1.0


def check_gate_reference(name, folder, ref, vocab: int) -> None:
    """The parity gate's reference (transformers' own decoder layers, one at a time) builds for the
    family and gives its class's logits: a gate that cannot build it fails (test_verify.py)."""
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.reference import transformers_logits

    ids = random_ids(vocab, 40, seed=3)
    diff = float(np.abs(transformers_logits(ids, load_checkpoint(folder)) - reference_logits(ref, ids)).max())
    print(f"{name}: the gate's transformers reference builds; max |logit diff| against {type(ref).__name__} = {diff:.1e}")
    assert diff <= 1e-4


def check_greedy(model, ref, vocab: int, prompt_length: int) -> None:
    """GREEDY_TOKENS greedy tokens after a random prompt, the same as transformers' class."""
    prompt = random_ids(vocab, prompt_length, seed=2)
    want = reference_greedy(ref, prompt, GREEDY_TOKENS)
    got = model.generate(prompt, max_new_tokens=GREEDY_TOKENS, temperature=0.0)
    assert_same_greedy(got, want, model.eos_token_ids)


def check_cascade(name, folder) -> None:
    """Cascade branches (torch fp32) decode the same tokens as each branch alone."""
    model = load_fp32(folder, branch_width=4, suffix_length=64)
    prefix, conts = branch_inputs(seed=3)
    out = model.generate_branches(prefix, conts, max_new_tokens=10)
    for r, cont in zip(out.branches, conts):
        alone = model.generate(prefix + cont, max_new_tokens=10)
        assert r.token_ids == alone.token_ids, f"{name}: branch {r.index} differs from decoding it alone"
    model.close()


# --- on one fp16 export -------------------------------------------------------------------------

def check_inspect_strict(out) -> None:
    r = CliRunner().invoke(main, ["inspect", str(out), "--strict"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "no ANE rule violations" in r.output


def mil_vs_torch_fp16_on_text(export, label: str, **options):
    """Score the first 128 tokens of the verify text with mil (fp16, `options`) and torch (fp16); print the numbers."""
    mil = llama_ane.load(export, backend="mil", precision="fp16", **options)
    ids = mil.encode(default_text())[:128]
    assert len(ids) == 128
    torch_model = llama_ane.load(export, backend="torch", precision="fp16")
    c = compare_logits(mil.score(ids), torch_model.score(ids), "torch", resolution=np.float16)  # fp16 against fp16
    print(f"{label}: max |logit diff| {c.max_abs_diff:.4f}, mean cosine {c.mean_cosine:.6f}, "
          f"top-1 {c.top1_agreement:.4f}")
    return c


def check_mil_fp16(name, out, top1: float) -> None:
    """The mil backend (fp16) against torch fp16 on real text: top-1 agreement at least `top1`."""
    c = mil_vs_torch_fp16_on_text(out, name)
    assert c.top1_agreement >= top1
    assert c.mean_cosine > 0.999


def check_mil_ane_numerics(name, out) -> None:
    """The mil backend with the Neural Engine's reported deviations (verify --ane-numerics) against torch
    fp16 on real text, at the fp16 thresholds of the parity gate."""
    from llama_ane.verify import TRANSFORMERS_THRESHOLDS

    c = mil_vs_torch_fp16_on_text(out, f"{name} (ANE numerics)", ane_numerics=True)
    assert c.top1_agreement >= TRANSFORMERS_THRESHOLDS.top1
    assert c.mean_cosine >= TRANSFORMERS_THRESHOLDS.cosine


def check_mil_branches(name, out) -> None:
    """The exported decode_branches programs (mil, fp16) against the prefill/decode programs, teacher
    forced. Both are fp16 and round differently: where the fp32 reference's top-2 margin is below
    NEAR_TIE, either token is right, so those positions are left out of the top-1 count (and
    counted, so that the test still covers most positions)."""
    mil = llama_ane.load(out, backend="mil")
    exact = llama_ane.load(out, backend="torch", precision="fp32")
    prefix, conts = branch_inputs(seed=6, lengths=(30, 20, 25))
    agree = total = ties = 0
    for branch, cont in zip(mil.score_branches(prefix, conts), conts):
        alone = mil.score(prefix + cont)[len(prefix):]
        want = exact.score(prefix + cont)[len(prefix):]
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > NEAR_TIE
        agree += int((branch.argmax(-1) == alone.argmax(-1))[clear].sum())
        total, ties = total + int(clear.sum()), ties + int((~clear).sum())
    print(f"{name}: decode_branches vs alone top-1 {agree / total:.4f} over {total} tokens ({ties} near-ties left out)")
    assert agree / total >= 0.99
    assert ties <= 0.25 * (total + ties)
    exact.close()
