"""Checkpoints are untrusted input: a damaged or mismatched config.json, safetensors header, index,
GGUF or tokenizer is refused before any conversion, and NaN/inf weights while they are streamed.

Each case exports through the command line (in process, with its own temporary directory) and must
end with a non-zero exit, exactly one `Error:` line naming the problem, no traceback, no output
folder that looks complete and nothing left in the temporary directory. The refusals before
conversion take a fraction of a second each; the cases that convert are marked `export`.
"""

from __future__ import annotations

import errno
import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from llama_ane.checkpoint.loader import CheckpointError, copy_tokenizer, load_checkpoint
from llama_ane.cli import main

LAYER0 = "model.layers.0."
EXPORT_ARGS = ["--context-length", "64", "--prefill-length", "32", "--no-verify", "--quiet", "--workers", "1"]


# -- building damaged checkpoints ---------------------------------------------------------------

def edit_config(change: Callable[[dict], object]) -> Callable[[Path], None]:
    """A case that passes config.json through `change` (which edits it in place or returns a new value)."""
    def apply(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        new = change(cfg)
        (folder / "config.json").write_text(json.dumps(cfg if new is None else new))
    return apply


def edit_state(change: Callable[[dict], None]) -> Callable[[Path], None]:
    """A case that rewrites model.safetensors after `change` edited its tensors."""
    def apply(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        state = load_file(str(folder / "model.safetensors"))
        change(state)
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return apply


def read_raw(file: Path) -> tuple[dict, bytes]:
    """A safetensors file's header and its data bytes."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(file: Path, header: object, data: bytes) -> None:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(h)) + h + data)


def edit_header(change: Callable[[dict], object]) -> Callable[[Path], None]:
    """A case that edits model.safetensors' JSON header (the data is kept as it is)."""
    def apply(folder: Path) -> None:
        file = folder / "model.safetensors"
        header, data = read_raw(file)
        new = change(header)
        write_raw(file, header if new is None else new, data)
    return apply


def set_entry(name: str, **fields) -> Callable[[dict], None]:
    def change(header: dict) -> None:
        for key, value in fields.items():
            if value is None:
                del header[name][key]
            else:
                header[name][key] = value
    return change


def sharded(change: Callable[[Path, dict], object] | None = None) -> Callable[[Path], None]:
    """A case that splits the weights into two shards with an index, then lets `change(folder, index)`
    damage them (it edits the index in place or returns the text to write instead)."""
    def apply(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        state = load_file(str(folder / "model.safetensors"))
        (folder / "model.safetensors").unlink()
        names = sorted(state)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, keys in shards.items():
            save_file({k: state[k] for k in keys}, str(folder / file))
        index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
        new = change(folder, index) if change else None
        (folder / "model.safetensors.index.json").write_text(new if isinstance(new, str) else json.dumps(index))
    return apply


def shard_of(index: dict, name: str) -> str:
    return index["weight_map"][name]


def write_file(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


def remove(*names: str) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        for name in names:
            (folder / name).unlink()
    return apply


def shard_to_directory(folder: Path, index: dict) -> None:
    shard = folder / shard_of(index, LAYER0 + "mlp.up_proj.weight")
    shard.unlink()
    shard.mkdir()


def tensor_in_wrong_shard(folder: Path, index: dict) -> None:
    name = LAYER0 + "self_attn.q_proj.weight"
    index["weight_map"][name] = next(f for f in set(index["weight_map"].values()) if f != shard_of(index, name))


def llama3_without_factor(cfg: dict) -> None:
    cfg["rope_scaling"] = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}


def no_head_dim(hidden: int, heads: int, kv_heads: int) -> Callable[[dict], None]:
    def change(cfg: dict) -> None:
        cfg.pop("head_dim", None)
        cfg.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads)
    return change


# name -> (how the checkpoint is damaged, words the Error: line must hold)
CASES: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    # config.json: types, ranges, divisibility
    "config: hidden_size a string": (edit_config(lambda c: c.update(hidden_size="64")),
                                     ["hidden_size", "string", "positive integer"]),
    "config: vocab_size a float": (edit_config(lambda c: c.update(vocab_size=320.5)), ["vocab_size", "320.5"]),
    "config: negative num_hidden_layers": (edit_config(lambda c: c.update(num_hidden_layers=-2)),
                                           ["num_hidden_layers", "-2", "positive integer"]),
    "config: rope_theta a string": (edit_config(lambda c: c.update(rope_theta="1e4")),
                                    ["rope_theta", "'1e4'", "positive number"]),
    "config: tie_word_embeddings a string": (edit_config(lambda c: c.update(tie_word_embeddings="false")),
                                             ["tie_word_embeddings", "true or false"]),
    "config: rope_scaling a list": (edit_config(lambda c: c.update(rope_scaling=[8.0])),
                                    ["rope_scaling", "a list", "object"]),
    "config: llama3 rope_scaling without factor": (edit_config(llama3_without_factor), ["rope_scaling", "factor"]),
    "config: the whole file a list": (edit_config(lambda c: [c]), ["config.json", "JSON object"]),
    "config: heads do not divide hidden_size": (edit_config(no_head_dim(64, 6, 2)),
                                                ["hidden_size (64)", "num_attention_heads (6)", "head_dim"]),
    "config: kv heads do not divide heads": (edit_config(lambda c: c.update(num_key_value_heads=3)),
                                             ["num_key_value_heads", "multiple"]),
    "config: eos_token_id outside the vocabulary": (edit_config(lambda c: c.update(eos_token_id=5000)),
                                                    ["eos_token_id 5000", "vocab_size"]),
    "config: eos_token_id a string": (edit_config(lambda c: c.update(eos_token_id="</s>")), ["eos_token_id", "the string", "token id"]),
    # tensors against the config, from the headers
    "tensor: projection of the wrong shape": (
        edit_state(lambda s: s.update({LAYER0 + "self_attn.q_proj.weight": s[LAYER0 + "self_attn.q_proj.weight"][:32]})),
        [LAYER0 + "self_attn.q_proj.weight", "[32, 64]", "[64, 64]", "num_attention_heads*head_dim"]),
    "tensor: config with another hidden_size": (edit_config(lambda c: c.update(hidden_size=128)),
                                                ["model.embed_tokens.weight", "[320, 64]", "[320, 128]"]),
    "tensor: integer projection": (
        edit_state(lambda s: s.update({LAYER0 + "mlp.up_proj.weight": s[LAYER0 + "mlp.up_proj.weight"].to(torch.int8)})),
        [LAYER0 + "mlp.up_proj.weight", "I8", "F32, F16 or BF16"]),
    "tensor: lm_head missing while untied": (edit_state(lambda s: s.pop("lm_head.weight")),
                                             ["lm_head.weight", "tie_word_embeddings"]),
    "tensor: a layer the config does not have": (
        edit_state(lambda s: s.update({"model.layers.7.mlp.up_proj.weight": s[LAYER0 + "mlp.up_proj.weight"].clone()})),
        ["layer 7", "num_hidden_layers"]),
    # safetensors headers
    "header: not JSON": (lambda f: write_raw(f / "model.safetensors", b"{not json", read_raw(f / "model.safetensors")[1]),
                         ["model.safetensors", "not a readable safetensors"]),
    "header: a JSON list": (edit_header(lambda h: [h]), ["model.safetensors", "not a JSON object"]),
    "header: entry without data_offsets": (edit_header(set_entry("model.norm.weight", data_offsets=None)),
                                           ["'model.norm.weight'", "data_offsets"]),
    "header: offsets of the wrong type": (edit_header(set_entry("model.norm.weight", data_offsets=["0", "256"])),
                                          ["'model.norm.weight'", "data_offsets"]),
    "header: shape that does not fit its bytes": (edit_header(set_entry("model.norm.weight", shape=[65])),
                                                  ["'model.norm.weight'", "bytes"]),
    "header: entry not an object": (edit_header(set_entry("model.norm.weight", dtype=7)),
                                    ["'model.norm.weight'", "dtype"]),
    "weights: model.safetensors a folder": (lambda f: (remove("model.safetensors")(f), (f / "model.safetensors").mkdir()),
                                            ["model.safetensors", "not a file"]),
    # sharded checkpoints and their index
    "index: not JSON": (sharded(lambda f, i: "{oops"), ["model.safetensors.index.json", "not valid JSON"]),
    "index: weight_map a list": (sharded(lambda f, i: i.update(weight_map=list(i["weight_map"]))),
                                 ["weight_map", "list"]),
    "index: no weight_map": (sharded(lambda f, i: i.pop("weight_map")), ["no weight_map"]),
    "index: a shard that lacks the tensor": (sharded(tensor_in_wrong_shard),
                                             [LAYER0 + "self_attn.q_proj.weight", "does not hold it"]),
    "index: a shard that is a folder": (sharded(shard_to_directory), ["not a file"]),
    "index: a shard outside the folder": (
        sharded(lambda f, i: i["weight_map"].update({"model.norm.weight": "../elsewhere.safetensors"})),
        ["../elsewhere.safetensors", "not a file inside"]),
    # the tokenizer, against the weights
    "tokenizer: tokenizer.json not JSON": (write_file("tokenizer.json", "garbage"), ["tokenizer.json", "JSON"]),
    "tokenizer: tokenizer.json no tokenizer": (write_file("tokenizer.json", '{"version": "1.0"}'),
                                               ["tokenizer", "cannot be loaded"]),
    "tokenizer: no tokenizer files": (remove("tokenizer.json"), ["no tokenizer.json or tokenizer.model"]),
    "tokenizer: generation_config.json garbage": (write_file("generation_config.json", '{"eos_token_id": "x"}'),
                                                  ["generation_config.json", "eos_token_id"]),
    "tokenizer: generation eos outside the vocabulary": (write_file("generation_config.json", '{"eos_token_id": [2, 999]}'),
                                                         ["generation_config.json", "999"]),
}


@pytest.fixture(scope="module")
def base(tiny_checkpoint) -> Path:
    return tiny_checkpoint(num_hidden_layers=1)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """A temporary directory of this test's own, so what an export leaves there can be seen."""
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def export(source: Path, out: Path, *extra: str):
    return CliRunner().invoke(main, ["export", str(source), "-o", str(out), *EXPORT_ARGS, *extra])


def assert_refused(result, words: list[str], out: Path, tmpdir: Path) -> str:
    """Non-zero exit, one Error: line holding `words`, no traceback, no OUT, nothing in `tmpdir`."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    for word in words:
        assert word in errors[0], (word, errors[0])
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")] == []
    assert list(tmpdir.iterdir()) == []
    return errors[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_checkpoint_is_refused_before_conversion(case, base, tmp_path, private_tmp, monkeypatch):
    damage, words = CASES[case]
    folder = tmp_path / "ckpt"
    shutil.copytree(base, folder)
    damage(folder)

    def no_conversion(*args, **kwargs):
        raise AssertionError("conversion started")
    monkeypatch.setattr("llama_ane.export.convert.convert_all", no_conversion)
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    assert_refused(export(folder, out), words, out, private_tmp)


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tiny_checkpoint, tmp_path, private_tmp):
    folder = tiny_checkpoint(num_hidden_layers=1, vocab_size=200)  # weights of 200 rows, a tokenizer of 320
    out = tmp_path / "out"
    assert_refused(export(folder, out), ["tokenizer", "id 319", "vocab_size is 200"], out, private_tmp)


def test_a_gguf_without_tokenizer_metadata_is_refused(tmp_path, private_tmp):
    pytest.importorskip("gguf")
    from support.gguf import write_tiny

    path = tmp_path / "notok.gguf"
    write_tiny(path)  # a complete llama GGUF whose metadata has no tokenizer.ggml.* keys
    out = tmp_path / "out"
    assert_refused(export(path, out), ["notok.gguf", "no tokenizer", "tokenizer.ggml.tokens"], out, private_tmp)


# -- the config alone ---------------------------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    ({"max_position_embeddings": 0}, ["max_position_embeddings", "positive integer"]),
    ({"rms_norm_eps": -1e-5}, ["rms_norm_eps", "positive number"]),
    ({"rope_theta": True}, ["rope_theta", "boolean"]),
    ({"attention_bias": "yes"}, ["attention_bias", "true or false"]),
    ({"rope_parameters": "default"}, ["rope_parameters", "object"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, ["rope_scaling", "factor", "positive number"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     ["high_freq_factor", "low_freq_factor"]),
    ({"eos_token_id": [2, "x"]}, ["eos_token_id", "list of token ids"]),
    ({"bos_token_id": -1}, ["bos_token_id", ">= 0"]),
    ({"head_dim": 0}, ["head_dim", "positive integer"]),
    ({"model_type": "mistral", "sliding_window": "4096"}, ["sliding_window"]),
])
def test_config_fields_are_checked_by_type_and_range(change, words):
    from llama_ane.config import ConfigError, LlamaConfig
    from llama_ane.testing import TINY_CONFIG

    with pytest.raises(ConfigError) as e:
        LlamaConfig.from_hf_dict(dict(TINY_CONFIG, vocab_size=320, **change), origin="x/config.json")
    assert "\n" not in str(e.value)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_a_good_config_still_reads_with_nulls_for_optional_fields():
    from llama_ane.config import LlamaConfig
    from llama_ane.testing import TINY_CONFIG

    cfg = LlamaConfig.from_hf_dict(dict(TINY_CONFIG, vocab_size=320, head_dim=None, num_key_value_heads=None,
                                        rope_scaling=None, bos_token_id=None, sliding_window=None))
    assert (cfg.head_dim, cfg.num_key_value_heads) == (16, 4)


# -- the tokenizer copy on a full disk --------------------------------------------------------

def full_disk_after(limit: int):
    """A stand-in for shutil.copyfile that writes part of a file and then fails with ENOSPC once
    `limit` files have been started, as a disk that fills mid-copy does."""
    started = []

    def copyfile(src, dst, *args, **kwargs):
        started.append(dst)
        if len(started) > limit:
            Path(dst).write_bytes(Path(src).read_bytes()[:10])
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return shutil.copy2(src, dst)
    return copyfile


def test_a_full_disk_while_the_tokenizer_is_copied_leaves_no_tokenizer(base, tmp_path, monkeypatch):
    monkeypatch.setattr("llama_ane.checkpoint.loader.shutil.copyfile", full_disk_after(1))
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(CheckpointError, match="disk is full") as e:
        copy_tokenizer(load_checkpoint(base), dest)
    assert "tokenizer" in str(e.value) and str(dest) in str(e.value)
    assert list(dest.iterdir()) == []  # neither the file copied whole nor the one cut short


@pytest.mark.export
def test_export_onto_a_full_disk_is_one_error_and_leaves_nothing(base, tmp_path, private_tmp, monkeypatch):
    monkeypatch.setattr("llama_ane.checkpoint.loader.shutil.copyfile", full_disk_after(0))
    out = tmp_path / "out"
    assert_refused(export(base, out), ["tokenizer", "disk is full"], out, private_tmp)


# -- NaN and infinite weights, found while they are streamed -------------------------------------

def poisoned(base: Path, folder: Path, name: str, value: float) -> Path:
    shutil.copytree(base, folder)
    edit_state(lambda s: s[name].view(-1).__setitem__(5, value))(folder)
    return folder


@pytest.mark.parametrize("value, dtype, words", [
    (float("nan"), np.float16, ["NaN"]),
    (float("inf"), np.float32, ["infinite"]),
    (1e6, np.float16, ["float16", "--precision fp32"]),  # finite in the checkpoint, not in fp16
])
def test_package_weights_refuse_values_that_are_not_finite(base, tmp_path, value, dtype, words):
    from llama_ane.export.package_weights import PackageWeights

    name = LAYER0 + "mlp.down_proj.weight"
    ckpt = load_checkpoint(poisoned(base, tmp_path / "ckpt", name, value))
    weights = PackageWeights(ckpt, dtype, [0])
    assert weights("layers.0.mlp.up_proj.weight").dtype == dtype  # its neighbours read as before
    with pytest.raises(CheckpointError) as e:
        weights("layers.0.mlp.down_proj.weight")
    for word in [repr(name), *words]:
        assert word in str(e.value), (word, str(e.value))


def test_nan_in_the_embedding_rows_is_named(base, tmp_path):
    from llama_ane.export.package_weights import PackageWeights

    ckpt = load_checkpoint(poisoned(base, tmp_path / "ckpt", "model.embed_tokens.weight", float("nan")))
    with pytest.raises(CheckpointError, match="'model.embed_tokens.weight' holds NaN"):
        PackageWeights(ckpt, np.float16, rows=(0, 64))("embed_tokens.weight")


@pytest.mark.export
def test_export_without_verify_refuses_nan_weights(base, tmp_path, private_tmp):
    name = LAYER0 + "self_attn.v_proj.weight"
    folder = poisoned(base, tmp_path / "ckpt", name, float("nan"))
    out = tmp_path / "out"
    assert_refused(export(folder, out), [name, "NaN"], out, private_tmp)


# -- the same through the real command line, in a process of its own ---------------------------

@pytest.mark.export
@pytest.mark.parametrize("case", ["tokenizer: tokenizer.json not JSON", "tensor: integer projection"])
def test_refusals_through_the_command_line(case, base, tmp_path):
    from support.cli import assert_clear_error, assert_nothing_left_looking_complete, run_cli

    damage, words = CASES[case]
    folder = tmp_path / "ckpt"
    shutil.copytree(base, folder)
    damage(folder)
    proc = run_cli(["export", folder, "-o", tmp_path / "out", *EXPORT_ARGS], tmp_path / "tmpdir")
    assert_clear_error(proc, words, 1)
    assert proc.stdout == ""  # refused before the plan is printed
    assert_nothing_left_looking_complete(tmp_path)
    assert list((tmp_path / "tmpdir").iterdir()) == []


@pytest.mark.export
def test_nan_weights_through_the_command_line(base, tmp_path):
    from support.cli import assert_clear_error, assert_nothing_left_looking_complete, run_cli

    name = LAYER0 + "mlp.gate_proj.weight"
    folder = poisoned(base, tmp_path / "ckpt", name, float("inf"))
    proc = run_cli(["export", folder, "-o", tmp_path / "out", *EXPORT_ARGS], tmp_path / "tmpdir")
    assert_clear_error(proc, [name, "infinite"], 1)
    assert_nothing_left_looking_complete(tmp_path)
    assert list((tmp_path / "tmpdir").iterdir()) == []
