"""Falcon-H1's Mamba-2 mixer as model.layers.mamba2's Mamba2Mixer (its muP multipliers folded into in_proj)
held to transformers' FalconH1Mixer: over a sequence, over padded prefill windows then decoding (the same
states, and transformers' own decoding steps), the cascade's branches, fp16, and the MIL builder run by
the MIL executor on a padded window."""

from __future__ import annotations

import pytest
import torch

from llama_ane.model.layers.mamba2 import Mamba2Mixer, Mamba2Shape, mamba2_mixer_mil, ssd

from support.delta import (carried, check_fp16_window, check_mil_builder_on_a_padded_window,
                           check_mil_states_follow_torch_fp16, check_padded_windows, check_prompt_cache_holds_the_states,
                           check_whole_sequence, windows_then_decoding, zero_states)

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, FalconH1Config  # noqa: E402
from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector  # noqa: E402

C, EPS, TOKENS, K = 32, 1e-5, 40, 4
# (heads, head_dim, groups, state, gate): the gated norm before or after the gate, or none
SHAPES = {"grouped_before": (4, 8, 2, 8, "before"), "one_group_after": (4, 8, 1, 16, "after"),
          "no_norm": (2, 16, 1, 8, None)}
MULTIPLIERS = [0.7, 1.3, 0.9, 1.1, 0.8]  # z, x, B, C, dt rows of in_proj
IN_MULTIPLIER = 1.25


def reference(shape: str) -> tuple[FalconH1Config, FalconH1Mixer]:
    h, p, gk, n, gate = SHAPES[shape]
    cfg = FalconH1Config(hidden_size=C, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         vocab_size=32, intermediate_size=48, mamba_d_ssm=h * p, mamba_n_heads=h, mamba_d_head=p,
                         mamba_n_groups=gk, mamba_d_state=n, mamba_d_conv=K, mamba_chunk_size=16, rms_norm_eps=EPS,
                         mamba_rms_norm=gate is not None, mamba_norm_before_gate=gate == "before",
                         ssm_multipliers=MULTIPLIERS, ssm_in_multiplier=IN_MULTIPLIER, pad_token_id=None)
    torch.manual_seed(0)
    module = FalconH1Mixer(cfg, 0).eval()
    module.register_buffer("mup_vector", compute_mup_vector(cfg), persistent=False)
    with torch.no_grad():
        for name, p_ in module.named_parameters():
            if name == "A_log":  # decays from slow to fast, as trained checkpoints hold
                p_.copy_(torch.linspace(-2.0, 1.5, h))
            elif name == "dt_bias":
                p_.copy_(torch.linspace(-3.0, 0.5, h))
            else:
                p_.normal_(0.0 if p_.dim() > 1 else 0.5, 0.3)
    return cfg, module


def mamba_shape(hf: FalconH1Mixer, shape: str) -> Mamba2Shape:
    h, p, gk, n, gate = SHAPES[shape]
    return Mamba2Shape(h, p, gk, n, K, EPS, gate, conv_bias=True, proj_bias=False, out_bias=False)


def ours(hf: FalconH1Mixer, shape: str) -> Mamba2Mixer:
    """Mamba2Mixer with hf's weights: in_proj's rows scaled by the mup vector and ssm_in_multiplier, 1x1 convs."""
    net = mamba_shape(hf, shape)
    module = Mamba2Mixer(C, net).eval()
    rows = hf.mup_vector.reshape(-1, 1) * hf.ssm_in_multiplier
    theirs = {"in_proj.weight": hf.in_proj.weight * rows, "conv1d.weight": hf.conv1d.weight.unsqueeze(2),
              "conv1d.bias": hf.conv1d.bias, "dt_bias": hf.dt_bias, "A_log": hf.A_log, "D": hf.D,
              "out_proj.weight": hf.out_proj.weight}
    if net.gate is not None:
        theirs["norm.weight"] = hf.norm.weight
    state = {name: t.reshape(module.state_dict()[name].shape) for name, t in theirs.items()}
    module.load_state_dict(state)
    return module


def reference_run(cfg, hf, tokens: int):
    """hf over `tokens` random inputs (seed 1) from empty states: the inputs, its outputs, its conv and
    recurrent states after them."""
    x = torch.randn(1, tokens, C, generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        y = hf(x, cache=cache)
    return x, y, (cache.get_conv_state(0, state_idx=0), cache.get_recurrent_state(0, state_idx=0))


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request):
    cfg, hf = reference(request.param)
    return cfg, hf, ours(hf, request.param), mamba_shape(hf, request.param)


