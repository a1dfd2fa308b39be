"""Every export option is declared once (contract.options) and reaches `llama-ane export` and
`export_model` with the same name and default; `generate` and `chat` share one set of sampling
options. Nothing here exports a model."""

from __future__ import annotations

import dataclasses
import inspect

import click
import pytest
from click.testing import CliRunner

from llama_ane.api import export_model
from llama_ane.contract.options import signature_with_options
from llama_ane.cli import main
from llama_ane.commands import chat, export, generate
from llama_ane.commands.options import options_from
from llama_ane.contract.options import (EXPORT_OPTIONS, ExportOptions, ExportOptionsError, QuantizeRequest, option,
                                        options_of)

# process options: how an export runs, not what it builds (API keyword -> CLI parameter, and how
# the CLI's value maps to the API's)
PROCESS = {"force": ("force", lambda v: v), "verify": ("no_verify", lambda v: not v),
           "with_transformers": ("no_transformers", lambda v: not v),
           "workers": ("workers", lambda v: v), "max_memory_gb": ("max_memory", lambda v: v),
           "progress": ("quiet", lambda v: not v), "revision": ("revision", lambda v: v)}
SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop")


def params(command: click.Command) -> dict[str, click.Parameter]:
    return {p.name: p for p in command.params}


def default(command: click.Command, name: str):
    """What the command gets for `name` when it is not given (a flag's False included)."""
    return params(command)[name].get_default(click.Context(command))


def test_every_option_field_is_in_the_table():
    names = [o.name for o in EXPORT_OPTIONS]
    assert len(names) == len(set(names))
    fields = [f.name for f in dataclasses.fields(ExportOptions) if f.name != "quantize"]
    assert set(names) == set(fields) | {f.name for f in dataclasses.fields(QuantizeRequest)}


def test_every_export_option_has_one_flag_and_one_keyword_with_its_default():
    cli = params(export.command)
    keywords = inspect.signature(export_model).parameters
    for o in EXPORT_OPTIONS:
        assert [p.name for p in export.command.params].count(o.name) == 1, o.name
        assert cli[o.name].opts == [o.flag]
        assert default(export.command, o.name) == o.default, o.name
        assert keywords[o.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert keywords[o.name].default == o.default, o.name
    # and the command has no other option of what an export builds
    assert set(cli) == {o.name for o in EXPORT_OPTIONS} | {name for name, _ in PROCESS.values()} | \
        {"model", "out", "as_json"}


def test_process_options_default_as_on_the_command_line():
    keywords = inspect.signature(export_model).parameters
    for keyword, (name, to_api) in PROCESS.items():
        assert keywords[keyword].default == to_api(default(export.command, name)), keyword
    assert keywords["verify"].default is True


def test_a_new_option_reaches_the_flags_and_the_keywords():
    Wider = dataclasses.make_dataclass("Wider", [("draft_layers", int, option(3, "Layers of the drafter."))],
                                       bases=(ExportOptions,), frozen=True)
    table = options_of(Wider)
    assert [o.name for o in table] == [o.name for o in EXPORT_OPTIONS] + ["draft_layers"]

    @click.command()
    @options_from(table)
    def command(**options):
        click.echo(repr(options["draft_layers"]))

    r = CliRunner().invoke(command, ["--draft-layers", "5"])
    assert r.exit_code == 0 and r.output.strip() == "5"
    assert "Layers of the drafter.  [default: 3]" in CliRunner().invoke(command, ["--help"]).output

    def f(source, out, *, force=False, **options):
        return options
    assert inspect.signature(signature_with_options(f, table)).parameters["draft_layers"].default == 3


@pytest.mark.parametrize("bad, near", [("context_lenght", "context_length"), ("quantise", "quantize"),
                                       ("verfy", "verify")])
def test_an_unknown_keyword_names_the_nearest(tmp_path, bad, near):
    with pytest.raises(TypeError, match=f"'{bad}'.*did you mean '{near}'"):
        export_model(None, tmp_path / "out", **{bad: 1})
    assert not (tmp_path / "out").exists()


def test_help_keeps_every_flag_and_its_metavar():
    text = CliRunner().invoke(main, ["export", "--help"], terminal_width=200).output
    for o in EXPORT_OPTIONS:
        assert o.flag in text
    for shown in ("--context-buckets auto|SIZE[,SIZE...]", "--quantize SCHEME", "--kv-cache [auto|inputs|state]",
                  "--target [iOS16|iOS17|iOS18|macOS13|macOS14|macOS15|coreai]", "--fold-lm-head [auto|yes|no]",
                  "--branches INTEGER", "--quantize-budget NUMBER", "--quantize-recipe PATH", "--no-verify"):
        assert shown in text


def test_context_buckets_as_text():
    assert ExportOptions(context_length=2048, context_buckets="1024, 2048").context_buckets == (1024, 2048)
    assert ExportOptions(context_length=2048, context_buckets=" auto",
                         decode_function="decode").context_buckets == (512, 1024, 2048)
    with pytest.raises(ExportOptionsError, match="--context-buckets must be 'auto' or sizes"):
        ExportOptions(context_buckets="512,big")


def test_a_bad_value_is_one_error_line(tmp_path):
    r = CliRunner().invoke(main, ["export", "-o", str(tmp_path / "out"), "--context-buckets", "512,big"])
    assert r.exit_code == 1 and r.output.strip().splitlines() == [
        "Error: --context-buckets must be 'auto' or sizes such as 512,1024,2048, got '512,big'"]
    assert not (tmp_path / "out").exists()


def test_generate_and_chat_share_the_sampling_options():
    gen, talk = params(generate.command), params(chat.command)
    for name in SAMPLING:
        a, b = gen[name], talk[name]
        assert (a.opts, a.help, type(a.type), a.multiple) == (b.opts, b.help, type(b.type), b.multiple), name
        if name != "max_new_tokens":  # each command keeps its own default length
            assert default(generate.command, name) == default(chat.command, name), name
    assert (default(generate.command, "max_new_tokens"), default(chat.command, "max_new_tokens")) == (128, 256)
    assert {n.replace("-", "_") for n in chat.SETTABLE} <= set(talk)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_reply_length_below_one_is_refused(command):
    argv = [command, "nowhere", "--max-new-tokens", "0"] + (["--prompt", "x"] if command == "generate" else [])
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 1 and "Error: --max-new-tokens must be at least 1, got 0" in r.output
