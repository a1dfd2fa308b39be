"""OLMo-Hybrid's linear-attention layer as model.layers.delta_net's DeltaLayer (beta scaled by 2, the gated
norm's own eps, q, k and v projected apart) held to transformers' OlmoHybridLinearAttentionDecoderLayer:
over a sequence, over padded prefill windows then decoding (the same states), in fp16 (the delta rule
in spans, where beta reaches 2), and the MIL builder run by the MIL executor on a padded window."""

from __future__ import annotations

import pytest
import torch

from llama_ane.model.layers.delta_net import SPAN, DeltaLayer, DeltaShape, gated_delta
from llama_ane.reference import token_by_token

from support.delta import (check_chunked_rule, check_fp16_window, check_mil_builder_on_a_padded_window,
                           check_padded_windows, check_whole_sequence, reference_run, windows_then_decoding)
from support.families import CASES

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, OlmoHybridConfig  # noqa: E402
from transformers.models.olmo_hybrid.modeling_olmo_hybrid import (  # noqa: E402
    OlmoHybridLinearAttentionDecoderLayer, torch_recurrent_gated_delta_rule)

MODELING = "transformers.models.olmo_hybrid.modeling_olmo_hybrid"
C, EPS, TOKENS, K = 32, 1e-6, 40, 4
# (key heads, value heads, Dk, Dv, linear_allow_neg_eigval): value heads per key head, beta in [0, 2]
# or [0, 1]
SHAPES = {"grouped": (2, 4, 16, 8, True), "one_each": (3, 3, 8, 16, False)}


def reference(shape: str) -> tuple[OlmoHybridConfig, OlmoHybridLinearAttentionDecoderLayer]:
    gk, h, dk, dv, neg = SHAPES[shape]
    cfg = OlmoHybridConfig(hidden_size=C, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                           num_attention_heads=2, num_key_value_heads=1, vocab_size=32, intermediate_size=48,
                           linear_conv_kernel_dim=K, linear_key_head_dim=dk, linear_value_head_dim=dv,
                           linear_num_key_heads=gk, linear_num_value_heads=h, rms_norm_eps=EPS,
                           linear_allow_neg_eigval=neg, pad_token_id=None)
    torch.manual_seed(0)
    module = OlmoHybridLinearAttentionDecoderLayer(cfg, 0).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):  # decays from slow to fast, as trained checkpoints hold
                p.copy_(torch.linspace(-2.0, 1.5, h))
            elif name.endswith("b_proj.weight"):  # beta near its ends as well as between
                p.normal_(0.0, 1.5)
            else:
                p.normal_(0.0 if p.dim() > 1 else 0.2, 0.3)
    return cfg, module


def delta_shape(shape: str) -> DeltaShape:
    gk, h, dk, dv, neg = SHAPES[shape]
    return DeltaShape(gk, h, dk, dv, K, EPS, 2.0 if neg else 1.0, 1e-5)


def ours(hf: OlmoHybridLinearAttentionDecoderLayer, shape: str) -> DeltaLayer:
    """DeltaLayer with hf's weights: q, k and v projections stacked as in_proj_qkv, 1x1 convs."""
    net = delta_shape(shape)
    module = DeltaLayer(C, hf.mlp.gate_proj.out_features, net).eval()
    a = hf.linear_attn
    theirs = {"input_layernorm.weight": hf.input_layernorm.weight,
              "linear_attn.in_proj_qkv.weight": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
              "linear_attn.in_proj_z.weight": a.g_proj.weight, "linear_attn.in_proj_b.weight": a.b_proj.weight,
              "linear_attn.in_proj_a.weight": a.a_proj.weight, "linear_attn.conv1d.weight": a.conv1d.weight,
              "linear_attn.dt_bias": a.dt_bias, "linear_attn.A_log": a.A_log, "linear_attn.norm.weight": a.o_norm.weight,
              "linear_attn.out_proj.weight": a.o_proj.weight,
              "post_attention_layernorm.weight": hf.post_attention_layernorm.weight,
              **{f"mlp.{p}.weight": getattr(hf.mlp, p).weight for p in ("gate_proj", "up_proj", "down_proj")}}
    shapes = {name: t.shape for name, t in module.state_dict().items()}
    assert set(shapes) == set(theirs)
    module.load_state_dict({name: t.detach().reshape(shapes[name]) for name, t in theirs.items()})
    return module


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request):
    cfg, hf = reference(request.param)
    with token_by_token(MODELING):
        x, y, states = reference_run(cfg, hf, TOKENS, C)
    return hf, ours(hf, request.param), delta_shape(request.param), x, y, states