def test_ssd_equals_the_token_loop():
    """ssd over a window from a random state equals the recurrence h = exp(a) h + B u^T, o = h^T C."""
    gen = torch.Generator().manual_seed(3)
    gk, r, n, p, s = 2, 3, 8, 4, 12
    c, b = (torch.randn(gk, 1, n, s, generator=gen) for _ in range(2))
    u = torch.randn(gk, r, p, s, generator=gen)
    a = -torch.rand(gk, r, 1, s, generator=gen) * 2.0
    state = torch.randn(gk, r, n, p, generator=gen)
    o, new = ssd(c, b, u, a, state)
    h, outs = state.clone(), []
    for t in range(s):
        h = torch.exp(a[..., t:t + 1]) * h + b[..., t].unsqueeze(-1) * u[..., t].unsqueeze(-2)
        outs.append(torch.matmul(h.transpose(2, 3), c[..., t:t + 1]))
    torch.testing.assert_close(o, torch.cat(outs, dim=3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new, h, rtol=1e-5, atol=1e-5)


def test_whole_sequence_and_states_match_transformers(pair):
    cfg, hf, module, net = pair
    x, y, (conv, state) = reference_run(cfg, hf, TOKENS)
    check_whole_sequence(module, net, x, y, conv, state)


@pytest.mark.parametrize("window", [16, 7])
def test_padded_windows_then_decode_carry_the_states(pair, window):
    cfg, hf, module, net = pair
    x, y, (conv, state) = reference_run(cfg, hf, TOKENS)
    check_padded_windows(module, net, x, y, conv, state, window, prefill=30)


def test_states_equal_transformers_own_decoding(pair):
    """transformers prefilling 20 tokens then decoding 20 one at a time (its recurrent step) leaves the
    states our padded windows and decoding leave, and its outputs are ours."""
    from llama_ane.model.layers.short_conv import conv_state_after

    cfg, hf, module, net = pair
    x = torch.randn(1, TOKENS, C, generator=torch.Generator().manual_seed(4))
    cache, outs = DynamicCache(config=cfg), []
    with torch.no_grad():
        outs.append(hf(x[:, :20], cache=cache))
        for t in range(20, TOKENS):
            outs.append(hf(x[:, t:t + 1], cache=cache))
        conv_state, state = zero_states(net)
        xs, ys = x.transpose(1, 2).unsqueeze(2), []
        for start in (0, 16):
            n = min(16, 20 - start)
            part = torch.cat([xs[..., start:start + n], torch.full((1, C, 1, 16 - n), -7.0)], dim=3)
            y, mixed, state = module(part, conv_state, state, n)
            ys.append(y[..., :n])
            conv_state = conv_state_after(conv_state, mixed, n)
        for t in range(20, TOKENS):
            y, mixed, state = module(xs[..., t:t + 1], conv_state, state, 1)
            ys.append(y)
            conv_state = conv_state_after(conv_state, mixed, 1)
    torch.testing.assert_close(torch.cat(ys, dim=3), torch.cat(outs, dim=1).transpose(1, 2).unsqueeze(2),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(carried(state, net), cache.get_recurrent_state(0, state_idx=0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv_state.reshape(-1, K - 1), cache.get_conv_state(0, state_idx=0)[0, :, 1:],
                               rtol=1e-5, atol=1e-6)


def test_branches_each_decode_as_alone(pair):
    """With n None, each column is its own sequence with its own states: the same outputs and states
    as decoding each alone."""
    _, _, module, net = pair
    gen = torch.Generator().manual_seed(5)
    b = 3
    x = torch.randn(1, C, 1, b, generator=gen)
    convs = torch.randn(1, net.conv_channels, b, K - 1, generator=gen)
    states = 0.3 * torch.randn(b, *net.state_shape[1:], generator=gen)
    with torch.no_grad():
        y, mixed, new = module(x, convs, states, None)
        for j in range(b):
            y1, mixed1, new1 = module(x[..., j:j + 1], convs[:, :, j:j + 1], states[j:j + 1], 1)
            torch.testing.assert_close(y[..., j:j + 1], y1, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mixed[..., j:j + 1], mixed1)
            torch.testing.assert_close(new[j:j + 1], new1, rtol=1e-5, atol=1e-5)


def test_fp16_window_stays_near_fp32(pair):
    cfg, hf, module, net = pair
    x, _, _ = reference_run(cfg, hf, TOKENS)
    check_fp16_window(module, net, x, make=lambda: Mamba2Mixer(C, net))


@pytest.mark.export
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_mil_builder_matches_torch_on_a_padded_window(pair, tmp_path, precision):
    _, _, module, net = pair
    check_mil_builder_on_a_padded_window(
        module, net, C, tmp_path, precision, s=16, n=11,
        builder=lambda g, x, conv_state, state, n, s: mamba2_mixer_mil(g, x, conv_state, state, n, "", net, s))


def test_state_bytes_and_flops():
    """The recurrent state is H x N x P values; the window's matmul flops grow with S as ssd runs them."""
    net = Mamba2Shape(4, 8, 2, 16, K, EPS)
    assert net.state_bytes() == 4 * 16 * 8 * 2
    assert net.as_delta.state_shape == net.state_shape and net.as_delta.conv_channels == net.conv_channels
    from llama_ane.contract.layer_costs import Mamba2

    macs = lambda s: Mamba2.macs(net.heads, net.groups, net.state, net.head_dim, s)  # noqa: E731
    assert macs(1) == 4 + 4 + 2 * 16 + 2 * 4 * 8 * 16 + 4 * 8
    assert macs(64) > 64 * macs(1)


# --- the family ---------------------------------------------------------------------------------

def tiny_config(name: str = "falcon_h1_tied_gqa", **change):
    from llama_ane.config import LlamaConfig
    from llama_ane.testing import TINY_CONFIG
    from support.families import CASES

    d = {k: v for k, v in {**TINY_CONFIG, "vocab_size": 320, **CASES[name], **change}.items() if v is not None}
    return LlamaConfig.from_hf_dict(d)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from support.checks import made_once
    from support.families import CASES, make_family_checkpoint

    return made_once(tmp_path_factory, {n: c for n, c in CASES.items() if n.startswith("falcon_h1")},
                     make_family_checkpoint)


@pytest.mark.parametrize("name", ["falcon_h1_tied_gqa", "falcon_h1_untied_mha", "falcon_h1_no_norm"])
def test_config_as_transformers_reads_it(name):
    """The mixer's sizes, where its gated norm sits and the multipliers read as FalconH1Config reads them;
    the manifest's copy reads back, and written back for transformers it is the same config."""
    import json

    from llama_ane.config import LlamaConfig
    from support.families import CASES

    cfg = tiny_config(name)
    case = {k: v for k, v in CASES[name].items() if k not in ("model_type",)}
    hf = FalconH1Config(**{**case, "hidden_size": 64, "num_hidden_layers": cfg.num_hidden_layers})
    assert cfg.mamba_layers == list(range(cfg.num_hidden_layers)) and not cfg.delta_layers
    assert (cfg.delta_value_heads, cfg.delta_value_dim, cfg.delta_key_heads, cfg.delta_key_dim, cfg.conv_kernel) == (
        hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_n_groups, hf.mamba_d_state, hf.mamba_d_conv)
    assert cfg.mamba_gate == (None if not hf.mamba_rms_norm else "before" if hf.mamba_norm_before_gate else "after")
    assert (cfg.embedding_multiplier, 1 / cfg.logits_scaling) == (hf.embedding_multiplier, hf.lm_head_multiplier)
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    back = cfg.transformers_config()
    for field in ("mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
                  "mamba_rms_norm", "mamba_norm_before_gate", "ssm_multipliers", "mlp_multipliers", "key_multiplier",
                  "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier",
                  "embedding_multiplier", "lm_head_multiplier"):
        assert getattr(back, field) == getattr(hf, field), field


@pytest.mark.parametrize("change, words", [
    ({"mamba_proj_bias": True}, ["mamba_proj_bias is true", "without biases"]),
    ({"projectors_bias": True}, ["projectors_bias is true"]),
    ({"attention_bias": True}, ["attention_bias is true"]),
    ({"time_step_limit": [0.0, 10.0]}, ["time_step_limit", "no limit"]),
    ({"mamba_n_heads": 3}, ["mamba_n_heads (3)", "mamba_d_head (32)", "mamba_d_ssm (128)"]),
    ({"mamba_n_heads": 4, "mamba_n_groups": 3}, ["mamba_n_heads (4)", "multiple of mamba_n_groups (3)"]),
    ({"ssm_multipliers": [1.0, 1.0]}, ["ssm_multipliers", "a list of 5 positive numbers"]),
    ({"key_multiplier": 0}, ["key_multiplier"]),
    ({"mamba_rms_norm": "yes"}, ["mamba_rms_norm", "true or false"]),
])
def test_bad_fields_are_refused_by_name(change, words):
    from llama_ane.config import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny_config(**change)
    for w in words:
        assert w in str(e.value)


def test_granite_4_h_is_refused_by_name():
    from llama_ane.config import ConfigError

    with pytest.raises(ConfigError, match="'granitemoehybrid'.*Granite 4.0-H's Mamba-2 layers"):
        tiny_config(model_type="granitemoehybrid")


def test_a_verify_window_is_refused_by_name():
    """A speculative verify window, which the mixers' states cannot serve, is refused by name."""
    from llama_ane.contract.options import ExportOptions, ExportOptionsError
    from llama_ane.contract.plan import plan_export

    with pytest.raises(ExportOptionsError, match="--verify-window 16.*Mamba-2 layers.*--verify-window 0"):
        plan_export(tiny_config(), ExportOptions(context_length=256, verify_window=16))


@pytest.mark.export
def test_tensors_are_those_transformers_saves(folders):
    """Every tensor an export reads is in the checkpoint FalconH1ForCausalLM saved, of the shape the
    config gives, and nothing else is there."""
    from safetensors import safe_open

    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.checkpoint.mapping import expected_shape, expected_tensors

    for name in ("falcon_h1_tied_gqa", "falcon_h1_no_norm"):
        folder = folders(name)
        ckpt = load_checkpoint(folder)
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        ours = {n: expected_shape(ckpt.config, n, dims) for n, dims in expected_tensors(ckpt.config).items()}
        assert set(ours) == set(stored)
        assert all(stored[n] == shape for n, shape in ours.items())


@pytest.mark.export
@pytest.mark.parametrize("prefill", [8, 32])
def test_windows_then_decoding_leave_each_mixers_states_as_transformers(folders, prefill):
    """Prefill in windows of `prefill` (the last one padded), then decoding: every mixer's recurrent state
    and convolution state, held per chunk, are FalconH1ForCausalLM's after the same tokens."""
    import llama_ane
    from transformers import FalconH1ForCausalLM

    folder = folders("falcon_h1_untied_mha")
    model = llama_ane.load(folder, backend="torch", precision="fp32", context_length=256, prefill_length=prefill,
                           layers_per_chunk=2)
    ref = FalconH1ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = list(range(9, 9 + 45))
    pipeline = windows_then_decoding(model, ids, 40)
    cache = DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(torch.tensor([ids[:40]]), cache=cache, use_cache=True)
        for t in ids[40:]:  # its own decoding steps
            ref(torch.tensor([[t]]), cache=cache, use_cache=True)
    cfg = pipeline.config
    h, n, p = cfg.delta_value_heads, cfg.delta_key_dim, cfg.delta_value_dim
    checked = 0
    for c, chunk in enumerate(pipeline.chunks):
        for j, layer in enumerate(chunk["layers"]):
            state = torch.from_numpy(pipeline.cache.caches[c]["delta"][j]).reshape(h, n, p).transpose(1, 2)
            torch.testing.assert_close(state, cache.get_recurrent_state(layer, state_idx=0)[0], rtol=1e-4, atol=1e-4)
            conv = pipeline.cache.caches[c]["conv"][j, :, 0, -(cfg.conv_kernel - 1):]
            torch.testing.assert_close(torch.from_numpy(conv), cache.get_conv_state(layer, state_idx=0)[0, :, 1:],
                                       rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked == len(cfg.mamba_layers) == cfg.num_hidden_layers
    model.close()


@pytest.mark.parametrize("s", [1, 18, 64])
def test_the_ssd_flops_are_the_programs(s):
    """The device model's flops of the mixers for a window of S tokens are those torch's counter sees ssd run."""
    from torch.utils.flop_counter import FlopCounterMode

    from llama_ane.contract import device_model as dm

    h, gk, n, p = 4, 2, 16, 32
    manifest = {"config": {"delta_key_heads": gk, "mamba_layers": [0, 1]},
                "cache": {"delta": {"heads": h, "key_dim": n, "value_dim": p, "layers": [0, 1]}},
                "chunks": [{"model": "chunk_0"}],
                "models": {"chunk_0": {"functions": {"prefill": {"inputs": [
                    {"name": "hidden_states", "shape": [1, 64, 1, s]}]}}}}}
    with FlopCounterMode(display=False) as counter:
        ssd(torch.randn(gk, 1, n, s), torch.randn(gk, 1, n, s), torch.randn(gk, h // gk, p, s),
            -torch.rand(gk, h // gk, 1, s), torch.randn(gk, h // gk, n, p))
    assert dm.delta_flops(manifest, "prefill") == 2 * counter.get_total_flops()  # two layers


@pytest.mark.export
def test_a_prompt_cache_file_holds_the_states_and_a_rewind_starts_again(folders, tmp_path):
    """A prompt-cache file saves each chunk's states whole: decoding on from the loaded file gives the
    logits of decoding on from the cache it was saved from. The states cannot go back: a rewind
    starts again from position 0."""
    import llama_ane

    model = llama_ane.load(folders("falcon_h1_tied_gqa"), backend="torch", precision="fp32", context_length=64,
                           prefill_length=8, layers_per_chunk=2)
    check_prompt_cache_holds_the_states(model, tmp_path)
    pipeline = model.pipeline
    assert all(c["conv"].any() for c in pipeline.cache.caches)
    assert pipeline.rewind(10) == 0 and pipeline.position == 0
    model.close()


@pytest.fixture(scope="module", params=["state", "inputs"])
def exported(request, folders, tmp_path_factory):
    """One fp16 export of each cache kind, with the cascade's branches."""
    from llama_ane.api import export_model

    out = tmp_path_factory.mktemp("export") / request.param
    return request.param, export_model(folders("falcon_h1_untied_mha"), out, context_length=256, prefill_length=64,
                                       layers_per_chunk=2, kv_cache=request.param, branch_width=4,
                                       suffix_length=64, progress=False, verify=False)


@pytest.mark.export
def test_each_cache_kind_passes_inspect_and_runs_in_mil(exported):
    """inspect --strict finds no ANE rule broken; the mil backend's programs give the torch fp16
    backend's top-1 tokens (>= 0.98) and their decode_branches the tokens of decoding alone; with
    input caches the chunks return the states after the window's real tokens, with state caches
    they write them; the mixers' recurrent states after a padded window and decoding follow torch's."""
    import llama_ane
    from support.checks import check_inspect_strict, check_mil_branches, check_mil_fp16

    kind, out = exported
    check_inspect_strict(out)
    check_mil_fp16(f"falcon_h1_{kind}", out, top1=0.98)
    check_mil_branches(f"falcon_h1_{kind}", out)
    window = llama_ane.load(out, backend="mil").manifest["models"]["chunk_0"]["functions"]["prefill"]
    where = {t["name"]: kind for kind in ("inputs", "states", "outputs") for t in window.get(kind, [])}
    assert where["delta_state"] == where["k_cache"] == ("states" if kind == "state" else "inputs")
    assert ("delta_new" in where) == (kind == "inputs") and where["window_tokens"] == "inputs"
    check_mil_states_follow_torch_fp16(out)
    # the device model reads every layer's states: its K/V besides
    from llama_ane.contract.traffic import state_bytes
    from llama_ane.model.layers.mamba2 import mamba_shape

    manifest = llama_ane.load(out, backend="mil").manifest
    cfg = tiny_config("falcon_h1_untied_mha")
    layers = cfg.num_hidden_layers
    assert manifest["cache"]["delta"]["layers"] == manifest["cache"]["conv"]["layers"] == list(range(layers))
    assert state_bytes(manifest)[1] == layers * mamba_shape(cfg).state_bytes()


@pytest.mark.export
def test_cascade_branches_equal_decoding_alone(folders):
    """Cascade branches (torch fp32), each from a copy of the prefix's states, decode as each branch alone."""
    from support.checks import check_cascade

    check_cascade("falcon_h1_untied_mha", folders("falcon_h1_untied_mha"))

