"""LFM2's conv layer (llama_ane.model.layers.short_conv) held to transformers' Lfm2DecoderLayer: a whole
sequence, padded prefill windows and token-by-token decoding carrying the conv state, and the MIL
builder run by the MIL executor on a padded window."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from llama_ane.model.layers import Graph
from llama_ane.model.layers.short_conv import ConvLayer, conv_layer_mil, conv_state_after, conv_state_after_mil

transformers = pytest.importorskip("transformers")
from transformers import Lfm2Config  # noqa: E402
from transformers.models.lfm2.modeling_lfm2 import Lfm2DecoderLayer  # noqa: E402
from conftest import convert_to  # noqa: E402
from support.conv import channels_first, conv_pair, random_layer, with_weights_of  # noqa: E402
from support.families import LFM2_CHECKPOINT  # noqa: E402

C, K, EPS, TOKENS = 16, 3, 1e-5, 11
RENAMED = {"operator_norm.": "input_layernorm.", "ffn_norm.": "post_attention_layernorm.",
           "feed_forward.w1.": "mlp.gate_proj.", "feed_forward.w3.": "mlp.up_proj.", "feed_forward.w2.": "mlp.down_proj."}


def reference(bias: bool) -> tuple[Lfm2Config, Lfm2DecoderLayer]:
    cfg = Lfm2Config(hidden_size=C, num_hidden_layers=2, layer_types=["conv", "full_attention"], num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=32, intermediate_size=48, conv_L_cache=K, conv_bias=bias,
                     norm_eps=EPS, block_multiple_of=8)
    return cfg, random_layer(Lfm2DecoderLayer, cfg)


def ours(hf: Lfm2DecoderLayer, bias: bool) -> ConvLayer:
    """ConvLayer with hf's weights, renamed and reshaped."""
    return with_weights_of(ConvLayer(C, hf.feed_forward.w1.out_features, K, EPS, bias).eval(), hf, RENAMED)


@pytest.fixture(scope="module", params=[False, True], ids=["no_bias", "bias"])
def pair(request):
    cfg, hf = reference(request.param)
    return conv_pair(cfg, hf, ours(hf, request.param), TOKENS)


def test_whole_sequence_and_state_match_transformers(pair):
    hf, module, x, y_ref, hf_state = pair
    with torch.no_grad():
        y, gated = module(channels_first(x), torch.zeros(1, C, 1, K - 1))
        state = conv_state_after(torch.zeros(1, C, 1, K - 1), gated, TOKENS)
    torch.testing.assert_close(y, channels_first(y_ref), rtol=1e-5, atol=1e-5)
    # transformers keeps the last K inputs; the convolution needs only the last K-1 of them
    torch.testing.assert_close(state.reshape(C, K - 1), hf_state[0, :, 1:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [1, 4, 8])
def test_padded_windows_then_decode_carry_the_state(pair, window):
    """Prefill windows of `window` columns, the last one padded with garbage, then decode one token at
    a time: the real columns equal the whole sequence's, and the state ends at the last real token."""
    hf, module, x, y_ref, hf_state = pair
    xs, prefill = channels_first(x), 7
    state, outputs = torch.zeros(1, C, 1, K - 1), []
    with torch.no_grad():
        for start in range(0, prefill, window):
            n = min(window, prefill - start)
            part = torch.cat([xs[..., start:start + n], torch.full((1, C, 1, window - n), 5.0)], dim=3)
            y, gated = module(part, state)
            outputs.append(y[..., :n])
            state = conv_state_after(state, gated, n)
        for t in range(prefill, TOKENS):
            y, gated = module(xs[..., t:t + 1], state)
            outputs.append(y)
            state = conv_state_after(state, gated, 1)
    torch.testing.assert_close(torch.cat(outputs, dim=3), channels_first(y_ref), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.reshape(C, K - 1), hf_state[0, :, 1:], rtol=1e-5, atol=1e-6)


@pytest.mark.export
def test_mil_builder_matches_torch_on_a_padded_window(pair, tmp_path):
    ct = pytest.importorskip("coremltools")
    from coremltools.converters.mil import Builder as mb
    from llama_ane.mil import PackageExecutor

    hf, module, x, _, _ = pair
    bias = module.conv.conv.bias is not None
    params = {name: t.numpy() for name, t in module.state_dict().items()}
    g = Graph(np.float32, lambda name: params[name])
    s, n = 4, 3
    int32 = ct.converters.mil.mil.types.int32

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, C, 1, s)), mb.TensorSpec(shape=(1, C, 1, K - 1)),
                             mb.TensorSpec(shape=(1,), dtype=int32)],
                opset_version=ct.target.iOS18)
    def prog(x, conv_state, n):
        y, gated = conv_layer_mil(g, x, conv_state, "", C, K, EPS, s, bias)
        return y, conv_state_after_mil(g, conv_state, gated, n, K, s)

    convert_to(prog, tmp_path / "conv_layer.mlpackage", compute_precision=ct.precision.FLOAT32)
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((1, C, 1, s)).astype(np.float32),
             "conv_state": rng.standard_normal((1, C, 1, K - 1)).astype(np.float32), "n": np.array([n], np.int32)}
    got = list(PackageExecutor(tmp_path / "conv_layer.mlpackage", precision="fp32").run("main", feeds).values())
    with torch.no_grad():
        y, gated = module(torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["conv_state"]))
        state = conv_state_after(torch.from_numpy(feeds["conv_state"]), gated, n)
    np.testing.assert_allclose(got[0], y.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], state.numpy(), rtol=1e-5, atol=1e-6)


