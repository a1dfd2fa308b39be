"""The text model of a multimodal checkpoint (Qwen3.5, Gemma 3 4B and up, Gemma 4): its config read
from text_config as transformers' composite config class reads it, its weights under the names of a
text checkpoint from either layout published files have (model.language_model.*, the Hub's Gemma 3
language_model.model.*), the vision and audio towers left out, and a processor's chat template
carried. The checkpoints are tiny random ones written by transformers' own ForConditionalGeneration
classes; their exports are held to those classes on text-only input."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llama_ane.config import ConfigError, LlamaConfig
from llama_ane.testing import CHAT_TEMPLATE, TINY_CONFIG, make_tiny_tokenizer

# The text models (TINY_CONFIG's sizes: hidden 64, 4 query heads, 2 kv heads), each with what its family adds
# (the composite's top level decides the tie, as transformers' does; Gemma names its activation its own way)
TEXT = {k: v for k, v in TINY_CONFIG.items() if k not in ("model_type", "architectures", "tie_word_embeddings")}
GEMMA_TEXT = {k: v for k, v in TEXT.items() if k != "hidden_act"}
TEXT_CONFIGS = {
    "qwen3_5": dict(TEXT, model_type="qwen3_5_text", head_dim=32, num_hidden_layers=4, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
    "gemma3": dict(GEMMA_TEXT, model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh", head_dim=32,
                   query_pre_attn_scalar=24, sliding_window=40, rms_norm_eps=1e-6, num_hidden_layers=4,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    "gemma4": dict(GEMMA_TEXT, model_type="gemma4_text", hidden_activation="gelu_pytorch_tanh", head_dim=32,
                   global_head_dim=32, num_hidden_layers=4, hidden_size_per_layer_input=8,
                   vocab_size_per_layer_input=320, final_logit_softcapping=30.0, rms_norm_eps=1e-6, sliding_window=24,
                   use_bidirectional_attention="vision",  # image tokens both ways; text (all there is here) causal
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
}
# Vision (and Gemma 4's audio) towers as small as their classes allow
TOWERS = {
    "qwen3_5": {"vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                  "patch_size": 4, "out_hidden_size": 64, "num_position_embeddings": 16}},
    "gemma3": {"vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 16,
                                 "patch_size": 4},
               "mm_tokens_per_image": 4},
    "gemma4": {"vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                                 "position_embedding_size": 64, "patch_size": 4},
               "audio_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                "subsampling_conv_channels": [8, 4], "output_proj_dims": 32}},
}
CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration",
           "gemma4": "Gemma4ForConditionalGeneration"}
TIED = {"qwen3_5": False, "gemma3": True, "gemma4": True}  # one untied LM head among them
SEQ = 40  # tokens compared: past Gemma's sliding windows (24, 40)
GREEDY = 16


def make_multimodal_checkpoint(path: Path, family: str, seed: int = 0) -> Path:
    """A tiny random checkpoint of `family`'s ForConditionalGeneration class (text model, vision tower and
    Gemma 4's audio tower), saved by transformers with the tiny tokenizer and its chat template."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = make_tiny_tokenizer(path)
    text = dict(TEXT_CONFIGS[family], vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.AutoConfig.for_model(family, text_config=text, tie_word_embeddings=TIED[family],
                                               initializer_range=0.15, **TOWERS[family])
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[family])(config).eval()
    with torch.no_grad():  # norms away from 1, so they are really exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    # Qwen3.5's in shards with an index, as its published files are
    shards = {"max_shard_size": "200KB"} if family == "qwen3_5" else {}
    model.save_pretrained(str(path), safe_serialization=True, **shards)
    return path


def reference(folder: Path, family: str):
    """The multimodal class of `folder` (transformers' own) in fp32."""
    import transformers

    return getattr(transformers, CLASSES[family]).from_pretrained(str(folder), dtype=torch.float32).eval()


# --- the config (no export) ---------------------------------------------------------------------

