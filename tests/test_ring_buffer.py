"""The sliding layers' ring buffer: its length, the slots its masks see, windows that wrap around
its end, rewinding, prompt-cache files, the cascade over a ring, `info`, and an export whose caches
are inputs (the family exports of tests/test_families.py keep theirs in states).

The checkpoint is the tiny Gemma 3 of test_families (window 40: not a multiple of 32; sliding
layers 0 and 2 around a full one), held to transformers' Gemma3ForCausalLM.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import llama_ane
from llama_ane.cli import main
from llama_ane.config import LlamaConfig
from llama_ane.model.embeddings import held_positions
from llama_ane.model.functions import ring_length, ring_rewind_limit
from llama_ane.runtime.kv_cache import PromptCacheError
from llama_ane.testing import TINY_CONFIG

from support.checks import check_inspect_strict, check_mil_branches, check_mil_fp16, reference
from support.families import CASES, make_family_checkpoint
from support.parity import MAX_LOGIT_DIFF, random_ids, reference_logits

NAME = "gemma3_tied_gqa"
CONFIG = dict(TINY_CONFIG, vocab_size=320, **CASES[NAME])


def _cfg() -> LlamaConfig:
    return LlamaConfig.from_hf_dict(CONFIG)


# --- the ring's arithmetic (unit) ---------------------------------------------------------------

def test_the_ring_holds_the_window_and_a_padded_window_in_multiples_of_32():
    cfg = _cfg()  # window 40
    assert ring_length(cfg, 256, 64) == 128  # 40 + 63 = 103 -> 128
    assert ring_length(cfg, 256, 32) == 96  # 40 + 31 = 71 -> 96
    assert ring_length(cfg, 256, 1) == 64  # 40 -> 64
    assert ring_length(cfg, 40, 32) == 0  # the window covers the context: no sliding mask, no ring
    assert ring_length(cfg, 96, 32) == 0  # a ring no shorter than the context: the full cache
    assert ring_rewind_limit(cfg, 96, 32) == 26


def test_held_positions_are_the_latest_below_position_in_each_slot():
    for ring in (32, 96):
        for position in (0, 1, 31, 32, 95, 96, 97, 200, 1000):
            held = held_positions(torch.tensor([position], dtype=torch.int32), ring).reshape(-1).tolist()
            want = [max([q for q in range(position) if q % ring == j], default=-1) for j in range(ring)]
            assert [max(h, -1) for h in held] == want, (ring, position)


# --- info: the ring does not grow with the context (unit) -----------------------------------------

def _info(tmp_path, context: int) -> tuple[dict, str]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    runner = CliRunner()
    as_json = runner.invoke(main, ["info", "--config", str(config), "--context-length", str(context), "--json"])
    text = runner.invoke(main, ["info", "--config", str(config), "--context-length", str(context)])
    assert as_json.exit_code == 0 and text.exit_code == 0, as_json.output + text.output
    return json.loads(as_json.output), text.output


def test_info_shows_a_sliding_cache_that_does_not_grow_with_the_context(tmp_path):
    from llama_ane.contract.traffic import kv_read_bytes

    small, small_text = _info(tmp_path, 256)
    large, large_text = _info(tmp_path, 2048)
    assert small["cache"]["sliding"] == large["cache"]["sliding"] == {"length": 128, "layers": [0, 2]}
    line = [s for s in small_text.splitlines() if s.strip().startswith("sliding")]
    assert len(line) == 1 and "128 positions" in line[0] and "MB of K/V" in line[0]
    assert line == [s for s in large_text.splitlines() if s.strip().startswith("sliding")]
    for m in (small, large):  # every function's ring is R slots, whatever its bucket
        shapes = {t["shape"][3] for model in m["models"].values() for f in model["functions"].values()
                  for t in f["inputs"] + f.get("states", []) if t["name"] in ("k_ring", "v_ring")}
        assert shapes == {128}
    # a step reads the full layer's cache up to the context, the ring whole: only the former grows
    per_position = 2 * 1 * small["cache"]["channels"] * 2  # K and V, one full layer, fp16
    grown = kv_read_bytes(large, 2048) - kv_read_bytes(small, 256)
    assert grown == per_position * (2048 - 256)


# --- torch fp32 against transformers ------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_family_checkpoint(tmp_path_factory.mktemp("ring"), **CASES[NAME])


@pytest.fixture(scope="module")
def ref(folder):
    return reference(folder, CASES[NAME]["model_type"])


def _load(folder, **options):
    return llama_ane.load(folder, backend="torch", precision="fp32", context_length=256, prefill_length=32,
                          layers_per_chunk=2, **options)


@pytest.mark.export
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "cache_update"])
def test_prefill_windows_that_wrap_around_the_ring(folder, ref, direct):
    """Windows starting at 10, 42, 74, ... of a 96-slot ring: the one at 74 runs past its end and
    wraps to slot 0 (written in place, or by the cache-update modules' one-hot); decoding goes on
    past the context's first ring-full. Logits equal transformers' at every position."""
    model = _load(folder, direct_cache=direct)
    ring = model.manifest["cache"]["sliding"]["length"]
    assert ring == 96
    ids = random_ids(300, 170, seed=4)
    pipe = model.pipeline
    pipe.reset()
    got = [pipe.prefill(ids[:10], all_logits=True)]
    starts = list(range(10, 160, 32))
    assert any(s % ring + 32 > ring for s in starts)  # a window that wraps
    got.append(pipe.prefill(ids[10:160], all_logits=True))
    got += [pipe.run_window([t]) for t in ids[160:]]
    pipe.wait()
    diff = np.abs(np.concatenate(got) - reference_logits(ref, ids)).max()
    assert diff <= MAX_LOGIT_DIFF
    model.close()


@pytest.mark.export
def test_rewinding_past_the_rings_reach_starts_again(folder, ref):
    """A prompt that shares only its first 100 of 150 cached tokens: the ring's slots of those
    tokens' windows were overwritten since, so nothing is reused, and the logits stay right; one
    that shares all but the last token reuses them."""
    model = _load(folder)
    ids = random_ids(300, 150, seed=5)
    model.pipeline.reset()
    model.pipeline.prefill(ids)
    other = ids[:100] + random_ids(300, 30, seed=6)
    logits, reused = model.pipeline.extend(other)
    assert reused == 0
    assert np.abs(logits - reference_logits(ref, other)[-1]).max() <= MAX_LOGIT_DIFF
    logits, reused = model.pipeline.extend(other[:-1] + [7])
    assert reused == len(other) - 1
    assert np.abs(logits - reference_logits(ref, other[:-1] + [7])[-1]).max() <= MAX_LOGIT_DIFF
    model.close()


@pytest.mark.export
def test_a_prompt_cache_holds_the_ring(folder, tmp_path):
    """Saved past the ring's length and loaded into a new cache, it continues as the run that made
    it; a file whose ring length disagrees with the export is refused by name."""
    model = _load(folder)
    prompt, more = random_ids(300, 130, seed=7), random_ids(300, 6, seed=8)
    cache = model.make_cache()
    model.generate(prompt, cache=cache, max_new_tokens=1)
    path = model.save_cache(cache, tmp_path / "ring.npz")
    loaded = model.load_cache(path)
    for a, b in zip(cache.caches, loaded.caches):
        assert set(a) == set(b) and all(np.array_equal(a[k][..., :len(prompt)] if k in ("k", "v") else a[k],
                                                       b[k][..., :len(prompt)] if k in ("k", "v") else b[k])
                                        for k in a)
    again = model.generate(prompt + more, cache=loaded, max_new_tokens=16)
    assert again.reused_tokens == len(prompt)
    assert again.token_ids == model.generate(prompt + more, max_new_tokens=16).token_ids

    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads(arrays["meta"].tobytes())
    meta["ring_length"] = 64
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    bad = tmp_path / "bad.npz"
    np.savez(bad, **arrays)
    with pytest.raises(PromptCacheError, match="ring buffer holds 64 positions, this export's 96"):
        model.load_cache(bad)
    model.close()


@pytest.mark.export
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "cache_update"])
def test_branches_whose_suffix_pushes_the_prefix_out_of_the_window(folder, direct):
    """Each branch's own text and answer (45 + 10 tokens) run past the window of 40: the prefix's
    positions leave every sliding layer's view as the branch's query moves on, and its ring's
    masks hide them; the tokens equal decoding each branch alone."""
    model = _load(folder, branch_width=2, suffix_length=64, direct_cache=direct)
    prefix = random_ids(300, 60, seed=9)
    own = [random_ids(300, 45, seed=10), random_ids(300, 20, seed=11)]
    out = model.generate_branches(prefix, own, max_new_tokens=10)
    for r, cont in zip(out.branches, own):
        assert r.token_ids == model.generate(prefix + cont, max_new_tokens=10).token_ids
    model.close()


# --- an export with its caches as inputs, and a verify function ---------------------------------

@pytest.fixture(scope="module")
def inputs_export(folder, tmp_path_factory):
    from llama_ane.api import export_model

    return export_model(folder, tmp_path_factory.mktemp("export") / "ring_inputs", context_length=256,
                        prefill_length=64, layers_per_chunk=2, kv_cache="inputs", verify_window=8, branch_width=2,
                        suffix_length=32, progress=False, verify=False)


@pytest.mark.export
def test_the_inputs_export_passes_inspect_and_runs_as_torch(inputs_export):
    manifest = json.loads((inputs_export / "manifest.json").read_text())
    assert manifest["cache"]["kind"] == "inputs" and manifest["cache"]["sliding"]["length"] == 128
    assert manifest["chunks"][0]["cache_update"]["prefill"] == "prefill_l1_r1"  # layers 0 (ring) and 1 (full)
    check_inspect_strict(inputs_export)
    check_mil_fp16(NAME, inputs_export, top1=0.98)
    check_mil_branches(NAME, inputs_export)


@pytest.mark.export
def test_speculative_decoding_writes_the_accepted_path_into_the_ring(inputs_export):
    """Verify trees past the ring's length (the mil programs, the verify cache update writing ring
    slots) give the tokens plain decoding gives."""
    model = llama_ane.load(inputs_export, backend="mil")
    text = random_ids(300, 20, seed=12)
    prompt = text * 7  # repeats, for prompt lookup to draft from; 140 tokens, past the ring's 128
    plain = model.generate(prompt, max_new_tokens=20)
    fast = model.generate(prompt, max_new_tokens=20, speculative="lookup")
    assert fast.token_ids == plain.token_ids
    model.close()
