"""--decode-function prefill: no decode functions, a token runs as a prefill window of one real token,
so each model keeps one function per bucket (one copy of its weights on the Neural Engine). The same
greedy tokens as an export with decode functions, on torch and mil, in every phase."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llama_ane.config import LlamaConfig
from llama_ane.contract import device_model as dm
from llama_ane.contract import resident as rs
from llama_ane.contract.manifest import ManifestError, _check_cache_shapes, check_manifest, window_cascade
from llama_ane.contract.options import ExportOptions, ExportOptionsError
from llama_ane.testing import TINY_CONFIG

CFG = LlamaConfig.from_hf_dict(dict(TINY_CONFIG, vocab_size=320, num_hidden_layers=4, head_dim=32))


def test_the_options_it_needs_and_what_auto_becomes():
    opts = ExportOptions(decode_function="prefill")
    assert opts.kv_cache == "state" and opts.context_buckets == (1024,)  # each bucket would be a copy
    opts.check()
    # auto: the prefill window on Core ML, whose functions wire a copy each; Core AI's entry points share one
    assert ExportOptions(decode_function="auto").decode_function == "prefill"
    assert ExportOptions(decode_function="auto", target="iOS17").decode_function == "prefill"
    assert ExportOptions(decode_function="auto", target="coreai").decode_function == "decode"
    with pytest.raises(ExportOptionsError, match="--target coreai.*--decode-function prefill"):
        ExportOptions(decode_function="prefill", target="coreai").check()
    with pytest.raises(ExportOptionsError, match="--decode-function must be one of auto, decode, prefill"):
        ExportOptions(decode_function="window").check()


def test_the_manifest_has_no_decode_function_and_says_so():
    m = dm.manifest_from_config(CFG, context_length=256, decode_function="prefill", context_buckets="128,256",
                                kv_cache="inputs")
    assert m["format_version"] == 4 and m["decode_function"] == "prefill" and m["cascade"] == "window"
    # the cascade steps through the prefill window: no decode_branches functions
    assert {fn for entry in m["models"].values() for fn in entry["functions"]} == {
        "prefill_128", "prefill", "prefill_128_l4", "prefill_l4"}
    emb = m["models"]["embeddings"]["functions"]["prefill"]
    assert [t["name"] for t in emb["inputs"]] == ["input_ids", "positions"]
    assert [t["name"] for t in emb["outputs"]] == ["hidden_states", "cos", "sin"]  # the host makes the masks
    # families whose states run along the rows keep the cascade function
    from transformers import AutoConfig

    lfm2 = LlamaConfig.from_hf_dict(AutoConfig.for_model(**dict(TINY_CONFIG, vocab_size=320,
                                                                **FAMILIES["lfm2"])).to_dict())
    m = dm.manifest_from_config(lfm2, context_length=256, decode_function="prefill", kv_cache="inputs")
    assert "cascade" not in m and "decode_branches" in m["models"]["chunk_0"]["functions"]
    # and so does a cascade wider than the window
    m = dm.manifest_from_config(CFG, context_length=256, prefill_length=4, decode_function="prefill", branch_width=8)
    assert "cascade" not in m and "decode_branches" in m["models"]["chunk_0"]["functions"]
    plain = dm.manifest_from_config(CFG, context_length=256, decode_function="decode")
    assert plain["format_version"] == 2 and "decode_function" not in plain and "cascade" not in plain
    with pytest.raises(ManifestError, match="format_version 4 is written only with decode_function"):
        check_manifest({**plain, "format_version": 4}, None)
    with pytest.raises(ManifestError, match=r"format_version 3 \(an export whose prefill window decoded, with masks "
                                            r"the embeddings made\) is no longer read; re-export"):
        check_manifest({**plain, "format_version": 3}, None)


def test_a_state_holds_a_window_past_the_context():
    """Where the prefill window decodes, a token at the context's last position writes the window's
    padding too: the states hold a window more (rounded to 32) and every function reads its bucket."""
    m = dm.manifest_from_config(CFG, context_length=256, prefill_length=32, decode_function="prefill",
                                kv_cache="state", context_buckets="128,256")
    for fn, io in m["models"]["chunk_0"]["functions"].items():
        assert {t["name"]: t["shape"][3] for t in io["states"]} == {"k_cache": 256 + 32, "v_cache": 256 + 32}
        assert [t["shape"][3] for t in io["inputs"] if t["name"] == "mask"] == [(128 if "128" in fn else 256) + 32]
    _check_cache_shapes(m)  # what loading checks of the shapes (a modelled manifest names no files)
    assert dm.manifest_from_config(CFG, context_length=256, kv_cache="state", decode_function="decode")["models"][
        "chunk_0"]["functions"]["decode"]["states"][0]["shape"][3] == 256


@pytest.mark.parametrize("ring", [0, 96])
def test_the_host_makes_the_masks_the_embeddings_made(ring):
    """runtime/masks.py gives the masks the in-graph embeddings give, sliding ones over positions
    and over a ring's slots, at positions before, across and past the ring's length."""
    import dataclasses

    import torch

    from llama_ane.model.embeddings import Embeddings
    from llama_ane.runtime.masks import HostMasks

    cfg = dataclasses.replace(CFG, sliding_window=40, sliding_layers=[0, 2])
    t, s = 256, 32
    made = Embeddings(cfg, t, s, windowed=True, ring=ring).eval()
    host = HostMasks(cfg, t, ring, np.float32)
    for position in (0, 5, 37, 100, 200):
        for n in (1, s):
            with torch.no_grad():
                out = made(torch.zeros(1, n, dtype=torch.int32), torch.tensor([position], dtype=torch.int32))
            got = host.window_masks(position, n, t)
            np.testing.assert_array_equal(got["mask"], out[3].numpy())
            np.testing.assert_array_equal(got["sliding_mask"], out[4].numpy())


def test_a_cascade_row_sees_the_prefix_and_its_own_branch():
    """Row b sees the prefix, its own branch's tokens (the last seen[b] steps of its slot) and itself."""
    from llama_ane.model.layers import MASK_VALUE
    from llama_ane.runtime.masks import HostMasks

    p, g, steps, s, t = 10, 3, 2, 8, 32
    masks = HostMasks(CFG, t, 0, np.float32).branch_masks(p, g, np.array([2, 2, 1]), steps, s, t)["mask"][0, 0]
    seen = masks == 0
    for b in range(g):  # branch 2 took its slot at the second step: its one token is that step's
        own = [p + i * g + b for i in (range(2) if b < 2 else [1])]
        assert np.flatnonzero(seen[b, :t]).tolist() == list(range(p)) + own
        assert np.flatnonzero(seen[b, t:]).tolist() == [b]  # itself, none of the other rows
    for r in range(g, s):  # padding sees only itself
        assert np.flatnonzero(seen[r]).tolist() == [t + r]
    assert set(np.unique(masks)) == {0.0, MASK_VALUE}