@pytest.mark.parametrize("span", [0, SPAN])
@pytest.mark.parametrize("s", [2, 8, 13, 64])
def test_chunked_rule_in_spans_matches_the_recurrent_one(s, span):
    """gated_delta over one window of S tokens, whole or in spans, with beta in [0, 2], equals
    transformers' token loop."""
    check_chunked_rule(s, 2.0, span)


def test_whole_sequence_and_states_match_transformers(pair):
    hf, module, net, x, y_ref, (conv_ref, state_ref) = pair
    check_whole_sequence(module, net, x, y_ref, conv_ref, state_ref)


@pytest.mark.parametrize("window", [1, 4, 16, 32])
def test_padded_windows_then_decode_carry_the_states(pair, window):
    """Prefill windows of `window` columns (spans of 4 and a shorter last one), the last one padded
    with garbage, then decode one token at a time: the real columns equal the whole sequence's and
    both states end at the last real token."""
    hf, module, net, x, y_ref, (conv_ref, state_ref) = pair
    check_padded_windows(module, net, x, y_ref, conv_ref, state_ref, window, 29)


def test_fp16_window_stays_near_fp32(pair):
    """A 40-token window in fp16 (the exported precision) stays finite and within 1% of fp32's scale;
    with beta up to 2 the delta rule runs in spans (DeltaShape.span), a window of beta up to 1 whole."""
    hf, module, net, x, _, _ = pair
    assert net.span == (SPAN if net.beta_scale > 1 else 0)
    check_fp16_window(module, net, x)


