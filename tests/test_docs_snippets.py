"""Every code block of README.md and docs/*.md runs as written on Linux, or says why it does not.

A fenced block's info string gives its language, then what this test needs to know:

    ```sh                   run with bash (-e -o pipefail) in the folder below
    ```python               run in this process, in that folder
    ```sh slow              run in the slow tier (long: the long tier): it runs SmolLM2 itself
    ```python server        run while `llama-ane serve out/smollm2` serves on 127.0.0.1:8080
    ```sh skip="why"        not run; the reason says why (macOS, a GPU, a placeholder path, ...)
    ```text  (json, jsonc, xml)   output or data, never run

Any other language (swift, ...) must carry skip="...", and a fence without a language is refused:
each block is either run or marked with its reason (`test_every_block_runs_or_says_why`).

The folder is laid out as a clone after `make run`: `out/smollm2` holds an export (a tiny random
model whose context of 4096 holds the shipped document, which its byte-level tokenizer makes about
2000 tokens, and branches after it; exported once for the run and shared by the workers, so the
blocks run in seconds), `benchmarks/document.txt` is the shipped document and `.venv`
is the running environment. Nothing in a block is replaced. The blocks of one document run in
order in one copy of it, as a reader follows the page (a later block may use what an earlier one
made). Commands run with the environment's `bin` first on PATH, standard input empty and
XDG_CACHE_HOME inside the test's folder. README's python blocks are run by tests/test_readme.py in
the same layout, and not a second time here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import shared

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "sh", "bash"}
DATA = {"text", "json", "jsonc", "xml"}
FLAGS = {"slow", "long", "server"}
SERVER = "http://127.0.0.1:8080"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>.*)$")


@dataclass
class Block:
    doc: str  # the document's path from the repository's root
    line: int  # the line of its opening fence
    lang: str
    code: str
    flags: set[str] = field(default_factory=set)
    skip: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def runs(self) -> bool:
        return self.lang in RUN and self.skip is None

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(text: str, doc: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, with what their info strings say and any problem
    with it (no language, an unknown word, a skip without a reason, a language that cannot run
    here without a skip)."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info = m.group("indent"), m.group("info").strip()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        code = textwrap.dedent("\n".join(line[len(indent):] if line.startswith(indent) else line
                                         for line in lines[i + 1:end])) + "\n"
        try:
            words = shlex.split(info)
        except ValueError as e:
            words, problem = info.split(), f"its info string cannot be read ({e})"
        else:
            problem = None
        block = Block(doc, i + 1, words[0] if words else "", code)
        if problem:
            block.problems.append(problem)
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key == "skip" and "=" in word:
                block.skip = value.strip()
                if not block.skip:
                    block.problems.append('skip="" gives no reason: say why it does not run')
            elif word in FLAGS:
                block.flags.add(word)
            else:
                block.problems.append(f"{word!r} is not one of skip=\"why\", {', '.join(sorted(FLAGS))}")
        if not block.lang:
            block.problems.append("the fence names no language: ```sh, ```python, ```text, ...")
        elif block.lang not in RUN | DATA and block.skip is None:
            block.problems.append(f"a {block.lang} block cannot run here: mark it skip=\"why\"")
        found.append(block)
        i = end + 1
    return found


def doc_blocks() -> list[Block]:
    return [b for path in DOCS for b in blocks(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())]


def run_here(block: Block) -> bool:
    """Whether this file runs it: a runnable block, but not README's python (test_readme.py's)."""
    return block.runs and not (block.doc == "README.md" and block.lang == "python")


RUNNABLE = [b for b in doc_blocks() if run_here(b)]

# blocks that fail for a bug of the product, not of the block: (document, text in the block) -> the bug.
# Strict: once the bug is fixed the block passes, and its entry here must go.
KNOWN_BUGS: dict[tuple[str, str], str] = {}


def _marks(block: Block) -> list:
    tier = pytest.mark.long if "long" in block.flags else pytest.mark.slow if "slow" in block.flags \
        else pytest.mark.export
    bugs = [why for (doc, text), why in KNOWN_BUGS.items() if block.doc == doc and text in block.code]
    return [tier, *(pytest.mark.xfail(reason=why, strict=True) for why in bugs)]


# ---- the marks (unit tier) ----------------------------------------------------------------------------------

def test_every_block_runs_or_says_why():
    problems = [f"{b.name}: {p}" for b in doc_blocks() for p in b.problems]
    assert not problems, "\n".join(problems)
    assert RUNNABLE, "no block of README.md or docs/*.md runs"


def test_the_marks_are_read():
    text = textwrap.dedent('''\
        ```sh
        echo one
        ```
        - item

          ```python slow server
          x = 1
          ```
        ```swift skip="needs Xcode"
        let x = 1
        ```
        ```
        bare
        ```
        ```swift
        let y = 2
        ```
        ```sh skip=""
        true
        ```
        ```sh fast
        true
        ```
        ''')
    found = blocks(text, "t.md")
    assert [(b.lang, b.runs, sorted(b.flags), b.skip) for b in found] == [
        ("sh", True, [], None), ("python", True, ["server", "slow"], None), ("swift", False, [], "needs Xcode"),
        ("", False, [], None), ("swift", False, [], None), ("sh", False, [], ""), ("sh", True, [], None)]
    assert found[1].code == "x = 1\n"
    assert [bool(b.problems) for b in found] == [False, False, False, True, True, True, True]


def test_a_failing_python_block_fails(tmp_path, monkeypatch):
    (block,) = blocks("```python\nx = 1\nassert x == 2, 'the snippet is wrong'\n```\n", "t.md")
    with pytest.raises(AssertionError, match="the snippet is wrong"):
        run_python(block, tmp_path, monkeypatch)


# ---- running them ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def docs_clone(tiny_checkpoint, tmp_path_factory) -> Path:
    """A folder as `make run` leaves the clone: out/smollm2 (a tiny export whose context holds the
    shipped document), benchmarks/document.txt and .venv (this environment)."""
    def build(root: Path) -> Path:
        from llama_ane.api import export_model

        (root / "benchmarks").mkdir(parents=True)
        shutil.copyfile(ROOT / "benchmarks" / "document.txt", root / "benchmarks" / "document.txt")
        export_model(tiny_checkpoint(num_hidden_layers=2, head_dim=32, max_position_embeddings=4096),
                     root / "out" / "smollm2",
                     context_length=4096, context_buckets=4096, prefill_length=64, progress=False, verify=False)
        return root
    return shared(tmp_path_factory, "docs-clone", build)


_FOLDERS: dict[str, Path] = {}


@pytest.fixture
def work(docs_clone, tmp_path_factory, request) -> Path:
    """The copy of the clone the current document's blocks run in, made at its first block."""
    doc = request.node.callspec.params["block"].doc
    if doc not in _FOLDERS:
        folder = tmp_path_factory.mktemp(re.sub(r"\W", "_", doc))
        shutil.copytree(docs_clone, folder, dirs_exist_ok=True)
        venv = Path(sys.prefix)
        if (venv / "bin" / "llama-ane").exists():
            (folder / ".venv").symlink_to(venv)
        (folder / ".cache").mkdir()
        _FOLDERS[doc] = folder
    return _FOLDERS[doc]


