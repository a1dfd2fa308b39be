"""manifest.json: writing, reading, hashing and checking (the contract is docs/manifest.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import LlamaANEError

FORMAT_VERSION = 2
MANIFEST = "manifest.json"


class ManifestError(LlamaANEError, ValueError):
    """An export folder whose manifest is missing, of another version, or does not match its files."""


def sha256_path(path: Path) -> str:
    """sha256 of a file, or of a directory as defined in docs/manifest.md (sorted relative paths)."""
    if path.is_file():
        return _sha256_file(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        h.update(rel.encode() + b"\0" + _sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_relative_name(name: str) -> str:
    """Refuse absolute paths and `..` in file names recorded in a manifest."""
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or "\\" in name or not name:
        raise ManifestError(f"manifest file name {name!r} must be a plain relative name inside the export folder")
    return name


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    """Hash every artifact named in `manifest["files"]` (keys) and write OUT/manifest.json."""
    manifest["files"] = {name: sha256_path(out / check_relative_name(name)) for name in sorted(manifest["files"])}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(out: str | Path, check_hashes: bool = True) -> dict[str, Any]:
    """Read and check OUT/manifest.json: version, file names, presence and (optionally) hashes."""
    out = Path(out)
    path = out / MANIFEST
    if not path.is_file():
        hint = " (an export that did not finish leaves no manifest: run `llama-ane export` again)" if out.is_dir() else ""
        raise ManifestError(f"{out} is not a llama-ane export: {MANIFEST} is missing{hint}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path} is not valid JSON ({e})") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ManifestError(f"{path} has format_version {version!r}; this llama-ane reads {FORMAT_VERSION}: "
                            "re-export with this version")
    for name, digest in manifest.get("files", {}).items():
        file = out / check_relative_name(name)
        if not file.exists():
            raise ManifestError(f"{file} is named in the manifest but missing; re-export or restore it")
        if check_hashes and sha256_path(file) != digest:
            raise ManifestError(f"{file} does not match its sha256 in the manifest: it was modified or corrupted; "
                                "re-export it")
    return manifest


def model_names(manifest: dict[str, Any]) -> list[str]:
    """Every model of an export, in pipeline order (an export whose caches are states and that has
    no cascade function has no cache-update model)."""
    return [*manifest["embeddings"]["models"], *(c["model"] for c in manifest["chunks"]),
            *manifest["lm_head"]["models"], *(["cache_update"] if "cache_update" in manifest["models"] else [])]


def kv_cache_kind(manifest: dict[str, Any]) -> str:
    """"inputs" (caches passed in, written by the cache-update model) or "state" (Core ML states
    the chunk functions update themselves)."""
    return manifest["cache"].get("kind", "inputs")


def function_states(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The states a function entry reads and writes ([] for a function without states)."""
    return entry.get("states", [])


def function_entry(manifest: dict[str, Any], model: str, function: str) -> dict[str, Any]:
    """The manifest entry {file, function_name, inputs, outputs} of one function of one model."""
    try:
        return manifest["models"][model]["functions"][function]
    except KeyError:
        raise ManifestError(f"the manifest has no function {function!r} for model {model!r}") from None


def new_manifest(*, name: str, source: dict, config: dict, plan: list[list[int]],
                 embedding_rows: list[tuple[int, int]], head_groups: list[list[int]], specs: dict,
                 context_length: int, prefill_length: int, branch_width: int, suffix_length: int,
                 precision: str, target: str, multifunction: bool, quantization: dict, weights: dict,
                 tokenizer: dict, files: dict[tuple[str, str], tuple[str, str]], created_by: dict,
                 kv_cache: str = "inputs", verify_window: int = 0) -> dict[str, Any]:
    """Assemble a manifest (without hashes; `write_manifest` adds them).

    `quantization` is the compression of each part ({"scheme": "none"} for fp16 weights);
    `weights` the bytes of each model's package as stored and dense.

    `files` maps (model, function) -> (file name, function name inside that file). `kv_cache` is
    how the caches live ("inputs" or "state", see contract/specs.py); a chunk's "cache_update" maps
    each of its functions to the cache-update function that writes its K/V, where there is one.
    """
    from .specs import BRANCHES, FUNCTIONS, VERIFY, cache_update_function, chunk_model_name, embeddings_model_name, \
        lm_head_model_name

    models: dict[str, Any] = {}
    for model, functions in specs.items():
        models[model] = {"functions": {}}
        for fn, io in functions.items():
            file, inner = files.get((model, fn), (None, None))
            models[model]["functions"][fn] = {"file": file, "function_name": inner, **io}
    updates = specs.get("cache_update", {})
    chunks = [{"model": chunk_model_name(i), "layers": layers,
               "cache_update": {fn: cache_update_function(fn, len(layers))
                                for fn in FUNCTIONS + ((BRANCHES,) if branch_width else ())
                                + ((VERIFY,) if verify_window else ())
                                if cache_update_function(fn, len(layers)) in updates}}
              for i, layers in enumerate(plan)]
    lm_outputs = [o for k in range(len(head_groups)) for o in specs[lm_head_model_name(k)]["decode"]["outputs"]]
    return {
        "format_version": FORMAT_VERSION,
        "name": name,
        "created_by": created_by,
        "source": source,
        "config": config,
        "context_length": context_length,
        "prefill_length": prefill_length,
        "branch_width": branch_width,
        "suffix_length": suffix_length,
        "verify_window": verify_window,
        "precision": precision,
        "deployment_target": target,
        "multifunction": multifunction,
        "quantization": quantization,
        "weights": weights,
        "cache": {"kind": kv_cache, "layout": "(layers, kv_heads*head_dim, 1, context)",
                  "channels": config["num_key_value_heads"] * config["head_dim"],
                  "dtype": "float16" if precision == "fp16" else "float32"},
        "embeddings": {"models": [embeddings_model_name(k) for k in range(len(embedding_rows))],
                       "vocab_ranges": [list(r) for r in embedding_rows]},
        "lm_head": {"models": [lm_head_model_name(k) for k in range(len(head_groups))],
                    "vocab_splits": [o["shape"][1] for o in lm_outputs]},
        "chunks": chunks,
        "models": models,
        "tokenizer": tokenizer,
        "files": sorted({f for f, _ in files.values() if f} | set(tokenizer.get("files", []))),
    }
