"""manifest.json: writing, reading, hashing and checking (the contract is docs/manifest.md)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

from ..errors import LlamaANEError
from ..model import names as N
from ..precision import PRECISIONS
from .schema import schema_problem

FORMAT_VERSION = 2
# format_version 4: an export whose prefill functions also decode (manifest "decode_function"), whose
# embeddings take each row's position and whose masks the host makes; written so only by such
# exports, so that readers from before it (the Swift host among them) refuse them by their version
# instead of looking for decode functions. 3 was the same with masks made by the embeddings.
PREFILL_DECODES_VERSION = 4
READ_VERSIONS = (FORMAT_VERSION, PREFILL_DECODES_VERSION)
RETIRED_VERSIONS = {3: "an export whose prefill window decoded, with masks the embeddings made"}
MANIFEST = "manifest.json"


class ManifestError(LlamaANEError, ValueError):
    """An export folder whose manifest is missing, of another version, or does not match its files."""


_HASHES: dict[str, tuple[tuple, str]] = {}
_HASHES_LOCK = threading.Lock()
_TYPE_WORDS = {"list": "a list", "str": "a string", "int": "a number", "float": "a number", "bool": "true or false"}
# what a manifest that does not hold together is told to do
REEXPORT = "the manifest was edited or damaged: re-export the model with `llama-ane export`"


def _signature(path: Path) -> tuple:
    """What changes when any byte of a file or of a directory's files changes: each file's relative
    path, size, inode and modification and change times (ctime moves on every write and cannot be
    set back, so a rewrite that restores the mtime still shows)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    out = []
    for f in files:
        st = f.stat()
        out.append((f.relative_to(path).as_posix() if f != path else "", st.st_size, st.st_ino, st.st_mtime_ns,
                    st.st_ctime_ns))
    return tuple(out)


def sha256_path(path: Path) -> str:
    """sha256 of a file, or of a directory as defined in docs/manifest.md (sorted relative paths).

    Computed once per process for a file or folder in one state: loading an export again (a
    backend, a draft model, `verify` after `load`) reads the stat of its files, not their bytes."""
    key = str(Path(path).resolve())
    signature = _signature(path)
    with _HASHES_LOCK:
        cached = _HASHES.get(key)
    if cached is not None and cached[0] == signature:
        return cached[1]
    if path.is_file():
        digest = _sha256_file(path)
    else:
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            rel = f.relative_to(path).as_posix()
            h.update(rel.encode() + b"\0" + _sha256_file(f).encode() + b"\n")
        digest = h.hexdigest()
    with _HASHES_LOCK:
        _HASHES[key] = (signature, digest)
    return digest


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_relative_name(name: str, field: str = "files") -> str:
    """Refuse absolute paths, `..`, backslashes and empty names among the file names of a manifest."""
    p = PurePosixPath(name)
    if not isinstance(name, str) or not name or p.is_absolute() or ".." in p.parts or "\\" in name \
            or name.startswith("~"):
        raise ManifestError(f"{MANIFEST}: {field} names {name!r}, which is not a plain relative name inside the "
                            f"export folder (absolute paths, '..' and backslashes are refused); {REEXPORT}")
    return name


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    """Hash every artifact named in `manifest["files"]` (keys) and write OUT/manifest.json."""
    manifest["files"] = {name: sha256_path(out / check_relative_name(name)) for name in sorted(manifest["files"])}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def referenced_files(manifest: dict[str, Any]) -> dict[str, str]:
    """Every file a manifest names outside its `files` map -> the first field that names it:
    each function's package and the tokenizer's files."""
    found: dict[str, str] = {}
    for model, entry in manifest["models"].items():
        for fn, f in entry["functions"].items():
            found.setdefault(f["file"], f"models.{model}.functions.{fn}.file")
    for i, name in enumerate(manifest["tokenizer"]["files"]):
        found.setdefault(name, f"tokenizer.files[{i}]")
    return found


