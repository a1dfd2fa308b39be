"""The command line: export, info and generate on tiny models, and one clear error line for bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import llama_ane
from llama_ane.cli import main
from llama_ane.export.validate import validate_export

from support.cli import assert_one_error_line


def run_cli(*args: str):
    """Invoke the CLI in-process; returns click's Result (stdout and stderr kept apart)."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_nothing_complete(parent: Path, name: str = "out") -> None:
    assert not (parent / name / "manifest.json").exists()
    assert not any(p.name.startswith(f".{name}.partial-") for p in parent.iterdir())


# ---- export: bad input ---------------------------------------------------------------------------------------

def test_export_missing_path(tmp_path):
    r = run_cli("export", tmp_path / "nowhere", "-o", tmp_path / "out", "--no-verify", "--quiet")
    assert_one_error_line(r, "nowhere", "does not exist")
    assert_nothing_complete(tmp_path)


def test_export_folder_without_config(tmp_path):
    src = tmp_path / "empty"
    src.mkdir()
    r = run_cli("export", src, "-o", tmp_path / "out", "--no-verify", "--quiet")
    assert_one_error_line(r, "empty", "no config.json")
    assert_nothing_complete(tmp_path)


def test_export_non_llama_config(tmp_path):
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257, "n_embd": 768,
        "n_layer": 12, "n_head": 12, "n_positions": 1024, "activation_function": "gelu_new"}))
    r = run_cli("export", src, "-o", tmp_path / "out", "--no-verify", "--quiet")
    assert_one_error_line(r, "model_type 'gpt2'", "supported")
    assert_nothing_complete(tmp_path)


def test_export_truncated_safetensors(tiny_checkpoint, tmp_path):
    src = tmp_path / "cut"
    shutil.copytree(tiny_checkpoint(), src)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size * 2 // 3])
    r = run_cli("export", src, "-o", tmp_path / "out", "--no-verify", "--quiet")
    assert_one_error_line(r, "model.safetensors", "truncated")
    assert_nothing_complete(tmp_path)


def test_export_layers_per_chunk_zero(tiny_checkpoint, tmp_path):
    r = run_cli("export", tiny_checkpoint(), "-o", tmp_path / "out", "--layers-per-chunk", "0", "--no-verify", "--quiet")
    assert_one_error_line(r, "--layers-per-chunk", "at least 1")
    assert_nothing_complete(tmp_path)


def test_export_context_not_a_multiple_of_the_prefill_window(tiny_checkpoint, tmp_path):
    r = run_cli("export", tiny_checkpoint(), "-o", tmp_path / "out", "--context-length", "100",
                "--prefill-length", "64", "--no-verify", "--quiet")
    assert_one_error_line(r, "--context-length 100", "multiple", "64")
    assert_nothing_complete(tmp_path)


def test_export_into_an_existing_folder_without_force(tiny_checkpoint, tmp_path):
    (tmp_path / "out").mkdir()
    r = run_cli("export", tiny_checkpoint(), "-o", tmp_path / "out", "--no-verify", "--quiet")
    assert_one_error_line(r, "already exists", "--force")
    assert list((tmp_path / "out").iterdir()) == []


def test_export_unknown_target_is_a_usage_error(tiny_checkpoint, tmp_path):
    r = run_cli("export", tiny_checkpoint(), "-o", tmp_path / "out", "--target", "watchOS9")
    assert r.exit_code == 2 and "watchOS9" in r.stderr
    assert_nothing_complete(tmp_path)


# ---- export: a real tiny run through the installed entry point --------------------------------------------------