# The config and the checkpoint's tensors (LFM2_CHECKPOINT: its kernel is K), the chunks and the pipeline

@pytest.fixture(scope="module")
def lfm2_folder(tmp_path_factory):
    from llama_ane.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("lfm2"), **LFM2_CHECKPOINT)


def test_lfm2_config_and_tensors_match_transformers(lfm2_folder):
    """The config read as transformers' Lfm2Config reads it (conv layers, kernel, the MLP's adjusted
    width, norm_eps, tied embeddings by default), and every tensor of the checkpoint renamed into
    ConvLayer's and DecoderLayer's parameters."""
    from transformers import AutoModelForCausalLM

    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.checkpoint.mapping import expected_tensors, final_norm, layer_state_dict
    from llama_ane.model.chunk import DecoderLayer

    hf = AutoModelForCausalLM.from_pretrained(str(lfm2_folder)).eval()
    ckpt = load_checkpoint(lfm2_folder)
    cfg = ckpt.config
    assert cfg.conv_layers == [0, 2] and cfg.conv_kernel == K and not cfg.conv_bias
    assert cfg.tie_word_embeddings and cfg.qk_norm and not cfg.qk_norm_across_heads
    assert cfg.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features == 96  # 64 * 1.5, to 16
    assert cfg.rms_norm_eps == hf.config.norm_eps and cfg.rope_theta == hf.config.rope_parameters["rope_theta"]
    hf_state = hf.state_dict()
    assert set(expected_tensors(cfg)) == set(hf_state) - {"lm_head.weight"}
    rebuilt = AutoModelForCausalLM.from_config(cfg.transformers_config())
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in hf_state.items()}
    for n in range(cfg.num_hidden_layers):
        state = layer_state_dict(ckpt, n)
        if cfg.convolves(n):
            module = ConvLayer(cfg.hidden_size, cfg.intermediate_size, K, cfg.rms_norm_eps)
        else:
            module = DecoderLayer(cfg, 64, n)
            torch.testing.assert_close(state["o_proj.weight"][..., 0, 0], hf_state[f"model.layers.{n}.self_attn.out_proj.weight"])
        module.load_state_dict(state)  # strict: every parameter, no other
    torch.testing.assert_close(state["mlp.up_proj.weight"][..., 0, 0], hf_state["model.layers.2.feed_forward.w3.weight"])
    torch.testing.assert_close(final_norm(ckpt), hf_state["model.embedding_norm.weight"])


