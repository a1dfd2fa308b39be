"""Gemma 4 (text): the config as transformers reads it, what is refused by name, the checkpoint's
tensors, the global layers' proportional RoPE, the per-layer inputs and the fp16 stream scale. The
end-to-end checks (torch fp32 against Gemma4ForCausalLM, mil fp16, inspect, cascade, chat template)
run on the Gemma 4 cases of tests/test_families.py.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from llama_ane.config import ConfigError, LlamaConfig
from llama_ane.testing import TINY_CONFIG

from support.families import CASES, E2B, E4B

BASE = dict(TINY_CONFIG, vocab_size=320)
K_EQ_V = dict(BASE, **CASES["gemma4_untied_mha"], attention_k_eq_v=True)


def test_gemma4_config_as_transformers_reads_it():
    """Layer types, both RoPE bases, the proportion and factor of the global RoPE, the per-layer
    inputs, V from K and the softcap read as Gemma4TextConfig reads them, from the checkpoint's
    fields and from transformers' own dictionary alike; the manifest's copy and the config given back
    to transformers read the same."""
    import transformers

    cfg = LlamaConfig.from_hf_dict(K_EQ_V)
    hf = transformers.AutoConfig.for_model(**K_EQ_V)
    assert [cfg.slides(n) for n in range(4)] == [t == "sliding_attention" for t in hf.layer_types]
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (cfg.rope_theta, cfg.rope_local_theta) == (full["rope_theta"], local["rope_theta"])
    assert (cfg.rope_proportion, cfg.rope_scaling) == (0.5, {"rope_type": "linear", "factor": 4.0})
    assert (cfg.per_layer_input_size, cfg.per_layer_vocab_size) == (8, 320)
    assert (cfg.k_eq_v, cfg.final_logit_softcapping, cfg.query_scale, cfg.embedding_multiplier) == (
        True, 30.0, 1.0, 64 ** 0.5)
    assert [cfg.value_from_key(n) for n in range(4)] == [False, True, False, True]
    filled = {"bos_token_id": hf.bos_token_id, "eos_token_id": [hf.eos_token_id],  # Gemma4TextConfig's defaults
              "max_position_embeddings": hf.max_position_embeddings}
    assert LlamaConfig.from_hf_dict(hf.to_dict()) == dataclasses.replace(cfg, **filled)
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    back = cfg.transformers_config()
    assert (type(back).__name__, back.layer_types, back.rope_parameters) == (
        "Gemma4TextConfig", hf.layer_types, hf.rope_parameters)
    assert LlamaConfig.from_hf_dict(back.to_dict()) == dataclasses.replace(cfg, **filled)
    plain = LlamaConfig.from_hf_dict(dict(BASE, model_type="gemma4_text", num_hidden_layers=7, global_head_dim=16))
    assert plain.sliding_layers == [0, 1, 2, 3, 4]  # every sixth global and the last (Gemma4TextConfig's)


@pytest.mark.parametrize("change, words", [
    ({"enable_moe_block": True}, ["enable_moe_block", "mixture-of-experts"]),
    ({"use_bidirectional_attention": "all"}, ["use_bidirectional_attention"]),
    ({"num_kv_shared_layers": 4}, ["kv_shared_layers 4", "lower num_kv_shared_layers"]),
    ({"per_layer_config": {"1": {"num_key_value_heads": 1}, "3": {"num_key_value_heads": 1}},
      "attention_k_eq_v": False}, ["1 kv heads", "without attention_k_eq_v"]),
    ({"per_layer_config": {"1": {"head_dim": 64}, "3": {"head_dim": 128}}}, ["different head sizes"]),
    ({"per_layer_config": {"0": {"head_dim": 64}}}, ["per_layer_config", "sliding layer 0"]),
    ({"per_layer_config": {"1": {"sliding_window": 4}}}, ["per_layer_config", "layer 1"]),
    ({"attention_bias": True}, ["attention_bias"]),
    ({"hidden_activation": "silu"}, ["hidden_activation", "'silu'"]),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, ["yarn", "proportional"]),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, ["sliding_attention"]),
    ({"rope_parameters": {"rope_theta": 1e6}}, ["rope_parameters", "per layer type"]),
])
def test_what_gemma4_export_does_not_do_is_named(change, words):
    with pytest.raises(ConfigError) as e:
        LlamaConfig.from_hf_dict(dict(K_EQ_V, **change))
    for w in words:
        assert w in str(e.value)


def test_gemma4_tensors_are_transformers_parameters():
    """The tensors an export reads and their shapes are Gemma4ForCausalLM's (no v_proj on the global
    layers that take V from K; the per-layer inputs' table, projection and norm; each layer's scalar)."""
    import transformers

    from llama_ane.checkpoint.mapping import expected_tensors

    cfg = LlamaConfig.from_hf_dict(K_EQ_V)
    model = transformers.AutoModelForCausalLM.from_config(cfg.transformers_config())
    theirs = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    ours = {name: tuple(d if isinstance(d, int) else getattr(cfg, d) for d in dims)
            for name, dims in expected_tensors(cfg).items()}
    assert ours == theirs


@pytest.mark.parametrize("wide", [{"global_head_dim": 64, "num_global_key_value_heads": 1},
                                  {"global_head_dim": 64, "attention_k_eq_v": False},
                                  {"per_layer_config": {"1": {"head_dim": 16, "num_key_value_heads": 2},
                                                        "3": {"head_dim": 16, "num_key_value_heads": 2}}}])
def test_wider_global_layers_as_transformers_builds_them(wide):
    """Global layers whose heads differ from the sliding ones' (global_head_dim, with V from K
    num_global_key_value_heads, or per_layer_config): each layer's config (LlamaConfig.at) has
    Gemma4TextAttention's sizes, the tensors an export reads have Gemma4ForCausalLM's shapes, the
    manifest's copy reads back the same, and the config given back to transformers builds the same."""
    import transformers

    from llama_ane.checkpoint.mapping import expected_shape, expected_tensors
    from llama_ane.contract.sizing import layer_shapes

    d = dict(K_EQ_V, **wide)
    cfg = LlamaConfig.from_hf_dict(d)
    assert cfg.wide_global
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**d))
    for n, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        heads = attention.q_proj.out_features // attention.head_dim
        kv = attention.k_proj.out_features // attention.head_dim
        assert (cfg.at(n).head_dim, cfg.at(n).num_key_value_heads, heads) == (attention.head_dim, kv, 4)
        theirs = {name.removeprefix(f"model.layers.{n}."): tuple(t.shape)
                  for name, t in model.state_dict().items() if name.startswith(f"model.layers.{n}.")}
        ours = layer_shapes(cfg, n)
        assert ours["q_proj.weight"] == theirs["self_attn.q_proj.weight"]
        assert ours["k_norm.weight"] == theirs["self_attn.k_norm.weight"]
    theirs = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert {name: expected_shape(cfg, name, dims) for name, dims in expected_tensors(cfg).items()} == theirs
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    back = transformers.AutoModelForCausalLM.from_config(cfg.transformers_config())
    assert {name: tuple(t.shape) for name, t in back.state_dict().items()} == theirs


