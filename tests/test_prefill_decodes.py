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
from llama_ane.contract.manifest import ManifestError, check_manifest
from llama_ane.contract.options import ExportOptions, ExportOptionsError
from llama_ane.testing import TINY_CONFIG

CFG = LlamaConfig.from_hf_dict(dict(TINY_CONFIG, vocab_size=320, num_hidden_layers=4, head_dim=32))


def test_the_options_it_needs_and_what_auto_becomes():
    opts = ExportOptions(decode_function="prefill")
    assert opts.kv_cache == "inputs" and opts.context_buckets == (1024,)  # each bucket would be a copy
    with pytest.raises(ExportOptionsError, match="--decode-function prefill.*--kv-cache inputs"):
        ExportOptions(decode_function="prefill", kv_cache="state").check()
    with pytest.raises(ExportOptionsError, match="--target coreai.*--decode-function prefill"):
        ExportOptions(decode_function="prefill", target="coreai").check()
    with pytest.raises(ExportOptionsError, match="--decode-function must be one of decode, prefill"):
        ExportOptions(decode_function="window").check()


def test_the_manifest_has_no_decode_function_and_says_so():
    m = dm.manifest_from_config(CFG, context_length=256, decode_function="prefill", context_buckets="128,256")
    assert m["format_version"] == 3 and m["decode_function"] == "prefill"
    assert {fn for entry in m["models"].values() for fn in entry["functions"]} == {
        "prefill_128", "prefill", "decode_branches", "prefill_128_l4", "prefill_l4", "decode_branches_l4"}
    plain = dm.manifest_from_config(CFG, context_length=256)
    assert plain["format_version"] == 2 and "decode_function" not in plain
    with pytest.raises(ManifestError, match="format_version 3 is written only with decode_function"):
        check_manifest({**plain, "format_version": 3}, None)


def test_one_copy_of_the_weights_and_the_time_to_first_token():
    """With no cascade function, every package of weights holds one function: the modelled resident
    memory is one copy; prefill is the same windows, so the time to first token of 512 tokens stays
    within 1.25x of the export with decode functions on every chip (here it reads the whole context
    where that one has a 512 bucket)."""
    one = dm.manifest_from_config(CFG, context_length=1024, decode_function="prefill", branch_width=0)
    two = dm.manifest_from_config(CFG, context_length=1024, branch_width=0, kv_cache="inputs")
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
    own = export_model(ckpt, root / "decode", kv_cache="inputs", **options)
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

    _, own, prefill = pair
    got = {name: json.loads(CliRunner().invoke(info, [str(out), "--json"]).output) for name, out in
           (("own", own), ("prefill", prefill))}
    # the cascade's and the verify window's functions remain: two or three functions a package, against five
    assert got["prefill"]["resident"]["copies"] < got["own"]["resident"]["copies"]
    assert got["prefill"]["resident_bytes"] < got["own"]["resident_bytes"]
    # no state caches to price it against: a state cannot take a whole window in the last positions
    assert "decode_step_bytes_other_kv_cache" not in got["prefill"] and "decode_step_bytes_other_kv_cache" in got["own"]
    assert "(the prefill window decodes: no --kv-cache state)" in CliRunner().invoke(info, [str(prefill)]).output
