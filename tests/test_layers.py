"""Imports run downward only: config -> model -> contract -> export | runtime -> commands.

Read statically from the source (every `import` and `from ... import`, at any depth, relative ones
resolved), so a lazy import inside a function counts as much as one at the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "llama_ane"

LEAVES = {"config", "families", "errors", "limits", "precision", "_version", "hub", "memory"}
# part of llama_ane -> the parts it may import (besides itself and the leaves)
ALLOWED = {
    "config": set(),
    "families": set(),
    "errors": set(),
    "_version": set(),
    "_quiet": set(),
    "limits": set(),
    "precision": set(),
    "hub": set(),
    "memory": set(),
    "mil": set(),
    "cuda": set(),
    "checkpoint": set(),
    "quantize": set(),
    "model": set(),
    "contract": {"model", "checkpoint", "quantize"},
    "export": {"model", "checkpoint", "contract", "mil", "quantize", "reference"},  # quality: the fp32 reference
    "runtime": {"model", "checkpoint", "contract", "mil"},
    "reference": {"checkpoint"},
    "verify": {"model", "checkpoint", "contract", "reference", "runtime"},
    "evaluate": {"contract", "quantize", "runtime", "verify"},
    "serve": {"contract", "runtime"},
    "api": {"checkpoint", "contract", "export", "quantize", "reference", "verify"},
}


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def imported_parts(path: Path, source: str | None = None) -> set[str]:
    """The top-level parts of llama_ane that the module at `path` (or `source` placed there) imports."""
    tree = ast.parse(path.read_text() if source is None else source)
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]  # ("llama_ane", "export")
    if path.name == "__init__.py":
        package = path.relative_to(PACKAGE.parent).parts[:-1]
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ((node.module,) if node.module else ()))
                names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
        for name in names:
            parts = name.split(".")
            if parts[0] == "llama_ane" and len(parts) > 1:
                found.add(parts[1])
    return found


def modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if part_of(p) in ALLOWED)


def test_every_part_has_a_rule():
    parts = {part_of(p) for p in PACKAGE.rglob("*.py")}
    assert parts - set(ALLOWED) <= {"commands", "cli", "__main__", "__init__", "testing"}, "add it to ALLOWED"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_downward(path):
    part = part_of(path)
    upward = imported_parts(path) - ALLOWED[part] - LEAVES - {part}
    assert not upward, f"{path.relative_to(PACKAGE)} ({part}) imports {sorted(upward)}"


def test_the_rule_catches_an_upward_import():
    """The checker itself: a lazy relative import of the exporter in a runtime module is seen."""
    path = PACKAGE / "runtime" / "backends" / "torch_backend.py"
    assert "export" not in imported_parts(path)
    assert "export" in imported_parts(path, path.read_text() + "\n\ndef f():\n    from ...export import convert\n")


# ---- the device model imports no torch --------------------------------------------------------------------------

TORCH_FREE = ("contract/device_model.py", "contract/traffic.py", "contract/layer_costs.py")  # info, inspect, bench


def _module_file(dotted: str) -> Path | None:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def loaded_at_import(path: Path) -> set[str]:
    """Every module importing `path` loads before any function runs: the top-level imports of it and
    of each llama_ane module they load (its packages' __init__ among them), followed through; imports
    inside functions or under `if TYPE_CHECKING` are left out. Outside modules by their top package."""
    seen, todo, found = set(), [path], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        package = p.relative_to(PACKAGE.parent).parts[:-1]
        for parent in range(1, len(package) + 1):  # the packages above it run their __init__ first
            todo.append(PACKAGE.parent.joinpath(*package[:parent], "__init__.py"))
        for node in ast.parse(p.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ((node.module,) if node.module else ()))
                else:
                    base = node.module or ""
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                if name.split(".")[0] != "llama_ane":
                    found.add(name.split(".")[0])
                elif (file := _module_file(name)) is not None:
                    todo.append(file)
    return found


@pytest.mark.parametrize("rel", TORCH_FREE)
def test_the_device_model_imports_no_torch(rel):
    """`info`, `inspect` and the device model run without torch (a second and more to import): the
    layer kinds' costs are in contract/layer_costs.py, not beside the torch modules."""
    assert not loaded_at_import(PACKAGE / rel) & {"torch", "coremltools", "transformers"}


def test_the_torch_free_check_sees_torch():
    assert "torch" in loaded_at_import(PACKAGE / "model" / "layers" / "delta_net.py")
    assert "torch" in loaded_at_import(PACKAGE / "model" / "chunk.py")