def test_wider_global_layers_need_the_ring():
    """The sliding layers' narrower K/V live in the ring apart from the global layers' cache: an
    export whose ring would not be shorter than the context is refused naming --context-length;
    the manifest gives the ring's channels beside the cache's, and each function's caches, RoPE
    tables and cascade suffix caches have their kind's sizes."""
    from llama_ane.contract.options import ExportOptionsError
    from llama_ane.contract.plan import ExportOptions, plan_export
    from llama_ane.contract.manifest import ring_channels

    cfg = LlamaConfig.from_hf_dict(dict(K_EQ_V, global_head_dim=64, num_global_key_value_heads=1, sliding_window=24))
    with pytest.raises(ExportOptionsError, match="--context-length 64: .* wider K/V"):
        plan_export(cfg, ExportOptions(context_length=64, prefill_length=32, layers_per_chunk=2))
    plan = plan_export(cfg, ExportOptions(context_length=256, prefill_length=32, layers_per_chunk=2,
                                          branch_width=2, suffix_length=32, decode_function="decode"))
    manifest = plan.manifest("m", {}, {})
    assert (manifest["cache"]["channels"], ring_channels(manifest)) == (1 * 64, 4 * 32)  # kv heads x head_dim
    decode = plan.specs["chunk_0"]["decode"]
    shapes = {t["name"]: t["shape"] for t in decode["inputs"] + decode.get("states", [])}
    assert (shapes["k_cache"][1], shapes["k_ring"][1], shapes["cos"][1], shapes["cos_local"][1]) == (64, 128, 64, 32)
    branches = {t["name"]: t["shape"] for t in plan.specs["chunk_0"]["decode_branches"]["inputs"]}
    updates = plan.specs["cache_update"]
    assert {t["name"]: t["shape"] for t in updates["decode_branches_l1_r1"]["outputs"]} == {
        "k_suffix_out": [1, 2, 64, 32], "v_suffix_out": [1, 2, 64, 32],
        "k_ring_suffix_out": [4, 2, 32, 32], "v_ring_suffix_out": [4, 2, 32, 32]}
    assert (branches["k_suffix"], branches["k_ring_suffix"]) == ([1, 2, 64, 32], [4, 2, 32, 32])