def test_spans_keep_the_inverse_in_fp16_range():
    """Keys that nearly agree and beta near 2 (each token nearly a reflection): over a whole 64-token
    window the inverse's powers leave fp16's range and the fp16 rule breaks down; in spans it stays
    within 1% of transformers' token loop."""
    gen = torch.Generator().manual_seed(3)
    s, dk, dv = 64, 16, 16
    base = torch.randn(dk, generator=gen)
    q = torch.nn.functional.normalize(torch.randn(1, s, 1, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(base + 0.3 * torch.randn(1, s, 1, dk, generator=gen), dim=-1)
    v = torch.randn(1, s, 1, dv, generator=gen)
    g = -0.01 * torch.rand(1, s, 1, generator=gen)
    beta = 1.9 + 0.1 * torch.rand(1, s, 1, generator=gen)
    want, _ = torch_recurrent_gated_delta_rule(*(t.double() for t in (q, k, v, g, beta)), output_final_state=True)
    args = ((q / dk ** 0.5).permute(2, 0, 3, 1), k.permute(2, 0, 3, 1), v.permute(2, 0, 3, 1),
            g.reshape(1, 1, 1, s), beta.reshape(1, 1, 1, s), torch.zeros(1, 1, dk, dv))
    want, scale = want.permute(2, 0, 3, 1), want.abs().max().item()
    whole, _ = gated_delta(*(t.half() for t in args))
    spans, _ = gated_delta(*(t.half() for t in args), span=SPAN)
    assert not ((whole.double() - want).abs().max().item() < 0.01 * scale)  # NaN or far off
    torch.testing.assert_close(spans.double(), want, rtol=0, atol=0.01 * scale)


@pytest.mark.export
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_mil_builder_matches_torch_on_a_padded_window(pair, tmp_path, precision):
    """18 columns, 17 real: where beta reaches 2, spans of 4 and a last one of 2."""
    hf, module, net, x, _, _ = pair
    check_mil_builder_on_a_padded_window(module, net, C, tmp_path, precision, 18, 17)


# --- the config, the checkpoint's tensors, the whole model --------------------------------------------

# the tiny OLMo-Hybrid checkpoints test_families.py runs end to end (written by OlmoHybridForCausalLM),
# whose torch fp32 logits, greedy tokens, cascade, fp16 export, inspect and mil runs it checks
CHECKPOINTS = {name.removeprefix("olmo_hybrid_"): case for name, case in CASES.items()
               if name.startswith("olmo_hybrid_")}


def tiny_config(case: str = "tied_gqa", **change):
    """The config of checkpoint `case` with `change`, as LlamaConfig reads it."""
    from llama_ane.config import LlamaConfig
    from llama_ane.testing import TINY_CONFIG

    return LlamaConfig.from_hf_dict({**TINY_CONFIG, "vocab_size": 320, **CHECKPOINTS[case], **change})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from support.checks import made_once
    from support.families import make_family_checkpoint

    return made_once(tmp_path_factory, {n: dict(c) for n, c in CHECKPOINTS.items()}, make_family_checkpoint)


def test_config_as_transformers_reads_it():
    """The layers, their sizes (OlmoHybridConfig's defaults where absent), beta's scale, the gated norm's
    eps and a null RoPE base read as OlmoHybridConfig reads them; the manifest's copy reads back, and
    written back for transformers it is the same config."""
    import json

    from llama_ane.config import LlamaConfig

    for name, case in CHECKPOINTS.items():
        cfg = tiny_config(name)
        hf = OlmoHybridConfig(**{k: v for k, v in {**case, "hidden_size": 64, "num_hidden_layers": 4}.items()
                                 if k not in ("model_type", "head_dim")})
        assert [cfg.linear(n) for n in range(4)] == [t == "linear_attention" for t in hf.layer_types]
        assert (cfg.conv_kernel, cfg.delta_key_heads, cfg.delta_value_heads, cfg.delta_key_dim, cfg.delta_value_dim) \
            == (hf.linear_conv_kernel_dim, hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
                hf.linear_value_head_dim)
        assert cfg.delta_beta_scale == (2.0 if hf.linear_allow_neg_eigval else 1.0) and cfg.delta_norm_eps == 1e-5
        rotates = hf.rope_parameters["rope_theta"] is not None
        assert [cfg.rotary(n) for n in range(4) if not cfg.linear(n)] == [rotates]
        assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
        back = cfg.transformers_config()
        for field in ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                      "linear_value_head_dim", "linear_allow_neg_eigval", "rope_parameters"):
            assert getattr(back, field) == getattr(hf, field), field
    default = tiny_config(layer_types=None, num_hidden_layers=8, linear_num_key_heads=None,
                          linear_key_head_dim=None, linear_value_head_dim=None)
    assert default.delta_layers == [0, 1, 2, 4, 5, 6]  # every fourth layer attention
    assert (default.delta_key_heads, default.delta_key_dim, default.delta_value_dim) == (2, 24, 48)  # as transformers
    assert tiny_config(layer_types=None, num_hidden_layers=2).delta_layers == [0]  # the last layer attention
    llama = LlamaConfig.from_hf_dict(dict(tiny_config().to_hf_dict(), model_type="llama"))
    assert "delta_beta_scale" not in llama.to_dict() and "delta_norm_eps" not in llama.to_dict()


@pytest.mark.export
def test_tensors_are_those_transformers_saves(folders):
    """Every tensor an export reads is in the checkpoint OlmoHybridForCausalLM saved (its stored names:
    attention_layer_norm, feedforward_layer_norm, the kernel in three parts), of the shape the config
    gives, and nothing else is there."""
    from safetensors import safe_open

    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.checkpoint.mapping import expected_shape, expected_tensors

    for name in CHECKPOINTS:
        folder = folders(name)
        ckpt = load_checkpoint(folder)
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        ours = {n: dims and expected_shape(ckpt.config, n, dims) for n, dims in expected_tensors(ckpt.config).items()}
        assert set(ours) == set(stored)
        assert all(stored[n] == shape for n, shape in ours.items() if shape)


@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["linear_attention"] * 4}, ["layer_types", "only \"linear_attention\""]),
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]},
     ["layer_types", "\"linear_attention\" or \"full_attention\""]),
    ({"linear_num_value_heads": 3}, ["linear_num_value_heads (3)", "multiple of linear_num_key_heads (2)"]),
    ({"linear_allow_neg_eigval": "yes"}, ["linear_allow_neg_eigval", "true or false"]),
    ({"head_dim": 16}, ["head_dim", "hidden_size / num_attention_heads (32)"]),
    ({"linear_conv_kernel_dim": 1}, ["linear_conv_kernel_dim", ">= 2"]),
])
def test_bad_fields_are_refused_by_name(change, words):
    from llama_ane.config import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny_config(**change)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("field, value", [("delta_beta_scale", 0), ("delta_beta_scale", "2"), ("delta_norm_eps", -1.0)])
def test_a_manifest_config_with_a_bad_variant_field_is_refused(field, value):
    from llama_ane.config import ConfigError, LlamaConfig

    with pytest.raises(ConfigError, match=field):
        LlamaConfig.from_dict(dict(tiny_config().to_dict(), **{field: value}))


