"""The device cost model on Gemma 4's extra tensors (contract/traffic.py, contract/device_model.py and
`llama-ane info`): KV-shared layers reading other chunks' caches, global layers wider than the
sliding ones, and the per-layer inputs' table and projection; and on the layers that do not attend
over the whole bucket: sliding layers attending over their ring, LFM2's conv layers and their state.

Every expected byte count is summed from the manifest's own tensor specs (what each function of a
step reads and writes), or from the config's published shapes, never from the code under test; the
same sums hold for the families before Gemma 4, whose numbers these changes leave as they were."""

from __future__ import annotations

import json

import pytest

from llama_ane.config import LlamaConfig
from llama_ane.contract import device_model as dm
from llama_ane.contract.specs import bucket_function
from llama_ane.contract.traffic import (decode_step_traffic, kv_read_bytes, kv_write_bytes, per_layer_table,
                                        weight_read_bytes, window_io_bytes)
from llama_ane.testing import TINY_CONFIG

from support.families import CASES, E2B
from support.traffic import (CTX, KV_SHARED_WIDE, TINY, cache_inputs, chunk_tensors, dense_params, every_tensor, nbytes,
                             run_info, tiny)

CONV = ("conv_state", "conv_branches")  # LFM2's conv states, a cascade's per branch


def e2b() -> dict:
    """Gemma-4-E2B's shape as an iOS export with decode functions plans it: 6 embeddings files, context
    buckets of 512..4096."""
    return dm.manifest_from_config(LlamaConfig.from_hf_dict(E2B), context_length=4096, kv_cache="inputs",
                                   layers_per_chunk=7, decode_function="decode")


SHAPES = {"tiny": tiny, "e2b": e2b}


# ---- the K/V a step reads ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
def test_a_decode_step_reads_every_cache_its_chunks_take(shape):
    """KV-shared chunks' inputs of their producers' caches count as reads, each tensor at its own
    width; writing is the producers' cache update, counted once."""
    m = SHAPES[shape]()
    caches = cache_inputs(m, "decode")
    shared = cache_inputs(m, "decode", shared=True)
    assert {t["name"] for t in shared} == {"shared_k_cache", "shared_v_cache", "shared_k_ring", "shared_v_ring"}
    assert len({t["shape"][1] for t in caches}) == 2  # the global layers' channels and the sliding layers'
    t = decode_step_traffic(m)  # the context's last step: the whole context's caches
    assert t.cache_read == sum(nbytes(s) for s in caches) > sum(nbytes(s) for s in caches if s not in shared)
    assert t.cache_update == 2 * sum(nbytes(s) for s in cache_inputs(m, "decode", shared=False))


def test_a_smaller_bucket_reads_what_its_functions_take():
    """E2B at 100 positions runs the 512-position bucket: the caches of decode_512's inputs, rings whole."""
    m = e2b()
    assert m["context_buckets"][0] == 512
    fn = bucket_function("decode", 512, m["context_length"])
    t = decode_step_traffic(m, filled=100)
    assert t.cache_read == sum(nbytes(s) for s in cache_inputs(m, fn))
    assert t.cache_update == 2 * sum(nbytes(s) for s in cache_inputs(m, fn, shared=False))
    assert t.cache_read < decode_step_traffic(m).cache_read


def test_a_cascade_step_reads_the_producers_suffix_caches():
    m = tiny()
    caches = cache_inputs(m, "decode_branches")
    assert {"shared_k_suffix", "shared_v_ring_suffix"} <= {s["name"] for s in caches}
    assert kv_read_bytes(m, CTX, "decode_branches") == sum(nbytes(s) for s in caches)
    own_suffix = [s for s in cache_inputs(m, "decode_branches", shared=False) if s["name"].endswith("_suffix")]
    assert kv_write_bytes(m, CTX, "decode_branches") == 2 * sum(nbytes(s) for s in own_suffix)


# ---- every tensor of a step: Gemma 4 and the families before it ---------------------------------------------------