# The shape of the Hub's gemma-3-4b-it config.json: a text_config listing only what differs from
# Gemma3TextConfig's defaults, the EOS ids and (by its absence) the tie at the top level
GEMMA3_HUB = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
              "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
              "mm_tokens_per_image": 256,
              "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024},
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                                "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                                "patch_size": 14, "vision_use_head": False}}


def test_a_diff_style_text_config_gets_transformers_defaults_and_the_top_level_ids():
    from transformers import Gemma3TextConfig

    cfg = LlamaConfig.from_hf_dict(GEMMA3_HUB)
    theirs = Gemma3TextConfig(**{k: v for k, v in GEMMA3_HUB["text_config"].items() if k != "model_type"})
    assert cfg.model_type == "gemma3_text"
    assert (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps) == (
        theirs.vocab_size, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim, theirs.rms_norm_eps)
    assert cfg.sliding_layers == [n for n, t in enumerate(theirs.layer_types) if t == "sliding_attention"]
    assert (cfg.sliding_window, cfg.max_position_embeddings) == (1024, theirs.max_position_embeddings)
    assert cfg.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"]
    assert cfg.rope_local_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.attention_scale == theirs.query_pre_attn_scalar ** -0.5
    assert cfg.eos_token_id == [1, 106]  # the top level's, which text_config lacks (its default would be [1])
    assert cfg.bos_token_id == theirs.bos_token_id and cfg.tie_word_embeddings
    # the text config's own ids win over the top level's
    own = dict(GEMMA3_HUB, text_config=dict(GEMMA3_HUB["text_config"], eos_token_id=7))
    assert LlamaConfig.from_hf_dict(own).eos_token_id == [7]


@pytest.mark.parametrize("top, tied", [(True, True), (False, False), (None, False)])
def test_the_tie_is_the_composites(top, tied):
    """Qwen3_5ForConditionalGeneration ties its LM head by the top-level tie_word_embeddings (Qwen3_5Config's
    default, untied, where config.json has none), whatever text_config says."""
    text = dict(TEXT_CONFIGS["qwen3_5"], vocab_size=320, tie_word_embeddings=not tied)
    d = {"model_type": "qwen3_5", "text_config": text, **({} if top is None else {"tie_word_embeddings": top})}
    cfg = LlamaConfig.from_hf_dict(d)
    assert cfg.tie_word_embeddings is tied and cfg.model_type == "qwen3_5_text"
    assert cfg.delta_layers == [0, 2] and cfg.attn_output_gate


@pytest.mark.parametrize("change, words", [
    ({"text_config": None}, ["'gemma3'", "text_config", "null", "'gemma3_text'", "language_model"]),
    ({"text_config": [1, 2]}, ["text_config", "a list"]),
    ({"text_config": dict(GEMMA3_HUB["text_config"], model_type="gemma2")},
     ["text_config.model_type", "'gemma2'", "'gemma3_text'"]),
    ({"text_config": dict(GEMMA3_HUB["text_config"], hidden_size="2560")}, ["text_config", "hidden_size"]),
])
def test_a_multimodal_config_without_a_usable_text_config_is_refused_by_name(change, words):
    with pytest.raises(ConfigError) as e:
        LlamaConfig.from_hf_dict({**GEMMA3_HUB, **change})
    for w in words:
        assert w in str(e.value)


def test_the_manifest_copy_of_the_config_is_the_text_models():
    cfg = LlamaConfig.from_hf_dict(GEMMA3_HUB)
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.to_dict()["model_type"] == "gemma3_text"