@pytest.mark.export
def test_export_tiny_through_the_command(tiny_checkpoint, tmp_path):
    """`python -m llama_ane export` on a 1-layer model: a complete, valid folder, and its time printed.

    --no-verify: the parity gate's top-1 threshold is meant for real models and text; a random tiny
    model has near-tied logits (verification itself is tested on the real model in test_smollm2.py).
    """
    src = tiny_checkpoint(num_hidden_layers=1)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "llama_ane", "export", str(src), "-o", str(out), "--context-length",
                           "64", "--prefill-length", "32", "--quiet", "--no-verify"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"exported .*out in \d+\.\d s", proc.stdout.strip().splitlines()[-1])  # its one closing line
    assert "done in" not in proc.stdout
    m = validate_export(out)
    assert m["context_length"] == 64 and m["prefill_length"] == 32
    assert [c["layers"] for c in m["chunks"]] == [[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial folders beside it


# ---- info ------------------------------------------------------------------------------------------------------

def test_info(tiny_export):
    r = run_cli("info", tiny_export)
    assert r.exit_code == 0, r.stderr
    m = json.loads((tiny_export / "manifest.json").read_text())
    assert m["name"] in r.stdout
    assert "5 layers" in r.stdout and "context   256 tokens" in r.stdout and "prefill window 64" in r.stdout
    assert "chunk_0      layers 0..1" in r.stdout and "chunk_2      layers 4..4" in r.stdout
    assert "sha256 verified" in r.stdout


def test_info_json(tiny_export):
    r = run_cli("info", tiny_export, "--json")
    assert r.exit_code == 0, r.stderr
    got = json.loads(r.stdout)
    traffic = got.pop("decode_step_bytes")
    other = got.pop("decode_step_bytes_other_kv_cache")
    resident = got.pop("resident")  # modelled in test_resident.py
    assert got.pop("resident_bytes") == resident["resident_bytes"] > got.pop("weight_copy_bytes") > 0
    assert got == json.loads((tiny_export / "manifest.json").read_text())
    # 5 layers, 2 kv heads x 32, context 256, fp16: each step reads every K and V cache once, and the
    # cache update reads and writes them again
    cache = 5 * 64 * 256 * 2
    assert traffic["cache_read"] == 2 * cache and traffic["cache_update"] == 4 * cache
    # with the caches in states, the same reads and one column (the new token) written per state
    assert other["kv_cache"] == "state" and other["cache_read"] == 2 * cache
    assert other["cache_update"] == 2 * cache // 256 and other["weights"] == traffic["weights"]
    stepped = [c["model"] for c in got["chunks"]] + got["lm_head"]["models"]
    assert traffic["weights"] == sum(got["weights"][m]["bytes"] for m in stepped) + 64 * 2  # + one embedding row
    assert traffic["total"] == traffic["weights"] + 6 * cache


def test_info_bandwidth_bound(tiny_export):
    m = json.loads((tiny_export / "manifest.json").read_text())
    r = run_cli("info", tiny_export, "--bandwidth", "100", "--json")
    assert r.exit_code == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["bandwidth_bound_tokens_per_s"] == pytest.approx(100e9 / got["decode_step_bytes"]["total"])
    text = run_cli("info", tiny_export, "--bandwidth", "100").stdout
    assert "upper bound" in text and "not a measurement" in text and "MB per token" in text
    assert m["name"] in text
    assert_one_error_line(run_cli("info", tiny_export, "--bandwidth", "0"), "--bandwidth", "positive")


def test_info_on_a_folder_that_is_not_an_export(tiny_checkpoint):
    assert_one_error_line(run_cli("info", tiny_checkpoint()), "not a llama-ane export", "manifest.json")


def test_info_on_a_tampered_export(tiny_export, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_export, copy)
    with open(copy / "tokenizer_config.json", "a") as f:
        f.write("\n")
    assert_one_error_line(run_cli("info", copy), "tokenizer_config.json", "sha256")


# ---- generate ------------------------------------------------------------------------------------------------------

GENERATE_FIELDS = {"text", "token_ids", "backend", "prompt_tokens", "generated_tokens", "finish_reason",
                   "prefill_tokens_per_s", "decode_tokens_per_s"}


def test_generate_json(tiny_export):
    r = run_cli("generate", tiny_export, "--prompt", "The quick brown fox", "--max-new-tokens", "12",
                "--backend", "torch", "--json", "--raw")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert GENERATE_FIELDS <= set(out)
    model = llama_ane.load(tiny_export, backend="torch")
    want = model.generate("The quick brown fox", max_new_tokens=12, raw=True)
    model.close()
    assert out["token_ids"] == want.token_ids and out["text"] == want.text
    assert out["backend"] == "torch"
    assert out["prompt_tokens"] == want.prompt_tokens > 0
    assert out["generated_tokens"] == len(out["token_ids"])
    assert out["finish_reason"] in ("length", "eos")
    assert out["finish_reason"] == "length" or len(out["token_ids"]) < 12
    assert out["prefill_tokens_per_s"] > 0


def test_generate_streams_text_and_reports_speed(tiny_export):
    r = run_cli("generate", tiny_export, "--prompt", "Caches hold", "--max-new-tokens", "8", "--backend", "torch",
                "--temperature", "0.8", "--top-k", "20", "--seed", "3", "--raw")
    assert r.exit_code == 0, r.stderr
    assert re.search(r"\[torch\] prefill: \d+ tokens in [\d.]+ s, [\d.]+ tok/s \| first token after [\d.]+ s\n"
                     r"\[torch\] generated \d+ tokens: \d+ decode steps in [\d.]+ s, .* \| finish: \w+\n"
                     r"\[torch\] load [\d.]+ s \+ warm-up [\d.]+ s \| total [\d.]+ s \| peak memory [\d.]+ GiB", r.stderr), \
        r.stderr
    assert "reused" not in r.stderr  # no cache was given
    model = llama_ane.load(tiny_export, backend="torch")
    want = model.generate("Caches hold", max_new_tokens=8, temperature=0.8, top_k=20, seed=3, raw=True)
    model.close()
    assert r.stdout == want.text + "\n"  # streamed pieces, then one newline


def test_generate_chat_uses_the_template(tiny_export):
    r = run_cli("generate", tiny_export, "--prompt", "hi", "--chat", "--max-new-tokens", "4", "--backend", "torch",
                "--json")
    assert r.exit_code == 0, r.stderr
    model = llama_ane.load(tiny_export, backend="torch")
    assert json.loads(r.stdout)["prompt_tokens"] == len(model.encode("hi", chat=True)) > len(model.encode("hi"))
    model.close()


def test_generate_prompt_longer_than_the_context(tiny_export):
    model = llama_ane.load(tiny_export, backend="torch")
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)
    n = len(model.encode(prompt))
    model.close()
    assert n > 256
    r = run_cli("generate", tiny_export, "--prompt", prompt, "--max-new-tokens", "4", "--backend", "torch", "--raw")
    assert_one_error_line(r, f"{n} tokens do not fit", "context length is 256")


def test_generate_on_a_missing_folder(tmp_path):
    assert_one_error_line(run_cli("generate", tmp_path / "nowhere", "--prompt", "x"), "nowhere", "does not exist")


def test_generate_with_coreml_off_macos(tiny_export):
    import platform

    if platform.system() == "Darwin":
        pytest.skip("Core ML runs on macOS")
    r = run_cli("generate", tiny_export, "--prompt", "x", "--backend", "coreml")
    assert_one_error_line(r, "coreml backend needs macOS")


def test_generate_bad_sampling_option(tmp_path):
    """Refused while the options are read, by flag, before OUT is looked at."""
    r = run_cli("generate", tmp_path, "--prompt", "x", "--backend", "torch", "--top-p", "0")
    assert_one_error_line(r, "--top-p", "(0, 1]")


def test_chat_set_checks_values_as_the_options_do(capsys):
    """The REPL's /set changes a sampling setting with the same checks as its command-line option,
    and a bad value is one message that leaves the setting as it was."""
    from llama_ane.commands.chat import _command

    class FakeChat:
        sampling = {"max_new_tokens": 40, "temperature": 0.0, "top_p": 1.0, "seed": None}

    chat = FakeChat()
    for line in ("/set temperature 0.7", "/set max-new-tokens 100000", "/set top-p 2", "/set seed x",
                 "/set temperature nan", "/set colour blue", "/set"):
        assert _command(chat, line)
    err = capsys.readouterr().err
    assert chat.sampling == {"max_new_tokens": 100000, "temperature": 0.7, "top_p": 1.0, "seed": None}
    assert "--top-p must be in (0, 1], got 2" in err and "'x' is not a valid integer" in err
    assert "--temperature must be a finite number" in err and "/set takes one of max-new-tokens" in err
    assert "max-new-tokens=100000  temperature=0.7" in err


def test_help_lists_the_commands():
    r = run_cli("--help")
    assert r.exit_code == 0
    for name in ("export", "generate", "info"):
        assert name in r.stdout
