"""Hostile input at run time: prompt-cache files, chat templates, the chat REPL, bytes that are not
UTF-8 and numbers that are not finite. Each must give one `Error:` line naming the problem, a
non-zero exit (or, in the REPL, a conversation that goes on), no traceback, no partial file and
the user's files as they were."""

from __future__ import annotations

import errno
import json
import shutil
import zipfile
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

import llama_ane
from llama_ane.cli import COMMANDS, LazyGroup, main
from llama_ane.commands.options import FiniteFloat, not_utf8
from llama_ane.runtime import kv_cache
from llama_ane.runtime.kv_cache import KVCache, PromptCacheError, load_cache, save_cache

CONTEXT = 32


def invoke(args: list, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False, **kwargs)


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("Error:")]


def assert_one_error(result, *words: str) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = error_lines(result)
    assert len(errors) == 1, result.stderr
    for word in words:
        assert word in errors[0], (word, errors[0])
    return errors[0]


@pytest.fixture
def no_model(monkeypatch):
    """Loading or exporting a model fails the test: option checks must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")
    monkeypatch.setattr(llama_ane, "load", refuse)
    monkeypatch.setattr("llama_ane.api.export_model", refuse)


# ---- numbers ---------------------------------------------------------------------------------------------------

def commands() -> dict[str, click.Command]:
    group = LazyGroup()
    return {name: group.get_command(None, name) for name in COMMANDS}


def float_options() -> list[tuple[str, str]]:
    """(command, flag) of every option that takes a real number."""
    return [(name, max(p.opts, key=len)) for name, cmd in commands().items() for p in cmd.params
            if isinstance(p, click.Option) and isinstance(p.type, FiniteFloat)]


def argv_before(command: str, tmp_path: Path) -> list:
    """The command and its required arguments and options, filled with harmless values."""
    cmd = commands()[command]
    argv: list = [command]
    for p in cmd.params:
        if isinstance(p, click.Argument) and p.required:
            argv.append(tmp_path)
        elif isinstance(p, click.Option) and p.required:
            argv += [p.opts[0], tmp_path / "out"]
    return argv


def test_every_real_number_option_is_a_finite_float():
    plain = [(name, p.name) for name, cmd in commands().items() for p in cmd.params
             if isinstance(p.type, click.types.FloatParamType)
             or (isinstance(p.default, float) and not isinstance(p.type, FiniteFloat))]
    assert plain == [], "use commands.options.FiniteFloat for these"
    assert {("generate", "--temperature"), ("generate", "--top-p"), ("chat", "--temperature"), ("chat", "--top-p"),
            ("export", "--max-memory"), ("info", "--bandwidth")} <= set(float_options())


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e400"])
@pytest.mark.parametrize("command,flag", float_options())
def test_nan_and_infinity_are_refused_by_name(command, flag, value, tmp_path, no_model):
    r = invoke(argv_before(command, tmp_path) + [flag, value])
    assert_one_error(r, flag, "finite", value)


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flag,value,words", [("--temperature", "-0.5", ["at least 0"]),
                                              ("--top-p", "0", ["(0, 1]"]), ("--top-p", "1.01", ["(0, 1]"]),
                                              ("--temperature", "warm", ["a number", "'warm'"])])
def test_sampling_values_out_of_range_are_refused_by_name(command, flag, value, words, tmp_path, no_model):
    argv = argv_before(command, tmp_path) + (["--prompt", "Hi"] if command == "generate" else [])
    assert_one_error(invoke(argv + [flag, value]), flag, *words)


def test_export_max_memory_must_be_positive(tmp_path, no_model):
    assert_one_error(invoke(["export", "-o", tmp_path / "out", "--max-memory", "0"]), "--max-memory", "positive")
    assert not (tmp_path / "out").exists()


def test_finite_float_keeps_good_values():
    t = FiniteFloat(minimum=0, maximum=1, min_open=True)
    assert t.convert("0.25", None, None) == 0.25 and t.convert(1, None, None) == 1.0


# ---- bytes that are not UTF-8 -----------------------------------------------------------------------------------

def test_not_utf8_names_the_byte_and_its_offset():
    assert not_utf8("x", "héllo") is None and not_utf8("x", "héllo".encode()) is None
    # Linux hands undecodable argv bytes to Python as surrogates; the offset counts the original bytes
    assert not_utf8("--prompt", "é\udcffa") == "--prompt is not UTF-8 text (byte 0xff at offset 2)"
    assert not_utf8("F", b"ab\xc3(") == "F is not UTF-8 text (byte 0xc3 at offset 2)"


@pytest.mark.parametrize("flag", ["--prompt", "--question", "--stop"])
def test_generate_text_options_must_be_utf8(flag, tmp_path, no_model):
    extra = [] if flag == "--prompt" else ["--prompt", "Hi"]
    r = invoke(["generate", tmp_path, *extra, flag, "Tell me ab\udcfeout it"])
    assert_one_error(r, flag, "not UTF-8", "byte 0xfe at offset 10")


@pytest.mark.parametrize("command,flag", [("chat", "--system"), ("gpu-generate", "--prompt"),
                                          ("gpu-generate", "--branch")])
def test_other_text_options_must_be_utf8(command, flag, tmp_path, no_model):
    assert_one_error(invoke([command, tmp_path, flag, "\udc80"]), flag, "byte 0x80 at offset 0")


@pytest.mark.parametrize("argv", [["generate", "{tmp}", "--prompt-file"], ["eval", "{tmp}", "--text"],
                                  ["verify", "{tmp}", "--text"]], ids=lambda a: f"{a[0]} {a[2]}")
def test_text_files_must_be_utf8(argv, tmp_path, no_model):
    doc = tmp_path / "doc.txt"
    doc.write_bytes("Once upon a time, ".encode() + b"\xff\xfe latin-1" + b" more text")
    r = invoke([a.replace("{tmp}", str(tmp_path)) for a in argv] + [doc])
    assert_one_error(r, f"{argv[2]} {doc} is not UTF-8 text (byte 0xff at offset 18)")
    assert doc.read_bytes().startswith(b"Once upon")


# ---- prompt-cache files, without an export ----------------------------------------------------------------------

MANIFEST = {"name": "tiny", "context_length": CONTEXT, "config": {"vocab_size": 100}}


def empty_cache() -> KVCache:
    """A cache shaped as an export's: two chunks of (layers, channels, 1, context) arrays."""
    return KVCache([], [{"k": np.zeros((layers, 4, 1, CONTEXT), np.float32),
                         "v": np.zeros((layers, 4, 1, CONTEXT), np.float32)} for layers in (2, 1)])