def test_one_copy_of_the_weights_and_the_time_to_first_token():
    """With the cascade in the window, every package of weights holds one function: the modelled
    resident memory is one copy; prefill is the same windows, so the time to first token of 512
    tokens stays within 1.25x of the export with decode functions on every chip (here it reads the
    whole context where that one has a 512 bucket)."""
    one = dm.manifest_from_config(CFG, context_length=1024, decode_function="prefill", kv_cache="inputs")
    assert rs.resident(dm.manifest_from_config(CFG, context_length=1024, decode_function="prefill")).copies == 1.0
    two = dm.manifest_from_config(CFG, context_length=1024, branch_width=0, kv_cache="inputs", decode_function="decode")
    wired = rs.resident(one)
    assert all(len(p["functions"]) == 1 for p in wired.packages.values() if p["weight_bytes"])
    assert wired.bytes == wired.weight_copy_bytes and wired.bytes <= 1.25 * rs.resident(one).weight_copy_bytes
    assert rs.resident(two).copies > 1.8
    for chip in dm.CHIPS.values():
        ratio = chip.seconds(dm.prefill_cost(one, 512)) / chip.seconds(dm.prefill_cost(two, 512))
        assert ratio <= 1.25, chip.name
    # a decoded token computes the whole window: its flops grow by the window, its bytes by its activations
    step, own = dm.decode_step(one, 100), dm.decode_step(two, 100)
    assert step.tokens == own.tokens == 1 and step.flops > 32 * own.flops and step.calls == own.calls


