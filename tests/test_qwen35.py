"""Qwen3.5's linear-attention layer (llama_ane.model.layers.delta_net) held to transformers': the chunked
delta rule to torch_recurrent_gated_delta_rule, the whole DeltaLayer to Qwen3_5DecoderLayer over a
sequence, over padded prefill windows then decoding (the same states), and the MIL builder run by
the MIL executor on a padded window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llama_ane.model.layers.delta_net import DeltaLayer, DeltaShape, delta_layer_mil
from llama_ane.model.layers import Graph

from support.delta import (channels_first, check_chunked_rule, check_fp16_window, check_mil_builder_on_a_padded_window,
                           check_mil_states_follow_torch_fp16, check_padded_windows, check_prompt_cache_holds_the_states,
                           check_whole_sequence, reference_run, windows_then_decoding)
from support.families import CASES

transformers = pytest.importorskip("transformers")
from transformers import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer  # noqa: E402
from conftest import convert_to  # noqa: E402

C, EPS, TOKENS, K = 32, 1e-6, 23, 4
# (key heads, value heads, Dk, Dv): GQA-style value heads per key head, and one each
SHAPES = {"grouped": (2, 4, 16, 8), "one_each": (3, 3, 8, 16)}
UNIT_OFFSET = ("input_layernorm.weight", "post_attention_layernorm.weight")  # Qwen3.5's (1 + w) norms


def reference(shape: str) -> tuple[Qwen3_5TextConfig, Qwen3_5DecoderLayer]:
    gk, h, dk, dv = SHAPES[shape]
    cfg = Qwen3_5TextConfig(hidden_size=C, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=32,
                            intermediate_size=48, linear_conv_kernel_dim=K, linear_key_head_dim=dk,
                            linear_value_head_dim=dv, linear_num_key_heads=gk, linear_num_value_heads=h,
                            rms_norm_eps=EPS)
    torch.manual_seed(0)
    module = Qwen3_5DecoderLayer(cfg, 0).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):  # decays from slow to fast, as trained checkpoints hold
                p.copy_(torch.linspace(-2.0, 1.5, h))
            else:
                p.normal_(0.0 if p.dim() > 1 else 0.2, 0.3)
    return cfg, module


def delta_shape(shape: str) -> DeltaShape:
    gk, h, dk, dv = SHAPES[shape]
    return DeltaShape(gk, h, dk, dv, K, EPS)


def ours(hf: Qwen3_5DecoderLayer, shape: str) -> DeltaLayer:
    """DeltaLayer with hf's weights: 1x1 convs, the (1 + w) norms stored as 1 + w."""
    module = DeltaLayer(C, hf.mlp.gate_proj.out_features, delta_shape(shape)).eval()
    shapes = {name: t.shape for name, t in module.state_dict().items()}
    state = {name: (t + 1.0 if name in UNIT_OFFSET else t).reshape(shapes[name]) for name, t in hf.state_dict().items()}
    module.load_state_dict(state)
    return module


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request):
    cfg, hf = reference(request.param)
    x, y, states = reference_run(cfg, hf, TOKENS, C, position_embeddings=None)
    return hf, ours(hf, request.param), delta_shape(request.param), x, y, states


@pytest.mark.parametrize("s", [1, 2, 5, 16, 64])
def test_chunked_rule_matches_the_recurrent_one(s):
    """gated_delta over one window of S tokens from a random state equals transformers' token loop."""
    check_chunked_rule(s, 1.0)


def test_whole_sequence_and_states_match_transformers(pair):
    hf, module, net, x, y_ref, (conv_ref, state_ref) = pair
    check_whole_sequence(module, net, x, y_ref, conv_ref, state_ref)


@pytest.mark.parametrize("window", [1, 4, 8, 16])
def test_padded_windows_then_decode_carry_the_states(pair, window):
    """Prefill windows of `window` columns, the last one padded with garbage, then decode one token
    at a time: the real columns equal the whole sequence's and both states end at the last real token."""
    hf, module, net, x, y_ref, (conv_ref, state_ref) = pair
    check_padded_windows(module, net, x, y_ref, conv_ref, state_ref, window, 13)


def test_fp16_window_stays_near_fp32(pair):
    """The same window in fp16 (the exported precision) stays finite and within 1% of fp32's scale
    (fp16 keeps 11 bits: the residual stream's values near 30 are 0.016 apart)."""
    hf, module, net, x, _, _ = pair
    check_fp16_window(module, net, x)


