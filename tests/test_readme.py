"""README.md's Python snippets run as written.

Each ```python block runs on its own in a folder laid out as a clone after `make run`: `out/smollm2`
holds an export (here a tiny random model with a context long enough for the shipped document, so
the snippets run in seconds) and `benchmarks/document.txt` is the shipped document. Nothing in a
snippet is replaced. A block that exports the embedded SmolLM2 (`export_model(None, ...)`) needs the
real model and is slow-marked; the others are export-marked.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def needs_smollm2(block: str) -> bool:
    return "export_model(None" in block


def test_python_blocks_are_found():
    assert python_blocks("text\n```python\nx = 1\n```\n```sh\nls\n```\n```python\ny = 2\n```\n") == ["x = 1\n",
                                                                                                    "y = 2\n"]
    assert BLOCKS, "README.md has no ```python block"


@pytest.fixture(scope="module")
def clone(tiny_checkpoint, tmp_path_factory) -> Path:
    """A folder as `make run` leaves the clone: out/smollm2 (an export) and benchmarks/document.txt."""
    from llama_ane.api import export_model

    root = tmp_path_factory.mktemp("clone")
    (root / "benchmarks").mkdir()
    shutil.copyfile(ROOT / "benchmarks" / "document.txt", root / "benchmarks" / "document.txt")
    export_model(tiny_checkpoint(), root / "out" / "smollm2", context_length=2048, context_buckets=2048,
                 prefill_length=64, progress=False, verify=False)
    return root


@pytest.mark.parametrize("index", [
    pytest.param(i, marks=pytest.mark.slow if needs_smollm2(block) else pytest.mark.export,
                 id=f"block{i + 1}") for i, block in enumerate(BLOCKS)])
def test_readme_python_block_runs(index, clone, tmp_path, monkeypatch):
    work = tmp_path / "clone"
    shutil.copytree(clone, work)
    monkeypatch.chdir(work)
    code = compile(BLOCKS[index], f"README.md python block {index + 1}", "exec")
    exec(code, {"__name__": "__main__"})