FAMILIES = {"llama": TINY.to_hf_dict(), "gemma3": dict(TINY_CONFIG, vocab_size=320, **CASES["gemma3_tied_gqa"]),
            "mistral_window": dict(TINY_CONFIG, vocab_size=320, **CASES["mistral_window"]),
            "lfm2": dict(TINY_CONFIG, vocab_size=320, **CASES["lfm2_tied_gqa"]),
            "gemma4_wide_global": dict(TINY_CONFIG, vocab_size=320, **CASES["gemma4_wide_global"]),
            "gemma4_kv_shared": KV_SHARED_WIDE}


@pytest.mark.parametrize("family, fn", [(family, fn) for family in FAMILIES for fn in ("decode", "verify", "decode_branches")
                                        if (family, fn) != ("lfm2", "verify")])  # LFM2's conv state cannot go back
def test_a_step_moves_every_tensor_its_functions_pass(family, fn):
    """With input caches a step reads the weights and every input and output of its functions once
    (caches among them, the per-layer inputs, a consumer's copies of its producers' caches, LFM2's
    conv states and their new values), and the cache update reads and rewrites the caches the chunks
    own: nothing counted twice or missed. The tensors passed between the models are the rest."""
    m = tiny(FAMILIES[family], **({"verify_window": 0} if family == "lfm2" else {}))
    ctx = m["context_length"]
    step = dm.step_cost(m, fn, ctx - dm.window_tokens(m, fn) if fn != "decode_branches" else ctx)
    own = [s for s in cache_inputs(m, fn, shared=False) if fn != "decode_branches" or s["name"].endswith("_suffix")]
    assert step.bytes == weight_read_bytes(m) + every_tensor(m, fn) + 2 * sum(nbytes(s) for s in own)
    conv = chunk_tensors(m, fn, "inputs", CONV) + chunk_tensors(m, fn, "outputs", ("conv_new",))
    assert bool(conv) == (family == "lfm2")
    assert window_io_bytes(m, fn) == every_tensor(m, fn) - sum(nbytes(s) for s in cache_inputs(m, fn) + conv)
    if family.startswith("gemma4"):
        assert all("per_layer_input" in {t["name"] for t in m["models"][c["model"]]["functions"][fn]["inputs"]}
                   for c in m["chunks"])


# ---- the per-layer inputs' weights ----------------------------------------------------------------------------------

def test_a_token_reads_a_per_layer_row_per_file_and_the_projection():
    """E2B: 6 embeddings files each look up a row of their part of the 262144 x (35 x 256) table, and
    the last projects the 1536-channel embedding onto it (its norm of 256 beside): 27.6 MB a token."""
    m = e2b()
    files = m["embeddings"]["models"]
    assert len(files) == 6
    channels = 35 * 256
    stepped = [c["model"] for c in m["chunks"]] + m["lm_head"]["models"]
    per_layer = 6 * channels * 2 + (1536 * channels + 256) * 2
    assert weight_read_bytes(m) == sum(m["weights"][x]["bytes"] for x in stepped) + 1536 * 2 + per_layer
    table = per_layer_table(m)
    assert (table.vocab, table.channels, table.projection_model) == (262_144, channels, "embeddings_5")
    assert table.table_bytes == 262_144 * channels * 2 and list(table.rows) == files
    assert per_layer_table(tiny(FAMILIES["llama"])) is None and per_layer_table(tiny(FAMILIES["gemma3"])) is None


def test_files_past_the_per_layer_tables_rows_read_none_of_it(monkeypatch):
    """A per-layer table of fewer rows than the vocabulary: a file past its rows looks nothing up."""
    import llama_ane.contract.plan as plan_module

    monkeypatch.setattr(plan_module, "weight_budget", lambda target: 115_000)  # three embeddings files
    m = tiny(dict(KV_SHARED_WIDE, vocab_size_per_layer_input=150))
    files, ranges = m["embeddings"]["models"], m["embeddings"]["vocab_ranges"]
    assert len(files) == 3 and ranges[0][1] < 150 < ranges[1][1]
    table = per_layer_table(m)
    assert table.rows == {files[0]: tuple(ranges[0]), files[1]: (ranges[1][0], 150)}
    assert table.table_bytes == 150 * 32 * 2 and table.projection_model == files[2]
    assert table.step_bytes == 2 * 32 * 2 + (64 * 32 + 8) * 2