# --- exports ------------------------------------------------------------------------------------

OPTIONS = dict(context_length=256, prefill_length=32, layers_per_chunk=2, precision="fp32", branch_width=4,
               verify_window=8, context_buckets="128,256", progress=False, verify=False)
FAMILIES = {
    "llama": dict(num_hidden_layers=4, head_dim=32),
    # a ring buffer of the sliding layers, with local RoPE
    "gemma3": dict(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh", head_dim=32,
                   query_pre_attn_scalar=24, rope_local_base_freq=10_000.0, sliding_window=40, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # conv states carried after windows of one real token
    "lfm2": dict(model_type="lfm2", tie_word_embeddings=True, intermediate_size=96, block_multiple_of=16,
                 block_ffn_dim_multiplier=1.5, conv_L_cache=3, head_dim=32, layer_types=["conv", "full_attention", "conv"]),
    # recurrent states too
    "qwen35": dict(model_type="qwen3_5_text", head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=32, num_hidden_layers=4,
                   layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"]),
}
NO_TREES = ("lfm2", "qwen35")  # their states cannot go back to a tree's accepted path: no verify window


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """A tiny checkpoint of the family exported with decode functions and without (inputs caches)."""
    from llama_ane.api import export_model
    from llama_ane.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp(request.param)
    ckpt = make_tiny_checkpoint(root / "ckpt", **FAMILIES[request.param])
    options = dict(OPTIONS, verify_window=0) if request.param in NO_TREES else OPTIONS
    own = export_model(ckpt, root / "decode", kv_cache="inputs", decode_function="decode", **options)
    prefill = export_model(ckpt, root / "prefill", decode_function="prefill", **options)
    return request.param, own, prefill


@pytest.mark.export
@pytest.mark.parametrize("backend", ["torch", "mil"])
def test_the_same_greedy_tokens_in_every_phase(pair, backend):
    """Prefill, decode across the bucket boundary (128), a cascade and speculative decoding give the
    tokens of the export with decode functions (fp32)."""
    import llama_ane

    name, own, prefill = pair
    a, b = llama_ane.load(own, backend=backend), llama_ane.load(prefill, backend=backend)
    assert set(b.manifest["models"]["chunk_0"]["functions"]) <= {"prefill_128", "prefill", "decode_branches", "verify"}
    # the cascade steps through the window where every layer attends over the one cache
    assert window_cascade(b.manifest) == (name == "llama") != ("decode_branches" in b.manifest["models"]["chunk_0"]["functions"])
    prompt = [int(t) for t in np.random.default_rng(3).integers(5, 300, 100)]
    got, want = (m.generate(prompt, max_new_tokens=40).token_ids for m in (b, a))
    assert got == want
    got, want = (m.generate_branches(prompt[:50], [[7], [8, 9], [10]], max_new_tokens=6) for m in (b, a))
    assert [r.token_ids for r in got.branches] == [r.token_ids for r in want.branches]
    if name not in NO_TREES:
        spec = dict(speculative="lookup", draft_tokens=4)
        assert (b.generate(prompt[:30] * 2, max_new_tokens=20, **spec).token_ids
                == a.generate(prompt[:30] * 2, max_new_tokens=20, **spec).token_ids)
    a.close()
    b.close()


@pytest.mark.export
def test_the_torch_backend_decodes_the_real_row_only(pair):
    """The fast reference runs a decoded token unpadded (its modules take any window); the programs
    run the whole window."""
    import llama_ane

    _, _, prefill = pair
    rows = {}
    for backend in ("torch", "mil"):
        model = llama_ane.load(prefill, backend=backend)
        predict = model.backend.predict
        seen = []
        model.backend.predict = lambda m, fn, inputs: seen.append(inputs.get("input_ids")) or predict(m, fn, inputs)
        model.generate([5, 6, 7], max_new_tokens=3)
        rows[backend] = {ids.shape[1] for ids in seen if ids is not None and ids.ndim == 2}
        model.close()
    assert rows["torch"] == {32, 1} and rows["mil"] == {32}


@pytest.mark.export
def test_info_prices_one_copy(pair, tmp_path):
    from click.testing import CliRunner

    from llama_ane.commands.info import command as info

    name, own, prefill = pair
    got = {name: json.loads(CliRunner().invoke(info, [str(out), "--json"]).output) for name, out in
           (("own", own), ("prefill", prefill))}
    text = CliRunner().invoke(info, [str(prefill)]).output
    assert ("as rows of the prefill window" in text) == (name == "llama") != ("suffix tokens each" in text)
    # the cascade's and the verify window's functions remain: two or three functions a package, against five
    assert got["prefill"]["resident"]["copies"] < got["own"]["resident"]["copies"]
    assert got["prefill"]["resident_bytes"] < got["own"]["resident_bytes"]
    # priced against state caches too, which hold a window past the context
    assert got["prefill"]["decode_step_bytes_other_kv_cache"]["kv_cache"] == "state"
    assert "with --kv-cache state:" in CliRunner().invoke(info, [str(prefill)]).output


@pytest.fixture(scope="module", params=["llama", "lfm2"])
def states(request, tmp_path_factory):
    """A tiny checkpoint of the family exported in fp16 with the prefill window decoding, its caches
    as states and as inputs."""
    from llama_ane.api import export_model
    from llama_ane.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp(f"{request.param}_states")
    ckpt = make_tiny_checkpoint(root / "ckpt", **FAMILIES[request.param])
    options = dict(OPTIONS, precision="fp16", verify_window=0, decode_function="prefill")
    return (request.param, export_model(ckpt, root / "state", kv_cache="state", **options),
            export_model(ckpt, root / "inputs", kv_cache="inputs", **options))


@pytest.mark.export
def test_state_caches_decode_in_the_window_to_the_context_end(states):
    """The programs with state caches give the tokens of those with input caches (fp16, mil): a
    decode up to the context's last position, whose windows write their padding past it, and a
    cascade (through the window for Llama, LFM2's function for LFM2)."""
    import llama_ane

    name, state, inputs = states
    a, b = llama_ane.load(state, backend="mil"), llama_ane.load(inputs, backend="mil")
    assert a.manifest["cache"]["kind"] == "state" and b.manifest["cache"]["kind"] == "inputs"
    prompt = [int(t) for t in np.random.default_rng(5).integers(5, 300, 256)]

    def run(m):  # 240 prefilled, then one token a window up to the last position (255: its window runs to 287)
        m.pipeline.reset()
        return np.stack([m.pipeline.prefill(prompt[:240])] + [m.pipeline.run_window(prompt[j:j + 1])[0]
                                                             for j in range(240, 256)])
    got, want = run(a), run(b)
    assert a.pipeline.position == 256 and (got.argmax(-1) == want.argmax(-1)).all()
    np.testing.assert_allclose(got, want, atol=1e-3)
    got, want = (m.generate_branches(prompt[:40], [[7], [8, 9], [10]], max_new_tokens=6) for m in (a, b))
    assert [r.token_ids for r in got.branches] == [r.token_ids for r in want.branches]
    a.close()
    b.close()