@pytest.mark.export
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_mil_builder_matches_torch_on_a_padded_window(pair, tmp_path, precision):
    hf, module, net, x, _, _ = pair
    check_mil_builder_on_a_padded_window(module, net, C, tmp_path, precision, 16, 11)


def branch_states(net: DeltaShape, b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of b branches' conv state (1,Q,B,K-1) and recurrent state (B,H*Dk,1,Dv), random."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, net.conv_channels, b, K - 1, generator=gen),
            0.3 * torch.randn(b, *net.state_shape[1:], generator=gen))


def test_branches_each_equal_their_own_decoding(pair):
    """B columns, each the next token of its own sequence from its own states, give what decoding
    each alone gives: its output, its token's conv values and its next state."""
    hf, module, net, x, _, _ = pair
    b = 3
    conv_states, states = branch_states(net, b, 4)
    xs = channels_first(x)[..., :b]
    with torch.no_grad():
        y, mixed, new = module(xs, conv_states, states, None)
        for j in range(b):
            y1, mixed1, new1 = module(xs[..., j:j + 1], conv_states[:, :, j:j + 1], states[j:j + 1], 1)
            torch.testing.assert_close(y[..., j:j + 1], y1, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mixed[..., j:j + 1], mixed1, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(new[j:j + 1], new1, rtol=1e-5, atol=1e-5)


@pytest.mark.export
def test_mil_builder_matches_torch_on_branches(pair, tmp_path):
    ct = pytest.importorskip("coremltools")
    from coremltools.converters.mil import Builder as mb
    from llama_ane.mil import PackageExecutor

    hf, module, net, x, _, _ = pair
    params = {name: t.numpy() for name, t in module.state_dict().items()}
    g = Graph(np.float32, lambda name: params[name])
    b, width = 3, 32

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, C, 1, b)), mb.TensorSpec(shape=(1, net.conv_channels, b, width)),
                             mb.TensorSpec(shape=(b, *net.state_shape[1:]))], opset_version=ct.target.iOS18)
    def prog(x, conv_branches, delta_branches):
        return delta_layer_mil(g, x, conv_branches, delta_branches, None, "", C, net, b)

    convert_to(prog, tmp_path / "delta_branches.mlpackage", compute_precision=ct.precision.FLOAT32)
    conv_states, states = branch_states(net, b, 5)
    conv_states = torch.cat([torch.zeros(1, net.conv_channels, b, width - K + 1), conv_states], dim=3)
    feeds = {"x": channels_first(x)[..., :b].numpy(), "conv_branches": conv_states.numpy(),
             "delta_branches": states.numpy()}
    got = list(PackageExecutor(tmp_path / "delta_branches.mlpackage", precision="fp32").run("main", feeds).values())
    with torch.no_grad():
        want = module(channels_first(x)[..., :b], conv_states, states, None)
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w.numpy(), rtol=1e-4, atol=1e-4)


# --- the config, the checkpoint's tensors, the whole model --------------------------------------------

# the tiny Qwen3.5 checkpoints test_families.py runs end to end (written by Qwen3_5ForCausalLM), whose
# torch fp32 logits, greedy tokens, cascade, fp16 export, inspect and mil runs it checks
CHECKPOINTS = {name.removeprefix("qwen35_"): case for name, case in CASES.items() if name.startswith("qwen35_")}


def tiny_config(case: str = "tied_gqa", **change):
    """The config of checkpoint `case` with `change`, as LlamaConfig reads it."""
    from llama_ane.config import LlamaConfig
    from llama_ane.testing import TINY_CONFIG

    return LlamaConfig.from_hf_dict({**TINY_CONFIG, "vocab_size": 320, **CHECKPOINTS[case], **change})