def _check_inside(out: Path, name: str, field: str) -> Path:
    """`out/name`, refused where it or (for a folder) anything in it is a link leading outside `out`."""
    root = out.resolve()
    path = out / name
    escapes = [path] if not path.resolve().is_relative_to(root) else []
    if path.is_dir() and not escapes:
        for folder, dirs, files in os.walk(path):
            escapes += [Path(folder) / n for n in dirs + files
                        if (Path(folder) / n).is_symlink() and not (Path(folder) / n).resolve().is_relative_to(root)]
    if escapes:
        raise ManifestError(f"{MANIFEST}: {field} names {name!r}, but {escapes[0]} is a link to "
                            f"{escapes[0].resolve()}, outside the export folder; copy the real files into the export "
                            "or re-export the model")
    return path


def _check_version(manifest: Any) -> None:
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version not in READ_VERSIONS:
        if version in RETIRED_VERSIONS:
            raise ManifestError(f"{MANIFEST}: format_version {version} ({RETIRED_VERSIONS[version]}) is no longer "
                                f"read; re-export the model with `llama-ane export` (format_version "
                                f"{PREFILL_DECODES_VERSION})")
        if version < FORMAT_VERSION:
            raise ManifestError(f"{MANIFEST}: format_version {version} comes from an older llama-ane; this one "
                                f"reads format_version {FORMAT_VERSION} and {PREFILL_DECODES_VERSION}: re-export the "
                                "model with `llama-ane export`")
        raise ManifestError(f"{MANIFEST}: format_version {version} comes from a newer llama-ane; this one reads "
                            f"format_version {FORMAT_VERSION} and {PREFILL_DECODES_VERSION}: upgrade llama-ane, or "
                            "re-export the model with this one")
    if version == PREFILL_DECODES_VERSION and manifest.get("decode_function") != "prefill":
        raise ManifestError(f"{MANIFEST}: format_version {version} is written only with decode_function \"prefill\", "
                            f"but it has {manifest.get('decode_function')!r}; {REEXPORT}")


def _check_references(manifest: dict[str, Any]) -> None:
    """The sections name models and functions that exist, and the chunks hold every layer once."""
    models = manifest["models"]
    named = [(f"embeddings.models[{i}]", m) for i, m in enumerate(manifest["embeddings"]["models"])] \
        + [(f"lm_head.models[{i}]", m) for i, m in enumerate(manifest["lm_head"]["models"])] \
        + [(f"chunks[{i}].model", c["model"]) for i, c in enumerate(manifest["chunks"])]
    for field, model in named:
        if model not in models:
            raise ManifestError(f"{MANIFEST}: {field} names the model {model!r}, which models does not hold; "
                                + REEXPORT)
    updates = models.get("cache_update", {}).get("functions", {})
    for i, chunk in enumerate(manifest["chunks"]):
        for phase, fn in chunk.get("cache_update", {}).items():
            if fn not in updates:
                raise ManifestError(f"{MANIFEST}: chunks[{i}].cache_update.{phase} names {fn!r}, which is not a "
                                    f"function of models.cache_update; {REEXPORT}")
    layers = sorted(layer for c in manifest["chunks"] for layer in c["layers"])
    if layers != list(range(manifest["config"]["num_hidden_layers"])):
        raise ManifestError(f"{MANIFEST}: chunks hold layers {layers}, not each of 0..{manifest['config']['num_hidden_layers'] - 1} "
                            f"(config.num_hidden_layers) once; {REEXPORT}")
    folded = manifest["lm_head"].get("folded_into")
    if folded is not None and folded != manifest["chunks"][-1]["model"]:
        raise ManifestError(f"{MANIFEST}: lm_head.folded_into names {folded!r}, not the last chunk "
                            f"{manifest['chunks'][-1]['model']!r}; {REEXPORT}")
    if (folded is None) == (not manifest["lm_head"]["models"]):
        raise ManifestError(f"{MANIFEST}: lm_head has " + ("both models and folded_into" if folded else
                            "neither models nor folded_into") + f"; {REEXPORT}")
    if sum(manifest["lm_head"]["vocab_splits"]) != manifest["config"]["vocab_size"]:
        raise ManifestError(f"{MANIFEST}: lm_head.vocab_splits {manifest['lm_head']['vocab_splits']} do not add up to "
                            f"config.vocab_size {manifest['config']['vocab_size']}; {REEXPORT}")


CACHE_TENSORS = (N.K_CACHE, N.V_CACHE, N.K_CACHE_OUT, N.V_CACHE_OUT)
RING_TENSORS = (N.K_RING, N.V_RING, N.updated(N.K_RING), N.updated(N.V_RING))