@pytest.mark.parametrize("case", ["gemma4_tied_gqa_k_eq_v", "gemma4_untied_mha"])
def test_rope_tables_are_transformers_rotary_embedding(case):
    """The global tables are Gemma4TextRotaryEmbedding's proportional ones (frequency 0, so cos 1 and
    sin 0, past the rotated pairs), the local tables its default ones."""
    import transformers

    from llama_ane.model.embeddings import stored_rope_tables

    cfg = LlamaConfig.from_hf_dict(dict(BASE, **CASES[case]))
    rope = transformers.models.gemma4.modeling_gemma4.Gemma4TextRotaryEmbedding(cfg.transformers_config())
    cos, sin = stored_rope_tables(cfg, 300)
    d = cfg.head_dim
    for kind, columns in (("full_attention", slice(0, d)), ("sliding_attention", slice(d, 2 * d))):
        want_cos, want_sin = (t[0] for t in rope(torch.zeros(1), torch.arange(300)[None], kind))
        torch.testing.assert_close(cos[:, columns], want_cos, rtol=0, atol=1e-5)  # float32 angles of positions up to 300
        torch.testing.assert_close(sin[:, columns], want_sin, rtol=0, atol=1e-5)  # float32 angles of positions up to 300
    angles = int(cfg.rope_proportion * d // 2)  # the pairs that rotate (0.25 or 0.5 of them)
    assert (cos[:, angles:d // 2] == 1).all() and not (cos[:, :angles] == 1).all()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from llama_ane.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("gemma4"), **dict(CASES["gemma4_untied_mha"], attention_k_eq_v=True))


def check_per_layer_inputs(model, folder, ids: np.ndarray) -> None:
    """The per_layer_inputs `model`'s embeddings give for `ids` (one prefill window, every file of the
    embeddings) are Gemma4TextModel's per-layer inputs, each layer's P (8) channels in its rows."""
    import transformers

    ref = transformers.Gemma4ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        t = torch.from_numpy(ids[None])
        e = ref.model.embed_tokens(t)
        want = ref.model.project_per_layer_inputs(e, ref.model.get_per_layer_inputs(t, e))[0].numpy()  # (S, L, P)
    window = np.zeros((1, model.manifest["prefill_length"]), np.int32)
    window[0, :len(ids)] = ids
    got = model.pipeline.embed("prefill", model.pipeline.window_inputs(window, 0))
    got = got["per_layer_inputs"][0, :, 0, :len(ids)].T.reshape(len(ids), -1, 8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_per_layer_inputs_are_transformers(folder):
    """The embeddings' per_layer_inputs (torch, and the MIL builder run by the MIL executor) are
    Gemma4TextModel's per-layer inputs, each layer's P channels in its rows."""
    import llama_ane

    model = llama_ane.load(folder, backend="torch", precision="fp32", context_length=64, prefill_length=16)
    check_per_layer_inputs(model, folder, np.random.default_rng(0).integers(0, 300, 12))
    chunks = model.manifest["chunks"]
    assert [c["layers"] for c in chunks] and all(
        t["shape"][1] == 8 * len(c["layers"]) for c in chunks
        for t in model.manifest["models"][c["model"]]["functions"]["prefill"]["inputs"] if t["name"] == "per_layer_input")
    model.close()


def test_the_reference_reads_only_the_tokens_rows_of_the_tables(folder):
    """The parity reference (run_layers) reads the embedding and per-layer tables' rows of its tokens
    only, never a table whole (Gemma 4 E2B's per-layer table is 4.7 GB)."""
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.reference import run_layers, token_rows

    ckpt = load_checkpoint(folder)
    assert ckpt.get_rows is not None
    ids = [5, 17, 300, 5, 42]
    want = run_layers(ckpt, ids, logits=False)  # the final norm's output: no LM head
    get = ckpt.get

    def no_tables(name):
        if name in ("model.embed_tokens_per_layer.weight", "model.embed_tokens.weight"):
            raise AssertionError(f"{name} read whole")
        return get(name)

    ckpt.get = no_tables
    assert torch.equal(torch.as_tensor(run_layers(ckpt, ids, logits=False)), torch.as_tensor(want))
    for name in ("model.embed_tokens_per_layer.weight", "model.embed_tokens.weight"):
        assert torch.equal(token_rows(ckpt, name, torch.tensor(ids)), get(name)[ids])


def test_fp16_stream_scale_keeps_the_per_layer_input_finite():
    """A Gemma 4 layer whose stream is past fp16's range unscaled stays finite in fp16 with the stream
    scale, per-layer input included (its gate reads the stream with the scale undone in its weights),
    and equals fp32."""
    from llama_ane.model.chunk import DecoderLayer

    cfg = LlamaConfig.from_hf_dict(dict(K_EQ_V, num_hidden_layers=1, layer_types=["full_attention"]))
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 16, 0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0, 0.5)
        layer.mlp.up_proj.weight.mul_(cfg.stream_scale)  # as the mapping stores them
        layer.o_proj.weight.mul_(cfg.stream_scale)
        layer.per_layer_input_gate.weight.div_(cfg.stream_scale * 1e5)  # gate inputs of order 1 unscaled
        for name in ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm"):
            getattr(layer, name).weight.mul_(cfg.stream_scale * 200)
        layer.layer_scalar.fill_(0.7)
    x = torch.randn(1, 64, 1, 4) * 1e5 * cfg.stream_scale  # a stream near 1e5 unscaled
    ple = torch.randn(1, 8, 1, 4)
    d = cfg.head_dim
    cos, sin = torch.ones(1, d, 1, 4), torch.zeros(1, d, 1, 4)
    mask = torch.zeros(1, 1, 4, 4).triu(1) * -1e4
    empty = torch.zeros(1, cfg.kv_channels, 1, 0)
    want = layer(x, cos, sin, mask, empty, empty, ple)[0] / cfg.stream_scale
    assert want.abs().max() > 65504
    got = layer.half()(x.half(), cos.half(), sin.half(), mask.half(), empty.half(), empty.half(), ple.half())[0]
    assert torch.isfinite(got).all()
    assert torch.allclose(got.float() / cfg.stream_scale, want, rtol=2e-2, atol=want.abs().max().item() * 2e-3)


def test_gemma4_io_names_what_the_embeddings_give():
    """Every chunk function reads its layers' per-layer inputs, which the embeddings output whole;
    the other inputs the chunk reads are the embeddings' outputs too."""
    from llama_ane.model import chunk, embeddings
    from llama_ane.model.functions import Layout

    cfg = LlamaConfig.from_hf_dict(K_EQ_V)
    layout = Layout(256, 16, "float16", branch_width=2, suffix_length=8, verify_window=4, ring=64)
    emb = embeddings.functions(cfg, layout)
    for fn, io in chunk.functions(cfg, layout, [2, 3]).items():
        inputs = {t["name"]: t["shape"] for t in io["inputs"]}
        s = inputs["hidden_states"][3]
        assert inputs["per_layer_input"] == [1, 16, 1, s]
        produced = {t["name"]: t["shape"] for t in emb[fn]["outputs"]}
        assert produced["per_layer_inputs"] == [1, 32, 1, s]
        assert set(inputs) - {"hidden_states", "k_cache", "v_cache", "k_ring", "v_ring", "k_suffix", "v_suffix",
                              "per_layer_input"} <= set(produced)


def test_a_gemma4_manifest_config_names_its_own_fields():
    """The manifest's config of a Gemma 4 export holds its own fields, which the Swift host knows (a
    host that does not know them refuses the export by their names); another family's holds none of
    them and reads back the same."""
    import re
    from pathlib import Path

    from llama_ane.config import GEMMA4_FIELDS

    gemma4 = LlamaConfig.from_hf_dict(K_EQ_V).to_dict()
    assert {"value_norm", "k_eq_v", "per_layer_input_size", "layer_scalar", "rope_proportion",
            "final_logit_softcapping"} <= set(gemma4)
    source = (Path(__file__).resolve().parent.parent / "swift_host" / "Sources" / "LlamaANE" / "Manifest"
              / "ModelConfigFields.swift").read_text("utf-8")
    assert set(GEMMA4_FIELDS) <= set(re.findall(r'^\s+"([a-z_0-9]+)",$', source, re.M))
    llama = LlamaConfig.from_hf_dict(BASE)
    assert not set(GEMMA4_FIELDS) & set(llama.to_dict()) and LlamaConfig.from_dict(llama.to_dict()) == llama


def test_the_per_layer_table_shares_the_embedding_files_rows():
    """The per-layer table is cut by the embedding table's vocabulary rows: each embeddings file holds
    the same rows of both, the last one the projection of the (then whole) embedding, the first the
    RoPE tables, each file within the target's budget (E2B: 262k x 35 x 256, 4.7 GB in fp16; E4B:
    262k x 42 x 256). A small model keeps everything in one file."""
    from llama_ane.contract.plan import ExportOptions, plan_export
    from llama_ane.limits import weight_budget

    cfg = LlamaConfig.from_hf_dict(K_EQ_V)
    plan = plan_export(cfg, ExportOptions(context_length=256, prefill_length=64, layers_per_chunk=2))
    assert plan.embedding_rows == [(0, cfg.vocab_size)]
    embeddings = next(p for p in plan.packages if p.model == "embeddings")
    assert embeddings.weight_bytes >= 2 * (cfg.per_layer_channels * (320 + 64) + cfg.vocab_size * 64)
    for shape, counts in ((E2B, (6, 3)), (E4B, (8, 4))):  # embeddings files for iOS, macOS (docs/export.md)
        big = LlamaConfig.from_hf_dict(shape)
        table = big.vocab_size * (big.hidden_size + big.per_layer_channels) * 2
        projection = (big.per_layer_channels * big.hidden_size + big.per_layer_input_size) * 2
        for target, count in zip(("iOS18", "macOS15"), counts):
            plan = plan_export(big, ExportOptions(context_length=4096, prefill_length=64, target=target,
                                                  layers_per_chunk=4, kv_cache="inputs", decode_function="decode"))
            files = [p for p in plan.packages if p.model.startswith("embeddings")]
            assert len(files) == len(plan.embedding_rows) == count
            assert all(p.weight_bytes <= weight_budget(target) for p in files)
            assert plan.embedding_rows[-1][1] == big.vocab_size
            rope = files[0].weight_bytes - plan.embedding_rows[0][1] * (big.hidden_size + big.per_layer_channels) * 2
            assert sum(p.weight_bytes for p in files) == table + projection + rope
            assert files[-1].weight_bytes - projection == (
                (files[-1].rows[1] - files[-1].rows[0]) * (big.hidden_size + big.per_layer_channels) * 2)
            spec = plan.specs[files[1].model]["decode"]
            assert [t["name"] for t in spec["inputs"]] == ["input_ids", "hidden_states", "per_layer_inputs"]
            assert [t["name"] for t in spec["outputs"]] == ["hidden_states_out", "per_layer_inputs_out"]


def test_per_layer_config_as_transformers_writes_it():
    """Gemma4TextConfig writes per_layer_config with zero-padded layer indices ("04"): E2B's config
    reads with its global layers' 512-channel heads."""
    import transformers

    written = transformers.Gemma4TextConfig(**{k: v for k, v in E2B.items() if k != "model_type"}).to_diff_dict()
    assert "04" in written.get("per_layer_config", {})
    cfg = LlamaConfig.from_hf_dict(dict(written, model_type="gemma4_text"))
    assert cfg.global_layers.head_dim == 512 and cfg.head_dim == 256 and cfg.kv_shared_layers == 20


def test_an_embeddings_file_too_small_for_its_rows_is_refused_by_name(monkeypatch):
    from llama_ane.contract.options import ExportOptionsError
    import llama_ane.contract.plan as plan_module

    monkeypatch.setattr(plan_module, "weight_budget", lambda target: 40_000)  # the RoPE tables alone take 33 kB
    with pytest.raises(ExportOptionsError, match="embeddings file cannot hold 64 vocabulary rows.*per-layer"):
        plan_module.plan_export(LlamaConfig.from_hf_dict(K_EQ_V),
                                plan_module.ExportOptions(context_length=256, prefill_length=64, branch_width=0))


def test_the_per_layer_table_is_read_a_block_of_rows_at_a_time(monkeypatch):
    """Packaging a file's rows of the per-layer table never reads more than a block of rows at once."""
    from llama_ane.export import package_weights

    table = torch.randn(1000, 48, dtype=torch.bfloat16)
    reads = []

    class Rows:
        get_rows = True

        def rows(self, name, start, end):
            reads.append(end - start)
            return table[start:end]

    monkeypatch.setattr(package_weights, "ROW_BLOCK", 48 * 100)
    got = package_weights.rows_array(Rows(), "model.embed_tokens_per_layer.weight", (130, 870), np.float16)
    np.testing.assert_array_equal(got, table[130:870].float().numpy().astype(np.float16))
    assert max(reads) == 100 and sum(reads) == 740 + 1  # and the first row, for the row's size


# --- the per-layer table cut with the embedding table: a budget small enough for three files ---

SPLIT = dict(CASES["gemma4_kv_shared"])


@pytest.fixture(scope="module")
def split_folder(tmp_path_factory):
    from support.families import make_family_checkpoint

    return make_family_checkpoint(tmp_path_factory.mktemp("gemma4_split"), **SPLIT)


def _small_budget(budget: int):
    import llama_ane.contract.plan as plan_module

    mp = pytest.MonkeyPatch()
    mp.setattr(plan_module, "weight_budget", lambda target: budget)
    return mp


@pytest.mark.export
def test_a_split_per_layer_table_computes_what_transformers_does(split_folder):
    """torch fp32 with the embedding and per-layer tables in three files: logits within 1e-3 of
    Gemma4ForCausalLM, its 32 greedy tokens, and the per-layer inputs as its own."""
    from support.checks import check_greedy, check_logits, load_fp32, reference

    mp = _small_budget(215_000)  # fp32: 384 bytes a row of both tables, 155 kB of RoPE tables and projection
    try:
        model = load_fp32(split_folder, branch_width=0)
    finally:
        mp.undo()
    assert model.manifest["embeddings"]["models"] == ["embeddings", "embeddings_1", "embeddings_2"]
    ref = reference(split_folder, "gemma4_text")
    check_logits("gemma4_split", model, ref, "gemma4_text", 320)
    check_greedy(model, ref, 320, 20)
    check_per_layer_inputs(model, split_folder, np.arange(0, 320, 13))  # ids from every file's rows
    model.close()


def test_a_per_layer_table_shorter_than_the_vocabulary_splits_too(tmp_path):
    """A per-layer table of fewer rows than the vocabulary (100 of 320): the files past its rows hold
    none of it and hand the lookup on; five files give the logits of one, bit for bit."""
    from support.checks import load_fp32
    from support.families import make_family_checkpoint
    from support.parity import random_ids

    folder = make_family_checkpoint(tmp_path / "short", **dict(SPLIT, vocab_size_per_layer_input=100))
    whole = load_fp32(folder, branch_width=0)
    mp = _small_budget(190_000)  # 64 rows a file beside 156 kB of RoPE tables and projection
    try:
        split = load_fp32(folder, branch_width=0)
    finally:
        mp.undo()
    assert len(split.manifest["embeddings"]["models"]) == 5 and len(whole.manifest["embeddings"]["models"]) == 1
    ids = random_ids(320, 40, seed=4)
    np.testing.assert_array_equal(split.score(ids), whole.score(ids))
    whole.close()
    split.close()


@pytest.mark.export
def test_a_split_per_layer_table_exports(split_folder, tmp_path):
    """The fp16 export with three embeddings files: inspect --strict is clean, the mil programs agree
    with torch fp16 (top-1 >= 0.98), and the files hold the per-layer rows of their vocabulary rows."""
    from llama_ane.mil.weights import read_weights

    import llama_ane
    from llama_ane.api import export_model

    from support.checks import check_inspect_strict, check_mil_fp16
    from support.parity import random_ids

    mp = _small_budget(115_000)  # fp16: 192 bytes a row of both tables, 86 kB of RoPE tables and projection
    try:
        out = export_model(split_folder, tmp_path / "split", context_length=256, prefill_length=64,
                           layers_per_chunk=2, kv_cache="inputs", branch_width=2, suffix_length=32, verify_window=8,
                           progress=False, verify=False)
    finally:
        mp.undo()
    manifest = json.loads((out / "manifest.json").read_text())
    files = manifest["embeddings"]["models"]
    assert files == ["embeddings", "embeddings_1", "embeddings_2"]
    for model, (a, b) in zip(files, manifest["embeddings"]["vocab_ranges"]):
        entry = manifest["models"][model]["functions"]["prefill"]
        names = ["embed_tokens_per_layer_weight", "per_layer_model_projection_weight"]
        found = read_weights(out / entry["file"], entry["function_name"], names[:1])
        assert found[names[0]].shape == (b - a, 32)
        if model == files[-1]:  # only the last file projects
            read_weights(out / entry["file"], entry["function_name"], names[1:])
        else:
            with pytest.raises(Exception):
                read_weights(out / entry["file"], entry["function_name"], names[1:])
    check_inspect_strict(out)
    check_mil_fp16("gemma4_split", out, top1=0.98)
    mil = llama_ane.load(out, backend="mil")  # the verify window's embeddings through every file
    prompt = random_ids(300, 20, seed=12) * 4  # repeats, for prompt lookup to draft from
    assert mil.generate(prompt, max_new_tokens=12, speculative="lookup").token_ids == \
        mil.generate(prompt, max_new_tokens=12).token_ids
    mil.close()


# --- wider global layers: an export with its caches as inputs (the family exports keep states) ---

@pytest.fixture(scope="module", params=["gemma4_wide_global", "gemma4_kv_shared"])
def inputs_export(request, tmp_path_factory):
    from llama_ane.api import export_model

    from support.families import make_family_checkpoint

    folder = make_family_checkpoint(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    # KV-shared layers 2 and 3 in chunks [0, 1, 2] and [3]: one producer in the layer's chunk, one in another
    out = export_model(folder, tmp_path_factory.mktemp("export") / request.param, context_length=256,
                       prefill_length=64, layers_per_chunk=3 if "kv_shared" in request.param else 2, kv_cache="inputs", verify_window=8, branch_width=2,
                       suffix_length=32, progress=False, verify=False)
    return request.param, folder, out


@pytest.mark.export
def test_wider_and_kv_shared_layers_with_input_caches(inputs_export):
    """Global layers wider than the sliding ones (and KV-shared layers reading their producers'
    caches and window K/V from other chunks), the caches as inputs: each kind's cache and cascade
    suffix caches are written by the cache-update programs; inspect --strict is clean, the mil
    programs (fp16) agree with torch fp16, their cascade with decoding alone, torch fp32's cascade
    (the cache-update modules writing the suffixes) decodes each branch's tokens alone, and
    speculative decoding (the verify programs) gives plain decoding's tokens."""
    import llama_ane

    from support.checks import check_inspect_strict, check_mil_branches, check_mil_fp16, load_fp32
    from support.parity import branch_inputs, random_ids

    name, folder, out = inputs_export
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cache"]["sliding"]["channels"] == 2 * 32 and manifest["cache"]["channels"] == 64
    assert manifest["chunks"][0]["cache_update"]["decode_branches"] == "decode_branches_l1_r1"
    check_inspect_strict(out)
    check_mil_fp16(name, out, top1=0.98)
    check_mil_branches(name, out)
    model = load_fp32(folder, branch_width=2, suffix_length=32, direct_cache=False)
    prefix, conts = branch_inputs(seed=3)
    for r, cont in zip(model.generate_branches(prefix, conts[:4], max_new_tokens=10).branches, conts):  # two groups
        assert r.token_ids == model.generate(prefix + cont, max_new_tokens=10).token_ids
    model.close()
    mil = llama_ane.load(out, backend="mil")
    prompt = random_ids(300, 20, seed=12) * 4  # repeats, for prompt lookup to draft from
    assert mil.generate(prompt, max_new_tokens=12, speculative="lookup").token_ids == \
        mil.generate(prompt, max_new_tokens=12).token_ids
    mil.close()



@pytest.mark.export
@pytest.mark.parametrize("backend, precision", [("torch", "fp32"), ("mil", "fp16")])
def test_streamed_scoring_with_kv_shared_layers_holds_one_model(inputs_export, backend, precision):
    """The parity gate's chunk-major scoring of KV-shared layers (a consumer chunk reads an earlier
    chunk's caches and window K/V, kept from when that chunk ran): the token-major logits exactly,
    in every bucket's functions too, and never two models with weights loaded at once."""
    import llama_ane

    from support.parity import random_ids

    name, _, out = inputs_export
    model = llama_ane.load(out, backend=backend, precision=precision)
    pipe, loaded, most = model.pipeline, set(), [0]
    predict, release = model.backend.predict, model.backend.release

    def counted_predict(m, fn, inputs):
        loaded.add(m)
        most[0] = max(most[0], len(loaded - {"cache_update"}))
        return predict(m, fn, inputs)

    def counted_release(m):
        loaded.discard(m)
        release(m)
    try:
        ids = random_ids(model.manifest["config"]["vocab_size"], 2 * 64 + 9, seed=5)
        pipe.reset()
        want = pipe.prefill(ids, all_logits=True)
        pipe.wait()
        model.backend.predict, model.backend.release = counted_predict, counted_release
        np.testing.assert_array_equal(pipe.score_streamed(ids), want)
        assert most[0] == 1, most
        got = pipe.score_streamed(ids, every_bucket=True)
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.99 and np.abs(got - want).max() < 0.05
    finally:
        model.close()


def test_kv_shared_layers_as_transformers_builds_them():
    """KV-shared layers: their producers as Gemma4TextConfig.kv_sharing_modes has them, no K/V
    tensors and double-wide MLPs as Gemma4ForCausalLM's; what has no producer of its type is refused
    by name, and so are state caches (a chunk's states cannot reach another chunk)."""
    import transformers

    from llama_ane.checkpoint.mapping import expected_shape, expected_tensors
    from llama_ane.contract.options import ExportOptionsError
    from llama_ane.contract.plan import ExportOptions, plan_export

    d = dict(BASE, **CASES["gemma4_kv_shared"])
    cfg = LlamaConfig.from_hf_dict(d)
    hf = transformers.AutoConfig.for_model(**d)
    modes = hf.kv_sharing_modes
    assert [cfg.shares_kv(n) for n in range(4)] == [m == "reuse" for m in modes] == [False, False, True, True]
    assert [cfg.kv_producer(n) for n in range(2, 4)] == [0, 1] and modes[:2] == ["store", "store"]
    assert [cfg.at(n).intermediate_size for n in range(4)] == [128] * 2 + [256] * 2
    model = transformers.AutoModelForCausalLM.from_config(hf)
    theirs = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert {name: expected_shape(cfg, name, dims) for name, dims in expected_tensors(cfg).items()} == theirs
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="kv_shared_layers 4: .* lower num_kv_shared_layers"):
        LlamaConfig.from_dict(dict(cfg.to_dict(), kv_shared_layers=4))
    with pytest.raises(ConfigError, match="kv_shared_layers 3: .* earlier layer of each of their types"):
        LlamaConfig.from_dict(dict(cfg.to_dict(), kv_shared_layers=3))
    with pytest.raises(ExportOptionsError, match="--kv-cache state: .* --kv-cache inputs"):
        plan_export(cfg, ExportOptions(context_length=256, prefill_length=32, kv_cache="state"))
    plan = plan_export(cfg, ExportOptions(context_length=256, prefill_length=32, layers_per_chunk=2,
                                          kv_cache="inputs", branch_width=2, suffix_length=32))
    assert plan.manifest("m", {}, {})["cache"]["sliding"]["layers"] == [0]  # layer 2 keeps no ring
    inputs = {t["name"]: t["shape"] for t in plan.specs["chunk_1"]["decode_branches"]["inputs"]}
    assert "k_cache" not in inputs and (inputs["shared_k_cache"], inputs["shared_k_ring"]) == (
        [1, 64, 1, 256], [1, 64, 1, 64])  # the global producer's 1 x 64 channels, the sliding one's 2 x 32 in the ring
    assert (inputs["shared_k_suffix"], inputs["shared_k_ring_suffix"]) == ([1, 2, 64, 32], [2, 2, 32, 32])


def test_the_parity_gate_of_kv_shared_layers_is_budgeted_one_package_at_a_time():
    """KV-shared layers are scored chunk-major like any other (the producers' caches kept, see
    test_streamed_scoring_with_kv_shared_layers_holds_one_model), so E2B's gate is budgeted at its
    largest package, as the same shape without sharing is, and it fits where its build fits."""
    from llama_ane.contract.plan import ExportOptions, plan_export
    from llama_ane.export.budget import PARENT_BYTES, VERIFY_FACTOR, build_peak, plan_memory, verify_peak

    options = ExportOptions(context_length=1024, prefill_length=64, target="iOS18", kv_cache="inputs")
    e2b = plan_export(LlamaConfig.from_hf_dict(E2B), options)
    largest = max(p.dense_bytes for p in e2b.packages)
    assert verify_peak(e2b, True) == PARENT_BYTES + int(VERIFY_FACTOR * largest)
    assert largest < sum(p.dense_bytes for p in e2b.packages) / 8  # 13 packages, the per-layer table cut in 6
    budget = 5 << 30
    assert build_peak(e2b, 1, "spawn") <= budget
    assert plan_memory(e2b, available=None, max_memory=budget, workers=1, method="spawn").peak <= budget