def test_lfm2_layers_from_full_attn_idxs():
    from llama_ane.config import LlamaConfig

    base = dict(vocab_size=32, hidden_size=C, num_hidden_layers=4, num_attention_heads=2, model_type="lfm2",
                norm_eps=1e-6, block_auto_adjust_ff_dim=False, intermediate_size=40, tie_embedding=False)
    cfg = LlamaConfig.from_hf_dict(dict(base, full_attn_idxs=[1, 3]))
    assert cfg.conv_layers == [0, 2] and cfg.intermediate_size == 40 and cfg.rms_norm_eps == 1e-6
    assert not cfg.tie_word_embeddings and cfg.rope_theta == 1_000_000.0
    assert LlamaConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("fields, words", [
    ({"layer_types": ["conv", "sliding_attention", "conv", "conv"]}, "layer_types"),
    ({"layer_types": ["conv"]}, "layer_types"),
    ({}, "full_attn_idxs"),
    ({"layer_types": ["conv"] * 4, "conv_L_cache": 1}, "conv_L_cache"),
])
def test_lfm2_bad_layer_fields_refused_by_name(fields, words):
    from llama_ane.config import ConfigError, LlamaConfig

    base = dict(vocab_size=32, hidden_size=C, num_hidden_layers=4, num_attention_heads=2, model_type="lfm2",
                intermediate_size=48)
    with pytest.raises(ConfigError, match=words):
        LlamaConfig.from_hf_dict(dict(base, **fields))