def test_attention_flops_take_each_layers_heads():
    """A prefill window of E2B: 2 flops per weight (the per-layer projection among them) and 4 per
    query channel per key, the global layers' 8 heads of 512 channels, the sliding layers' of 256;
    the global layers' keys those of the 512 bucket and the window (the width of its mask), the
    sliding layers' those of their ring of 576 slots and the window, more than the bucket's."""
    m = e2b()
    window = 64
    masks = {t["name"]: t["shape"][-1] for t in m["models"]["embeddings"]["functions"]["prefill_512"]["outputs"]}
    assert masks["mask"] == 512 + window and masks["sliding_mask"] == m["cache"]["sliding"]["length"] + window == 640
    attention = sum(8 * (256 * masks["sliding_mask"] if kind == "sliding_attention" else 512 * masks["mask"])
                    for kind in E2B["layer_types"])
    stepped = [c["model"] for c in m["chunks"]] + m["lm_head"]["models"]
    params = (sum(m["weights"][x]["dense_bytes"] for x in stepped) + 1536 * 2 + 6 * 8960 * 2
              + (1536 * 8960 + 256) * 2) / 2
    assert dm.step_cost(m, "prefill", 0).flops == pytest.approx(window * (2 * params + 4 * attention))


@pytest.mark.parametrize("family, fn", [(family, fn) for family in ("gemma3", "mistral_window", "gemma4_kv_shared", "lfm2")
                                        for fn in ("prefill", "decode", "verify", "decode_branches")
                                        if (family, fn) != ("lfm2", "verify")])
def test_attention_flops_take_each_layers_keys(family, fn):
    """Each layer attends over what its mask covers: a global layer the bucket and the window
    (`mask`), a sliding layer its ring and the window (`sliding_mask`, narrower than the bucket's
    here), KV-shared sliding layers their producer's ring; a cascade step the prefix (or the ring)
    and the suffix cache. LFM2's conv layers attend to nothing: their short convolution, C x kernel
    multiply-adds per token, is the 2 flops per weight of its (C, kernel) taps."""
    m = tiny(FAMILIES[family], **({"verify_window": 0} if family == "lfm2" else {}))
    c, ctx = m["config"], m["context_length"]
    masks = {t["name"]: t["shape"][-1] for t in m["models"]["embeddings"]["functions"][fn]["outputs"]}
    if fn == "decode_branches":  # a branch's keys: the prefix's (or the ring's) and its suffix cache's
        full = masks["prefix_mask"] + m["suffix_length"]
        ring = masks["sliding_prefix_mask"] + m["suffix_length"] if "sliding_prefix_mask" in masks else None
    else:
        full, ring = masks["mask"], masks.get("sliding_mask")
    assert (ring is not None and ring < full) == (family != "lfm2")

    def query_channels(n: int) -> int:
        wide = c.get("global_head_dim") if n not in c["sliding_layers"] else None
        return c["num_attention_heads"] * (wide or c["head_dim"])

    layers = range(c["num_hidden_layers"])
    keys = [0 if n in c["conv_layers"] else ring if n in c["sliding_layers"] else full for n in layers]
    assert (0 in keys) == (family == "lfm2")
    tokens = dm.window_tokens(m, fn)
    attention = 4 * sum(query_channels(n) * keys[n] for n in layers)
    step = dm.step_cost(m, fn, ctx - tokens if fn != "decode_branches" else ctx)
    assert step.flops == pytest.approx(tokens * (2 * dense_params(m) + attention))
    if family == "lfm2":  # the conv layers' taps are among the weights
        taps = len(c["conv_layers"]) * c["hidden_size"] * c["conv_kernel"]
        assert taps * 2 <= sum(m["weights"][x["model"]]["dense_bytes"] for x in m["chunks"])


