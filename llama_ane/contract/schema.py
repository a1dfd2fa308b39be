"""The shape of manifest.json as a JSON Schema (docs/manifest.md is its prose), and the check that
turns the first violation into one ManifestError naming the field.

The schema holds what a reader indexes without looking first: required sections, their types and
the ranges of the sizes. What ties fields to each other (paths inside the export, the `files`
map covering every file, the context length in the cache shapes) is checked in `manifest.py`,
which runs this first so that those checks read a manifest of the right shape.
"""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator, ValidationError

_INT = {"type": "integer"}
_COUNT = {"type": "integer", "minimum": 0}
_SIZE = {"type": "integer", "minimum": 1}
_NAME = {"type": "string", "minLength": 1}
# a file of the export; `manifest.py` checks that it stays inside the folder
_FILE = {"type": "string", "minLength": 1}
_INT_OR_NULL = {"type": ["integer", "null"]}
_TENSOR = {
    "type": "object",
    "required": ["name", "shape", "dtype"],
    "properties": {
        "name": _NAME,
        "shape": {"type": "array", "items": _SIZE},
        "dtype": {"enum": ["float16", "float32", "int32"]},
    },
}
_TENSORS = {"type": "array", "items": _TENSOR}
_FUNCTION = {
    "type": "object",
    "required": ["file", "function_name", "inputs", "outputs"],
    "properties": {"file": _FILE, "function_name": _NAME, "inputs": _TENSORS, "outputs": _TENSORS,
                   "states": _TENSORS},
}
_MODEL_LIST = {"type": "array", "minItems": 1, "items": _NAME}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["format_version", "name", "created_by", "source", "config", "context_length", "prefill_length",
                 "branch_width", "suffix_length", "precision", "deployment_target", "multifunction", "cache",
                 "embeddings", "lm_head", "chunks", "models", "tokenizer", "files"],
    "properties": {
        "format_version": _INT,
        "decode_function": {"enum": ["decode", "prefill"]},
        "cascade": {"enum": ["function", "window"]},
        "name": {"type": "string"},
        "created_by": {"type": "object", "additionalProperties": {"type": "string"}},
        # provenance: the checkpoint the export came from, outside the export by design (only
        # `verify` reads it, and only when asked to compare against it)
        "source": {"type": "object", "required": ["kind"],
                   "properties": {"kind": {"enum": ["default", "hf", "gguf"]}, "path": {"type": ["string", "null"]}}},
        "config": {
            "type": "object",
            "required": ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "head_dim"],
            "properties": {k: _SIZE for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads", "head_dim")}
            | {"rms_norm_eps": {"type": "number"}, "rope_theta": {"type": "number"},
               "max_position_embeddings": _SIZE, "model_type": {"type": "string"},
               "bos_token_id": _INT_OR_NULL,
               "eos_token_id": {"anyOf": [_INT, {"type": "array", "items": _INT}, {"type": "null"}]}},
        },
        "context_length": _SIZE,
        "prefill_length": _SIZE,
        "branch_width": _COUNT,
        "suffix_length": _COUNT,
        "verify_window": _COUNT,
        "context_buckets": {"type": "array", "minItems": 1, "items": _SIZE},
        "precision": {"enum": ["fp16", "fp32"]},
        "deployment_target": _NAME,
        "multifunction": {"type": "boolean"},
        "quantization": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["scheme"], "properties": {"scheme": _NAME}}},
        "weights": {"type": "object", "additionalProperties": {
            "type": "object", "properties": {"bytes": _COUNT, "dense_bytes": _COUNT}}},
        "cache": {"type": "object", "required": ["layout", "channels", "dtype"],
                  "properties": {"kind": {"enum": ["inputs", "state"]}, "layout": {"type": "string"},
                                 "channels": _SIZE, "dtype": {"enum": ["float16", "float32"]},
                                 "sliding": {"type": "object", "required": ["length", "layers"],
                                             "properties": {"length": _SIZE, "channels": _SIZE, "layers": {
                                                 "type": "array", "minItems": 1, "items": _COUNT}}},
                                 "conv": {"type": "object", "required": ["layers", "channels", "kernel", "width"],
                                          "properties": {"layers": {"type": "array", "minItems": 1,
                                                                    "items": _COUNT},
                                                         "channels": _SIZE, "kernel": _SIZE, "width": _SIZE}},
                                 "delta": {"type": "object", "required": ["layers", "heads", "key_dim", "value_dim"],
                                           "properties": {"layers": {"type": "array", "minItems": 1,
                                                                     "items": _COUNT},
                                                          "heads": _SIZE, "key_dim": _SIZE, "value_dim": _SIZE}}}},
        "embeddings": {"type": "object", "required": ["models", "vocab_ranges"],
                       "properties": {"models": _MODEL_LIST, "vocab_ranges": {
                           "type": "array", "items": {"type": "array", "items": _COUNT,
                                                      "minItems": 2, "maxItems": 2}}}},
        "lm_head": {"type": "object", "required": ["models", "vocab_splits"],
                    "properties": {"models": {"type": "array", "items": _NAME}, "folded_into": _NAME,
                                   "vocab_splits": {"type": "array", "minItems": 1, "items": _SIZE}}},
        "chunks": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["model", "layers"],
            "properties": {"model": _NAME, "layers": {"type": "array", "minItems": 1, "items": _COUNT},
                           "cache_update": {"type": "object", "additionalProperties": _NAME}}}},
        "models": {"type": "object", "minProperties": 1, "additionalProperties": {
            "type": "object", "required": ["functions"],
            "properties": {"functions": {"type": "object", "minProperties": 1, "additionalProperties": _FUNCTION}}}},
        "tokenizer": {"type": "object", "required": ["files", "eos_token_ids"],
                      "properties": {"files": {"type": "array", "items": _FILE},
                                     "bos_token_id": _INT_OR_NULL,
                                     "eos_token_ids": {"type": "array", "items": _INT},
                                     "add_bos_token": {"type": "boolean"},
                                     "chat_template": {"type": ["string", "null"]},
                                     "special_tokens": {"type": "object", "additionalProperties": _INT}}},
        # artifact -> sha256 hex; the hashes are what make an edited package or tokenizer fail to load
        "files": {"type": "object", "minProperties": 1,
                  "additionalProperties": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
    },
}

