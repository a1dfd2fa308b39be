"""The export's self-check: hashes, manifest I/O against the packages' own descriptions, dim limits."""

from __future__ import annotations

from pathlib import Path

from ..limits import COREML_ARRAY_DTYPES, MAX_DIM
from ..contract.manifest import ManifestError, read_manifest
from ..mil.package import read_spec


def _features(package: Path, spec, function_name: str) -> tuple[dict, dict, dict]:
    """{name: (shape, dtype)} of a package function's inputs, outputs and states, from its Model spec."""
    desc = spec.description
    if desc.functions:
        matches = [f for f in desc.functions if f.name == function_name]
        if not matches:
            raise ManifestError(f"{package.name} has no function {function_name!r}")
        desc = matches[0]

    def table(features, array=lambda f: f.type.multiArrayType):
        return {f.name: (list(array(f).shape), COREML_ARRAY_DTYPES.get(array(f).dataType, "?")) for f in features}
    return table(desc.input), table(desc.output), table(desc.state, lambda f: f.type.stateType.arrayType)


def validate_export(out: Path) -> dict:
    """Check an export folder; raise ManifestError naming the first problem. Returns the manifest."""
    manifest = read_manifest(out, check_hashes=True)
    specs: dict[str, object] = {}  # each package's spec read once, whatever number of functions it holds
    for model, entry in manifest["models"].items():
        for fn, f in entry["functions"].items():
            if f["file"] not in specs:
                specs[f["file"]] = read_spec(out / f["file"])
            inputs, outputs, states = _features(out / f["file"], specs[f["file"]], f["function_name"])
            if {t["name"] for t in f.get("states", [])} != set(states):
                raise ManifestError(f"{f['file']} ({fn}) has states {sorted(states)}, the manifest says "
                                    f"{sorted(t['name'] for t in f.get('states', []))}")
            for kind, declared, actual in (("input", f["inputs"], inputs), ("output", f["outputs"], outputs),
                                           ("state", f.get("states", []), states)):
                for t in declared:
                    if t["name"] not in actual:
                        raise ManifestError(f"{f['file']} ({fn}) has no {kind} {t['name']!r} named in the manifest")
                    shape, dtype = actual[t["name"]]
                    if shape != t["shape"] or dtype != t["dtype"]:
                        raise ManifestError(
                            f"{f['file']} ({fn}) {kind} {t['name']!r} is {dtype}{shape}, the manifest says "
                            f"{t['dtype']}{t['shape']}")
                    if max(shape) > MAX_DIM:
                        raise ManifestError(f"{f['file']} ({fn}) {kind} {t['name']!r} has a dimension over {MAX_DIM}")
    return manifest