def test_config_and_tensors_as_transformers_has_them():
    """The config read as Qwen3_5TextConfig reads it (linear layers, their heads and widths, the
    convolution's kernel, a quarter of each head rotated, output-gated attention), the manifest's copy
    read back, and every tensor and shape of Qwen3_5ForCausalLM's."""
    import json

    from transformers import AutoModelForCausalLM

    from llama_ane.checkpoint.mapping import expected_shape, expected_tensors
    from llama_ane.config import DELTA_FIELDS, LlamaConfig

    for name in CHECKPOINTS:
        cfg = tiny_config(name)
        hf = cfg.transformers_config()
        assert [cfg.linear(n) for n in range(4)] == [t == "linear_attention" for t in hf.layer_types]
        assert (cfg.conv_kernel, cfg.delta_key_heads, cfg.delta_value_heads, cfg.delta_key_dim, cfg.delta_value_dim) \
            == (hf.linear_conv_kernel_dim, hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
                hf.linear_value_head_dim)
        assert cfg.rotary_dim == 8 and cfg.attn_output_gate and cfg.qk_norm
        assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
        model = AutoModelForCausalLM.from_config(hf)
        theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
        ours = {n: expected_shape(cfg, n, dims) for n, dims in expected_tensors(cfg).items()}
        assert ours == theirs
    assert tiny_config("untied_mha").delta_layers == [0, 2]  # full_attention_interval 2
    assert tiny_config(layer_types=None, num_hidden_layers=8).delta_layers == [0, 1, 2, 4, 5, 6]  # by default every 4th
    assert tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
                                        "mrope_section": [11, 11, 10], "mrope_interleaved": True}).rotary_dim == 16
    llama = LlamaConfig.from_hf_dict(dict(tiny_config().to_hf_dict(), model_type="llama"))
    assert not set(DELTA_FIELDS) & set(llama.to_dict())  # other families' manifests hold none of them


@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]},
     ["layer_types", "\"linear_attention\""]),
    ({"layer_types": ["linear_attention", "full_attention"]}, ["layer_types", "num_hidden_layers (4)"]),
    ({"linear_num_value_heads": 3}, ["linear_num_value_heads (3)", "multiple of linear_num_key_heads (2)"]),
    ({"linear_conv_kernel_dim": 1}, ["linear_conv_kernel_dim", ">= 2"]),
    ({"linear_key_head_dim": "16"}, ["linear_key_head_dim", "the string"]),
    ({"attention_bias": True}, ["attention_bias", "without biases"]),
])
def test_bad_fields_are_refused_by_name(change, words):
    from llama_ane.config import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny_config(**change)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("field, value", [("delta_layers", [9]), ("delta_layers", "0,1"), ("delta_key_dim", 0),
                                          ("attn_output_gate", "yes"), ("delta_value_heads", 3)])
def test_a_manifest_config_with_a_bad_linear_attention_field_is_refused(field, value):
    """The manifest's copy of the config is untrusted too: each of Qwen3.5's fields is checked when read back."""
    from llama_ane.config import ConfigError, LlamaConfig

    with pytest.raises(ConfigError, match=field.split("_")[-1] if field == "delta_value_heads" else field):
        LlamaConfig.from_dict(dict(tiny_config().to_dict(), **{field: value}))


def test_multimodal_checkpoint_and_speculative_window_refused_by_name():
    """Qwen3.5's multimodal checkpoint (model_type qwen3_5: a vision tower, language_model.* names)
    is refused by name; so is a verify window, which its linear-attention states cannot serve."""
    from llama_ane.config import ConfigError, LlamaConfig
    from llama_ane.contract.options import ExportOptions, ExportOptionsError
    from llama_ane.contract.plan import plan_export
    from llama_ane.testing import TINY_CONFIG

    with pytest.raises(ConfigError, match="'qwen3_5'.*Gated DeltaNet"):
        LlamaConfig.from_hf_dict(dict(TINY_CONFIG, vocab_size=320, model_type="qwen3_5"))
    with pytest.raises(ExportOptionsError, match="--verify-window 16.*linear-attention layers.*--verify-window 0"):
        plan_export(tiny_config(), ExportOptions(context_length=256, verify_window=16))


