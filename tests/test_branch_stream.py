"""`generate` on the command line: cascade branches stream as they decode, a prompt over the context
names --overflow shift, and --speculative is checked from the manifest before the model loads."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from llama_ane.cli import main
from llama_ane.runtime.model import LlamaANEModel

pytestmark = pytest.mark.export  # runs the tiny export end to end


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert result.exit_code != 0 and "Traceback" not in result.output and len(lines) == 1, result.output
    return lines[0]


def test_document_questions_stream_each_branch_while_decoding(tiny_export, monkeypatch):
    """Each branch's first text is printed, tagged with its number, before the last decode step;
    the branches' lines interleave, and the statistics come after them all."""
    import click

    from llama_ane.commands import generate
    from llama_ane.runtime.cascade import CascadeDecoder

    monkeypatch.setattr(LlamaANEModel, "eos_token_ids", property(lambda self: []))
    monkeypatch.setattr(generate, "STREAM_WIDTH", 1)  # every piece of text goes out as it comes
    events = []
    real_step, real_echo = CascadeDecoder.step, click.echo

    def step(self, *args, **kwargs):
        events.append(("step", None))
        return real_step(self, *args, **kwargs)

    def echo(message=None, *args, **kwargs):
        events.append(("echo", str(message)))
        return real_echo(message, *args, **kwargs)
    monkeypatch.setattr(CascadeDecoder, "step", step)
    monkeypatch.setattr(click, "echo", echo)
    res = run_cli("generate", tiny_export, "--backend", "torch", "--prompt", "A doc about caches.",
                  "--question", "What?", "--question", "Why?", "--max-new-tokens", "8")
    assert res.exit_code == 0, res.output
    last_step = max(i for i, (kind, _) in enumerate(events) if kind == "step")
    tagged = [(i, text[:3]) for i, (kind, text) in enumerate(events) if kind == "echo" and text[:3] in ("[1]", "[2]")]
    for tag in ("[1]", "[2]"):
        assert min(i for i, t in tagged if t == tag) < last_step, (tag, events)
    order = [t for _, t in tagged]
    assert order != sorted(order), order  # a [2] line comes before a later [1] line
    stats = max(i for i, (kind, text) in enumerate(events) if kind == "echo" and "branches over a" in text)
    assert stats > max(i for i, _ in tagged)
    assert res.stdout.startswith("--- [1] Q: What?\n--- [2] Q: Why?\n")


def test_samples_json_stays_one_document(tiny_export):
    res = run_cli("generate", tiny_export, "--backend", "torch", "--prompt", "Caches hold", "--samples", "2",
                  "--temperature", "1.0", "--seed", "1", "--max-new-tokens", "3", "--json")
    assert res.exit_code == 0, res.output
    assert [b["label"] for b in json.loads(res.stdout)["branches"]] == ["sample 1", "sample 2"]


def test_a_prompt_over_the_context_names_overflow_shift(tiny_export):
    line = error_line(run_cli("generate", tiny_export, "--backend", "torch", "--raw", "--prompt", "fox " * 400))
    assert "256" in line and "--overflow shift" in line


@pytest.fixture
def no_load(monkeypatch):
    """The model load, which the checks below must never reach."""
    from llama_ane.commands import session

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(session, "load_model", refuse)
    return calls


def test_speculative_without_a_verify_window_is_refused_before_the_load(tiny_export, tmp_path, no_load):
    export = tmp_path / "export"
    shutil.copytree(tiny_export, export)
    manifest = json.loads((export / "manifest.json").read_text())
    manifest.pop("verify_window", None)
    (export / "manifest.json").write_text(json.dumps(manifest))
    line = error_line(run_cli("generate", export, "--backend", "torch", "--prompt", "a b a b",
                              "--speculative", "lookup"))
    assert "no verify function" in line and "--verify-window" in line
    assert no_load == []


@pytest.mark.parametrize("args, words", [
    (["--speculative", "ngram"], ["--speculative must be", "lookup"]),
    (["--speculative", "draft:"], ["--speculative must be"]),
    (["--speculative", "lookup", "--draft-tokens", "99"], ["--draft-tokens must be 1..15"]),
])
def test_bad_speculative_values_are_refused_before_the_load(tiny_export, no_load, args, words):
    line = error_line(run_cli("generate", tiny_export, "--backend", "torch", "--prompt", "a b a b", *args))
    for word in words:
        assert word in line, (word, line)
    assert no_load == []