def ring_of(manifest: dict[str, Any]) -> int:
    """Slots of the sliding layers' ring buffer (manifest cache.sliding.length), 0 where there is none."""
    return manifest["cache"].get("sliding", {}).get("length", 0)


def ring_channels(manifest: dict[str, Any]) -> int:
    """Channels of the ring buffer's K/V (cache.sliding.channels, else cache.channels)."""
    return manifest["cache"].get("sliding", {}).get("channels", manifest["cache"]["channels"])


def _check_cache_shapes(manifest: dict[str, Any]) -> None:
    """Every K/V cache tensor holds its function's context bucket (a state: the whole context) of
    cache.channels channels, as the packages were built for (their own shapes are compared where
    they are opened); the buckets ascend to context_length."""
    from .specs import bucket_of

    context, channels, ring = manifest["context_length"], manifest["cache"]["channels"], ring_of(manifest)
    for model, entry in manifest["models"].items():
        for fn, f in entry["functions"].items():
            bucket = bucket_of(fn, context)
            for kind in ("inputs", "outputs", "states"):
                for i, t in enumerate(f.get(kind, [])):
                    if t["name"] not in CACHE_TENSORS + RING_TENSORS or len(t["shape"]) != 4:
                        continue
                    if t["name"] in RING_TENSORS:
                        want, given = [t["shape"][0], ring_channels(manifest), 1, ring], \
                            f"cache.sliding.length {ring} and channels"
                    else:
                        want = [t["shape"][0], channels, 1, cache_length(manifest) if kind == "states" else bucket]
                        given = f"context_length {context}"
                    if t["shape"] != want or not want[-1]:
                        raise ManifestError(
                            f"{MANIFEST}: models.{model}.functions.{fn}.{kind}[{i}] {t['name']!r} of {f['file']} "
                            f"has shape {t['shape']}, but {given} and cache.channels {channels} give "
                            f"{want}; {REEXPORT}")
    reads_ring = any(t["name"] in RING_TENSORS for entry in manifest["models"].values()
                     for f in entry["functions"].values() for kind in ("inputs", "states") for t in f.get(kind, []))
    if ring and not reads_ring:
        raise ManifestError(f"{MANIFEST}: cache.sliding names a ring buffer of {ring} positions, but no chunk "
                            f"function reads one (k_ring); {REEXPORT}")
    _check_conv_shapes(manifest)
    _check_delta_shapes(manifest)
    buckets = context_buckets(manifest)
    if buckets != sorted(set(buckets)) or buckets[-1] != context:
        raise ManifestError(f"{MANIFEST}: context_buckets {buckets} must ascend to context_length {context}; "
                            f"{REEXPORT}")


def _tensors_named(manifest: dict[str, Any], names: tuple[str, ...], kinds: tuple[str, ...]):
    """Every function tensor called one of `names` among its `kinds` ("inputs", "states",
    "outputs"), with where it is ("models.chunk_0.functions.decode.inputs[5]")."""
    for model, entry in manifest["models"].items():
        for fn, f in entry["functions"].items():
            for kind in kinds:
                for i, t in enumerate(f.get(kind, [])):
                    if t["name"] in names:
                        yield f"models.{model}.functions.{fn}.{kind}[{i}]", t


def _check_conv_shapes(manifest: dict[str, Any]) -> None:
    """Every conv state tensor is (layers, cache.conv.channels, 1, cache.conv.width), and there
    is one exactly where cache.conv says the export has conv layers."""
    conv = manifest["cache"].get("conv")
    read = False
    for where, t in _tensors_named(manifest, (N.CONV_STATE,), ("inputs", "states")):
        read = True
        if conv is None:
            raise ManifestError(f"{MANIFEST}: {where} reads a conv state (conv_state), but there is no cache.conv; "
                                f"{REEXPORT}")
        want = [t["shape"][0], conv["channels"], 1, conv["width"]]
        if t["shape"] != want or conv["width"] < conv["kernel"] - 1:
            raise ManifestError(
                f"{MANIFEST}: {where} 'conv_state' has shape {t['shape']}, but cache.conv (channels "
                f"{conv['channels']}, width {conv['width']}, at least kernel {conv['kernel']} - 1) gives {want}; "
                f"{REEXPORT}")
    if conv is not None and not read:
        raise ManifestError(f"{MANIFEST}: cache.conv names conv layers {conv['layers']}, but no chunk function "
                            f"reads their state (conv_state); {REEXPORT}")


