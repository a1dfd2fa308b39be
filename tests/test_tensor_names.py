"""The tensor names Python builds are the Swift host's: llama_ane.model.names against the committed
table both sides check (swift_host/Tests/LlamaANETests/Fixtures/tensor_names.json; the Swift host's
TensorNamesTests checks its TensorNames and CarriedState against the same file). The file is
written by tests/swift_fixtures.py (`--only names`) from llama_ane.model.names."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from llama_ane.model import names

ROOT = Path(__file__).resolve().parent.parent
TABLE = json.loads((ROOT / "swift_host/Tests/LlamaANETests/Fixtures/tensor_names.json").read_text("utf-8"))
SWIFT = (ROOT / "swift_host/Sources/LlamaANE/Runtime/TensorNames.swift").read_text("utf-8")


def python_name(role: str) -> str:
    """The Python constant of a Swift role: inputIds -> INPUT_IDS."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", role).upper()


def test_the_table_holds_every_swift_role():
    """Every `static let` of TensorNames.swift is in the table, so that the Swift test checks it."""
    roles = re.findall(r"static let (\w+)", SWIFT)
    assert len(roles) > 30
    assert sorted(roles) == sorted([*TABLE["names"], *TABLE["sets"]])


@pytest.mark.parametrize("role", sorted(TABLE["names"]))
def test_each_name_is_the_tables(role):
    assert getattr(names, python_name(role)) == TABLE["names"][role]


@pytest.mark.parametrize("role", sorted(TABLE["sets"]))
def test_each_set_is_the_tables(role):
    value = getattr(names, python_name(role))
    assert sorted(value) == TABLE["sets"][role]
    assert len(set(value)) == len(value)


def test_made_names_are_the_tables():
    made = TABLE["made"]
    assert {x: names.updated(x) for x in made["updated"]} == made["updated"]
    assert {x: names.shared(x) for x in made["shared"]} == made["shared"]
    assert {j: names.logits(int(j)) for j in made["logits"]} == made["logits"]
    assert all(names.logits_split(name) == int(j) for j, name in made["logits"].items())
    assert names.logits_split("logits_x") is None and names.logits_split("hidden_states") is None


def test_carried_states_are_the_tables():
    assert {c.key: {"state": c.state, "new": c.new, "branches": c.branches, "afterWindow": c.after_window,
                    "afterBranchStep": c.after_branch_step, "copyToBranches": c.copy_to_branches}
            for c in names.CARRIED} == TABLE["carried"]
    assert {c.state for c in names.CARRIED} <= set(names.CACHES)


def test_kv_stems_name_the_caches():
    """The stems a host keys its K/V by make the manifest's cache, new K/V and suffix names."""
    for which in "kv":
        assert names.cache(names.kv(which)) == f"{which}_cache"
        ring = names.kv(which, ring=True)
        assert names.cache(ring) == f"{which}_ring" and ring in names.RINGS
        assert (names.new(ring), names.suffix(ring)) == (f"{which}_ring_new", f"{which}_ring_suffix")
        assert names.is_ring(names.suffix(ring)) and not names.is_ring(names.suffix(which))
    with pytest.raises(ValueError, match="'k' or 'v'"):
        names.kv("q")


def table_names() -> set[str]:
    """Every tensor name model.names gives: its names, and each name of its sets."""
    found = set()
    for key, value in vars(names).items():
        if key.isupper() and isinstance(value, str):
            found.add(value)
        elif key.isupper() and isinstance(value, (tuple, frozenset, set)):
            found.update(x for x in value if isinstance(x, str))
    return found


def function_modules():
    """The torch modules that run an exported function, called with its inputs by name."""
    import torch
    from llama_ane.model import cache_update, chunk, embeddings, lm_head

    internal = {embeddings.PerLayerInputs}  # run inside the embeddings' function, on its own tensors
    return [c for m in (embeddings, chunk, lm_head, cache_update) for c in vars(m).values()
            if isinstance(c, type) and issubclass(c, torch.nn.Module) and c.__module__ == m.__name__
            and "forward" in vars(c) and c not in internal]


def test_the_torch_modules_take_the_tables_names():
    """A function's torch module takes each input under its manifest name (the torch backend calls it
    by name), so every parameter of their forward is model.names' (or names.shared of one)."""
    modules, known = function_modules(), table_names()
    assert len(modules) >= 10
    for module in modules:
        params = [p for p in inspect.signature(module.forward).parameters if p != "self"]
        odd = [p for p in params if p not in known and not (p.startswith(names.SHARED_PREFIX)
                                                            and names.shared(p[len(names.SHARED_PREFIX):]) == p
                                                            and p[len(names.SHARED_PREFIX):] in known)]
        assert not odd, f"{module.__name__}.forward takes {odd}, which model.names does not name"