_VALIDATOR = Draft202012Validator(SCHEMA)
_TYPE_WORDS = {"object": "an object", "array": "a list", "string": "a string", "integer": "an integer",
               "number": "a number", "boolean": "true or false", "null": "null"}


def field_path(parts) -> str:
    """`models.chunk_0.functions.decode.inputs[4].shape`: dotted keys, list indices in brackets."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "the manifest"


def _requirement(error: ValidationError) -> str:
    """What the violated keyword asks for, in words."""
    v, value = error.validator, error.validator_value
    if v == "type":
        kinds = [value] if isinstance(value, str) else value
        return "must be " + " or ".join(_TYPE_WORDS.get(k, k) for k in kinds) + f", not {error.instance!r:.60}"
    if v == "enum":
        return f"must be one of {', '.join(map(repr, value))}, not {error.instance!r:.60}"
    if v == "minimum":
        return f"must be at least {value}, not {error.instance!r}"
    if v in ("minItems", "minProperties"):
        return "must not be empty" if value == 1 else f"needs at least {value} entries"
    if v == "maxItems":
        return f"has more than {value} entries"
    if v == "minLength":
        return "must not be empty"
    if v == "pattern":
        return f"must be a sha256 hex digest (64 lowercase hex digits), not {error.instance!r:.60}"
    return error.message


def schema_problem(manifest: Any) -> str | None:
    """The first schema violation as "<field> <what it must be>", or None. The shallowest comes
    first, so a missing section is named before what is wrong inside another."""
    errors = sorted(_VALIDATOR.iter_errors(manifest), key=lambda e: (len(e.absolute_path), field_path(e.absolute_path)))
    if not errors:
        return None
    e = errors[0]
    if e.validator == "required":  # name the missing field itself
        missing = next(k for k in e.validator_value if k not in e.instance)
        return f"{field_path([*e.absolute_path, missing])} is missing"
    return f"{field_path(e.absolute_path)} {_requirement(e)}"