def _check_delta_shapes(manifest: dict[str, Any]) -> None:
    """Every linear-attention state tensor (delta_state, delta_new, delta_branches) is (rows,
    cache.delta.heads * key_dim, 1, value_dim), and there is one exactly where cache.delta says the
    export has linear-attention layers."""
    from ..model.functions import DELTA_BRANCHES, DELTA_NEW, DELTA_STATE

    delta = manifest["cache"].get("delta")
    read = False
    for where, t in _tensors_named(manifest, (DELTA_STATE, DELTA_NEW, DELTA_BRANCHES), ("inputs", "states", "outputs")):
        read = True
        if delta is None:
            raise ManifestError(f"{MANIFEST}: {where} is a linear-attention state ({t['name']}), but there is no "
                                f"cache.delta; {REEXPORT}")
        want = [t["shape"][0], delta["heads"] * delta["key_dim"], 1, delta["value_dim"]]
        if t["shape"] != want:
            raise ManifestError(
                f"{MANIFEST}: {where} {t['name']!r} has shape {t['shape']}, but cache.delta (heads {delta['heads']}, "
                f"key_dim {delta['key_dim']}, value_dim {delta['value_dim']}) gives {want}; {REEXPORT}")
    if delta is not None and not read:
        raise ManifestError(f"{MANIFEST}: cache.delta names linear-attention layers {delta['layers']}, but no chunk "
                            f"function reads their state ({DELTA_STATE}); {REEXPORT}")


def check_manifest(manifest: Any, out: Path) -> dict[str, Any]:
    """Everything about a manifest that its folder's file names and its own fields can tell: the
    version, the schema (contract/schema.py), every file name a plain relative name that stays
    inside `out` (links included), the `files` map naming every file referenced anywhere, the
    sections naming what exists, and the context length agreeing with the cache shapes."""
    if not isinstance(manifest, dict):
        kind = "null" if manifest is None else _TYPE_WORDS.get(type(manifest).__name__, type(manifest).__name__)
        raise ManifestError(f"{MANIFEST} holds {kind}, not an object; {REEXPORT}")
    _check_version(manifest)
    problem = schema_problem(manifest)
    if problem:
        raise ManifestError(f"{MANIFEST}: {problem}; {REEXPORT}")
    fields = {name: "files" for name in manifest["files"]} | referenced_files(manifest)
    for name, field in fields.items():
        check_relative_name(name, field)
    for name, field in referenced_files(manifest).items():
        if name not in manifest["files"]:
            raise ManifestError(f"{MANIFEST}: files has no sha256 of {name!r}, which {field} names: without it the "
                                f"file could be changed unnoticed; {REEXPORT}")
    _check_references(manifest)
    _check_cache_shapes(manifest)
    for name, field in fields.items():
        _check_inside(out, name, field)
    return manifest


def read_manifest(out: str | Path, check_hashes: bool = True) -> dict[str, Any]:
    """Read and check OUT/manifest.json (`check_manifest`), then that every file in its `files` map
    exists and (unless `check_hashes` is False) has its recorded sha256."""
    out = Path(out)
    path = out / MANIFEST
    if not path.is_file():
        hint = " (an export that did not finish leaves no manifest: run `llama-ane export` again)" if out.is_dir() else ""
        raise ManifestError(f"{out} is not a llama-ane export: {MANIFEST} is missing{hint}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON ({e}); {REEXPORT}") from None
    check_manifest(manifest, out)
    for name, digest in manifest["files"].items():
        file = out / name
        if not file.exists():
            raise ManifestError(f"{file} is named in the manifest but missing; re-export or restore it")
        if check_hashes and sha256_path(file) != digest:
            raise ManifestError(f"{file} does not match its sha256 in the manifest: it was modified or corrupted; "
                                "re-export it")
    return manifest


