"""A new user's first hour with the command line: the chat template by default, honest statistics,
prompts from stdin, context shift, prompt caches that say how they were wrapped, quiet output and a
fast `--help`."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import llama_ane
from llama_ane.cli import main
from llama_ane.runtime.chat import prompt_ids
from llama_ane.runtime.model import LlamaANEModel


def run_cli(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input, catch_exceptions=False)


def one_error(result, *words):
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.fixture(scope="module")
def model(tiny_export):
    m = llama_ane.load(tiny_export, backend="torch")
    yield m
    m.close()


@pytest.fixture
def no_eos(monkeypatch):
    monkeypatch.setattr(LlamaANEModel, "eos_token_ids", property(lambda self: []))


def generate_json(export, *args, input=None):
    r = run_cli("generate", export, "--backend", "torch", "--json", *args, input=input)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


# ---- the chat template by default --------------------------------------------------------------------------------

def test_generate_wraps_the_prompt_in_the_chat_template_by_default(tiny_export, model):
    out = generate_json(tiny_export, "--prompt", "What is a cache?", "--max-new-tokens", "3")
    assert out["chat_template"] is True
    assert out["prompt_tokens"] == len(model.encode("What is a cache?", chat=True))
    assert out["token_ids"] == model.generate(model.encode("What is a cache?", chat=True), max_new_tokens=3).token_ids
    raw = generate_json(tiny_export, "--prompt", "What is a cache?", "--max-new-tokens", "3", "--raw")
    assert raw["chat_template"] is False and raw["prompt_tokens"] == len(model.encode("What is a cache?"))
    alias = generate_json(tiny_export, "--prompt", "What is a cache?", "--max-new-tokens", "3", "--chat")
    assert alias["token_ids"] == out["token_ids"]


def test_system_prompt_on_generate(tiny_export, model):
    out = generate_json(tiny_export, "--prompt", "Hi", "--system", "Be terse.", "--max-new-tokens", "2")
    assert out["prompt_tokens"] == len(prompt_ids(model, "Hi", "Be terse.")) > len(model.encode("Hi", chat=True))
    one_error(run_cli("generate", tiny_export, "--prompt", "Hi", "--system", "x", "--raw"), "--system", "--raw")


def test_an_empty_reply_at_eos_prints_a_hint(tiny_export, monkeypatch):
    monkeypatch.setattr(LlamaANEModel, "eos_token_ids", property(lambda self: list(range(400))))
    r = run_cli("generate", tiny_export, "--prompt", "Hi", "--backend", "torch")
    assert r.exit_code == 0 and "ended its reply at once" in r.stderr and "--raw" in r.stderr


# ---- honest statistics -------------------------------------------------------------------------------------------

def test_max_new_tokens_8_reports_8_generated_tokens(tiny_export, no_eos):
    out = generate_json(tiny_export, "--prompt", "Caches", "--max-new-tokens", "8")
    assert out["generated_tokens"] == len(out["token_ids"]) == 8
    assert out["decode_steps"] == 7  # the first token came from the prompt's logits
    assert out["finish_reason"] == "length"
    assert "reused_tokens" not in out  # no cache was given
    assert 0 < out["prefill_seconds"] <= out["first_token_seconds"] <= out["total_seconds"]
    assert out["load_seconds"] > 0 and out["warmup_seconds"] > 0 and out["peak_memory_bytes"] > 2**20
    r = run_cli("generate", tiny_export, "--prompt", "Caches", "--max-new-tokens", "8", "--backend", "torch")
    assert "generated 8 tokens: 7 decode steps" in r.stderr and "reused" not in r.stderr


def test_the_warm_up_is_kept_out_of_the_prefill(tiny_export, monkeypatch):
    """The first call of a function is slow on a real backend; the warm-up takes it, not the prompt."""
    from llama_ane.runtime.pipeline import Pipeline

    calls = []
    real = Pipeline.run_window

    def counting(self, ids):
        calls.append(len(ids))
        return real(self, ids)
    monkeypatch.setattr(Pipeline, "run_window", counting)
    generate_json(tiny_export, "--prompt", "Caches", "--max-new-tokens", "2", "--raw")
    assert calls[:2] == [2, 1]  # the warm-up ran prefill and decode once before the prompt


# ---- prompts: stdin, shift, default stop -------------------------------------------------------------------------

def test_prompt_file_dash_reads_stdin(tiny_export, model):
    out = generate_json(tiny_export, "--prompt-file", "-", "--raw", "--max-new-tokens", "2", input="The lazy dog")
    assert out["prompt_tokens"] == len(model.encode("The lazy dog"))
    r = run_cli("generate", tiny_export, "--prompt-file", "-", "--backend", "torch", input=b"caf\xe9")
    one_error(r, "--prompt-file", "not UTF-8")


def test_overflow_shift_takes_a_prompt_longer_than_the_context(tiny_export, model, no_eos):
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)
    assert len(model.encode(prompt)) > 256
    out = generate_json(tiny_export, "--prompt", prompt, "--raw", "--overflow", "shift", "--keep", "4",
                        "--max-new-tokens", "3")
    assert out["generated_tokens"] == 3 and out["context_shifts"] >= 1 and out["prompt_tokens"] <= 256
    one_error(run_cli("generate", tiny_export, "--prompt", "x", "--keep", "3"), "--keep", "--overflow shift")


def test_raw_document_questions_stop_at_a_blank_line_by_default(tiny_export, monkeypatch):
    seen = []
    real = LlamaANEModel.generate_branches

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("stop"))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(LlamaANEModel, "generate_branches", spy)
    generate_json(tiny_export, "--prompt", "A doc.", "--question", "What?", "--raw", "--max-new-tokens", "2")
    generate_json(tiny_export, "--prompt", "A doc.", "--question", "What?", "--raw", "--stop", ".",
                  "--max-new-tokens", "2")
    generate_json(tiny_export, "--prompt", "A doc.", "--question", "What?", "--max-new-tokens", "2")
    assert seen == [["\n\n"], ["."], []]  # the chat template's end-of-turn token ends an answer itself


# ---- prompt caches remember how their text was wrapped -----------------------------------------------------------

def test_a_prompt_cache_made_with_the_template_is_not_reused_raw(tiny_export, tmp_path):
    cache = tmp_path / "doc.npz"
    first = generate_json(tiny_export, "--prompt", "A document.", "--prompt-cache", cache, "--max-new-tokens", "2")
    assert first["reused_tokens"] == 0
    saved = cache.read_bytes()
    one_error(run_cli("generate", tiny_export, "--prompt", "A document.", "--prompt-cache", cache, "--raw",
                      "--backend", "torch"), str(cache), "chat template", "drop --raw")
    assert cache.read_bytes() == saved  # not overwritten
    again = generate_json(tiny_export, "--prompt", "A document.", "--prompt-cache", cache, "--max-new-tokens", "2")
    assert again["reused_tokens"] >= first["prompt_tokens"] - 1


@pytest.mark.filterwarnings("ignore:Duplicate name")  # the bad messages array replaces the good one
def test_the_wrapping_and_messages_round_trip_in_a_cache_file(model, tmp_path):
    from llama_ane.runtime.kv_cache import PromptCacheError

    cache = model.make_cache()
    model.generate([5, 6, 7], max_new_tokens=2, cache=cache)
    cache.wrapping, cache.messages = "chat", [{"role": "user", "content": "hé"}]
    model.save_cache(cache, tmp_path / "c.npz")
    back = model.load_cache(tmp_path / "c.npz")
    assert (back.wrapping, back.messages, back.tokens) == ("chat", cache.messages, cache.tokens)
    cache.wrapping, cache.messages = None, None
    model.save_cache(cache, tmp_path / "old.npz")
    back = model.load_cache(tmp_path / "old.npz")
    assert back.wrapping is None and back.messages is None
    # messages that are not {role, content} texts are refused by name
    import zipfile
    with zipfile.ZipFile(tmp_path / "c.npz", "a") as z:
        buf = __import__("io").BytesIO()
        np.save(buf, np.frombuffer(json.dumps([{"role": 1}]).encode(), np.uint8))
        z.writestr("messages.npy", buf.getvalue())
    with pytest.raises(PromptCacheError, match="messages"):
        model.load_cache(tmp_path / "c.npz")


# ---- sampling options on the command line ------------------------------------------------------------------------

def test_min_p_and_repetition_penalty_options(tiny_export, model, no_eos):
    out = generate_json(tiny_export, "--prompt", "fox fox fox", "--raw", "--repetition-penalty", "2.5",
                        "--max-new-tokens", "4")
    assert out["token_ids"] == model.generate("fox fox fox", max_new_tokens=4, repetition_penalty=2.5, raw=True).token_ids
    out = generate_json(tiny_export, "--prompt", "fox", "--raw", "--min-p", "0.3", "--temperature", "1",
                        "--seed", "4", "--max-new-tokens", "4")
    assert out["token_ids"] == model.generate("fox", max_new_tokens=4, min_p=0.3, temperature=1.0, seed=4, raw=True).token_ids
    one_error(run_cli("generate", tiny_export, "--prompt", "x", "--min-p", "1.5"), "--min-p", "[0, 1]")
    one_error(run_cli("generate", tiny_export, "--prompt", "x", "--repetition-penalty", "0"),
              "--repetition-penalty", "positive")


# ---- quiet and fast ------------------------------------------------------------------------------------------------

def test_only_the_known_harmless_coremltools_messages_are_dropped():
    from llama_ane._quiet import quiet_coremltools

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    handler = Keep()
    logging.getLogger("coremltools").addHandler(handler)
    try:
        quiet_coremltools()
        logging.getLogger("coremltools.models.model").warning(
            "Failed to load _MLModelProxy: No module named 'coremltools.libcoremlpython'")
        logging.getLogger("coremltools").warning("Torch version 2.13.0 has not been tested with coremltools. ...")
        logging.getLogger("coremltools").warning("a conversion warning that matters")
        assert records == ["a conversion warning that matters"]
        quiet_coremltools(False)
        logging.getLogger("coremltools.models.model").warning("Failed to load _MLModelProxy: No module named "
                                                             "'coremltools.libcoremlpython'")
        assert len(records) == 2
    finally:
        logging.getLogger("coremltools").removeHandler(handler)
        quiet_coremltools(False)


HEAVY = ("torch", "coremltools", "transformers")
PROBE = """
import sys
from llama_ane.cli import main
for argv in {argvs!r}:
    try:
        main(argv, standalone_mode=False)
    except BaseException as e:
        print(type(e).__name__, file=sys.stderr)
print(sorted(m for m in {heavy!r} if m in sys.modules))
"""


@pytest.mark.export
@pytest.mark.parametrize("argvs", [
    [["--help"]],
    [["generate", "nowhere", "--prompt", "x", "--top-p", "2"]],
    [["chat", "nowhere", "--temperature", "-1"]],
    [["export", "-o", "x", "--max-memory", "0"]],
], ids=["help", "generate-bad-option", "chat-bad-option", "export-bad-option"])
def test_help_and_bad_options_import_no_heavy_library(argvs):
    proc = subprocess.run([sys.executable, "-c", PROBE.format(argvs=argvs, heavy=HEAVY)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr


@pytest.mark.export
def test_the_command_line_hides_coremltools_import_noise_unless_verbose(tiny_export):
    def run(*flags):
        return subprocess.run([sys.executable, "-m", "llama_ane", *flags, "inspect", str(tiny_export)],
                              capture_output=True, text=True, timeout=300)
    quiet, verbose = run(), run("-v")
    assert quiet.returncode == 0 and verbose.returncode == 0, quiet.stderr
    assert "Failed to load _MLModelProxy" not in quiet.stderr and "has not been tested" not in quiet.stderr
    assert "Failed to load _MLModelProxy" in verbose.stderr