# ---- LFM2's conv state ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["prefill", "decode", "decode_branches"])
def test_a_step_reads_the_conv_state_and_writes_it(fn):
    """The chunks read their conv states whole (conv_state, an input or a state, or a cascade's
    conv_branches), and write them: with input caches (and in a cascade step) their conv_new
    output, from which the host keeps the next state; with states the one-hot write of the state,
    which reads and rewrites it. The K/V is counted as before."""
    kv = ("k_cache", "v_cache")
    for kind in ("inputs", "state"):
        m = tiny(FAMILIES["lfm2"], verify_window=0, kv_cache=kind)
        tokens = dm.window_tokens(m, fn)
        conv_in = chunk_tensors(m, fn, "inputs", CONV)
        conv_states = chunk_tensors(m, fn, "states", CONV)
        conv_new = chunk_tensors(m, fn, "outputs", ("conv_new",))
        assert len(conv_in + conv_states) == 2 and all(t["shape"][-1] == 32 for t in conv_in + conv_states)
        assert all(t["shape"][-1] == tokens for t in conv_new)
        kv_specs = chunk_tensors(m, fn, "inputs" if kind == "inputs" else "states", kv)  # the prefix, in a cascade
        read = sum(nbytes(t) for t in kv_specs + conv_in + conv_states)
        if fn == "decode_branches":
            read += sum(nbytes(t) for t in chunk_tensors(m, fn, "inputs", ("k_suffix", "v_suffix")))
        assert kv_read_bytes(m, CTX, fn) == read
        if fn == "decode_branches":  # the suffix caches' update, the branches' conv values
            kv_write = 2 * sum(nbytes(t) for t in chunk_tensors(m, fn, "inputs", ("k_suffix", "v_suffix")))
            conv_write = sum(nbytes(t) for t in conv_new)
        elif kind == "inputs":  # the cache-update model reads and rewrites the caches; conv_new out
            kv_write = 2 * sum(nbytes(t) for t in kv_specs)
            conv_write = sum(nbytes(t) for t in conv_new)
        else:  # the window's columns of each K/V state; the conv state read and rewritten, no conv_new out
            assert not conv_new
            kv_write = sum(nbytes(t) // CTX * tokens for t in kv_specs)
            conv_write = 2 * sum(nbytes(t) for t in conv_states)
        assert conv_write > 0 and kv_write_bytes(m, CTX, fn) == kv_write + conv_write


def test_the_conv_states_other_kind_is_the_other_exports():
    """`info`'s alternative: an export's step priced with the other --kv-cache is what the export
    with that kind moves, conv state included."""
    inputs, state = (tiny(FAMILIES["lfm2"], verify_window=0, kv_cache=kind) for kind in ("inputs", "state"))
    for filled in (0, 100, CTX - 1):
        assert decode_step_traffic(inputs, "state", filled=filled) == decode_step_traffic(state, filled=filled)
        assert decode_step_traffic(state, "inputs", filled=filled) == decode_step_traffic(inputs, filled=filled)


# ---- llama-ane info --------------------------------------------------------------------------------------------------

def test_info_shows_the_per_layer_table(tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps(KV_SHARED_WIDE))
    out = run_info("--config", tmp_path / "tiny.json", "--context-length", CTX, "--kv-cache", "inputs", "--chip", "M4")
    assert "  embeddings   token rows 0..319, per-layer rows 0..319, " in out
    assert (f"  per-layer table 320 x 32 (4 layers x 8) in embeddings, {320 * 32 * 2 / 1e6:.1f} MB; projection "
            f"64 -> 32 in embeddings, {(64 * 32 + 8) * 2 / 1e6:.1f} MB") in out
    assert "heads 4/1 x 32 (global layers 4/1 x 64), the last 2 KV-shared" in out
    assert "no --kv-cache state" in out
    (tmp_path / "e2b.json").write_text(json.dumps(E2B))
    out = run_info("--config", tmp_path / "e2b.json", "--context-length", 4096, "--kv-cache", "inputs", "--chip", "M4")
    assert (f"per-layer table 262144 x 8960 (35 layers x 256) in embeddings..embeddings_5 (6 files), "
            f"{262_144 * 8960 * 2 / 1e6:.1f} MB") in out
    assert "  embeddings_5 token rows 218496..262143, per-layer rows 218496..262143, " in out
    (tmp_path / "llama.json").write_text(json.dumps(FAMILIES["llama"]))
    out = run_info("--config", tmp_path / "llama.json", "--context-length", CTX, "--chip", "M4")
    assert "per-layer" not in out and "KV-shared" not in out and "with --kv-cache inputs" in out


def test_info_json_offers_no_state_alternative_for_kv_shared_layers(tmp_path):
    """KV-shared layers cannot keep states (a chunk's state cannot feed another chunk): `--json`
    prices no --kv-cache state alternative for them, as the text does not; other models keep it."""
    (tmp_path / "shared.json").write_text(json.dumps(KV_SHARED_WIDE))
    got = json.loads(run_info("--config", tmp_path / "shared.json", "--context-length", CTX, "--kv-cache", "inputs",
                              "--chip", "M4", "--json"))
    assert "decode_step_bytes" in got and "decode_step_bytes_other_kv_cache" not in got
    (tmp_path / "lfm2.json").write_text(json.dumps(FAMILIES["lfm2"]))
    got = json.loads(run_info("--config", tmp_path / "lfm2.json", "--context-length", CTX, "--kv-cache", "inputs",
                              "--chip", "M4", "--json", "--decode-function", "decode"))
    other = got["decode_step_bytes_other_kv_cache"]
    assert other["kv_cache"] == "state"
    m = tiny(FAMILIES["lfm2"], verify_window=0, kv_cache="state", prefill_length=got["prefill_length"],
             layers_per_chunk=len(got["chunks"][0]["layers"]), branch_width=got["branch_width"],
             suffix_length=got["suffix_length"], fold_lm_head="auto" if got["lm_head"].get("folded_into") else "no")
    assert {k: other[k] for k in ("cache_read", "cache_update")} == {
        k: decode_step_traffic(m, filled=CTX - 1).to_dict()[k] for k in ("cache_read", "cache_update")}


@pytest.mark.export
def test_an_exports_traffic_and_info(tmp_path):
    """A real export's manifest: the same specs and bytes as planned, and `info` on it."""
    from llama_ane.api import export_model
    from llama_ane.contract.manifest import read_manifest

    from support.families import make_family_checkpoint

    folder = make_family_checkpoint(tmp_path / "ckpt", **KV_SHARED_WIDE)
    out = export_model(folder, tmp_path / "out", context_length=CTX, prefill_length=64, layers_per_chunk=2,
                       kv_cache="inputs", verify_window=8, branch_width=2, suffix_length=32, fold_lm_head="no",
                       decode_function="decode", progress=False, verify=False)
    m = read_manifest(out)
    def specs(manifest: dict) -> dict:
        return {(model, fn): (spec["inputs"], spec["outputs"]) for model, entry in manifest["models"].items()
                for fn, spec in entry["functions"].items()}
    assert specs(m) == specs(tiny())
    t = decode_step_traffic(m)
    assert t.cache_read == sum(nbytes(s) for s in cache_inputs(m, "decode"))
    assert t.weights == sum(m["weights"][x]["bytes"] for x in ("chunk_0", "chunk_1", "lm_head")) + 64 * 2 + (
        32 * 2 + (64 * 32 + 8) * 2)
    assert dm.decode_step(m, 100) == dm.decode_step(tiny(), 100)
    text = run_info(out, "--chip", "M4")
    assert "per-layer table 320 x 32 (4 layers x 8) in embeddings" in text and "sha256 verified" in text
    assert f"KV cache read {t.cache_read / 1e6:.1f} MB" in text