def check_package_io(manifest: dict[str, Any], file: str,
                     functions: dict[str, tuple[Sequence, Sequence]]) -> None:
    """Compare the I/O a package describes with what the manifest says of every function it holds.

    `functions` maps each function name in the package to its (inputs, outputs) as the package's
    model description declares them: objects with `name`, `shape` and `dtype` (states among the
    inputs). Raises ManifestError naming the function, the tensor and both shapes."""
    for model, entry in manifest["models"].items():
        for fn, f in entry["functions"].items():
            if f["file"] != file:
                continue
            inner = f["function_name"] or "main"
            if inner not in functions:
                raise ManifestError(f"{file} has no function {inner!r} (models.{model}.functions.{fn}); it has "
                                    f"{sorted(functions)}; {REEXPORT}")
            described = {kind: {t.name: t for t in tensors} for kind, tensors in zip(("inputs", "outputs"),
                                                                                     functions[inner])}
            declared = {"inputs": f["inputs"] + f.get("states", []), "outputs": f["outputs"]}
            for kind in ("inputs", "outputs"):
                for t in declared[kind]:
                    actual = described[kind].get(t["name"])
                    where = f"{file} ({model}/{fn}) {kind[:-1]} {t['name']!r}"
                    if actual is None:
                        raise ManifestError(f"{where} named in {MANIFEST} is not in the package, which has "
                                            f"{sorted(described[kind])}; {REEXPORT}")
                    if list(actual.shape) != t["shape"] or actual.dtype != t["dtype"]:
                        raise ManifestError(f"{where} is {actual.dtype}{list(actual.shape)} in the package but "
                                            f"{t['dtype']}{t['shape']} in {MANIFEST}; {REEXPORT}")


def model_names(manifest: dict[str, Any]) -> list[str]:
    """Every model of an export, in pipeline order (an export whose caches are states and that has
    no cascade function has no cache-update model)."""
    return [*manifest["embeddings"]["models"], *(c["model"] for c in manifest["chunks"]),
            *manifest["lm_head"]["models"], *(["cache_update"] if "cache_update" in manifest["models"] else [])]


def context_buckets(manifest: dict[str, Any]) -> list[int]:
    """The context buckets of an export, ascending to its context length (one for older exports)."""
    return list(manifest.get("context_buckets") or [manifest["context_length"]])


def kv_cache_kind(manifest: dict[str, Any]) -> str:
    """"inputs" (caches passed in, written by the cache-update model) or "state" (Core ML states
    the chunk functions update themselves)."""
    return manifest["cache"].get("kind", "inputs")