def test_a_qwen35_gguf_is_refused_by_name(tmp_path):
    """llama.cpp's Qwen3.5 architecture ('qwen35') is not read from GGUF: one error naming it."""
    pytest.importorskip("gguf")
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.errors import LlamaANEError
    from support.gguf import write_bare

    path = write_bare(tmp_path / "qwen35.gguf", "qwen35")
    with pytest.raises(LlamaANEError, match="'qwen35' model, which llama-ane does not export"):
        load_checkpoint(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from support.checks import made_once

    from llama_ane.testing import make_tiny_checkpoint

    return made_once(tmp_path_factory, CHECKPOINTS, make_tiny_checkpoint)


def load_fp32(folder, **options):
    import llama_ane

    return llama_ane.load(folder, backend="torch", precision="fp32",
                          **{"context_length": 256, "prefill_length": 32, "layers_per_chunk": 2, **options})


def hf_model(folder):
    """Qwen3_5ForCausalLM of `folder` in fp32."""
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.mark.export
@pytest.mark.parametrize("prefill", [8, 32])
def test_windows_then_decoding_leave_each_layers_states_as_transformers(folders, prefill):
    """Prefill in windows of `prefill` (the last one padded), then decoding: every linear-attention
    layer's recurrent state and convolution state, held per chunk, are transformers' after the same
    tokens, and the pipeline's are those of the export's own reference (llama_ane.reference)."""
    from transformers import DynamicCache

    from llama_ane.reference import recurrent_delta_rule

    folder = folders("tied_gqa")
    model, ref = load_fp32(folder, prefill_length=prefill), hf_model(folder)
    ids = list(range(9, 9 + 45))
    pipeline = windows_then_decoding(model, ids, 40)
    cache = DynamicCache(config=ref.config)
    with torch.no_grad(), recurrent_delta_rule("qwen3_5_text"):
        ref(torch.tensor([ids]), cache=cache, use_cache=True)
    cfg = pipeline.config
    for c, chunk in enumerate(pipeline.chunks):
        rows = [n for n in chunk["layers"] if cfg.linear(n)]
        for j, n in enumerate(rows):
            state = pipeline.cache.caches[c]["delta"][j].reshape(cfg.delta_value_heads, cfg.delta_key_dim, -1)
            torch.testing.assert_close(torch.from_numpy(state), cache.get_recurrent_state(n, state_idx=0)[0],
                                       rtol=1e-4, atol=1e-4)
            conv = pipeline.cache.caches[c]["conv"][j, :, 0, -(K - 1):]
            torch.testing.assert_close(torch.from_numpy(conv), cache.get_conv_state(n, state_idx=0)[0, :, 1:],
                                       rtol=1e-4, atol=1e-4)  # as the recurrent state: fp32 through the layers below
    assert pipeline.rewind(30) == 0 and pipeline.position == 0  # a state cannot go back: start again
    model.close()


@pytest.mark.export
def test_a_prompt_cache_file_holds_the_states(folders, tmp_path):
    """A prompt-cache file saves each chunk's states whole: decoding on from the loaded file gives
    the logits of decoding on from the cache it was saved from."""
    model = load_fp32(folders("tied_gqa"), context_length=64, prefill_length=8)
    check_prompt_cache_holds_the_states(model, tmp_path)
    model.close()


@pytest.fixture(scope="module", params=["state", "inputs"])
def exported(request, folders, tmp_path_factory):
    """One fp16 export of each cache kind (tied_gqa: a chunk of linear-attention layers only, and one
    with the attention layer)."""
    from llama_ane.api import export_model

    out = tmp_path_factory.mktemp("export") / request.param
    return request.param, export_model(folders("tied_gqa"), out, context_length=256, prefill_length=64,
                                       layers_per_chunk=2, kv_cache=request.param, branch_width=4,
                                       suffix_length=64, progress=False, verify=False)


@pytest.mark.export
@pytest.mark.slow
def test_the_fp16_export_passes_inspect_and_runs_in_mil(exported):
    """inspect --strict finds no ANE rule broken; the mil backend's programs give the torch fp16
    backend's top-1 tokens (>= 0.98) and their decode_branches the tokens of decoding alone; with
    input caches the chunks return the states after the window's real tokens (delta_new), with
    state caches they write them."""
    from support.checks import check_inspect_strict, check_mil_branches, check_mil_fp16

    import llama_ane

    kind, out = exported
    check_inspect_strict(out)
    check_mil_fp16(f"qwen35_{kind}", out, top1=0.98)
    check_mil_branches(f"qwen35_{kind}", out)
    window = llama_ane.load(out, backend="mil").manifest["models"]["chunk_0"]["functions"]["prefill"]
    where = {t["name"]: kind for kind in ("inputs", "states", "outputs") for t in window.get(kind, [])}
    assert where["delta_state"] == ("states" if kind == "state" else "inputs")
    assert ("delta_new" in where) == (kind == "inputs") and where["window_tokens"] == "inputs"


@pytest.mark.export
@pytest.mark.slow
def test_mil_states_follow_torch_fp16(exported):
    """The programs' recurrent states after a padded prefill window and decoding (mil, fp16) are the
    torch backend's (fp16) within fp16 rounding."""
    check_mil_states_follow_torch_fp16(exported[1])