def test_chunk_windows_and_decode_match_transformers(lfm2_folder):
    """A BlockChunk of every layer (conv and attention) between the embeddings and the LM head, run
    as the runtime runs it: a full prefill window, a padded one, then decode, the K/V written at
    each window's position and the conv state taken from conv_new at the window's real tokens. Its
    logits are transformers' Lfm2ForCausalLM's."""
    from transformers import AutoModelForCausalLM

    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.checkpoint.mapping import chunk_state_dict, embeddings_state_dict, lm_head_state_dict
    from llama_ane.model.chunk import BlockChunk, functions
    from llama_ane.model.embeddings import Embeddings
    from llama_ane.model.functions import Layout
    from llama_ane.model.lm_head import LMHead, vocab_splits

    ckpt = load_checkpoint(lfm2_folder)
    cfg, t, s = ckpt.config, 32, 8
    layers = list(range(cfg.num_hidden_layers))
    io = functions(cfg, Layout(t, s, "float32"), layers)["prefill"]
    assert [(x["name"], x["shape"][3]) for x in io["inputs"]][-3:] == [("k_cache", t), ("v_cache", t),
                                                                          ("conv_state", 32)]  # K-1 kept in 32
    assert [x["shape"] for x in io["outputs"]] == [[1, 64, 1, s], [1, cfg.kv_channels, 1, s],
                                                   [1, cfg.kv_channels, 1, s], [2, 64, 1, s]]
    chunk = BlockChunk(cfg, layers, t).eval()
    chunk.load_state_dict(chunk_state_dict(ckpt, layers))
    head = LMHead(cfg).eval()
    head.load_state_dict(lm_head_state_dict(ckpt, vocab_splits(cfg.vocab_size)))
    embed = {w: Embeddings(cfg, t, w).eval() for w in (1, s)}
    for module in embed.values():
        module.load_state_dict(embeddings_state_dict(ckpt), strict=False)
    tokens = torch.randint(3, cfg.vocab_size, (1, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(lfm2_folder)).eval()(tokens).logits[0]
        k = torch.zeros(1, cfg.kv_channels, 1, t)
        v = torch.zeros_like(k)
        state = torch.zeros(2, 64, 1, 32)
        position, got = 0, []
        for n in (8, 5, 1):  # a full window, a padded one, decode
            w = 1 if n == 1 else s
            ids = torch.zeros(1, w, dtype=torch.int32)
            ids[0, :n] = tokens[0, position:position + n]
            hidden, cos, sin, mask = embed[w](ids, torch.tensor([position], dtype=torch.int32))
            hidden, k_new, v_new, conv_new = chunk(hidden, cos, sin, mask, k, v, conv_state=state)
            k[..., position:position + n], v[..., position:position + n] = k_new[..., :n], v_new[..., :n]
            state = conv_state_after(state, conv_new, n)
            got.append(torch.cat(head(hidden), dim=1)[0, :, 0, :n].T)
            position += n
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.export
def test_chunk_mil_matches_torch(lfm2_folder, tmp_path):
    """The chunk's prefill function built in MIL (conv layers reading their rows of conv_state,
    attention layers their K/V) and run by the MIL executor gives the torch chunk's outputs."""
    ct = pytest.importorskip("coremltools")
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.checkpoint.mapping import chunk_state_dict
    from llama_ane.export.programs import build_program, save_program
    from llama_ane.mil import PackageExecutor
    from llama_ane.model.chunk import BlockChunk, functions
    from llama_ane.model.functions import Layout

    ckpt = load_checkpoint(lfm2_folder)
    cfg, t, s = ckpt.config, 32, 8
    layers = list(range(cfg.num_hidden_layers))
    io = functions(cfg, Layout(t, s, "float32"), layers)["prefill"]
    state = chunk_state_dict(ckpt, layers)
    chunk = BlockChunk(cfg, layers, t).eval()
    chunk.load_state_dict(state)
    params = {name: w.numpy() for name, w in state.items()}
    prog = build_program("chunk_0", {"prefill": io}, cfg, lambda name: params[name], dtype=np.float32,
                         opset=ct.target.iOS18, layers=layers, context_length=t, suffix_length=0)
    save_program(prog, tmp_path / "chunk.mlpackage", ct.target.iOS18, multifunction=True)
    rng = np.random.default_rng(3)
    feeds = {x["name"]: rng.standard_normal(x["shape"]).astype(np.float32) for x in io["inputs"]}
    feeds["mask"] = np.where(rng.random(feeds["mask"].shape) < 0.3, -1e4, 0.0).astype(np.float32)
    got = PackageExecutor(tmp_path / "chunk.mlpackage", precision="fp32").run("prefill", feeds)
    with torch.no_grad():
        want = chunk(**{name: torch.from_numpy(a) for name, a in feeds.items()})
    assert list(got) == [x["name"] for x in io["outputs"]]
    for name, w in zip(got, want):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.export
def test_pipeline_carries_the_conv_state(lfm2_folder):
    """The torch backend through the pipeline (a chunk of a conv and an attention layer, then a
    chunk of a conv layer only, which keeps no K/V): transformers' logits over padded prefill
    windows, token by token decoding after them, and a rewind, which the conv state cannot go back
    in, prefilling again from the start."""
    import llama_ane
    from transformers import AutoModelForCausalLM

    model = llama_ane.load(lfm2_folder, backend="torch", precision="fp32", context_length=64, prefill_length=8,
                           layers_per_chunk=2)
    assert [c["layers"] for c in model.manifest["chunks"]] == [[0, 1], [2]]
    ids = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(lfm2_folder)).eval()(ids).logits[0].numpy()
    ids = ids[0].tolist()
    np.testing.assert_allclose(model.score(ids), want, atol=1e-4)
    pipeline = model.pipeline
    pipeline.reset()
    got = [pipeline.run_window(ids[:5])]  # a padded window, then decoding
    got += [pipeline.run_window(ids[n:n + 1]) for n in range(5, 12)]
    np.testing.assert_allclose(np.concatenate(got), want[:12], atol=1e-4)
    assert pipeline.rewind(10) == 0 and pipeline.position == 0
    np.testing.assert_allclose(pipeline.run_window(ids[:8]), want[:8], atol=1e-4)
    assert pipeline.rewind(8) == 8  # nothing forgotten: the state stands


def test_a_verify_window_is_refused_by_name(lfm2_folder):
    """A conv state cannot be rewound to the path a speculative tree accepts: no verify function."""
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.contract.options import ExportOptions
    from llama_ane.contract.plan import plan_export
    from llama_ane.errors import LlamaANEError

    cfg = load_checkpoint(lfm2_folder).config
    with pytest.raises(LlamaANEError, match="--verify-window 16.*conv layers.*--verify-window 0"):
        plan_export(cfg, ExportOptions(context_length=256, prefill_length=64, verify_window=16, kv_cache="inputs"))
    assert plan_export(cfg, ExportOptions(context_length=256, prefill_length=64)).chunks