def test_the_text_models_tensors_are_renamed_and_the_rest_left_out():
    from llama_ane.checkpoint.loader import text_model_names

    transformers5 = ["model.language_model.embed_tokens.weight", "model.language_model.layers.0.mlp.up_proj.weight",
                     "model.language_model.norm.weight", "lm_head.weight", "model.visual.blocks.0.attn.qkv.weight",
                     "mtp.fc.weight", "mtp.layers.0.mlp.up_proj.weight", "model.audio_tower.layers.0.weight",
                     "model.embed_vision.embedding_projection.weight"]
    assert text_model_names(transformers5) == {
        "model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
        "model.layers.0.mlp.up_proj.weight": "model.language_model.layers.0.mlp.up_proj.weight",
        "model.norm.weight": "model.language_model.norm.weight", "lm_head.weight": "lm_head.weight"}
    hub_gemma3 = ["language_model.model.embed_tokens.weight", "language_model.model.layers.3.self_attn.q_proj.weight",
                  "language_model.lm_head.weight", "vision_tower.vision_model.embeddings.patch_embedding.weight",
                  "multi_modal_projector.mm_input_projection_weight"]
    assert text_model_names(hub_gemma3) == {
        "model.embed_tokens.weight": "language_model.model.embed_tokens.weight",
        "model.layers.3.self_attn.q_proj.weight": "language_model.model.layers.3.self_attn.q_proj.weight",
        "lm_head.weight": "language_model.lm_head.weight"}
    text = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
    assert text_model_names(text) == {n: n for n in text}  # a text checkpoint's names are ours