def filled_cache(n: int = 5) -> KVCache:
    cache = empty_cache()
    rng = np.random.default_rng(0)
    for c in cache.caches:
        for name in ("k", "v"):
            c[name][..., :n] = rng.standard_normal(c[name][..., :n].shape)
    cache.tokens = list(range(3, 3 + n))
    return cache


def write_npz(path: Path, info: dict | None = None, **arrays) -> Path:
    """An .npz as save_cache writes it, with `info` as its meta JSON and arrays of the caller's choosing."""
    if info is not None:
        arrays["meta"] = np.frombuffer(json.dumps(info).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def good_meta(n: int = 5, **changes) -> dict:
    return {"version": kv_cache.CACHE_FILE_VERSION, "manifest_sha256": kv_cache.manifest_digest(MANIFEST),
            "name": "tiny", "tokens": list(range(3, 3 + n)), **changes}


def good_arrays(n: int = 5) -> dict:
    return {f"{name}_{i}": np.zeros((layers, 4, 1, n), np.float16) for i, layers in enumerate((2, 1))
            for name in ("k", "v")}


def test_a_prompt_cache_round_trips(tmp_path):
    cache = filled_cache()
    path = save_cache(cache, MANIFEST, tmp_path / "c.npz")
    loaded = load_cache(path, MANIFEST, empty_cache())
    assert loaded.tokens == cache.tokens
    for got, want in zip(loaded.caches, cache.caches):
        np.testing.assert_array_equal(got["k"], want["k"])
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]
    (tmp_path / "plain").write_bytes(b"")  # made with the same umask: the cache is as readable as any file
    assert path.stat().st_mode == (tmp_path / "plain").stat().st_mode
    # a hand-made file of the right fields (float16 arrays) loads as well
    assert load_cache(write_npz(tmp_path / "h.npz", good_meta(), **good_arrays()), MANIFEST, empty_cache()).position == 5


SPRUNG: list[str] = []


def _spring() -> str:
    SPRUNG.append("unpickled")
    return "trap"


class Trap:
    """Unpickling it calls _spring: a file holding it must be refused without being unpickled."""

    def __reduce__(self):
        return _spring, ()


def _truncated(tmp: Path) -> Path:
    path = save_cache(filled_cache(), MANIFEST, tmp / "c.npz")
    path.write_bytes(path.read_bytes()[:-300])
    return path


def _file(tmp: Path, data: bytes) -> Path:
    (tmp / "c.npz").write_bytes(data)
    return tmp / "c.npz"


def _npy(tmp: Path) -> Path:
    np.save(tmp / "c.npy", np.zeros(3))
    return tmp / "c.npy"