def test_a_gguf_of_it_is_refused_by_name(tmp_path):
    """llama.cpp has no OLMo-Hybrid architecture (gguf-py lists none): a file naming one is refused
    with its name, as any architecture the export does not read."""
    gguf = pytest.importorskip("gguf")
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.errors import LlamaANEError
    from support.gguf import write_bare

    assert not any("hybrid" in name for name in gguf.MODEL_ARCH_NAMES.values() if "olmo" in name)
    path = write_bare(tmp_path / "olmo_hybrid.gguf", "olmo_hybrid")
    with pytest.raises(LlamaANEError, match="'olmo_hybrid' model, which llama-ane does not export"):
        load_checkpoint(path)


@pytest.mark.export
@pytest.mark.parametrize("prefill", [8, 32])
def test_windows_then_decoding_leave_each_layers_states_as_transformers(folders, prefill):
    """Prefill in windows of `prefill` (the last one padded), then decoding: every linear-attention
    layer's recurrent state and convolution state, held per chunk, are OlmoHybridForCausalLM's after
    the same tokens (its token-by-token delta rule)."""
    import llama_ane
    from transformers import OlmoHybridForCausalLM

    folder = folders("tied_gqa")
    model = llama_ane.load(folder, backend="torch", precision="fp32", context_length=256, prefill_length=prefill,
                           layers_per_chunk=2)
    ref = OlmoHybridForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = list(range(9, 9 + 45))
    pipeline = windows_then_decoding(model, ids, 40)
    cache = DynamicCache(config=ref.config)
    with torch.no_grad(), token_by_token(MODELING):
        ref(torch.tensor([ids]), cache=cache, use_cache=True)
    cfg = pipeline.config
    checked = 0
    for c, chunk in enumerate(pipeline.chunks):
        for j, n in enumerate([n for n in chunk["layers"] if cfg.linear(n)]):
            state = pipeline.cache.caches[c]["delta"][j].reshape(cfg.delta_value_heads, cfg.delta_key_dim, -1)
            torch.testing.assert_close(torch.from_numpy(state), cache.get_recurrent_state(n, state_idx=0)[0],
                                       rtol=1e-4, atol=1e-4)
            conv = pipeline.cache.caches[c]["conv"][j, :, 0, -(K - 1):]
            torch.testing.assert_close(torch.from_numpy(conv), cache.get_conv_state(n, state_idx=0)[0, :, 1:],
                                       rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked == len(cfg.delta_layers) == 3
    model.close()


def test_a_verify_window_is_refused_by_name():
    """A speculative verify window, which its linear-attention states cannot serve, is refused by name."""
    from llama_ane.contract.options import ExportOptions, ExportOptionsError
    from llama_ane.contract.plan import plan_export

    with pytest.raises(ExportOptionsError, match="--verify-window 16.*linear-attention layers.*--verify-window 0"):
        plan_export(tiny_config(), ExportOptions(context_length=256, verify_window=16))


@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
@pytest.mark.parametrize("s", [1, 18, 64])
def test_the_delta_rules_flops_are_the_programs_in_spans(beta_scale, s):
    """The device model's delta-rule flops for a window of S tokens are those torch's counter sees
    gated_delta run, whole (beta up to 1) or in spans of SPAN (beta up to 2)."""
    from torch.utils.flop_counter import FlopCounterMode

    from llama_ane.contract import device_model as dm
    from llama_ane.model.functions import delta_span

    h, gk, dk, dv = 4, 2, 16, 32
    r = h // gk
    manifest = {"config": {"delta_key_heads": gk, "delta_beta_scale": beta_scale},
                "cache": {"delta": {"heads": h, "key_dim": dk, "value_dim": dv, "layers": [0, 2]}},
                "chunks": [{"model": "chunk_0"}],
                "models": {"chunk_0": {"functions": {"prefill": {"inputs": [
                    {"name": "hidden_states", "shape": [1, 64, 1, s]}]}}}}}
    with FlopCounterMode(display=False) as counter:
        gated_delta(torch.randn(gk, 1, dk, s), torch.randn(gk, 1, dk, s), torch.randn(gk, r, dv, s),
                    -torch.rand(gk, r, 1, s), torch.rand(gk, r, 1, s), torch.randn(gk, r, dk, dv), delta_span(beta_scale))
    assert dm.delta_flops(manifest, "prefill") == 2 * counter.get_total_flops()