def test_a_processors_chat_template_is_carried(tmp_path):
    """A multimodal repo's chat template in the processor's chat_template.json (which the tokenizer
    does not read) is written as chat_template.jinja; one of the tokenizer's own is kept as it is."""
    from transformers import AutoTokenizer

    from llama_ane.checkpoint.loader import copy_tokenizer

    src, out = tmp_path / "src", tmp_path / "out"
    out.mkdir()
    make_tiny_tokenizer(src)
    (src / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(str(src)).chat_template is None
    (src / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    files = copy_tokenizer(SimpleNamespace(tokenizer_dir=src), out)
    assert "chat_template.jinja" in files
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == CHAT_TEMPLATE
    (src / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # the tokenizer's own wins
    (out / "chat_template.jinja").unlink()
    copy_tokenizer(SimpleNamespace(tokenizer_dir=src), out)
    assert (out / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"


# --- the checkpoints, exported ------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            made[family] = make_multimodal_checkpoint(tmp_path_factory.mktemp(family), family)
        return made[family]
    return get


@pytest.mark.export
@pytest.mark.parametrize("family", list(CLASSES))
def test_the_checkpoint_loads_as_a_text_checkpoint(checkpoints, family):
    """Every tensor the export reads is found under its text name, none of the towers' is listed,
    and each holds the multimodal model's text tensor."""
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.checkpoint.mapping import expected_tensors

    folder = checkpoints(family)
    assert (folder / "model.safetensors.index.json").is_file() == (family == "qwen3_5")
    ckpt = load_checkpoint(folder)
    assert ckpt.config.model_type == TEXT_CONFIGS[family]["model_type"]
    assert ckpt.config.tie_word_embeddings is TIED[family]
    assert set(expected_tensors(ckpt.config)) <= set(ckpt.tensors)
    assert all(n.startswith(("model.layers.", "model.embed_tokens", "model.norm.", "model.per_layer", "lm_head."))
               for n in ckpt.tensors)
    theirs = reference(folder, family).state_dict()
    for name in expected_tensors(ckpt.config):
        stored = name if name == "lm_head.weight" else "model.language_model." + name.removeprefix("model.")
        torch.testing.assert_close(ckpt.tensor(name).float(), theirs[stored].float(), rtol=0, atol=0)


@pytest.mark.export
def test_both_layouts_load_to_the_same_tensors(checkpoints, tmp_path):
    """transformers saves Gemma 3 in the Hub's layout (language_model.model.*, the towers without
    `model.`); the same tensors in transformers 5's (model.language_model.*, model.vision_tower.*),
    with an untied head in each (language_model.lm_head.*, lm_head.*), load under the same names."""
    import shutil

    from safetensors.torch import load_file, save_file

    from llama_ane.checkpoint.loader import load_checkpoint

    folder = checkpoints("gemma3")
    hub = load_file(str(folder / "model.safetensors"))
    assert any(n.startswith("language_model.model.layers.") for n in hub)
    head = torch.randn(tuple(hub["language_model.model.embed_tokens.weight"].shape))
    layouts = {"hub": {**hub, "language_model.lm_head.weight": head},
               "transformers5": {**{("model.language_model." + n.removeprefix("language_model.model.")
                                     if n.startswith("language_model.model.") else "model." + n): t
                                    for n, t in hub.items()}, "lm_head.weight": head}}
    loaded = {}
    for name, tensors in layouts.items():
        shutil.copytree(folder, tmp_path / name)
        save_file(tensors, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        loaded[name] = load_checkpoint(tmp_path / name)
    ours, theirs = loaded["hub"], loaded["transformers5"]
    assert set(ours.tensors) == set(theirs.tensors) and "lm_head.weight" in ours.tensors
    assert not any("vision" in n or "projector" in n for n in ours.tensors)
    for name in ours.tensors:
        assert theirs.tensors[name] == ours.tensors[name]
        torch.testing.assert_close(theirs.tensor(name), ours.tensor(name), rtol=0, atol=0)
    embeddings = hub["language_model.model.embed_tokens.weight"]
    torch.testing.assert_close(ours.tensor("model.embed_tokens.weight"), embeddings)
    torch.testing.assert_close(ours.rows("lm_head.weight", 3, 9), head[3:9])
    torch.testing.assert_close(theirs.rows("lm_head.weight", 3, 9), head[3:9])


@pytest.fixture(scope="module")
def exports(checkpoints, tmp_path_factory):
    from llama_ane.api import export_model

    made = {}

    def get(family):
        if family not in made:
            made[family] = export_model(checkpoints(family), tmp_path_factory.mktemp("export") / family,
                                        context_length=256, prefill_length=32, layers_per_chunk=2, progress=False,
                                        verify=family == "gemma3")  # one export passes the parity gate
        return made[family]
    return get


@pytest.mark.export
@pytest.mark.parametrize("family", list(CLASSES))
def test_the_export_follows_the_multimodal_class_on_text(checkpoints, exports, family):
    """The export of each family's multimodal checkpoint: its manifest records the text model, the
    folder and the chat template, and its modules run by the torch backend in fp32 give the
    multimodal class's logits (within 1e-3) on text-only input, and its greedy tokens."""
    import llama_ane
    from llama_ane.contract.manifest import read_manifest

    from support.parity import MAX_LOGIT_DIFF, assert_same_greedy, random_ids, reference_greedy, reference_logits

    folder, out = checkpoints(family), exports(family)
    manifest = read_manifest(out)
    assert manifest["config"]["model_type"] == TEXT_CONFIGS[family]["model_type"]
    assert manifest["source"] == {"kind": "hf", "path": str(folder.resolve())}
    assert manifest["tokenizer"]["chat_template"] == CHAT_TEMPLATE
    ref = reference(folder, family)
    # the export's torch modules in fp32, on the weights the export read (an export folder would round them to fp16)
    model = llama_ane.load(folder, backend="torch", precision="fp32", context_length=256, prefill_length=32,
                           layers_per_chunk=2)
    ids = random_ids(300, SEQ, seed=1)
    got, want = model.score(ids), reference_logits(ref, ids)
    assert got.shape == want.shape
    diff = float(np.abs(got - want).max())
    print(f"{family}: max |logit diff| = {diff:.2e} (logits up to {np.abs(want).max():.1f})")
    assert diff <= MAX_LOGIT_DIFF and np.abs(want).max() > 1.0
    prompt = random_ids(300, 12, seed=2)
    out_ids = model.generate(prompt, max_new_tokens=GREEDY, temperature=0.0)
    assert_same_greedy(out_ids, reference_greedy(ref, prompt, GREEDY), model.eos_token_ids)
    model.close()


@pytest.mark.export
def test_the_mil_program_follows_torch_fp16(exports):
    """The Gemma 3 export's programs (mil, fp16) pick torch fp16's top-1 token on real text."""
    from support.checks import check_mil_fp16

    check_mil_fp16("gemma3", exports("gemma3"), top1=0.98)