def test_sizing_counts_each_kind_of_layer(lfm2_folder):
    """The bytes the plan gives a conv layer and an attention layer are their parameters' (a conv
    layer is the larger here), so chunks and the weight budget hold what the packages will."""
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.checkpoint.mapping import layer_state_dict
    from llama_ane.contract.sizing import layer_shapes, layer_weight_bytes

    ckpt = load_checkpoint(lfm2_folder)
    cfg = ckpt.config
    counts = {n: sum(t.numel() for t in layer_state_dict(ckpt, n).values()) for n in (0, 1)}
    assert {n: layer_weight_bytes(cfg, 2, layer=n) for n in (0, 1)} == {n: 2 * counts[n] for n in (0, 1)}
    assert layer_weight_bytes(cfg, 2) == 2 * max(counts.values()) == 2 * counts[0]
    assert set(layer_shapes(cfg, 0)) == set(layer_state_dict(ckpt, 0))


def test_cascade_counts_the_prefix_bytes_of_attention_layers_only(lfm2_folder):
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.runtime.cascade import prefix_bytes_per_step

    cfg = load_checkpoint(lfm2_folder).config
    manifest = {"config": cfg.to_dict(), "cache": {"channels": cfg.kv_channels}}
    assert prefix_bytes_per_step(manifest, 10, 2) == 2 * 1 * cfg.kv_channels * 10 * 2  # one attention layer of 3


@pytest.mark.export
def test_a_prompt_cache_file_holds_the_conv_state(lfm2_folder, tmp_path):
    """A prompt-cache file saves each chunk's conv state whole: decoding on from the loaded file
    gives the logits of decoding on from the cache it was saved from."""
    import llama_ane
    from llama_ane.runtime.kv_cache import load_cache, save_cache

    model = llama_ane.load(lfm2_folder, backend="torch", precision="fp32", context_length=64, prefill_length=8,
                           layers_per_chunk=2)
    pipeline, ids = model.pipeline, list(range(5, 19))
    pipeline.reset()
    pipeline.run_window(ids[:8])
    pipeline.run_window(ids[8:13])
    assert pipeline.cache.caches[1]["conv"].any()
    save_cache(pipeline.cache, model.manifest, tmp_path / "prompt.npz")
    want = pipeline.run_window(ids[13:14])
    pipeline.use(load_cache(tmp_path / "prompt.npz", model.manifest, pipeline.new_cache()))
    np.testing.assert_array_equal(pipeline.run_window(ids[13:14]), want)


@pytest.mark.export
def test_an_export_with_input_caches_runs_in_mil(lfm2_folder, tmp_path):
    """--kv-cache inputs: the programs return conv_new, the host takes the state at each window's
    real tokens, and a chunk of conv layers only has no cache update; the mil backend's padded
    window and decoding give the torch backend's logits. Its parity gate compares with transformers'
    Lfm2 layers, and passes."""
    import llama_ane
    from llama_ane.api import export_model

    log: list[str] = []
    out = export_model(lfm2_folder, tmp_path / "export", context_length=64, prefill_length=32, layers_per_chunk=2,
                       kv_cache="inputs", branch_width=0, progress=False, log=log.append)
    (report,) = [line for line in log if line.startswith("verify ")]
    print(report)
    assert re.search(r"\n  transformers +[0-9.]+ +[0-9.]+ +[0-9.]+  ok\n", report), report
    assert report.endswith("\n  passed") and "skipped" not in report
    manifest = llama_ane.load(out, backend="mil").manifest
    # the prefill window decodes (the default): one cache update a chunk size, none for the conv-only chunk
    assert [c["cache_update"] for c in manifest["chunks"]] == [{"prefill": "prefill_l1"}, {}]
    ids = list(range(7, 47))
    got = {}
    for backend, options in (("mil", {}), ("torch", {"precision": "fp16"})):
        pipeline = llama_ane.load(out, backend=backend, **options).pipeline
        pipeline.reset()
        logits = [pipeline.run_window(ids[:20])] + [pipeline.run_window(ids[n:n + 1]) for n in range(20, 40)]
        got[backend] = np.concatenate(logits)
    # within fp16 noise (~0.03 here, logits up to ~5); test_pipeline_carries_the_conv_state holds the
    # host's state to transformers
    np.testing.assert_allclose(got["mil"], got["torch"], atol=0.1)
    assert (got["mil"].argmax(axis=1) == got["torch"].argmax(axis=1)).mean() >= 0.95
