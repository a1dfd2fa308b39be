"""The export's self-check: hashes, manifest I/O against the packages' own descriptions, dim limits."""

from __future__ import annotations

from pathlib import Path

from ..limits import COREML_ARRAY_DTYPES, MAX_DIM
from ..contract.manifest import ManifestError, read_manifest


def _features(package: Path, function_name: str) -> tuple[dict, dict]:
    """{name: (shape, dtype)} of a package function's inputs and outputs, from its Model spec."""
    import coremltools as ct

    spec = ct.utils.load_spec(str(package))
    desc = spec.description
    if desc.functions:
        matches = [f for f in desc.functions if f.name == function_name]
        if not matches:
            raise ManifestError(f"{package.name} has no function {function_name!r}")
        desc = matches[0]

    def table(features):
        return {f.name: (list(f.type.multiArrayType.shape), COREML_ARRAY_DTYPES.get(f.type.multiArrayType.dataType, "?"))
                for f in features}
    return table(desc.input), table(desc.output)


def validate_export(out: Path) -> dict:
    """Check an export folder; raise ManifestError naming the first problem. Returns the manifest."""
    manifest = read_manifest(out, check_hashes=True)
    for model, entry in manifest["models"].items():
        for fn, f in entry["functions"].items():
            inputs, outputs = _features(out / f["file"], f["function_name"])
            for kind, declared, actual in (("input", f["inputs"], inputs), ("output", f["outputs"], outputs)):
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