def _huge_header(tmp: Path) -> Path:
    """k_0 declares a shape of 10^12 floats: refused from its header, before any allocation."""
    path = write_npz(tmp / "c.npz", good_meta(), **{k: v for k, v in good_arrays().items() if k != "k_0"})
    header = {"descr": "<f4", "fortran_order": False, "shape": (10**12,)}
    with zipfile.ZipFile(path, "a") as z, z.open("k_0.npy", "w") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(b"\0" * 64)
    return path


# name -> (a file made in the folder it is given, words its refusal must hold)
BAD_CACHES = {
    "not a zip": (lambda t: _file(t, b"just some text\n"), ["not a zip"]),
    "a plain .npy": (_npy, ["not a zip"]),
    "truncated": (_truncated, ["cannot be read"]),
    "empty file": (lambda t: _file(t, b""), ["not a zip"]),
    "object array": (lambda t: write_npz(t / "c.npz", good_meta(), **{**good_arrays(),
                                                                      "k_0": np.array([Trap()], dtype=object)}),
                     ["'k_0'", "object"]),
    "object meta": (lambda t: write_npz(t / "c.npz", None, meta=np.array([Trap()], dtype=object)), ["'meta'"]),
    "no meta": (lambda t: write_npz(t / "c.npz", None, **good_arrays()), ["no 'meta' array"]),
    "meta not JSON": (lambda t: write_npz(t / "c.npz", None, meta=np.frombuffer(b"{oops", np.uint8)), ["not JSON"]),
    "meta a list": (lambda t: write_npz(t / "c.npz", None, meta=np.frombuffer(b"[1, 2]", np.uint8)),
                    ["not a JSON object"]),
    "no version": (lambda t: write_npz(t / "c.npz", {k: v for k, v in good_meta().items() if k != "version"},
                                       **good_arrays()), ["version None"]),
    "another export": (lambda t: write_npz(t / "c.npz", good_meta(manifest_sha256="0" * 64), **good_arrays()),
                       ["made by another export"]),
    "tokens not ids": (lambda t: write_npz(t / "c.npz", good_meta(tokens=[1, "two"]), **good_arrays()),
                       ["token ids"]),
    "token past the vocabulary": (lambda t: write_npz(t / "c.npz", good_meta(tokens=[5, 100]), **good_arrays(2)),
                                  ["vocabulary size 100"]),
    "longer than the context": (lambda t: write_npz(t / "c.npz", good_meta(CONTEXT + 1), **good_arrays(2)),
                                [f"{CONTEXT + 1} tokens", f"context of {CONTEXT}"]),
    "missing array": (lambda t: write_npz(t / "c.npz", good_meta(), **{k: v for k, v in good_arrays().items()
                                                                        if k != "v_1"}), ["no 'v_1' array"]),
    "wrong shape": (lambda t: write_npz(t / "c.npz", good_meta(), **{**good_arrays(), "v_0": np.zeros((2, 4, 1, 4))}),
                    ["'v_0'", "(2, 4, 1, 4)", "(2, 4, 1, 5)"]),
    "wrong dtype": (lambda t: write_npz(t / "c.npz", good_meta(), **{**good_arrays(),
                                                                     "k_1": np.zeros((1, 4, 1, 5), np.int64)}),
                    ["'k_1'", "int64"]),
    "huge declared shape": (_huge_header, ["'k_0'", "(1000000000000,)"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CACHES))
def test_a_bad_prompt_cache_file_is_one_clear_error(case, tmp_path):
    make, words = BAD_CACHES[case]
    path = make(tmp_path)
    before = path.read_bytes()
    SPRUNG.clear()
    with pytest.raises(PromptCacheError) as e:
        load_cache(path, MANIFEST, empty_cache())
    message = str(e.value)
    assert str(path) in message and "\n" not in message
    for word in words:
        assert word in message, (word, message)
    assert SPRUNG == []  # nothing was unpickled
    assert path.read_bytes() == before  # and the file was left as it was


def test_a_missing_prompt_cache_is_not_advised_away(tmp_path):
    for path in (tmp_path / "nowhere.npz", tmp_path):
        with pytest.raises(PromptCacheError) as e:
            load_cache(path, MANIFEST, empty_cache())
        assert str(path) in str(e.value) and "delete" not in str(e.value)
        assert ("does not exist" if path.suffix else "is a folder") in str(e.value)


def _no_space_midway(f, **arrays):
    """np.savez that writes part of the archive, then finds the disk full."""
    f.write(b"PK\x03\x04 half an archive")
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fault,words", [
    ("disk full while writing", ["disk is full"]),
    ("disk full at sync", ["disk is full"]),
    ("read-only folder", ["not writable"]),
])
def test_a_failed_save_leaves_no_partial_file_and_the_old_one_intact(fault, words, tmp_path, monkeypatch):
    old = save_cache(filled_cache(3), MANIFEST, tmp_path / "c.npz")
    before = old.read_bytes()
    if fault == "disk full while writing":
        monkeypatch.setattr(kv_cache.np, "savez", _no_space_midway)
    elif fault == "disk full at sync":
        def fsync(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(kv_cache.os, "fsync", fsync)
    else:  # root ignores permission bits, so the refusal the OS gives is simulated
        def refused(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied")
        monkeypatch.setattr(kv_cache, "open", refused, raising=False)
    with pytest.raises(PromptCacheError) as e:
        save_cache(filled_cache(6), MANIFEST, old)
    assert str(old) in str(e.value)
    for word in words:
        assert word in str(e.value)
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]  # no .partial, no temporary file
    assert old.read_bytes() == before


def test_save_into_a_missing_folder_or_over_a_user_file_is_refused(tmp_path):
    with pytest.raises(PromptCacheError, match="does not exist"):
        save_cache(filled_cache(), MANIFEST, tmp_path / "no" / "c.npz")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(PromptCacheError, match="not a llama-ane prompt-cache file"):
        save_cache(filled_cache(), MANIFEST, notes)
    assert notes.read_text() == "my notes" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# ---- with a real export -----------------------------------------------------------------------------------------

BOOM_TEMPLATE = (
    "{% for message in messages %}{% if 'boom' in message['content'] %}"
    "{{ raise_exception('the word boom is not allowed') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_template(export: Path, folder: Path, template: str) -> Path:
    """A copy of `export` whose chat template is `template` (the manifest rehashed to match)."""
    from llama_ane.contract.manifest import read_manifest, write_manifest

    copy = folder / "export"
    shutil.copytree(export, copy)
    (copy / "chat_template.jinja").write_text(template)
    manifest = read_manifest(copy, check_hashes=False)
    manifest["tokenizer"]["chat_template"] = template
    write_manifest(copy, manifest)
    return copy


@pytest.mark.export
@pytest.mark.parametrize("template,words", [("{% for m in messages %}{{ m.content ", ["TemplateSyntaxError"]),
                                            (BOOM_TEMPLATE, ["boom is not allowed"])])
def test_generate_chat_with_a_failing_template(tiny_export, tmp_path, template, words):
    export = with_template(tiny_export, tmp_path, template)
    r = invoke(["generate", export, "--chat", "--prompt", "say boom", "--backend", "torch", "--max-new-tokens", 2])
    assert_one_error(r, "chat template", *words)


@pytest.mark.export
def test_chat_repl_goes_on_after_failures(tiny_export, tmp_path):
    """A failing template turn, /save into a missing folder, /load of a missing and of a bad file, and a
    line that is not UTF-8: each is one Error line; the turns after them still work, so the failed
    turn left no message behind (the template refuses any conversation that holds 'boom')."""
    export = with_template(tiny_export, tmp_path, BOOM_TEMPLATE)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"junk")
    lines = ["say boom", "hello", f"/save {tmp_path / 'no' / 'c.npz'}", "how are you", f"/load {tmp_path / 'x.npz'}",
             f"/load {junk}", "caf\xe9", "still here?", f"/save {tmp_path / 'c.npz'}", "/quit"]
    stdin = b"".join((line.encode("latin-1") if line == "caf\xe9" else line.encode()) + b"\n" for line in lines)
    r = invoke(["chat", export, "--backend", "torch", "--max-new-tokens", 3], input=stdin)
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    errors = error_lines(r)
    assert len(errors) == 5, r.stderr
    assert "boom is not allowed" in errors[0]
    assert "does not exist" in errors[1] and str(tmp_path / "no") in errors[1]
    assert "x.npz does not exist" in errors[2] and "delete" not in errors[2]
    assert str(junk) in errors[3] and junk.read_bytes() == b"junk"
    assert "byte 0xe9 at offset 3" in errors[4]
    assert r.stderr.count("[prefill") == 3  # hello, how are you, still here?
    assert (tmp_path / "c.npz").is_file() and "[saved" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz", "export", "junk.npz"]  # no partial file


@pytest.mark.export
def test_generate_refuses_a_bad_prompt_cache_and_keeps_it(tiny_export, tmp_path):
    cache = tmp_path / "doc.npz"
    cache.write_bytes(b"PK\x03\x04 not really a zip")
    r = invoke(["generate", tiny_export, "--prompt", "Hello", "--prompt-cache", cache, "--backend", "torch",
                "--max-new-tokens", 2])
    assert_one_error(r, str(cache), "prompt-cache")
    assert cache.read_bytes() == b"PK\x03\x04 not really a zip"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.npz"]