def function_states(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The states a function entry reads and writes ([] for a function without states)."""
    return entry.get("states", [])


def decode_function(manifest: dict[str, Any]) -> str:
    """The function a decoded token runs, before its bucket: "decode", or "prefill" for an export
    whose prefill functions decode too (model.functions.DECODE_FUNCTIONS)."""
    return manifest.get("decode_function", "decode")


def cache_length(manifest: dict[str, Any]) -> int:
    """Columns of a state cache of the whole context: the context, with room for a window's padding
    where tokens run the prefill window (model.functions.state_length)."""
    from .specs import state_length

    return state_length(manifest["context_length"], manifest["prefill_length"], kv_cache_kind(manifest),
                        decode_function(manifest))


def window_cascade(manifest: dict[str, Any]) -> bool:
    """Whether the cascade steps through the prefill window (model.functions.cascades_in_window):
    manifest "cascade" "window"."""
    return manifest.get("cascade") == "window"


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
                 kv_cache: str = "inputs", verify_window: int = 0,
                 context_buckets: list[int] | None = None, head_folded_into: str | None = None,
                 decode_function: str = "decode") -> dict[str, Any]:
    """Assemble a manifest (without hashes; `write_manifest` adds them).

    `quantization` is the compression of each part ({"scheme": "none"} for fp16 weights);
    `weights` the bytes of each model's package as stored and dense.

    `files` maps (model, function) -> (file name, function name inside that file). `kv_cache` is
    how the caches live ("inputs" or "state", see contract/specs.py); a chunk's "cache_update" maps
    each of its functions to the cache-update function that writes its K/V, where there is one.
    `head_folded_into` names the chunk that carries the LM head (then there is no LM head model).
    `decode_function` "prefill": the export has no decode functions (recorded, with format_version 4,
    which older readers refuse), and "cascade" "window" where its cascade steps through the prefill window.
    """
    from ..config import LlamaConfig
    from .specs import (BRANCHES, cache_update_function, cascades_in_window, chunk_model_name, chunk_rows, conv_state_width,
                        embeddings_model_name, lm_head_model_name, ring_length, suffix_update_counts)

    cfg = LlamaConfig.from_dict(config)
    ring = ring_length(cfg, context_length, prefill_length)

    models: dict[str, Any] = {}
    for model, functions in specs.items():
        models[model] = {"functions": {}}
        for fn, io in functions.items():
            file, inner = files.get((model, fn), (None, None))
            models[model]["functions"][fn] = {"file": file, "function_name": inner, **io}
    updates = specs.get("cache_update", {})
    chunks = []
    for i, layers in enumerate(plan):
        counts = [len(rows) for rows in chunk_rows(cfg, layers, ring)]  # in the full cache, in the ring
        names = {fn: cache_update_function(fn, *(suffix_update_counts(cfg, layers, ring) if fn == BRANCHES else counts))
                 for fn in specs[chunk_model_name(i)]}
        chunks.append({"model": chunk_model_name(i), "layers": layers,
                       "cache_update": {fn: name for fn, name in names.items() if name in updates}})
    lm_outputs = ([o for o in specs[head_folded_into][decode_function]["outputs"] if N.logits_split(o["name"]) is not None]
                  if head_folded_into else
                  [o for k in range(len(head_groups)) for o in specs[lm_head_model_name(k)][decode_function]["outputs"]])
    return {
        "format_version": FORMAT_VERSION if decode_function == "decode" else PREFILL_DECODES_VERSION,
        **({"decode_function": decode_function} if decode_function != "decode" else {}),
        **({"cascade": "window"} if cascades_in_window(cfg, decode_function, branch_width, ring, prefill_length) else {}),
        "name": name,
        "created_by": created_by,
        "source": source,
        "config": config,
        "context_length": context_length,
        "prefill_length": prefill_length,
        "branch_width": branch_width,
        "suffix_length": suffix_length,
        "verify_window": verify_window,
        "context_buckets": context_buckets or [context_length],
        "precision": precision,
        "deployment_target": target,
        "multifunction": multifunction,
        "quantization": quantization,
        "weights": weights,
        "cache": {"kind": kv_cache, "layout": "(layers, kv_heads*head_dim, 1, context)",
                  "channels": cfg.global_layers.kv_channels,
                  "dtype": PRECISIONS[precision].dtype,
                  # the sliding layers' ring buffer: (their layers in a chunk, channels, 1, length), its
                  # channels given where they are not cache.channels (Gemma 4's wider global layers)
                  **({"sliding": {"length": ring, "layers": [n for n in cfg.sliding_layers if not cfg.shares_kv(n)],
                                  **({"channels": cfg.kv_channels} if cfg.wide_global else {})}} if ring else {}),
                  # the conv layers' state: (their layers in a chunk, channels, 1, width), any context; its
                  # last kernel - 1 columns hold the values (Qwen3.5's linear-attention layers convolve too)
                  **({"conv": {"layers": [n for n in range(cfg.num_hidden_layers) if cfg.convolves(n)],
                               "channels": cfg.conv_channels, "kernel": cfg.conv_kernel,
                               "width": conv_state_width(cfg)}} if cfg.conv_layers or cfg.recurrent_layers else {}),
                  # the linear-attention layers' recurrent state: (their layers in a chunk, heads*key_dim, 1,
                  # value_dim), any context (Falcon-H1's Mamba-2 mixers': heads*state_size, 1, head_dim)
                  **({"delta": {"layers": cfg.recurrent_layers, "heads": cfg.delta_value_heads,
                                "key_dim": cfg.delta_key_dim, "value_dim": cfg.delta_value_dim}}
                     if cfg.recurrent_layers else {})},
        "embeddings": {"models": [embeddings_model_name(k) for k in range(len(embedding_rows))],
                       "vocab_ranges": [list(r) for r in embedding_rows]},
        "lm_head": {"models": [] if head_folded_into else [lm_head_model_name(k) for k in range(len(head_groups))],
                    "vocab_splits": [o["shape"][1] for o in lm_outputs],
                    **({"folded_into": head_folded_into} if head_folded_into else {})},
        "chunks": chunks,
        "models": models,
        "tokenizer": tokenizer,
        "files": sorted({f for f, _ in files.values() if f} | set(tokenizer.get("files", []))),
    }