def environment(folder: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "XDG_CACHE_HOME": str(folder / ".cache"), "PYTHONWARNINGS": "ignore"}


def run_python(block: Block, folder: Path, monkeypatch) -> None:
    monkeypatch.chdir(folder)
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / ".cache"))
    exec(compile(block.code, f"{block.name} (python block)", "exec"), {"__name__": "__main__"})


def run_sh(block: Block, folder: Path, timeout: float) -> None:
    # background jobs a block starts (a server) end with it; -e: any failing command fails the block
    script = "trap 'for p in $(jobs -p); do kill $p; wait $p; done 2>/dev/null || true' EXIT\n" + block.code
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=folder, env=environment(folder),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{block.name} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
                    f"{proc.stderr[-3000:]}", pytrace=False)


def port_free(port: int = 8080) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def serving(folder: Path):
    """`llama-ane serve out/smollm2` in `folder`, once it answers /health; the process."""
    proc = subprocess.Popen([sys.executable, "-m", "llama_ane", "serve", "out/smollm2"], cwd=folder,
                            env=environment(folder), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"llama-ane serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}", pytrace=False)
        try:
            urllib.request.urlopen(f"{SERVER}/health", timeout=2).read()
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail("llama-ane serve did not answer /health within 180 s", pytrace=False)


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stderr.close()


@pytest.mark.parametrize("block", [pytest.param(b, marks=_marks(b), id=b.name) for b in RUNNABLE])
def test_block_runs(block, work, monkeypatch):
    if ("server" in block.flags or "serve " in block.code) and not port_free():
        pytest.skip("127.0.0.1:8080, where the block's server listens, is in use")
    server = serving(work) if "server" in block.flags else None
    try:
        if block.lang == "python":
            run_python(block, work, monkeypatch)
        else:
            run_sh(block, work, timeout=1800 if "long" in block.flags else 600)
    finally:
        if server is not None:
            stop(server)


@pytest.mark.export
def test_a_failing_shell_block_fails(tmp_path):
    (block,) = blocks("```sh\ntrue\nfalse\necho after\n```\n", "t.md")
    with pytest.raises(pytest.fail.Exception, match="exited 1"):
        run_sh(block, tmp_path, timeout=60)
